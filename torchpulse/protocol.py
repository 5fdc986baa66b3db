"""The wire schema shared by the probes and the daemon.

A frame is an 8-byte header followed by a msgpack body::

    magic b"TP" | protocol version (u8) | reserved (u8) | body length (u32, big endian)

The version lives in the header, not in the body, so that a daemon can answer
an agent of another protocol version with a clear error before it tries to
decode a body whose schema it does not know.
"""

from __future__ import annotations

import struct
from typing import Final

import msgspec

from torchpulse.limits import MAX_FRAME_BYTES

PROTOCOL_VERSION: Final = 1
MAGIC: Final = b"TP"
HEADER: Final = struct.Struct(">2sBBI")
HEADER_SIZE: Final = HEADER.size

FieldValue = str | int | float | bool | None

# The trace argument the daemon sets on every trace command, whatever its client sent: the sender's uid
# (SO_PEERCRED), with which the agent decides where that sender may have it write.
CALLER_UID_ARG: Final = "caller_uid"


def utf8(text: str) -> str:
    """`text` as valid UTF-8: undecodable bytes Python kept as surrogates become "?"."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")


class Hello(msgspec.Struct, tag="hello", frozen=True):
    """First frame of an agent connection: who is talking."""

    run: str
    rank: int
    local_rank: int
    world_size: int
    pid: int
    host: str
    torch_version: str
    agent_version: str
    command: str
    started_at: float  # when the agent's process loaded torchpulse: the same in every hello of it
    # Finite upper bounds of each histogram family, as this agent buckets it. A histogram sample
    # carries counts, not bounds: a daemon of another version re-buckets or refuses them by these
    # instead of labelling them with its own. Agents from before this field send none (the catalog's).
    histogram_bounds: dict[str, tuple[float, ...]] = {}


class Sample(msgspec.Struct, array_like=True, frozen=True):
    """Current value of one counter or gauge series, a running total for counters."""

    family: str
    labels: tuple[str, ...]
    value: float


class HistogramSample(msgspec.Struct, array_like=True, frozen=True):
    """Running per-bucket counts (not cumulative; last bucket is +Inf) and sum."""

    family: str
    labels: tuple[str, ...]
    bucket_counts: tuple[int, ...]
    total: float


class LogEvent(msgspec.Struct, array_like=True, frozen=True):
    """A discrete event whose full text belongs in the daemon's structured log."""

    ts: float
    level: str
    event: str
    fields: dict[str, FieldValue]


class Batch(msgspec.Struct, tag="batch", frozen=True):
    """Series that changed since the last batch, plus pending log events."""

    seq: int
    sent_at: float
    samples: list[Sample]
    histograms: list[HistogramSample]
    events: list[LogEvent]


# A checkpoint save announced by the agent's `checkpoint` probe travels as a
# LogEvent with this name and CheckpointSaved's fields, so it is logged like
# any event and rides the agent's bounded, resent-on-reconnect event queue.
CHECKPOINT_SAVED_EVENT: Final = "checkpoint saved"


class CheckpointSaved(msgspec.Struct, frozen=True):
    """A torch.distributed.checkpoint save that returned (or whose async upload finished)."""

    path: str
    api: str  # save | async_save
    duration_seconds: float
    # Only rank 0 asks, so a checkpoint on shared storage is validated by one node.
    validate: bool
    # The saved directory's st_dev and st_ino as the job saw them (None when it could not stat it, or an
    # agent older than these fields). A job in a container names paths of its own mount namespace: the daemon
    # validates the path only where it names this same directory, never an unrelated one at that path.
    device: int | None = None
    inode: int | None = None

    def identity(self) -> tuple[int, int] | None:
        return None if self.device is None or self.inode is None else (self.device, self.inode)


def checkpoint_saved(event: LogEvent) -> CheckpointSaved | None:
    """The announcement carried by `event`, or None when it is not one (or malformed)."""
    if event.event != CHECKPOINT_SAVED_EVENT:
        return None
    try:
        return msgspec.convert(event.fields, CheckpointSaved)
    except msgspec.ValidationError:
        return None


class Goodbye(msgspec.Struct, tag="bye", frozen=True):
    """Sent by an agent whose process is exiting normally."""

    reason: str


class StatusRequest(msgspec.Struct, tag="status_request", frozen=True):
    """First and only frame of a `torchpulse status` connection."""


class Command(msgspec.Struct, tag="command", frozen=True):
    """Daemon to agent: do something at the next safe point and answer with a CommandResult."""

    id: int
    name: str
    args: dict[str, FieldValue]


class CommandResult(msgspec.Struct, tag="command_result", frozen=True):
    """Agent to daemon: the outcome of one Command."""

    id: int
    ok: bool
    message: str
    data: dict[str, FieldValue]


class CtlRequest(msgspec.Struct, tag="ctl_request", frozen=True):
    """First and only frame of a `torchpulse ctl` connection: a command for some ranks of a run."""

    run: str
    ranks: list[int] | None
    name: str
    args: dict[str, FieldValue]
    timeout: float


class RankResult(msgspec.Struct, frozen=True):
    rank: int
    status: str  # ok | failed | timeout | not_connected
    message: str
    data: dict[str, FieldValue]


class CtlReply(msgspec.Struct, tag="ctl_reply", frozen=True):
    run: str
    command: str
    results: list[RankResult]


class Welcome(msgspec.Struct, tag="welcome", frozen=True):
    """The daemon accepted a Hello."""

    daemon_version: str


class ErrorReply(msgspec.Struct, tag="error", frozen=True):
    """The daemon refused a frame; the connection is closed after it."""

    code: str
    message: str


class RankStatus(msgspec.Struct, frozen=True):
    rank: int
    pid: int
    host: str
    connected: bool
    events_received: int
    events_dropped: int
    last_seen_seconds_ago: float
    # Said goodbye before disconnecting (normal exit or detach); a default for older daemons.
    exited: bool = False


class RunStatus(msgspec.Struct, frozen=True):
    run: str
    world_size: int
    ended: bool
    ranks: list[RankStatus]


class StatusReply(msgspec.Struct, tag="status_reply", frozen=True):
    daemon_version: str
    uptime_seconds: float
    pid: int
    events_received: int
    frames_rejected: dict[str, int]
    runs: list[RunStatus]


AgentFrame = Hello | Batch | Goodbye | StatusRequest | CommandResult | CtlRequest
DaemonFrame = Welcome | ErrorReply | StatusReply | Command | CtlReply


class FrameError(Exception):
    """A frame that cannot be accepted; `reason` is a bounded metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


_encoder = msgspec.msgpack.Encoder()


def encode(message: AgentFrame | DaemonFrame) -> bytes:
    """Serialise one message into a complete frame, header included."""
    body = _encoder.encode(message)
    if len(body) > MAX_FRAME_BYTES:
        raise FrameError("oversized", f"frame body of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, len(body)) + body


def parse_header(header: bytes) -> int:
    """Validate a frame header and return the body length."""
    magic, version, _reserved, length = HEADER.unpack(header)
    if magic != MAGIC:
        raise FrameError("bad_magic", f"not a torchpulse frame (magic {magic!r})")
    if version != PROTOCOL_VERSION:
        raise FrameError(
            "version_mismatch",
            f"protocol version {version} is not supported by this side (speaks {PROTOCOL_VERSION}); "
            "upgrade the agent and the daemon together",
        )
    if length > MAX_FRAME_BYTES:
        raise FrameError("oversized", f"frame length {length} exceeds {MAX_FRAME_BYTES}")
    return int(length)


_agent_decoder = msgspec.msgpack.Decoder(AgentFrame)
_daemon_decoder = msgspec.msgpack.Decoder(DaemonFrame)


def decode_agent_frame(body: bytes) -> AgentFrame:
    """Decode a body sent by an agent (or a CLI client) to the daemon."""
    try:
        frame: AgentFrame = _agent_decoder.decode(body)
        return frame
    except msgspec.ValidationError as exc:
        # Well-formed msgpack of a shape we do not know: most often a newer
        # agent's message type, so it is named apart from garbage bytes.
        reason = "unknown_type" if "`$.type`" in str(exc) else "invalid_frame"
        raise FrameError(reason, f"invalid frame: {exc}") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        # msgspec raises UnicodeDecodeError, not DecodeError, for a string that is not UTF-8.
        raise FrameError("decode_error", f"undecodable frame: {exc}") from None


def decode_daemon_frame(body: bytes) -> DaemonFrame:
    """Decode a body sent by the daemon."""
    try:
        frame: DaemonFrame = _daemon_decoder.decode(body)
        return frame
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise FrameError("decode_error", f"undecodable frame: {exc}") from None
