"""Checkpoint faults with real validation workers: bursts, deletions, workers killed at their limits."""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import DaemonProcess, child_of, select, start_daemon, wait_for
from tests.support.checkpoints import commit_copy

pytestmark = pytest.mark.slow

WORKER_MODULE = b"torchpulse.checkpoints.worker"  # in the command line of the worker the daemon validates in


@pytest.fixture
def watched(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    root = tmp_path / "ckpt"
    root.mkdir()
    yield root, tmp_path / "torchpulse.toml"


def _start(tmp_path: Path, config: Path, root: Path, body: str) -> DaemonProcess:
    config.write_text(f'[checkpoints]\nroots = [{{ path = "{root}", observer = "inotify" }}]\n{body}')
    return start_daemon(tmp_path, extra_args=["--config", str(config)])


def _validations(daemon: DaemonProcess, root: Path) -> dict[str, float]:
    samples = select(daemon.scrape(), "torchpulse_checkpoint_validations_total", root=str(root))
    return {dict(k)["status"]: v for k, v in samples.items() if v}


def _validated(daemon: DaemonProcess) -> Counter[str]:
    return Counter(str(e["path"]) for e in daemon.log_lines() if e.get("event") == "checkpoint validated")


def test_fifty_checkpoints_at_once_are_each_validated_exactly_once(
    tmp_path: Path, watched: tuple[Path, Path], saved_checkpoint: Path
) -> None:
    """A burst of 50 commits is validated with bounded concurrency: none lost, none twice."""
    root, config = watched
    daemon = _start(tmp_path, config, root, 'level = "metadata"\nmax_concurrent_validations = 3\n')
    try:
        for step in range(50):
            commit_copy(saved_checkpoint, root / f"step-{step:03d}")
        wait_for(lambda: {"valid": 50.0} == _validations(daemon, root), timeout=120)
        time.sleep(1.0)  # a late duplicate would show up here
        counts = _validated(daemon)
        assert (50, {1}) == (len(counts), set(counts.values()))
        assert {"valid": 50.0} == _validations(daemon, root)
    finally:
        daemon.stop()


def test_a_checkpoint_deleted_during_validation_is_reported_and_the_daemon_goes_on(
    tmp_path: Path, watched: tuple[Path, Path], saved_checkpoint: Path
) -> None:
    """Deleting a directory under a running data-level validation (retention does this) discards the
    result with a log line, records nothing, and the next checkpoint validates."""
    root, config = watched
    daemon = _start(tmp_path, config, root, 'level = "data"\n')
    try:
        commit_copy(saved_checkpoint, root / "step-1")
        # Deleted only once its worker runs, and while it is stopped: deleted before (a loaded machine, the
        # debounce and the daemon's stats not done yet) it "vanished before validation"; after the worker
        # finished, it was validated. Either way the line awaited below never came.
        worker = child_of(daemon.proc.pid, WORKER_MODULE, timeout=60)
        os.kill(worker, signal.SIGSTOP)
        try:
            shutil.rmtree(root / "step-1")
        finally:
            os.kill(worker, signal.SIGCONT)
        wait_for(
            lambda: any(
                e.get("event") == "checkpoint deleted during validation; result discarded" for e in daemon.log_lines()
            ),
            timeout=60,
        )
        assert {} == _validations(daemon, root)
        commit_copy(saved_checkpoint, root / "step-2")
        wait_for(lambda: 1.0 == _validations(daemon, root).get("valid"), timeout=60)
        assert daemon.proc.poll() is None
    finally:
        daemon.stop()


@pytest.mark.parametrize(
    ("limit", "reason"),
    [("validation_timeout_seconds = 0.2", "time"), ("validation_memory_limit_bytes = 104857600", "memory")],
)
def test_a_worker_killed_at_its_limit_is_reported_and_validation_resumes_after_reload(
    tmp_path: Path, watched: tuple[Path, Path], saved_checkpoint: Path, limit: str, reason: str
) -> None:
    """A worker past its time or memory limit is killed and reported as `error`; after SIGHUP with
    sane limits the next checkpoint validates, in the same daemon process."""
    root, config = watched
    daemon = _start(tmp_path, config, root, f'level = "data"\n{limit}\n')
    try:
        commit_copy(saved_checkpoint, root / "step-1")
        wait_for(lambda: {"error": 1.0} == _validations(daemon, root), timeout=60)
        findings = select(daemon.scrape(), "torchpulse_checkpoint_findings", root=str(root), rule="TP-CKPT-000")
        assert [1.0] == [v for v in findings.values() if v], reason
        config.write_text(f'[checkpoints]\nroots = [{{ path = "{root}", observer = "inotify" }}]\nlevel = "data"\n')
        daemon.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: any(e.get("event") == "config reloaded" for e in daemon.log_lines()))
        commit_copy(saved_checkpoint, root / "step-2")
        wait_for(lambda: 1.0 == _validations(daemon, root).get("valid"), timeout=60)
    finally:
        daemon.stop()
