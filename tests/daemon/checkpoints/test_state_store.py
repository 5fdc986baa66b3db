"""The validation state file when it is damaged or locked: the daemon starts, keeps serving and says why."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from tests.support.checkpoints import FakeWorker, heartbeat, run_service, tiny_checkpoint, until
from torchpulse.daemon.checkpoints.config import CheckpointsConfig, RootConfig
from torchpulse.daemon.checkpoints.root_set import RootSet
from torchpulse.daemon.checkpoints.service import CheckpointService
from torchpulse.daemon.checkpoints.state import DB_NAME, Record, StateStore
from torchpulse.protocol import CheckpointSaved

PAGE = 4096  # sqlite's default page size: page 1 holds the header and the schema


def test_a_state_file_damaged_past_its_schema_is_set_aside_and_a_new_one_kept(
    tmp_path: Path, worker: FakeWorker
) -> None:
    """The first query past page 1 failed the start; now the file is moved aside, the checkpoint validated once
    more and remembered in a new file."""
    root = tmp_path / "root"
    tiny_checkpoint(root / "step-1")
    config = CheckpointsConfig(roots=(RootConfig(str(root), "inotify"),), debounce_seconds=0.0)

    async def validated(service: CheckpointService) -> None:
        await until(lambda: service.stats.root(str(root)).validations["valid"] == 1)

    run_service(tmp_path, config, validated)
    state = tmp_path / "state" / DB_NAME
    assert not state.with_name(DB_NAME + "-wal").exists()  # closed cleanly: everything is in the file
    with state.open("r+b") as file:
        file.seek(PAGE)
        file.write(b"\xa5" * (state.stat().st_size - PAGE))

    with capture_logs() as logs:
        run_service(tmp_path, config, validated)

    async def restarted(service: CheckpointService) -> None:
        await service.sweep()
        await asyncio.sleep(0.2)

    run_service(tmp_path, config, restarted)
    assert [str(root / "step-1")] * 2 == worker.calls
    [corrupt] = [entry for entry in logs if entry["event"].startswith("checkpoint state file is corrupt")]
    assert [Path(corrupt["moved_to"])] == list(state.parent.glob(f"{DB_NAME}.corrupt-*"))


@pytest.fixture
def locked_state(tmp_path: Path) -> Iterator[Path]:
    """Yields the state directory once another process holds the state file's write lock."""
    state = tmp_path / "state"
    state.mkdir()
    StateStore(state).close()  # the daemon opens it fine, and then cannot write
    script = (
        "import sqlite3, sys\n"
        f"db = sqlite3.connect({str(state / DB_NAME)!r}, isolation_level=None)\n"
        "db.execute('BEGIN IMMEDIATE')\n"
        "print('locked', flush=True)\n"
        "sys.stdin.read()\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        assert "locked" == holder.stdout.readline().strip()
        yield state
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.process
@pytest.mark.usefixtures("locked_state")
def test_a_state_file_locked_by_another_writer_never_stalls_the_loop_for_long(
    tmp_path: Path, worker: FakeWorker
) -> None:
    """Each write waited 5 s for the lock on the event loop (metrics, agents, everything); now briefly, then it
    is logged and the result kept in memory."""
    step = tmp_path / "job" / "step-1"
    tiny_checkpoint(step)
    gaps: list[float] = []

    async def body(service: CheckpointService) -> None:
        beat = asyncio.create_task(heartbeat(gaps))
        try:
            service.announce("run", 0, CheckpointSaved(str(step), "save", 1.0, True))  # writes the new root
            await until(lambda: service.stats.root(str(step.parent)).validations["valid"] == 1)
            for _ in range(2):
                await service.sweep()
        finally:
            beat.cancel()

    with capture_logs() as logs:
        run_service(tmp_path, CheckpointsConfig(debounce_seconds=0.0), body)
    assert [str(step)] == worker.calls
    assert max(gaps) < 2.5
    assert ["database is locked"] == [
        entry["error"] for entry in logs if entry["event"] == "cannot persist a checkpoint result"
    ]


def _record(path: str) -> Record:
    return Record(path, "/ckpt", "key", "valid", "metadata", 1.0, 1.0, 0, 0.1, {})


def test_persistent_says_whether_results_reach_the_file_while_a_removed_one_cannot_be_written_again(
    tmp_path: Path,
) -> None:
    """The state directory removed and a file put in its place: the result stays in memory and `persistent` (the
    daemon_state_persistent gauge) is False; once the path is free, the next write writes the file and it is True."""
    state = tmp_path / "state"
    store = StateStore(state)
    try:
        assert store.persistent
        shutil.rmtree(state)
        state.write_text("not a directory")
        with capture_logs() as logs:
            store.save(_record("/ckpt/step-1"))
        assert (
            False,
            [
                "checkpoint state file was removed and cannot be written again; results are kept in memory "
                "until a restart"
            ],
        ) == (store.persistent, [e["event"] for e in logs])
        state.unlink()
        store.save(_record("/ckpt/step-2"))
        assert store.persistent
    finally:
        store.close()
    again = StateStore(state)
    try:
        assert ("key", "key") == (again.key_of("/ckpt/step-1"), again.key_of("/ckpt/step-2"))
    finally:
        again.close()


def test_a_start_that_fails_half_way_closes_its_state_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A start that raises before the service is composed leaves no open state file behind: close() could
    not reach it, and a daemon that retries would hold one more SQLite connection each time."""
    closed: list[Path] = []
    real_close = StateStore.close

    def recording_close(self: StateStore) -> None:
        closed.append(tmp_path)
        real_close(self)

    def broken_restore(self: RootSet) -> None:
        raise RuntimeError("restore failed")

    monkeypatch.setattr(StateStore, "close", recording_close)
    monkeypatch.setattr(RootSet, "restore", broken_restore)
    service = CheckpointService(CheckpointsConfig(), tmp_path / "state")

    async def main() -> None:
        with pytest.raises(RuntimeError, match="restore failed"):
            await service.start()
        await service.close()  # after a failed start: nothing left to close, and no error

    asyncio.run(main())
    assert ([tmp_path], None) == (closed, service.store)
