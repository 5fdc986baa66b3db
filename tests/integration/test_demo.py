"""`make demo` end to end: daemon, a real torchrun job of 2 ranks, and the printed summary."""

from __future__ import annotations

import subprocess
import sys

from tests.support import REPO


def test_demo_shows_every_probe_and_the_validated_checkpoints() -> None:
    """The demo exits 0; its tables show both torchrun ranks with every optimizer step (one skipped for
    the injected NaN), every backward pass, the non-finite pass, a recompile, both saves and the deliberate
    failed save per rank, valid checkpoints, and the latest one invalid after a save into it died half way."""
    result = subprocess.run([sys.executable, "-m", "torchpulse.demo", "--steps", "20"], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert 0 == result.returncode, result.stdout + result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith("demo ")]
    assert [["demo", "0", "exited", "19"], ["demo", "1", "exited", "19"],
            ["demo", "0", "20", "1", "2", "2", "4", "-"], ["demo", "1", "20", "1", "2", "2", "4", "-"],
            ["demo", "0", "2", "1", "save", "NotADirectoryError", "x1"],
            ["demo", "1", "2", "1", "save", "NotADirectoryError", "x1"]] == [
        row[:4] if len(row) > 8 else row for row in rows]
    assert "DELIBERATE failing checkpoint save" in result.stdout
    assert 2 == result.stdout.count("daemon log: rank ")
    lines = result.stdout.splitlines()
    validated, after_the_crash = [line.split() for line in lines if line.startswith("/") and "/checkpoints " in line]
    assert ["valid", "2"] == validated[1:3]
    # The simulated save that died half way into the latest checkpoint: validated again, invalid.
    assert (["invalid", "3"], "TP-CKPT-004") == (after_the_crash[1:3], after_the_crash[5])
    assert "== torchpulse status" in result.stdout
