"""The data reader's parallel scan: CRC pieces combine exactly, value counts survive the cut."""

from __future__ import annotations

import os
import random
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchpulse.checkpoints.crc import crc32, crc32_combine
from torchpulse.checkpoints.data_reader import read_data
from torchpulse.checkpoints.model import DataReport
from torchpulse.checkpoints.reader import read_checkpoint
from torchpulse.checkpoints.zipview import central_directory

N = 300_000  # 1.2 MB of float32: many 4 KiB blocks, so two workers each get a part
EXP_AVG, EXP_AVG_SQ = "optim.state.w.exp_avg", "optim.state.w.exp_avg_sq"


def test_crc32_combine_matches_zlib_on_the_concatenation() -> None:
    rng = random.Random(5)
    for _ in range(300):
        a = rng.randbytes(rng.randrange(0, 5000))
        b = rng.randbytes(rng.randrange(0, 5000))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
        assert crc32(a + b, 0) == zlib.crc32(a + b)
    with pytest.raises(ValueError):
        crc32_combine(0, 0, -1)


@pytest.fixture(scope="module")
def large_item_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One model tensor and its AdamW-shaped state, with bad values on both sides of the cut."""
    exp_avg = torch.randn(N)
    exp_avg_sq = torch.rand(N)
    # Positions at the start, around the middle (where the two workers' parts meet for
    # 4 KiB blocks) and at the very end of the storage.
    for at in (0, N // 2 - 1, N // 2, N // 2 + 1024, N - 1):
        exp_avg[at] = float("nan")
    exp_avg[7] = float("inf")
    exp_avg_sq[N // 2 + 3] = -1.0
    exp_avg_sq[N - 2] = -2.0
    path = tmp_path_factory.mktemp("large") / "ckpt"
    state = {"model": {"w": torch.randn(N)}, "optim": {"state": {"w": {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}}}}
    dcp.save(state, checkpoint_id=path)
    return path


def _read(path: Path, block_size: int, workers: int) -> DataReport:
    outcome = read_checkpoint(path)
    assert outcome.checkpoint is not None
    return read_data(outcome.checkpoint, frozenset({EXP_AVG, EXP_AVG_SQ}), block_size=block_size, workers=workers)


@pytest.mark.parametrize(("block_size", "workers"), [(4096, 2), (4096, 3), (1 << 20, 2), (4096, 1)])
def test_every_cut_reports_the_same_exact_counts(large_item_checkpoint: Path, block_size: int, workers: int) -> None:
    report = _read(large_item_checkpoint, block_size, workers)
    assert report.problems == ()
    by_key = {t.key: t for t in report.tensors}
    assert (by_key[EXP_AVG].nonfinite, by_key[EXP_AVG].negative) == (6, 0)
    assert (by_key[EXP_AVG_SQ].nonfinite, by_key[EXP_AVG_SQ].negative) == (0, 2)
    assert (by_key["model.w"].nonfinite, by_key["model.w"].shape) == (0, (N,))  # not optimizer state: unchecked


def test_a_flipped_bit_in_the_second_part_is_a_crc_mismatch(large_item_checkpoint: Path, tmp_path: Path) -> None:
    copy = tmp_path / "ckpt"
    copy.mkdir()
    for f in large_item_checkpoint.iterdir():
        copy.joinpath(f.name).write_bytes(f.read_bytes())
    outcome = read_checkpoint(copy)
    assert outcome.checkpoint is not None
    entry = next(s for s in outcome.checkpoint.storage if s.key == "model.w")
    data = copy / entry.relative_path
    with open(data, "rb") as f:

        def read_at(offset: int, n: int) -> bytes:
            return os.pread(f.fileno(), n, entry.offset + offset)

        member = next(m for m in central_directory(read_at, entry.length) if "/data/" in m.name)
    # Far into the member, past its first half; the local header is < 200 bytes.
    at = entry.offset + member.local_offset + 200 + member.size * 3 // 4
    raw = bytearray(data.read_bytes())
    raw[at] ^= 1
    data.write_bytes(bytes(raw))
    report = _read(copy, 4096, 2)
    assert [(p.kind, p.key) for p in report.problems] == [("crc", "model.w")]


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32])
def test_dtypes_saved_through_untyped_storage_are_readable(tmp_path: Path, dtype: torch.dtype) -> None:
    """float8 and the unsigned ints have no legacy storage class: torch writes `torch.storage.UntypedStorage`."""
    dcp.save({"model": {"w": torch.zeros(4, 2).to(dtype)}}, checkpoint_id=tmp_path / "ckpt")
    outcome = read_checkpoint(tmp_path / "ckpt")
    assert outcome.checkpoint is not None
    report = read_data(outcome.checkpoint, frozenset())
    stored = [(t.key, t.dtype, t.shape) for t in report.tensors]
    assert ((), [("model.w", str(dtype).removeprefix("torch."), (4, 2))]) == (report.problems, stored)


@pytest.mark.parametrize("name", [".metadata", "model.safetensors"])
def test_a_metadata_file_swapped_for_a_fifo_is_refused_without_blocking(tmp_path: Path, name: str) -> None:
    """Between the listing and the read a FIFO can take the metadata's place: open() must not wait for a writer."""
    from torchpulse.checkpoints.reader import parse_metadata_file, read_safetensors_header

    fifo = tmp_path / name
    os.mkfifo(fifo)
    read = parse_metadata_file if name == ".metadata" else read_safetensors_header
    with pytest.raises(ValueError, match="not a regular file"):
        read(fifo)
    link = tmp_path / "link"
    link.symlink_to("/etc/hostname")
    with pytest.raises(ValueError, match="not a regular file"):
        read(link)
