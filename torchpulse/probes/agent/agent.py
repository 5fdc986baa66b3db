"""The in-process agent: a bounded hot-path buffer, cumulative state, and its probes.

Probes call `Agent.record(handler, *payload)` from training threads: an append
to a bounded deque and nothing else. The sender thread later runs each handler
to fold the record into the cumulative `MetricStore`, and ships the changes.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol, TypeVarTuple

from torchpulse.limits import MAX_FIELD_CHARS, MAX_REQUESTED_EVENTS
from torchpulse.probes.agent.config import AgentConfig
from torchpulse.probes.agent.control import Control
from torchpulse.probes.agent.identity import Identity
from torchpulse.probes.agent.logs import get_logger
from torchpulse.probes.agent.probe import Probe, ProbeFactory
from torchpulse.probes.agent.sender import Sender
from torchpulse.probes.agent.stall import StallWatch
from torchpulse.probes.agent.store import MetricStore
from torchpulse.protocol import FieldValue, LogEvent

log = get_logger("torchpulse.agent")
Payload = TypeVarTuple("Payload")


class _Handler(Protocol):
    """A queued record's handler, as the buffer holds it: `record` checked that it takes its own payload,
    the one thing `_drain` ever calls it with. A buffer of records of every payload type has no closer
    static type (Python's types have no "some payload, the handler's own")."""

    def __call__(self, *payload: object) -> None: ...


Record = tuple[_Handler, tuple[object, ...]]
# The `reason` values of agent_events_dropped_total, in the order `_sync_drop_counters` reads them.
DROP_REASONS = ("buffer_full", "events_overflow", "oversized")


def _cut(fields: dict[str, FieldValue]) -> dict[str, FieldValue]:
    return {k: (v[:MAX_FIELD_CHARS] if isinstance(v, str) else v) for k, v in fields.items()}


class Agent:
    """One per process; created by `torchpulse.attach()`."""

    def __init__(
        self, config: AgentConfig, identity: Identity, families: ProbeFactory, store: MetricStore | None = None
    ) -> None:
        self.config = config
        self.identity = identity
        # What `ctl enable NAME` makes probes with (the core never imports a family itself).
        self.families = families
        self.pid = os.getpid()
        # Read on every hook call; cleared on detach and in forked children.
        self.enabled = True
        # `store`: the running totals of this process's agent before a detach(), which this one continues.
        self.store = store if store is not None else MetricStore()
        # At 0 from the first batch on, so that rate() sees the first drops (the sender thread that
        # owns the store does not exist yet).
        self.store.start_at_zero("agent_events_dropped_total", tuple((reason,) for reason in DROP_REASONS))
        self.probes: dict[str, Probe] = {}
        self._buffer: deque[Record] = deque()
        # The agent's own bookkeeping (probe enabled, probe errors): sent, but
        # not a sign that this process trains, so it does not make it connect.
        self._quiet: deque[Record] = deque()
        self._capacity = config.buffer_capacity
        self._buffer_drops = 0
        self._reported_drops: dict[str, int] = {}
        self._events: deque[LogEvent] = deque()
        # Events an operator asked for in bulk (`ctl autograd-log`: one per autograd node, thousands a pass);
        # they wait behind the job's own events and leave as flushes have room.
        self._requested: deque[LogEvent] = deque()
        self._event_drops = 0
        self._oversized_drops = 0
        self._sender: Sender | None = None
        # After shutdown: no thread of ours touches the store any more (it may be handed to a next agent).
        self.stopped = False
        # Set once a probe recorded something. Processes that import torch but
        # never train (torchrun's launcher, spawned workers) never connect.
        self.active = False
        self.control = Control(self)
        self.stall = StallWatch(self, self.control.boundary)
        self._lock = threading.Lock()

    # -- hot path -----------------------------------------------------------
    def record(self, handler: Callable[[*Payload], None], *payload: *Payload) -> None:
        """Queue `handler(*payload)` for the sender thread; drop (counted) when full."""
        if len(self._buffer) < self._capacity:
            self._buffer.append((handler, payload))  # type: ignore[arg-type]  # see _Handler
        else:
            self._buffer_drops += 1

    def record_quiet(self, handler: Callable[[*Payload], None], *payload: *Payload) -> None:
        """Like `record`, for bookkeeping that alone must not make the process connect."""
        if len(self._quiet) < self._capacity:
            self._quiet.append((handler, payload))  # type: ignore[arg-type]  # see _Handler
        else:
            self._buffer_drops += 1

    def reports(self) -> bool:
        """Whether this process connects to the daemon: a probe recorded something, drained or not yet."""
        return self.active or bool(self._buffer) or bool(self._events) or bool(self._requested)

    # -- sender-thread side -------------------------------------------------
    def emit(self, level: str, event: str, **fields: FieldValue) -> None:
        """Queue a structured event for the daemon's log (any thread)."""
        if len(self._events) < self.config.max_pending_events:
            self._events.append(LogEvent(time.time(), level, event, _cut(fields)))
        else:
            self._event_drops += 1

    def emit_requested(self, level: str, event: str, **fields: FieldValue) -> None:
        """`emit` for events an operator asked for in bulk: held past one flush's worth (up to
        MAX_REQUESTED_EVENTS), sent as flushes have room after the job's own events."""
        if len(self._requested) < MAX_REQUESTED_EVENTS:
            self._requested.append(LogEvent(time.time(), level, event, _cut(fields)))
        else:
            self._event_drops += 1

    def drain(self) -> None:
        """Fold every queued record into the store (sender thread only)."""
        self.active = self.reports()
        self._drain(self._quiet)
        self._drain(self._buffer)
        self._sync_drop_counters()
        if self.active:
            self.stall.check()

    def _drain(self, buffer: deque[Record]) -> None:
        while True:
            try:
                handler, payload = buffer.popleft()
            except IndexError:
                break
            try:
                handler(*payload)
            except Exception as exc:
                owner = getattr(handler, "__self__", None)
                fail = getattr(owner, "fail", None)
                if callable(fail):
                    fail(exc)
                else:
                    log.warning("dropped a record that failed to aggregate", error=repr(exc))

    def _sync_drop_counters(self) -> None:
        for reason, total in zip(
            DROP_REASONS, (self._buffer_drops, self._event_drops, self._oversized_drops), strict=True
        ):
            if total != self._reported_drops.get(reason, 0):
                self.store.inc("agent_events_dropped_total", (reason,), total - self._reported_drops.get(reason, 0))
                self._reported_drops[reason] = total

    def take_events(self, limit: int) -> list[LogEvent]:
        events: list[LogEvent] = []
        while self._events and len(events) < limit:
            events.append(self._events.popleft())
        while self._requested and len(events) < limit:
            events.append(self._requested.popleft())
        return events

    def return_events(self, events: list[LogEvent]) -> None:
        """Put back events of a batch that was not delivered (oldest dropped first)."""
        room = self.config.max_pending_events - len(self._events)
        keep = events[-room:] if room > 0 else []
        self._event_drops += len(events) - len(keep)
        self._events.extendleft(reversed(keep))

    def count_oversized(self) -> None:
        """An item larger than a whole frame was not sent (sender thread only)."""
        self._oversized_drops += 1

    @property
    def step(self) -> int:
        """Completed steps of the job's main optimizer: the step number commands use."""
        return self.control.step

    @property
    def dropped_total(self) -> int:
        return self._buffer_drops + self._event_drops + self._oversized_drops

    @property
    def buffer_fill(self) -> int:
        return len(self._buffer)

    # -- lifecycle ----------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            if self._sender is None:
                self._sender = Sender(self)
                self._sender.start()

    def wake_sender(self) -> None:
        sender = self._sender
        if sender is not None:
            sender.wake()

    def flush(self, timeout: float = 2.0) -> bool:
        """Ask the sender to send everything now; True when it was delivered."""
        sender = self._sender
        return bool(sender.flush(timeout)) if sender is not None else False

    def shutdown(self, timeout: float = 2.0, goodbye: bool = True) -> None:
        """Stop the probes and send a last batch (bounded by `timeout`), with a goodbye unless told not to."""
        with self._lock:
            sender, self._sender = self._sender, None
        for probe in list(self.probes.values()):
            probe.uninstall()
            probe.discard()
        self.probes.clear()
        self.control.uninstall(timeout)
        if sender is not None and os.getpid() == self.pid:
            sender.stop(timeout, goodbye)
            self.stopped = not sender.is_alive()
        self.enabled = False

    def forget_after_fork(self) -> None:
        """In a forked child: no agent unless the child asks for one."""
        self.enabled = False
        self._buffer.clear()
        self._quiet.clear()
        self._events.clear()
        self._requested.clear()
        sender, self._sender = self._sender, None
        if sender is not None:
            sender.forget_after_fork()
