"""Compile and CPU-side CUDA-graph probes against real torch.compile, compared with torch's own records."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
import torch._dynamo.utils
from torch._dynamo.utils import counters

from tests.support import histogram_series, local_agent, series
from torchpulse.probes.compile.reasons import function_label, is_recompile_limit
from torchpulse.probes.torch_compat import dynamo as dynamo_compat

HERE = __file__


@dataclasses.dataclass
class Scenario:
    agent: Any
    metrics: list[Any]  # torch's own CompilationMetrics of the scenario
    frames: Counter[str]
    graph_breaks: Counter[str]
    cudagraph_skips: int
    lines: dict[str, int]


def _line(fn: Any) -> int:
    return int(fn.__code__.co_firstlineno)


def shape_fn(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def dtype_fn(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def const_fn(x: torch.Tensor, k: int) -> torch.Tensor:
    return x * k


def limit_fn(x: torch.Tensor) -> torch.Tensor:
    return x - 1


def break_fn(x: torch.Tensor) -> torch.Tensor:
    x = x.sin()
    torch._dynamo.graph_break()  # GRAPH-BREAK-LINE
    return x.cos()


def _delta(before: dict[str, int], group: str) -> Counter[str]:
    now = Counter(dict(counters.get(group, {})))
    now.subtract(before)
    return +now


@pytest.fixture(scope="module")
def scenario() -> Iterator[Scenario]:
    """One agent sees every compile event of the module; compiled once, tiny graphs, shared."""
    agent: Any = local_agent(("optimizer", "compile", "cudagraphs"))
    torch._dynamo.utils.clear_compilation_metrics()
    before = {group: dict(counters.get(group, {})) for group in ("frames", "graph_break")}
    skips_before = dynamo_compat.dynamo_counter("inductor", "cudagraph_skips")
    cheap = "eager"  # dynamo with the eager backend: real guards and recompiles, no codegen
    compiled = torch.compile(shape_fn, backend=cheap)
    for n in (2, 3, 4):  # 2 -> 3 recompiles once, then the graph is dynamic
        compiled(torch.randn(n))
    compiled = torch.compile(dtype_fn, backend=cheap)
    compiled(torch.randn(3))
    compiled(torch.randn(3, dtype=torch.float64))
    compiled = torch.compile(const_fn, backend=cheap)
    compiled(torch.randn(3), 2)
    compiled(torch.randn(3), 3)
    torch.compile(break_fn, backend=cheap)(torch.randn(3))
    with torch._dynamo.config.patch(recompile_limit=2):
        compiled = torch.compile(limit_fn, dynamic=False, backend=cheap)
        for n in (1, 2, 3, 4):
            compiled(torch.randn(n))
    # Inductor for real phase timings, a lazily compiled backward, and a CPU
    # "reduce-overhead" graph that must be counted as a CUDA-graph skip.
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled_model = torch.compile(model, mode="reduce-overhead")
    compiled_model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    metrics = torch._dynamo.utils.get_compilation_metrics()
    agent.drain()
    with open(HERE) as source:
        break_line = next(i for i, line in enumerate(source, 1) if line.rstrip().endswith("# GRAPH-BREAK-LINE"))
    yield Scenario(
        agent,
        metrics,
        _delta(before["frames"], "frames"),
        _delta(before["graph_break"], "graph_break"),
        dynamo_compat.dynamo_counter("inductor", "cudagraph_skips") - skips_before,
        {"break": break_line},
    )
    agent.shutdown()


def _label(fn: Any) -> str:
    return function_label(fn.__name__, fn.__code__.co_filename, _line(fn))


def test_frames_match_torch_counters(scenario: Scenario) -> None:
    """ok and failed frames equal Dynamo's counters['frames'] over the same run."""
    expected = {
        ("ok",): float(scenario.frames["ok"]),
        ("failed",): float(scenario.frames["total"] - scenario.frames["ok"]),
    }
    assert expected == series(scenario.agent, "compile_frames_total")


def test_each_recompile_is_counted_once_with_its_reason(scenario: Scenario) -> None:
    """Shape, dtype and Python-constant recompiles: one each, right class, same total as torch recorded."""
    recompiles = series(scenario.agent, "recompiles_total")
    expected = {
        (_label(shape_fn), "tensor_size"): 1.0,
        (_label(dtype_fn), "dtype"): 1.0,
        (_label(const_fn), "python_value"): 1.0,
        (_label(limit_fn), "tensor_size"): 1.0,
    }
    assert expected == recompiles
    torch_recompiles = [m for m in scenario.metrics if m.recompile_reason and m.fail_type is None]
    assert len(torch_recompiles) == sum(recompiles.values())


def test_recompile_limit_hit_is_counted(scenario: Scenario) -> None:
    """The frame that hit the (lowered) recompile limit is counted once under its function."""
    torch_hits = [
        m
        for m in scenario.metrics
        if is_recompile_limit(
            m.fail_type,
            m.fail_reason,
            dynamo_compat.RECOMPILE_LIMIT_MARKERS,
            dynamo_compat.RECOMPILE_LIMIT_FAIL_TYPES,
            dynamo_compat.RECOMPILE_LIMIT_ERRORS,
        )
    ]
    assert 1 == len(torch_hits)
    assert {(_label(limit_fn),): 1.0} == series(scenario.agent, "recompile_limit_hits_total")


def test_graph_break_is_counted_with_kind_and_line(scenario: Scenario) -> None:
    """The kind is the first line of torch's own graph-break key; the location is the breaking line."""
    assert 1 == sum(scenario.graph_breaks.values())
    kind = next(iter(scenario.graph_breaks)).split("\n", 1)[0]
    location = f"compile/test_compile.py:{scenario.lines['break']}"
    assert {(kind, location): 1.0} == series(scenario.agent, "graph_breaks_total")


def test_compile_durations_cover_forward_and_lazy_backward(scenario: Scenario) -> None:
    """Every phase of the inductor forward and of its lazily compiled backward was observed."""
    histograms = {labels[0]: h for labels, h in histogram_series(scenario.agent, "compile_duration_seconds").items()}
    for phase in ("dynamo", "aot_autograd", "inductor", "aot_autograd_backward", "inductor_backward"):
        assert phase in histograms
    backward = [m for m in scenario.metrics if m.is_forward is False]
    assert len(backward) == sum(histograms["inductor_backward"].bucket_counts)
    forward_frames = [
        m
        for m in scenario.metrics
        if m.is_forward is not False and not m.is_runtime and m.dynamo_cumulative_compile_time_us is not None
    ]
    assert len(forward_frames) == sum(histograms["dynamo"].bucket_counts)


def test_reduce_overhead_on_cpu_is_a_cudagraph_skip(scenario: Scenario) -> None:
    """CPU graphs skip CUDA graphs without a message; the counter increments are cpu_device skips."""
    assert scenario.cudagraph_skips >= 1
    assert {("cpu_device",): float(scenario.cudagraph_skips)} == series(scenario.agent, "cudagraph_skips_total")


def test_optimizer_readiness_on_cpu_reports_nothing_to_fix(scenario: Scenario) -> None:
    """CPU tensors are never copied by CUDA graphs: readiness gauges are zero, the label is the optimizer probe's."""
    assert {("SGD#0",): 0.0} == series(scenario.agent, "optimizer_nonstatic_grads")
    assert {("SGD#0",): 0.0} == series(scenario.agent, "optimizer_cpu_step_tensors")
    assert {} == series(scenario.agent, "optimizer_capturable")


def reset_fn(x: torch.Tensor) -> torch.Tensor:
    return x + 3


def test_dynamo_reset_mid_job_keeps_the_probe_working(scenario: Scenario) -> None:
    """After torch._dynamo.reset() (which clears compile callbacks) recompiles are still counted."""
    agent: Any = local_agent(("compile",))
    try:
        compiled = torch.compile(reset_fn, backend="eager")
        compiled(torch.randn(2))
        torch._dynamo.reset()
        callback = agent.probes["compile"]._start.callback
        assert callback not in dynamo_compat.callback_handler().start_callbacks
        compiled = torch.compile(reset_fn, backend="eager")
        compiled(torch.randn(2))
        compiled(torch.randn(5))
        agent.drain()
        assert 3.0 == agent.store.value("compile_frames_total", ("ok",))
        assert 1.0 == agent.store.value("recompiles_total", (_label(reset_fn), "tensor_size"))
        assert callback in dynamo_compat.callback_handler().start_callbacks  # re-added by the next compile
    finally:
        agent.shutdown()
    assert callback not in dynamo_compat.callback_handler().start_callbacks


def detach_fn(x: torch.Tensor) -> torch.Tensor:
    return x + 2


def test_records_queued_before_detach_keep_their_labels(scenario: Scenario) -> None:
    """The sender folds the last records in after detach: a limit hit still names its function.

    (It was labelled "? (?:?)" when detach had dropped the frame names first.)
    """
    agent: Any = local_agent(("compile",))
    try:
        with torch._dynamo.config.patch(recompile_limit=2):
            compiled = torch.compile(detach_fn, dynamic=False, backend="eager")
            compiled(torch.randn(1))
            compiled(torch.randn(2))  # a recompile, which names the frame
            agent.drain()  # the sender folded these in before the job detached
            compiled(torch.randn(3))  # the limit hit, whose record carries no code name
    finally:
        agent.shutdown()  # with the limit hit's record still queued
    agent.drain()
    assert {(_label(detach_fn),): 1.0} == series(agent, "recompile_limit_hits_total")
    assert {(_label(detach_fn), "tensor_size"): 1.0} == series(agent, "recompiles_total")


def fullgraph_fn(x: torch.Tensor) -> torch.Tensor:
    return x * 4


def test_fullgraph_recompile_limit_hit_is_counted_and_raised_unchanged(scenario: Scenario) -> None:
    """Under fullgraph=True a limit hit raises FailOnRecompileLimitHit into the job: a limit hit, not a recompile.

    (Its message, "Hard failure due to fullgraph=True", names no limit: it was counted as a tensor_size recompile.)
    """
    agent: Any = local_agent(("compile",))
    try:
        with torch._dynamo.config.patch(recompile_limit=1):
            compiled = torch.compile(fullgraph_fn, backend="eager", fullgraph=True, dynamic=False)
            compiled(torch.randn(1))
            with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit, match="fullgraph=True"):
                compiled(torch.randn(2))
        agent.drain()
    finally:
        agent.shutdown()
    assert {(_label(fullgraph_fn),): 1.0} == series(agent, "recompile_limit_hits_total")
    assert {} == series(agent, "recompiles_total")
    assert {("ok",): 1.0, ("failed",): 1.0} == series(agent, "compile_frames_total")


def early_fn(x: torch.Tensor) -> torch.Tensor:
    return x * 5


def test_limit_hit_of_a_function_compiled_before_attach_names_it(scenario: Scenario) -> None:
    """A probe attached to a running job names a limit hit by the frame's compiles before it (Dynamo's history).

    (It was labelled "? (?:?)": a limit hit carries no code name.)
    """
    with torch._dynamo.config.patch(recompile_limit=2):
        compiled = torch.compile(early_fn, backend="eager", dynamic=False)
        compiled(torch.randn(1))
        compiled(torch.randn(2))
        agent: Any = local_agent(("compile",))
        try:
            compiled(torch.randn(3))
            agent.drain()
        finally:
            agent.shutdown()
    assert {(_label(early_fn),): 1.0} == series(agent, "recompile_limit_hits_total")
