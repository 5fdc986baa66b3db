"""What the daemon cannot read or write is shown: checkpoint roots it cannot list, a state directory it cannot write.

The daemon tests drop root's permission override (`file_modes_bind`), so that
real modes on real directories shut it out as they shut out the `torchpulse`
user it runs as in production.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from tests.daemon.checkpoints.conftest import file_modes_bind, logged, shut_out
from tests.support import DaemonProcess, select, start_daemon, wait_for
from tests.support.checkpoints import FakeWorker, commit_copy, run_service, tiny_checkpoint, until
from torchpulse.daemon.checkpoints.config import CheckpointsConfig, RootConfig
from torchpulse.daemon.checkpoints.service import CheckpointService
from torchpulse.daemon.checkpoints.watcher import unreadable

UNREADABLE = "checkpoint root cannot be read"
READABLE_AGAIN = "checkpoint root can be read again; watching it"
NOT_WRITABLE = "state directory not writable"


def _readable(daemon: DaemonProcess) -> dict[str, float]:
    return {dict(k)["root"]: v for k, v in select(daemon.scrape(), "torchpulse_checkpoint_root_readable").items()}


def _valid(daemon: DaemonProcess, root: Path) -> float:
    return sum(
        select(daemon.scrape(), "torchpulse_checkpoint_validations_total", root=str(root), status="valid").values()
    )


def _lines(daemon: DaemonProcess, prefix: str) -> list[dict[str, object]]:
    return [line for line in daemon.log_lines() if str(line.get("event", "")).startswith(prefix)]


def _persistent(daemon: DaemonProcess) -> list[float]:
    return list(select(daemon.scrape(), "torchpulse_daemon_state_persistent").values())


@pytest.mark.slow
@pytest.mark.parametrize("observer", ["inotify", "polling"])
def test_a_root_the_daemon_cannot_read_is_shown_once_and_watched_once_it_can(
    tmp_path: Path, saved_checkpoint: Path, observer: str, stopper: list[DaemonProcess]
) -> None:
    """Another user's root with mode 700 and a root that does not exist yet: readable 0 and one warning each, however
    many sweeps (inotify used to report the first one watched, and never to deliver an event from it). Fixed
    without a restart: readable 1, one line each, the save made meanwhile validated, and a later save found by the
    watch itself, with sweeps a minute apart by then."""
    denied, missing = tmp_path / "denied", tmp_path / "missing"
    denied.mkdir()
    shut_out(denied)
    config = tmp_path / "torchpulse.toml"

    def write_config(incomplete_after_seconds: float) -> None:
        config.write_text(
            f'[checkpoints]\nroots = [{{ path = "{denied}", observer = "{observer}" }}, '
            f'{{ path = "{missing}", observer = "{observer}" }}]\npoll_interval_seconds = 0.5\n'
            f'incomplete_after_seconds = {incomplete_after_seconds}\nlevel = "metadata"\n'
        )

    write_config(2)  # a sweep every 0.5 s
    daemon = start_daemon(tmp_path, extra_args=["--config", str(config)], preexec=file_modes_bind())
    stopper.append(daemon)
    wait_for(lambda: {str(denied): 0.0, str(missing): 0.0} == _readable(daemon), timeout=30)
    commit_copy(saved_checkpoint, denied / "step-1")  # the job's user can write there; the daemon cannot look
    time.sleep(3)  # six sweeps
    assert 0 == _valid(daemon, denied)
    assert sorted([(str(denied), "Permission denied"), (str(missing), "No such file or directory")]) == sorted(
        (line["root"], line["error"]) for line in _lines(daemon, UNREADABLE)
    )

    denied.chmod(0o755)
    missing.mkdir()
    wait_for(lambda: {str(denied): 1.0, str(missing): 1.0} == _readable(daemon), timeout=30)
    wait_for(lambda: 1 == _valid(daemon, denied), timeout=60)
    assert sorted([(str(denied), observer), (str(missing), observer)]) == sorted(
        (line["root"], line["observer"]) for line in _lines(daemon, READABLE_AGAIN)
    )

    write_config(1800)  # sweeps a minute apart: what is committed next only the watch can find in time
    daemon.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: bool(_lines(daemon, "config reloaded")), timeout=30)
    time.sleep(1)  # the sweep a reload starts has ended
    for root in (denied, missing):
        commit_copy(saved_checkpoint, root / "step-2")
    wait_for(lambda: (2, 1) == (_valid(daemon, denied), _valid(daemon, missing)), timeout=30)
    assert 2 == len(_lines(daemon, UNREADABLE))


@pytest.mark.slow
def test_a_state_directory_the_daemon_cannot_write_is_one_warning_and_a_gauge_and_costs_a_revalidation(
    tmp_path: Path, saved_checkpoint: Path, stopper: list[DaemonProcess]
) -> None:
    """The state directory belongs to another user: the daemon starts and validates, says once what is lost and
    how to fix it, exports daemon_state_persistent 0; a restart validates the same checkpoint again (the loss the
    warning names). Made writable while it runs, it stays memory-only until a restart, which writes the file."""
    state = tmp_path / "state"
    state.mkdir()
    shut_out(state, 0o755)
    root = tmp_path / "ckpt"
    commit_copy(saved_checkpoint, root / "step-1")
    config = tmp_path / "torchpulse.toml"
    config.write_text(f'[checkpoints]\nroots = ["{root}"]\nlevel = "metadata"\n')
    preexec = file_modes_bind()

    def start() -> DaemonProcess:
        daemon = start_daemon(
            tmp_path, port=stopper[0].port if stopper else None, extra_args=["--config", str(config)], preexec=preexec
        )
        stopper.append(daemon)
        return daemon

    first = start()
    wait_for(lambda: 1 == _valid(first, root), timeout=60)
    assert [0.0] == _persistent(first)
    [warning] = _lines(first, NOT_WRITABLE)
    assert (str(state), "Permission denied") == (warning["state_dir"], warning["error"])
    assert "validated again" in str(warning["lost"]) and "restart" in str(warning["fix"])
    assert [] == _lines(first, "checkpoint state file cannot be opened")
    assert 0 == first.stop()

    second = start()
    wait_for(lambda: 1 == _valid(second, root), timeout=60)  # step-1 again: nothing remembered it
    assert [0.0] == _persistent(second)
    state.chmod(0o777)
    commit_copy(saved_checkpoint, root / "step-2")
    wait_for(lambda: 2 == _valid(second, root), timeout=60)
    assert ([0.0], []) == (_persistent(second), list(state.iterdir()))  # no recovery without a restart
    assert 0 == second.stop()

    third = start()
    wait_for(lambda: [1.0] == _persistent(third), timeout=30)  # exported once the store is open
    assert [] == _lines(third, NOT_WRITABLE)


def test_unreadable_names_why_a_directory_cannot_be_listed(tmp_path: Path) -> None:
    """The kernel's reason, as the log line and the watch error give it; none for a directory that can be read."""
    (tmp_path / "file").write_text("")
    reasons = [unreadable(str(path)) for path in (tmp_path, tmp_path / "missing", tmp_path / "file")]
    assert [None, "No such file or directory", "Not a directory"] == reasons


@pytest.mark.parametrize("observer", ["inotify", "polling"])
def test_a_root_that_appears_later_is_logged_once_each_way_and_its_checkpoints_found(
    tmp_path: Path, worker: FakeWorker, observer: str
) -> None:
    """Ten sweeps over a missing root log one line; the sweep after it appears logs one more, watches it, and
    finds the checkpoint already in it; the stats (the gauge) follow."""
    root = tmp_path / "later"
    config = CheckpointsConfig(
        roots=(RootConfig(str(root), observer),), poll_interval_seconds=0.1, debounce_seconds=0.0
    )

    async def body(service: CheckpointService) -> None:
        for _ in range(10):
            await service.sweep()
        assert service.stats.root(str(root)).readable is False
        tiny_checkpoint(tmp_path / "made" / "step-1")
        (tmp_path / "made").rename(root)  # it appears with a checkpoint already in it
        await service.sweep()
        assert service.stats.root(str(root)).readable is True
        await until(lambda: [str(root / "step-1")] == worker.calls)
        for _ in range(3):
            await service.sweep()
        await asyncio.sleep(0.3)

    with capture_logs() as logs:
        run_service(tmp_path, config, body)
    assert [(str(root), "No such file or directory")] == [(e["root"], e["error"]) for e in logged(logs, UNREADABLE)]
    assert [(str(root), observer)] == [(e["root"], e["observer"]) for e in logged(logs, READABLE_AGAIN)]
    assert [] == logged(logs, "cannot watch checkpoint root")
