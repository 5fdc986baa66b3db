"""C fast accepts for the per-chunk rules (`_rulekernels`), when it was built.

Each answers True only when its Python rule would report nothing; the rule then
returns at once, and runs its own Python checks on any other answer, or where
the module is missing (no compiler at install time).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from torchpulse.c_modules import optional_module
from torchpulse.checkpoints.model import Chunk, StorageEntry

_kernels: ModuleType | None = optional_module("torchpulse.checkpoints._rulekernels")


def _call(name: str, *args: Any) -> bool:
    if _kernels is None:
        return False
    kernel: Callable[..., bool | None] = getattr(_kernels, name)
    return kernel(*args) is True


def tiling_holds(chunks: Sequence[Chunk], size: Sequence[int]) -> bool:
    """True when the chunks tile `size` exactly (TP-CKPT-010 has nothing to say); False: ask the rule."""
    return type(chunks) is tuple and type(size) is tuple and _call("tiling_holds", chunks, size)


def items_disjoint(storage: tuple[StorageEntry, ...]) -> bool:
    """True when no two items of one file share a byte (TP-CKPT-007 has nothing to say); False: ask the rule."""
    return type(storage) is tuple and _call("items_disjoint", storage)


def items_within(storage: tuple[StorageEntry, ...], sizes: dict[str, int]) -> bool:
    """True when every item lies inside its file (TP-CKPT-006 has nothing to say); False: ask the rule."""
    return type(storage) is tuple and _call("items_within", storage, sizes)


def storage_matches(
    storage: tuple[StorageEntry, ...], tensors: list[tuple[str, tuple[Chunk, ...]]], bytes_keys: list[str]
) -> bool:
    """True when entries and chunks pair up one to one (TP-CKPT-009 has nothing to say); False: ask the rule."""
    return type(storage) is tuple and _call("storage_matches", storage, tensors, bytes_keys)
