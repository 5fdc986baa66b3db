"""Allow-list unpicklers: `.metadata`, tensor records and bytes items, without torch.

DCP writes `.metadata` with plain `pickle` (protocol 4), which torch's own
`weights_only` unpickler rejects, and `dcp.load` reads it back with plain
`pickle`, so a hostile checkpoint runs code there. Here every global is looked
up in an exact (module, name) table that maps to inert stand-ins; anything
else, persistent ids included, raises `UnsafePickleError` before it is called.
"""

from __future__ import annotations

import functools
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

# A data.pkl is walked opcode by opcode before the C unpickler runs it: that unpickler
# trusts its input in ways a few hostile bytes turn into gigabytes, a crash or a hang.
# It sizes its memo by the largest index it meets (9 bytes zero 1 GiB), hashes dict
# keys and set items recursively with no depth check (a 300 000-deep tuple key is a
# segfault on 3.11), and tuples do not cache their hash (a 370-byte key made of shared
# tuples takes 2**60 steps). The walk bounds all three by the pickle's length.
# Python's own pickler stops near 1 000 levels; tuple hashing crashes near 150 000.
_MAX_NESTING = 10_000
# Hashing work allowed per byte of pickle: real keys (names, small tuples) use ~1.
_HASH_STEPS_PER_BYTE = 16
_PUT_OPCODES = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_GET_OPCODES = frozenset({"GET", "BINGET", "LONG_BINGET"})
_LONG_OPCODES = frozenset({"LONG", "LONG1", "LONG4"})
# Opcodes that change the object under their arguments instead of making a new one.
_IN_PLACE_OPCODES = frozenset({"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD"})
_EMPTY_CONTAINER_OPCODES = frozenset({"EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET"})
# Opcodes that hash what they take: dict keys (SETITEM: [dict, key, value]; the others: key, value, ...)
# and set items.
_SET_OPCODES = frozenset({"ADDITEMS", "FROZENSET"})
_KEYS_HASHED = frozenset({"SETITEM", "SETITEMS", "DICT"}) | _SET_OPCODES


@functools.cache
def _stack_effects() -> dict[str, tuple[int, bool, int, bool]]:
    """Per opcode: items taken below a MARK, whether it takes a MARK, items taken otherwise, whether it pushes."""
    import pickletools

    effects = {}
    for op in pickletools.opcodes:
        before = op.stack_before
        if pickletools.markobject in before:
            effects[op.name] = (before.index(pickletools.markobject), True, 0, bool(op.stack_after))
        else:
            effects[op.name] = (0, False, len(before), bool(op.stack_after))
    return effects


def check_structure(data: bytes) -> None:
    """Raise UnpicklingError if unpickling `data` would allocate, nest or hash far beyond its length.

    Each object the pickle makes is a `[depth, cost]` pair that the stack and
    the memo share, so DUP, GET and in-place opcodes see one object: its
    nesting depth, and the steps hashing it takes (a tuple rehashes its items
    every time, so its cost is the sum of theirs; a frozenset caches its hash).
    """
    import pickletools

    limit = len(data)
    budget = _HASH_STEPS_PER_BYTE * limit + (1 << 16)
    effects = _stack_effects()
    stack: list[list[int]] = []
    marks: list[int] = []  # stack heights at each MARK, as in the C unpickler
    # Immutable leaves (numbers, strings, globals) share one pair: a pickle of 30 million small ints
    # must not cost 30 million lists here. Containers made empty and filled in place get their own.
    leaf = [1, 1]
    memo: dict[int, list[int]] = {}
    hashed = 0
    try:
        for op, arg, pos in pickletools.genops(data):
            name = op.name
            n_below, uses_mark, n_taken, pushes = effects[name]
            fence = marks[-1] if marks else 0
            if not (uses_mark or n_taken):  # pushes a new leaf, or touches only the memo or the marks
                if name == "MARK":
                    marks.append(len(stack))
                elif pushes and name not in _GET_OPCODES:
                    if name in _LONG_OPCODES and isinstance(arg, int) and arg.bit_length() >= 64:
                        stack.append([1, 1 + arg.bit_length() // 64])  # int hashes are not cached either
                    else:
                        stack.append([1, 1] if name in _EMPTY_CONTAINER_OPCODES else leaf)
                elif name in _PUT_OPCODES or name in _GET_OPCODES or name == "FRAME":
                    if not isinstance(arg, int) or arg > limit:
                        what = "frame length" if name == "FRAME" else "memo index"
                        raise pickle.UnpicklingError(f"{what} {arg} at byte {pos} is larger than the pickle")
                    if name in _GET_OPCODES:
                        if arg not in memo:
                            raise pickle.UnpicklingError(f"memo index {arg} at byte {pos} was never set")
                        stack.append(memo[arg])
                    elif name != "FRAME":
                        if len(stack) <= fence:
                            raise pickle.UnpicklingError("unpickling stack underflow")
                        memo[arg] = stack[-1]
                continue
            if name == "POP" and marks and fence == len(stack):
                marks.pop()  # POP right after a MARK drops the mark, as in the C unpickler
                continue
            if uses_mark:
                if not marks:
                    raise pickle.UnpicklingError("could not find MARK")
                items = stack[fence:]
                del stack[fence:]
                marks.pop()
                fence = marks[-1] if marks else 0
                if len(stack) - n_below < fence:
                    raise pickle.UnpicklingError("unpickling stack underflow")
                below = stack[len(stack) - n_below :] if n_below else []
                del stack[len(stack) - n_below :]
            else:
                if len(stack) - n_taken < fence:
                    raise pickle.UnpicklingError("unpickling stack underflow")
                below = []
                if n_taken == 1:
                    items = [stack.pop()]
                else:
                    items = stack[len(stack) - n_taken :]
                    del stack[len(stack) - n_taken :]
            if name in _KEYS_HASHED:
                keys = items if name in _SET_OPCODES else items[1:2] if name == "SETITEM" else items[0::2]
                hashed += sum(k[1] for k in keys)
                if hashed > budget:
                    raise pickle.UnpicklingError(f"hashing its keys takes more than {budget} steps (byte {pos})")
            if name in _IN_PLACE_OPCODES:
                container, added = (below[0], items) if below else (items[0], items[1:])
                if container is leaf:  # BUILD on a shared leaf: it becomes an object of its own
                    container = [1, 1]
                if added:
                    container[0] = max(container[0], 1 + max(a[0] for a in added))
                    container[1] = min(budget + 1, container[1] + sum(a[1] for a in added))
                made = container
            elif name in ("DUP", "MEMOIZE"):  # the same object again, not a new one
                made = items[0]
                if name == "DUP":
                    stack.append(made)
                else:
                    memo[len(memo)] = made
            elif pushes:
                nested, steps = 0, 0
                for taken in (below, items):
                    for t in taken:
                        nested = t[0] if t[0] > nested else nested
                        steps += t[1]
                steps = 1 + len(items) if name == "FROZENSET" else min(budget + 1, 1 + steps)
                made = [1 + nested, steps]
            else:
                continue
            if made[0] > _MAX_NESTING:
                raise pickle.UnpicklingError(f"objects nested more than {_MAX_NESTING} deep (byte {pos})")
            stack.append(made)
    except ValueError as exc:  # genops: unknown opcode, or an argument longer than what follows
        raise pickle.UnpicklingError(f"malformed pickle: {exc}") from None


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


@dataclass(frozen=True, slots=True)
class _StorageType:
    # Frozen, and without a __dict__: BUILD on this shared instance (slot state (None, {"dtype": ...}))
    # would otherwise change how every later record in the process is read.
    dtype: str


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


def _sizes(value: object, what: str) -> tuple[int, ...]:
    # torch writes sizes and strides as tuples of ints; anything else is not a tensor it saved,
    # and would fail later in arithmetic (a string shape) or in a read at offset 2**64.
    if not isinstance(value, tuple | list) or not all(type(v) is int and v >= 0 for v in value):
        raise pickle.UnpicklingError(f"tensor {what} is not a sequence of non-negative integers")
    return tuple(value)


def _record(storage: object, offset: object, size: object, stride: object, dtype: str) -> TensorRecord:
    if not isinstance(storage, StorageRef):
        raise pickle.UnpicklingError("tensor without storage")
    if type(offset) is not int or offset < 0:
        raise pickle.UnpicklingError("tensor storage offset is not a non-negative integer")
    shape, strides = _sizes(size, "size"), _sizes(stride, "stride")
    if len(shape) != len(strides):
        raise pickle.UnpicklingError(f"tensor of {len(shape)} dimensions with {len(strides)} strides")
    return TensorRecord(storage, offset, shape, strides, dtype)


def _rebuild_v2(storage: object, offset: object, size: object, stride: object, *_rest: object) -> TensorRecord:
    if not isinstance(storage, StorageRef):
        raise pickle.UnpicklingError("tensor without storage")
    return _record(storage, offset, size, stride, storage.dtype)


def _rebuild_v3(
    storage: object,
    offset: object,
    size: object,
    stride: object,
    _requires_grad: object,
    _hooks: object,
    dtype: object,
    *_rest: object,
) -> TensorRecord:
    if not isinstance(dtype, DType):
        raise pickle.UnpicklingError("tensor dtype is not a torch dtype")
    return _record(storage, offset, size, stride, str(dtype))


def _backward_hooks(*args: object) -> dict[str, object]:
    """`OrderedDict()`: torch never saves hooks, and dict(args) would hash whatever args hold."""
    if args:
        raise pickle.UnpicklingError("backward hooks with contents")
    return {}


_TENSOR_GLOBALS: dict[tuple[str, str], object] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
    ("collections", "OrderedDict"): _backward_hooks,
    ("torch", "UntypedStorage"): _StorageType("uint8"),
    # dtypes without a legacy storage class (float8, uint16/32/64) go through _rebuild_tensor_v3 with this one.
    ("torch.storage", "UntypedStorage"): _StorageType("uint8"),
    **{("torch", n): _StorageType(d) for n, d in _LEGACY_STORAGES.items()},
    **_DTYPE_GLOBALS,
}


class _TensorUnpickler(_AllowListUnpickler):
    allowed = _TENSOR_GLOBALS

    def persistent_load(self, pid: object) -> Any:
        # ("storage", storage type, key, location, numel); the key names the member data/<key>
        # and must be a str: str() of a hostile list of shared lists is 2**60 characters long.
        if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType):
            key, numel = pid[2], pid[4]
            if isinstance(key, str) and type(numel) is int and numel >= 0:
                return StorageRef(pid[1].dtype, key, numel)
        raise UnsafePickleError("unexpected persistent id")


def _unpickle(unpickler: type[_AllowListUnpickler], data: bytes) -> object:
    check_structure(data)
    try:
        return unpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError:
        raise
    except MemoryError:  # the walk bounded every allocation by len(data): this process is out of memory
        raise
    except Exception as exc:  # allowed callables or opcodes given the wrong objects: TypeError, AttributeError, ...
        raise pickle.UnpicklingError(f"{type(exc).__name__}: {exc}") from None


# Records of same-shaped chunks are byte-identical: a verdict cached by bytes skips the walk
# (~5x the unpickling itself: ~35 us for a record) for all but the first of them.
_CACHED_RECORD_BYTES = 4096


def load_tensor_record(data: bytes) -> TensorRecord:
    """Read a saved tensor's `data.pkl` into a record; raise UnpicklingError if it is anything else."""
    return _cached_record(data) if len(data) <= _CACHED_RECORD_BYTES else _tensor_record(data)


def _tensor_record(data: bytes) -> TensorRecord:
    obj = _unpickle(_TensorUnpickler, data)
    if not isinstance(obj, TensorRecord):
        raise pickle.UnpicklingError(f"expected a tensor, found {type(obj).__name__}")
    return obj


_cached_record = functools.lru_cache(maxsize=1024)(_tensor_record)


class _PlainUnpickler(_AllowListUnpickler):
    allowed: Mapping[tuple[str, str], object] = {}


# Tensors whose pickle holds one rank's part only. A bytes item is written by one rank (DCP deduplicates
# items by key), so such a tensor pickled inside one keeps that rank's shards and loses the others'.
# DTensor counts when a Shard-like or Partial placement is pickled with it (Replicate alone loses nothing).
_DISTRIBUTED = "torch.distributed."
_SHARDED_PLACEMENTS = frozenset({"Shard", "_StridedShard", "Partial", "_Partial", "_NormPartial"})


def sharded_tensors_in(data: bytes) -> str:
    """Which rank-local tensors a (torch.save protocol 2) pickle refers to: "" when none, else a name such
    as "DTensor with Shard placements" or "ShardedTensor". Read from its GLOBAL opcodes, nothing executed."""
    import pickletools

    names: set[tuple[str, str]] = set()
    try:
        for opcode, arg, _pos in pickletools.genops(data):
            if opcode.name == "GLOBAL" and isinstance(arg, str) and " " in arg:
                module, name = arg.split(" ", 1)
                if module.startswith(_DISTRIBUTED):
                    names.add((module, name))
    except ValueError:  # malformed past a point: what was read so far still counts
        pass
    kinds = []
    if any(name == "ShardedTensor" for _, name in names):
        kinds.append("ShardedTensor")
    placements = sorted(name for _, name in names if name in _SHARDED_PLACEMENTS)
    if placements and any(name == "DTensor" for _, name in names):
        kinds.append(f"DTensor with {'/'.join(placements)} placements")
    return ", ".join(kinds)


def load_plain(data: bytes) -> object:
    """Read a bytes item made only of builtins (lists of names, floats, bools); raise UnpicklingError if not."""
    return _unpickle(_PlainUnpickler, data)


LoadFn = Callable[[bytes], object]
