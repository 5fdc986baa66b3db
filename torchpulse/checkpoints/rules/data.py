"""Rules over what the data read found: stored dtype/shape, CRC, unreadable items."""

from __future__ import annotations

from collections.abc import Sequence

from torchpulse.checkpoints.model import (
    Checkpoint,
    Finding,
    ItemProblem,
    StoredBytes,
    StoredTensor,
)
from torchpulse.checkpoints.rules import error, info


def stored_matches_metadata(ckpt: Checkpoint, stored: Sequence[StoredTensor]) -> list[Finding]:
    """TP-CKPT-019/020: each stored chunk has the metadata's dtype and the chunk's shape."""
    out: list[Finding] = []
    for s in stored:
        tensor = ckpt.tensors.get(s.key)
        if tensor is None:
            continue
        where = f" (chunk at {list(s.chunk_offsets)})" if len(tensor.chunks) > 1 else ""
        if s.dtype != tensor.dtype:
            out.append(
                error(
                    "TP-CKPT-019",
                    s.key,
                    f"stored as {s.dtype} but the metadata says "
                    f"{tensor.dtype}{where}: load reinterprets or converts silently",
                )
            )
        sizes = next((c.sizes for c in tensor.chunks if c.offsets == s.chunk_offsets), None)
        if sizes is not None and tuple(s.shape) != tuple(sizes):
            out.append(
                error(
                    "TP-CKPT-020",
                    s.key,
                    f"stored shape {list(s.shape)} but the chunk is {list(sizes)}{where}",
                )
            )
    return out


def item_problems(problems: Sequence[ItemProblem]) -> list[Finding]:
    """TP-CKPT-023/024: CRC mismatches and items that could not be parsed."""
    out: list[Finding] = []
    for p in problems:
        if p.kind == "crc":
            out.append(error("TP-CKPT-023", p.key, f"CRC32 mismatch in {p.relative_path}: {p.detail}"))
        else:
            out.append(error("TP-CKPT-024", p.key, f"unreadable in {p.relative_path}: {p.detail}"))
    return out


def unverifiable_bytes(items: Sequence[StoredBytes]) -> list[Finding]:
    """TP-CKPT-025: bytes items that would need code to be run are reported, not executed."""
    return [
        info("TP-CKPT-025", b.key, f"not verified: {b.reason}") for b in items if not b.verifiable and not b.sharded
    ]


def sharded_bytes(items: Sequence[StoredBytes]) -> list[Finding]:
    """TP-CKPT-027: a bytes item that pickles rank-local tensors holds one rank's shards only.

    DCP writes each bytes item from one rank (items are deduplicated by key), so a
    DTensor with Shard placements or a ShardedTensor pickled inside one (a state dict
    saved with `flatten_state_dict=False`, sharded tensors in a tuple or an object)
    keeps that rank's shards; `dcp.load` gives every rank those, with no error.
    """
    return [
        error(
            "TP-CKPT-027",
            b.key,
            f"holds {b.sharded} pickled whole: DCP wrote it from one rank, so the other "
            "ranks' shards are not in the checkpoint (save sharded tensors as state dict entries: "
            "flatten_state_dict=True, no tuples or objects around them)",
        )
        for b in items
        if b.sharded
    ]
