"""CUDA-graph probe paths that need a GPU: recordings, re-recordings, mutated-input skips, pools, readiness.

Where torch's behaviour decides a number (how many graphs were recorded, which grads Dynamo treats as
static), the expected value is read from torch's own state after the run, so a test checks the probe
against torch 2.13 instead of against a guess; each test also asserts that the scenario produced
something to count.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from tests.support import histogram_series, local_agent, series
from torchpulse.probes.compile.logtap import LogTap
from torchpulse.probes.torch_compat import cudagraph_trees as trees_compat
from torchpulse.probes.torch_compat import dynamo as dynamo_compat

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

Series = dict[tuple[str, ...], float]


def _grown(agent: Any, family: str, before: Series) -> Series:
    """The series of a counter family that grew since `before`, by how much."""
    now = series(agent, family)
    return {
        labels: value - before.get(labels, 0.0) for labels, value in now.items() if value != before.get(labels, 0.0)
    }


def _value(agent: Any, family: str) -> float:
    return float(agent.store.value(family) or 0.0)


def _trees() -> tuple[int, int, int, int]:
    """From the training thread's tree managers: (trees, nodes, siblings recorded again, functions warmed up).

    A recording adds one node; a re-recording adds a sibling for the same function under the same parent.
    Both tables are defaultdicts that torch's lookups fill with empty lists.
    """
    trees = nodes = again = warmed = 0
    for manager in trees_compat.tree_managers():
        warmed += len(manager.warmed_up_functions)
        for siblings in manager.roots.values():
            trees += len(siblings)
            nodes += sum(1 + root.num_descendants() for root in siblings)
            again += max(len(siblings) - 1, 0)
        pending = [node for siblings in manager.roots.values() for node in siblings]
        while pending:
            node = pending.pop()
            for children in node.children.values():
                again += max(len(children) - 1, 0)
                pending.extend(children)
    return trees, nodes, again, warmed


def _pool_bytes() -> int:
    from torch._inductor.cudagraph_trees import get_cudagraph_segments

    return sum(
        int(segment["total_size"])
        for manager in trees_compat.tree_managers()
        for segment in get_cudagraph_segments(manager.cuda_graphs_thread_pool)
    )


def _label(agent: Any, optimizer: torch.optim.Optimizer) -> str:
    return str(agent.probes["optimizer"]._tracked[optimizer].label)


@pytest.fixture(scope="module")
def agent() -> Iterator[Any]:
    """One agent for the module, readiness and trees read at every optimizer step."""
    probe_agent: Any = local_agent(("optimizer", "compile", "cudagraphs"), optimizer_state_every=1)
    yield probe_agent
    probe_agent.shutdown()


def test_recordings_warmups_trees_and_pool_match_torchs_trees(agent: Any) -> None:
    """A CUDA-graphed training loop: every recording, warm-up, tree and pool byte the manager holds is counted."""
    torch.manual_seed(0)
    trees0, nodes0, _, warmed0 = _trees()
    recordings0, warmups0 = _value(agent, "cudagraph_recordings_total"), _value(agent, "cudagraph_warmups_total")
    model = torch.nn.Linear(8, 8, device="cuda")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    compiled = torch.compile(model, mode="reduce-overhead")
    for _ in range(4):
        optimizer.zero_grad(set_to_none=True)
        compiled(torch.randn(4, 8, device="cuda")).sum().backward()
        optimizer.step()
    agent.probes["cudagraphs"]._trees.dirty = True  # read the trees again at the next step, to compare now
    optimizer.step()
    agent.drain()
    trees, nodes, _, warmed = _trees()
    assert nodes - nodes0 >= 2  # forward and backward recorded
    assert (float(trees), float(nodes)) == (_value(agent, "cudagraph_trees"), _value(agent, "cudagraph_nodes"))
    assert float(nodes - nodes0) == _value(agent, "cudagraph_recordings_total") - recordings0
    durations = histogram_series(agent, "cudagraph_recording_duration_seconds")[()]
    assert _value(agent, "cudagraph_recordings_total") == float(sum(durations.bucket_counts))
    assert warmed - warmed0 >= 2
    assert float(warmed - warmed0) == _value(agent, "cudagraph_warmups_total") - warmups0
    assert trees - trees0 >= 1
    pool = _pool_bytes()
    assert pool > 0
    assert float(pool) == agent.store.value("cudagraph_pool_bytes")


def test_readiness_counts_what_dynamo_would_find(agent: Any) -> None:
    """Non-static grads exactly as Dynamo's `_is_static_for_cudagraphs` judges them, moved grads, CPU `step`
    tensors and `capturable` of CUDA groups only, for an optimizer over CUDA-graphed, eager and CPU params."""
    from torch._dynamo.variables.optimizer import _is_static_for_cudagraphs

    torch.manual_seed(0)
    graphed = torch.nn.Linear(8, 8, device="cuda")
    eager = torch.nn.Linear(8, 8, device="cuda")  # grads from the caching allocator: never static
    on_cpu = torch.zeros(3, requires_grad=True)
    compiled = torch.compile(graphed, mode="reduce-overhead")
    optimizer = torch.optim.Adam(
        [{"params": graphed.parameters()}, {"params": eager.parameters()}, {"params": [on_cpu]}],
        lr=1e-3,
        capturable=False,
    )
    cuda_params = [*graphed.parameters(), *eager.parameters()]
    held: list[Any] = []
    addresses: list[list[int]] = []
    for _ in range(4):
        held = [p.grad for p in eager.parameters()]  # alive while the next grads are made: they move
        optimizer.zero_grad(set_to_none=True)
        x = torch.randn(4, 8, device="cuda")
        (compiled(x).sum() + eager(x).sum() + on_cpu.sum().cuda()).backward()
        addresses.append([p.grad.data_ptr() for p in cuda_params])  # type: ignore[union-attr]
        optimizer.step()
    agent.drain()
    del held
    label = _label(agent, optimizer)
    # The probe measured in the last step's post-hook; nothing ran on the GPU since.
    nonstatic = sum(not _is_static_for_cudagraphs(p.grad) for p in cuda_params)  # type: ignore[arg-type]
    moved = sum(before != after for before, after in zip(addresses[-2], addresses[-1], strict=True))
    assert nonstatic >= 2 and moved >= 2  # at least the eager model's weight and bias
    assert {(label,): float(nonstatic)} == series(agent, "optimizer_nonstatic_grads", label)
    assert {(label,): float(moved)} == series(agent, "optimizer_moving_grads", label)
    # Adam without capturable keeps `step` on the CPU; the CPU param's own step is not a hazard.
    assert {(label,): 4.0} == series(agent, "optimizer_cpu_step_tensors", label)
    assert {(label, "0"): 0.0, (label, "1"): 0.0} == series(agent, "optimizer_capturable", label)


def test_mutated_input_skip_is_classified(agent: Any) -> None:
    """A graph that mutates a non-static input skips CUDA graphs; counted as mutated_inputs like torch counts it."""
    before = dynamo_compat.dynamo_counter("inductor", "cudagraph_skips")
    skips = series(agent, "cudagraph_skips_total")

    def mutate(x: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        return x * 2

    compiled = torch.compile(mutate, mode="reduce-overhead")
    for _ in range(3):
        compiled(torch.randn(4, device="cuda"))
    torch.optim.SGD([torch.zeros(1, device="cuda", requires_grad=True)], lr=0.1).step()  # poll point
    agent.drain()
    skipped = dynamo_compat.dynamo_counter("inductor", "cudagraph_skips") - before
    assert skipped >= 1
    assert {("mutated_inputs",): float(skipped)} == _grown(agent, "cudagraph_skips_total", skips)


def _symint_lines() -> tuple[list[str], LogTap]:
    """Every "symint key" line of the tree module, seen next to the probe's own tap."""
    lines: list[str] = []

    def sink(record: logging.LogRecord) -> None:
        if trees_compat.TREES_SYMINT_RECORDING in str(record.msg):
            lines.append(record.getMessage())

    return lines, LogTap(trees_compat.CUDAGRAPH_TREES_LOGGER, logging.INFO, sink)


def _assert_second_sizes_rerecord_once_per_graph(agent: Any, run_size: Callable[[int], object]) -> None:
    """Run three calls of size 4, then three of size 6: every graph with symint inputs logs one "symint key"
    line per size, and only its second size counts as a new_dynamic_shape re-recording."""
    rerecords = series(agent, "cudagraph_rerecords_total")
    lines, tap = _symint_lines()
    try:
        for n in (4, 4, 4, 6, 6, 6):
            run_size(n)
    finally:
        tap.remove()
    agent.drain()
    graphs = len(lines) // 2
    assert graphs >= 1 and 2 * graphs == len(lines)
    assert {("new_dynamic_shape",): float(graphs)} == _grown(agent, "cudagraph_rerecords_total", rerecords)


def test_new_dynamic_shape_is_a_rerecord(agent: Any) -> None:
    """A dynamic graph recorded for a second size counts one new_dynamic_shape re-recording."""

    def scale(x: torch.Tensor) -> torch.Tensor:
        return x * 3

    compiled = torch.compile(scale, mode="reduce-overhead", dynamic=True)
    _assert_second_sizes_rerecord_once_per_graph(agent, lambda n: compiled(torch.randn(n, device="cuda")))


def test_forward_and_backward_new_shapes_count_once_per_graph(agent: Any) -> None:
    """Forward and backward share a compile id: each graph's first size is a first recording, its second a
    re-recording (counted by compile id, the backward's first size was a re-recording)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8, device="cuda")
    compiled = torch.compile(model, mode="reduce-overhead", dynamic=True)

    def train_step(n: int) -> None:
        model.zero_grad(set_to_none=True)
        compiled(torch.randn(n, 8, device="cuda")).sum().backward()

    _assert_second_sizes_rerecord_once_per_graph(agent, train_step)


def test_alternating_parameter_storage_is_one_rerecord(agent: Any) -> None:
    """Swapping a parameter's storage back and forth re-records once; later calls replay one of the two
    graphs although torch logs a failed check for the other each time."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8, device="cuda")
    compiled = torch.compile(model, mode="reduce-overhead")
    first = model.weight.data
    second = first.clone()
    x = torch.randn(4, 8, device="cuda")
    rerecords = series(agent, "cudagraph_rerecords_total")
    _, _, again0, _ = _trees()
    with torch.no_grad():
        for weight in (first, first, first, second, first, second, first, second):
            model.weight.data = weight
            compiled(x)  # the output dies at once: the next call starts at the roots again
    agent.drain()
    _, _, again, _ = _trees()
    assert again - again0 >= 1
    grown = _grown(agent, "cudagraph_rerecords_total", rerecords)
    assert float(again - again0) == sum(grown.values())
    assert {"static_input_changed"} == {labels[0] for labels in grown}


def test_dynamo_reset_empties_the_tree_gauges(agent: Any) -> None:
    """torch._dynamo.reset() drops the tree managers and their pools: the gauges follow at the next step."""

    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    compiled = torch.compile(double, mode="reduce-overhead")
    for _ in range(3):
        compiled(torch.randn(4, device="cuda"))
    poll = torch.optim.SGD([torch.zeros(1, device="cuda", requires_grad=True)], lr=0.1)
    poll.step()
    agent.drain()
    assert _value(agent, "cudagraph_nodes") > 0 and _value(agent, "cudagraph_pool_bytes") > 0
    torch._dynamo.reset()
    poll.step()
    agent.drain()
    assert (0.0, 0.0, 0.0) == (
        _value(agent, "cudagraph_trees"),
        _value(agent, "cudagraph_nodes"),
        _value(agent, "cudagraph_pool_bytes"),
    )
