"""Daemon lifecycle in a real process: SIGHUP reload, SIGTERM, textfile output, stale sockets."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.support import REPO, free_port, parse_exposition, reload_config, select, start_daemon, wait_for


@pytest.mark.process
def test_sighup_reloads_the_config_and_a_bad_file_keeps_the_old_one(tmp_path: Path) -> None:
    """A valid edit is applied on SIGHUP; a broken file is logged and the daemon keeps running."""
    config = tmp_path / "tp.toml"
    config.write_text("[runs]\nseries_limit_per_run = 100\n")
    daemon = start_daemon(tmp_path, extra_args=["--config", str(config)])
    try:
        reload_config(daemon, config, "[runs]\nseries_limit_per_run = 7\n")
        reload_config(
            daemon,
            config,
            "[runs]\nseries_limit_per_run = 'many'\n",
            "config reload failed; keeping the running config",
        )
        assert daemon.proc.poll() is None
        assert (
            1.0
            == select(daemon.scrape(), "torchpulse_build_info", version="0.1.0")[
                (("protocol_version", "1"), ("version", "0.1.0"))
            ]
        )
    finally:
        assert 0 == daemon.stop(signal.SIGTERM)


@pytest.mark.process
def test_sigterm_stops_cleanly_and_a_stale_socket_is_replaced(tmp_path: Path) -> None:
    """SIGTERM exits 0; a socket file left by a SIGKILLed daemon does not block the next start."""
    first = start_daemon(tmp_path)
    first.stop(signal.SIGKILL)
    assert first.socket_path.exists()
    second = first.restart()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(str(second.socket_path))
    finally:
        assert 0 == second.stop(signal.SIGTERM)


@pytest.mark.process
def test_sigterm_removes_the_socket_file_it_bound(tmp_path: Path) -> None:
    """A stopped daemon leaves no socket behind: agents see "no daemon" (ENOENT), not a dead socket."""
    daemon = start_daemon(tmp_path)
    assert daemon.socket_path.exists()
    assert 0 == daemon.stop(signal.SIGTERM)
    assert not daemon.socket_path.exists()


@pytest.mark.process
def test_textfile_output_is_written_atomically(tmp_path: Path) -> None:
    """With `textfile` set the daemon writes a parseable .prom file for node_exporter, and removes it at stop."""
    prom = tmp_path / "torchpulse.prom"
    config = tmp_path / "tp.toml"
    config.write_text(f'[daemon]\ntextfile = "{prom}"\ntextfile_interval_seconds = 0.2\n')
    daemon = start_daemon(tmp_path, extra_args=["--config", str(config)])
    try:
        wait_for(prom.exists)
        samples = parse_exposition(prom.read_text())
        assert [1.0] == list(select(samples, "torchpulse_build_info").values())
        assert [] == [p.name for p in tmp_path.iterdir() if p.name.startswith(".torchpulse.prom.")]
    finally:
        assert 0 == daemon.stop()
    # Left behind, node_exporter would serve the last values (agent_up 1) for as long as it runs.
    assert not prom.exists()


@pytest.mark.process
def test_a_second_daemon_on_a_live_socket_refuses_to_start(tmp_path: Path) -> None:
    """Starting a daemon on a socket another daemon serves fails instead of stealing it."""
    daemon = start_daemon(tmp_path)
    second_dir = tmp_path / "second"
    second_dir.mkdir()
    try:
        with pytest.raises(RuntimeError, match="another daemon is already listening"):
            start_daemon(second_dir, socket_path=daemon.socket_path)
    finally:
        daemon.stop()


@pytest.mark.process
def test_a_reload_applies_the_log_level_and_keeps_command_line_flags(tmp_path: Path) -> None:
    """SIGHUP re-applies log_level; --socket/--listen/--state-dir still win and are not reported as changed."""
    from tests.support import send_raw
    from torchpulse.protocol import StatusRequest, encode

    config = tmp_path / "tp.toml"
    config.write_text('[daemon]\nlog_level = "info"\n')
    daemon = start_daemon(tmp_path, extra_args=["--config", str(config)])
    try:
        reload_config(daemon, config, '[daemon]\nlog_level = "warning"\n')
        assert not [e for e in daemon.log_lines() if e.get("event") == "these keys need a restart to take effect"]
        before = len(daemon.log_lines())
        send_raw(daemon.socket_path, encode(StatusRequest()))
        send_raw(daemon.socket_path, b"garbage-garbage-garbage")  # a warning: still logged
        wait_for(
            lambda: any(
                e.get("event") == "rejected a frame and closed the connection" for e in daemon.log_lines()[before:]
            )
        )
        assert all(e.get("level") != "info" for e in daemon.log_lines()[before:])
        assert daemon.scrape()
    finally:
        assert 0 == daemon.stop(signal.SIGTERM)


@pytest.mark.process
def test_a_reload_that_changes_listen_keeps_serving_on_the_running_address_and_says_so(tmp_path: Path) -> None:
    """`listen` needs a restart: after SIGHUP the old port still serves, the new one is not bound, one warning."""
    first, second = free_port(), free_port()
    path = tmp_path / "tp.toml"
    base = f'[daemon]\nsocket = "{tmp_path}/a.sock"\nstate_dir = "{tmp_path}/state"\n'
    path.write_text(base + f'listen = "127.0.0.1:{first}"\n')
    log = tmp_path / "daemon.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torchpulse", "daemon", "--log-format", "json", "--config", str(path)],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )

    def events() -> list[dict[str, object]]:
        return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]

    def serves(port: int) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5):
                return True
        except OSError:
            return False

    try:
        wait_for(lambda: serves(first), timeout=30)
        path.write_text(base + f'listen = "127.0.0.1:{second}"\n')
        proc.send_signal(signal.SIGHUP)
        wait_for(lambda: any(e["event"] == "config reloaded" for e in events()))
        state = (serves(first), serves(second))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
    warnings = [(e["event"], e["keys"]) for e in events() if e["level"] == "warning"]
    assert ((True, False), [("these keys need a restart to take effect", ["listen"])]) == (state, warnings)
