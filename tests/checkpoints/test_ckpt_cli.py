"""The `torchpulse check` entry point and the worker process the daemon will use."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from torchpulse.checkpoints.cli import main
from torchpulse.checkpoints.model import Level, Status
from torchpulse.checkpoints.worker import Limits, validate_in_worker


def test_valid_checkpoint_json(single_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--format json prints the documented object and exits 0 for a valid checkpoint."""
    code = main([str(single_root / "single"), "--level", "metadata", "--format", "json"])
    out = json.loads(capsys.readouterr().out)
    expected = (0, "valid", "metadata", [], True)
    actual = (code, out["status"], out["level"], out["findings"], "duration_seconds" in out["stats"])
    assert expected == actual


def test_invalid_checkpoint_text(single_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An invalid checkpoint exits 1; the text output groups findings under their rule."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(single_root / "single", ckpt)
    (ckpt / "__0_0.distcp").unlink()
    code = main([str(ckpt), "--level", "metadata"])
    lines = capsys.readouterr().out.splitlines()
    assert (1, True, True) == (
        code,
        lines[0].startswith("INVALID:"),
        lines[1].startswith("  TP-CKPT-005"),
    )


def test_incomplete_and_usage_errors(tmp_path: Path) -> None:
    """No .metadata exits 3; a missing directory or a bad flag exits 2."""
    (tmp_path / "__0_0.distcp").write_bytes(b"x")
    codes = (
        main([str(tmp_path)]),
        main([str(tmp_path / "nope")]),
        main([str(tmp_path), "--level", "bogus"]),
    )
    assert (3, 2, 2) == codes


def test_module_entry_point(single_root: Path) -> None:
    """`python -m torchpulse.checkpoints.cli PATH` runs the check and exits 0."""
    proc = subprocess.run(
        [sys.executable, "-m", "torchpulse.checkpoints.cli", str(single_root / "flat")],
        capture_output=True,
        text=True,
    )
    assert (0, "VALID:") == (proc.returncode, proc.stdout[:6])


def test_worker_validates_in_a_child_process(single_root: Path) -> None:
    """The daemon's entry point returns the same result object, parsed from JSON."""
    result = validate_in_worker(single_root / "single", Level.DATA, Limits(drop_cache=True))
    assert (Status.VALID, Level.DATA) == (result.status, result.level)


def test_worker_timeout_is_an_error_result(single_root: Path) -> None:
    """A worker over its time limit is killed and reported as status error."""
    result = validate_in_worker(single_root / "single", Level.DATA, Limits(timeout_seconds=0.01))
    assert (Status.ERROR, ["TP-CKPT-000"]) == (result.status, [f.rule for f in result.findings])


def test_worker_memory_limit_is_an_error_result(single_root: Path) -> None:
    """A worker that cannot even import torch under its memory limit reports an error."""
    result = validate_in_worker(single_root / "single", Level.DATA, Limits(memory_bytes=64 << 20))
    assert Status.ERROR == result.status
