"""The agent server's own state about ranks: which connection speaks for each one now, and how many of its
log events the daemon still writes.

Keyed by the registry's `RankState` (compared by identity): a rank's entry goes when the registry forgets
the rank, and a restarted process (a new `RankState`) starts afresh, while the same process reconnecting
keeps its log budget.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

import structlog

from torchpulse.bounds import TokenBucket
from torchpulse.daemon.log_settings import LOG_LEVELS
from torchpulse.daemon.logs import bounded_fields, cut
from torchpulse.daemon.runs import RankState
from torchpulse.limits import (
    EVENT_LOG_BURST,
    EVENT_LOG_RATE,
    MAX_NAME_CHARS,
    NODE_LOG_BURST,
    NODE_LOG_RATE,
    SUPPRESSED_REPORT_INTERVAL,
)
from torchpulse.protocol import LogEvent

log = structlog.get_logger("torchpulse.daemon.server")
# `autograd.node` events come only when asked for (`ctl autograd-log N`, at most 100 passes):
# one per node of each pass, so a large model's request alone is tens of thousands of lines.
# They get a bucket of their own, large enough for such a request, and do not use up the other.
NODE_LOG_EVENT: Final = "autograd.node"
# Names an agent's event field cannot have: who sent it, and the logger's own parameters.
RESERVED_FIELDS: Final = {
    "event",
    "run",
    "rank",
    "agent_ts",
    "level",
    "timestamp",
    "self",
    "exc_info",
    "exception",
    "stack_info",
}


@dataclass(frozen=True, eq=False)
class AgentLink:
    """One agent connection: its id, and how to write to it or close it."""

    id: int
    send: Callable[[bytes], None]
    close: Callable[[], None]


def _event_budget() -> TokenBucket:
    # Agents' events become daemon log lines: a buggy or hostile agent sending thousands per frame
    # would fill the journal, whose own rate limit then drops the daemon's lines about other jobs too.
    return TokenBucket(EVENT_LOG_RATE, EVENT_LOG_BURST, time.monotonic())


def _node_log_budget() -> TokenBucket:
    return TokenBucket(NODE_LOG_RATE, NODE_LOG_BURST, time.monotonic())


@dataclass
class LogBudget:
    """How many of one rank's log events the daemon still writes, and when it last said how many it did not."""

    events: TokenBucket = field(default_factory=_event_budget)
    nodes: TokenBucket = field(default_factory=_node_log_budget)
    reported_at: float = 0.0

    def write(self, run: str, rank: int, events: list[LogEvent]) -> None:
        """The agent's events as daemon log lines, within the budget."""
        now = time.monotonic()
        for event in events:
            budget = self.nodes if event.event == NODE_LOG_EVENT else self.events
            if not budget.take(now):
                continue
            level = event.level if event.level in LOG_LEVELS else "info"
            # An agent's field must not override who sent it.
            fields = {(f"field_{k}" if k in RESERVED_FIELDS else k): v for k, v in event.fields.items()}
            getattr(log, level)(
                cut(event.event, MAX_NAME_CHARS), run=run, rank=rank, agent_ts=event.ts, **bounded_fields(fields)
            )
        self.report_suppressed(run, rank, now)

    def report_suppressed(self, run: str, rank: int, now: float, final: bool = False) -> None:
        """One line per interval (and one when the rank leaves) saying how many of its events were not written."""
        suppressed = self.events.suppressed + self.nodes.suppressed
        if not suppressed or (not final and now - self.reported_at < SUPPRESSED_REPORT_INTERVAL):
            return
        log.warning(
            "agent log events suppressed: this rank sends more than the daemon writes",
            run=run,
            rank=rank,
            suppressed=suppressed,
            autograd_node=self.nodes.suppressed,
            burst=self.events.burst,
            per_second=self.events.rate,
        )
        self.events.suppressed = self.nodes.suppressed = 0
        self.reported_at = now


class ConnectionTable:
    """Written by the agent server only; the control hub reads it to send commands."""

    def __init__(self) -> None:
        self._links: weakref.WeakKeyDictionary[RankState, AgentLink] = weakref.WeakKeyDictionary()
        self._budgets: weakref.WeakKeyDictionary[RankState, LogBudget] = weakref.WeakKeyDictionary()

    def link(self, state: RankState) -> AgentLink | None:
        """The connection that speaks for the rank now, or None while it is not connected."""
        return self._links.get(state)

    def claim(self, state: RankState, link: AgentLink) -> None:
        """`link` speaks for the rank from now on; an older connection's frames and close no longer count."""
        self._links[state] = link

    def owns(self, state: RankState, connection: int) -> bool:
        link = self._links.get(state)
        return link is not None and link.id == connection

    def release(self, state: RankState, connection: int) -> None:
        """The connection closed: it no longer speaks for the rank (unless a newer one took over before)."""
        if self.owns(state, connection):
            del self._links[state]

    def budget(self, state: RankState) -> LogBudget:
        budget = self._budgets.get(state)
        if budget is None:
            budget = self._budgets[state] = LogBudget()
        return budget
