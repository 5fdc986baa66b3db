"""The agent socket against malformed identities: bad UTF-8 and megabyte-long names in a Hello."""

from __future__ import annotations

from tests.support import DaemonProcess, rejected_frames, select, send_raw, wait_for
from torchpulse.protocol import HEADER, MAGIC, PROTOCOL_VERSION, Hello, encode


def _send_body(daemon: DaemonProcess, body: bytes) -> bytes:
    return send_raw(daemon.socket_path, HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, len(body)) + body, close_write=False)


def _hello(run: str, host: str = "h") -> bytes:
    return encode(Hello(run, 0, 0, 1, 1, host, "2.13.0", "0.1.0", "cmd", 0.0))[HEADER.size :]


def test_invalid_utf8_in_a_hello_is_a_counted_decode_error(daemon: DaemonProcess) -> None:
    """A run name that is not UTF-8 gets an ErrorReply and a decode_error count, not a traceback."""
    body = _hello("RUNNAME").replace(b"RUNNAME", b"\xffUNNAME")
    reply = _send_body(daemon, body)
    wait_for(lambda: bool(rejected_frames(daemon)))
    assert (True, {"decode_error": 1.0}) == (b"decode_error" in reply, rejected_frames(daemon))
    assert "Traceback" not in daemon.log_path.read_text()


def test_megabyte_run_and_host_names_are_refused(daemon: DaemonProcess) -> None:
    """A run or host name longer than a label may be is refused before the run exists."""
    replies = [_send_body(daemon, _hello("r" * (1 << 20))), _send_body(daemon, _hello("ok", host="h" * 300))]
    wait_for(lambda: 2.0 == sum(rejected_frames(daemon).values()))
    samples = daemon.scrape()
    assert ([True, True], {"invalid_frame": 2.0}, {}) == (
        [b"longer than 200 characters" in r for r in replies],
        rejected_frames(daemon),
        select(samples, "torchpulse_agent_up"),
    )
