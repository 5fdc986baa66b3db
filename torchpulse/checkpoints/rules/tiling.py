"""TP-CKPT-010: the chunks of each tensor tile it exactly.

In bounds, pairwise disjoint and total volume equal to numel together mean an
exact tiling. Disjointness uses a sweep along the longest dim with a heap of
active chunks, so sharded layouts (FSDP rows, MoE experts) cost O(n log n); torch's
save-time check (`_validate_global_plan`) never runs on load.
"""

from __future__ import annotations

import heapq
import math
from itertools import islice
from operator import add, itemgetter, le

from torchpulse.checkpoints.model import Chunk, Finding, TensorEntry
from torchpulse.checkpoints.rules import error, kernels

_MAX_REPORTED = 5


def _overlaps(a: Chunk, b: Chunk) -> bool:
    for ao, asz, bo, bsz in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True):
        if ao + asz <= bo or bo + bsz <= ao:
            return False
    return True


def _out_of_bounds(chunk: Chunk, size: tuple[int, ...]) -> bool:
    if len(chunk.offsets) != len(size) or len(chunk.sizes) != len(size):
        return True
    # A zero-size chunk may sit at offset == dim: uneven FSDP2 shards write those.
    return any(o < 0 or s < 0 or o + s > d for o, s, d in zip(chunk.offsets, chunk.sizes, size, strict=True))


_offsets_of, _sizes_of = itemgetter(0), itemgetter(1)


def _all_in_bounds(chunks: tuple[Chunk, ...], size: tuple[int, ...]) -> bool:
    """`_out_of_bounds` of no chunk, decided per dimension with C-level loops (MoE: 4,096 chunks a tensor)."""
    if not chunks:
        return True
    offsets, sizes = list(map(_offsets_of, chunks)), list(map(_sizes_of, chunks))
    if set(map(len, offsets)) != {len(size)} or set(map(len, sizes)) != {len(size)}:
        return False
    for dim, (starts, lengths) in enumerate(zip(zip(*offsets, strict=True), zip(*sizes, strict=True), strict=True)):
        if min(starts) < 0 or min(lengths) < 0 or max(map(add, starts, lengths)) > size[dim]:
            return False
    return True


def _disjoint_along(chunks: tuple[Chunk, ...], dim: int) -> bool:
    """True when the chunks' extents along `dim` never overlap (then no two chunks share an element).

    Row-sharded (FSDP) and expert-sharded (MoE) layouts pass this in C-level
    loops; others, and every real overlap, go to the exact sweep.
    """
    along = itemgetter(dim)
    spans = sorted(zip(map(along, map(_offsets_of, chunks)), map(along, map(_sizes_of, chunks)), strict=True))
    starts = list(map(_offsets_of, spans))
    ends = map(add, starts, map(_sizes_of, spans))
    return all(map(le, ends, islice(starts, 1, None)))


def overlapping_pairs(chunks: list[Chunk], dim: int = 0) -> list[tuple[Chunk, Chunk]]:
    """Pairs of chunks sharing at least one element (found by a sweep along `dim`)."""
    solid = [c for c in chunks if c.sizes and all(s > 0 for s in c.sizes)]
    solid.sort(key=lambda c: c.offsets[dim])
    active: list[tuple[int, int, Chunk]] = []  # (end on dim 0, tiebreak, chunk)
    found: list[tuple[Chunk, Chunk]] = []
    for i, chunk in enumerate(solid):
        start = chunk.offsets[dim]
        while active and active[0][0] <= start:
            heapq.heappop(active)
        for _, _, other in active:
            if _overlaps(chunk, other):
                found.append((other, chunk))
                if len(found) >= _MAX_REPORTED:
                    return found
        heapq.heappush(active, (start + chunk.sizes[dim], i, chunk))
    return found


def exact_tiling(tensor: TensorEntry) -> list[Finding]:
    """Check one tensor's chunks: bounds, disjointness, and volume == numel."""
    out: list[Finding] = []
    key = tensor.key
    if not tensor.size:  # a scalar: exactly one chunk
        if len(tensor.chunks) != 1:
            out.append(error("TP-CKPT-010", key, f"scalar stored as {len(tensor.chunks)} chunks"))
        return out
    if kernels.tiling_holds(tensor.chunks, tensor.size):
        return out
    bad = (
        []
        if _all_in_bounds(tensor.chunks, tensor.size)
        else [c for c in tensor.chunks if _out_of_bounds(c, tensor.size)]
    )
    for c in bad[:_MAX_REPORTED]:
        out.append(
            error(
                "TP-CKPT-010",
                key,
                f"chunk offsets {list(c.offsets)} sizes {list(c.sizes)} fall outside shape {list(tensor.size)}",
            )
        )
    if bad:
        return out
    numel = math.prod(tensor.size)
    volume = sum(map(math.prod, map(_sizes_of, tensor.chunks)))
    longest = max(range(len(tensor.size)), key=lambda d: tensor.size[d])
    pairs = [] if _disjoint_along(tensor.chunks, longest) else overlapping_pairs(list(tensor.chunks), longest)
    for a, b in pairs:
        out.append(error("TP-CKPT-010", key, f"chunks at {list(a.offsets)} and {list(b.offsets)} overlap"))
    if volume < numel:
        out.append(
            error(
                "TP-CKPT-010",
                key,
                f"chunks cover {volume} of {numel} elements: {numel - volume} are never written and load as garbage",
            )
        )
    elif volume > numel and not pairs:
        out.append(error("TP-CKPT-010", key, f"chunks hold {volume} elements for {numel}"))
    elif volume == numel and pairs:
        out.append(error("TP-CKPT-010", key, "overlap of equal volume leaves a gap elsewhere"))
    return out


def all_tilings(tensors: list[TensorEntry]) -> list[Finding]:
    out: list[Finding] = []
    for t in tensors:
        out.extend(exact_tiling(t))
    return out
