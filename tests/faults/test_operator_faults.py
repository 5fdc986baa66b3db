"""What operators do to a running daemon: odd config files, SIGHUP under load, a taken port, moved outputs, a removed
state dir."""

from __future__ import annotations

import asyncio
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO, DaemonProcess, free_port, select, start_daemon, wait_for
from tests.support.checkpoints import FakeWorker, commit_copy, run_service, tiny_checkpoint, until
from torchpulse.daemon.checkpoints import runner as checkpoint_runner
from torchpulse.daemon.checkpoints.config import CheckpointsConfig, RootConfig
from torchpulse.daemon.checkpoints.service import CheckpointService
from torchpulse.daemon.checkpoints.state import DB_NAME
from torchpulse.protocol import StatusRequest, encode

# A config an editor saved in Latin-1 ("é" is byte 0xe9), and one nested past Python's recursion limit.
NOT_UTF8 = b"# r\xe9glages du n\x9cud\n[runs]\nseries_limit_per_run = 7\n"
TOO_DEEP = b"[runs]\nx = " + b"[" * 5000 + b"]" * 5000 + b"\n"


def _events(daemon: DaemonProcess, event: str) -> list[dict[str, object]]:
    return [line for line in daemon.log_lines() if line.get("event") == event]


def _serves(daemon: DaemonProcess) -> bool:
    return [1.0] == list(select(daemon.scrape(), "torchpulse_build_info").values())


@pytest.mark.process
@pytest.mark.parametrize("content", [NOT_UTF8, TOO_DEEP], ids=["latin1", "nested"])
def test_an_unreadable_config_file_refuses_the_start_with_one_line_and_status_2(tmp_path: Path, content: bytes) -> None:
    """tomllib raised UnicodeDecodeError and RecursionError past the ConfigError handler: a traceback, status 1."""
    config = tmp_path / "tp.toml"
    config.write_bytes(content)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchpulse",
            "daemon",
            "--config",
            str(config),
            "--socket",
            str(tmp_path / "a.sock"),
            "--state-dir",
            str(tmp_path / "state"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = proc.stderr.strip().splitlines()
    assert (2, 1) == (proc.returncode, len(lines)), proc.stderr
    assert lines[0].startswith(f"torchpulse: invalid configuration: {config}: not valid TOML: ")


@pytest.mark.process
@pytest.mark.parametrize("content", [NOT_UTF8, TOO_DEEP], ids=["latin1", "nested"])
def test_sighup_with_an_unreadable_config_file_keeps_the_daemon_and_its_config(tmp_path: Path, content: bytes) -> None:
    """The same files on SIGHUP ended the daemon (the exception left its housekeeping loop); now one error names
    the file, the running config stays, and the next good edit applies."""
    config = tmp_path / "tp.toml"
    config.write_text("[runs]\nseries_limit_per_run = 100\n")
    daemon = start_daemon(tmp_path, extra_args=["--config", str(config)])
    try:
        config.write_bytes(content)
        daemon.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: bool(_events(daemon, "config reload failed; keeping the running config")))
        [failed] = _events(daemon, "config reload failed; keeping the running config")
        assert str(failed["error"]).startswith(f"{config}: not valid TOML: ")
        assert (None, True) == (daemon.proc.poll(), _serves(daemon))
        config.write_text("[runs]\nseries_limit_per_run = 7\n")
        daemon.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: bool(_events(daemon, "config reloaded")))
    finally:
        assert 0 == daemon.stop()


@pytest.mark.process
def test_a_metrics_port_in_use_fails_the_start_with_one_line_and_leaves_no_dead_socket(tmp_path: Path) -> None:
    """The agent socket was bound before the port failed and stayed behind: agents met "connection refused" from a
    dead socket instead of "no daemon", which a stopped daemon otherwise guarantees. The textfile of a killed
    daemon went on saying agent_up 1 to node_exporter: the failed start removes it."""
    textfile = tmp_path / "torchpulse.prom"
    textfile.write_text('torchpulse_agent_up{run="r",rank="0"} 1\n')
    config = tmp_path / "tp.toml"
    config.write_text(f'[daemon]\ntextfile = "{textfile}"\n')
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torchpulse",
                "daemon",
                "--socket",
                str(tmp_path / "a.sock"),
                "--listen",
                f"127.0.0.1:{port}",
                "--state-dir",
                str(tmp_path / "state"),
                "--config",
                str(config),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
    errors = [line for line in proc.stderr.splitlines() if '"level": "error"' in line]
    assert (1, 1) == (proc.returncode, len(errors)), proc.stderr
    assert "daemon failed to start" in errors[0] and "address already in use" in errors[0]
    assert f"cannot serve /metrics on 127.0.0.1:{port} (daemon.listen in the config, or --listen)" in errors[0]
    assert (False, False) == ((tmp_path / "a.sock").exists(), textfile.exists())


@pytest.mark.process
def test_a_start_refused_at_the_agent_socket_removes_a_killed_daemons_textfile(tmp_path: Path) -> None:
    """Any failed start, not only a taken port: a regular file where the socket goes refuses the start, and the
    textfile a killed daemon left (agent_up 1, frozen counters) goes, as node_exporter would serve it for ever."""
    textfile, sock = tmp_path / "torchpulse.prom", tmp_path / "a.sock"
    textfile.write_text('torchpulse_agent_up{run="r",rank="0"} 1\n')
    sock.write_text("not a socket")
    config = tmp_path / "tp.toml"
    config.write_text(f'[daemon]\ntextfile = "{textfile}"\n')
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchpulse",
            "daemon",
            "--socket",
            str(sock),
            "--listen",
            f"127.0.0.1:{free_port()}",
            "--state-dir",
            str(tmp_path / "state"),
            "--config",
            str(config),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert 1 == proc.returncode and "exists and is not a socket" in proc.stderr, proc.stderr
    assert (False, "not a socket") == (textfile.exists(), sock.read_text())


@pytest.mark.process
def test_a_textfile_output_moved_or_switched_off_on_sighup_leaves_no_frozen_file(tmp_path: Path) -> None:
    """The old .prom stayed for ever (even after the stop, which removes only the current one): node_exporter served
    its frozen values, agent_up 1 included, for as long as it ran."""
    first, second = tmp_path / "first.prom", tmp_path / "second.prom"
    config = tmp_path / "tp.toml"
    config.write_text(f'[daemon]\ntextfile = "{first}"\ntextfile_interval_seconds = 0.2\n')
    daemon = start_daemon(tmp_path, extra_args=["--config", str(config)])
    try:
        wait_for(first.exists)
        config.write_text(f'[daemon]\ntextfile = "{second}"\ntextfile_interval_seconds = 0.2\n')
        daemon.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: second.exists() and not first.exists())
        config.write_text("[daemon]\n")
        daemon.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: not second.exists())
        assert _serves(daemon)
    finally:
        assert 0 == daemon.stop()
    assert [] == sorted(p.name for p in tmp_path.glob("*.prom"))


@pytest.mark.slow
def test_a_state_directory_removed_while_running_is_written_again_and_nothing_is_validated_twice(
    tmp_path: Path, saved_checkpoint: Path
) -> None:
    """`rm -r` of the state dir: SQLite went on writing to the unlinked file without a word, so every result was
    lost at the next restart, which validated everything again. Now the file is written again, whole, with one
    warning, and a restart validates only what is new."""
    root = tmp_path / "ckpt"
    root.mkdir()
    config = tmp_path / "tp.toml"
    config.write_text(f'[checkpoints]\nroots = [{{ path = "{root}", observer = "inotify" }}]\nlevel = "metadata"\n')
    daemon = start_daemon(tmp_path, extra_args=["--config", str(config)])

    def validated(d: DaemonProcess) -> list[str]:
        return [str(line["path"]) for line in _events(d, "checkpoint validated")]

    try:
        commit_copy(saved_checkpoint, root / "step-1")
        wait_for(lambda: [str(root / "step-1")] == validated(daemon), timeout=60)
        shutil.rmtree(daemon.state_dir)
        commit_copy(saved_checkpoint, root / "step-2")
        wait_for(lambda: 2 == len(validated(daemon)), timeout=60)
        assert _serves(daemon)
        [warning] = [
            line
            for line in daemon.log_lines()
            if str(line.get("event")).startswith("checkpoint state file was removed while the daemon ran")
        ]
        assert str(daemon.state_dir / DB_NAME) == warning["path"]
    finally:
        assert 0 == daemon.stop()
    again = daemon.restart()
    try:
        commit_copy(saved_checkpoint, root / "step-3")  # after the start's sweep: a re-validation shows before it
        wait_for(lambda: bool(validated(again)), timeout=60)
        assert [str(root / "step-3")] == validated(again)
    finally:
        again.stop()


def test_a_root_removed_on_sighup_exports_nothing_from_validations_in_flight_or_queued(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A validation running when SIGHUP dropped its root brought the root's series back, frozen (an invalid one
    alerted for ever), and its queued checkpoints were validated into root="other"; now the running one is
    recorded but not exported, and the queued ones are not validated."""
    worker = FakeWorker(seconds=0.5)
    monkeypatch.setattr(checkpoint_runner, "validate", worker)
    dropped, kept = tmp_path / "dropped", tmp_path / "kept"
    for step in range(3):
        tiny_checkpoint(dropped / f"step-{step}")
        worker.invalid.add(str(dropped / f"step-{step}"))
    kept.mkdir()
    config = CheckpointsConfig(
        roots=(RootConfig(str(dropped), "inotify"), RootConfig(str(kept), "inotify")), debounce_seconds=0.0
    )

    async def body(service: CheckpointService) -> None:
        await until(lambda: 1 == len(worker.calls))
        service.apply_config(CheckpointsConfig(roots=(RootConfig(str(kept), "inotify"),), debounce_seconds=0.0))
        await until(lambda: 0 == worker.running and not service.queue.pending)
        await asyncio.sleep(0.3)
        assert [str(dropped / "step-2")] == worker.calls  # the newest first, the others were queued
        assert [str(kept)] == list(service.stats.roots)  # neither the dropped root nor "other"
        assert service.store is not None
        # Remembered: should the root come back, that checkpoint is not validated again.
        assert service.store.key_of(str(dropped / "step-2")) is not None

    run_service(tmp_path, config, body)


@pytest.mark.process
def test_an_agent_socket_removed_while_running_is_bound_again(tmp_path: Path) -> None:
    """`rm -r` of the socket's directory left the daemon listening on a file nobody could reach: no agent could
    connect or reconnect and `torchpulse status` found no daemon until a restart, and nothing was logged."""
    socket_path = tmp_path / "run" / "agent.sock"
    daemon = start_daemon(tmp_path, socket_path=socket_path)
    try:
        before = socket.socket(socket.AF_UNIX)
        before.connect(str(socket_path))
        shutil.rmtree(socket_path.parent)
        wait_for(lambda: bool(_events(daemon, "agent socket removed while running; bound again")))
        with before:  # a connection accepted before the rebind is still served
            before.settimeout(10)
            before.sendall(encode(StatusRequest()))
            assert before.recv(65536)
        [event] = _events(daemon, "agent socket removed while running; bound again")
        assert "warning" == event["level"]
        status = subprocess.run(
            [sys.executable, "-m", "torchpulse", "status", "--socket", str(socket_path)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert 0 == status.returncode, status.stderr
        assert "torchpulse daemon" in status.stdout
        assert (None, True) == (daemon.proc.poll(), _serves(daemon))
    finally:
        assert 0 == daemon.stop()
    assert not socket_path.exists()  # the new socket file is removed at the stop, like the first
