"""Data level: stream every item once, check CRC32, stored dtype/shape and state values.

Memory stays bounded by one block buffer per worker (plus one decompressed item
for zstd): a long member is cut into one part per worker, and each worker reads
its part block by block into its own reused buffer, updates the part's CRC and
checks the block's values while it is still in cache; the parts' CRCs are then
combined. torch is imported only here, lazily, and only to look at numbers
(`torch.frombuffer`), never to unpickle.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import struct
from collections.abc import Callable, Iterator
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from torchpulse.checkpoints.crc import crc32, crc32_combine
from torchpulse.checkpoints.model import (
    Checkpoint,
    DataReport,
    FileInfo,
    Format,
    ItemProblem,
    StorageEntry,
    StoredBytes,
    StoredTensor,
)
from torchpulse.checkpoints.reader import open_regular_fd
from torchpulse.checkpoints.rules.optimizer import NON_NEGATIVE_STATE
from torchpulse.checkpoints.unpickler import (
    DTYPE_ITEMSIZE,
    TensorRecord,
    UnsafePickleError,
    load_plain,
    load_tensor_record,
    sharded_tensors_in,
)
from torchpulse.checkpoints.zipview import Member, ZipFormatError, central_directory, data_offset

# Blocks small enough to stay in cache between the read, the CRC and the value check:
# measured on 1 GB, 512 KiB to 1 MiB blocks in two workers match `cat`; 8 MiB is 15% slower.
BLOCK_SIZE = 1 << 20
WORKERS = 2
_FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16"})
_PICKLE_CAP = 64 << 20
# What torch.save puts around one storage (data.pkl, version, byteorder, 64-byte alignment): a few KiB.
_ZIP_SLACK = 1 << 20

Progress = Callable[[int], None]


@dataclass
class _Accumulator:
    tensors: list[StoredTensor]
    bytes_items: list[StoredBytes]
    problems: list[ItemProblem]
    bytes_read: int = 0
    # (key, chunk offsets) -> bytes of the chunk, built on the first transformed item.
    chunk_bytes: dict[tuple[str, tuple[int, ...]], int] | None = None


class _ValueCheck:
    """Counts non-finite and negative values block by block (torch imported on first use).

    `torch.isfinite` runs at ~0.4 GB/s on CPU while a reduction runs at memory
    speed, so a block is reduced first and only counted exactly when the
    reduction says it must be. Without a sign check that reduction is a sum
    (NaN/Inf poison it; the fastest pass). With one (second moments) it is one
    `aminmax` pass instead of a sum plus a min: NaN propagates through both,
    an Inf shows in one of them, and the min gives the sign.
    """

    def __init__(self, dtype: str, check_sign: bool) -> None:
        import torch

        self.torch = torch
        self.dtype = getattr(torch, dtype)
        self.check_sign = check_sign
        self.nonfinite = 0
        self.negative = 0

    def update(self, block: memoryview) -> None:
        torch = self.torch
        t = torch.frombuffer(block, dtype=self.dtype)
        if t.numel() == 0:
            return
        if not self.check_sign:
            if not bool(torch.isfinite(t.sum())):
                self.nonfinite += int((~torch.isfinite(t)).sum())
            return
        low, high = torch.aminmax(t)
        if not (bool(torch.isfinite(low)) and bool(torch.isfinite(high))):
            self.nonfinite += int((~torch.isfinite(t)).sum())
        if not bool(low >= 0):  # a NaN min hides the sign: count exactly
            self.negative += int((t < 0).sum())


def _scalar(raw: bytes, dtype: str) -> float | None:
    fmt = {"float64": "<d", "float32": "<f", "int64": "<q", "int32": "<i"}.get(dtype)
    if fmt is not None and len(raw) == struct.calcsize(fmt):
        return float(struct.unpack(fmt, raw)[0])
    if dtype == "bfloat16" and len(raw) == 2:
        return float(struct.unpack("<f", b"\0\0" + raw)[0])
    if dtype == "float16" and len(raw) == 2:
        return float(struct.unpack("<e", raw)[0])
    return None


class _Source:
    """Random access to one item: a slice of an open file, or decompressed bytes."""

    def __init__(self, fd: int | None, base: int, length: int, data: bytearray | None = None) -> None:
        self.fd, self.base, self.length, self.data = fd, base, length, data

    def read_at(self, offset: int, n: int) -> bytes:
        # Offsets come from the item's own bytes (zip64 fields, a record's storage offset): one
        # outside the item reads nothing, not another item's bytes, and never reaches pread as
        # a negative or 2**64 offset.
        if offset < 0 or offset >= self.length:
            return b""
        n = max(0, min(n, self.length - offset))
        if self.data is not None:
            return bytes(self.data[offset : offset + n])
        assert self.fd is not None
        return os.pread(self.fd, n, self.base + offset)

    def scan(self, offset: int, n: int, workers: _Workers, window: _Window | None = None) -> _Scanned:
        """CRC32 of bytes [offset, offset + n), and the value check of the part inside `window`.

        A long range is cut into one contiguous part per worker (at block
        boundaries, so values stay aligned); each worker reads, checksums and
        checks its part block by block while the block is in cache, and the
        CRCs are combined. preadv, CRC32 and torch reductions all release the GIL.
        """
        parts, pool = workers.split(n), workers.pool
        pending = (
            []
            if pool is None
            else [
                pool.submit(self._scan_part, offset, at, size, view, window)
                for (at, size), view in zip(parts[1:], workers.views[1:], strict=False)
            ]
        )
        try:
            first = self._scan_part(offset, *parts[0], workers.views[0], window)
        finally:
            # Never leave a read running into a buffer that the next call reuses.
            futures.wait(pending)
        results = [p.result() for p in pending]
        crc, nonfinite, negative = first.crc, first.nonfinite, first.negative
        for (_, size), part in zip(parts[1:], results, strict=True):
            crc = crc32_combine(crc, part.crc, size)
            nonfinite += part.nonfinite
            negative += part.negative
        return _Scanned(crc, nonfinite, negative)

    def _scan_part(self, offset: int, at: int, n: int, view: memoryview, window: _Window | None) -> _Scanned:
        values = window.check() if window is not None else None
        crc, end = 0, at + n
        while at < end:
            block = self._block(view, offset + at, end - at)
            crc = crc32(block, crc)
            if values is not None and window is not None:
                a, b = max(window.lo, at), min(window.hi, at + len(block))
                if a < b:
                    values.update(block[a - at : b - at])
            at += len(block)
        if values is None:
            return _Scanned(crc)
        return _Scanned(crc, values.nonfinite, values.negative)

    def _block(self, view: memoryview, offset: int, left: int) -> memoryview:
        want = min(len(view), left)
        if self.data is not None:  # already in memory: no copy
            block = memoryview(self.data)[offset : offset + want]
        else:
            assert self.fd is not None
            block = view[: os.preadv(self.fd, [view[:want]], self.base + offset)]
        if not block:
            raise ZipFormatError("unexpected end of file")
        return block


@dataclass(frozen=True, slots=True)
class _Window:
    """Where a tensor's values lie inside a member (bytes), and how to check them."""

    lo: int
    hi: int
    dtype: str
    check_sign: bool

    def check(self) -> _ValueCheck:
        return _ValueCheck(self.dtype, self.check_sign)


@dataclass(frozen=True, slots=True)
class _Scanned:
    crc: int
    nonfinite: int = 0
    negative: int = 0


class _Workers:
    """One reusable block buffer per worker, and a pool for all workers but the caller."""

    def __init__(self, block_size: int, count: int) -> None:
        self.block_size = block_size
        self.views = tuple(memoryview(bytearray(block_size)) for _ in range(count))
        self.pool = ThreadPoolExecutor(count - 1, thread_name_prefix="torchpulse-read") if count > 1 else None

    def split(self, n: int) -> list[tuple[int, int]]:
        """(start, length) of each worker's part of n bytes; one part when it is short."""
        if self.pool is None or n < 2 * self.block_size:
            return [(0, n)]
        blocks = math.ceil(n / self.block_size)
        per = math.ceil(blocks / len(self.views)) * self.block_size
        return [(at, min(per, n - at)) for at in range(0, n, per)]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)


def read_data(
    ckpt: Checkpoint,
    value_keys: frozenset[str],
    *,
    drop_cache: bool = False,
    progress: Progress | None = None,
    block_size: int = BLOCK_SIZE,
    workers: int = WORKERS,
) -> DataReport:
    """Read every item that the metadata level found in bounds; report what is stored.

    `value_keys` are the keys (optimizer state) whose values are checked for
    NaN/Inf and sign. `drop_cache` evicts each file from the page cache once
    read, so a daemon's validation does not push the training job's data out.
    """
    with _single_threaded_torch():
        return _read_all(ckpt, value_keys, drop_cache, progress, _Workers(block_size, workers))


@contextlib.contextmanager
def _single_threaded_torch() -> Iterator[None]:
    # Per-block reductions are tiny; torch's intra-op pool costs 20x more in wake-ups
    # than the work itself (measured: 8 MiB sum 0.3 ms on 1 thread, 7.6 ms on 2).
    try:
        import torch
    except ImportError:  # pragma: no cover - the worker always has torch
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _read_all(
    ckpt: Checkpoint,
    value_keys: frozenset[str],
    drop_cache: bool,
    progress: Progress | None,
    workers: _Workers,
) -> DataReport:
    acc = _Accumulator([], [], [])
    try:
        _read_files(ckpt, value_keys, drop_cache, progress, workers, acc)
    finally:
        workers.close()
    return DataReport(tuple(acc.tensors), tuple(acc.bytes_items), tuple(acc.problems), acc.bytes_read)


def _read_files(
    ckpt: Checkpoint,
    value_keys: frozenset[str],
    drop_cache: bool,
    progress: Progress | None,
    workers: _Workers,
    acc: _Accumulator,
) -> None:
    by_file: dict[str, list[StorageEntry]] = {}
    for s in ckpt.storage:
        info = ckpt.files.get(s.relative_path)
        if info is not None and s.offset >= 0 and s.length >= 0 and s.offset + s.length <= info.size:
            by_file.setdefault(s.relative_path, []).append(s)
    for name in sorted(by_file):
        path = Path(ckpt.path) / name
        fd = _open_as_listed(path, ckpt.files[name])
        if fd is None:
            acc.problems.extend(ItemProblem("unreadable", s.key, name, "not a regular file") for s in by_file[name])
            continue
        try:
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            reach = 0
            for entry in sorted(by_file[name], key=lambda s: s.offset):
                if entry.length > 0 and entry.offset < reach:
                    # Overlapping items are TP-CKPT-007 already: reading each of them again would let
                    # a large .metadata read one file once per item (a million times 64 MiB).
                    continue
                reach = max(reach, entry.offset + entry.length)
                try:
                    _read_item(ckpt, fd, entry, entry.key in value_keys, workers, acc)
                except (
                    ZipFormatError,
                    pickle.UnpicklingError,
                    ValueError,
                    EOFError,
                    KeyError,
                    struct.error,
                ) as exc:
                    # OSError is not here: an I/O error means "cannot tell", not a broken item.
                    acc.problems.append(ItemProblem("unreadable", entry.key, name, str(exc)))
                acc.bytes_read += entry.length
                if progress is not None:
                    progress(entry.length)
            # Truncated or rewritten while it was read: what was found describes no file on disk.
            _check_as_listed(os.fstat(fd), path, ckpt.files[name])
        finally:
            if drop_cache:
                with contextlib.suppress(OSError):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def _open_as_listed(path: Path, listed: FileInfo) -> int | None:
    """A descriptor on `path` if it is still the regular file the listing saw; None if it is no regular file."""
    opened = open_regular_fd(path)
    if opened is None:
        return None
    fd, st = opened
    try:
        _check_as_listed(st, path, listed)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_as_listed(st: os.stat_result, path: Path, listed: FileInfo) -> None:
    if (st.st_size, st.st_mtime_ns) != (listed.size, listed.mtime_ns):
        raise OSError(f"{path}: changed while it was validated ({listed.size} bytes listed, {st.st_size} now)")


def _read_item(
    ckpt: Checkpoint, fd: int, entry: StorageEntry, check: bool, workers: _Workers, acc: _Accumulator
) -> None:
    if ckpt.format is Format.SAFETENSORS:
        _read_raw_tensor(ckpt, _Source(fd, entry.offset, entry.length), entry, check, workers, acc)
        return
    source = _Source(fd, entry.offset, entry.length)
    if entry.transforms:
        data = _untransform(source.read_at(0, entry.length), entry, _expanded_limit(ckpt, entry, acc))
        source = _Source(None, 0, len(data), data)
    members = central_directory(source.read_at, source.length)
    if not members:
        raise ZipFormatError("empty archive")
    # What torch.load reads (PyTorchStreamReader): `<dir>/data.pkl`, then `<dir>/data/<key>` for the
    # storage the pickle names, <dir> being the first central directory entry's directory. Those
    # decide what is checked, whatever the order of the members or other files named data.pkl;
    # every other member is only checksummed.
    prefix = members[0].name.split("/", 1)[0]
    named = {m.name: m for m in members}
    pkl = named.get(f"{prefix}/data.pkl")
    if pkl is None:
        raise ZipFormatError("no data.pkl in the item")
    if pkl.size > _PICKLE_CAP:
        raise ZipFormatError("data.pkl is implausibly large")
    pickled = source.read_at(_member_start(source, pkl), pkl.size)
    _check_crc(acc, entry, pkl, crc32(pickled, 0))
    record = None if entry.chunk_offsets is None else load_tensor_record(pickled)
    storage = None
    if record is not None:
        storage = named.get(f"{prefix}/data/{record.storage.key}")
        if storage is None:
            raise ZipFormatError(f"no member data/{record.storage.key} for the storage that data.pkl names")
    for m in sorted(members, key=lambda m: m.local_offset):
        if m is pkl:
            continue
        start = _member_start(source, m)
        if m is storage and record is not None:
            crc = _scan_storage(source, start, m, record, check, workers, acc, entry)
        else:
            crc = source.scan(start, m.size, workers).crc
        _check_crc(acc, entry, m, crc)
    if record is None:
        acc.bytes_items.append(_decode_bytes_item(entry.key, pickled))


def _member_start(source: _Source, m: Member) -> int:
    if m.method != 0:
        raise ZipFormatError(f"{m.name}: compressed members are not written by torch.save")
    start = data_offset(source.read_at, m)
    if start + m.size > source.length:
        raise ZipFormatError(f"{m.name} runs past the end of the item")
    return start


def _check_crc(acc: _Accumulator, entry: StorageEntry, m: Member, crc: int) -> None:
    if crc != m.crc32:
        acc.problems.append(
            ItemProblem(
                "crc",
                entry.key,
                entry.relative_path,
                f"member {m.name}: stored {m.crc32:08x}, computed {crc:08x}",
            )
        )


def _scan_storage(
    source: _Source,
    start: int,
    m: Member,
    record: TensorRecord,
    check: bool,
    workers: _Workers,
    acc: _Accumulator,
    entry: StorageEntry,
) -> int:
    itemsize = DTYPE_ITEMSIZE.get(record.dtype, 1)
    numel = math.prod(record.shape)
    # torch.load refuses a view that reaches past its storage; checked here, such a view would
    # also leave its values unchecked (the window below lies outside the member).
    last = sum((n - 1) * s for n, s in zip(record.shape, record.stride, strict=True))
    extent = record.storage_offset + 1 + last if numel else 0
    if extent * itemsize > m.size:
        raise ZipFormatError(f"the tensor's view needs {extent * itemsize} bytes of {m.name}, which has {m.size}")
    # Values outside the tensor's view of its storage are not the tensor's business.
    lo, hi = record.storage_offset * itemsize, (record.storage_offset + numel) * itemsize
    scanned = source.scan(start, m.size, workers, _window(lo, hi, record.dtype, entry.key, check))
    scalar = source.read_at(start + lo, min(hi, m.size) - lo) if numel == 1 else None
    acc.tensors.append(_stored(entry, record.dtype, record.shape, scanned, scalar))
    return scanned.crc


def _read_raw_tensor(
    ckpt: Checkpoint,
    source: _Source,
    entry: StorageEntry,
    check: bool,
    workers: _Workers,
    acc: _Accumulator,
) -> None:
    tensor = ckpt.tensors[entry.key]
    chunk = next(c for c in tensor.chunks if c.offsets == entry.chunk_offsets)
    numel = math.prod(chunk.sizes)
    scanned = source.scan(0, entry.length, workers, _window(0, entry.length, tensor.dtype, entry.key, check))
    scalar = source.read_at(0, entry.length) if numel == 1 else None
    acc.tensors.append(_stored(entry, tensor.dtype, chunk.sizes, scanned, scalar))


def _window(lo: int, hi: int, dtype: str, key: str, check: bool) -> _Window | None:
    """The NaN/Inf (and, for second moments, sign) check of one optimizer-state item, if it has one."""
    return _Window(lo, hi, dtype, _is_second_moment(key)) if check and dtype in _FLOAT_DTYPES else None


def _stored(
    entry: StorageEntry, dtype: str, shape: tuple[int, ...], scanned: _Scanned, scalar_raw: bytes | None
) -> StoredTensor:
    """What one item holds: its dtype and shape, the value-check counts, and its value if a scalar."""
    return StoredTensor(
        entry.key,
        entry.chunk_offsets or (),
        dtype,
        shape,
        scanned.nonfinite,
        scanned.negative,
        None if scalar_raw is None else _scalar(scalar_raw, dtype),
    )


def _is_second_moment(key: str) -> bool:
    return key.rsplit(".", 1)[-1] in NON_NEGATIVE_STATE


def _expanded_limit(ckpt: Checkpoint, entry: StorageEntry, acc: _Accumulator) -> int:
    """The most bytes a transformed item may decompress to: its chunk as the metadata sizes it, plus the zip.

    A bytes item has no size in the metadata; its data.pkl cap bounds it.
    """
    if entry.chunk_offsets is None:
        return _PICKLE_CAP + _ZIP_SLACK
    if acc.chunk_bytes is None:  # one pass over all chunks, not one per item
        acc.chunk_bytes = {
            (t.key, c.offsets): math.prod(c.sizes) * DTYPE_ITEMSIZE.get(t.dtype, 16)
            for t in ckpt.tensors.values()
            for c in t.chunks
        }
    return acc.chunk_bytes.get((entry.key, entry.chunk_offsets), _PICKLE_CAP) + _ZIP_SLACK


def _untransform(raw: bytes, entry: StorageEntry, limit: int) -> bytearray:
    """Undo the item's transforms, refusing to hold more than `limit` bytes.

    A zstd frame of RLE blocks inflates 32 000 times (256 KiB -> 8 GiB), so the
    output is read block by block and stops at the size the metadata allows.
    """
    data = bytearray(raw)
    for descriptor in entry.transforms:
        if descriptor.split("/")[0] != "stream.zstd":
            raise ZipFormatError(f"unknown transform {descriptor!r}")
        try:
            import zstandard
        except ImportError as exc:
            raise ZipFormatError("zstd transform but the zstandard module is missing") from exc
        out = bytearray()
        try:
            # One frame, as DCP writes it (stream_reader stops at its end, as decompressobj did).
            with zstandard.ZstdDecompressor().stream_reader(data) as reader:
                while block := reader.read(BLOCK_SIZE):
                    out += block
                    if len(out) > limit:
                        raise ZipFormatError(f"decompresses to more than {limit} bytes, past the size of its chunk")
        except zstandard.ZstdError as exc:
            raise ZipFormatError(f"zstd: {exc}") from None
        data = out
    return data


def _decode_bytes_item(key: str, pickled: bytes) -> StoredBytes:
    try:
        return StoredBytes(key, True, load_plain(pickled))
    except UnsafePickleError as exc:
        return StoredBytes(key, False, None, str(exc), sharded_tensors_in(pickled))
