"""Metric family type and the shared bucket layouts of the catalog.

The families themselves live in :mod:`torchpulse.catalog`, one module per
probe area.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final, Literal

PREFIX: Final = "torchpulse_"
# Prometheus label names; `__` is reserved and `le` is the histogram's own label.
_LABEL_NAME: Final = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
Kind = Literal["counter", "gauge", "histogram"]

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


@dataclass(frozen=True)
class Family:
    """One metric family as agents send it (labels exclude `run` and `rank`)."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()

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
        if {"run", "rank", "job", "instance"} & set(self.labels):
            raise ValueError(f"{self.name}: run/rank are added by the daemon; job/instance belong to Prometheus")

    @property
    def exposed_name(self) -> str:
        return PREFIX + self.name
