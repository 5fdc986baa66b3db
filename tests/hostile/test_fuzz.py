"""CI's short run of the atheris harnesses (`make fuzz` runs them longer); skipped where atheris is missing."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.support import REPO

pytest.importorskip("atheris")
SECONDS = int(os.environ.get("FUZZ_CI_SECONDS", "10"))
HARNESSES = ["fuzz_frames", "fuzz_metadata"]


@pytest.mark.slow
@pytest.mark.parametrize("harness", HARNESSES)
def test_harness_runs_clean_for_a_short_time(harness: str, tmp_path: os.PathLike[str]) -> None:
    """The harness runs its time budget with no crash, hang, leak or out-of-memory, and does real work."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "fuzz" / f"{harness}.py"), f"-max_total_time={SECONDS}", "-timeout=10",
         "-rss_limit_mb=3072", f"-artifact_prefix={tmp_path}/"],
        capture_output=True, text=True, timeout=SECONDS + 90, cwd=REPO,
    )
    done = re.search(r"Done (\d+) runs", proc.stderr)
    assert (0, True) == (proc.returncode, done is not None), proc.stderr[-3000:]
    assert int(done.group(1)) > 100  # type: ignore[union-attr]
