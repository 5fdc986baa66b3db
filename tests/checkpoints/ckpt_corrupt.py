"""Makes one broken copy of a real checkpoint per rule, each breaking exactly one thing."""

from __future__ import annotations

import datetime
import io
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from torchpulse.checkpoints.zipview import central_directory, data_offset

DATA = "__0_0.distcp"


def load_md(d: Path) -> Metadata:
    with open(d / ".metadata", "rb") as f:
        return pickle.load(f)  # the test's own pristine file, never a hostile one


def save_md(d: Path, md: Metadata) -> None:
    with open(d / ".metadata", "wb") as f:
        pickle.dump(md, f)
    settle(d)


def settle(d: Path) -> None:
    """Make every data file older than .metadata, as after a clean save."""
    when = (d / ".metadata").stat().st_mtime_ns
    for p in d.iterdir():
        if p.name.endswith(".distcp"):
            os.utime(p, ns=(when - 10**10, when - 10**10))


def entry(md: Metadata, key: str) -> tuple[MetadataIndex, _StorageInfo]:
    for index, info in md.storage_data.items():
        if index.fqn == key:
            return index, info
    raise KeyError(key)


def replace_item(d: Path, md: Metadata, key: str, obj: object) -> None:
    """Append `torch.save(obj)` to the data file and point the item at it."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    path = d / DATA
    offset = path.stat().st_size
    with open(path, "ab") as f:
        f.write(buf.getvalue())
    index, _ = entry(md, key)
    md.storage_data[index] = _StorageInfo(DATA, offset, len(buf.getvalue()))


def storage_data_offset(d: Path, md: Metadata, key: str) -> int:
    """Absolute file offset of the tensor bytes of item `key`."""
    _, info = entry(md, key)
    fd = os.open(d / info.relative_path, os.O_RDONLY)
    try:

        def read_at(o: int, n: int) -> bytes:
            return os.pread(fd, n, info.offset + o)

        member = next(m for m in central_directory(read_at, info.length) if "/data/" in m.name)
        return info.offset + data_offset(read_at, member)
    finally:
        os.close(fd)


def patch_bytes(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


W, B2 = "optim.state.0.weight", "optim.state.2.bias"


def _missing_metadata(d: Path) -> None:
    (d / ".metadata").unlink()


def _only_tmp(d: Path) -> None:
    (d / ".metadata").rename(d / ".metadata.tmp")


def _tmp_beside(d: Path) -> None:
    shutil.copy(d / ".metadata", d / ".metadata.tmp")
    old = (d / ".metadata").stat().st_mtime_ns - 10**11
    os.utime(d / ".metadata.tmp", ns=(old, old))
    settle(d)


def _stale(d: Path) -> None:
    future = (d / ".metadata").stat().st_mtime_ns + 10**10
    os.utime(d / DATA, ns=(future, future))


def _missing_file(d: Path) -> None:
    (d / DATA).unlink()


def _past_eof(d: Path) -> None:
    path = d / DATA
    os.truncate(path, path.stat().st_size - 100)
    settle(d)


def _overlap_items(d: Path) -> None:
    md = load_md(d)
    index, _ = entry(md, f"{W}.exp_avg")
    md.storage_data[index] = entry(md, f"{W}.exp_avg_sq")[1]
    save_md(d, md)


def _unreferenced(d: Path) -> None:
    shutil.copy(d / DATA, d / "__7_0.distcp")
    settle(d)


def _no_storage(d: Path) -> None:
    md = load_md(d)
    del md.storage_data[entry(md, "model.0.bias")[0]]
    save_md(d, md)


def _gap(d: Path) -> None:
    # Only for the model-only checkpoint: a larger global size leaves rows unwritten.
    md = load_md(d)
    md.state_dict_metadata["model.0.weight"].size = torch.Size([10, 4])
    save_md(d, md)


def _version(d: Path) -> None:
    md = load_md(d)
    md.version = "9.9.9"
    save_md(d, md)


def _garbage_metadata(d: Path) -> None:
    (d / ".metadata").write_bytes(b"\x80\x04not a pickle at all")
    settle(d)


def _state_shape(d: Path) -> None:
    md = load_md(d)
    replace_item(d, md, f"{W}.exp_avg", torch.zeros(4, 8))
    tensor_md = md.state_dict_metadata[f"{W}.exp_avg"]
    tensor_md.size = torch.Size([4, 8])
    tensor_md.chunks[0].sizes = torch.Size([4, 8])
    save_md(d, md)


def _state_missing(d: Path) -> None:
    md = load_md(d)
    key = f"{B2}.exp_avg"
    del md.state_dict_metadata[key], md.storage_data[entry(md, key)[0]], md.planner_data[key]
    save_md(d, md)


def _params(names: Callable[[list[str]], list[str]]) -> Callable[[Path], None]:
    def corrupt(d: Path) -> None:
        md = load_md(d)
        replace_item(d, md, "optim.param_groups.0.params",
                     names(["0.weight", "0.bias", "2.weight", "2.bias"]))  # fmt: skip
        save_md(d, md)

    return corrupt


def _step(d: Path) -> None:
    md = load_md(d)
    replace_item(d, md, f"{B2}.step", torch.tensor(7.0))
    save_md(d, md)


def _mixed_precision(d: Path) -> None:
    md = load_md(d)
    replace_item(d, md, f"{W}.exp_avg", torch.zeros(8, 4, dtype=torch.bfloat16))
    md.state_dict_metadata[f"{W}.exp_avg"].properties.dtype = torch.bfloat16
    save_md(d, md)


def _dtype(d: Path) -> None:
    md = load_md(d)
    md.state_dict_metadata["model.0.weight"].properties.dtype = torch.float64
    save_md(d, md)


def _stored_shape(d: Path) -> None:
    md = load_md(d)
    replace_item(d, md, "model.0.bias", torch.zeros(4))
    save_md(d, md)


def _nan(d: Path) -> None:
    md = load_md(d)
    value = torch.zeros(8, 4)
    value[1, 2] = float("nan")
    value[3, 3] = float("inf")
    replace_item(d, md, f"{W}.exp_avg", value)
    save_md(d, md)


def _negative(d: Path) -> None:
    md = load_md(d)
    replace_item(d, md, f"{W}.exp_avg_sq", -torch.ones(8, 4))
    save_md(d, md)


def _crc(d: Path) -> None:
    md = load_md(d)
    at = storage_data_offset(d, md, "model.0.weight")
    with open(d / DATA, "rb") as f:
        f.seek(at)
        byte = f.read(1)[0]
    patch_bytes(d / DATA, at, bytes([byte ^ 1]))  # lowest mantissa bit: still finite
    settle(d)


def _unreadable(d: Path) -> None:
    md = load_md(d)
    _, info = entry(md, "model.0.bias")
    patch_bytes(d / info.relative_path, info.offset + info.length - 22, b"\0" * 4)
    settle(d)


def _unverifiable(d: Path) -> None:
    md = load_md(d)
    replace_item(d, md, "optim.param_groups.0.lr", datetime.timedelta(days=1))
    save_md(d, md)


# rule -> (name, corruption); applied to the nested single-process checkpoint.
CORRUPTIONS: list[tuple[str, str, Callable[[Path], None]]] = [
    ("TP-CKPT-001", "missing_metadata", _missing_metadata),
    ("TP-CKPT-002", "only_tmp", _only_tmp),
    ("TP-CKPT-003", "tmp_beside", _tmp_beside),
    ("TP-CKPT-004", "stale", _stale),
    ("TP-CKPT-005", "missing_file", _missing_file),
    ("TP-CKPT-006", "past_eof", _past_eof),
    ("TP-CKPT-007", "overlapping_items", _overlap_items),
    ("TP-CKPT-008", "unreferenced", _unreferenced),
    ("TP-CKPT-009", "no_storage", _no_storage),
    ("TP-CKPT-011", "version", _version),
    ("TP-CKPT-012", "garbage_metadata", _garbage_metadata),
    ("TP-CKPT-013", "state_shape", _state_shape),
    ("TP-CKPT-014", "state_missing", _state_missing),
    ("TP-CKPT-015", "params_missing", _params(lambda n: n[:-1])),
    ("TP-CKPT-015", "params_duplicated", _params(lambda n: [*n, n[0]])),
    ("TP-CKPT-016", "step", _step),
    ("TP-CKPT-018", "mixed_precision", _mixed_precision),
    ("TP-CKPT-019", "dtype", _dtype),
    ("TP-CKPT-020", "stored_shape", _stored_shape),
    ("TP-CKPT-021", "nan", _nan),
    ("TP-CKPT-022", "negative", _negative),
    ("TP-CKPT-023", "crc", _crc),
    ("TP-CKPT-024", "unreadable", _unreadable),
    ("TP-CKPT-025", "unverifiable", _unverifiable),
]

# Tiling corruptions need the right source checkpoint.
GAP = ("TP-CKPT-010", "gap", _gap)


def corrupt_copy(src: Path, dst: Path, corruption: Callable[[Path], None]) -> Path:
    shutil.copytree(src, dst)
    settle(dst) if (dst / ".metadata").exists() else None
    corruption(dst)
    return dst


def shift_chunk(d: Path, key: str, chunk_index: int, new_offset: list[int]) -> None:
    """Move one chunk (and its storage key) so it overlaps a neighbour with equal volume."""
    md = load_md(d)
    chunk = md.state_dict_metadata[key].chunks[chunk_index]
    old = chunk.offsets
    chunk.offsets = torch.Size(new_offset)
    for index in list(md.storage_data):
        if index.fqn == key and index.offset == old:
            md.storage_data[MetadataIndex(key, new_offset)] = md.storage_data.pop(index)
    save_md(d, md)


def drop_chunk(d: Path, key: str, chunk_index: int) -> None:
    """Remove one chunk and its storage entry: a gap that dcp.load never notices."""
    md = load_md(d)
    chunk = md.state_dict_metadata[key].chunks.pop(chunk_index)
    for index in list(md.storage_data):
        if index.fqn == key and index.offset == chunk.offsets:
            del md.storage_data[index]
    save_md(d, md)
