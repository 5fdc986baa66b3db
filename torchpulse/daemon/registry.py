"""The registry: the one writer of the run model (`runs`), from hellos, batches, goodbyes and closes.

It decides which process a rank is (a reconnect, a restart, a second claimant), admits runs and ranks
within their bounds, and forgets what ended after its grace period. Everything here runs on the daemon's
event loop thread; collectors read the model on the same thread.
"""

from __future__ import annotations

import time
from collections import Counter

import structlog

from torchpulse.daemon.histogram_layouts import BucketPlan, Refused, plan_for
from torchpulse.daemon.ingest import apply_batch
from torchpulse.daemon.peercred import Peer, still_running
from torchpulse.daemon.runs import RankState, RunState
from torchpulse.limits import MAX_COMMAND_CHARS, MAX_LABEL_CHARS
from torchpulse.protocol import Batch, FrameError, Hello, LogEvent

log = structlog.get_logger("torchpulse.daemon")


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
            and still_running(previous.peer)
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
    def current(run: RunState, state: RankState) -> bool:
        """Whether `state` is still the rank's (no hello of a new process replaced it)."""
        return run.ranks.get(state.hello.rank) is state

    def disconnect(self, run: RunState, state: RankState, owned: bool) -> None:
        """A connection that said hello closed; `owned`: it still spoke for the rank (no newer one took over)."""
        self.connections -= 1
        if owned and self.current(run, state):
            state.connected = False
            state.disconnected_at, state.disconnected_wall = time.monotonic(), time.time()
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
        received = apply_batch(run, state, batch, self.series_limit_per_run, self.series_rejected)
        self.events_received += received
        return batch.events

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
