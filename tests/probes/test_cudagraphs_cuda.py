"""CUDA-graph probe paths that need a GPU: recordings, re-recordings, mutated-input skips, pools, readiness."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.support import local_agent
from torchpulse.probes import torch_features as tf

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _series(agent: Any, family: str) -> dict[tuple[str, ...], float]:
    return {labels: value for (name, labels), value in agent.store._values.items() if name == family}


@pytest.fixture(scope="module")
def agent() -> Iterator[Any]:
    """One agent for the module; one tiny CUDA model compiled with reduce-overhead."""
    probe_agent: Any = local_agent(("optimizer", "compile", "cudagraphs"), optimizer_state_every=1)
    yield probe_agent
    probe_agent.shutdown()


def test_recordings_pool_and_readiness(agent: Any) -> None:
    """A CUDA-graphed training loop records, fills a pool, and reports a non-capturable Adam."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8, device="cuda")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=False)
    compiled = torch.compile(model, mode="reduce-overhead")
    for _ in range(4):
        compiled(torch.randn(4, 8, device="cuda")).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    agent.drain()
    assert (agent.store.value("cudagraph_recordings_total") or 0) >= 1
    assert ("cudagraph_recording_duration_seconds", ()) in agent.store._histograms
    assert (agent.store.value("cudagraph_warmups_total") or 0) >= 1
    assert (agent.store.value("cudagraph_trees") or 0) >= 1
    assert (agent.store.value("cudagraph_nodes") or 0) >= 1
    assert (agent.store.value("cudagraph_pool_bytes") or 0) > 0
    assert {("Adam#0", "0"): 0.0} == _series(agent, "optimizer_capturable")
    assert {("Adam#0",): 2.0} == _series(agent, "optimizer_cpu_step_tensors")  # weight and bias
    assert {("Adam#0",): 2.0} == _series(agent, "optimizer_nonstatic_grads")


def test_mutated_input_skip_is_classified(agent: Any) -> None:
    """A graph that mutates a non-static input skips CUDA graphs; counted as mutated_inputs like torch counts it."""
    before = tf.dynamo_counter("inductor", "cudagraph_skips")
    already = agent.store.value("cudagraph_skips_total", ("mutated_inputs",)) or 0.0

    def mutate(x: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        return x * 2

    compiled = torch.compile(mutate, mode="reduce-overhead")
    for _ in range(3):
        compiled(torch.randn(4, device="cuda"))
    torch.optim.SGD([torch.zeros(1, device="cuda", requires_grad=True)], lr=0.1).step()  # poll point
    agent.drain()
    skipped = tf.dynamo_counter("inductor", "cudagraph_skips") - before
    assert skipped >= 1
    assert float(skipped) == (agent.store.value("cudagraph_skips_total", ("mutated_inputs",)) or 0.0) - already


def test_new_dynamic_shape_is_a_rerecord(agent: Any) -> None:
    """A dynamic graph recorded for a second size counts a new_dynamic_shape re-recording."""
    def scale(x: torch.Tensor) -> torch.Tensor:
        return x * 3

    compiled = torch.compile(scale, mode="reduce-overhead", dynamic=True)
    for n in (4, 4, 4, 6, 6, 6):
        compiled(torch.randn(n, device="cuda"))
    agent.drain()
    assert (agent.store.value("cudagraph_rerecords_total", ("new_dynamic_shape",)) or 0) >= 1
