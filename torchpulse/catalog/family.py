"""Metric family type and the shared bucket layouts of the catalog.

The families themselves live in :mod:`torchpulse.catalog`, one module per
probe area, and one for the daemon's own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final, Literal

PREFIX: Final = "torchpulse_"
# Prometheus label names; `__` is reserved and `le` is the histogram's own label.
_LABEL_NAME: Final = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
Kind = Literal["counter", "gauge", "histogram"]
# Who produces a family's series: agents send "agent" families (the daemon adds `run` and `rank`);
# the daemon's own collectors export "daemon" families, labels and all.
Source = Literal["agent", "daemon"]

# Optimizer steps span ~100 µs (tiny CPU models) to minutes (huge CPU offload).
STEP_BUCKETS: Final = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
# One phase of compiling one graph: from ~10 ms (Dynamo on a small frame) to half an hour and more
# (Inductor on a large model with max-autotune), which 900 s used to fold into +Inf.
COMPILE_BUCKETS: Final = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    900.0,
    1800.0,
    3600.0,
)
# A DCP save (or an async save until its upload finished): ~0.1 s for a toy model, an hour for a large
# one on slow storage.
SAVE_BUCKETS: Final = (
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    900.0,
    1800.0,
    3600.0,
)
# One checkpoint validation, worker start to result: ~0.1 s at the metadata level, many minutes for the
# data level of 100 GB of shards. The daemon's checkpoint statistics bin by these bounds.
VALIDATION_BUCKETS: Final = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


@dataclass(frozen=True)
class Family:
    """One metric family: for an agent family, labels exclude `run` and `rank` (the daemon adds them).

    `help` is the exposition's HELP line; `doc` is what docs/metrics.md says beyond it (Markdown,
    never exposed).
    """

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    doc: str = ""
    source: Source = "agent"

    def __post_init__(self) -> None:
        if self.kind == "counter" and not self.name.endswith("_total"):
            raise ValueError(f"counter {self.name} must end in _total")
        if self.kind != "counter" and self.name.endswith("_total"):
            # Queries treat `_total` as "a counter: use rate()"; a gauge named so would be misread.
            raise ValueError(f"{self.kind} {self.name} must not end in _total")
        bad = [n for n in self.labels if not _LABEL_NAME.fullmatch(n) or n.startswith("__") or n == "le"]
        if bad or len(set(self.labels)) != len(self.labels):
            raise ValueError(f"{self.name}: invalid or repeated label names {list(self.labels)}")
        if self.kind == "histogram" and (not self.buckets or list(self.buckets) != sorted(set(self.buckets))):
            raise ValueError(f"histogram {self.name} needs strictly increasing buckets")
        if self.kind != "histogram" and self.buckets:
            raise ValueError(f"{self.kind} {self.name} cannot have buckets")
        if {"job", "instance"} & set(self.labels):
            raise ValueError(f"{self.name}: job/instance belong to Prometheus")
        if self.source == "agent" and {"run", "rank"} & set(self.labels):
            raise ValueError(f"{self.name}: run/rank are added by the daemon")
        if self.name.endswith("_info") and self.kind != "gauge":
            # Dashboards join on an `_info` family's labels, reading its value as always 1.
            raise ValueError(f"{self.kind} {self.name}: an _info family is a gauge")

    @property
    def exposed_name(self) -> str:
        return PREFIX + self.name

    @property
    def exposed_labels(self) -> tuple[str, ...]:
        """The labels /metrics shows, in order: an agent family's come after `run` and `rank`."""
        return ("run", "rank", *self.labels) if self.source == "agent" else self.labels

    @property
    def contract_kind(self) -> str:
        """The type dashboards/metrics.txt gives: `info` for an `_info` gauge, else the kind."""
        return "info" if self.name.endswith("_info") else self.kind

    @property
    def unit(self) -> str:
        """The unit the name's suffix says (the naming convention's base units); "" for counts and flags."""
        base = self.name.removesuffix("_total")
        if base.endswith(("_timestamp_seconds", "_time_seconds")):
            return "seconds since the epoch"
        for suffix in ("seconds", "bytes", "ratio"):
            if base.endswith(f"_{suffix}"):
                return suffix
        return ""


@dataclass(frozen=True)
class Section:
    """One part of docs/metrics.md: a title, its families in the order shown, and notes on what they share."""

    title: str
    families: tuple[Family, ...]
    notes: str = ""
