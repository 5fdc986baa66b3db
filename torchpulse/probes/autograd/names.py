"""Fully qualified parameter names, with wrapper prefixes stripped at wrapper boundaries.

Names are needed only when something is reported (a non-finite gradient), so
nothing is hooked on the hot path: on a miss the resolver finds the root
modules with one `gc.get_objects()` scan (tens of ms in a large process, once
per new set of parameters, e.g. a model rebuilt after a divergence) and walks
their module trees.
"""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import cast

import torch
from torch import nn

from torchpulse.probes.torch_compat import distributed as fsdp_compat

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
    sharded_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    stack: list[tuple[nn.Module, str]] = [(root, "")]
    while stack:
        module, prefix = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        for name, param in module._parameters.items():
            if param is not None and id(param) not in names:
                names[id(param)] = (param, prefix + name)
        sharded_pairs.extend(fsdp_compat.fsdp2_parameter_pairs(module))
        children = [
            (child, prefix if is_wrapper_edge(module, name) else f"{prefix}{name}.")
            for name, child in module._modules.items()
            if child is not None
        ]
        # Reversed so the pop order follows registration order (like named_parameters).
        stack.extend(reversed(children))
    # FSDP2 registers either the shard or the unsharded parameter; the other one has the same name
    # (a micro-step without gradient sync leaves its gradient on the unsharded one, now unregistered).
    for pair in sharded_pairs:
        named = [names[id(tensor)][1] for tensor in pair if id(tensor) in names]
        for tensor in pair:
            if named and id(tensor) not in names:
                names[id(tensor)] = (tensor, named[0])
    return names


def root_modules(objects: Iterable[object]) -> list[nn.Module]:
    """Modules that are nobody's child, largest tree first."""
    # type(), not isinstance(): isinstance reads `__class__`, which deprecated
    # proxies in torch.distributed answer with a FutureWarning.
    modules = [cast(nn.Module, obj) for obj in objects if issubclass(type(obj), nn.Module)]
    children = {id(child) for module in modules for child in module._modules.values() if child is not None}
    roots = [module for module in modules if id(module) not in children]
    roots.sort(key=lambda m: sum(1 for _ in m.modules()), reverse=True)
    return roots


class NameResolver:
    """Caches names weakly; rescans the process when a parameter it has never looked for is
    missing (a model built since the last scan), else at most once per `min_rescan_interval`."""

    def __init__(self, min_rescan_interval: float = 30.0) -> None:
        self._names: dict[int, tuple[weakref.ReferenceType[torch.Tensor], str]] = {}
        # Parameters missing after a scan: no module holds them, so they alone trigger no rescan.
        self._missed: dict[int, weakref.ReferenceType[torch.Tensor]] = {}
        self._min_interval = min_rescan_interval
        self._last_scan = -float("inf")

    def name(self, param: torch.Tensor) -> str:
        return self.names([param])[0]

    def names(self, params: Sequence[torch.Tensor]) -> list[str]:
        """Names of `params`, scanning the process at most once for all of them."""
        found = [self._lookup(param) for param in params]
        missing = [param for param, name in zip(params, found, strict=True) if name is None]
        if missing and self._rescan_due(missing):
            self.rescan(gc.get_objects())
            found = [self._lookup(param) for param in params]
        for param, name in zip(params, found, strict=True):
            if name is None:
                self._missed[id(param)] = weakref.ref(param)
        return [
            name if name is not None else f"<unnamed {tuple(param.shape)}>"
            for param, name in zip(params, found, strict=True)
        ]

    def _rescan_due(self, missing: list[torch.Tensor]) -> bool:
        if time.monotonic() - self._last_scan >= self._min_interval:
            return True
        # Plain tensors (inputs that require grad) never have a name: no early scan for them.
        return any(isinstance(param, nn.Parameter) and not self._was_missed(param) for param in missing)

    def _was_missed(self, param: torch.Tensor) -> bool:
        ref = self._missed.get(id(param))
        return ref is not None and ref() is param

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
        self._missed = {key: ref for key, ref in self._missed.items() if ref() is not None}
