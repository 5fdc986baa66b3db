"""Families of the torch.compile and CUDA-graph probes (and optimizer CUDA-graph readiness)."""

from __future__ import annotations

from typing import Final

from torchpulse.catalog.family import COMPILE_BUCKETS, Family, Section

# Recordings take from ~1 ms (a tiny graph) to seconds (a large model with warm-up syncs).
RECORDING_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

FAMILIES: Final[tuple[Family, ...]] = (
    # Compile probe.
    Family(
        "compile_frames_total",
        "counter",
        "Frames Dynamo tried to compile, by outcome (ok or failed; a recompile-limit hit counts as failed).",
        ("status",),
    ),
    Family(
        "recompiles_total",
        "counter",
        "Recompilations by function (first K per process, rest 'other') and classified first failed guard.",
        ("function", "reason"),
        doc="The full guard-failure text is in the daemon's log.",
    ),
    Family(
        "graph_breaks_total",
        "counter",
        "Graph breaks by Dynamo graph-break type and user location file:line (first K per process, rest 'other').",
        ("kind", "location"),
    ),
    Family(
        "recompile_limit_hits_total",
        "counter",
        "Frames that hit the recompile limit and now run uncompiled, by function.",
        ("function",),
    ),
    Family(
        "compile_duration_seconds",
        "histogram",
        "Compile time per graph by exclusive phase: dynamo, aot_autograd, inductor, and the lazily "
        "compiled backward as aot_autograd_backward and inductor_backward.",
        ("phase",),
        COMPILE_BUCKETS,
    ),
    # CUDA-graph probe.
    Family(
        "cudagraph_skips_total",
        "counter",
        "Graphs compiled with CUDA graphs requested that run without them, by classified reason.",
        ("reason",),
        doc='On a CPU, `mode="reduce-overhead"` shows up as `cpu_device`.',
    ),
    Family("cudagraph_recordings_total", "counter", "CUDA-graph recordings (first recordings and re-recordings)."),
    Family(
        "cudagraph_recording_duration_seconds",
        "histogram",
        "Wall time of one CUDA-graph recording (CUDAGRAPH_RECORDING callbacks).",
        (),
        RECORDING_BUCKETS,
    ),
    Family("cudagraph_warmups_total", "counter", "Eager warm-up runs of functions before CUDA-graph recording."),
    Family(
        "cudagraph_rerecords_total",
        "counter",
        "CUDA-graph re-recordings by reason (static input pointer changed, managed index mismatch, "
        "dead tensors, new dynamic shape).",
        ("reason",),
    ),
    Family(
        "cudagraph_rerecord_limit_hits_total",
        "counter",
        "Functions that exceeded the re-record limit and now run without CUDA graphs.",
    ),
    Family(
        "cudagraph_dynamic_shape_warnings_total",
        "counter",
        "Times a function crossed cudagraph_dynamic_shape_warn_limit distinct recorded shapes.",
    ),
    Family(
        "cudagraph_nonstatic_input_copies_total",
        "counter",
        "Non-static inputs of recorded CUDA graphs; each is copied into the graph on every replay.",
    ),
    Family("cudagraph_trees", "gauge", "CUDA-graph trees (root recordings) of the training thread."),
    Family("cudagraph_nodes", "gauge", "Recorded CUDA graphs (tree nodes) of the training thread."),
    Family("cudagraph_pool_bytes", "gauge", "Bytes reserved in the CUDA-graph private memory pools."),
    # Optimizer CUDA-graph readiness (measured by the cudagraphs probe).
    Family(
        "optimizer_nonstatic_grads",
        "gauge",
        "CUDA grads that are not static addresses: a compiled, CUDA-graphed step copies each on replay.",
        ("optimizer",),
    ),
    Family(
        "optimizer_moving_grads",
        "gauge",
        "Grads whose address changed since the previous readiness check (zero_grad(set_to_none=True)).",
        ("optimizer",),
    ),
    Family(
        "optimizer_capturable",
        "gauge",
        "1 when a param group on CUDA has capturable=True, else 0 (CUDA groups only).",
        ("optimizer", "param_group"),
    ),
    Family(
        "optimizer_cpu_step_tensors",
        "gauge",
        "Optimizer `step` state tensors on the CPU for parameters on CUDA.",
        ("optimizer",),
    ),
)

SECTION: Final = Section(
    "torch.compile and CUDA graphs",
    FAMILIES,
    """\
K of the `function` and `location` labels is `TORCHPULSE_OPT_COMPILE_TOP_K`
([configuration.md](configuration.md)). The compile probe reads torch's own log records through logger
filters, so what the job prints (with or without `TORCH_LOGS`) stays byte-identical, also after the
job's `logging.config.dictConfig` disabled torch's loggers (the probe still reads them, and they stay
silent); every version-dependent fact lives in `torchpulse/probes/torch_compat/`.

One change to how a job compiles remains, and only when it compiles `optimizer.step` itself
(`torch.compile(opt.step)`): torch calls step hooks from the step's wrapper
(`torch/optim/optimizer.py`), and the agent's hooks are `torch.compiler.disable`d, so Dynamo runs that
wrapper eagerly. The optimizer's math inside it stays compiled (and CUDA-graphed with
`mode="reduce-overhead"`); the job sees one more failed frame, `wrapper`, in
`torchpulse_compile_frames_total{status="failed"}` and in torch's own counters, and
`TORCH_LOGS=graph_breaks` reports the wrapper's break at the hook call instead of at torch's own break
after the step. Without the hooks no step time or readiness could be read.""",
)
