"""Autograd probe: passes by kind and time, sampled per-node timing, non-finite gradients.

Every pass goes through one wrapper of the engine's entry (`engine`), which
costs two clock reads and one record on ordinary passes. Every Nth pass
(`schedule`) it hooks the graph's nodes for timing (`nodes`), and after passes
that accumulate into `.grad` it queues a device-side non-finite check
(`nonfinite`) that is read back later without a sync.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch.optim import Optimizer

from torchpulse.bounds import TokenBucket
from torchpulse.limits import MAX_GRAPH_DEPTH
from torchpulse.probes.agent.logs import get_logger
from torchpulse.probes.agent.probe import Probe
from torchpulse.probes.agent.store import BoundedLabel
from torchpulse.probes.autograd.config import AutogradConfig
from torchpulse.probes.autograd.engine import EngineHook
from torchpulse.probes.autograd.names import NameResolver
from torchpulse.probes.autograd.nodes import (
    NodeTime,
    PassTimer,
    PassTiming,
    format_grad_outputs,
    iter_graph,
    roots_of,
)
from torchpulse.probes.autograd.nonfinite import CheckResult, GradCheck, merge
from torchpulse.probes.autograd.schedule import PassPlan, PassSchedule
from torchpulse.probes.torch_compat import dynamo as dynamo_compat
from torchpulse.probes.torch_compat import features

if TYPE_CHECKING:
    from torchpulse.probes.agent.agent import Agent

log = get_logger("torchpulse.probes")

# Fewest passes between the searches that a dropped model's parameters trigger.
LOST_SEARCH_EVERY = 10
# Warnings about non-finite passes: the first few in full, then one a minute. A job whose loss
# went NaN for good (or a GradScaler that never recovers) would otherwise log one line per pass
# per rank for as long as it runs; the counter and the gauge still see every pass.
NONFINITE_LOG_BURST = 10
NONFINITE_LOG_INTERVAL = 60.0
# The `kind` values of backward_passes_total (see `_plan`).
PASS_KINDS = ("backward", "grad", "compiled_autograd", "reentrant")
# Non-traced tensor types take the fast path; anything else is checked for fake/functional.
_PLAIN = (torch.Tensor, torch.nn.Parameter)


@dataclass(frozen=True)
class SampledPass:
    """The last timed pass, kept for `torchpulse status`."""

    pass_index: int
    kind: str
    seconds: float
    node_seconds: float
    slowest: tuple[NodeTime, ...]


class AutogradProbe(Probe):
    name = "autograd"
    commands = frozenset({"sample", "autograd-log"})

    def __init__(self, agent: Agent) -> None:
        super().__init__(agent)
        self.config = AutogradConfig.from_options(agent.config.options)
        self._schedule = PassSchedule(
            self.config.sample_every,
            self.config.log_passes,
            functools.partial(self.start_at_zero, "autograd_sampled_passes_total"),
        )
        self._discovered = False
        self._lost_search_at = -LOST_SEARCH_EVERY
        self._check = GradCheck(self.config.max_pending_checks)
        # Optimizer -> parameter groups already tracked: graph walks find parameters only on
        # sampled passes, so a second model (a GAN's generator, a rebuilt model) or the inside
        # of a reentrant checkpoint would go unchecked for up to N passes, or for ever.
        self._optimizers: weakref.WeakKeyDictionary[Optimizer, int] = weakref.WeakKeyDictionary()
        self._names = NameResolver()
        self._node_label = BoundedLabel(self.config.top_nodes)
        self._torch_logging_noted = False
        self._deep_graph_noted = False
        self._nonfinite_log = TokenBucket(1 / NONFINITE_LOG_INTERVAL, NONFINITE_LOG_BURST, time.monotonic())
        self._engine = EngineHook[PassPlan](self, agent, self._begin, self._end)
        self.last_sample: SampledPass | None = None

    # -- live control (applied at the next pass boundary) -------------------
    def set_sample_every(self, every: int) -> None:
        """Time the nodes of every `every`th pass from the next pass on; 0 switches timing off."""
        self._schedule.set_sample_every(every)

    def log_next_passes(self, passes: int) -> None:
        """Emit one structured event per executed node for the next `passes` passes."""
        self._schedule.log_next_passes(passes)

    def status(self) -> dict[str, object]:
        """Plain values for `torchpulse status`: settings and the last timed pass."""
        sample, schedule = self.last_sample, self._schedule
        return {
            "passes": schedule.passes,
            "sample_every": schedule.sample_every,
            "logging_passes_left": schedule.log_left,
            "parameters_checked": self._check.known,
            "last_sampled_pass": None
            if sample is None
            else {
                "pass_index": sample.pass_index,
                "kind": sample.kind,
                "seconds": sample.seconds,
                "node_seconds": sample.node_seconds,
                "slowest": [(n.name, n.sequence_nr, n.seconds) for n in sample.slowest],
            },
        }

    # -- install ------------------------------------------------------------
    def _install(self) -> None:
        for patch in self._engine.install():
            self._keep(patch)
        self._install_after_import(dynamo_compat.DYNAMO, self._engine.keep_dynamo_out)
        if self.config.nonfinite:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            for feature in features.missing("dispatch_modes_aside"):
                log.warning("autograd probe runs without a torch feature", feature=feature.name, reason=feature.reason)

            self._keep(register_optimizer_step_pre_hook(self.guard(self._track_optimizer)))
        self._start_counters_at_zero()

    def _start_counters_at_zero(self) -> None:
        """The counters whose labels are known now, at 0: a NaN pass must be an increase() from 0."""
        self.start_at_zero("backward_passes_total", tuple((kind,) for kind in PASS_KINDS))
        if self.config.nonfinite:
            self.start_at_zero("grad_nonfinite_passes_total")
        if self._schedule.sample_every > 0:  # else at 0 once `set_sample_every` switches timing on
            self.start_at_zero("autograd_sampled_passes_total")

    def _track_optimizer(self, optimizer: Optimizer, _args: tuple[object, ...], _kwargs: dict[str, object]) -> None:
        """Check every parameter an optimizer steps, from its first step on (one lookup per step)."""
        groups = len(optimizer.param_groups)
        if self._optimizers.get(optimizer) == groups:
            return
        self._optimizers[optimizer] = groups
        for group in optimizer.param_groups:
            for param in group["params"]:
                if isinstance(param, torch.Tensor):
                    self._check.track(param)

    def _uninstalled(self) -> None:
        self._check.clear()
        self._optimizers = weakref.WeakKeyDictionary()
        self._names = NameResolver()
        self._discovered = False
        self.last_sample = None

    # -- training thread ----------------------------------------------------
    def _begin(
        self, t_outputs: Sequence[object], args: tuple[object, ...], kwargs: dict[str, object]
    ) -> PassPlan | None:
        try:
            return self._plan(t_outputs, args, kwargs)
        except Exception as exc:  # probe bugs must never reach the job
            self.fail(exc)
            return None

    def _plan(
        self, t_outputs: Sequence[object], args: tuple[object, ...], kwargs: dict[str, object]
    ) -> PassPlan | None:
        first = t_outputs[0] if len(t_outputs) else None
        if first is not None and type(first) not in _PLAIN and _is_traced(first):
            return None
        if torch._C._current_autograd_node() is not None:
            # A pass started inside a node (reentrant checkpointing): its time is the node's.
            return PassPlan("reentrant", -1, accumulate=False)
        compiled_autograd = sys.modules.get("torch._dynamo.compiled_autograd")
        compiled = bool(getattr(compiled_autograd, "compiled_autograd_enabled", False))
        accumulate = bool(kwargs.get("accumulate_grad", args[5] if len(args) > 5 else True))
        kind = "compiled_autograd" if compiled else ("backward" if accumulate else "grad")
        plan = self._schedule.plan(kind, accumulate, compiled)
        plan.logged = plan.logged and not self._torch_logs_nodes()
        # A dropped model's parameters died: search this pass for a rebuilt one (not more often
        # than every few passes, for jobs that make new Parameters every step).
        lost = accumulate and self._check.lost and plan.index - self._lost_search_at >= LOST_SEARCH_EVERY
        discover = accumulate and self.config.nonfinite and (plan.due or lost or not self._discovered)
        if discover:
            self._check.lost = False
        if lost:
            self._lost_search_at = plan.index
        if plan.sampled or plan.logged:
            # Only a pass that accumulates is checked, and only the check prunes what is tracked: a job of
            # `autograd.grad` passes alone (or no check at all) would keep a dead input leaf per timed pass.
            track = self._check.track if self.config.nonfinite and accumulate else _ignore
            plan.timer = PassTimer(
                roots_of(t_outputs), detailed=plan.logged, on_parameter=track, on_cut=self._note_deep_graph
            )
        elif discover:
            for node in iter_graph(roots_of(t_outputs), on_cut=self._note_deep_graph):
                variable = getattr(node, "variable", None)
                if isinstance(variable, torch.Tensor):
                    self._check.track(variable)
        self._discovered = self._discovered or (discover and self._check.known > 0)
        return plan

    def _note_deep_graph(self) -> None:
        """Once per process: a graph deeper than the walks go (see MAX_GRAPH_DEPTH)."""
        if not self._deep_graph_noted:
            self._deep_graph_noted = True
            self.agent.emit(
                "warning",
                "autograd.graph_too_deep",
                max_depth=MAX_GRAPH_DEPTH,
                effect="nodes deeper are not timed, logged or searched for parameters",
            )

    def _torch_logs_nodes(self) -> bool:
        """True when torch's own DEBUG logging hooks run: a second set would only add cost."""
        if logging.getLogger("torch.autograd.graph").getEffectiveLevel() > logging.DEBUG:
            return False
        if not self._torch_logging_noted:
            self._torch_logging_noted = True
            self.agent.emit(
                "info",
                "autograd.logging_deferred",
                reason="torch.autograd.graph logger at DEBUG: torch logs every node",
            )
        return True

    def _end(self, plan: PassPlan, seconds: float, ok: bool) -> None:
        try:
            timing = plan.timer.finish(self.config.slowest_kept) if plan.timer is not None else None
            self.agent.record(self._on_pass, plan.kind, seconds)
            if plan.timer is not None and plan.timer.error is not None:
                raise plan.timer.error
            if timing is not None and plan.sampled:
                self.last_sample = SampledPass(plan.index, plan.kind, seconds, timing.node_seconds, timing.slowest)
                self.agent.record(self._on_sample, timing)
            if timing is not None and plan.logged:
                self.agent.record(self._on_logged, plan.index, timing)
            if ok and plan.accumulate and plan.kind != "reentrant" and self.config.nonfinite:
                self._check.launch(plan.index, plan.kind)
            results = self._check.poll()
            if results:
                merged = merge(results)
                self.agent.record(self._on_checked, merged, [self._nonfinite_names(result) for result in merged])
        except Exception as exc:  # never into the job; the pass itself already finished
            self.fail(exc)

    def _nonfinite_names(self, result: CheckResult) -> NonfiniteNames:
        """The names of the first parameters a check found non-finite, and whether it found more; resolved here, on
        the training thread, while the model surely lives: a `main()` that returns right after the bad pass frees
        it before the sender thread would look (a resolver scan, tens of ms, only for a model not named before)."""
        if not result.nonfinite:
            return NonfiniteNames((), False)
        params = [param for param in (ref() for ref in result.nonfinite) if param is not None]
        shown = params[: self.config.max_names_logged]
        return NonfiniteNames(tuple(self._names.names(shown)), len(params) > len(shown))

    # -- sender thread ------------------------------------------------------
    def _on_pass(self, kind: str, seconds: float) -> None:
        self.agent.store.inc("backward_passes_total", (kind,))
        self.agent.store.observe("backward_duration_seconds", (kind,), seconds)

    def _on_sample(self, timing: PassTiming) -> None:
        store = self.agent.store
        store.inc("autograd_sampled_passes_total", ())
        # Slowest first, so the first sampled pass admits the top K types by time.
        for name, calls, seconds in sorted(timing.totals, key=lambda t: t[2], reverse=True):
            label = self._node_label(name)
            store.inc("autograd_node_seconds_total", (label,), seconds)
            store.inc("autograd_node_calls_total", (label,), float(calls))

    def _on_logged(self, pass_index: int, timing: PassTiming) -> None:
        for execution in timing.executions:
            self.agent.emit_requested(
                "info",
                "autograd.node",
                pass_index=pass_index,
                node=execution.name,
                sequence_nr=execution.sequence_nr,
                seconds=execution.seconds,
                grad_outputs=format_grad_outputs(execution.grad_outputs),
            )

    def _on_checked(self, results: list[CheckResult], names: list[NonfiniteNames]) -> None:
        store = self.agent.store
        for result, named in zip(results, names, strict=True):
            if self.config.grad_norm:
                store.set("grad_norm", (), result.norm)
            # Back to 0 after a clean pass: the alert reads a non-zero gauge as "still non-finite".
            store.set("grad_nonfinite_parameters", (), float(len(result.nonfinite)))
            if not result.nonfinite:
                continue
            store.inc("grad_nonfinite_passes_total", ())
            budget = self._nonfinite_log
            if not budget.take(time.monotonic()):
                continue
            # How many non-finite passes went unlogged since the previous line (the counter has them all).
            skipped = {"passes_not_logged": budget.suppressed} if budget.suppressed else {}
            budget.suppressed = 0
            self.agent.emit(
                "warning",
                "autograd.nonfinite_gradients",
                pass_index=result.pass_index,
                kind=result.kind,
                parameters=len(result.nonfinite),
                checked=result.checked,
                names=",".join(named.names),
                names_truncated=named.truncated,
                **skipped,
            )


class NonfiniteNames(NamedTuple):
    """What a non-finite pass's log line names: a tuple, one made per checked pass."""

    names: tuple[str, ...]
    truncated: bool


def _ignore(_param: torch.Tensor) -> None:
    pass


def _is_traced(tensor: object) -> bool:
    """Fake or functional tensors: a compile-time trace, not a pass of the job."""
    if not isinstance(tensor, torch.Tensor):
        return False  # a GradientEdge (pipelining's weight backward), not a tensor
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return isinstance(tensor, FakeTensor | FunctionalTensor) or torch._is_functional_tensor(tensor)
