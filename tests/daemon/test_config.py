"""Daemon configuration: defaults, file, flags, errors that name the key, and the listen address it reports."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.support import REPO
from torchpulse.daemon.config import Config, ConfigError, Overrides, from_mapping, load, with_overrides
from torchpulse.paths import DEFAULT_LISTEN, agent_socket_path, default_socket_path


def test_no_file_gives_embedded_defaults() -> None:
    """Without a config file the daemon uses the documented defaults."""
    config = load(None)
    assert (DEFAULT_LISTEN, default_socket_path()) == (config.daemon.listen, config.daemon.socket)


def test_default_socket_is_under_run_for_root_and_runtime_dir_otherwise() -> None:
    """Root gets /run/torchpulse, a user gets $XDG_RUNTIME_DIR/torchpulse."""
    assert Path("/run/torchpulse/agent.sock") == default_socket_path({}, uid=0)
    assert Path("/run/user/1000/torchpulse/agent.sock") == default_socket_path(
        {"XDG_RUNTIME_DIR": "/run/user/1000"}, uid=1000
    )


def _listen(path: Path) -> socket.socket:
    path.parent.mkdir(parents=True, exist_ok=True)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    return server


def test_a_users_job_finds_the_system_service_unless_the_user_runs_a_daemon(tmp_path: Path) -> None:
    """No TORCHPULSE_SOCKET: the user's own daemon's socket, else the service's, else the user's default."""
    env = {"XDG_RUNTIME_DIR": str(tmp_path / "user")}
    own, system = tmp_path / "user" / "torchpulse" / "agent.sock", tmp_path / "run" / "agent.sock"
    system.parent.mkdir()
    system.touch()  # a plain file left behind is no service
    assert own == agent_socket_path(env, uid=1000, system_socket=system)
    system.unlink()
    with _listen(system):
        assert system == agent_socket_path(env, uid=1000, system_socket=system)
        with _listen(own):
            assert own == agent_socket_path(env, uid=1000, system_socket=system)
        assert tmp_path / "set" == agent_socket_path(
            {**env, "TORCHPULSE_SOCKET": str(tmp_path / "set")}, uid=1000, system_socket=system
        )


@pytest.mark.parametrize("squat", ["owner", "mode"])
def test_a_users_own_socket_under_a_directory_another_user_controls_is_not_used(tmp_path: Path, squat: str) -> None:
    """A /tmp/torchpulse-UID made by another user (or writable by others): its socket may be theirs, and the job
    would send them its metrics and run their commands. The service's socket is used instead, whatever exists."""
    env = {"XDG_RUNTIME_DIR": str(tmp_path / "user")}
    own, system = tmp_path / "user" / "torchpulse" / "agent.sock", tmp_path / "run" / "agent.sock"
    with _listen(own):
        if squat == "owner":
            os.chown(own.parent, 4242, 4242)
        else:
            own.parent.chmod(0o777)
        assert system == agent_socket_path(env, uid=1000, system_socket=system)
        with _listen(system):
            assert system == agent_socket_path(env, uid=1000, system_socket=system)
        own.parent.chmod(0o700)
        os.chown(own.parent, 1000, 1000)
        assert own == agent_socket_path(env, uid=1000, system_socket=system)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"daemon": {"listne": "x"}}, "daemon.listne: unknown key"),
        ({"daemon": {"listen": 9}}, "daemon.listen: expected str, got int"),
        ({"daemon": {"listen": "localhost"}}, "listen: expected HOST:PORT"),
        ({"runs": {"series_limit_per_run": 0}}, "runs.series_limit_per_run: must be >= 1"),
        ({"runs": {"grace_period_seconds": "5m"}}, "runs.grace_period_seconds: expected a number"),
        ({"runs": {"lost_grace_period_seconds": -1}}, "runs.lost_grace_period_seconds: must be >= 0"),
        ({"damon": {}}, "damon: unknown section"),
        # TOML has nan and inf; nan passes every `<= 0` check unless refused by name.
        (
            {"daemon": {"textfile_interval_seconds": float("nan")}},
            "daemon.textfile_interval_seconds: expected a finite number, got nan",
        ),
        ({"runs": {"grace_period_seconds": float("inf")}}, "runs.grace_period_seconds: expected a finite number"),
        (
            {"daemon": {"socket": "/" + "s" * 107}},
            "daemon.socket: '/s+': the path is 108 bytes long; a Unix socket path may have at most 107 bytes",
        ),
    ],
)
def test_bad_values_name_the_key(data: dict[str, dict[str, object]], message: str) -> None:
    """Each mistake raises one ConfigError whose text names the offending key."""
    with pytest.raises(ConfigError, match=message):
        from_mapping(data)


def test_flags_override_the_file(tmp_path: Path) -> None:
    """--socket/--listen/--state-dir win over the file's values."""
    path = tmp_path / "tp.toml"
    path.write_text('[daemon]\nlisten = "127.0.0.1:1"\nsocket = "/a.sock"\n')
    config = with_overrides(load(path), Overrides(listen="127.0.0.1:2", state_dir=tmp_path))
    assert ("127.0.0.1:2", Path("/a.sock"), tmp_path) == (
        config.daemon.listen,
        config.daemon.socket,
        config.daemon.state_dir,
    )
    assert isinstance(config, Config)


@pytest.mark.process
def test_bad_config_file_exits_non_zero_with_one_clear_line(tmp_path: Path) -> None:
    """`torchpulse daemon --config bad.toml` prints one error naming file and key, exits 2."""
    path = tmp_path / "bad.toml"
    assert (2, [f"torchpulse: invalid configuration: {path}: runs.grace_period_seconds: must be >= 0"]) == (
        _start_with(path, "[runs]\ngrace_period_seconds = -1\n")
    )


def _start_with(path: Path, config: str) -> tuple[int, list[str]]:
    """`torchpulse daemon --config PATH` with `config` in PATH: exit status and stderr lines."""
    path.write_text(config)
    result = subprocess.run(
        [sys.executable, "-m", "torchpulse", "daemon", "--config", str(path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    return result.returncode, result.stderr.strip().splitlines()


def test_a_socket_path_of_107_bytes_is_the_longest_accepted(tmp_path: Path) -> None:
    """107 bytes and the terminating NUL fill sun_path exactly: accepted, and the daemon can bind it."""
    import socket

    path = tmp_path / ("s" * (107 - len(str(tmp_path)) - 1))
    assert path == from_mapping({"daemon": {"socket": str(path)}}).daemon.socket
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))


@pytest.mark.process
def test_a_socket_path_too_long_refuses_to_start_naming_the_key_and_the_limit(tmp_path: Path) -> None:
    """`--socket` past the kernel's limit: one config error line, exit 2, no directory created for it."""
    socket_dir = tmp_path / ("d" * 120)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchpulse",
            "daemon",
            "--socket",
            str(socket_dir / "agent.sock"),
            "--listen",
            "127.0.0.1:0",
            "--state-dir",
            str(tmp_path / "state"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    lines = result.stderr.strip().splitlines()
    assert (2, 1, False) == (result.returncode, len(lines), socket_dir.exists()), result.stderr
    assert lines[0].startswith(
        f"torchpulse: invalid configuration: daemon.socket: '{socket_dir}/agent.sock': the path"
        f" is {len(str(socket_dir)) + 11} bytes long; a Unix socket path may have at most 107 "
        "bytes (108 with the terminating NUL)"
    )


@pytest.mark.process
def test_a_bad_checkpoints_section_names_the_file_like_the_other_sections(tmp_path: Path) -> None:
    """`[checkpoints]` is parsed after the file is read, by its owner; its errors still say which file."""
    path = tmp_path / "bad.toml"
    expected = f"torchpulse: invalid configuration: {path}: checkpoints.roots: 'relative/dir' is not an absolute path"
    assert (2, [expected]) == _start_with(path, '[checkpoints]\nroots = ["relative/dir"]\n')


# What each bad file gets in one line on stderr, after "torchpulse: invalid configuration: <file>: ".
REFUSED = [
    # int() reads Arabic-Indic digits: this was port 0, a random port Prometheus is never pointed at.
    ('[daemon]\nlisten = "127.0.0.1:\u0660"\n', "daemon.listen: expected HOST:PORT, got '127.0.0.1:\u0660'"),
    ('[daemon]\nlisten = "127.0.0.1:\u00b2"\n', "daemon.listen: expected HOST:PORT, got '127.0.0.1:\u00b2'"),
    # Every interface to a Go exporter, loopback here before: refused as ambiguous.
    (
        '[daemon]\nlisten = ":0"\n',
        "daemon.listen: ':0' names no host; write 127.0.0.1:0 (this machine only) or 0.0.0.0:0 (every interface)",
    ),
    (
        '[daemon]\nstate_dir = ""\n',
        "daemon.state_dir: expected a path, got an empty string (leave the key out for the default)",
    ),
    (
        '[daemon]\nsocket = ""\n',
        "daemon.socket: expected a path, got an empty string (leave the key out for the default)",
    ),
    ('listen = "0.0.0.0:0"\n[daemon]\n', "listen: unknown key outside any table (it belongs under [daemon])"),
    ("retries = 3\n", "retries: unknown key outside any table (keys go under [daemon], [runs] or [checkpoints])"),
]


def _start(tmp: Path, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "torchpulse", "daemon", "--log-format", "json", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=tmp,
    )


@pytest.mark.process
@pytest.mark.parametrize(("config", "error"), REFUSED)
def test_a_bad_value_refuses_the_start_with_one_line_naming_the_key(tmp_path: Path, config: str, error: str) -> None:
    """Each mistake exits 2 with one line naming the file and the key, and binds nothing."""
    path = tmp_path / "tp.toml"
    path.write_text(config, encoding="utf-8")
    proc = _start(tmp_path, "--config", str(path), "--socket", str(tmp_path / "a.sock"))
    try:
        out, _ = proc.communicate(timeout=15)
    finally:
        proc.kill()
        proc.wait()
    assert (2, [f"torchpulse: invalid configuration: {path}: {error}"], []) == (
        proc.returncode,
        out.decode().splitlines(),
        sorted(p.name for p in tmp_path.iterdir() if p != path),
    )


@pytest.mark.process
def test_the_ready_line_writes_an_ipv6_listener_as_a_url(tmp_path: Path) -> None:
    """`metrics` in the `daemon ready` log line is a URL that reaches /metrics: an IPv6 address in brackets."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
            port = probe.getsockname()[1]
    except OSError:
        pytest.skip("no IPv6 loopback here")
    proc = _start(
        tmp_path,
        "--socket",
        str(tmp_path / "a.sock"),
        "--state-dir",
        str(tmp_path / "state"),
        "--listen",
        f"[::1]:{port}",
    )
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        with urllib.request.urlopen(ready["metrics"], timeout=10) as response:
            status = response.status
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
    assert ("daemon ready", f"http://[::1]:{port}/metrics", 200) == (ready["event"], ready["metrics"], status)
