"""Sampled per-node timing, on-demand autograd logging, and leak checks over many steps; node timing and logging
against independent ground truth: deep graphs, threads, nested tensors."""

from __future__ import annotations

import gc
import logging
import re
import statistics
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from tests.probes.autograd.autograd_support import (
    autograd_agent,
    events,
    node_values,
    passes,
    tiny_transformer,
)
from tests.support import histogram_series
from torchpulse.limits import MAX_GRAPH_DEPTH
from torchpulse.probes.autograd.nodes import format_grad_outputs, iter_graph, roots_of

# Node hooks time the nodes, not the engine between them: on this CPU model the
# nodes hold at least this share of a pass (measured 0.84-0.94 on an idle core).
# The median over passes absorbs a pass that lost the CPU between two nodes.
MIN_NODE_SHARE = 0.5
ROOT = Path(__file__).resolve().parents[3]


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
            histogram = histogram_series(agent, "backward_duration_seconds")[("backward",)]
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


@pytest.mark.process
def test_a_chain_deeper_than_the_walk_trains_on_and_is_walked_to_the_limit_only() -> None:
    """A 50,000-deep graph (a long unrolled recurrence) freed after a walked pass overflowed the
    stack in torch 2.13 (its nodes keep the Python objects a walk made): the job must live, and
    the walk stop at MAX_GRAPH_DEPTH with one warning."""
    script = textwrap.dedent("""
        import torch
        from tests.probes.autograd.autograd_support import autograd_agent, events
        with autograd_agent(sample_every="1", slowest_kept="20000") as agent:
            weight = torch.ones(4, requires_grad=True)
            for _ in range(2):
                y = weight
                for _ in range(50_000):
                    y = y * 1.0
                loss = y.sum()
                loss.backward()
                del loss, y
            sample = agent.probes["autograd"].last_sample
            calls = len(sample.slowest)
            print(calls, len(events(agent, "autograd.graph_too_deep")), weight.grad[0].item())
    """)
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert (0, f"{MAX_GRAPH_DEPTH} 1 2.0") == (done.returncode, done.stdout.strip()), done.stderr[-2000:]


def test_iter_graph_stops_at_max_depth_and_says_so_once() -> None:
    """A 5-deep chain walked 3 levels deep yields the first 3 nodes and calls on_cut once."""
    weight = torch.ones(2, requires_grad=True)
    loss = (weight * 2).exp().neg().sum()  # Sum, Neg, Exp, Mul, AccumulateGrad
    cuts: list[int] = []
    names = [node.name() for node in iter_graph(roots_of([loss]), max_depth=3, on_cut=lambda: cuts.append(1))]
    full = [node.name() for node in iter_graph(roots_of([loss]), max_depth=5, on_cut=lambda: cuts.append(2))]
    assert (["SumBackward0", "NegBackward0", "ExpBackward0"], [1]) == (names, cuts)
    assert ["SumBackward0", "NegBackward0", "ExpBackward0", "MulBackward0", "torch::autograd::AccumulateGrad"] == full


def test_two_threads_training_one_model_each_time_only_their_own_pass() -> None:
    """Hooks on shared AccumulateGrad nodes see the other thread's pass too: counting its executions
    inflated calls, and a post-hook without this pass's pre-hook timed a node from the clock's origin."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with autograd_agent(sample_every="1") as agent:
            torch.manual_seed(0)
            model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(10)])
            x = torch.randn(8, 32)
            barrier = threading.Barrier(2)

            def train() -> None:
                barrier.wait()
                for _ in range(20):
                    model(x).sum().backward()

            workers = [threading.Thread(target=train) for _ in range(2)]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()
            calls = node_values(agent, "autograd_node_calls_total")
            seconds = node_values(agent, "autograd_node_seconds_total")
            histogram = histogram_series(agent, "backward_duration_seconds")[("backward",)]
            assert 40 == passes(agent, "backward") == agent.store.value("autograd_sampled_passes_total", ())
            assert {
                "AccumulateGrad": 40 * 20,
                "AddmmBackward0": 40 * 10,
                "TBackward0": 40 * 10,
                "SumBackward0": 40,
            } == calls
            assert sum(seconds.values()) <= histogram.total
    finally:
        torch.set_num_threads(threads)


def test_a_parameter_used_inside_and_outside_a_reentrant_checkpoint_is_one_call_per_pass() -> None:
    """The inner pass of a reentrant checkpoint runs the shared AccumulateGrad too: its time is the
    checkpoint node's, so the outer pass counts that node once, as torch runs it once in its task."""
    with autograd_agent(sample_every="1") as agent:
        layer = torch.nn.Linear(4, 4)
        x = torch.randn(2, 4)
        for _ in range(3):
            checkpoint(layer, layer(x), use_reentrant=True).sum().backward()
        calls = node_values(agent, "autograd_node_calls_total")
        assert (3 * 2, 3) == (calls["AccumulateGrad"], calls["CheckpointFunctionBackward"])


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_a_strided_nested_tensor_gradient_is_logged_and_leaves_the_probe_on() -> None:
    """A strided nested tensor has no `shape` (torch's own logging hooks fail the pass on it): its
    irregular size reads `?`, the pass is logged in full, and the probe stays on."""
    with autograd_agent() as agent:
        agent.probes["autograd"].log_next_passes(1)
        a, b = torch.ones(2, 3, requires_grad=True), torch.ones(4, 3, requires_grad=True)
        nested = torch.nested.as_nested_tensor([a, b])
        torch.nested.to_padded_tensor(nested * 2, 0.0).sum().backward()
        agent.drain()
        logged = [(e["node"], e["grad_outputs"]) for e in events(agent, "autograd.node")]
        assert [
            ("SumBackward0", "[f32[]]"),
            ("ToPaddedTensorBackward0", "[f32[2, 4, 3]]"),
            ("MulBackward0", "[f32[2, ?, 3]]"),
            ("NestedTensorFromTensorListBackward0", "[f32[2, ?, 3]]"),
            ("AccumulateGrad", "[f32[2, 3]]"),
            ("AccumulateGrad", "[f32[4, 3]]"),
        ] == logged
        assert agent.probes["autograd"].enabled
        assert b.grad is not None and torch.equal(torch.full((4, 3), 2.0), b.grad)


def test_a_logged_pass_larger_than_one_flush_is_delivered_whole_over_several() -> None:
    """`ctl autograd-log` of a model with more nodes than one flush carries (2,048 events): every node's event
    reaches the sender over the next flushes, behind the job's own events, none dropped (before: 2,048 of them)."""
    with autograd_agent() as agent:
        weight = torch.ones(4, requires_grad=True)
        agent.probes["autograd"].log_next_passes(1)
        y = weight
        for _ in range(2_999):
            y = y * 1.0
        y.sum().backward()
        agent.drain()
        agent.emit("warning", "job.own_event")
        limit = agent.config.max_pending_events
        flushes = []
        while batch := agent.take_events(limit):
            flushes.append([e.event for e in batch])
        agent.drain()
        dropped = agent.store.value("agent_events_dropped_total", ("events_overflow",))
        nodes = [event for flush in flushes for event in flush if event == "autograd.node"]
        assert ([limit, 3_002 - limit], "job.own_event", 3_001, 0) == (
            [len(f) for f in flushes],
            flushes[0][0],
            len(nodes),
            dropped,
        )
