"""What reaches a reader's terminal from text that agents (any local user's job) or a peer socket chose."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from tests.support import PYTHON, REPO, DaemonProcess, start_daemon, wait_for
from torchpulse.daemon.client import request_status
from torchpulse.protocol import (
    HEADER,
    MAGIC,
    PROTOCOL_VERSION,
    Batch,
    ErrorReply,
    Hello,
    LogEvent,
    RankStatus,
    RunStatus,
    Sample,
    StatusReply,
    encode,
)
from torchpulse.summary import RankSummary, format_table, summarize

SCREEN_CLEAR = "\x1b[2J"
CLIPBOARD_WRITE = "\x1b]52;c;aGkx\x07"  # OSC 52: sets the reader's clipboard; no space, quote or "="


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """A real daemon writing the console log format (what `torchpulse daemon` shows on a terminal)."""
    process = start_daemon(tmp_path_factory.mktemp("terminal"), extra_args=["--log-format", "console"])
    try:
        yield process
    finally:
        process.stop()


def _agent(
    daemon: DaemonProcess,
    run: str,
    rank: int,
    host: str,
    events: list[LogEvent] | None = None,
) -> socket.socket:
    """A connection speaking the agents' protocol: a hello, then one batch with a step count and `events`."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(daemon.socket_path))
    sock.sendall(encode(Hello(run, rank, rank, 3, os.getpid(), host, "2.13.0", "0.1.0", "train.py", time.time())))
    sock.recv(4096)  # Welcome
    sock.sendall(encode(Batch(1, time.time(), [Sample("optimizer_steps_total", ("SGD#0",), 3.0)], [], events or [])))
    return sock


def _torchpulse(*args: str, socket_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "-m", "torchpulse", *args, "--socket", str(socket_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_an_agents_log_event_reaches_the_console_log_escaped(daemon: DaemonProcess) -> None:
    """An agent's event name, field name and field value are escaped in the console log, not written raw."""
    event = LogEvent(1.5, "warning", f"evil{SCREEN_CLEAR}", {f"k{SCREEN_CLEAR}": CLIPBOARD_WRITE})
    sock = _agent(daemon, "console-run", 0, "h", [event])
    try:
        wait_for(lambda: "evil" in daemon.log_path.read_text())
    finally:
        sock.close()
    line = next(line for line in daemon.log_path.read_text().splitlines() if "evil" in line)
    expected = (
        "[warning  ] evil\\x1b[2J                    agent_ts=1.5 k\\x1b[2J='\\x1b]52;c;aGkx\\x07' rank=0 "
        "run=console-run"
    )
    assert expected == line.split(" ", 1)[1]


def test_status_aligns_wide_host_names_and_escapes_them(daemon: DaemonProcess) -> None:
    """`torchpulse status` pads CJK and emoji host names by their width on screen, and escapes a control."""
    hosts = ["中文主机", "😀😀x", f"n{SCREEN_CLEAR}-very-long-host-name"]
    socks = [_agent(daemon, "wide", rank, host) for rank, host in enumerate(hosts)]
    try:

        def counted() -> bool:
            runs = [run for run in request_status(daemon.socket_path).runs if run.run == "wide"]
            return len(runs) == 1 and [1, 1, 1] == [rank.events_received for rank in runs[0].ranks]

        wait_for(counted)
        out = _torchpulse("status", socket_path=daemon.socket_path).stdout.splitlines()
    finally:
        for sock in socks:
            sock.close()
    pid = os.getpid()
    start = out.index("run wide (running, world size 3)")
    assert [
        "run wide (running, world size 3)",
        "  rank  state             pid  host               received  dropped",
        f"     0  connected    {pid:>8}  中文主机                  1        0",
        f"     1  connected    {pid:>8}  😀😀x                     1        0",
        f"     2  connected    {pid:>8}  n\\x1b[2J-very-lo          1        0",
    ] == out[start : start + 5]


def test_the_demo_summary_escapes_and_aligns_run_labels(daemon: DaemonProcess) -> None:
    """The per-rank table read back from /metrics escapes a run label's control and aligns a wide one."""
    socks = [_agent(daemon, run, 0, "h") for run in (f"s{SCREEN_CLEAR}", "训练")]
    try:

        def rows() -> list[RankSummary]:
            return [row for row in summarize(daemon.scrape_text()) if row.run in (f"s{SCREEN_CLEAR}", "训练")]

        wait_for(lambda: [3.0, 3.0] == [row.steps for row in rows()])
        table = format_table(rows())
    finally:
        for sock in socks:
            sock.close()
    assert [
        "run       rank  up   steps  step p50  step p99  learning rate  state size  dropped",
        "--------  ----  ---  -----  --------  --------  -------------  ----------  -------",
        "s\\x1b[2J  0     yes  3      -         -         -              0 B         0",
        "训练      0     yes  3      -         -         -              0 B         0",
    ] == table.splitlines()


def _serve_once(path: Path, frames: list[bytes]) -> threading.Thread:
    """A socket at `path` that answers each of len(frames) connections with one frame: a hostile or wrong daemon."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen()

    def serve() -> None:
        with server:
            for frame in frames:
                conn, _ = server.accept()
                with conn:
                    conn.recv(65536)
                    conn.sendall(frame)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


@pytest.mark.process
def test_what_a_peer_on_the_socket_says_is_escaped(tmp_path: Path) -> None:
    """A refusal's message, an undecodable tag and the daemon's version are printed escaped by status and ctl."""
    body = msgspec.msgpack.encode({"type": f"{SCREEN_CLEAR}x", "code": "c", "message": "m"})
    frames = [
        encode(ErrorReply("not_authorized", f"no{CLIPBOARD_WRITE}")),
        HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, len(body)) + body,
        encode(
            StatusReply(
                f"9{SCREEN_CLEAR}", 1.0, 7, 0, {}, [RunStatus("r", 1, False, [RankStatus(0, 8, "h", True, 1, 0, 0.0)])]
            )
        ),
    ]
    path = tmp_path / "peer.sock"
    thread = _serve_once(path, frames)
    refused = _torchpulse("ctl", "status", "--run", "r", socket_path=path)
    garbled = _torchpulse("status", socket_path=path)
    version = _torchpulse("status", socket_path=path)
    thread.join(10)
    assert (1, "", "torchpulse: refused: no\\x1b]52;c;aGkx\\x07\n") == (
        refused.returncode,
        refused.stdout,
        refused.stderr,
    )
    assert (
        1,
        "",
        f"torchpulse: unexpected answer from {path}: undecodable frame: Invalid value '\\x1b[2Jx' - at `$.type`\n",
    ) == (garbled.returncode, garbled.stdout, garbled.stderr)
    assert (0, "torchpulse daemon 9\\x1b[2J (pid 7), up 1s") == (version.returncode, version.stdout.splitlines()[0])
