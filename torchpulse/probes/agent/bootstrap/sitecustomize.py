"""torchpulse bootstrap, on PYTHONPATH because `torchpulse run` put it there.

It first runs the sitecustomize this one shadows, then waits for the program
to import torch and attaches the agent right after. Processes that never
import torch pay for one import-hook lookup and nothing else.
"""

import os
import sys

# Every Python process under `torchpulse run` imports this file: no `typing` import at run time,
# and any Python 3 must run it silently (Python 3.6 is RHEL 8's /usr/bin/python3, which jobs call).
# Python 2 (CentOS 7's /usr/bin/python, which tools a job starts may be) must at least parse it, or it
# prints "'import sitecustomize' failed" and skips the sitecustomize this file shadows: no annotations
# (type comments instead), no f-strings, and no Python 3 import outside the Python 3 branch.
if sys.version_info[0] >= 3:  # noqa: UP036  (Python 2 reads this file too)
    import importlib.machinery
    import importlib.util

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence  # noqa: F401  (used in type comments)
    from multiprocessing.process import BaseProcess  # noqa: F401
    from types import ModuleType  # noqa: F401

_HERE = os.path.dirname(os.path.abspath(__file__))
# Set in this module's namespace before it runs when another torchpulse bootstrap (a second
# install, nested `torchpulse run`s) chained to it: every bootstrap directory already passed.
# Without it two bootstraps on PYTHONPATH would chain to each other until RecursionError,
# and the user's own sitecustomize would never run.
_CHAINED_FROM = tuple(globals().get("_torchpulse_chained_from", ()))  # type: tuple[str, ...]


def _chain_on_python2():  # type: () -> None
    """Python 2 gets no agent, but the sitecustomize this file shadows runs: imported again without this directory.

    The directory stays off sys.path, where it would not be without `torchpulse run`. A second bootstrap
    further on does the same, so the chain ends; Python 2's import returns what sys.modules holds then.
    """
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    del sys.modules["sitecustomize"]
    try:  # noqa: SIM105  (no contextlib.suppress on Python 2)
        __import__("sitecustomize")
    except ImportError:  # what Python 2's site module does with it too
        pass


def _chain_to_shadowed_sitecustomize():  # type: () -> None
    skip = set(_CHAINED_FROM) | {_HERE}
    paths = [p for p in sys.path if os.path.abspath(p or os.curdir) not in skip]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", paths)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    module.__dict__["_torchpulse_chained_from"] = tuple(skip)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


def _should_attach():  # type: () -> bool
    # Inductor's compile workers (`python -m torch._inductor.compile_worker`, argv[0] its
    # __main__.py path) import torch but never train; a user script merely named so does.
    argv = " ".join(sys.argv[:2]).replace(os.sep, ".")
    return "_inductor.compile_worker" not in argv


def _attach():  # type: () -> None
    try:
        if not _should_attach():
            return
        if _starting_multiprocessing_child() and _attach_when_started():
            return
    except Exception as exc:
        sys.stderr.write("torchpulse: agent not attached: " + repr(exc) + "\n")
        return
    _attach_now()


def _attach_now():  # type: () -> None
    try:
        import torchpulse

        torchpulse.attach()
    except Exception as exc:  # the job must start even if the agent cannot
        sys.stderr.write("torchpulse: agent not attached: " + repr(exc) + "\n")


# Modules whose functions, as a multiprocessing child's target, never train: the child gets no agent
# (it would never connect, but would carry the hooks and a thread). DataLoader workers (torch's, and
# torchdata's StatefulDataLoader), and the saver process of DCP's process-based async_save.
NON_TRAINING_TARGET_MODULES = (
    "torch.utils.data._utils.worker",
    "torchdata.stateful_dataloader.worker",
    "torch.distributed.checkpoint._async_process_executor",
)


def _starting_multiprocessing_child():  # type: () -> bool
    """True in a spawn or forkserver child that imports torch while it unpickles its main module or target.

    Such a child is a DataLoader worker, which never trains, or a rank of `torch.multiprocessing.spawn`;
    which one shows only once it starts its target.
    """
    process = sys.modules.get("multiprocessing.process")
    return process is not None and bool(getattr(process.current_process(), "_inheriting", False))


def _attach_when_started():  # type: () -> bool
    """Attach as this child starts its target, unless that is a DataLoader worker's loop; False: attach now.

    BaseProcess._bootstrap is where the child first has its process object; it is wrapped once,
    in this process only, and put back at its first call. (`multiprocessing.util.register_after_fork`
    callbacks never run in a spawn child: SpawnProcess._after_fork does nothing.)
    """
    from multiprocessing.process import BaseProcess

    original = BaseProcess.__dict__.get("_bootstrap")
    if original is None:
        return False

    def bootstrap_then_attach(self, *args, **kwargs):  # type: (BaseProcess, *object, **object) -> object
        BaseProcess._bootstrap = original  # type: ignore[attr-defined]
        target = getattr(self, "_target", None)
        # A DataLoader worker never trains: like a forked one, it gets no agent; nor DCP's saver process.
        if getattr(target, "__module__", None) not in NON_TRAINING_TARGET_MODULES:
            _attach_now()
        return original(self, *args, **kwargs)

    BaseProcess._bootstrap = bootstrap_then_attach  # type: ignore[attr-defined]
    return True


class _AttachAfterTorch:
    """Meta-path finder that wraps torch's loader to attach once torch finished importing.

    It stays until torch has run: `importlib.util.find_spec("torch")` alone, which is how
    transformers, accelerate and Lightning check that torch is installed, imports nothing.
    """

    def __init__(self):  # type: () -> None
        self.attached = False

    def find_spec(self, name, path=None, target=None):
        # type: (str, Sequence[str] | None, ModuleType | None) -> importlib.machinery.ModuleSpec | None
        if name != "torch" or self.attached:
            return None
        spec = self._spec_from_later_finders(name, path, target)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original_exec = loader.exec_module

        def exec_then_attach(module):  # type: (ModuleType) -> None
            original_exec(module)
            if not self.attached:
                self.attached = True
                if self in sys.meta_path:
                    sys.meta_path.remove(self)
                _attach()

        loader.exec_module = exec_then_attach  # type: ignore[method-assign]
        return spec

    def _spec_from_later_finders(self, name, path, target):
        # type: (str, Sequence[str] | None, ModuleType | None) -> importlib.machinery.ModuleSpec | None
        """What the import system would find for `name` without this finder (it never asks this one again)."""
        finders = sys.meta_path
        if self in finders:
            finders = finders[finders.index(self) + 1 :]
        for finder in finders:
            find_spec = getattr(finder, "find_spec", None)
            spec = find_spec(name, path, target) if find_spec is not None else None
            if spec is not None:
                return spec  # type: ignore[no-any-return]
        return None


if sys.version_info[0] < 3:  # noqa: UP036
    _chain_on_python2()
else:
    try:
        _chain_to_shadowed_sitecustomize()
    finally:
        # A chained bootstrap leaves attaching to the first one, which runs this after it returns.
        if os.environ.get("TORCHPULSE_BOOTSTRAP") == "1" and not _CHAINED_FROM:
            if "torch" in sys.modules:
                # The shadowed sitecustomize imported torch itself: there is no later import to wait for.
                _attach()
            else:
                sys.meta_path.insert(0, _AttachAfterTorch())
