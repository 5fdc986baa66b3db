"""Property-based tests of the `.metadata` parser and of the tiling rule against a brute-force oracle."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchpulse.checkpoints.model import Chunk, TensorEntry
from torchpulse.checkpoints.rules.tiling import exact_tiling
from torchpulse.checkpoints.unpickler import MetadataStandIn, load_metadata

# What the reader turns into a "metadata unreadable" finding; anything else escaping is a crash.
NOT_A_FINDING = (MemoryError, OSError)


def _cells(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(o, o + s) for o, s in zip(offsets, sizes, strict=True))))


def tiles_exactly(size: tuple[int, ...], chunks: list[Chunk]) -> bool:
    """The oracle: every chunk in bounds and every element of the tensor written exactly once."""
    for c in chunks:
        if len(c.offsets) != len(size) or len(c.sizes) != len(size):
            return False
        if any(o < 0 or s < 0 or o + s > d for o, s, d in zip(c.offsets, c.sizes, size, strict=True)):
            return False
    cover = Counter(cell for c in chunks for cell in _cells(c.offsets, c.sizes))
    return all(cover[cell] == 1 for cell in _cells((0,) * len(size), size))


@st.composite
def tensors(draw: st.DrawFn) -> TensorEntry:
    size = tuple(draw(st.lists(st.integers(0, 5), min_size=1, max_size=3)))
    if draw(st.booleans()):
        # A real sharding: split each dim into pieces, then perhaps drop, duplicate or nudge one.
        cuts = [sorted(draw(st.lists(st.integers(0, d), max_size=2))) for d in size]
        bounds = [[0, *c, d] for c, d in zip(cuts, size, strict=True)]
        chunks = [
            Chunk(
                tuple(b[i] for b, i in zip(bounds, idx, strict=True)),
                tuple(b[i + 1] - b[i] for b, i in zip(bounds, idx, strict=True)),
            )
            for idx in itertools.product(*(range(len(b) - 1) for b in bounds))
        ]
        edit = draw(st.sampled_from(["none", "drop", "dup", "nudge"]))
        if chunks and edit == "drop":
            chunks.pop(draw(st.integers(0, len(chunks) - 1)))
        elif chunks and edit == "dup":
            chunks.append(chunks[draw(st.integers(0, len(chunks) - 1))])
        elif chunks and edit == "nudge":
            i = draw(st.integers(0, len(chunks) - 1))
            offsets = list(chunks[i].offsets)
            offsets[draw(st.integers(0, len(offsets) - 1))] += draw(st.sampled_from([-1, 1]))
            chunks[i] = Chunk(tuple(offsets), chunks[i].sizes)
    else:
        dims = st.lists(st.integers(-2, 6), min_size=len(size), max_size=len(size)).map(tuple)
        odd = st.lists(st.integers(-2, 6), max_size=4).map(tuple)
        chunks = draw(st.lists(st.builds(Chunk, dims | odd, dims | odd), max_size=6))
    return TensorEntry("t", "float32", size, tuple(chunks))


@given(tensors())
def test_tiling_rule_agrees_with_brute_force(tensor: TensorEntry) -> None:
    """TP-CKPT-010 reports nothing exactly when every element is written once and every chunk is in bounds."""
    findings = exact_tiling(tensor)
    assert tiles_exactly(tensor.size, list(tensor.chunks)) == (not findings)


@given(st.binary(max_size=256))
def test_unpickler_on_arbitrary_bytes_refuses_or_returns_metadata(data: bytes) -> None:
    """Random bytes yield a Metadata stand-in or a refusal the reader reports; nothing else escapes."""
    try:
        result = load_metadata(data)
    except NOT_A_FINDING:
        raise
    except Exception:
        return
    assert isinstance(result, MetadataStandIn)


@pytest.fixture(scope="module")
def pristine_metadata(saved_checkpoint: Path) -> bytes:
    return (saved_checkpoint / ".metadata").read_bytes()


@settings(
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow], max_examples=150, deadline=None
)
@given(st.data())
def test_mutated_real_metadata_unpickles_or_is_refused(pristine_metadata: bytes, data: st.DataObject) -> None:
    """Byte flips in a genuine `.metadata` give stand-ins or a refusal, never another kind of failure."""
    raw = bytearray(pristine_metadata)
    for _ in range(data.draw(st.integers(1, 3))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    try:
        load_metadata(bytes(raw))
    except NOT_A_FINDING:
        raise
    except Exception:
        return


def test_tiling_stays_fast_for_many_chunks() -> None:
    """Ten thousand row shards of one tensor are checked in well under a second."""
    rows = 10_000
    tensor = TensorEntry("w", "float32", (rows, 8), tuple(Chunk((r, 0), (1, 8)) for r in range(rows)))
    assert [] == exact_tiling(tensor)
    assert math.prod(tensor.size) == sum(math.prod(c.sizes) for c in tensor.chunks)
