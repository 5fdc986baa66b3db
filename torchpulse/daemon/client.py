"""Blocking client for one-shot requests to the daemon (`torchpulse status`)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import TypeVar

from torchpulse.framing import FrameReader
from torchpulse.protocol import (
    CtlReply,
    CtlRequest,
    ErrorReply,
    StatusReply,
    StatusRequest,
    decode_daemon_frame,
    encode,
)
from torchpulse.terminal import fit, printable

T = TypeVar("T", StatusReply, CtlReply)


class DaemonUnavailable(Exception):
    pass


def _request(path: Path, request: StatusRequest | CtlRequest, reply_type: type[T], timeout: float) -> T:
    """Send one request frame and wait for its reply; every failure is a DaemonUnavailable."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(str(path))
        except OSError as exc:
            raise DaemonUnavailable(f"no daemon at {path}: {exc.strerror or exc}") from None
        sock.sendall(encode(request))
        reader = FrameReader()
        while True:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                raise DaemonUnavailable(f"the daemon did not answer within {timeout:g}s") from None
            if not chunk:
                raise DaemonUnavailable("the daemon closed the connection without answering")
            for body in reader.feed(chunk):
                frame = decode_daemon_frame(body)
                if isinstance(frame, ErrorReply):
                    raise DaemonUnavailable(f"refused: {frame.message}")
                if isinstance(frame, reply_type):
                    return frame
    finally:
        sock.close()


def request_status(path: Path, timeout: float = 5.0) -> StatusReply:
    return _request(path, StatusRequest(), StatusReply, timeout)


def format_status(reply: StatusReply) -> str:
    lines = [
        f"torchpulse daemon {printable(reply.daemon_version)} (pid {reply.pid}), up {_duration(reply.uptime_seconds)}",
        f"events received: {reply.events_received}"
        + (f", frames rejected: {sum(reply.frames_rejected.values())}" if reply.frames_rejected else ""),
    ]
    if not reply.runs:
        lines.append("no runs connected")
    for run in reply.runs:
        state = "ended" if run.ended else "running"
        lines.append(f"run {printable(run.run)} ({state}, world size {run.world_size})")
        lines.append(f"  {'rank':>4}  {'state':<12} {'pid':>8}  {'host':<16} {'received':>10} {'dropped':>8}")
        for rank in run.ranks:
            if rank.connected:
                status = "connected"
            else:
                status = f"{'exited' if rank.exited else 'gone'} {_duration(rank.last_seen_seconds_ago)}"
            lines.append(f"  {rank.rank:>4}  {status:<12} {rank.pid:>8}  {fit(rank.host, 16)} "
                         f"{rank.events_received:>10} {rank.events_dropped:>8}")
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"


def send_ctl(path: Path, request: CtlRequest, timeout: float) -> CtlReply:
    """Send one command request and wait for the per-rank results."""
    return _request(path, request, CtlReply, timeout)


def format_ctl(reply: CtlReply) -> str:
    if not reply.results:
        return f"run {printable(reply.run)}: no such run, or no ranks connected"
    lines = []
    for result in reply.results:
        data = " ".join(f"{k}={v}" for k, v in sorted(result.data.items()))
        line = f"rank {result.rank:>3}  {result.status:<13} {result.message}" + (f"  {data}" if data else "")
        lines.append(printable(line))
    return "\n".join(lines)
