"""Families of the autograd probe."""

from __future__ import annotations

from typing import Final

from torchpulse.catalog.family import STEP_BUCKETS, Family

FAMILIES: Final[tuple[Family, ...]] = (
    Family(
        "backward_passes_total",
        "counter",
        "Autograd passes by kind: backward (loss.backward, torch.autograd.backward), grad "
        "(torch.autograd.grad), compiled_autograd, reentrant (a pass started inside another).",
        ("kind",),
    ),
    Family(
        "backward_duration_seconds",
        "histogram",
        "Wall time of autograd passes on the host (on CUDA: until the engine returns).",
        ("kind",),
        STEP_BUCKETS,
    ),
    Family(
        "autograd_node_seconds_total",
        "counter",
        "Seconds in autograd nodes of sampled passes, by node type (top K, rest in other).",
        ("node",),
    ),
    Family(
        "autograd_node_calls_total",
        "counter",
        "Autograd node executions in sampled passes, by node type (top K, rest in other).",
        ("node",),
    ),
    Family("autograd_sampled_passes_total", "counter", "Passes whose nodes were timed."),
    Family("grad_nonfinite_passes_total", "counter", "Passes after which a parameter gradient held NaN or Inf."),
    Family(
        "grad_nonfinite_parameters",
        "gauge",
        "Parameters with non-finite gradients after the most recent checked pass (0 once clean).",
    ),
    Family(
        "grad_norm",
        "gauge",
        "Global L2 norm of parameter gradients after the last pass (local shard; scaled "
        "under GradScaler); exported when enabled.",
    ),
)
