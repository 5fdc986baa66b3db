"""Node timing and logging against independent ground truth: deep graphs, threads, nested tensors."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from tests.probes.autograd.autograd_support import autograd_agent, events, node_values, passes
from torchpulse.limits import MAX_GRAPH_DEPTH
from torchpulse.probes.autograd.nodes import iter_graph, roots_of

ROOT = Path(__file__).resolve().parents[3]


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
            histogram = agent.store._histograms[("backward_duration_seconds", ("backward",))]
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
