"""Run callbacks right after a module executes, without importing it ourselves.

Some probes need a module the job may never import (`torch._dynamo`,
`torch.distributed.checkpoint`). Importing it at attach would change the job:
`torch.distributed.checkpoint` costs ~0.9 s, and a `torch._dynamo` imported
before `init_process_group` makes DDP over gloo hang at exit now and then on
torch 2.13 (see `torch_compat.DYNAMO`). So the probe waits for the job to
import it, and finishes installing then.

One finder serves every waiting callback: the import system asks finders in
turn and stops at the first spec, so two finders for one module would let
only one of them see it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType

Callback = Callable[[ModuleType], None]


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.waiting: dict[str, list[AfterImport]] = {}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.waiting:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        loader = spec.loader if spec is not None else None
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return None
        original_exec = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original_exec(module)
            with self.lock:
                due = self.waiting.pop(fullname, [])
                self._step_aside_if_idle()
            for hook in due:
                hook.callback(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec

    def add(self, hook: AfterImport) -> None:
        with self.lock:
            self.waiting.setdefault(hook.name, []).append(hook)
            if self not in sys.meta_path:
                sys.meta_path.insert(0, self)

    def discard(self, hook: AfterImport) -> None:
        with self.lock:
            hooks = self.waiting.get(hook.name, [])
            if hook in hooks:
                hooks.remove(hook)
            if not hooks:
                self.waiting.pop(hook.name, None)
            self._step_aside_if_idle()

    def _step_aside_if_idle(self) -> None:
        if not self.waiting and self in sys.meta_path:
            sys.meta_path.remove(self)


_FINDER = _Finder()


class AfterImport:
    """One waiting `callback(module)` for `name`; `remove()` cancels it if it has not run."""

    def __init__(self, name: str, callback: Callback) -> None:
        self.name, self.callback = name, callback
        _FINDER.add(self)

    def remove(self) -> None:
        _FINDER.discard(self)
