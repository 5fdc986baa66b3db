"""Families of the autograd probe."""

from __future__ import annotations

from typing import Final

from torchpulse.catalog.family import STEP_BUCKETS, Family, Section

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
        doc="Their names are in the daemon's log (below).",
    ),
    Family(
        "grad_norm",
        "gauge",
        "Global L2 norm of parameter gradients after the last pass (local shard; scaled "
        "under GradScaler); exported when enabled.",
    ),
)

SECTION: Final = Section(
    "Autograd",
    FAMILIES,
    """\
Passes are counted by wrapping `torch.autograd.graph._engine_run_backward` (both references to it);
AOTAutograd's compile-time passes are not counted. Every 100th pass
(`TORCHPULSE_OPT_AUTOGRAD_SAMPLE_EVERY`) times every node of the graph down to 10,000 levels deep (K of
the `node` label: `TORCHPULSE_OPT_AUTOGRAD_TOP_NODES`). Deeper nodes, in a very long unrolled
recurrence, are left out with one `autograd.graph_too_deep` warning, because on torch 2.13 freeing a
fully walked chain of ~45,000 nodes overflows the stack. A pass's hooks count only that pass, not
another thread's or a reentrant checkpoint's inner pass; they are Python closures that only read the
clock (the logging mode of `ctl autograd-log` also describes each node's grad_outputs).

The non-finite check runs after every pass that accumulates into `.grad`: one fused
`torch._foreach_norm` per device and dtype over every gradient. On CUDA its result is copied to pinned
memory without a sync and read once its event completed, so the training thread never waits for the
device; on a CPU it runs on the training thread and costs one read of every gradient. Nothing compiled
runs inside the training process. `TORCHPULSE_OPT_AUTOGRAD_NONFINITE=0` switches the check off,
`TORCHPULSE_OPT_AUTOGRAD_GRAD_NORM=1` exports `torchpulse_grad_norm`. The names of the affected
parameters (`layers.3.attn.q_proj.weight`, wrapper prefixes stripped) are in the
`autograd.nonfinite_gradients` log event: one per non-finite pass for the first 10, then one a minute,
with `passes_not_logged` saying how many it left out (the counter sees every pass). The check's
reductions are hidden from the job's own dispatch modes (`FlopCounterMode`, `DebugMode`, memory
trackers), and gradients on the meta device are skipped.""",
)
