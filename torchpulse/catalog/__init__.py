"""The metric catalog: every family /metrics exports, with its type, labels and help.

This is the contract between probes, daemon and dashboards. Agents send the
family name without the ``torchpulse_`` prefix and only the label values
listed here; the daemon adds ``run`` and ``rank`` from the connection and
refuses series of families that are not in `CATALOG`, so an agent cannot
invent metric names (nor send one of the daemon's own). The daemon's
collectors take their families from `DAEMON_FAMILIES`. docs/metrics.md and
dashboards/metrics.txt are generated from `SECTIONS` (`make docs`).

Each probe area owns one module, the daemon one more; this one merges them.
Nothing here imports torch, so the daemon can use it.
"""

from __future__ import annotations

from typing import Final

from torchpulse.catalog import autograd, checkpoints, compile, daemon, foundation
from torchpulse.catalog.family import PREFIX, Family, Kind, Section

__all__ = [
    "CATALOG",
    "DAEMON_FAMILIES",
    "EXPORTED",
    "HISTOGRAM_BOUNDS",
    "PREFIX",
    "SECTIONS",
    "Family",
    "Kind",
    "Section",
]


def _merge(*groups: tuple[Family, ...]) -> dict[str, Family]:
    merged: dict[str, Family] = {}
    for group in groups:
        for family in group:
            if family.name in merged:
                raise ValueError(f"metric family {family.name} is defined twice")
            merged[family.name] = family
    return merged


# In the order docs/metrics.md and dashboards/metrics.txt list them.
SECTIONS: Final[tuple[Section, ...]] = (
    foundation.SECTION,
    compile.SECTION,
    autograd.SECTION,
    checkpoints.SECTION,
    daemon.SECTION,
)
EXPORTED: Final[dict[str, Family]] = _merge(*(section.families for section in SECTIONS))
CATALOG: Final[dict[str, Family]] = {name: f for name, f in EXPORTED.items() if f.source == "agent"}
DAEMON_FAMILIES: Final[dict[str, Family]] = {name: f for name, f in EXPORTED.items() if f.source == "daemon"}
# Each histogram family's bucket bounds: agents send theirs in the hello, so that a daemon of
# another version re-buckets or refuses what they count instead of mislabelling it.
HISTOGRAM_BOUNDS: Final[dict[str, tuple[float, ...]]] = {
    name: family.buckets for name, family in CATALOG.items() if family.kind == "histogram"
}
