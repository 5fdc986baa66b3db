"""Fully qualified parameter names, with wrapper prefixes stripped at wrapper boundaries.

Names are needed only when something is reported (a non-finite gradient), so
nothing is hooked on the hot path: on a miss the resolver finds the root
modules with one `gc.get_objects()` scan (tens of ms in a large process, once
per new set of parameters) and walks their module trees.
"""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Iterable

import torch
from torch import nn

# Child names that only a wrapper introduces: always a wrapper boundary.
WRAPPER_CHILDREN = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
# `module` is a wrapper boundary only under these (a user's own `module` child keeps its name).
DATA_PARALLEL_TYPES = frozenset({"DistributedDataParallel", "DataParallel"})


def is_wrapper_edge(parent: nn.Module, child_name: str) -> bool:
    if child_name in WRAPPER_CHILDREN:
        return True
    return child_name == "module" and type(parent).__name__ in DATA_PARALLEL_TYPES


def parameter_names(root: nn.Module) -> dict[int, tuple[torch.Tensor, str]]:
    """id(param) -> (param, name) in one module tree; a shared parameter keeps its first name."""
    names: dict[int, tuple[torch.Tensor, str]] = {}
    seen: set[int] = set()
    stack: list[tuple[nn.Module, str]] = [(root, "")]
    while stack:
        module, prefix = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        for name, param in module._parameters.items():
            if param is not None and id(param) not in names:
                names[id(param)] = (param, prefix + name)
        children = [(child, prefix if is_wrapper_edge(module, name) else f"{prefix}{name}.")
                    for name, child in module._modules.items() if child is not None]
        # Reversed so the pop order follows registration order (like named_parameters).
        stack.extend(reversed(children))
    return names


def root_modules(objects: Iterable[object]) -> list[nn.Module]:
    """Modules that are nobody's child, largest tree first."""
    # type(), not isinstance(): isinstance reads `__class__`, which deprecated
    # proxies in torch.distributed answer with a FutureWarning.
    modules: list[nn.Module] = [obj for obj in objects  # type: ignore[misc]
                                if issubclass(type(obj), nn.Module)]
    children = {id(child) for module in modules
                for child in module._modules.values() if child is not None}
    roots = [module for module in modules if id(module) not in children]
    roots.sort(key=lambda m: sum(1 for _ in m.modules()), reverse=True)
    return roots


class NameResolver:
    """Caches names weakly; rescans the process at most once per `min_rescan_interval`."""

    def __init__(self, min_rescan_interval: float = 30.0) -> None:
        self._names: dict[int, tuple[weakref.ReferenceType[torch.Tensor], str]] = {}
        self._min_interval = min_rescan_interval
        self._last_scan = -float("inf")

    def name(self, param: torch.Tensor) -> str:
        name = self._lookup(param)
        if name is None and time.monotonic() - self._last_scan >= self._min_interval:
            self.rescan(gc.get_objects())
            name = self._lookup(param)
        return name if name is not None else f"<unnamed {tuple(param.shape)}>"

    def _lookup(self, param: torch.Tensor) -> str | None:
        entry = self._names.get(id(param))
        if entry is None or entry[0]() is not param:
            return None
        return entry[1]

    def rescan(self, objects: Iterable[object]) -> None:
        self._last_scan = time.monotonic()
        names: dict[int, tuple[weakref.ReferenceType[torch.Tensor], str]] = {}
        for root in root_modules(objects):
            for key, (param, name) in parameter_names(root).items():
                if key not in names:
                    names[key] = (weakref.ref(param), name)
        self._names = names
