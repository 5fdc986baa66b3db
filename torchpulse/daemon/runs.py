"""The run model: runs, their ranks, and each rank's latest series values, and the read-only view of it
that the exporters and the status reply get.

The registry (`registry.Registry`) is the only writer. The agent server keeps its connections, and the
series collector its rendered prefixes, beside this model (keyed by `RankState`), never in it.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final, Protocol

from torchpulse.catalog import CATALOG
from torchpulse.daemon.histogram_layouts import BucketPlan
from torchpulse.daemon.peercred import Peer
from torchpulse.protocol import Hello

SeriesKey = tuple[str, tuple[str, ...]]
COUNTER_FAMILIES: Final = frozenset(name for name, family in CATALOG.items() if family.kind == "counter")


@dataclass(eq=False)  # compared, and hashed, by identity: the server and collectors key their state by it
class RankState:
    """One rank of a run, as its agent last reported it (kept after it disconnects, for a grace period)."""

    hello: Hello
    peer: Peer | None
    connected: bool = True
    connected_at: float = field(default_factory=time.monotonic)
    last_seen: float = field(default_factory=time.monotonic)
    # The agent said goodbye before its connection closed: its process exited normally or
    # detached. Such a rank is not down, and is forgotten after the grace period even while
    # the rest of its run goes on (an elastic job scaled down).
    exited: bool = False
    disconnected_at: float | None = None
    # The same moment by the wall clock, which agents' `started_at` is read on: a process started
    # later in this rank's slot (host, local rank) of the run is its restart, whatever rank it became.
    disconnected_wall: float | None = None
    events_received: int = 0
    values: dict[SeriesKey, float] = field(default_factory=dict)
    histograms: dict[SeriesKey, tuple[tuple[int, ...], float]] = field(default_factory=dict)
    # Histogram families this rank's agent buckets otherwise than the daemon (its hello says how).
    bucket_plan: BucketPlan = field(default_factory=dict)
    # Steps per second of the first optimizer, smoothed; for synchronised traces.
    step_rate: float = 0.0
    _rate_mark: tuple[float, float] | None = None

    @property
    def series(self) -> int:
        """Series this rank holds (they count against its run's series limit)."""
        return len(self.values) + len(self.histograms)

    @property
    def events_dropped(self) -> int:
        return int(sum(v for (name, _), v in self.values.items() if name == "agent_events_dropped_total"))


@dataclass
class RunState:
    """A run (a job): its ranks, and the series they hold against its limit."""

    name: str
    ranks: dict[int, RankState] = field(default_factory=dict)
    ended_at: float | None = None
    series: int = 0
    series_rejected: int = 0

    @property
    def reporting_uids(self) -> set[int | None]:
        """The uids whose processes report the run's ranks, connected or remembered (None: unknown).

        A run belongs to its user: the server refuses another user's hello for it, and `ctl`
        lets that user command it.
        """
        return {state.peer.uid if state.peer is not None else None for state in self.ranks.values()}

    @property
    def lost_a_rank(self) -> bool:
        """Whether a rank of the run disconnected without a goodbye (crashed, killed, cut off) and is still down."""
        return any(not state.connected and not state.exited for state in self.ranks.values())

    @property
    def info(self) -> Hello | None:
        return next(iter(self.ranks.values())).hello if self.ranks else None


class RunsView(Protocol):
    """What the exporters read of the registry (they never write it)."""

    @property
    def runs(self) -> Mapping[str, RunState]: ...
    @property
    def connections(self) -> int: ...
    @property
    def events_received(self) -> int: ...
    @property
    def frames_rejected(self) -> Counter[str]: ...
    @property
    def series_rejected(self) -> Counter[str]: ...

    def counts(self) -> tuple[int, int]: ...
