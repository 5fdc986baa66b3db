"""What the daemon knows: runs, their ranks, and each rank's latest series values.

Agents send running totals, so applying a batch is an overwrite, never an
add: a resent or duplicated batch changes nothing. Everything here runs on
the daemon's event loop thread; collectors read it on the same thread.
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

import structlog

from torchpulse.bounds import TokenBucket
from torchpulse.catalog import CATALOG
from torchpulse.daemon.buckets import BucketPlan, Refused, plan_for, rebucket
from torchpulse.protocol import Batch, FrameError, Hello, LogEvent

log = structlog.get_logger("torchpulse.daemon")
MAX_LABEL_CHARS: Final = 200
# run_info carries the command line; agents cut it at 256 characters.
MAX_COMMAND_CHARS: Final = 512
SeriesKey = tuple[str, tuple[str, ...]]
COUNTER_FAMILIES: Final = frozenset(name for name, family in CATALOG.items() if family.kind == "counter")
# Log events of one rank the daemon writes: a whole burst (an agent's full event queue several
# times over), then a few a second. Kept across reconnects of the same process.
EVENT_LOG_BURST: Final = 10_000
EVENT_LOG_RATE: Final = 20.0
# `autograd.node` events come only when asked for (`ctl autograd-log N`, at most 100 passes):
# one per node of each pass, so a large model's request alone is tens of thousands of lines.
# They get a bucket of their own, large enough for such a request, and do not use up the other.
NODE_LOG_EVENT: Final = "autograd.node"
NODE_LOG_BURST: Final = 250_000
NODE_LOG_RATE: Final = 2_000.0


def _event_budget() -> TokenBucket:
    # Agents' events become daemon log lines: a buggy or hostile agent sending thousands per frame
    # would fill the journal, whose own rate limit then drops the daemon's lines about other jobs too.
    return TokenBucket(EVENT_LOG_RATE, EVENT_LOG_BURST, time.monotonic())


def _node_log_budget() -> TokenBucket:
    return TokenBucket(NODE_LOG_RATE, NODE_LOG_BURST, time.monotonic())


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int
    groups: frozenset[int] = frozenset()


def _still_running(peer: Peer | None) -> bool:
    """Whether the process that opened a connection still exists (pid from SO_PEERCRED, in our namespace).

    A connection outlives its process where a forked child inherited the socket (a DataLoader
    worker of a crashed rank): then a restarted rank takes over. Unknown (no peer credentials,
    a pid from another namespace): assume it runs.
    """
    if peer is None or peer.pid <= 0:
        return True
    try:
        os.kill(peer.pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: another user's process, alive
        return True
    return True


@dataclass
class RankState:
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
    # Sends a frame to this rank's agent while it is connected (set by the server).
    channel: Callable[[bytes], None] | None = None
    # The server's id of the connection that owns this rank now, and how to close
    # it: a newer hello for the rank (a reconnect, a restarted process) takes over.
    connection: int = 0
    close: Callable[[], None] | None = None
    # Steps per second of the first optimizer, smoothed; for synchronised traces.
    step_rate: float = 0.0
    _rate_mark: tuple[float, float] | None = None
    # Owned by the series collector: rendered `name{labels}` prefixes per series.
    render_cache: dict[SeriesKey, str | tuple[str, ...]] = field(default_factory=dict)
    # Owned by the server: how many of this rank's log events it still writes, and when it last
    # said how many it did not.
    log_budget: TokenBucket = field(default_factory=_event_budget)
    node_log_budget: TokenBucket = field(default_factory=_node_log_budget)
    suppressed_reported_at: float = 0.0

    @property
    def series(self) -> int:
        """Series this rank holds (they count against its run's series limit)."""
        return len(self.values) + len(self.histograms)

    @property
    def events_dropped(self) -> int:
        return int(sum(v for (name, _), v in self.values.items() if name == "agent_events_dropped_total"))


@dataclass
class RunState:
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


def _update_step_rate(state: RankState, steps: float) -> None:
    if not math.isfinite(steps):
        return  # a buggy agent's inf/NaN must not poison the rate that traces are planned with
    now = time.monotonic()
    mark = state._rate_mark
    state._rate_mark = (now, steps)
    if mark is not None and now > mark[0] and steps >= mark[1]:
        rate = (steps - mark[1]) / (now - mark[0])
        state.step_rate = rate if state.step_rate == 0 else 0.7 * state.step_rate + 0.3 * rate


def _log_bucket_plan(hello: Hello, plan: BucketPlan) -> None:
    """Once per hello: which of the agent's histogram families are re-bucketed, and which refused and why."""
    refused = {name: p.why for name, p in plan.items() if isinstance(p, Refused)}
    rebucketed = sorted(name for name, p in plan.items() if not isinstance(p, Refused))
    fields = {"run": hello.run, "rank": hello.rank, "agent_version": hello.agent_version}
    if rebucketed:
        log.info(
            "agent buckets histograms more finely than this daemon; summed into the daemon's buckets",
            families=rebucketed,
            **fields,
        )
    if refused:
        log.warning(
            "agent buckets histograms otherwise than this daemon; those histograms are refused "
            "(bad_buckets) until the job runs the daemon's torchpulse version",
            families=refused,
            **fields,
        )


class Registry:
    def __init__(
        self,
        series_limit_per_run: int = 5000,
        grace_period: float = 300.0,
        max_runs: int = 1000,
        max_ranks_per_run: int = 1024,
        lost_grace_period: float = 3600.0,
    ) -> None:
        self.series_limit_per_run = series_limit_per_run
        self.grace_period = grace_period
        self.lost_grace_period = lost_grace_period
        # Bounds on what a local client can make the daemon hold (a run name or a
        # rank number per hello): ended runs and disconnected ranks make room first.
        self.max_runs = max_runs
        self.max_ranks_per_run = max_ranks_per_run
        self.runs: dict[str, RunState] = {}
        self.events_received = 0
        self.frames_rejected: Counter[str] = Counter()
        self.series_rejected: Counter[str] = Counter()
        self.connections = 0
        self.started = time.monotonic()

    # -- connections --------------------------------------------------------
    def connect(self, hello: Hello, peer: Peer | None) -> tuple[RunState, RankState]:
        # `run` is a label on every series of the run and `host` one of run_info: a
        # megabyte-long name would be copied into thousands of rendered series.
        for name, value, limit in (
            ("run", hello.run, MAX_LABEL_CHARS),
            ("host", hello.host, MAX_LABEL_CHARS),
            ("torch_version", hello.torch_version, MAX_LABEL_CHARS),
            ("agent_version", hello.agent_version, MAX_LABEL_CHARS),
            ("command", hello.command, MAX_COMMAND_CHARS),
        ):
            if len(value) > limit:
                raise FrameError("invalid_frame", f"hello: {name} is longer than {limit} characters")
        run = self.runs.get(hello.run)
        if run is None:
            if len(self.runs) >= self.max_runs and not self._forget_oldest_ended_run():
                raise FrameError(
                    "too_many_runs",
                    f"the daemon already holds {self.max_runs} runs with a connected agent (runs.max_runs); retrying",
                )
            run = self.runs[hello.run] = RunState(hello.run)
        previous = run.ranks.get(hello.rank)
        if previous is None and len(run.ranks) >= self.max_ranks_per_run and not self._forget_a_rank(run):
            raise FrameError(
                "too_many_ranks",
                f"run {hello.run!r} already has {self.max_ranks_per_run} "
                "connected ranks here (runs.max_ranks_per_run); retrying",
            )
        same_process = previous is not None and (
            previous.hello.pid,
            previous.hello.host,
            previous.hello.started_at,
        ) == (hello.pid, hello.host, hello.started_at)
        if (
            previous is not None
            and previous.connected
            and not previous.exited
            and not same_process
            and _still_running(previous.peer)
        ):
            # Two live processes claim one rank: taking turns, they would overwrite each other's
            # running totals (counters jumping back and forth). The first keeps it. One whose agent
            # said goodbye gave the rank up, though its connection may outlive that (a forked child
            # holding the socket, a close not read yet): it is no claimant.
            raise FrameError(
                "rank_taken",
                f"rank {hello.rank} of run {hello.run!r} is held by pid "
                f"{previous.hello.pid} on {previous.hello.host!r}: two processes report as one rank "
                "(two jobs with one run name, or a wrong RANK); retrying",
            )
        run.ended_at = None
        self._forget_restarted_ranks(run, hello)
        if previous is not None and previous.connected and previous.close is not None:
            # The older connection is dead or about to be: its frames must not
            # overwrite newer totals, nor its close mark the rank disconnected.
            previous.close()
        if previous is not None and same_process:
            # The same process reconnecting: keep what it told us so far. A pid reused on the same host
            # (a restarted container) is a new process: its started_at differs.
            previous.hello, previous.peer, previous.connected = hello, peer, True
            previous.exited, previous.disconnected_at, previous.disconnected_wall = False, None, None
            previous.connected_at = previous.last_seen = time.monotonic()
            state = previous
        else:
            if previous is not None:
                run.series -= previous.series
            state = run.ranks[hello.rank] = RankState(hello, peer)
        state.bucket_plan = plan_for(hello.histogram_bounds)
        if state.bucket_plan:
            _log_bucket_plan(hello, state.bucket_plan)
        self.connections += 1
        return run, state

    @staticmethod
    def _forget_restarted_ranks(run: RunState, hello: Hello) -> None:
        """Forget the run's down ranks whose slot this hello's process took over once they were gone.

        torchelastic restarts every worker of a node in its slot (host, local rank), but the rendezvous
        may number them otherwise: a node left (the world shrank) or another joined ahead of this one.
        The rank the slot had before is no longer part of the job, not down: kept, it would stay `gone`
        (TorchpulseAgentDown, and the run's world size) for as long as the run goes on and an hour after.
        Only a process started after the rank went counts: a rank of the same slot running beside it
        (ranks without LOCAL_RANK all read 0) reconnecting later is no restart.
        """
        for rank, state in list(run.ranks.items()):
            if (
                rank != hello.rank
                and not state.connected
                and not state.exited
                and state.disconnected_wall is not None
                and hello.started_at > state.disconnected_wall
                and (state.hello.host, state.hello.local_rank) == (hello.host, hello.local_rank)
            ):
                Registry._drop_rank(run, rank)
                log.info(
                    "rank forgotten: its slot was restarted as another rank",
                    run=run.name,
                    rank=rank,
                    pid=state.hello.pid,
                    local_rank=hello.local_rank,
                    restarted_as=hello.rank,
                    new_pid=hello.pid,
                )

    def _forget_oldest_ended_run(self) -> bool:
        # Runs that ended cleanly first: forgetting one that lost a rank silently ends its down alert.
        ended = [(run.lost_a_rank, run.ended_at, name) for name, run in self.runs.items() if run.ended_at is not None]
        if not ended:
            return False
        *_, name = min(ended)
        del self.runs[name]
        log.info(
            "ended run forgotten before its grace period to make room (runs.max_runs)", run=name, max_runs=self.max_runs
        )
        return True

    @staticmethod
    def _forget_a_rank(run: RunState) -> bool:
        # Exited ranks first: a crashed one dropped here would silently end its down alert.
        gone = [(not state.exited, state.last_seen, rank) for rank, state in run.ranks.items() if not state.connected]
        if not gone:
            return False
        *_, rank = min(gone)
        Registry._drop_rank(run, rank)
        return True

    @staticmethod
    def _drop_rank(run: RunState, rank: int) -> None:
        """Forget a disconnected rank and the series it held against its run's limit."""
        run.series -= run.ranks.pop(rank).series

    @staticmethod
    def owns(run: RunState, state: RankState, connection: int) -> bool:
        """Whether `connection` still speaks for the rank (no newer hello took it over)."""
        return run.ranks.get(state.hello.rank) is state and state.connection == connection

    def disconnect(self, run: RunState, state: RankState, connection: int) -> None:
        self.connections -= 1
        if self.owns(run, state, connection):
            state.connected = False
            state.disconnected_at, state.disconnected_wall = time.monotonic(), time.time()
            state.channel = state.close = None
        if not any(rank.connected for rank in run.ranks.values()):
            run.ended_at = time.monotonic()

    @staticmethod
    def goodbye(state: RankState) -> None:
        """The rank's agent announced a normal exit (or a detach) on the connection that owns it."""
        state.exited = True

    def reject_frame(self, reason: str) -> None:
        self.frames_rejected[reason] += 1

    # -- ingest -------------------------------------------------------------
    def apply(self, run: RunState, state: RankState, batch: Batch) -> list[LogEvent]:
        """Overwrite the rank's series with the batch's running totals; return its log events."""
        state.last_seen = time.monotonic()
        values = state.values
        for sample in batch.samples:
            key = (sample.family, sample.labels)
            value = sample.value
            if not 0.0 <= value < math.inf and sample.family in COUNTER_FAMILIES:
                # NaN, Inf or negative: not a count. Rendered, it would turn every rate() over the
                # series into NaN (or a reset); the last good total stays.
                self.series_rejected["bad_value"] += 1
                continue
            if key not in values:
                if not self._admit(run, sample.family, sample.labels, histogram=False):
                    continue
                run.series += 1
            values[key] = sample.value
            if sample.family == "optimizer_steps_total" and sample.labels[0].endswith("#0"):
                _update_step_rate(state, sample.value)
        histograms = state.histograms
        for hist in batch.histograms:
            if any(count < 0 for count in hist.bucket_counts):
                # Rendered cumulatively, a negative count makes `le` buckets decrease.
                self.series_rejected["bad_buckets"] += 1
                continue
            if not 0.0 <= hist.total < math.inf:
                # Every histogram in the catalog observes durations: a NaN, Inf or negative sum would
                # make rate(_sum) / rate(_count), the mean step time, NaN or a reset. The last good one stays.
                self.series_rejected["bad_value"] += 1
                continue
            counts = hist.bucket_counts
            plan = state.bucket_plan.get(hist.family)
            if plan is not None:
                if isinstance(plan, Refused) or len(counts) != len(plan):
                    self.series_rejected["bad_buckets"] += 1
                    continue
                counts = rebucket(counts, plan, len(CATALOG[hist.family].buckets) + 1)
            key = (hist.family, hist.labels)
            if key not in histograms:
                if not self._admit(run, hist.family, hist.labels, histogram=True):
                    continue
                family = CATALOG[hist.family]
                if len(counts) != len(family.buckets) + 1:
                    self.series_rejected["bad_buckets"] += 1
                    continue
                run.series += 1
            elif len(counts) != len(histograms[key][0]):
                self.series_rejected["bad_buckets"] += 1
                continue
            histograms[key] = (counts, hist.total)
        received = len(batch.samples) + len(batch.histograms) + len(batch.events)
        state.events_received += received
        self.events_received += received
        return batch.events

    def _admit(self, run: RunState, name: str, labels: tuple[str, ...], histogram: bool) -> bool:
        family = CATALOG.get(name)
        if family is None:
            self.series_rejected["unknown_family"] += 1
            return False
        if (family.kind == "histogram") != histogram or len(labels) != len(family.labels):
            self.series_rejected["bad_shape"] += 1
            return False
        if any(len(value) > MAX_LABEL_CHARS for value in labels):
            self.series_rejected["label_too_long"] += 1
            return False
        if run.series >= self.series_limit_per_run:
            run.series_rejected += 1
            self.series_rejected["run_series_limit"] += 1
            return False
        return True

    # -- housekeeping ---------------------------------------------------------
    def prune(self, now: float | None = None) -> tuple[list[str], list[tuple[str, int]]]:
        """Forget runs that ended, and ranks that exited, more than the grace period ago.

        A rank whose connection dropped without a goodbye (a crash, a kill, a hang
        the daemon cut off) stays until its run ends: it is what TorchpulseAgentDown
        is about. A run that ended so stays for the longer lost grace period: forgotten
        after five minutes, its alert would resolve as if the job had recovered. A
        restart of the job under its run name brings its ranks up again before that.
        Returns the runs and the (run, rank) pairs forgotten.
        """
        now = time.monotonic() if now is None else now
        expired = [
            name
            for name, run in self.runs.items()
            if run.ended_at is not None
            and now - run.ended_at >= (self.lost_grace_period if run.lost_a_rank else self.grace_period)
        ]
        for name in expired:
            del self.runs[name]
        departed: list[tuple[str, int]] = []
        for run in self.runs.values():
            for rank, state in list(run.ranks.items()):
                if (
                    state.exited
                    and not state.connected
                    and state.disconnected_at is not None
                    and now - state.disconnected_at >= self.grace_period
                ):
                    self._drop_rank(run, rank)
                    departed.append((run.name, rank))
        return expired, departed

    def counts(self) -> tuple[int, int]:
        """Active runs and connected ranks."""
        ranks = sum(1 for run in self.runs.values() for r in run.ranks.values() if r.connected)
        runs = sum(1 for run in self.runs.values() if run.ended_at is None)
        return runs, ranks
