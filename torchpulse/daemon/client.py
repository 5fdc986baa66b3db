"""Blocking client for one-shot requests to the daemon (`torchpulse status`)."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import TypeVar

from torchpulse.framing import FrameReader
from torchpulse.protocol import (
    CtlReply,
    CtlRequest,
    ErrorReply,
    FieldValue,
    RankResult,
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
                # Mostly a daemon that stopped or restarted: a command may have reached ranks before it went.
                maybe = "; ranks it reached may still apply the command" if isinstance(request, CtlRequest) else ""
                raise DaemonUnavailable(f"the daemon closed the connection without answering{maybe}")
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
            lines.append(
                f"  {rank.rank:>4}  {status:<12} {rank.pid:>8}  {fit(rank.host, 16)} "
                f"{rank.events_received:>10} {rank.events_dropped:>8}"
            )
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


# `ctl status` fields in the order a reader looks for them; any other field follows, by name.
_FIRST_FIELDS = ("step", "step_rate", "probes", "tracing", "buffer_fill", "buffer_capacity", "events_dropped", "pid")


def format_ctl(reply: CtlReply) -> str:
    """One line per rank: its status, what happened in words, then the rest of the agent's answer as key=value."""
    if not reply.results:
        return f"run {printable(reply.run)}: no such run, or no ranks connected"
    lines = []
    for result in reply.results:
        message, data = _summary(reply.command, result)
        fields = " ".join(f"{key}={_field_value(data[key])}" for key in _field_order(data))
        text = f"{message}  {fields}" if message and fields else message or fields
        lines.append(printable(f"rank {result.rank:>3}  {result.status:<13} {text}".rstrip()))
    return "\n".join(lines)


def format_stacks(reply: CtlReply) -> str:
    """`ctl stacks`: one block per rank, its training thread's stack under a line saying how long since its last
    step; a rank that did not answer says why instead."""
    if not reply.results:
        return f"run {printable(reply.run)}: no such run, or no ranks connected"
    blocks = []
    for result in reply.results:
        data = result.data
        if result.status != "ok" or not isinstance(stack := data.get("stack"), str):
            blocks.append(printable(f"rank {result.rank}: {result.status} {result.message}".rstrip()))
            continue
        since = data.get("seconds_since_step")
        when = "no step yet" if not isinstance(since, int | float) else f"last step {since:.1f} s ago"
        head = f"rank {result.rank}: step {data.get('step')}, {when}, thread {data.get('thread')}"
        # The stack's own lines are kept as they are (printable() would fold their line breaks).
        blocks.append(printable(head) + "\n" + "\n".join(printable(line) for line in stack.rstrip().splitlines()))
    return "\n\n".join(blocks)


def _summary(command: str, result: RankResult) -> tuple[str, dict[str, FieldValue]]:
    """The result's message and the data it does not already say.

    Agents answer a command that worked with the message "ok", which the status column already
    shows (the line read "ok  ok  changed=False"); what enable, disable, sample and autograd-log
    did is in their data, said here in words. An answer of another shape (another agent version)
    is shown as it came.
    """
    data = dict(result.data)
    message = "" if result.message == result.status else result.message
    if result.status != "ok":
        return message, data
    probe, changed = data.get("probe"), data.get("changed")
    if command in ("enable", "disable") and isinstance(probe, str) and isinstance(changed, bool):
        del data["probe"], data["changed"]
        message = f"{probe} {command}d" if changed else f"{probe} was already {command}d"
    elif command == "sample" and type(every := data.get("sample_every")) is int:
        del data["sample_every"]
        message = (
            "node timing off"
            if every == 0
            else "timing the nodes of every pass"
            if every == 1
            else f"timing the nodes of 1 pass in {every}"
        )
    elif command == "autograd-log" and type(passes := data.get("passes")) is int:
        del data["passes"]
        message = f"logging every autograd node of the next {passes} pass{'' if passes == 1 else 'es'}"
    return message, data


def _field_order(data: dict[str, FieldValue]) -> list[str]:
    return [key for key in _FIRST_FIELDS if key in data] + sorted(key for key in data if key not in _FIRST_FIELDS)


def _field_value(value: FieldValue) -> str:
    """A value as one word: text that is empty or has spaces, quotes or `=` is quoted (the slowest autograd
    nodes are "MmBackward0#3 0.21ms, ..."), so that a reader, and `shlex.split`, see where each field ends."""
    if isinstance(value, str) and (not value or any(c.isspace() or c in "\"'=" for c in value)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)
