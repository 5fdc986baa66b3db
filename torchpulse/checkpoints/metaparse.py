"""The C reader of `.metadata` (`_metaparse`), with the Python unpickler as its reference.

`parse(data)` returns the reader's per-file model, exactly as the Python path
(`load_metadata` then `extract_standins`) would build it, or None when the C
reader declines: anything outside what DCP writes, anything the Python path
would refuse or fail on, or a module that was not built (no compiler at
install time). On None the caller runs the Python path, which then decides.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final, NamedTuple

from torchpulse.c_modules import optional_module
from torchpulse.checkpoints.model import Chunk, StorageEntry
from torchpulse.checkpoints.unpickler import (
    _METADATA_GLOBALS,
    BytesStorageMetadataStandIn,
    ChunkStorageMetadataStandIn,
    DType,
    MetadataIndexStandIn,
    MetadataStandIn,
    StorageInfoStandIn,
    StorageMetaStandIn,
    TensorPropertiesStandIn,
    TensorStorageMetadataStandIn,
    _enum_value,
    _layout,
    _path,
)

_metaparse = optional_module("torchpulse.checkpoints._metaparse")


# (key, None) for a bytes item; (key, dtype, size, chunks) for a tensor.
Item = tuple[str, None] | tuple[str, str, tuple[int, ...], tuple[Chunk, ...]]


class Extracted(NamedTuple):
    """What the reader takes from one metadata file."""

    version: object
    items: list[Item]
    storage: list[StorageEntry]
    # planner_data when it is a dict (the reader ignores anything else).
    planner: dict[Any, Any] | None


# The C reader's role for each allow-listed object: the numbers of `_metaparse.c`'s R_* enum.
_ROLES: Final[Mapping[object, int]] = {
    MetadataStandIn: 1,
    TensorStorageMetadataStandIn: 2,
    BytesStorageMetadataStandIn: 3,
    StorageMetaStandIn: 4,
    ChunkStorageMetadataStandIn: 5,
    MetadataIndexStandIn: 6,
    StorageInfoStandIn: 7,
    TensorPropertiesStandIn: 8,
    tuple: 9,
    _layout: 10,
    _enum_value: 11,
    _path: 12,
    dict: 13,
}
_DTYPE_ROLE: Final = 14


def _role(obj: object) -> tuple[int, str | None] | None:
    if isinstance(obj, DType):
        return _DTYPE_ROLE, str(obj)
    role = _ROLES.get(obj)
    return None if role is None else (role, None)


def allowed_roles(globals_: Mapping[tuple[str, str], object] = _METADATA_GLOBALS) -> dict[tuple[str, str], Any]:
    """The allow-list as the C reader takes it; an entry without a role is left out (the C reader declines it)."""
    return {pair: role for pair, obj in globals_.items() if (role := _role(obj)) is not None}


_ALLOWED: Final = allowed_roles()


def parse(data: bytes) -> Extracted | None:
    """The per-file model of `.metadata` bytes from the C reader, or None to run the Python path."""
    if _metaparse is None:
        return None
    reader: Callable[..., tuple[object, list[Item], list[StorageEntry], dict[Any, Any] | None] | None]
    reader = _metaparse.parse
    result = reader(data, _ALLOWED, Chunk, StorageEntry)
    if result is None:
        return None
    version, items, storage, planner = result
    # A key given twice is one entry (the last value) to the Python path's dict.
    if len({item[0] for item in items}) != len(items):
        return None
    return Extracted(version, items, storage, planner)
