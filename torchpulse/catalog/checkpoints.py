"""Families of checkpoint-save announcements from agents."""

from __future__ import annotations

from typing import Final

from torchpulse.catalog.family import Family

FAMILIES: Final[tuple[Family, ...]] = ()
