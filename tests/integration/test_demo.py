"""`make demo` end to end: daemon, a real torchrun job of 2 ranks, and the printed summary."""

from __future__ import annotations

import subprocess
import sys

from tests.support import REPO


def test_demo_prints_a_summary_row_per_rank() -> None:
    """The demo exits 0 and its table shows both torchrun ranks with every step counted."""
    result = subprocess.run([sys.executable, "-m", "torchpulse.demo", "--steps", "20"], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert 0 == result.returncode, result.stdout + result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith("demo ")]
    assert [["demo", "0", "no", "20"], ["demo", "1", "no", "20"]] == [row[:4] for row in rows]
    assert "== torchpulse status" in result.stdout
