"""CI's short run of the atheris harnesses (`make fuzz` runs them longer); skipped where atheris is missing."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.support import REPO

pytest.importorskip("atheris")
# A fixed seed and run count: CI must give the same answer every time, and a failure here
# must reproduce with the same command. `make fuzz` is the open-ended, time-bounded search.
SEED = 1
RUNS = {"fuzz_frames": 5_000, "fuzz_metadata": 150_000}
HARNESSES = sorted(RUNS)
# CPython under the harness' address-space cap prints this for some inputs; it is not a finding.
NOISE = "SystemError: deallocated bytearray object has exported buffers"


@pytest.mark.slow
@pytest.mark.parametrize("harness", HARNESSES)
def test_harness_runs_clean_for_a_short_time(harness: str, tmp_path: os.PathLike[str]) -> None:
    """The harness runs its time budget with no crash, hang, leak or out-of-memory, and does real work."""
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "fuzz" / f"{harness}.py"),
            f"-seed={SEED}",
            f"-runs={RUNS[harness]}",
            "-timeout=10",
            "-rss_limit_mb=3072",
            f"-artifact_prefix={tmp_path}/",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
    )
    done = re.search(r"Done (\d+) runs", proc.stderr)
    tail = "\n".join(line for line in proc.stderr.splitlines() if NOISE not in line)[-3000:]
    assert (0, True) == (proc.returncode, done is not None), tail
    assert int(done.group(1)) > 100  # type: ignore[union-attr]
