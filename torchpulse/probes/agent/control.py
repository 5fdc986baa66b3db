"""Commands from the daemon, applied at safe points of the training thread.

The sender thread receives a `Command`, checks its arguments, and either
answers at once (`status` reads plain fields, `stacks` the training thread's
stack; bad arguments are refused) or
queues it. The training thread runs queued commands at its next step boundary
(`step_boundary`: after the job's main optimizer stepped), never in the middle
of a step; a trace (`traces`) starts and stops at those boundaries too.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from torchpulse.limits import MAX_PENDING_COMMANDS
from torchpulse.probes.agent import trace_capture
from torchpulse.probes.agent.commands import CommandFailed, check_arguments
from torchpulse.probes.agent.config import unknown_probe_error
from torchpulse.probes.agent.logs import get_logger
from torchpulse.probes.agent.step_boundary import StepBoundary
from torchpulse.probes.agent.traces import Data, TraceRunner
from torchpulse.protocol import Command, CommandResult

if TYPE_CHECKING:
    from torchpulse.probes.agent.agent import Agent
    from torchpulse.probes.agent.probe import Probe

log = get_logger("torchpulse.control")
__all__ = ["CommandFailed", "Control"]


class Control:
    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.boundary = StepBoundary(lambda: agent.enabled, lambda: self.armed, self.safe_point)
        self.traces = TraceRunner(self._answer, lambda: (agent.identity.run, agent.identity.rank))
        # Commands waiting for a safe point, each with its trace directory opened on arrival (None: no trace).
        self._pending: deque[tuple[Command, int | None]] = deque()
        self.results: deque[CommandResult] = deque()
        self._lock = threading.Lock()
        # Read on the hot path: True while anything waits for a safe point.
        self.armed = False
        self._safe_handlers: dict[str, Callable[[Command], Data]] = {
            "enable": self._enable,
            "disable": self._disable,
            "sample": self._sample,
            "autograd-log": self._autograd_log,
            "cudagraph-dump": self._cudagraph_dump,
        }

    @property
    def step(self) -> int:
        return self.boundary.step

    def install(self) -> None:
        self.boundary.install()

    def uninstall(self, timeout: float = 2.0) -> None:
        """Remove our hooks; end a trace and answer every command still waiting, since no step
        boundary will come for them."""
        self.boundary.uninstall()
        with self._lock:
            pending, self._pending = list(self._pending), deque()
            self.armed = False
        self.traces.abandon()
        for command, out_dir in pending:
            trace_capture.close_dir(out_dir)
            self._answer(command, False, "the agent detached before its next step boundary", {})
        self.traces.wait_written(timeout)

    # -- sender thread --------------------------------------------------------
    def receive(self, command: Command) -> None:
        """Answer or queue one command; never raises (this is the sender thread's loop)."""
        try:
            if command.name == "status":
                self._answer(command, True, "ok", self.status())
            elif command.name == "stacks":  # at once: a stuck rank never reaches its next step boundary
                self._answer(command, True, "ok", self.stacks())
            elif command.name == "trace" or command.name in self._safe_handlers:
                out_dir = check_arguments(command, self.agent.families.known)
                with self._lock:
                    busy = len(self._pending) >= MAX_PENDING_COMMANDS
                    if not busy:
                        self._pending.append((command, out_dir))
                        self.armed = True
                if busy:
                    trace_capture.close_dir(out_dir)
                    raise CommandFailed(
                        f"busy: {MAX_PENDING_COMMANDS} commands already wait for this rank's next step boundary"
                    )
            else:
                raise CommandFailed(f"unknown command {command.name[:64]!r}")
        except CommandFailed as exc:
            self._answer(command, False, str(exc), {})
        except Exception as exc:  # a bug here must not cost the connection, nor leave the caller waiting
            log.warning("command failed", command=command.name[:64], error=repr(exc))
            self._answer(command, False, f"internal error: {exc!r}"[:500], {})

    def status(self) -> Data:
        agent = self.agent
        probes = list(agent.probes.items())  # one C-level copy: the training thread may add a probe meanwhile
        data: Data = {
            "step": self.step,
            "probes": ",".join(sorted(n for n, p in probes if p.enabled)),
            "buffer_fill": agent.buffer_fill,
            "buffer_capacity": agent.config.buffer_capacity,
            "events_dropped": agent.dropped_total,
            "pid": agent.identity.pid,
            "step_rate": self.boundary.step_rate(),
            "tracing": self.traces.busy(),
        }
        autograd = agent.probes.get("autograd")
        if autograd is not None and autograd.enabled:
            data.update(_autograd_status(autograd.status()))
        return data

    def stacks(self) -> Data:
        stall = self.agent.stall
        since = stall.seconds_since_step()
        return {
            "step": self.step,
            "seconds_since_step": None if since is None else round(since, 3),
            "stall_threshold_seconds": round(stall.threshold(), 3),
            "thread": stall.training_thread_name(),
            "stack": stall.training_stack(),
        }

    # -- training thread ------------------------------------------------------
    def safe_point(self) -> None:
        """Run queued commands and advance a trace; called between steps."""
        while True:
            with self._lock:
                entry = self._pending.popleft() if self._pending else None
            if entry is None:
                break
            command, out_dir = entry
            try:
                if command.name == "trace":
                    self.traces.start(command, out_dir, self.step)
                else:
                    self._answer(command, True, "ok", self._safe_handlers[command.name](command))
            except CommandFailed as exc:
                self._answer(command, False, str(exc), {})
            except Exception as exc:  # a bug in a command must not reach the job
                log.warning("command failed", command=command.name, error=repr(exc))
                self._answer(command, False, f"internal error: {exc!r}", {})
        self.traces.advance(self.step)
        with self._lock:
            self.armed = bool(self._pending) or self.traces.active

    def _answer(self, command: Command, ok: bool, message: str, data: Data) -> None:
        self.results.append(CommandResult(command.id, ok, message, data))
        self.agent.wake_sender()

    # -- handlers ---------------------------------------------------------------
    def _probe_name(self, command: Command) -> str:
        name = command.args.get("probe")
        if not isinstance(name, str) or not name:
            raise CommandFailed("missing argument: probe")
        return name

    def _enable(self, command: Command) -> Data:
        name = self._probe_name(command)
        probe = self.agent.probes.get(name)
        if probe is not None and probe.enabled:
            return {"probe": name, "changed": False}
        if probe is None:
            families = self.agent.families
            if (error := unknown_probe_error(name, families.known)) is not None:
                raise CommandFailed(error)
            probe = families.make(name, self.agent)
            if probe is None:
                raise CommandFailed(f"probe {name!r} is not available on this torch")
            self.agent.probes[name] = probe
        probe.install()
        return {"probe": name, "changed": True}

    def _disable(self, command: Command) -> Data:
        name = self._probe_name(command)
        probe = self.agent.probes.get(name)
        if probe is None or not probe.enabled:
            return {"probe": name, "changed": False}
        probe.uninstall()
        return {"probe": name, "changed": True}

    def _enabled_probe(self, name: str, command: str) -> Probe:
        probe = self.agent.probes.get(name)
        if probe is None or not probe.enabled:
            raise CommandFailed(f"probe {name!r} is not enabled (enable it first)")
        if command not in probe.commands:
            raise CommandFailed(f"probe {name!r} does not support {command}")
        return probe

    def _sample(self, command: Command) -> Data:
        rate = command.args["rate"]
        if not isinstance(rate, int | float):  # checked on arrival; this keeps mypy and `python -O` honest
            raise CommandFailed("rate must be a number")
        every = 0 if rate == 0 else max(1, round(1 / rate))  # 0: sampling off
        self._enabled_probe(self._probe_name(command), "sample").set_sample_every(every)
        return {"sample_every": every}

    def _autograd_log(self, command: Command) -> Data:
        passes = command.args["passes"]
        if not isinstance(passes, int):  # checked on arrival
            raise CommandFailed("passes must be an integer")
        self._enabled_probe("autograd", "autograd-log").log_next_passes(passes)
        return {"passes": passes}

    def _cudagraph_dump(self, command: Command) -> Data:
        probe = self.agent.probes.get("cudagraphs")
        if probe is None or not probe.enabled or "cudagraph-dump" not in probe.commands:
            raise CommandFailed("the cudagraphs probe is not enabled")
        return probe.dump_state()


def _autograd_status(state: dict[str, object]) -> Data:
    data: Data = {}
    for key, field in (("sample_every", "autograd_sample_every"), ("passes", "autograd_passes")):
        value = state.get(key)
        if isinstance(value, int | float | str | bool) or value is None:
            data[field] = value
    last = state.get("last_sampled_pass")
    if isinstance(last, dict):
        # The slowest nodes of the last timed pass, e.g. "AddmmBackward0#42 1.20ms": the sequence
        # number tells two nodes of one type apart (AccumulateGrad has none: -1, left out).
        data["autograd_slowest"] = ", ".join(
            f"{name}{'' if seq < 0 else f'#{seq}'} {seconds * 1e3:.2f}ms"
            for name, seq, seconds in last.get("slowest", [])[:5]
        )
    return data
