"""The wire schema: framing, versioning and the errors a bad peer gets."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from torchpulse.framing import FrameReader
from torchpulse.limits import MAX_FRAME_BYTES
from torchpulse.protocol import (
    HEADER,
    MAGIC,
    PROTOCOL_VERSION,
    Batch,
    FrameError,
    Hello,
    HistogramSample,
    LogEvent,
    Sample,
    decode_agent_frame,
    encode,
    parse_header,
)

HELLO = Hello("r", 1, 1, 2, 42, "h", "2.13.0", "0.1.0", "python train.py", 1.0)


def test_batch_round_trips_through_a_frame() -> None:
    """A batch encoded into a frame decodes to an equal batch."""
    batch = Batch(
        7,
        2.5,
        [Sample("optimizer_steps_total", ("AdamW#0",), 3.0)],
        [HistogramSample("optimizer_step_duration_seconds", ("AdamW#0",), (1, 2, 0), 0.5)],
        [LogEvent(1.0, "info", "recompile", {"reason": "size", "n": 1})],
    )
    frame = encode(batch)
    assert FrameReader().feed(frame) == [frame[HEADER.size :]]
    assert batch == decode_agent_frame(frame[HEADER.size :])


def test_reader_reassembles_frames_split_anywhere() -> None:
    """Frames fed one byte at a time come out whole and in order."""
    frames = encode(HELLO) + encode(Batch(1, 0.0, [], [], []))
    reader, bodies = FrameReader(), []
    for i in range(len(frames)):
        bodies += reader.feed(frames[i : i + 1])
    assert [HELLO, Batch(1, 0.0, [], [], [])] == [decode_agent_frame(b) for b in bodies]


def test_version_mismatch_is_a_clear_error() -> None:
    """A frame of another protocol version is refused with a message naming both versions."""
    with pytest.raises(FrameError) as info:
        parse_header(HEADER.pack(MAGIC, PROTOCOL_VERSION + 1, 0, 10))
    assert "version_mismatch" == info.value.reason
    assert f"speaks {PROTOCOL_VERSION}" in str(info.value)


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        (HEADER.pack(b"XX", PROTOCOL_VERSION, 0, 1), "bad_magic"),
        (HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, MAX_FRAME_BYTES + 1), "oversized"),
    ],
)
def test_bad_headers_are_refused(header: bytes, reason: str) -> None:
    """Wrong magic and oversized length prefixes are refused before any body is read."""
    with pytest.raises(FrameError) as info:
        parse_header(header)
    assert reason == info.value.reason


def test_unknown_message_type_is_named_apart_from_garbage() -> None:
    """A well-formed frame of an unknown type is `unknown_type`, garbage is `decode_error`."""
    with pytest.raises(FrameError) as unknown:
        decode_agent_frame(msgspec.msgpack.encode({"type": "from_the_future"}))
    with pytest.raises(FrameError) as garbage:
        decode_agent_frame(b"\xc1\xc1")
    assert ("unknown_type", "decode_error") == (unknown.value.reason, garbage.value.reason)


@given(st.binary(max_size=256))
def test_decoder_never_raises_anything_but_frame_error(data: bytes) -> None:
    """Arbitrary bytes either decode or raise FrameError, nothing else."""
    with contextlib.suppress(FrameError):
        decode_agent_frame(data)
