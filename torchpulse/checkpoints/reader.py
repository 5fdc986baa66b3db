"""Directory -> `Checkpoint`: reads only metadata files and `stat`, never tensor bytes."""

from __future__ import annotations

import errno
import gc
import io
import json
import os
import re
import stat
import struct
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import chain, repeat
from operator import itemgetter, methodcaller
from pathlib import Path
from typing import Any

from torchpulse.checkpoints import metaparse
from torchpulse.checkpoints.metaparse import Extracted, Item
from torchpulse.checkpoints.model import (
    DATA_SUFFIXES,
    Checkpoint,
    Chunk,
    FileInfo,
    Format,
    StorageEntry,
    TensorEntry,
)
from torchpulse.checkpoints.unpickler import (
    DEFAULT_METADATA_SIZE_CAP,
    BytesStorageMetadataStandIn,
    MetadataStandIn,
    TensorStorageMetadataStandIn,
    load_metadata,
)

METADATA_NAME = ".metadata"
HF_INDEX_NAME = "model.safetensors.index.json"
_RANK_METADATA = re.compile(r"^__(\d+)\.metadata$")


@dataclass(frozen=True, slots=True)
class Listing:
    """Every regular file in the checkpoint directory, by name."""

    path: str
    files: Mapping[str, FileInfo]

    def data_files(self) -> list[str]:
        return sorted(n for n in self.files if n.endswith(DATA_SUFFIXES))

    def rank_metadata(self) -> list[str]:
        return sorted(
            (n for n in self.files if _RANK_METADATA.match(n)),
            key=lambda n: int(_RANK_METADATA.match(n).group(1)),  # type: ignore[union-attr]
        )


@dataclass(frozen=True, slots=True)
class ReadOutcome:
    listing: Listing
    checkpoint: Checkpoint | None
    # Why `checkpoint` is None although a metadata file exists (refused, corrupt).
    metadata_error: str | None = None
    # Rank metadata files that could not be read, with the reason.
    errors: Mapping[str, str] = field(default_factory=dict)


def list_directory(path: str | os.PathLike[str]) -> Listing:
    """Stat every regular file directly in `path` (OSError propagates: exit status 2)."""
    files: dict[str, FileInfo] = {}
    with os.scandir(path) as it:
        for entry in it:
            if entry.is_file(follow_symlinks=False):
                st = entry.stat(follow_symlinks=False)
                files[entry.name] = FileInfo(entry.name, st.st_size, st.st_mtime_ns)
    return Listing(str(path), files)


@contextmanager
def gc_paused() -> Iterator[None]:
    # Millions of small objects trigger repeated full collections while unpickling;
    # nothing here forms cycles, so pausing the collector is safe and 3x faster.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            if gc.get_freeze_count() == 0:
                # Promote what was allocated meanwhile to the oldest generation in O(1):
                # otherwise the first allocation after enable() scans the millions of
                # new objects as one young generation (0.8 s for a million chunks).
                # Skipped when the process froze objects itself (unfreeze would thaw them).
                gc.freeze()
                gc.unfreeze()
            gc.enable()


def open_regular_fd(path: Path) -> tuple[int, os.stat_result] | None:
    """A descriptor on `path` and its stat if it is a regular file; None if it no longer is one.

    The directory can change after the listing: O_NONBLOCK keeps a FIFO swapped
    in from blocking open() for ever, O_NOFOLLOW keeps a symlink from leading
    out of the checkpoint. Any other error (EACCES, ENOENT after a delete, EIO)
    propagates: the validator cannot tell, which is not an invalid checkpoint.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):  # a symlink; a socket
            return None
        raise
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode):
            os.set_blocking(fd, True)
            return fd, st
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None


def open_regular(path: Path) -> io.BufferedReader:
    """`open_regular_fd` as a file object; ValueError (a finding) if `path` is no regular file."""
    opened = open_regular_fd(path)
    if opened is None:
        raise ValueError(f"{path.name} is not a regular file")
    return open(opened[0], "rb", closefd=True)


def parse_metadata_file(path: Path, size_cap: int = DEFAULT_METADATA_SIZE_CAP) -> Extracted | MetadataStandIn:
    """The C reader's model of one metadata file, or the Python unpickler's stand-ins where it declines.

    Raises ValueError when the file is over `size_cap` or not a regular file.
    """
    with open_regular(path) as f:
        data = f.read(size_cap + 1)
    if len(data) > size_cap:
        raise ValueError(f"{path.name} is larger than the {size_cap} byte cap")
    with gc_paused():
        return metaparse.parse(data) or load_metadata(data)


def read_checkpoint(path: str | os.PathLike[str], size_cap: int = DEFAULT_METADATA_SIZE_CAP) -> ReadOutcome:
    """Parse the checkpoint's metadata (DCP pickle or Hugging Face JSON) plus `stat`."""
    listing = list_directory(path)
    if METADATA_NAME in listing.files:
        names = [METADATA_NAME]
    elif listing.rank_metadata():
        names = listing.rank_metadata()
    elif HF_INDEX_NAME in listing.files or any(n.endswith(".safetensors") for n in listing.files):
        return _read_safetensors(listing)
    else:
        return ReadOutcome(listing, None)
    parsed: list[Extracted | MetadataStandIn] = []
    errors: dict[str, str] = {}
    for name in names:
        try:
            parsed.append(parse_metadata_file(Path(path) / name, size_cap))
        except (MemoryError, OSError):
            raise  # the validator failed, not the checkpoint: "cannot tell"
        except Exception as exc:  # any parse failure is a finding, never a crash
            errors[name] = f"{type(exc).__name__}: {exc}"
    if errors:
        return ReadOutcome(listing, None, "; ".join(f"{n}: {e}" for n, e in errors.items()), errors)
    try:
        checkpoint = _from_standins(listing, [listing.files[n] for n in names], parsed)
    except MemoryError:
        raise
    except Exception as exc:  # allowed classes in an unexpected shape: a finding, never a crash
        errors = {n: f"{type(exc).__name__}: {exc}" for n in names}
        return ReadOutcome(listing, None, "; ".join(f"{n}: {e}" for n, e in errors.items()), errors)
    return ReadOutcome(listing, checkpoint)


_new = tuple.__new__
# The per-chunk stand-ins hold their pickled state dict at [0]; these getters run in C
# over a million chunks (`map`), where a Python loop would cost ~1 us per chunk.
_state = itemgetter(0)
_offsets, _sizes = itemgetter("offsets"), itemgetter("sizes")
_fqn, _path = itemgetter("fqn"), itemgetter("relative_path")
_offset, _length = itemgetter("offset"), itemgetter("length")
_index_offset = methodcaller("get", "offset")
_transforms = methodcaller("get", "transform_descriptors")


def _tuple(value: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in value)


def _chunks(standins: Any) -> tuple[Chunk, ...]:
    states = list(map(_state, standins))
    offsets = list(map(tuple, map(_offsets, states)))
    sizes = list(map(tuple, map(_sizes, states)))
    # One C-speed pass over every value: a string or float offset must be a finding here,
    # not a TypeError out of the tiling rule later.
    if not set(map(type, chain.from_iterable(offsets))) <= {int} or not set(map(type, chain.from_iterable(sizes))) <= {
        int
    }:
        raise ValueError("chunk offsets and sizes must be integers")
    return tuple(map(_new, repeat(Chunk), zip(offsets, sizes, strict=True)))


def _storage_entries(storage_data: dict[Any, Any]) -> list[StorageEntry]:
    index_states = list(map(_state, storage_data))
    info_states = list(map(_state, storage_data.values()))
    keys = map(str, map(_fqn, index_states))
    chunk_offsets = [None if o is None else tuple(o) for o in map(_index_offset, index_states)]
    paths = map(str, map(_path, info_states))
    offsets = map(int, map(_offset, info_states))
    lengths = map(int, map(_length, info_states))
    transforms = [tuple(map(str, t)) if t else () for t in map(_transforms, info_states)]
    fields = zip(keys, chunk_offsets, paths, offsets, lengths, transforms, strict=True)
    return list(map(_new, repeat(StorageEntry), fields))


def _version(parsed: Extracted | MetadataStandIn) -> object:
    return parsed.version if isinstance(parsed, Extracted) else parsed.get("version")


def extract_standins(md: MetadataStandIn) -> Extracted:
    """The reader's model of one file from the Python unpickler's stand-ins (the C reader's reference)."""
    items: list[Item] = []
    for key, item in (md.get("state_dict_metadata") or {}).items():
        if isinstance(item, TensorStorageMetadataStandIn):
            # tuple.__new__ skips NamedTuple's Python-level __new__: 1M chunks, 0.5 s less.
            chunks = _chunks(item["chunks"])
            items.append((key, str(item["properties"].get("dtype")), _tuple(item["size"]), chunks))
        elif isinstance(item, BytesStorageMetadataStandIn):
            items.append((key, None))
        else:
            raise ValueError(f"unexpected metadata entry {type(item).__name__} for {key}")
    storage_data = md.get("storage_data") or {}
    if not isinstance(storage_data, dict):
        raise ValueError("storage_data is not a mapping")
    planner_data = md.get("planner_data")
    return Extracted(
        md.get("version"),
        items,
        _storage_entries(storage_data),
        planner_data if isinstance(planner_data, dict) else None,
    )


def _from_standins(
    listing: Listing, metadata_files: list[FileInfo], parsed: list[Extracted | MetadataStandIn]
) -> Checkpoint:
    tensors: dict[str, TensorEntry] = {}
    bytes_keys: set[str] = set()
    storage: list[StorageEntry] = []
    key_paths: dict[str, tuple[str, ...]] = {}
    versions = {_version(p) for p in parsed}
    for extracted in (p if isinstance(p, Extracted) else extract_standins(p) for p in parsed):
        for entry in extracted.items:
            if len(entry) == 2:
                bytes_keys.add(entry[0])
                continue
            key, dtype, size, chunks = entry
            previous = tensors.get(key)
            if previous is not None:
                # Per-rank metadata (use_collectives=False) lists each rank's chunks;
                # replicated items (steps, unsharded params) appear once per rank.
                seen = set(previous.chunks)
                chunks = previous.chunks + tuple(c for c in chunks if c not in seen)
            tensors[key] = TensorEntry(key, dtype, size, chunks)
        storage.extend(extracted.storage)
        if extracted.planner is not None:
            for key, key_path in extracted.planner.items():
                if isinstance(key_path, tuple | list):
                    key_paths[str(key)] = tuple(str(p) for p in key_path)
    temp = {n: f for n, f in listing.files.items() if n.endswith(".tmp")}
    data = {n: f for n, f in listing.files.items() if n.endswith(DATA_SUFFIXES)}
    version = versions.pop() if len(versions) == 1 else ",".join(sorted(map(str, versions)))
    return Checkpoint(
        path=listing.path,
        format=Format.TORCH_SAVE,
        metadata_files=tuple(metadata_files),
        version=None if version is None else str(version),
        tensors=tensors,
        bytes_keys=frozenset(bytes_keys),
        storage=tuple(storage),
        key_paths=key_paths,
        files=data,
        temp_files=temp,
    )


# --- Hugging Face safetensors layout (HuggingFaceStorageWriter) -------------------------

_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}
_HEADER_CAP = 100 << 20


def read_safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """Return the JSON header of a safetensors file and where its data starts."""
    with open_regular(path) as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError("file shorter than the safetensors header length")
        (n,) = struct.unpack("<Q", head)
        if n > _HEADER_CAP:
            raise ValueError(f"header length {n} is implausible")
        raw = f.read(n)
    header = json.loads(raw)
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    return header, 8 + n


def _read_safetensors(listing: Listing) -> ReadOutcome:
    tensors: dict[str, TensorEntry] = {}
    storage: list[StorageEntry] = []
    errors: dict[str, str] = {}
    names = sorted(n for n in listing.files if n.endswith(".safetensors"))
    for name in names:
        try:
            header, data_start = read_safetensors_header(Path(listing.path) / name)
            extra = header.pop("__metadata__", None) or {}
            sharding = json.loads(extra.get("DCP_SHARDING_INFO", "{}"))
            for key, info in header.items():
                shape = _tuple(info["shape"])
                begin, end = (int(x) for x in info["data_offsets"])
                offsets = _tuple(sharding.get(key, {}).get("saved_offsets", [0] * len(shape)))
                chunk = Chunk(offsets, shape)
                size = tuple(o + s for o, s in zip(offsets, shape, strict=True))
                dtype = _SAFETENSORS_DTYPES.get(str(info["dtype"]), str(info["dtype"]))
                previous = tensors.get(key)
                if previous is not None:
                    size = tuple(max(a, b) for a, b in zip(size, previous.size, strict=True))
                    chunks = (*previous.chunks, chunk)
                else:
                    chunks = (chunk,)
                tensors[key] = TensorEntry(key, dtype, size, chunks)
                storage.append(StorageEntry(key, offsets, name, data_start + begin, end - begin))
        except (MemoryError, OSError):
            raise
        except Exception as exc:  # a broken header is a finding, never a crash
            errors[name] = f"{type(exc).__name__}: {exc}"
    if errors:
        return ReadOutcome(listing, None, "; ".join(f"{n}: {e}" for n, e in errors.items()), errors)
    index_info = listing.files.get(HF_INDEX_NAME)
    checkpoint = Checkpoint(
        path=listing.path,
        format=Format.SAFETENSORS,
        metadata_files=(index_info,) if index_info else (),
        version="safetensors",
        tensors=tensors,
        bytes_keys=frozenset(),
        storage=tuple(storage),
        key_paths={},
        files={n: listing.files[n] for n in names},
        temp_files={n: f for n, f in listing.files.items() if n.endswith(".tmp")},
    )
    return ReadOutcome(listing, checkpoint)
