"""Compile probe: compiled frames, recompiles by reason, graph breaks, recompile-limit hits, compile time.

Everything comes from what torch already produces for its own telemetry: the
CompilationMetrics record Dynamo logs after every frame and lazy backward
compile, and the `graph_breaks` artifact log. Both are read through log taps
(`compile_logtap`) that leave what the job prints untouched. The taps only
copy a few fields and queue a record; classification happens on the agent's
thread. Steady-state steps never reach this code: it runs only when torch
compiles.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, NamedTuple

from torchpulse.limits import MAX_COMPILE_FRAMES, MAX_GRAPH_BREAK_KINDS
from torchpulse.probes.agent.config import int_option
from torchpulse.probes.agent.logs import get_logger
from torchpulse.probes.agent.probe import Probe
from torchpulse.probes.agent.store import BoundedLabel
from torchpulse.probes.compile.logtap import LogTap
from torchpulse.probes.compile.reasons import (
    classify_recompile,
    function_label,
    is_recompile_limit,
    parse_graph_break,
    short_path,
)
from torchpulse.probes.torch_compat import dynamo as dynamo_compat
from torchpulse.probes.torch_compat import features

if TYPE_CHECKING:
    from torchpulse.probes.agent.agent import Agent

log = get_logger("torchpulse.probes")
DEFAULT_TOP_K = 20
# The `status` values of compile_frames_total.
FRAME_STATUSES = ("ok", "failed")


class Compilation(NamedTuple):
    """The fields of one CompilationMetrics object that the probe uses."""

    compile_id: str
    co_name: str | None
    co_filename: str | None
    co_firstlineno: int | None
    is_forward: bool | None
    recompile_reason: str | None
    fail_type: str | None
    fail_reason: str | None
    dynamo_us: int | None
    aot_autograd_us: int | None
    inductor_us: int | None
    backward_us: int | None

    @classmethod
    def of(cls, m: Any) -> Compilation:
        # `is_forward` and `recompile_reason` are missing before ~2.6 (feature
        # "compilation_metrics_recompile_reason"): a record then reads as a forward frame without a reason.
        return cls(
            str(m.compile_id or "?"),
            m.co_name,
            m.co_filename,
            m.co_firstlineno,
            getattr(m, "is_forward", None),
            getattr(m, "recompile_reason", None),
            m.fail_type,
            m.fail_reason,
            getattr(m, "dynamo_cumulative_compile_time_us", None),
            getattr(m, "aot_autograd_cumulative_compile_time_us", None),
            getattr(m, "inductor_cumulative_compile_time_us", None),
            getattr(m, "backward_cumulative_compile_time_us", None),
        )


def frame_of(compile_id: str) -> str:
    """The frame id of a compile id: "3/1" -> "3", and under compiled autograd "!0/3/1" -> "3".

    The "!0" prefix is the compiled-autograd graph whose backward was running, not the frame: the
    frames a backward compiles (its graph, hooks, functions compiled elsewhere too) all carry it.
    """
    parts = compile_id.split("/")
    return parts[1] if compile_id.startswith("!") and len(parts) > 2 else parts[0]


def is_recompile_id(compile_id: str) -> bool:
    """Whether a compile id names a frame's second or later compile: "3/1", "3/1_2" (attempt 2), "!0/3/1"."""
    parts = compile_id.split("/")
    if compile_id.startswith("!"):
        parts = parts[1:]
    if len(parts) < 2:
        return False
    index = parts[1].split("_", 1)[0]
    return index.isdigit() and int(index) > 0


def phase_seconds(c: Compilation) -> list[tuple[str, float]]:
    """Exclusive time per phase: the cumulative timers nest (dynamo ⊃ aot autograd ⊃ inductor)."""
    phases: list[tuple[str, float]] = []
    if c.is_forward is False:
        if c.backward_us is not None:
            phases.append(("aot_autograd_backward", max(0, c.backward_us - (c.inductor_us or 0)) / 1e6))
        if c.inductor_us is not None:
            phases.append(("inductor_backward", c.inductor_us / 1e6))
        return phases
    inner = c.aot_autograd_us if c.aot_autograd_us is not None else c.inductor_us
    if c.dynamo_us is not None:
        phases.append(("dynamo", max(0, c.dynamo_us - (inner or 0)) / 1e6))
    if c.aot_autograd_us is not None:
        phases.append(("aot_autograd", max(0, c.aot_autograd_us - (c.inductor_us or 0)) / 1e6))
    if c.inductor_us is not None:
        phases.append(("inductor", c.inductor_us / 1e6))
    return phases


class _StartCallback:
    """A compile-start callback that `torch._dynamo.reset()` may clear; re-added when missing."""

    def __init__(self, callback: Any) -> None:
        self.callback = callback

    def ensure(self) -> None:
        handler = dynamo_compat.callback_handler()
        if self.callback not in handler.start_callbacks:
            handler.register_start_callback(self.callback)

    def remove(self) -> None:
        # ValueError: already cleared by torch._dynamo.reset().
        with contextlib.suppress(ValueError):
            dynamo_compat.callback_handler().remove_start_callback(self.callback)


class CompileProbe(Probe):
    name = "compile"

    def __init__(self, agent: Agent) -> None:
        super().__init__(agent)
        top_k = int_option(agent.config.options, "compile_top_k", DEFAULT_TOP_K, minimum=1)
        self._top_k = top_k
        self._taps: list[LogTap] = []
        self._graph_breaks: LogTap | None = None
        self._start: _StartCallback | None = None
        self._reasons_known = True
        self._reset_state()

    def _reset_state(self) -> None:
        self._functions = BoundedLabel(self._top_k)
        self._locations = BoundedLabel(self._top_k)
        self._kinds = BoundedLabel(MAX_GRAPH_BREAK_KINDS)
        self._frames: dict[str, str] = {}

    def _install(self) -> None:
        # Nothing to observe before the job imports Dynamo, and importing it here
        # would change the job (see `torch_compat.DYNAMO`).
        self._install_after_import(dynamo_compat.DYNAMO, self._install_with_dynamo)

    def _install_with_dynamo(self) -> None:
        self._reasons_known = features.has("compilation_metrics_recompile_reason")
        for feature in features.missing(
            "compilation_metrics_log", "compilation_metrics_recompile_reason", "compile_callbacks"
        ):
            log.warning("compile probe runs without a torch feature", feature=feature.name, reason=feature.reason)
        if features.has("compilation_metrics_log"):
            if not dynamo_compat.metrics_logging_enabled():
                log.warning("torch._dynamo.config.log_compilation_metrics is off; compile metrics stay empty")
            else:
                # Only now that frames can be counted: a 0 says "watched, none", so not before
                # Dynamo is loaded nor without the records. The other compile counters are labelled
                # by function or location, an open set, and start at their first event.
                self.start_at_zero("compile_frames_total", tuple((status,) for status in FRAME_STATUSES))
            self._tap(dynamo_compat.METRICS_LOGGER, logging.INFO, self._on_metrics_record)
            # A limit hit names its function only through an earlier compile of the frame, which
            # may predate the probe (attached late, or to a running job).
            history = [
                Compilation.of(m)
                for m in dynamo_compat.compilation_metrics_history()
                if not getattr(m, "is_runtime", False)
            ]
            self.agent.record_quiet(self._remember_frames, history)
        self._graph_breaks = self._tap(dynamo_compat.GRAPH_BREAK_LOGGER, logging.DEBUG, self._on_graph_break_record)
        if features.has("compile_callbacks"):
            self._start = _StartCallback(self.guard(self._on_compile_start))
            self._start.ensure()
            self._keep(self._start)

    def _tap(self, logger_name: str, level: int, sink: Any) -> LogTap:
        tap = LogTap(logger_name, level, self.guard(sink))
        self._taps.append(tap)
        self._keep(tap)
        return tap

    def _uninstalled(self) -> None:
        # Labels and frame names stay: records queued before a detach are folded in
        # after it (the sender's last batch), and a limit hit names its function only
        # through the frame map. Kept across disable/enable, labels stay the first K of this process.
        self._taps = []
        self._graph_breaks = None
        self._start = None

    # -- training thread (only while torch compiles) ---------------------------
    def _on_compile_start(self, *_args: Any) -> None:
        # TORCH_LOGS / set_logs may have reset a logger level since the last compile.
        for tap in self._taps:
            tap.refresh()

    def _on_metrics_record(self, record: logging.LogRecord) -> None:
        metrics = dynamo_compat.compilation_metrics_of(record.args)
        if metrics is None or getattr(metrics, "is_runtime", False):
            return
        if self._start is not None:
            self._start.ensure()  # torch._dynamo.reset() clears compile callbacks
        self.agent.record(self._on_compilation, Compilation.of(metrics))

    def _on_graph_break_record(self, record: logging.LogRecord) -> None:
        if (
            isinstance(record.msg, str)
            and record.msg.startswith(dynamo_compat.GRAPH_BREAK_FULL_PREFIX)
            and self._graph_breaks is not None
            and self._graph_breaks.hides(record)
        ):
            # Dynamo deduplicated this break only because the tap enabled its logger.
            dynamo_compat.forget_graph_break_dedup()
        self.agent.record(self._on_graph_break, record.getMessage())

    # -- agent thread ----------------------------------------------------------
    def _remember_frames(self, compilations: list[Compilation]) -> None:
        for c in compilations:
            if c.is_forward is not False:
                self._function_of(c)

    def _function_of(self, c: Compilation) -> str:
        frame_id = frame_of(c.compile_id)
        if c.co_name is not None:
            if len(self._frames) >= MAX_COMPILE_FRAMES:
                self._frames.clear()
            self._frames[frame_id] = function_label(c.co_name, c.co_filename, c.co_firstlineno)
        # A recompile-limit hit carries no code name; its frame id names the function.
        return self._frames.get(frame_id) or function_label(c.co_name, c.co_filename, c.co_firstlineno)

    def _on_compilation(self, c: Compilation) -> None:
        store = self.agent.store
        for phase, seconds in phase_seconds(c):
            store.observe("compile_duration_seconds", (phase,), seconds)
        if c.is_forward is False:
            return  # a lazy backward graph is not a frame
        function = self._function_of(c)
        store.inc("compile_frames_total", ("ok" if c.fail_type is None else "failed",))
        if is_recompile_limit(
            c.fail_type,
            c.fail_reason,
            dynamo_compat.RECOMPILE_LIMIT_MARKERS,
            dynamo_compat.RECOMPILE_LIMIT_FAIL_TYPES,
            dynamo_compat.RECOMPILE_LIMIT_ERRORS,
        ):
            store.inc("recompile_limit_hits_total", (self._functions(function),))
            self.agent.emit(
                "warning",
                "recompile limit hit; the function now runs uncompiled",
                function=function,
                compile_id=c.compile_id,
                last_reason=c.recompile_reason,
            )
            return
        detail = c.recompile_reason
        if detail is None and not self._reasons_known and is_recompile_id(c.compile_id):
            # This torch records no reasons: the compile id alone says it recompiled.
            detail = "unknown: this torch records no recompile reason"
        if detail is not None:
            reason = classify_recompile(detail) if c.recompile_reason is not None else "other"
            store.inc("recompiles_total", (self._functions(function), reason))
            self.agent.emit(
                "info", "recompile", function=function, reason=reason, compile_id=c.compile_id, detail=detail
            )
        if c.fail_type is not None:
            self.agent.emit(
                "warning",
                "compile failed",
                function=function,
                compile_id=c.compile_id,
                fail_type=c.fail_type,
                detail=c.fail_reason,
            )

    def _on_graph_break(self, message: str) -> None:
        parsed = parse_graph_break(message)
        if parsed is None:
            return
        location = f"{short_path(parsed.filename)}:{parsed.line}"
        kind = self._kinds(parsed.kind)
        self.agent.store.inc("graph_breaks_total", (kind, self._locations(location)))
        self.agent.emit(
            "info", "graph break", kind=parsed.kind, location=f"{parsed.filename}:{parsed.line}", detail=parsed.reason
        )
