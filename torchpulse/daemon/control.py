"""`torchpulse ctl`: route a command to ranks of a run and gather their answers.

Who may send: root, the daemon's own user and members of `control_group`
(checked with SO_PEERCRED and SO_PEERGROUPS, /proc where the kernel has no
SO_PEERGROUPS), to any run; anyone else only to a run of their own, one whose
every rank (connected or remembered) was reported by processes of their uid,
so that users of a shared node can trace their own jobs. Another user's run
and a run that does not exist get the same refusal: it does not tell whether
someone else runs a job of that name. Every command is logged with who sent
it. A trace command carries the sender's uid to the agent, which lets another
user than the job's (not root) trace only into a directory that user owns or a
shared sticky one (`trace_capture`). A rank that does not answer within the
timeout is reported as such; the others are not held back by it.
"""

from __future__ import annotations

import asyncio
import grp
import itertools
import math
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import structlog

from torchpulse.daemon.connections import ConnectionTable
from torchpulse.daemon.logs import bounded_fields, cut
from torchpulse.daemon.peercred import Peer
from torchpulse.daemon.registry import Registry
from torchpulse.daemon.runs import RankState, RunState
from torchpulse.limits import MAX_COMMAND_TIMEOUT, MAX_LOGGED_RANKS, MAX_NAME_CHARS
from torchpulse.protocol import (
    CALLER_UID_ARG,
    Command,
    CommandResult,
    CtlReply,
    CtlRequest,
    FieldValue,
    RankResult,
    encode,
)

log = structlog.get_logger("torchpulse.daemon.control")
# How far ahead of the fastest rank a synchronised trace starts, in seconds of
# its step rate: long enough for the command to reach every rank first.
TRACE_LEAD_SECONDS = 2.0
MIN_TRACE_LEAD_STEPS = 3
# How long the daemon waits for an agent's `status` (answered by its agent thread, not at a step boundary)
# when it needs the rank's own step counter: to plan a trace, and to explain a timeout.
STEP_QUERY_SECONDS = 1.0
MAX_REPORTED_RATE = 1e6
# Command ids start at a random point of this range, different for each daemon process: an agent answers a
# command of the daemon before a restart on its connection to the next daemon (a trace it was capturing, a
# trace superseded), and with ids counted from 1 again that answer would be taken for a new command's.
COMMAND_ID_RANGE: Final = 2**62
# Agents that lost the daemon retry at most every backoff_max (5 s by default, +-20 %): until a daemon has run
# this long, a rank it has not heard from may be on its way back. A command waits for it that long at most.
RECONNECT_WINDOW_SECONDS = 7.0
RECONNECT_POLL_SECONDS = 0.05


class NotAuthorized(Exception):
    pass


class Disconnected(Exception):
    """The rank's connection closed while a command waited for its answer."""


def peer_groups(peer: Peer) -> set[int]:
    """Primary and supplementary groups of the peer: from SO_PEERGROUPS, else /proc."""
    groups = {peer.gid, *peer.groups}
    if peer.groups:
        return groups
    try:
        status = Path(f"/proc/{peer.pid}/status").read_text()
    except OSError:
        return groups
    for line in status.splitlines():
        if line.startswith("Groups:"):
            groups.update(int(g) for g in line.split()[1:])
    return groups


def owns_run(run: RunState | None, uid: int) -> bool:
    """Whether every rank of `run`, connected or remembered, was reported by processes of `uid`."""
    return run is not None and run.reporting_uids == {uid}


def authorize(peer: Peer | None, control_group: str, run: RunState | None) -> Peer:
    """The caller, when it may send commands to `run` (None: no such run); NotAuthorized otherwise."""
    if peer is None:
        raise NotAuthorized("cannot identify the caller (no SO_PEERCRED)")
    # Ownership first: it needs no group lookup, which may ask a directory service.
    if owns_run(run, peer.uid) or peer.uid in (0, os.geteuid()):
        return peer
    if control_group:
        try:
            gid = grp.getgrnam(control_group).gr_gid
        except KeyError:
            gid = None
        if gid is not None and gid in peer_groups(peer):
            return peer
    group = f", members of group {control_group!r}" if control_group else ""
    # The same words whether the run is another user's or does not exist.
    raise NotAuthorized(
        f"uid {peer.uid} may not send commands to this run (allowed: root, the daemon's user{group} "
        "or the user whose job reports the run)"
    )


MAX_STEP: Final = 2**53


def current_step(state: RankState) -> int:
    """Completed steps of the rank's first optimizer, as last reported."""
    for (name, labels), value in state.values.items():
        if name == "optimizer_steps_total" and labels and labels[0].endswith("#0"):
            # A buggy agent's inf, NaN or 1e300 must not break planning (or msgpack's int range).
            return int(value) if math.isfinite(value) and 0 <= value <= MAX_STEP else 0
    return 0


def _rate(state: RankState) -> float:
    """Smoothed steps/s, or the average since the rank connected while too few batches came in."""
    if state.step_rate > 0:
        return state.step_rate
    elapsed = time.monotonic() - state.connected_at
    return current_step(state) / elapsed if elapsed > 0 else 0.0


def logged_ranks(ranks: list[int] | None) -> list[int] | str | None:
    """The addressed ranks for the log: all of them when few, else the first ones and how many."""
    if ranks is None or len(ranks) <= MAX_LOGGED_RANKS:
        return ranks
    return f"{ranks[:MAX_LOGGED_RANKS]} and {len(ranks) - MAX_LOGGED_RANKS} more"


class ControlHub:
    def __init__(self, registry: Registry, links: ConnectionTable, control_group: Callable[[], str]) -> None:
        self.registry = registry
        self._links = links  # the agent server's: which connection speaks for each rank
        self.control_group = control_group
        self._ids = itertools.count(secrets.randbelow(COMMAND_ID_RANGE) + 1)
        # Command id -> (the rank it went to, that rank's connection, the answer to come).
        self._waiting: dict[int, tuple[RankState, int, asyncio.Future[CommandResult]]] = {}

    def resolve(self, result: CommandResult, state: RankState, connection: int) -> None:
        """An answer counts only from the connection the command was sent on (ids are guessable)."""
        waiting = self._waiting.get(result.id)
        if waiting is None or waiting[0] is not state or waiting[1] != connection:
            return
        del self._waiting[result.id]
        if not waiting[2].done():
            waiting[2].set_result(result)

    def disconnected(self, connection: int) -> None:
        """Commands sent on a connection that closed get no answer: say so now, not at the timeout."""
        for _state, sent_on, future in list(self._waiting.values()):
            if sent_on == connection and not future.done():
                future.set_exception(Disconnected())

    async def handle(self, request: CtlRequest, peer: Peer | None, reached: list[int] | None = None) -> CtlReply:
        """Route `request` and gather the answers; the ranks it was sent to are added to `reached`, so that a
        caller that gives up waiting can tell which ranks may still apply it."""
        who = {"uid": peer.uid if peer else None, "pid": peer.pid if peer else None}
        # A client's inf would wait for ever and its NaN would poison the loop's timer heap.
        timeout = min(request.timeout, MAX_COMMAND_TIMEOUT) if request.timeout > 0 else MAX_COMMAND_TIMEOUT
        # What waiting for reconnecting ranks took is taken from the command's time: the client waits
        # `timeout` and a few seconds more, not longer.
        wait = timeout - await self._await_reconnects(request, timeout / 2)
        run = self.registry.runs.get(request.run)
        caller = authorize(peer, self.control_group(), run)
        # What a client sends is cut for the log: it may be anything up to a 4 MiB frame.
        command, run_name = cut(request.name, MAX_NAME_CHARS), cut(request.run, MAX_NAME_CHARS)
        log.info(
            "command received",
            command=command,
            run=run_name,
            ranks=logged_ranks(request.ranks),
            args=bounded_fields(request.args),
            **who,
        )
        if run is None:
            return CtlReply(request.run, request.name, [])
        # Once per rank: the same rank twice would get a trace command twice, and refuse the second.
        wanted = sorted(run.ranks) if request.ranks is None else sorted(set(request.ranks))
        args = dict(request.args)
        if request.name == "trace":
            # Set here, whatever the client sent: the agent decides with it where the sender may have it write.
            args[CALLER_UID_ARG] = caller.uid
            if "start_step" not in args:
                args["start_step"] = await self._trace_start([run.ranks[r] for r in wanted if r in run.ranks])
                # While it was planned, the run may have ended and another user's job taken its ranks.
                authorize(caller, self.control_group(), run)
        # Sent to every rank before the first await: a client gone while the answers are awaited (Ctrl-C) has
        # had its command delivered to each rank it named, as its "command received" line tells.
        sent = [self._send(run.ranks.get(rank), rank, request.name, args) for rank in wanted]
        if reached is not None:
            reached.extend(rank for rank, one in zip(wanted, sent, strict=True) if isinstance(one, _Sent))
        try:
            results = await asyncio.gather(*(self._answer(one, wait, asked=timeout) for one in sent))
        finally:
            # Cancelled before a wait began, its `finally` never runs: answers no one waits for must not pile up.
            for one in sent:
                if isinstance(one, _Sent):
                    self._waiting.pop(one.command_id, None)
        for result in results:
            log.info(
                "command result",
                command=command,
                run=run_name,
                rank=result.rank,
                status=result.status,
                message=cut(result.message),
                **who,
            )
        return CtlReply(request.run, request.name, list(results))

    async def _await_reconnects(self, request: CtlRequest, most: float) -> float:
        """Just after the daemon started, wait (at most `most` seconds) for addressed ranks still to reconnect;
        the seconds waited.

        The registry starts empty: without this, a command sent right after a restart reached only the ranks
        back already, and its reply left the others out without a word (`ctl trace` of half a job, exit 0), or
        named an addressed rank "no such rank", or the run "no such run". Ranks addressed by number are waited
        for until they are connected; all ranks of a run until as many as its world size are (on a node that
        runs only some ranks of a larger job, until the window is over).
        """
        started = time.monotonic()
        deadline = min(self.registry.started + RECONNECT_WINDOW_SECONDS, started + most)
        if started >= deadline:
            return 0.0  # the usual case: a daemon up for a while has heard from every running rank
        wanted = None if request.ranks is None else set(request.ranks)
        if wanted is not None and len(wanted) > self.registry.max_ranks_per_run:
            return 0.0  # more ranks than a run holds here: never all connected (and each poll would walk them)
        while time.monotonic() < deadline and self._reconnecting(request.run, wanted):
            await asyncio.sleep(RECONNECT_POLL_SECONDS)
        return time.monotonic() - started

    def _reconnecting(self, name: str, wanted: set[int] | None) -> bool:
        """Whether addressed ranks of run `name` may still be missing: not connected, or never seen."""
        run = self.registry.runs.get(name)
        if run is None:
            return True
        connected = {rank for rank, state in run.ranks.items() if state.connected}
        if wanted is not None:
            return not wanted <= connected
        return len(connected) < max((state.hello.world_size for state in run.ranks.values()), default=1)

    async def _trace_start(self, states: list[RankState]) -> int:
        """The same first step for every rank: past the fastest one by a couple of seconds of steps."""
        ranks = [s for s in states if s.connected]
        if not ranks:
            return 1
        # The agents' own step counters: the optimizer metric is missing while that probe is off and
        # frozen after `ctl disable optimizer`, which put the start in the past (every trace then failed).
        reported = await asyncio.gather(*(self._agent_step(s) for s in ranks))
        step = max(max(current_step(s), r[0] if r else 0) for s, r in zip(ranks, reported, strict=True))
        rate = max(max(_rate(s), r[1] if r else 0.0) for s, r in zip(ranks, reported, strict=True))
        lead = max(MIN_TRACE_LEAD_STEPS, math.ceil(rate * TRACE_LEAD_SECONDS))
        # A lying agent's step rate must not push the step past what msgpack carries.
        return min(step + lead, MAX_STEP)

    async def _agent_step(self, state: RankState) -> tuple[int, float] | None:
        """The rank's step counter and recent steps/s from its agent, or None without a usable answer."""
        result = await self._answer(self._send(state, 0, "status", {}), STEP_QUERY_SECONDS, explain=False)
        step, rate = result.data.get("step"), result.data.get("step_rate", 0.0)
        if result.status != "ok" or not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
            return None
        if not isinstance(rate, int | float) or not math.isfinite(rate) or not 0 <= rate <= MAX_REPORTED_RATE:
            rate = 0.0
        return step, float(rate)

    async def _timeout_message(self, state: RankState, name: str, args: dict[str, FieldValue], timeout: float) -> str:
        """Why a rank did not answer, asked of its agent thread: stuck, or waiting for a step boundary."""
        head = f"no answer within {timeout:g}s"
        reported = await self._agent_step(state)
        if reported is None:
            return f"{head} (its agent does not answer either: the process is stopped or hung)"
        step = reported[0]
        if step == 0:
            return (
                f"{head}: the rank has finished no optimizer step yet, and commands apply right after "
                "optimizer.step() (a loop without a torch.optim optimizer never gets there)"
            )
        if name == "trace":
            first, steps = args.get("start_step"), args.get("steps")
            span = (
                f"steps {first}..{first + steps - 1}"
                if isinstance(first, int) and isinstance(steps, int)
                else "the traced steps"
            )
            return (
                f"{head} (the rank is at step {step}; the trace of {span} still completes into its "
                "directory, unless the rank is stuck)"
            )
        # The agent keeps the command: it applies at that boundary all the same, the answer is only late.
        return (
            f"{head} (the rank is at step {step} and has not reached its next step boundary, or is stuck; "
            "the command stays queued and applies there if the rank gets there)"
        )

    def _send(self, state: RankState | None, rank: int, name: str, args: dict[str, FieldValue]) -> _Sent | RankResult:
        """Write one command to the rank's connection, or the result that says why it could not be."""
        if state is None:
            return RankResult(rank, "not_connected", "no such rank in this run", {})
        link = self._links.link(state)
        if not state.connected or link is None:
            return RankResult(rank, "not_connected", "rank is not connected", {})
        command_id = next(self._ids)
        future: asyncio.Future[CommandResult] = asyncio.get_running_loop().create_future()
        try:
            link.send(encode(Command(command_id, name, args)))
        except (ConnectionError, RuntimeError) as exc:
            return RankResult(rank, "failed", f"could not send: {exc}", {})
        self._waiting[command_id] = (state, link.id, future)
        return _Sent(state, rank, name, args, command_id, future)

    async def _answer(
        self, sent: _Sent | RankResult, timeout: float, explain: bool = True, asked: float | None = None
    ) -> RankResult:
        """Wait `timeout` seconds for the answer to a command sent; `asked` is the timeout the client asked
        for, which a timeout's message names (the wait may be shorter: part of it went to reconnecting ranks)."""
        if isinstance(sent, RankResult):
            return sent
        try:
            result = await asyncio.wait_for(sent.future, timeout)
        except TimeoutError:
            timed_out = True
        except Disconnected:
            return RankResult(
                sent.rank,
                "not_connected",
                "the rank disconnected before answering (it exited, detached or reconnected)",
                {},
            )
        else:
            timed_out = False
        finally:
            self._waiting.pop(sent.command_id, None)
        if timed_out:
            # Explaining asks the agent for its step: a question that must not be explained in turn.
            message = (
                await self._timeout_message(sent.state, sent.name, sent.args, asked or timeout)
                if explain
                else "no answer"
            )
            return RankResult(sent.rank, "timeout", message, {})
        return RankResult(sent.rank, "ok" if result.ok else "failed", result.message, result.data)


@dataclass(frozen=True)
class _Sent:
    """A command written to a rank's connection, its answer awaited."""

    state: RankState
    rank: int
    name: str
    args: dict[str, FieldValue]
    command_id: int
    future: asyncio.Future[CommandResult]
