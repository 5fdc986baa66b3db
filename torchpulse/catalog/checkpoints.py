"""Families of checkpoint-save announcements from agents."""

from __future__ import annotations

from typing import Final

from torchpulse.catalog.family import SAVE_BUCKETS, Family

FAMILIES: Final[tuple[Family, ...]] = (
    Family("checkpoint_save_duration_seconds", "histogram",
           "Wall time of torch.distributed.checkpoint save (api=save) or of an async save until its upload "
           "finished (api=async_save), on this rank.", ("api",), SAVE_BUCKETS),
)
