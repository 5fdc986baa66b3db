"""Commands from the daemon, applied at safe points of the training thread.

The sender thread receives a `Command`, checks its arguments, and either
answers at once (`status` reads plain fields; bad arguments are refused) or
queues it. The training thread runs queued commands at its next step boundary
(after the job's main optimizer stepped), never in the middle of a step. A
trace spans whole optimizer steps: it starts right after step S-1 finished
and stops right after step S+N-1 finished, so it covers steps S..S+N-1
exactly; its file is written by a thread of its own (`trace_capture`).
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchpulse.probes import trace_capture
from torchpulse.probes.control_args import CommandFailed, check_arguments
from torchpulse.probes.logs import get_logger
from torchpulse.probes.trace_capture import Trace
from torchpulse.protocol import Command, CommandResult, FieldValue

if TYPE_CHECKING:
    from torchpulse.probes.agent import Agent

log = get_logger("torchpulse.control")
Data = dict[str, FieldValue]
__all__ = ["CommandFailed", "Control"]
# Commands waiting for the next step boundary; a peer flooding more gets "busy", not the job's memory.
MAX_PENDING_COMMANDS = 32
# Steps whose times give the recent step rate that `status` reports (the daemon plans a trace's start with it).
STEP_RATE_WINDOW = 16
# What a trace that missed its start step tells the user (without one, the daemon picks a step ahead).
_RETRY_LATER = "retry with a later --start-step, or without one"


class Control:
    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self._first: weakref.ref[Any] | None = None
        self._stepped_since_first: set[int] = set()  # ids of other optimizers since the main one stepped
        self._handle: Any = None
        self._hook: Callable[..., None] | None = None
        self._pre_handle: Any = None
        # Commands waiting for a safe point, each with its trace directory opened on arrival (None: no trace).
        self._pending: deque[tuple[Command, int | None]] = deque()
        self.results: deque[CommandResult] = deque()
        self._step_times: deque[float] = deque(maxlen=STEP_RATE_WINDOW)
        # A trace waiting for its first step or capturing, then the thread writing its file.
        self._trace: Trace | None = None
        self._writer: threading.Thread | None = None
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

    # -- the step boundary ----------------------------------------------------
    # Commands (un)install probes, which adds to and removes from torch's table
    # of global post-hooks while torch iterates it. That is harmless only from
    # the table's last hook (the iteration is then over), so our hook is kept
    # last: before each step of the main optimizer (from a pre-hook on that
    # optimizer, when no global table is being iterated) and after commands ran.
    # The main optimizer is the first one to step, outermost when one wraps
    # another, replaced when it stops stepping while another one goes on.
    def install(self) -> None:
        """Count steps and apply commands from hooks of our own, independent of any probe,
        so that `ctl disable optimizer` can be undone by `ctl enable optimizer`."""
        from torch.optim.optimizer import register_optimizer_step_post_hook

        from torchpulse.probes.torch_compat.dynamo import disable_tracing

        if self._handle is None:
            self._hook = disable_tracing(self._after_step)
            self._handle = register_optimizer_step_post_hook(self._hook)

    def uninstall(self, timeout: float = 2.0) -> None:
        """Remove our hooks; end a trace (a profiler left running would grow for ever) and answer
        every command still waiting, since no step boundary will come for them."""
        handles, self._handle, self._pre_handle = (self._handle, self._pre_handle), None, None
        self._first = None
        for handle in handles:
            if handle is not None:
                handle.remove()
        with self._lock:
            trace, self._trace = self._trace, None
            pending, self._pending = list(self._pending), deque()
            self.armed = False
        if trace is not None:
            trace.close()
            if trace.profiler is not None:
                trace_capture.stop_quietly(trace.profiler)
            self._answer(
                trace.command,
                False,
                f"the agent detached before the trace of steps {trace.start_step}.."
                f"{trace.last_step} was complete; nothing was written",
                {},
            )
        for command, out_dir in pending:
            trace_capture.close_dir(out_dir)
            self._answer(command, False, "the agent detached before its next step boundary", {})
        writer = self._writer
        if writer is not None:
            writer.join(timeout)  # a trace already captured is worth a short wait at exit

    def _after_step(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if not self.agent.enabled:
            return
        try:
            if _nested_step():
                return  # the inner optimizer of a wrapper, or super().step(): not a step boundary
            first = self._first() if self._first is not None else None
            if first is not optimizer:
                if first is not None and id(optimizer) not in self._stepped_since_first:
                    self._stepped_since_first.add(id(optimizer))
                    return
                # No main optimizer yet, it is gone, or this one stepped twice while it did not (an LR finder's).
                self._adopt(optimizer)
            self._stepped_since_first.clear()
            self.agent.step += 1
            self._step_times.append(time.monotonic())
            if self.armed and self._last_hook():
                self.safe_point()
                self._move_last()
        except Exception as exc:  # never into the job
            log.warning("step boundary hook failed", error=repr(exc))

    def _adopt(self, optimizer: Any) -> None:
        from torchpulse.probes.torch_compat.dynamo import disable_tracing

        if self._pre_handle is not None:
            self._pre_handle.remove()  # the old optimizer's own table: not being iterated
        self._pre_handle = optimizer.register_step_pre_hook(disable_tracing(self._before_main_step))
        self._first = weakref.ref(optimizer)

    def _before_main_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        try:
            if self.armed:
                self._move_last()
        except Exception as exc:  # never into the job
            log.warning("step boundary hook failed", error=repr(exc))

    def _last_hook(self) -> bool:
        """Whether our hook is the last of the global table (unknown tables count as last)."""
        from torchpulse.probes.torch_compat.optim import global_optimizer_post_hooks

        table = global_optimizer_post_hooks()
        return table is None or self._handle is None or next(reversed(table), None) == self._handle.id

    def _move_last(self) -> None:
        """Re-register our hook at the end of the table; only when the table is not being iterated."""
        from torch.optim.optimizer import register_optimizer_step_post_hook

        if self._handle is not None and self._hook is not None and not self._last_hook():
            self._handle.remove()
            self._handle = register_optimizer_step_post_hook(self._hook)

    # -- sender thread --------------------------------------------------------
    def receive(self, command: Command) -> None:
        """Answer or queue one command; never raises (this is the sender thread's loop)."""
        try:
            if command.name == "status":
                self._answer(command, True, "ok", self.status())
            elif command.name == "trace" or command.name in self._safe_handlers:
                out_dir = check_arguments(command)
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
        autograd = agent.probes.get("autograd")
        data: Data = {
            "step": agent.step,
            "probes": ",".join(sorted(n for n, p in probes if p.enabled)),
            "buffer_fill": agent.buffer_fill,
            "buffer_capacity": agent.config.buffer_capacity,
            "events_dropped": agent.dropped_total,
            "pid": agent.identity.pid,
            "step_rate": self._step_rate(),
            "tracing": self._trace is not None or self._writing(),
        }
        status = getattr(autograd, "status", None)
        if autograd is not None and autograd.enabled and callable(status):
            state = status()
            data["autograd_sample_every"] = state.get("sample_every")
            data["autograd_passes"] = state.get("passes")
            last = state.get("last_sampled_pass")
            if isinstance(last, dict):
                # The slowest nodes of the last timed pass, e.g. "AddmmBackward0#42 1.20ms": the sequence
                # number tells two nodes of one type apart (AccumulateGrad has none: -1, left out).
                data["autograd_slowest"] = ", ".join(
                    f"{name}{'' if seq < 0 else f'#{seq}'} {seconds * 1e3:.2f}ms"
                    for name, seq, seconds in last.get("slowest", [])[:5]
                )
        return data

    def _step_rate(self) -> float:
        """Steps per second over the last few steps and the wait since; 0.0 before two steps.

        A rank stuck in a collective keeps its last steps' times: the time since its last step,
        beyond one usual interval, counts too, so its rate falls instead of reading as before.
        """
        times = list(self._step_times)  # one C-level copy: the training thread appends meanwhile
        if len(times) < 2 or times[-1] <= times[0]:
            return 0.0
        span = times[-1] - times[0]
        overdue = time.monotonic() - times[-1] - span / (len(times) - 1)
        return round((len(times) - 1) / (span + max(0.0, overdue)), 3)

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
                    data = self._start_trace(command, out_dir)
                else:
                    data = self._safe_handlers[command.name](command)
            except CommandFailed as exc:
                self._answer(command, False, str(exc), {})
            except Exception as exc:  # a bug in a command must not reach the job
                log.warning("command failed", command=command.name, error=repr(exc))
                self._answer(command, False, f"internal error: {exc!r}", {})
            else:
                if command.name != "trace":
                    self._answer(command, True, "ok", data)
        self._advance_trace()
        with self._lock:
            self.armed = bool(self._pending) or self._trace is not None

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
        from torchpulse.probes.api import PROBES, _make_probe

        name = self._probe_name(command)
        probe = self.agent.probes.get(name)
        if probe is not None and probe.enabled:
            return {"probe": name, "changed": False}
        if probe is None:
            if name not in PROBES:
                raise CommandFailed(f"unknown probe {name!r} (known: {', '.join(sorted(PROBES))})")
            probe = _make_probe(name, self.agent)
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

    def _probe_method(self, command: Command, method: str) -> Callable[[int], None]:
        name = self._probe_name(command)
        probe = self.agent.probes.get(name)
        if probe is None or not probe.enabled:
            raise CommandFailed(f"probe {name!r} is not enabled (enable it first)")
        fn = getattr(probe, method, None)
        if not callable(fn):
            raise CommandFailed(f"probe {name!r} does not support {command.name}")
        return fn  # type: ignore[no-any-return]

    def _sample(self, command: Command) -> Data:
        rate = command.args["rate"]
        if not isinstance(rate, int | float):  # checked on arrival; this keeps mypy and `python -O` honest
            raise CommandFailed("rate must be a number")
        every = 0 if rate == 0 else max(1, round(1 / rate))  # 0: sampling off
        self._probe_method(command, "set_sample_every")(every)
        return {"sample_every": every}

    def _autograd_log(self, command: Command) -> Data:
        passes = command.args["passes"]
        if not isinstance(passes, int):  # checked on arrival
            raise CommandFailed("passes must be an integer")
        self._probe_method(Command(command.id, command.name, {"probe": "autograd"}), "log_next_passes")(passes)
        return {"passes": passes}

    def _cudagraph_dump(self, command: Command) -> Data:
        probe = self.agent.probes.get("cudagraphs")
        dump = getattr(probe, "dump_state", None)
        if probe is None or not callable(dump):
            raise CommandFailed("the cudagraphs probe is not enabled")
        result = dump()
        return dict(result) if isinstance(result, dict) else {"state": str(result)}

    def _start_trace(self, command: Command, out_dir: int | None) -> Data:
        """Accept a trace into `out_dir` (opened on arrival), which is the trace's from here on, or closed."""
        try:
            if out_dir is None:  # check_arguments opens it for every trace it lets through
                raise CommandFailed("out must be a directory path")
            start, steps, out = self._trace_request(command)
        except BaseException:
            trace_capture.close_dir(out_dir)
            raise
        current = self._trace
        if current is not None:
            # Still waiting for its first step (one far ahead, or a client that gave up): the newer request wins.
            current.close()
            self._answer(
                current.command, False, f"superseded by a newer trace request before step {current.start_step} came", {}
            )
        self._trace = Trace(command, start, steps, out, out_dir)
        return {}

    def _trace_request(self, command: Command) -> tuple[int, int, Path]:
        """The first step, step count and directory of a trace this rank can take now; CommandFailed otherwise."""
        args = command.args
        steps, start, out = args["steps"], args.get("start_step"), args["out"]
        if not isinstance(steps, int) or not isinstance(out, str):  # checked on arrival
            raise CommandFailed("steps must be an integer and out a path")
        current = self._trace
        if (current is not None and current.profiler is not None) or self._writing():
            raise CommandFailed("a trace is already being captured or written on this rank")
        if not isinstance(start, int):
            start = self.agent.step + 1
        if start <= self.agent.step:
            raise CommandFailed(
                f"missed the start step {start}: this rank already finished step {self.agent.step}; {_RETRY_LATER}"
            )
        return start, steps, Path(out)

    def _writing(self) -> bool:
        writer = self._writer
        return writer is not None and writer.is_alive()

    def _advance_trace(self) -> None:
        trace = self._trace
        if trace is None:
            return
        step = self.agent.step
        try:
            if trace.profiler is None and step >= trace.start_step - 1:
                if step > trace.start_step - 1:
                    raise CommandFailed(f"missed the start step {trace.start_step} (at step {step}); {_RETRY_LATER}")
                trace.profiler = trace_capture.start_profiler()
                if self._trace is not trace:  # detached meanwhile, from another thread
                    trace_capture.stop_quietly(trace.profiler)
            elif trace.profiler is not None and step >= trace.last_step:
                with self._lock:
                    if self._trace is not trace:
                        return  # detached meanwhile, from another thread
                    self._trace = None
                trace.profiler.stop()
                # Exporting takes seconds for a real model: not on the training thread.
                self._writer = threading.Thread(
                    target=self._write_trace, args=(trace,), daemon=True, name="torchpulse-trace-writer"
                )
                self._writer.start()
        except CommandFailed as exc:
            self._trace = None
            trace.close()
            self._answer(trace.command, False, str(exc), {})
        except Exception as exc:
            self._trace = None
            trace.close()
            if trace.profiler is not None:
                trace_capture.stop_quietly(trace.profiler)
            self._answer(trace.command, False, f"trace failed: {exc!r}", {})

    def _write_trace(self, trace: Trace) -> None:
        ident = self.agent.identity
        data: Data = {}
        try:
            path = trace_capture.write(trace, ident.run, ident.rank)
        except Exception as exc:
            log.warning("trace not written", out=str(trace.out), error=repr(exc))
            ok, message = False, f"trace failed: {exc}"
        else:
            ok, message = True, "trace written"
            data = {"path": str(path), "first_step": trace.start_step, "last_step": trace.last_step}
        # The profiler's events (hundreds of MB for a long trace) and, after a failed write, Kineto's handle
        # on the partial file it left (holding a full disk's space) go now, before the user is told.
        trace_capture.release(trace.profiler)
        trace.close()
        self._answer(trace.command, ok, message, data)


_OPTIMIZER_FILE = "optim/optimizer.py"


def _nested_step() -> bool:
    """True inside the inner call when a subclass's step() calls super().step().

    Torch wraps both methods, so the post-hooks run twice for one step; the
    outer wrapper frame sits a couple of frames above the inner one.
    """
    frame = sys._getframe(1)
    seen = 0
    for _ in range(16):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == "wrapper" and code.co_filename.endswith(_OPTIMIZER_FILE):
            seen += 1
            if seen == 2:
                return True
        frame = frame.f_back  # type: ignore[assignment]
    return False
