"""`make demo` end to end: daemon, a real torchrun job of 2 ranks, and the printed summary."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.support import REPO

# A node type as torch names it: a backward node, or the node that accumulates a leaf's gradient.
NODE_TYPE = r"(?:\w+Backward\d*|AccumulateGrad)"


@pytest.mark.process
def test_demo_shows_every_probe_and_the_validated_checkpoints() -> None:
    """The demo exits 0; its tables show both torchrun ranks with every optimizer step (one skipped for
    the injected NaN), every backward pass, the non-finite pass and the parameter it named, the first
    pass timed node by node, a recompile, both saves and the deliberate failed save per rank, valid
    checkpoints, and the latest one invalid after a save into it died half way."""
    result = subprocess.run(
        [sys.executable, "-m", "torchpulse.demo", "--steps", "20"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert 0 == result.returncode, result.stdout + result.stderr
    sections = result.stdout.split("\n== ")
    [node_times] = [section for section in sections if section.startswith("where backward time goes")]
    node_rows = [line.split(None, 3) for line in node_times.splitlines() if line.startswith("demo ")]
    assert [["demo", "0", "1"], ["demo", "1", "1"]] == [row[:3] for row in node_rows]
    for *_key, slowest in node_rows:  # three node types of the demo's model, each timed, slowest first
        times = [re.fullmatch(rf"({NODE_TYPE}) ([0-9.]+) ms x([0-9]+)", entry) for entry in slowest.split(", ")]
        assert 3 == len(times) and all(times), slowest
        milliseconds = [float(match[2]) for match in times if match]
        assert sorted(milliseconds, reverse=True) == milliseconds and milliseconds[-1] > 0
    rows = [
        line.split()
        for line in result.stdout.splitlines()
        if line.startswith("demo ") and line not in node_times.splitlines()
    ]
    assert [
        ["demo", "0", "exited", "19"],
        ["demo", "1", "exited", "19"],
        ["demo", "0", "20", "1", "2", "2", "4", "-"],
        ["demo", "1", "20", "1", "2", "2", "4", "-"],
        ["demo", "0", "2", "1", "save", "NotADirectoryError", "x1"],
        ["demo", "1", "2", "1", "save", "NotADirectoryError", "x1"],
    ] == [row[:4] if len(row) > 8 else row for row in rows]
    assert "DELIBERATE failing checkpoint save" in result.stdout
    assert 4 == result.stdout.count("daemon log: rank ")
    for rank in (0, 1):
        assert (
            f"daemon log: rank {rank} warning: pass 4 (backward): non-finite gradients in 1 of 27 parameters: head.bias"
        ) in result.stdout
    lines = result.stdout.splitlines()
    validated, after_the_crash = [line.split() for line in lines if line.startswith("/") and "/checkpoints " in line]
    assert ["valid", "2"] == validated[1:3]
    # The simulated save that died half way into the latest checkpoint: validated again, invalid.
    assert (["invalid", "3"], "TP-CKPT-004") == (after_the_crash[1:3], after_the_crash[5])
    assert "== torchpulse status" in result.stdout
