"""A daemon that runs for months on a node with a new job every hour: what it keeps of roots stays bounded."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import sqlite3
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from tests.support import DaemonProcess, select, start_daemon, wait_for
from tests.support.checkpoints import commit_copy
from torchpulse.daemon.checkpoints.config import CheckpointsConfig, RootConfig
from torchpulse.daemon.checkpoints.scan import metadata_key
from torchpulse.daemon.checkpoints.service import CheckpointService
from torchpulse.daemon.checkpoints.state import DB_NAME, Record, StateStore
from torchpulse.limits import MAX_LOGGED_ONCE
from torchpulse.protocol import CHECKPOINT_SAVED_EVENT, Batch, CheckpointSaved, Goodbye, Hello, LogEvent, encode

pytestmark = pytest.mark.slow
FOLDED = 'too many announced checkpoint roots; this one is validated but not watched and its metrics use root="other"'


def _config(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "torchpulse.toml"
    # Metadata level: the worker reads no tensor bytes, so validations take a fraction of a second.
    path.write_text(f'[checkpoints]\nlevel = "metadata"\nincomplete_after_seconds = 2\n{body}')
    return path


def _announce(daemon: DaemonProcess, *paths: Path) -> None:
    """Announce `paths` as rank 0's saves over the agent socket, as the checkpoint probe does."""
    events = [
        LogEvent(
            time.time(),
            "info",
            CHECKPOINT_SAVED_EVENT,
            {"path": str(path), "api": "save", "duration_seconds": 1.0, "validate": True},
        )
        for path in paths
    ]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(daemon.socket_path))
        sock.sendall(encode(Hello("job", 0, 0, 1, os.getpid(), "h", "2.13.0", "0.1.0", "test", time.time())))
        sock.recv(4096)  # Welcome
        sock.sendall(encode(Batch(1, time.time(), [], [], events)) + encode(Goodbye("exit")))


def _roots(daemon: DaemonProcess) -> set[str]:
    """Root labels on any checkpoint series of /metrics."""
    return {
        dict(labels)["root"]
        for (name, labels) in daemon.scrape()
        if name.startswith("torchpulse_checkpoint_") and "root" in dict(labels)
    }


def _valid(daemon: DaemonProcess, root: str) -> float:
    return sum(select(daemon.scrape(), "torchpulse_checkpoint_validations_total", root=root, status="valid").values())


def _rows(state_dir: Path, sql: str) -> list[str]:
    db = sqlite3.connect(state_dir / DB_NAME)
    try:
        return sorted(str(row[0]) for row in db.execute(sql))
    finally:
        db.close()


def _two_jobs(
    tmp_path: Path, saved_checkpoint: Path, stopper: list[DaemonProcess], settings: str
) -> tuple[DaemonProcess, Path, Path]:
    """A daemon with these [checkpoints] settings, and a committed checkpoint in each of two jobs' directories."""
    job_a, job_b = tmp_path / "jobA" / "step-1", tmp_path / "jobB" / "step-1"
    commit_copy(saved_checkpoint, job_a)
    commit_copy(saved_checkpoint, job_b)
    daemon = start_daemon(tmp_path, extra_args=["--config", str(_config(tmp_path, settings))])
    stopper.append(daemon)
    return daemon, job_a, job_b


def test_expired_roots_leave_metrics_and_the_state_file_and_other_expires_too(
    tmp_path: Path, saved_checkpoint: Path, stopper: list[DaemonProcess]
) -> None:
    """Job A gets the one slot, job B folds into "other"; past the TTL neither is exported, and once their
    directories are deleted no row of them is kept (before, each kept its newest row forever)."""
    daemon, job_a, job_b = _two_jobs(
        tmp_path, saved_checkpoint, stopper, "max_announced_roots = 1\nannounced_root_ttl_seconds = 4\n"
    )
    _announce(daemon, job_a, job_b)
    wait_for(lambda: 1 == _valid(daemon, str(job_a.parent)) == _valid(daemon, "other"), timeout=30)
    # "other" says when a job last saved there, as announced roots do: NoValidCheckpointRecently leaves it alone.
    assert 1 == len(select(daemon.scrape(), "torchpulse_checkpoint_last_announced_timestamp_seconds", root="other"))
    wait_for(lambda: set() == _roots(daemon), timeout=15)  # TTL, then a sweep (every 0.5 s)
    assert 0 == daemon.stop()
    for job in (job_a, job_b):
        shutil.rmtree(job.parent)  # the jobs' clean-up
    # A restart dates "other"'s last announcement by its last validation (no announcement time is stored),
    # and the first sweep prunes: start once that is past the TTL too, or a loaded machine, whose validation
    # ended later than the restart takes, keeps "other" exported, and its row, for one more TTL.
    validated = max(float(at) for at in _rows(daemon.state_dir, "SELECT validated_at FROM checkpoints"))
    time.sleep(max(0.0, validated + 4.5 - time.time()))
    again = daemon.restart()
    stopper.append(again)
    # The first sweep prunes: rows of roots that export nothing go with their directories.
    wait_for(lambda: [] == _rows(again.state_dir, "SELECT path FROM checkpoints"), timeout=15)
    assert set() == _roots(again)


def test_lowering_max_announced_roots_on_reload_drops_the_oldest_roots(
    tmp_path: Path, saved_checkpoint: Path, stopper: list[DaemonProcess]
) -> None:
    """A reload applies max_announced_roots at once: the root announced longest ago stops being watched, its
    series and its stored row go (before, it stayed watched, and its row stayed in the file for good)."""
    daemon, job_a, job_b = _two_jobs(tmp_path, saved_checkpoint, stopper, "max_announced_roots = 2\n")
    _announce(daemon, job_a)
    wait_for(lambda: 1 == _valid(daemon, str(job_a.parent)), timeout=30)
    _announce(daemon, job_b)
    wait_for(lambda: 1 == _valid(daemon, str(job_b.parent)), timeout=30)
    config = tmp_path / "torchpulse.toml"  # written by _two_jobs
    config.write_text(config.read_text().replace("max_announced_roots = 2", "max_announced_roots = 1"))
    daemon.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: {str(job_b.parent)} == _roots(daemon), timeout=15)
    assert [str(job_b.parent)] == _rows(daemon.state_dir, "SELECT path FROM announced_roots")


def test_a_folded_directory_configured_later_is_exported_under_its_own_name(
    tmp_path: Path, saved_checkpoint: Path, stopper: list[DaemonProcess]
) -> None:
    """A directory once folded into "other" and then added to the config is a root like any other (before,
    every series of it said root="other" for the rest of the daemon's life)."""
    job = tmp_path / "job"
    commit_copy(saved_checkpoint, job / "step-1")
    config = _config(tmp_path, "max_announced_roots = 0\n")
    daemon = start_daemon(tmp_path, extra_args=["--config", str(config)])
    stopper.append(daemon)
    _announce(daemon, job / "step-1")
    wait_for(lambda: 1 == _valid(daemon, "other"), timeout=30)
    config.write_text(config.read_text() + f'roots = ["{job}"]\n')
    daemon.proc.send_signal(signal.SIGHUP)
    wait_for(
        lambda: 1 == sum(select(daemon.scrape(), "torchpulse_checkpoint_root_readable", root=str(job)).values()),
        timeout=15,
    )
    commit_copy(saved_checkpoint, job / "step-2")
    wait_for(lambda: 1 == _valid(daemon, str(job)), timeout=30)
    assert 1 == _valid(daemon, "other")


def test_the_warning_about_folded_directories_remembers_a_bounded_number_of_them(tmp_path: Path) -> None:
    """Each folded directory is warned about once, in a bounded memory: past MAX_LOGGED_ONCE others, the first
    one is news again (before, every folded directory was kept for the daemon's life)."""
    first = tmp_path / "job-first" / "step-1"
    others = [tmp_path / f"job-{n}" / "step-1" for n in range(MAX_LOGGED_ONCE)]

    async def main() -> None:
        (tmp_path / "state").mkdir()
        service = CheckpointService(
            CheckpointsConfig(max_announced_roots=0, debounce_seconds=3600.0), tmp_path / "state"
        )
        await service.start()
        try:
            with capture_logs() as logs:
                for path in (first, *others, first):
                    service.announce("job", 0, CheckpointSaved(str(path), "save", 1.0, True))
        finally:
            await service.close()
        warned = [str(line["root"]) for line in logs if line["event"] == FOLDED]
        assert (MAX_LOGGED_ONCE + 2, [str(first.parent)] * 2) == (
            len(warned),
            [root for root in warned if root == str(first.parent)],
        )

    asyncio.run(main())


def test_a_sweep_reads_a_roots_records_in_one_query(tmp_path: Path) -> None:
    """1,500 recorded checkpoints: a sweep asks SQLite once, not once per directory (8,200 lookups blocked the
    loop ~0.2 s in the audit), and finds every one of them known."""
    root = tmp_path / "root"
    marker = tmp_path / "metadata"
    marker.write_bytes(b"x")
    steps = [root / f"step-{n:04d}" for n in range(1500)]
    for step in steps:
        step.mkdir(parents=True)
        os.link(marker, step / ".metadata")  # one inode: cheap to make, and a real commit marker to the scan
    store = StateStore(tmp_path / "state")
    store._db.execute("BEGIN")  # one transaction: a commit per row would sync 1,500 times
    for step in steps:
        found = metadata_key(str(step))
        assert found is not None
        store.save(Record(str(step), str(root), found[0], "valid", "metadata", time.time(), found[1], 1, 0.1, {}))
    store._db.execute("COMMIT")
    store.close()
    config = CheckpointsConfig(roots=(RootConfig(str(root), "polling"),), poll_interval_seconds=3600.0)

    async def main() -> None:
        service = CheckpointService(config, tmp_path / "state")
        await service.start()
        try:
            while not service.sweeps.scans:  # the start's own sweep: waited for, so that it asks nothing below
                await asyncio.sleep(0.01)
            await asyncio.gather(*service.sweeps.scans.values())
            if service.sweeps.prune_task is not None:  # the start's prune too: it reads the table as well
                await service.sweeps.prune_task
            assert service.store is not None
            statements: list[str] = []
            service.store._db.set_trace_callback(statements.append)
            task = service.sweeps.start_scan(str(root))
            assert task is not None
            await task
            service.store._db.set_trace_callback(None)
            assert (1, {}) == (len(statements), service.queue.pending)
        finally:
            await service.close()

    asyncio.run(main())
