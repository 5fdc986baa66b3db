"""Families of checkpoint-save announcements from agents."""

from __future__ import annotations

from typing import Final

from torchpulse.catalog.family import SAVE_BUCKETS, Family

FAMILIES: Final[tuple[Family, ...]] = (
    Family(
        "checkpoint_save_duration_seconds",
        "histogram",
        "Wall time of torch.distributed.checkpoint save (api=save) or of an async save until its upload "
        "finished (api=async_save), on this rank.",
        ("api",),
        SAVE_BUCKETS,
    ),
    Family(
        "checkpoint_save_failures_total",
        "counter",
        "torch.distributed.checkpoint saves that raised on this rank (api=save, or api=async_save while "
        "staging or in its upload), by the class of what went wrong (error: for DCP's CheckpointException the first "
        "failing rank's exception, e.g. OSError; cut to 64 characters; the first 8 names per process, the rest "
        "other).",
        ("api", "error"),
    ),
)
