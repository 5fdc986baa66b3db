"""Sampled per-node timing, on-demand autograd logging, and leak checks over many steps."""

from __future__ import annotations

import gc
import logging
import re
import statistics

import torch

from tests.probes.autograd.autograd_support import (
    autograd_agent,
    events,
    node_values,
    tiny_transformer,
)
from torchpulse.probes.autograd.nodes import format_grad_outputs, iter_graph, roots_of

# Node hooks time the nodes, not the engine between them: on this CPU model the
# nodes hold at least this share of a pass (measured 0.84-0.94 on an idle core).
# The median over passes absorbs a pass that lost the CPU between two nodes.
MIN_NODE_SHARE = 0.5


def test_sampled_pass_times_nodes_of_a_transformer_consistently_with_the_pass() -> None:
    """AddmmBackward0 and friends appear; node sums lie within [0.5, 1] of the pass time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with autograd_agent(sample_every="1") as agent:
            model = tiny_transformer(d_model=128)
            x = torch.randn(4, 32, 128)
            shares = []
            for _ in range(7):
                model(x).square().mean().backward()
                sample = agent.probes["autograd"].last_sample
                assert sample.node_seconds <= sample.seconds
                shares.append(sample.node_seconds / sample.seconds)
            assert statistics.median(shares) >= MIN_NODE_SHARE, shares
            seconds = node_values(agent, "autograd_node_seconds_total")
            calls = node_values(agent, "autograd_node_calls_total")
            assert {"AddmmBackward0", "NativeLayerNormBackward0", "AccumulateGrad"} <= set(seconds)
            graph = [node.name() for node in iter_graph(roots_of([model(x).mean()]))]
            assert 7 * graph.count("AddmmBackward0") == calls["AddmmBackward0"]
            assert 7 == agent.store.value("autograd_sampled_passes_total", ())
            histogram = agent.store._histograms[("backward_duration_seconds", ("backward",))]
            assert sum(seconds.values()) <= histogram.total
    finally:
        torch.set_num_threads(threads)


def test_slowest_nodes_of_the_last_sampled_pass_are_kept() -> None:
    """`last_sample` lists the slowest nodes, slowest first, with their sequence numbers."""
    with autograd_agent(sample_every="1", slowest_kept="5") as agent:
        model = tiny_transformer()
        model(torch.randn(2, 4, 32)).mean().backward()
        slowest = agent.probes["autograd"].last_sample.slowest
        assert 5 == len(slowest)
        assert [s.seconds for s in slowest] == sorted((s.seconds for s in slowest), reverse=True)
        assert all(s.sequence_nr >= 0 or s.name == "AccumulateGrad" for s in slowest)
        status = agent.probes["autograd"].status()
        assert [s.name for s in slowest] == [n for n, _, _ in status["last_sampled_pass"]["slowest"]]


def test_default_sampling_times_the_first_pass_then_every_hundredth() -> None:
    """Default sample_every=100: passes 0 and 100 of 150 are timed."""
    with autograd_agent() as agent:
        weight = torch.randn(4, requires_grad=True)
        for _ in range(150):
            (weight * 2).sum().backward()
        agent.drain()
        assert 2 == agent.store.value("autograd_sampled_passes_total", ())


def test_log_next_passes_emits_one_event_per_node_for_exactly_n_passes() -> None:
    """Two logged passes of a graph with K nodes give 2*K events, then none."""
    with autograd_agent() as agent:
        model = tiny_transformer()
        x = torch.randn(2, 4, 32)
        node_count = len(list(iter_graph(roots_of([model(x).mean()]))))
        agent.probes["autograd"].log_next_passes(2)
        for _ in range(4):
            model(x).mean().backward()
        agent.drain()
        logged = events(agent, "autograd.node")
        assert 2 * node_count == len(logged)
        assert {0, 1} == {e["pass_index"] for e in logged}
        first = logged[0]
        assert ("MeanBackward0", "[f32[]]") == (first["node"], first["grad_outputs"])
        addmm = next(e for e in logged if e["node"] == "AddmmBackward0")
        assert re.fullmatch(r"\[f32\[\d+(, \d+)*\]\]", str(addmm["grad_outputs"]))
        assert all(float(e["seconds"]) >= 0 for e in logged)


def test_logging_defers_to_torch_when_its_own_debug_hooks_are_on() -> None:
    """With the torch.autograd.graph logger at DEBUG, no second set of hooks: one note instead."""
    logger = logging.getLogger("torch.autograd.graph")
    level, propagate = logger.level, logger.propagate
    handler = logging.NullHandler()
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        with autograd_agent(log_passes="2") as agent:
            weight = torch.randn(4, requires_grad=True)
            for _ in range(2):
                (weight * 2).sum().backward()
            agent.drain()
            assert [] == events(agent, "autograd.node")
            assert 1 == len(events(agent, "autograd.logging_deferred"))
    finally:
        logger.setLevel(level)
        logger.propagate = propagate
        logger.removeHandler(handler)


def test_format_matches_torch_logging_notation() -> None:
    """`f32[8, 128, 256]` and `None`, as torch's logging hooks print them."""
    shapes = [(torch.float32, (8, 128, 256)), None, (torch.bfloat16, ())]
    assert "[f32[8, 128, 256],None,bf16[]]" == format_grad_outputs(shapes)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_timing_without_the_nonfinite_check_keeps_no_reference_per_pass() -> None:
    """With nonfinite off nothing prunes the check's list: timed passes must not fill it with
    a dead reference to each step's input leaf."""
    with autograd_agent(sample_every="1", nonfinite="0") as agent:
        weight = torch.nn.Parameter(torch.ones(4))
        for _ in range(20):
            (weight * torch.randn(4, requires_grad=True)).sum().backward()
        assert 0 == agent.probes["autograd"].status()["parameters_checked"]


def test_memory_stays_flat_over_a_thousand_steps() -> None:
    """Sampling every other pass for 1,000 steps leaves no objects behind."""
    with autograd_agent(sample_every="2") as agent:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(4, 8)
        for _ in range(100):
            _step(model, optimizer, x)
        agent.drain()
        gc.collect()
        before = len(gc.get_objects())
        for index in range(1000):
            _step(model, optimizer, x)
            if index % 100 == 0:
                agent.drain()
        agent.drain()
        gc.collect()
        grown = len(gc.get_objects()) - before
        assert grown < 50, grown
        assert 1100 == agent.store.value("backward_passes_total", ("backward",))
        assert 550 == agent.store.value("autograd_sampled_passes_total", ())


def test_accumulate_grad_nodes_report_sequence_number_minus_one() -> None:
    """torch gives AccumulateGrad UINT64_MAX for "no sequence number", which a JSON reader (doubles)
    turns into another number: it is reported as -1, every other node by its real number."""
    with autograd_agent(sample_every="1", slowest_kept="100") as agent:
        model = torch.nn.Linear(3, 2)
        model(torch.randn(4, 3)).sum().backward()
        numbers = {s.name: s.sequence_nr for s in agent.probes["autograd"].last_sample.slowest}
        assert (-1, True) == (numbers["AccumulateGrad"], 0 <= numbers["AddmmBackward0"] < 1 << 53)
