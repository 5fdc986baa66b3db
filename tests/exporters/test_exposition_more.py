"""A real daemon process: config values it must refuse, the listen address it reports, odd label text, HTTP 405."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support import REPO, free_port, parse_exposition, require_tool, select, start_daemon, wait_for
from torchpulse.protocol import Batch, Hello, Sample, encode

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


@pytest.mark.process
def test_a_refused_method_is_told_which_ones_are_served(tmp_path: Path) -> None:
    """A 405 answer carries `Allow: GET, HEAD` (RFC 9110 15.5.6) on every path."""
    daemon = start_daemon(tmp_path)
    try:
        answers = []
        for request in (
            b"POST /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            b"DELETE /nowhere HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        ):
            with socket.create_connection(("127.0.0.1", daemon.port), timeout=10) as conn:
                conn.sendall(request)
                reply = b""
                while chunk := conn.recv(65536):
                    reply += chunk
            head = reply.split(b"\r\n\r\n", 1)[0].decode().split("\r\n")
            answers.append((head[0], [line for line in head if line.startswith("Allow:")]))
    finally:
        daemon.stop()
    assert [("HTTP/1.1 405 Method Not Allowed", ["Allow: GET, HEAD"])] * 2 == answers


@pytest.mark.process
def test_label_text_with_quotes_backslashes_and_control_characters_survives_a_real_scrape(tmp_path: Path) -> None:
    """Run, host and command with `"`, `\\`, newline, CR, NUL and non-ASCII come back exactly; promtool is silent."""
    weird = 'a"b\\c\nd\re\tf\x00g\u2028h\x7f\ufeff\u00e9\U0001f600'
    command = (weird * 40)[:512]
    daemon = start_daemon(tmp_path)
    try:
        with socket.socket(socket.AF_UNIX) as agent:
            agent.settimeout(10)
            agent.connect(str(daemon.socket_path))
            agent.sendall(encode(Hello(weird, 0, 0, 1, os.getpid(), weird, "2.13.0", "0.1.0", command, time.time())))
            agent.recv(4096)
            agent.sendall(encode(Batch(1, time.time(), [Sample("optimizer_steps_total", (weird,), 3.0)], [], [])))
            wait_for(lambda: bool(select(daemon.scrape(), "torchpulse_optimizer_steps_total")))
            text = daemon.scrape_text()
    finally:
        daemon.stop()
    promtool = subprocess.run(
        [require_tool("promtool"), "check", "metrics"],
        input=text.encode(),
        capture_output=True,
        timeout=60,
        check=False,
    )
    samples = parse_exposition(text)
    assert (0, b"", b"") == (promtool.returncode, promtool.stdout, promtool.stderr)
    assert [3.0] == list(select(samples, "torchpulse_optimizer_steps_total", run=weird, optimizer=weird).values())
    assert [1.0] == list(select(samples, "torchpulse_run_info", run=weird, host=weird, command=command).values())


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
