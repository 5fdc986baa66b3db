"""The one profiler trace a rank may take at a time, from its request to its written file.

A trace spans whole optimizer steps: it starts right after step S-1 finished
and stops right after step S+N-1 finished, so it covers steps S..S+N-1
exactly; its file is written by a thread of its own (`trace_capture`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from torchpulse.probes.agent import trace_capture
from torchpulse.probes.agent.commands import CommandFailed
from torchpulse.probes.agent.logs import get_logger
from torchpulse.probes.agent.trace_capture import Trace
from torchpulse.protocol import Command, FieldValue

log = get_logger("torchpulse.control")
Data = dict[str, FieldValue]
Answer = Callable[[Command, bool, str, Data], None]
# What a trace that missed its start step tells the user (without one, the daemon picks a step ahead).
_RETRY_LATER = "retry with a later --start-step, or without one"


class TraceRunner:
    """A trace waiting for its first step or capturing, then the thread writing its file."""

    def __init__(self, answer: Answer, run_and_rank: Callable[[], tuple[str, int]]) -> None:
        self._answer = answer
        # Read when the file is named: a job may set its rank after attaching (the identity is re-read).
        self._run_and_rank = run_and_rank
        self._trace: Trace | None = None
        self._writer: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        """Waiting for its first step or capturing (not writing)."""
        return self._trace is not None

    def busy(self) -> bool:
        """Anything of a trace left on this rank, its writing included."""
        return self._trace is not None or self.writing()

    def writing(self) -> bool:
        writer = self._writer
        return writer is not None and writer.is_alive()

    def start(self, command: Command, out_dir: int | None, step: int) -> None:
        """Accept a trace into `out_dir` (opened on arrival), which is the trace's from here on, or closed."""
        try:
            if out_dir is None:  # check_arguments opens it for every trace it lets through
                raise CommandFailed("out must be a directory path")
            start, steps, out = self._request(command, step)
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

    def _request(self, command: Command, step: int) -> tuple[int, int, Path]:
        """The first step, step count and directory of a trace this rank can take now; CommandFailed otherwise."""
        args = command.args
        steps, start, out = args["steps"], args.get("start_step"), args["out"]
        if not isinstance(steps, int) or not isinstance(out, str):  # checked on arrival
            raise CommandFailed("steps must be an integer and out a path")
        current = self._trace
        if (current is not None and current.profiler is not None) or self.writing():
            raise CommandFailed("a trace is already being captured or written on this rank")
        if not isinstance(start, int):
            start = step + 1
        if start <= step:
            raise CommandFailed(
                f"missed the start step {start}: this rank already finished step {step}; {_RETRY_LATER}"
            )
        return start, steps, Path(out)

    def advance(self, step: int) -> None:
        """At a step boundary: start the profiler before the first step, stop it after the last."""
        trace = self._trace
        if trace is None:
            return
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
                    target=self._write, args=(trace,), daemon=True, name="torchpulse-trace-writer"
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

    def abandon(self) -> None:
        """The agent detaches: end a trace (a profiler left running would grow for ever)."""
        with self._lock:
            trace, self._trace = self._trace, None
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

    def wait_written(self, timeout: float) -> None:
        """A trace already captured is worth a short wait at exit."""
        writer = self._writer
        if writer is not None:
            writer.join(timeout)

    def _write(self, trace: Trace) -> None:
        data: Data = {}
        try:
            path = trace_capture.write(trace, *self._run_and_rank())
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
