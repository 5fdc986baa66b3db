"""Property-based tests of the wire decoder and of what the daemon does with whatever it decodes."""

from __future__ import annotations

import math

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import parse_exposition
from torchpulse.catalog import CATALOG
from torchpulse.daemon.registry import Registry
from torchpulse.exporters.collectors.series import AgentSeriesCollector
from torchpulse.framing import FrameReader
from torchpulse.limits import MAX_FRAME_BYTES, MAX_LABEL_CHARS
from torchpulse.protocol import (
    HEADER_SIZE,
    Batch,
    FrameError,
    Hello,
    HistogramSample,
    LogEvent,
    Sample,
    decode_agent_frame,
    decode_daemon_frame,
    encode,
    parse_header,
)

FAMILIES = sorted(CATALOG)
labels = st.text(max_size=12) | st.just("x" * (MAX_LABEL_CHARS + 1))
floats = st.floats(allow_nan=False)
samples = st.builds(
    Sample, st.sampled_from(FAMILIES) | st.text(max_size=8), st.lists(labels, max_size=3).map(tuple), floats
)
histograms = st.builds(
    HistogramSample,
    st.sampled_from(FAMILIES),
    st.lists(labels, max_size=2).map(tuple),
    st.lists(st.integers(0, 2**40), max_size=20).map(tuple),
    floats,
)
field_values = st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | floats | st.text(max_size=20)
events = st.builds(
    LogEvent,
    floats,
    st.text(max_size=8),
    st.text(max_size=20),
    st.dictionaries(st.text(max_size=8), field_values, max_size=4),
)
batches = st.builds(
    Batch,
    st.integers(0, 2**63 - 1),
    floats,
    st.lists(samples, max_size=20),
    st.lists(histograms, max_size=5),
    st.lists(events, max_size=3),
)
runs = st.text(min_size=1, max_size=30)


@given(st.lists(batches, min_size=1, max_size=4), st.lists(st.integers(1, 64), min_size=1, max_size=30))
def test_any_valid_batches_survive_any_split(frames: list[Batch], cuts: list[int]) -> None:
    """Frames fed to the reader in arbitrary slices decode to exactly the batches that were sent."""
    stream = b"".join(encode(b) for b in frames)
    reader, bodies, at, i = FrameReader(), [], 0, 0
    while at < len(stream):
        step = cuts[i % len(cuts)]
        bodies += reader.feed(stream[at : at + step])
        at, i = at + step, i + 1
    assert frames == [decode_agent_frame(body) for body in bodies]


@given(st.binary(min_size=HEADER_SIZE, max_size=HEADER_SIZE))
def test_any_header_is_accepted_within_bounds_or_refused_with_a_reason(header: bytes) -> None:
    """parse_header returns a length no larger than the frame cap, or raises FrameError."""
    try:
        length = parse_header(header)
    except FrameError as exc:
        assert exc.reason in {"bad_magic", "version_mismatch", "oversized"}
    else:
        assert 0 <= length <= MAX_FRAME_BYTES


@given(batches, st.data())
def test_mutated_frames_raise_only_frame_error(batch: Batch, data: st.DataObject) -> None:
    """Flipping, cutting or inserting bytes of a real frame body never raises anything but FrameError."""
    body = bytearray(encode(batch)[HEADER_SIZE:])
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, max(0, len(body) - 1)))
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        if op == "flip" and body:
            body[at] ^= data.draw(st.integers(1, 255))
        elif op == "cut":
            del body[at : at + data.draw(st.integers(1, 8))]
        else:
            body[at:at] = data.draw(st.binary(min_size=1, max_size=8))
    for decode in (decode_agent_frame, decode_daemon_frame):
        try:
            decode(bytes(body))
        except FrameError as exc:
            assert exc.reason in {"decode_error", "invalid_frame", "unknown_type"}


@given(st.binary(max_size=2048))
def test_reader_on_garbage_raises_only_frame_error_and_buffers_at_most_one_frame(data: bytes) -> None:
    """Any byte stream yields frames or FrameError, and the reader never holds more than one frame."""
    reader = FrameReader()
    try:
        for i in range(0, len(data), 97):
            reader.feed(data[i : i + 97])
    except FrameError:
        return
    assert len(reader._buffer) <= HEADER_SIZE + MAX_FRAME_BYTES


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=60)
@given(runs, st.lists(batches, min_size=1, max_size=4), st.integers(1, 30))
def test_registry_and_exposition_hold_for_any_decoded_batch(run: str, frames: list[Batch], limit: int) -> None:
    """Whatever well-formed batches say, the series budget holds and /metrics stays parseable."""
    registry = Registry(series_limit_per_run=limit)
    hello = Hello(run, 0, 0, 1, 1, "host", "2.13.0", "0.1.0", "cmd", 0.0)
    state_run, state = registry.connect(hello, None)
    for frame in frames:
        registry.apply(state_run, state, frame)
    held = len(state.values) + len(state.histograms)
    assert (held, True) == (state_run.series, held <= limit)
    assert all(len(v) <= MAX_LABEL_CHARS for (_, lv) in (*state.values, *state.histograms) for v in lv)
    text = AgentSeriesCollector(registry).render()
    parsed = parse_exposition(text)
    exposed = {(name, dict(lv).get("run")) for (name, lv) in parsed}
    assert all(r == run for (_, r) in exposed)
    for (family, lv), value in state.values.items():
        expected_labels = {"run": run, "rank": "0", **dict(zip(CATALOG[family].labels, lv, strict=True))}
        key = (CATALOG[family].exposed_name, tuple(sorted(expected_labels.items())))
        assert math.isclose(value, parsed[key]) or value == parsed[key]


@given(st.binary(max_size=512))
def test_unknown_msgpack_shapes_are_named(data: bytes) -> None:
    """Arbitrary msgpack maps with a `type` key are refused as unknown or invalid, never crash."""
    body = msgspec.msgpack.encode({"type": data.decode("latin-1"), "payload": data})
    try:
        decode_agent_frame(body)
    except FrameError as exc:
        assert exc.reason in {"unknown_type", "invalid_frame"}
