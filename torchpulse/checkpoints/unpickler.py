"""Allow-list unpicklers: `.metadata`, tensor records and bytes items, without torch.

DCP writes `.metadata` with plain `pickle` (protocol 4), which torch's own
`weights_only` unpickler rejects, and `dcp.load` reads it back with plain
`pickle`, so a hostile checkpoint runs code there. Here every global is looked
up in an exact (module, name) table that maps to inert stand-ins; anything
else, persistent ids included, raises `UnsafePickleError` before it is called.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

# A million-chunk `.metadata` is ~140 MB; anything larger is refused unread.
DEFAULT_METADATA_SIZE_CAP = 256 << 20


class UnsafePickleError(pickle.UnpicklingError):
    """The pickle asked for something outside the allow-list; nothing was executed."""


class _StandIn(dict[str, Any]):
    """Base of inert objects that receive a dataclass's pickled state.

    A dict subclass whose `__setstate__` is `dict.update`, so BUILD stays in C:
    this is what keeps a million-chunk `.metadata` parse to a few seconds.
    """

    __slots__ = ()
    __setstate__ = dict.update

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict.__repr__(self)})"


class _StateHolder(list[Any]):
    """Base of the per-chunk stand-ins (millions of them): BUILD appends the state, uncopied.

    `holder[0]` is the pickled state dict. A list subclass whose `__setstate__`
    is `list.append` keeps BUILD in C and skips the dict copy `_StandIn` makes:
    ~20% of a million-chunk parse.
    """

    __slots__ = ()
    __setstate__ = list.append

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list.__repr__(self)})"


class MetadataStandIn(_StandIn):
    __slots__ = ()


class TensorStorageMetadataStandIn(_StandIn):
    __slots__ = ()


class BytesStorageMetadataStandIn(_StandIn):
    __slots__ = ()


class ChunkStorageMetadataStandIn(_StateHolder):
    __slots__ = ()


class StorageMetaStandIn(_StandIn):
    __slots__ = ()


class StorageInfoStandIn(_StateHolder):
    __slots__ = ()


class TensorPropertiesStandIn(_StandIn):
    __slots__ = ()

    def __setstate__(self, state: object) -> None:  # type: ignore[override]
        # TensorProperties pickles as (dtype, layout, requires_grad, mem_format, pin).
        if isinstance(state, tuple) and state:
            self["dtype"] = str(state[0])
        elif isinstance(state, dict):
            self["dtype"] = str(state.get("dtype", "float32"))


class MetadataIndexStandIn(_StateHolder):
    """Dict key of `storage_data`, hashed by identity: the keys are only iterated."""

    __slots__ = ()
    __hash__ = object.__hash__  # type: ignore[assignment]
    __eq__ = object.__eq__


class DType(str):
    """A torch dtype by name ("float32"); a str so nothing can call it."""


def _layout(name: object) -> str:
    return str(name)


def _enum_value(value: object) -> object:
    return value


def _path(*parts: object) -> str:
    return "/".join(str(p) for p in parts)


DTYPE_ITEMSIZE: Mapping[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "complex128": 16,
    "complex64": 8,
    "complex32": 4,
    "float8_e5m2": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2fnuz": 1,
    "float8_e4m3fnuz": 1,
    "float8_e8m0fnu": 1,
}

# torch pickles dtypes as globals `torch.<name>`; a few have legacy aliases.
_DTYPE_GLOBALS: dict[tuple[str, str], object] = {("torch", name): DType(name) for name in DTYPE_ITEMSIZE}
_DTYPE_GLOBALS.update(
    {
        ("torch", "float"): DType("float32"),
        ("torch", "double"): DType("float64"),
        ("torch", "half"): DType("float16"),
        ("torch", "long"): DType("int64"),
        ("torch", "int"): DType("int32"),
        ("torch", "short"): DType("int16"),
        ("torch", "cfloat"): DType("complex64"),
        ("torch", "cdouble"): DType("complex128"),
    }
)

_DCP = "torch.distributed.checkpoint.metadata"
_METADATA_GLOBALS: dict[tuple[str, str], object] = {
    (_DCP, "Metadata"): MetadataStandIn,
    (_DCP, "TensorStorageMetadata"): TensorStorageMetadataStandIn,
    (_DCP, "BytesStorageMetadata"): BytesStorageMetadataStandIn,
    (_DCP, "ChunkStorageMetadata"): ChunkStorageMetadataStandIn,
    (_DCP, "TensorProperties"): TensorPropertiesStandIn,
    (_DCP, "MetadataIndex"): MetadataIndexStandIn,
    (_DCP, "StorageMeta"): StorageMetaStandIn,
    (_DCP, "_MEM_FORMAT_ENCODING"): _enum_value,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): StorageInfoStandIn,
    # torch.Size(tuple) is rebuilt as the tuple itself: REDUCE calls tuple(...).
    ("torch", "Size"): tuple,
    ("torch.serialization", "_get_layout"): _layout,
    ("pathlib", "PosixPath"): _path,
    ("pathlib", "PurePosixPath"): _path,
    ("pathlib", "WindowsPath"): _path,
    ("collections", "OrderedDict"): dict,
    **_DTYPE_GLOBALS,
}


class _AllowListUnpickler(pickle.Unpickler):
    allowed: Mapping[tuple[str, str], object] = {}

    def find_class(self, module: str, name: str) -> Any:
        # Exact pairs only: "os.system" inside an allowed module is not a name here.
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise UnsafePickleError(f"refused global {module}.{name}") from None

    def persistent_load(self, pid: object) -> Any:
        raise UnsafePickleError("refused persistent id")


class _MetadataUnpickler(_AllowListUnpickler):
    allowed = _METADATA_GLOBALS


# Opcodes whose argument is a memo index (pickletools names); genops checks lengths itself.
_MEMO_OPCODES = frozenset({"LONG_BINPUT", "LONG_BINGET", "BINPUT", "BINGET"})


def declared_beyond_data(data: bytes) -> str | None:
    """Why `data` cannot be a real pickle of its size, or None (only run after a MemoryError)."""
    import pickletools

    try:
        for opcode, arg, pos in pickletools.genops(data):
            if opcode.name in _MEMO_OPCODES and isinstance(arg, int) and arg > len(data):
                return f"memo index {arg} at byte {pos} is larger than the file"
            if opcode.name == "FRAME" and isinstance(arg, int) and arg > len(data):
                return f"frame of {arg} bytes at byte {pos} is larger than the file"
    except ValueError as exc:  # genops: a declared length longer than the bytes that follow
        return f"declared length runs past the end of the file ({exc})"
    return None


def load_metadata(data: bytes) -> MetadataStandIn:
    """Unpickle DCP `.metadata` bytes into stand-ins; raise on anything unexpected."""
    try:
        obj = _MetadataUnpickler(io.BytesIO(data)).load()
    except MemoryError:
        # A few bytes can declare a 2**40-byte string or a 2**30-slot memo and make the
        # unpickler allocate before it reads: a broken file, not a validator failure.
        problem = declared_beyond_data(data)
        if problem is None:
            raise
        raise pickle.UnpicklingError(problem) from None
    if not isinstance(obj, MetadataStandIn):
        raise pickle.UnpicklingError(f"top-level object is {type(obj).__name__}, not Metadata")
    return obj


# --- records inside torch.save zips (data level) -------------------------------------


@dataclass(frozen=True, slots=True)
class StorageRef:
    dtype: str
    key: str
    numel: int


@dataclass(frozen=True, slots=True)
class TensorRecord:
    """What `data.pkl` of a saved tensor says, without rebuilding the tensor."""

    storage: StorageRef
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str


class _StorageType:
    def __init__(self, dtype: str) -> None:
        self.dtype = dtype


_LEGACY_STORAGES = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "BFloat16Storage": "bfloat16",
    "ComplexDoubleStorage": "complex128",
    "ComplexFloatStorage": "complex64",
}


def _rebuild_v2(
    storage: object, offset: int, size: tuple[int, ...], stride: tuple[int, ...], *_rest: object
) -> TensorRecord:
    if not isinstance(storage, StorageRef):
        raise pickle.UnpicklingError("tensor without storage")
    return TensorRecord(storage, int(offset), tuple(size), tuple(stride), storage.dtype)


def _rebuild_v3(
    storage: object,
    offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    _requires_grad: object,
    _hooks: object,
    dtype: object,
    *_rest: object,
) -> TensorRecord:
    if not isinstance(storage, StorageRef):
        raise pickle.UnpicklingError("tensor without storage")
    return TensorRecord(storage, int(offset), tuple(size), tuple(stride), str(dtype))


_TENSOR_GLOBALS: dict[tuple[str, str], object] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
    ("collections", "OrderedDict"): dict,
    ("torch", "UntypedStorage"): _StorageType("uint8"),
    **{("torch", n): _StorageType(d) for n, d in _LEGACY_STORAGES.items()},
    **_DTYPE_GLOBALS,
}


class _TensorUnpickler(_AllowListUnpickler):
    allowed = _TENSOR_GLOBALS

    def persistent_load(self, pid: object) -> Any:
        if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType):
            return StorageRef(pid[1].dtype, str(pid[2]), int(pid[4]))
        raise UnsafePickleError("unexpected persistent id")


def load_tensor_record(data: bytes) -> TensorRecord:
    """Read a saved tensor's `data.pkl` into a record; raise if it is anything else."""
    obj = _TensorUnpickler(io.BytesIO(data)).load()
    if not isinstance(obj, TensorRecord):
        raise pickle.UnpicklingError(f"expected a tensor, found {type(obj).__name__}")
    return obj


class _PlainUnpickler(_AllowListUnpickler):
    allowed: Mapping[tuple[str, str], object] = {}


def load_plain(data: bytes) -> object:
    """Read a bytes item made only of builtins (lists of names, floats, bools)."""
    return _PlainUnpickler(io.BytesIO(data)).load()


LoadFn = Callable[[bytes], object]
