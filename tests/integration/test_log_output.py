"""What torchpulse writes to logs: the daemon's journal lines, and the training job's own output."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from tests.support import REPO, DaemonProcess, send_raw, start_daemon, wait_for
from torchpulse.aio import close_connection
from torchpulse.limits import AGENT_SOCKET_WRITE_TIMEOUT
from torchpulse.protocol import (
    HEADER,
    MAGIC,
    PROTOCOL_VERSION,
    Batch,
    CtlRequest,
    Hello,
    LogEvent,
    encode,
)

# journald splits a stderr line longer than LineMax (48 KiB by default) into several entries,
# and none of them is JSON any more.
JOURNAL_LINE_MAX = 48 * 1024
HUGE = "X" * 1_000_000


def _journal_lines(daemon: DaemonProcess) -> list[str]:
    return daemon.log_path.read_text().splitlines()


def _events(daemon: DaemonProcess, event: str) -> list[dict[str, object]]:
    return [e for e in daemon.log_lines() if e.get("event") == event]


def _frame(body: object) -> bytes:
    data = msgspec.msgpack.encode(body)
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, len(data)) + data


def test_what_a_hostile_peer_sends_is_cut_in_the_daemon_log(daemon: DaemonProcess) -> None:
    """A megabyte in a frame's type, an agent's event or a command stays out of the log, each line short JSON."""
    reply = send_raw(daemon.socket_path, _frame({"type": HUGE}), close_write=False)
    assert len(reply) < 4096  # the error answered to the peer is cut too
    send_raw(daemon.socket_path, encode(CtlRequest(HUGE, list(range(100_000)), HUGE, {HUGE[:500_000]: HUGE}, 1.0)))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(daemon.socket_path))
        sock.sendall(encode(Hello("hostile", 0, 0, 1, os.getpid(), "h", "t", "a", "c", 0.0)))
        sock.recv(4096)  # welcome
        fields: dict[str, str | int | float | bool | None] = {f"field{i}": HUGE[:100_000] for i in range(30)}
        sock.sendall(encode(Batch(1, 0.0, [], [], [LogEvent(0.0, "warning", HUGE[:200_000], fields)])))
    wait_for(lambda: bool(_events(daemon, "agent disconnected")))
    lines = _journal_lines(daemon)
    assert [] == [line[:200] for line in lines if len(line) > JOURNAL_LINE_MAX]
    events = [json.loads(line) for line in lines]  # every line is one JSON object
    rejected = next(e for e in events if e["event"] == "rejected a frame and closed the connection")
    assert ("unknown_type", os.getuid()) == (rejected["reason"], rejected["peer_uid"])
    assert 1 == len([e for e in events if e["event"] == "command received"])
    assert 1 == len([e for e in events if e.get("run") == "hostile" and e["event"].startswith("XXX")])


def test_a_reply_larger_than_the_socket_buffer_closes_without_an_error(tmp_path: Path) -> None:
    """Closing after a reply the peer reads only later (a big status) raises nothing (asyncio logged a traceback)."""
    path = tmp_path / "s.sock"

    async def scenario() -> list[BaseException]:
        errors: list[BaseException] = []
        done = asyncio.Event()

        async def serve(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"x" * (4 << 20))  # far more than the kernel buffers: most stays in asyncio's
            try:
                await close_connection(writer, AGENT_SOCKET_WRITE_TIMEOUT)
            except BaseException as exc:
                errors.append(exc)
            done.set()

        server = await asyncio.start_unix_server(serve, path=str(path))
        async with server:
            reader, writer = await asyncio.open_unix_connection(str(path))
            await asyncio.sleep(0.2)  # the server has called close() with its buffer still full
            while await reader.read(1 << 20):
                pass
            await asyncio.wait_for(done.wait(), 15)
            writer.close()
        return errors

    assert [] == asyncio.run(scenario())


ASYNCIO_FAILURE = """
import asyncio, gc, sys, warnings
from torchpulse.daemon import logs

logs.configure(sys.argv[1], "info")

async def fails() -> None:
    raise ZeroDivisionError("from a task nobody awaits")

async def main() -> None:
    asyncio.get_running_loop().create_task(fails())
    await asyncio.sleep(0.1)

asyncio.run(main())
gc.collect()  # asyncio logs "Task exception was never retrieved" when the task is collected
warnings.warn("a library's warning")
"""


def _stdlib_records(log_format: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", ASYNCIO_FAILURE, log_format], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert (0, "") == (result.returncode, result.stdout)
    return result.stderr.splitlines()


@pytest.mark.process
def test_the_standard_librarys_records_in_the_daemon_are_json_lines_too() -> None:
    """asyncio's own error (with its traceback) and a warning come out as JSON lines, not plain text."""
    events = [json.loads(line) for line in _stdlib_records("json")]
    asyncio_error, warning = events
    assert ("error", "asyncio", "Task exception was never retrieved") == (
        asyncio_error["level"],
        asyncio_error["logger"],
        str(asyncio_error["event"]).splitlines()[0],
    )
    assert "ZeroDivisionError: from a task nobody awaits" in str(asyncio_error["exception"])
    assert ("warning", "py.warnings") == (warning["level"], warning["logger"])
    assert "timestamp" in asyncio_error


@pytest.mark.process
def test_the_standard_librarys_records_on_a_terminal_are_readable_lines() -> None:
    """With the console format the same records read as the daemon's own lines: time, [level], event."""
    lines = _stdlib_records("console")
    assert "[error    ] Task exception was never retrieved" in lines[0]
    assert any(line.startswith("ZeroDivisionError: from a task nobody awaits") for line in lines)


@pytest.mark.process
def test_under_journald_each_line_carries_its_priority_for_journalctl_p(tmp_path: Path) -> None:
    """stderr being the journal stream systemd names in JOURNAL_STREAM: `<N>` prefixes; anywhere else, none."""
    script = (
        "import logging, sys\nfrom torchpulse.daemon import logs\nlogs.configure('auto', 'info')\n"
        "import structlog\nlog = structlog.get_logger()\nlog.info('routine')\nlog.warning('look')\n"
        "logging.getLogger('asyncio').error('broken')\n"
    )
    out = tmp_path / "stderr"
    with out.open("w") as stderr:
        st = os.fstat(stderr.fileno())
        for stream in (f"{st.st_dev}:{st.st_ino}", f"{st.st_dev}:{st.st_ino + 1}"):
            subprocess.run(
                [sys.executable, "-c", script],
                cwd=REPO,
                stderr=stderr,
                check=True,
                timeout=60,
                env={**os.environ, "JOURNAL_STREAM": stream},
            )
    lines = out.read_text().splitlines()
    assert ["<6>", "<4>", "<3>", "", "", ""] == [line[: line.index("{")] for line in lines]
    assert ["routine", "look", "broken"] * 2 == [json.loads(line[line.index("{") :])["event"] for line in lines]


@pytest.mark.process
def test_log_flags_override_the_config_and_survive_a_reload(tmp_path: Path) -> None:
    """`--log-format console --log-level warning`: readable lines, warnings only, also after a SIGHUP."""
    daemon = start_daemon(tmp_path, extra_args=["--log-format", "console", "--log-level", "warning"])
    try:
        daemon.proc.send_signal(signal.SIGHUP)
        time.sleep(1.5)  # the reload runs at the next housekeeping tick
        send_raw(daemon.socket_path, b"garbage!")
        wait_for(lambda: "rejected a frame" in daemon.log_path.read_text())
    finally:
        daemon.stop()
    lines = _journal_lines(daemon)
    assert 1 == len(lines), lines
    assert "[warning  ] rejected a frame and closed the connection" in lines[0]
    assert "reason=bad_magic" in lines[0]


def test_a_reload_without_a_config_file_says_so(daemon: DaemonProcess) -> None:
    """SIGHUP to a daemon started without --config: `config reloaded` with a null path, not the text "None"."""
    daemon.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: bool(_events(daemon, "config reloaded")))
    assert [None] == [e["path"] for e in _events(daemon, "config reloaded")]
