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


def _chain_to_shadowed_sitecustomize() -> None:
    paths = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", paths)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


def _should_attach() -> bool:
    # Inductor's compile workers import torch but never train.
    argv = " ".join(sys.argv[:2])
    return "compile_worker" not in argv


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
    if os.environ.get("TORCHPULSE_BOOTSTRAP") == "1" and "torch" not in sys.modules:
        sys.meta_path.insert(0, _AttachAfterTorch())
