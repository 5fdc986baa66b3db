"""Families of the agent itself and of the optimizer probe."""

from __future__ import annotations

from typing import Final

from torchpulse.catalog.family import STEP_BUCKETS, Family, Section

FAMILIES: Final[tuple[Family, ...]] = (
    Family(
        "agent_events_dropped_total",
        "counter",
        "Events the agent dropped instead of blocking the job, by where and why.",
        ("reason",),
        doc="`oversized` is one item larger than a whole frame. Records are dropped and counted, never queued "
        "without bound and never blocking a step.",
    ),
    Family(
        "agent_probe_errors_total",
        "counter",
        "Internal errors of a probe; a probe disables itself after its first error.",
        ("probe",),
        doc="The probe logs one warning; the job's own exceptions pass through untouched.",
    ),
    Family("agent_probe_enabled", "gauge", "1 while the probe is installed and enabled.", ("probe",)),
    Family(
        "agent_stalled",
        "gauge",
        "1 while the rank has not stepped its main optimizer for longer than its stall threshold.",
        (),
        doc="The threshold is TORCHPULSE_STALL_SECONDS or 10x the p99 of the last 100 step intervals, whichever is "
        "longer (TORCHPULSE_FIRST_STEP_STALL_SECONDS before the first step); the daemon's log has the training "
        "thread's stack from the moment it rose, and `torchpulse ctl stacks` shows the current one.",
    ),
    Family(
        "agent_last_step_timestamp_seconds",
        "gauge",
        "Unix time of the main optimizer's last step on this rank.",
        (),
    ),
    # Optimizer probe.
    Family("optimizer_steps_total", "counter", "Completed optimizer.step() calls.", ("optimizer",)),
    Family(
        "optimizer_step_errors_total",
        "counter",
        "optimizer.step() calls that raised (the pre-hook ran, the post-hook did not).",
        ("optimizer",),
    ),
    Family(
        "optimizer_step_duration_seconds",
        "histogram",
        "Wall time of optimizer.step() on the host, without the closure it runs (on CUDA: launch time, "
        "not kernel time).",
        ("optimizer",),
        STEP_BUCKETS,
        doc="LBFGS evaluates its closure several times per step, and Lightning's automatic optimization passes "
        "every training step (forward and backward) as the closure: that time is the model's, not the "
        "optimizer's.",
    ),
    Family(
        "optimizer_learning_rate",
        "gauge",
        "Learning rate that the last step of each param group used.",
        ("optimizer", "param_group"),
        doc="A scheduler's change shows from the next step on.",
    ),
    Family("optimizer_parameters", "gauge", "Parameter tensors the optimizer updates.", ("optimizer",)),
    Family(
        "optimizer_parameter_elements",
        "gauge",
        "Elements in the parameter tensors the optimizer updates.",
        ("optimizer",),
        doc="Whole tensors also when they are sharded (FSDP2, TP): the model's size, the same on every rank; "
        "`torchpulse_optimizer_state_bytes` is this rank's share.",
    ),
    Family(
        "optimizer_state_bytes",
        "gauge",
        "Bytes held in optimizer state tensors (local shard, lists of tensors included), recomputed periodically.",
        ("optimizer",),
        doc="LBFGS's history counts too. Recomputed every 100 steps by default and whenever the number of state "
        "entries or param groups changes.",
    ),
)

SECTION: Final = Section(
    "Agent and optimizer",
    FAMILIES,
    """\
The `optimizer` label is `<class>#<n>` (`AdamW#0`), in the order the process first stepped each
optimizer; it stays the same across `ctl disable`/`enable`. `n` is the smallest number no live
optimizer holds, so a job that builds a new optimizer per trial or OOM retry keeps counting under the
same label instead of adding series; a step that raised is counted when that optimizer is dropped, if
it never steps again. An optimizer that wraps another one and steps it inside its own step
(`ZeroRedundancyOptimizer`, Lookahead, SAM) is one optimizer: only the wrapper the job calls is counted
and timed, and its `torchpulse_optimizer_state_bytes` include the state the wrapped one holds (under
ZeRO, this rank's shard).""",
)
