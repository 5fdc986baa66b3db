"""torchpulse bootstrap, on PYTHONPATH because `torchpulse run` put it there.

It first runs the sitecustomize this one shadows, then waits for the program
to import torch and attaches the agent right after. Processes that never
import torch pay for one import-hook lookup and nothing else.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

# Every Python process under `torchpulse run` imports this file: no `typing` import at run time.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import ModuleType
    from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
# Set in this module's namespace before it runs when another torchpulse bootstrap (a second
# install, nested `torchpulse run`s) chained to it: every bootstrap directory already passed.
# Without it two bootstraps on PYTHONPATH would chain to each other until RecursionError,
# and the user's own sitecustomize would never run.
_CHAINED_FROM: tuple[str, ...] = globals().get("_torchpulse_chained_from", ())


def _chain_to_shadowed_sitecustomize() -> None:
    skip = {*_CHAINED_FROM, _HERE}
    paths = [p for p in sys.path if os.path.abspath(p or os.curdir) not in skip]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", paths)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    module.__dict__["_torchpulse_chained_from"] = tuple(skip)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


def _should_attach() -> bool:
    # Inductor's compile workers (`python -m torch._inductor.compile_worker`, argv[0] its
    # __main__.py path) import torch but never train; a user script merely named so does.
    argv = " ".join(sys.argv[:2]).replace(os.sep, ".")
    return "_inductor.compile_worker" not in argv


def _attach() -> None:
    try:
        if not _should_attach():
            return
        import torchpulse

        torchpulse.attach()
    except Exception as exc:  # the job must start even if the agent cannot
        sys.stderr.write(f"torchpulse: agent not attached: {exc!r}\n")


class _AttachAfterTorch:
    """Meta-path finder that wraps torch's loader to attach once torch finished importing."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_then_attach(module: ModuleType) -> None:
            original_exec(module)
            _attach()

        loader.exec_module = exec_then_attach  # type: ignore[method-assign]
        return spec


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
