"""The metric catalog: every family an agent may send, with its type and labels.

This is the contract between probes, daemon and dashboards. Agents send the
family name without the ``torchpulse_`` prefix and only the label values
listed here; the daemon adds ``run`` and ``rank`` from the connection and
refuses series of unknown families, so an agent cannot invent metric names.
Each probe area owns one module; this one merges them. Nothing here imports
torch, so the daemon can use it.
"""

from __future__ import annotations

from typing import Final

from torchpulse.catalog import autograd, checkpoints, compile, foundation
from torchpulse.catalog.family import PREFIX, Family, Kind

__all__ = ["CATALOG", "HISTOGRAM_BOUNDS", "PREFIX", "Family", "Kind"]


def _merge(*groups: tuple[Family, ...]) -> dict[str, Family]:
    merged: dict[str, Family] = {}
    for group in groups:
        for family in group:
            if family.name in merged:
                raise ValueError(f"metric family {family.name} is defined twice")
            merged[family.name] = family
    return merged


CATALOG: Final[dict[str, Family]] = _merge(
    foundation.FAMILIES, compile.FAMILIES, autograd.FAMILIES, checkpoints.FAMILIES
)
# Each histogram family's bucket bounds: agents send theirs in the hello, so that a daemon of
# another version re-buckets or refuses what they count instead of mislabelling it.
HISTOGRAM_BOUNDS: Final[dict[str, tuple[float, ...]]] = {
    name: family.buckets for name, family in CATALOG.items() if family.kind == "histogram"
}
