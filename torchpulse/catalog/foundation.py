"""Families of the agent itself and of the optimizer probe."""

from __future__ import annotations

from typing import Final

from torchpulse.catalog.family import STEP_BUCKETS, Family

FAMILIES: Final[tuple[Family, ...]] = (
    Family(
        "agent_events_dropped_total",
        "counter",
        "Events the agent dropped instead of blocking the job, by where and why.",
        ("reason",),
    ),
    Family(
        "agent_probe_errors_total",
        "counter",
        "Internal errors of a probe; a probe disables itself after its first error.",
        ("probe",),
    ),
    Family("agent_probe_enabled", "gauge", "1 while the probe is installed and enabled.", ("probe",)),
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
    ),
    Family(
        "optimizer_learning_rate",
        "gauge",
        "Learning rate that the last step of each param group used.",
        ("optimizer", "param_group"),
    ),
    Family("optimizer_parameters", "gauge", "Parameter tensors the optimizer updates.", ("optimizer",)),
    Family(
        "optimizer_parameter_elements",
        "gauge",
        "Elements in the parameter tensors the optimizer updates.",
        ("optimizer",),
    ),
    Family(
        "optimizer_state_bytes",
        "gauge",
        "Bytes held in optimizer state tensors (local shard, lists of tensors included), recomputed periodically.",
        ("optimizer",),
    ),
)
