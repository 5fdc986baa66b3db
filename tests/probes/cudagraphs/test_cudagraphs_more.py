"""CUDA-graph probe on CPU: readiness of every kind of CPU optimizer, labels across a re-install, and
`reduce-overhead` skips across `torch._dynamo.reset()`."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch._dynamo

from tests.support import local_agent
from torchpulse.probes.torch_compat import dynamo as dynamo_compat
from torchpulse.protocol import Command


def _series(agent: Any, family: str) -> dict[tuple[str, ...], float]:
    return {labels: value for (name, labels), value in agent.store._values.items() if name == family}


def test_a_disabled_and_enabled_probe_keeps_the_optimizer_label() -> None:
    """Without the optimizer probe, a re-install of the cudagraphs probe keeps a live optimizer's one series."""
    agent: Any = local_agent(("cudagraphs",), optimizer_state_every=1)
    optimizer = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)
    try:
        optimizer.step()
        for number, name in enumerate(("disable", "enable"), start=1):
            agent.control.receive(Command(number, name, {"probe": "cudagraphs"}))
            optimizer.step()
        optimizer.step()
        agent.drain()
        assert [True, True] == [result.ok for result in agent.control.results]
        assert {("SGD#0",): 0.0} == _series(agent, "optimizer_nonstatic_grads")
    finally:
        agent.shutdown()


def test_cpu_optimizers_of_every_kind_have_nothing_to_fix() -> None:
    """SGD, Adam (foreach, fused), AdamW with a group added later, LBFGS, SparseAdam and an optimizer
    without grads, with grads replaced or kept: zero gauges, no capturable series, no hint."""
    agent: Any = local_agent(("optimizer", "cudagraphs"), optimizer_state_every=1)
    model = torch.nn.Linear(3, 2)
    embedding = torch.nn.Embedding(4, 2, sparse=True)
    extra = torch.nn.Parameter(torch.zeros(3))
    groups: list[dict[str, Any]] = [{"params": [model.weight]}, {"params": [model.bias], "lr": 0.01}]
    adamw = torch.optim.AdamW(groups)
    adamw.add_param_group({"params": [extra]})
    optimizers = [
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        torch.optim.Adam(model.parameters(), foreach=True),
        torch.optim.Adam(model.parameters(), fused=True),
        adamw,
        torch.optim.LBFGS(model.parameters()),
        torch.optim.SparseAdam(embedding.parameters()),
        torch.optim.Adam([torch.nn.Parameter(torch.ones(1))]),
    ]

    def loss() -> float:
        value = model(torch.ones(2, 3)).sum() + embedding(torch.tensor([1])).sum()
        value.backward()
        return float(value.detach())

    try:
        for step in range(3):
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=step % 2 == 0)
                optimizer.step(loss)  # every kind takes a closure; LBFGS needs one
        agent.drain()
        labels = [agent.probes["optimizer"]._tracked[optimizer].label for optimizer in optimizers]
        zeros = {(label,): 0.0 for label in labels}
        gauges = ("optimizer_nonstatic_grads", "optimizer_moving_grads", "optimizer_cpu_step_tensors")
        assert [zeros, zeros, zeros, {}] == [_series(agent, family) for family in (*gauges, "optimizer_capturable")]
        assert [] == [event.event for event in agent._events if "CUDA graphs" in event.event]
    finally:
        agent.shutdown()


@pytest.mark.process
def test_reduce_overhead_on_cpu_is_one_skip_per_compile_also_after_dynamo_reset() -> None:
    """A forward and its lazily compiled backward are one cpu_device skip, as torch counts, again after a reset."""
    agent: Any = local_agent(("cudagraphs",), optimizer_state_every=1)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = dynamo_compat.dynamo_counter("inductor", "cudagraph_skips")
    try:
        for _ in range(2):
            compiled = torch.compile(model, mode="reduce-overhead")
            for _ in range(2):
                compiled(torch.ones(1, 2)).sum().backward()
                optimizer.step()
            torch._dynamo.reset()
        agent.drain()
        assert 2 == dynamo_compat.dynamo_counter("inductor", "cudagraph_skips") - before
        assert {("cpu_device",): 2.0} == {
            labels: value for labels, value in _series(agent, "cudagraph_skips_total").items() if value
        }
    finally:
        agent.shutdown()


def test_an_optimizer_first_seen_while_the_optimizer_probe_is_off_gets_one_label_from_both() -> None:
    """Optimizer B steps first while the optimizer probe is disabled: both probes call it SGD#1 (the CUDA-graph
    probe's own numbering called it SGD#0, the label of optimizer A, so both wrote one series)."""
    agent: Any = local_agent(("optimizer", "cudagraphs"), optimizer_state_every=1)
    try:
        first = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
        _step(first)
        agent.probes["optimizer"].enabled = False
        second = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
        _step(second)
        agent.probes["optimizer"].enabled = True
        _step(second)
        agent.drain()
        steps = {labels[0] for (name, labels) in agent.store._values if name == "optimizer_steps_total"}
        readiness = sorted(labels[0] for (name, labels) in agent.store._values if name == "optimizer_nonstatic_grads")
        assert ({"SGD#0", "SGD#1"}, ["SGD#0", "SGD#1"]) == (steps, readiness)
    finally:
        agent.shutdown()


def _step(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.ones_like(param)
    optimizer.step()
