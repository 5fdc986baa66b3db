"""Commands from the daemon, applied at safe points of the training thread.

The sender thread receives a `Command` and either answers at once (`status`
reads plain fields) or queues it. The training thread runs queued commands at
its next step boundary (after the job's main optimizer stepped), never in
the middle of a step. A trace
spans whole optimizer steps: it starts right after step S-1 finished and
stops right after step S+N-1 finished, so it covers steps S..S+N-1 exactly.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchpulse.probes.logs import get_logger
from torchpulse.protocol import Command, CommandResult, FieldValue

if TYPE_CHECKING:
    from torchpulse.probes.agent import Agent

log = get_logger("torchpulse.control")
Data = dict[str, FieldValue]


class CommandFailed(Exception):
    """A command that cannot be done; its text is what the user sees."""


@dataclass
class _Trace:
    command: Command
    start_step: int
    steps: int
    out: Path
    profiler: Any = None

    @property
    def last_step(self) -> int:
        return self.start_step + self.steps - 1


class Control:
    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self._first: weakref.ref[Any] | None = None
        self._stepped_since_first: set[int] = set()  # ids of other optimizers since the main one stepped
        self._handle: Any = None
        self._hook: Callable[..., None] | None = None
        self._pre_handle: Any = None
        self._pending: deque[Command] = deque()
        self.results: deque[CommandResult] = deque()
        self._trace: _Trace | None = None
        self._lock = threading.Lock()
        # Read on the hot path: True while anything waits for a safe point.
        self.armed = False
        self._safe_handlers: dict[str, Callable[[Command], Data]] = {
            "enable": self._enable,
            "disable": self._disable,
            "sample": self._sample,
            "autograd-log": self._autograd_log,
            "trace": self._start_trace,
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

        from torchpulse.probes.torch_features import disable_tracing

        if self._handle is None:
            self._hook = disable_tracing(self._after_step)
            self._handle = register_optimizer_step_post_hook(self._hook)

    def uninstall(self) -> None:
        handles, self._handle, self._pre_handle = (self._handle, self._pre_handle), None, None
        self._first = None
        for handle in handles:
            if handle is not None:
                handle.remove()

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
            if self.armed and self._last_hook():
                self.safe_point()
                self._move_last()
        except Exception as exc:  # never into the job
            log.warning("step boundary hook failed", error=repr(exc))

    def _adopt(self, optimizer: Any) -> None:
        from torchpulse.probes.torch_features import disable_tracing

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
        from torchpulse.probes.torch_features import global_optimizer_post_hooks

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
        if command.name == "status":
            self._answer(command, True, "ok", self.status())
        elif command.name in self._safe_handlers:
            with self._lock:
                self._pending.append(command)
                self.armed = True
        else:
            self._answer(command, False, f"unknown command {command.name!r}", {})

    def status(self) -> Data:
        agent = self.agent
        autograd = agent.probes.get("autograd")
        data: Data = {
            "step": agent.step,
            "probes": ",".join(sorted(n for n, p in agent.probes.items() if p.enabled)),
            "buffer_fill": agent.buffer_fill,
            "buffer_capacity": agent.config.buffer_capacity,
            "events_dropped": agent.dropped_total,
            "pid": agent.identity.pid,
            "tracing": self._trace is not None,
        }
        status = getattr(autograd, "status", None)
        if autograd is not None and autograd.enabled and callable(status):
            state = status()
            data["autograd_sample_every"] = state.get("sample_every")
            data["autograd_passes"] = state.get("passes")
            last = state.get("last_sampled_pass")
            if isinstance(last, dict):
                # The slowest node types of the last timed pass, e.g. "AddmmBackward0 1.20ms".
                data["autograd_slowest"] = ", ".join(
                    f"{name} {seconds * 1e3:.2f}ms" for name, _seq, seconds in last.get("slowest", [])[:5])
        return data

    # -- training thread ------------------------------------------------------
    def safe_point(self) -> None:
        """Run queued commands and advance a trace; called between steps."""
        while True:
            with self._lock:
                command = self._pending.popleft() if self._pending else None
            if command is None:
                break
            try:
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
        rate = command.args.get("rate")
        if not isinstance(rate, int | float) or not 0 < rate <= 1:
            raise CommandFailed("rate must be a number in (0, 1]")
        every = max(1, round(1 / rate))
        self._probe_method(command, "set_sample_every")(every)
        return {"sample_every": every}

    def _autograd_log(self, command: Command) -> Data:
        passes = command.args.get("passes")
        if not isinstance(passes, int) or passes < 1:
            raise CommandFailed("passes must be a positive integer")
        self._probe_method(Command(command.id, command.name, {"probe": "autograd"}), "log_next_passes")(passes)
        return {"passes": passes}

    def _cudagraph_dump(self, command: Command) -> Data:
        probe = self.agent.probes.get("cudagraphs")
        dump = getattr(probe, "dump_state", None)
        if probe is None or not callable(dump):
            raise CommandFailed("the cudagraphs probe is not enabled")
        result = dump()
        return dict(result) if isinstance(result, dict) else {"state": str(result)}

    def _start_trace(self, command: Command) -> Data:
        args = command.args
        steps, start, out = args.get("steps"), args.get("start_step"), args.get("out")
        if not isinstance(steps, int) or steps < 1:
            raise CommandFailed("steps must be a positive integer")
        if not isinstance(out, str) or not out:
            raise CommandFailed("missing argument: out")
        if self._trace is not None:
            raise CommandFailed("a trace is already being captured")
        if not isinstance(start, int):
            start = self.agent.step + 1
        if start <= self.agent.step:
            raise CommandFailed(f"missed the start step {start}: this rank already finished step "
                                f"{self.agent.step}; retry with a larger start margin")
        self._trace = _Trace(command, start, steps, Path(out))
        return {}

    def _advance_trace(self) -> None:
        trace = self._trace
        if trace is None:
            return
        step = self.agent.step
        try:
            if trace.profiler is None and step >= trace.start_step - 1:
                if step > trace.start_step - 1:
                    raise CommandFailed(f"missed the start step {trace.start_step} (at step {step})")
                trace.profiler = _start_profiler()
            elif trace.profiler is not None and step >= trace.last_step:
                self._trace = None
                path = _finish_profiler(trace, self.agent)
                self._answer(trace.command, True, "trace written",
                             {"path": str(path), "first_step": trace.start_step, "last_step": trace.last_step})
        except CommandFailed as exc:
            self._trace = None
            self._answer(trace.command, False, str(exc), {})
        except Exception as exc:
            self._trace = None
            if trace.profiler is not None:
                _stop_quietly(trace.profiler)
            self._answer(trace.command, False, f"trace failed: {exc!r}", {})


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


def _start_profiler() -> Any:
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    profiler = profile(activities=activities)
    profiler.start()
    return profiler


def _stop_quietly(profiler: Any) -> None:
    try:
        profiler.stop()
    except Exception:  # already broken; the failure was reported
        return


def _finish_profiler(trace: _Trace, agent: Agent) -> Path:
    trace.profiler.stop()
    ident = agent.identity
    trace.out.mkdir(parents=True, exist_ok=True)
    safe_run = "".join(c if c.isalnum() or c in "-_." else "_" for c in ident.run)
    path = trace.out / f"{safe_run}-rank{ident.rank}-steps{trace.start_step}-{trace.last_step}-{int(time.time())}.json"
    trace.profiler.export_chrome_trace(str(path))
    return path
