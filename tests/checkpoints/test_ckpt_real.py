"""Real torch 2.13 checkpoints: pristine ones are valid, each corruption hits one rule."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from ckpt_corrupt import CORRUPTIONS, GAP, corrupt_copy, drop_chunk, settle, shift_chunk

from tests.support.checkpoints import SAVE_SCRIPT, run_ranks
from torchpulse.checkpoints.model import Level, Status, ValidationResult
from torchpulse.checkpoints.validate import validate

needs_zstd = pytest.mark.skipif(importlib.util.find_spec("zstandard") is None, reason="zstandard not installed")
needs_safetensors = pytest.mark.skipif(
    importlib.util.find_spec("safetensors") is None, reason="safetensors not installed"
)


def rule_set(result: ValidationResult) -> set[str]:
    return {f.rule for f in result.findings}


@pytest.mark.parametrize(
    "kind",
    [
        "single",
        "flat",
        "model_only",
        pytest.param("zstd", marks=needs_zstd),
        pytest.param("safetensors", marks=needs_safetensors),
    ],
)
@pytest.mark.parametrize("level", [Level.METADATA, Level.DATA])
def test_pristine_single_process_is_valid(single_root: Path, kind: str, level: Level) -> None:
    """Every freshly saved single-process checkpoint is valid at metadata and data level."""
    result = validate(single_root / kind, level)
    errors = [f for f in result.findings if f.severity.value != "info"]
    assert (Status.VALID, []) == (result.status, errors)


@pytest.mark.parametrize("kind", ["single", "flat"])
def test_pristine_loads_resharded(single_root: Path, kind: str) -> None:
    """The load level proves both key layouts load through torch's seed API."""
    result = validate(single_root / kind, Level.LOAD)
    assert (Status.VALID, ()) == (result.status, result.findings)


@pytest.fixture(scope="module")
def baseline(single_root: Path) -> set[str]:
    return rule_set(validate(single_root / "single", Level.DATA))


@pytest.mark.parametrize(("rule", "name", "corruption"), CORRUPTIONS, ids=[c[1] for c in CORRUPTIONS])
def test_each_corruption_is_detected_by_exactly_its_rule(
    single_root: Path, tmp_path: Path, baseline: set[str], rule: str, name: str, corruption: object
) -> None:
    """One broken copy per rule; the data level reports that rule and no other new one."""
    broken = corrupt_copy(single_root / "single", tmp_path / name, corruption)  # type: ignore[arg-type]
    result = validate(broken, Level.DATA)
    assert {rule} == rule_set(result) - baseline


def test_gap_in_model_only_checkpoint(single_root: Path, tmp_path: Path) -> None:
    """A global size larger than the chunks (rows never written) is a tiling error."""
    rule, name, corruption = GAP
    broken = corrupt_copy(single_root / "model_only", tmp_path / name, corruption)
    assert {rule} == rule_set(validate(broken, Level.METADATA)) - {"TP-CKPT-017"}


def test_metadata_level_reads_no_tensor_bytes(single_root: Path, tmp_path: Path) -> None:
    """The metadata level passes a checkpoint whose tensor bytes are all zeros."""
    broken = corrupt_copy(single_root / "single", tmp_path / "zeroed", lambda d: None)
    data = broken / "__0_0.distcp"
    data.write_bytes(b"\0" * data.stat().st_size)
    settle(broken)
    expected = (Status.VALID, Status.INVALID)
    actual = (validate(broken, Level.METADATA).status, validate(broken, Level.DATA).status)
    assert expected == actual


@pytest.mark.process
def test_overwrite_in_place_that_crashed_is_invalid(tmp_path: Path) -> None:
    """New data files under the old .metadata: stale metadata, reported invalid."""
    out = tmp_path / "overwrite"
    proc = subprocess.run([sys.executable, str(SAVE_SCRIPT), "overwrite_crash", str(out)])
    result = validate(out, Level.METADATA)
    assert (17, Status.INVALID, {"TP-CKPT-004"}) == (proc.returncode, result.status, rule_set(result))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fsdp2", "ddp2", "percollective2"])
def test_pristine_two_rank_checkpoints_are_valid(dist2_root: Path, kind: str) -> None:
    """FSDP2, DDP and per-rank-metadata saves from 2 real ranks load resharded and are valid."""
    result = validate(dist2_root / kind, Level.LOAD)
    assert (Status.VALID, ()) == (result.status, result.findings)


@pytest.mark.slow
def test_pristine_four_rank_uneven_fsdp2_is_valid(dist4_root: Path) -> None:
    """4-rank FSDP2 with a 5-row layer (shards 2, 2, 1, 0) is valid, zero-size chunk included."""
    from torchpulse.checkpoints.reader import read_checkpoint

    ckpt = read_checkpoint(dist4_root / "fsdp4").checkpoint
    assert ckpt is not None
    sizes = [c.sizes[0] for c in ckpt.tensors["model.2.weight"].chunks]
    result = validate(dist4_root / "fsdp4", Level.LOAD)
    assert (Status.VALID, (), [2, 2, 1, 0]) == (result.status, result.findings, sorted(sizes, reverse=True))


@pytest.mark.slow
def test_sharded_gap_and_equal_volume_overlap(dist2_root: Path, tmp_path: Path) -> None:
    """A dropped shard and a shifted shard (same volume) are tiling errors dcp.load accepts."""
    gap = corrupt_copy(dist2_root / "fsdp2", tmp_path / "gap",
                       lambda d: drop_chunk(d, "model.0.weight", 1))  # fmt: skip
    shifted = corrupt_copy(dist2_root / "fsdp2", tmp_path / "shift",
                           lambda d: shift_chunk(d, "model.0.weight", 1, [2, 0]))  # fmt: skip
    actual = (rule_set(validate(gap, Level.DATA)), rule_set(validate(shifted, Level.DATA)))
    assert ({"TP-CKPT-010"}, {"TP-CKPT-010"}) == actual


@pytest.mark.slow
def test_save_with_a_killed_rank_is_incomplete(tmp_path: Path) -> None:
    """Rank 1 is SIGKILLed after writing its data: no .metadata, reported incomplete."""
    out = tmp_path / "crashed"
    codes = run_ranks("crash", out, 2, timeout=90)
    result = validate(out, Level.DATA)
    assert (True, Status.INCOMPLETE, {"TP-CKPT-001"}) == (
        codes != [0, 0],
        result.status,
        rule_set(result),
    )
