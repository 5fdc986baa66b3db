"""CUDA-graph probe: skips by reason, recordings, warm-ups, re-recordings, pools, optimizer readiness.

Sources, all read without changing what torch prints (see `compile.logtap`):
- `counters['inductor']['cudagraph_skips']` plus the skip messages logged with
  each increment (`skips`).
- The tree manager's own debug/info lines for warm-ups, recordings, new shapes
  and re-record reasons (`trees`), and the CUDAGRAPH_RECORDING compile
  callbacks for recording time (`recording`).
- The tree manager itself (thread-local) and optimizer state (`readiness`),
  read from the training thread in a global optimizer post-hook every N steps.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_post_hook

from torchpulse.probes.agent.config import int_option
from torchpulse.probes.agent.logs import get_logger
from torchpulse.probes.agent.probe import Probe
from torchpulse.probes.compile.logtap import LogTap, Sink
from torchpulse.probes.compile.reasons import CUDAGRAPH_SKIP_REASONS, RERECORD_REASONS, classify_cudagraph_skip
from torchpulse.probes.cudagraphs.readiness import Readiness, measure_readiness, readiness_hint
from torchpulse.probes.cudagraphs.recording import RecordingClock
from torchpulse.probes.cudagraphs.skips import SkipCounter, silent_skip_reason
from torchpulse.probes.cudagraphs.trees import TreeCensus, TreeCount, TreeLog, count_trees
from torchpulse.probes.optimizer import OptimizerLabels
from torchpulse.probes.torch_compat import cudagraph_trees as trees_compat
from torchpulse.probes.torch_compat import dynamo as dynamo_compat
from torchpulse.probes.torch_compat import features
from torchpulse.protocol import FieldValue

if TYPE_CHECKING:
    from torchpulse.probes.agent.agent import Agent

log = get_logger("torchpulse.probes")


class _Tracked:
    __slots__ = ("__weakref__", "grad_ptrs", "hinted", "label", "steps")

    def __init__(self, label: str) -> None:
        self.label = label
        self.steps = 0
        self.grad_ptrs: dict[int, int] = {}
        self.hinted = False


class CudaGraphProbe(Probe):
    name = "cudagraphs"
    commands = frozenset({"cudagraph-dump"})

    def __init__(self, agent: Agent) -> None:
        super().__init__(agent)
        self.every = int_option(
            agent.config.options, "cudagraph_readiness_every", agent.config.optimizer_state_every, minimum=1
        )
        self._recordings: RecordingClock | None = None  # None on a torch without recording callbacks
        self._taps: list[LogTap] = []
        self._labels = OptimizerLabels(self.at_death)  # when the optimizer probe is off
        # Per optimizer, kept across disable/enable (as the optimizer probe keeps its labels): a
        # re-install must not give a live optimizer a second label, series and hint.
        self._due_in: dict[int, int] = {}  # id(optimizer) -> steps until its next check
        self._tracked: weakref.WeakKeyDictionary[Optimizer, _Tracked] = weakref.WeakKeyDictionary()
        self._wrapped_seen: weakref.WeakSet[Optimizer] = weakref.WeakSet()
        self._skips = SkipCounter()
        self._tree_log = TreeLog()
        self._trees = TreeCensus()

    def _install(self) -> None:
        # Everything here reads Dynamo or Inductor: wait for the job to import Dynamo
        # (a compile, or its first optimizer step) instead of importing it now.
        self._install_after_import(dynamo_compat.DYNAMO, self._install_with_dynamo)

    def _install_with_dynamo(self) -> None:
        _skip_tracing_once()
        # Tree managers are detected once the job imports their module (`TreeCensus`).
        for feature in features.missing("dynamo_counters", "compile_callbacks", "compile_callback_args"):
            log.warning("cudagraphs probe runs without a torch feature", feature=feature.name, reason=feature.reason)
        # Fresh accounting per install, from the counters' values now; records queued before a detach
        # were folded in by then, in the sender's last batch.
        self._skips, self._tree_log, self._trees = SkipCounter(), TreeLog(), TreeCensus()
        self._skips.start()
        for logger_name in trees_compat.CUDAGRAPH_SKIP_LOGGERS:
            self._tap(logger_name, logging.WARNING, self._on_cudagraphs_record)
        if trees_compat.cuda_present():
            # Only a CUDA process builds graph trees; elsewhere a DEBUG level on
            # torch's logger would be a change with nothing to observe.
            self._tap(trees_compat.CUDAGRAPH_TREES_LOGGER, logging.DEBUG, self._on_trees_record)
            # Inductor imports the tree module when it first records a graph: a job that never
            # uses CUDA graphs (most, though every optimizer step loads Dynamo) gets no zeros.
            self._install_after_import(trees_compat.CUDAGRAPH_TREES, self._start_counters_at_zero)
        if features.has("compilation_metrics_log"):
            self._tap(dynamo_compat.METRICS_LOGGER, logging.INFO, self._on_compile_end)
        if features.has("compile_callbacks") and features.has("compile_callback_args"):
            self._recordings = RecordingClock(self.guard, self._on_recorded)
            self._recordings.ensure()
            self._keep(self._recordings)
        self._checked_step = self.guard(self._after_step)
        self._keep(register_optimizer_step_post_hook(self._every_step))

    def _start_counters_at_zero(self) -> None:
        """Every counter of this probe at 0 (their labels are fixed reason lists), so that a later
        skip or re-record is an increase() from 0 instead of a series born at its first value."""
        self.start_at_zero("cudagraph_skips_total", tuple((reason,) for reason in CUDAGRAPH_SKIP_REASONS))
        self.start_at_zero("cudagraph_rerecords_total", tuple((reason,) for reason in RERECORD_REASONS))
        for family in (
            "cudagraph_recordings_total",
            "cudagraph_warmups_total",
            "cudagraph_rerecord_limit_hits_total",
            "cudagraph_dynamic_shape_warnings_total",
        ):
            self.start_at_zero(family)
        if features.has("dynamo_counters"):  # its only source
            self.start_at_zero("cudagraph_nonstatic_input_copies_total")

    def _tap(self, logger_name: str, level: int, sink: Sink) -> None:
        tap = LogTap(logger_name, level, self.guard(sink))
        self._taps.append(tap)
        self._keep(tap)

    def _uninstalled(self) -> None:
        # The accounting stays until the next install starts it afresh (`_install_with_dynamo`):
        # records queued before a detach are folded in after it, in the sender's last batch.
        self._recordings = None
        self._taps = []

    # -- training thread: compile time and slow CUDA-graph paths ---------------
    def _on_compile_end(self, record: logging.LogRecord) -> None:
        if dynamo_compat.compilation_metrics_of(record.args) is None:
            return
        if self._recordings is not None:
            self._recordings.ensure()  # torch._dynamo.reset() clears compile callbacks
        for tap in self._taps:
            tap.refresh()
        self._poll_counters()

    def _on_cudagraphs_record(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if record.funcName == trees_compat.CUDAGRAPH_SKIP_FUNCTION or message.startswith(
            trees_compat.CUDAGRAPH_SKIP_PREFIX
        ):
            self._skips.explained()
            limit = any(marker in message for marker in trees_compat.CUDAGRAPH_RERECORD_LIMIT_MARKERS)
            self.agent.record(self._on_skip, classify_cudagraph_skip(message), message, limit)
        elif message.startswith(trees_compat.CUDAGRAPH_DYNAMIC_SHAPE_WARNING):
            self.agent.record(self._on_dynamic_shape_warning, message)

    def _on_trees_record(self, record: logging.LogRecord) -> None:
        for event in self._tree_log.read(record):
            if event.kind == "rerecord":
                self.agent.record(self._on_rerecord, event.reason, event.detail)
            elif event.kind == "warmup":
                self.agent.record(self._inc, "cudagraph_warmups_total")
            elif self._recordings is None:  # no recording callbacks on this torch: count from the log
                self._trees.dirty = True
                self.agent.record(self._inc, "cudagraph_recordings_total")

    def _on_recorded(self, seconds: float) -> None:
        self._trees.dirty = True
        self.agent.record(self._on_recording, seconds)
        self._poll_counters()

    def _poll_counters(self) -> None:
        increase = self._skips.poll()
        if increase.silent_skips:
            self.agent.record(self._on_silent_skips, silent_skip_reason(), increase.silent_skips)
        if increase.input_copies:
            self.agent.record(self._inc, "cudagraph_nonstatic_input_copies_total", float(increase.input_copies))

    # -- training thread: every optimizer step (cheap unless due) --------------
    def _every_step(self, optimizer: Optimizer, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        # Not wrapped by `guard`: its Dynamo-disable wrapper costs ~1 us a call,
        # measurable on a fast compiled step. This path is a dict lookup and an
        # int compare that cannot raise; `_skip_tracing_once` below keeps Dynamo from
        # tracing it, and the real work runs guarded. A disabled probe's hook may stay registered (an
        # uninstall inside a hook): it must not start countdowns that only a tracked optimizer's finalizer drops.
        if not self.enabled:
            return
        key = id(optimizer)
        left = self._due_in.get(key, 0) - 1
        if left > 0:
            self._due_in[key] = left
            return
        self._due_in[key] = self.every
        self._checked_step(optimizer, args, kwargs)

    def _after_step(self, optimizer: Optimizer, _args: tuple[object, ...], _kwargs: dict[str, object]) -> None:
        optimizer_probe = self.agent.probes.get("optimizer")
        if optimizer in getattr(optimizer_probe, "wrapped", ()):
            # Stepped inside a wrapper's step (ZeroRedundancyOptimizer): the wrapper is measured. Its
            # countdown still goes with it, as a tracked optimizer's does.
            if optimizer not in self._wrapped_seen:
                self._wrapped_seen.add(optimizer)
                self.at_death(optimizer, self._due_in.pop, id(optimizer), None)
            return
        tracked = self._tracked.get(optimizer) or self._track(optimizer)
        tracked.steps += 1
        if self._recordings is not None:
            self._recordings.ensure()
        readiness = measure_readiness(optimizer, tracked.grad_ptrs, trees_compat.static_checker())
        hint = None
        if not tracked.hinted:
            hint = readiness_hint(readiness)
            tracked.hinted = hint is not None
        self.agent.record(self._on_readiness, tracked.label, readiness, hint)
        self._poll_counters()
        count = self._trees.poll()
        if count is not None:
            self.agent.record(self._on_trees, count)

    def _track(self, optimizer: Optimizer) -> _Tracked:
        # One name per optimizer across both probes, also while the optimizer probe is disabled.
        label_of: Callable[[Optimizer], str] = getattr(
            self.agent.probes.get("optimizer"), "label_of", self._labels.take
        )
        tracked = _Tracked(label_of(optimizer))
        self._tracked[optimizer] = tracked
        # The countdown is keyed by id() for the hot path's sake: drop it with the optimizer.
        self.at_death(optimizer, self._due_in.pop, id(optimizer), None)
        return tracked

    def dump_state(self) -> dict[str, FieldValue]:
        """CUDA-graph tree state for `torchpulse ctl cudagraph-dump`; call on the training thread,
        where the (thread-local) tree manager lives."""
        count = count_trees()
        if count is None:
            return {"available": False, "reason": "this torch has no CUDA-graph tree managers"}
        skips = dynamo_compat.dynamo_counter("inductor", "cudagraph_skips") if features.has("dynamo_counters") else None
        return {
            "available": True,
            "cuda": trees_compat.cuda_present(),
            "managers": count.managers,
            "trees": count.trees,
            "nodes": count.nodes,
            "pool_bytes": count.pool_bytes,
            "skips_total": skips,
        }

    # -- agent thread ------------------------------------------------------------
    def _inc(self, family: str, amount: float = 1.0) -> None:
        self.agent.store.inc(family, (), amount)

    def _on_skip(self, reason: str, message: str, rerecord_limit: bool) -> None:
        self.agent.store.inc("cudagraph_skips_total", (reason,))
        if rerecord_limit:
            self.agent.store.inc("cudagraph_rerecord_limit_hits_total", ())
        self.agent.emit("warning", "cudagraphs skipped", reason=reason, detail=message)

    def _on_silent_skips(self, reason: str, count: int) -> None:
        self.agent.store.inc("cudagraph_skips_total", (reason,), float(count))

    def _on_dynamic_shape_warning(self, message: str) -> None:
        self.agent.store.inc("cudagraph_dynamic_shape_warnings_total", ())
        self.agent.emit("warning", "cudagraph dynamic-shape warn limit crossed", detail=message)

    def _on_rerecord(self, reason: str, detail: str) -> None:
        self.agent.store.inc("cudagraph_rerecords_total", (reason,))
        self.agent.emit("info", "cudagraph re-recorded", reason=reason, detail=detail)

    def _on_recording(self, duration: float) -> None:
        self.agent.store.inc("cudagraph_recordings_total", ())
        self.agent.store.observe("cudagraph_recording_duration_seconds", (), duration)

    def _on_trees(self, count: TreeCount) -> None:
        self.agent.store.set("cudagraph_trees", (), float(count.trees))
        self.agent.store.set("cudagraph_nodes", (), float(count.nodes))
        if count.pool_bytes is not None:
            self.agent.store.set("cudagraph_pool_bytes", (), float(count.pool_bytes))

    def _on_readiness(self, label: str, r: Readiness, hint: str | None) -> None:
        store = self.agent.store
        store.set("optimizer_nonstatic_grads", (label,), float(r.nonstatic_grads))
        store.set("optimizer_moving_grads", (label,), float(r.moving_grads))
        store.set("optimizer_cpu_step_tensors", (label,), float(r.cpu_step_tensors))
        for group, flag in r.capturable:
            store.set("optimizer_capturable", (label, str(group)), 1.0 if flag else 0.0)
        if hint is not None:
            self.agent.emit(
                "warning",
                "optimizer is not ready for CUDA graphs",
                optimizer=label,
                hint=hint,
                nonstatic_grads=r.nonstatic_grads,
                moving_grads=r.moving_grads,
                cpu_step_tensors=r.cpu_step_tensors,
            )


@functools.cache
def _skip_tracing_once() -> None:
    # Dynamo treats a skipped function like a disabled one when a compiled
    # `optimizer.step` calls hooks, without a wrapper in eager mode.
    dynamo_compat.skip_tracing(CudaGraphProbe._every_step)
