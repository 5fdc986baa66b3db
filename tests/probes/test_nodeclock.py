"""The C node-timing hooks (`_nodeclock`) against the Python hooks they replace on the same graphs."""

from __future__ import annotations

import gc
import logging
import sys
import threading
from typing import Any

import pytest
import torch

from tests.probes.autograd_support import autograd_agent, timing_hooks, tiny_transformer
from torchpulse.probes.autograd_nodes import PassTimer, PassTiming, _nodeclock, node_type, roots_of

pytestmark = pytest.mark.skipif(_nodeclock is None, reason="the C module _nodeclock was not built")


def _timed_pass(kind: str, model: torch.nn.Module, x: torch.Tensor) -> tuple[int, PassTiming]:
    """(nodes hooked, what the timer found) for one pass of `model` timed by that kind of hooks."""
    with timing_hooks(kind):
        loss = model(x).square().mean()
        timer = PassTimer(roots_of([loss]), detailed=False, on_parameter=lambda _param: None)
        assert (kind == "c") == (timer._clock is not None)
        loss.backward()
        return timer.node_count, timer.finish(slowest_kept=1000)


def _calls_by_type(timing: PassTiming) -> dict[str, int]:
    return {name: calls for name, calls, _seconds in timing.totals}


def test_the_c_hooks_count_what_the_python_hooks_count_and_time_every_node_they_count() -> None:
    """A small transformer (more nodes than the clock's first 64 slots): the same calls per node type
    from both kinds of hooks, every counted node has a positive time, and the sum fits in the pass."""
    model, x = tiny_transformer(), torch.randn(2, 8, 32)
    _nodes, python = _timed_pass("python", model, x)
    model.zero_grad(set_to_none=True)
    nodes, native = _timed_pass("c", model, x)
    assert nodes > 64
    assert _calls_by_type(python) == _calls_by_type(native)
    assert "AddmmBackward0" in _calls_by_type(native)
    assert all(node.seconds > 0 for node in native.slowest)
    assert nodes == len(native.slowest) == sum(_calls_by_type(native).values())
    assert native.node_seconds == pytest.approx(sum(seconds for _, _, seconds in native.totals))


def test_the_c_hooks_leave_gradients_as_they_are_and_leave_no_hook_behind() -> None:
    """Gradients with and without the hooks are identical; after finish() no hook is left on any
    node (each hook holds its clock: the clock's references come back to what the timer holds)."""
    model, x = tiny_transformer(), torch.randn(2, 8, 32)
    model(x).square().mean().backward()
    expected = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    with timing_hooks("c"):
        timer = PassTimer(roots_of([loss]), detailed=False, on_parameter=lambda _param: None)
    clock = timer._clock
    held = 3  # timer._clock, `clock`, getrefcount's argument
    assert held + 2 * timer.node_count == sys.getrefcount(clock)
    loss.backward(retain_graph=True)
    timer.finish(slowest_kept=1)
    gc.collect()
    assert held == sys.getrefcount(clock)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(expected) == len(grads)
    assert all(torch.equal(e, g) for e, g in zip(expected, grads, strict=True))


def test_a_failing_task_lookup_is_kept_as_the_error_and_never_raised_into_the_pass() -> None:
    """The first error is kept (later ones are not), the pass finishes, and nothing is counted."""
    failures = iter(range(1000))

    def broken_task_id() -> int:
        raise RuntimeError(f"lookup {next(failures)} failed")

    assert _nodeclock is not None
    weight = torch.ones(3, requires_grad=True)
    loss = (weight * 2).exp().sum()
    timer = PassTimer(roots_of([loss]), detailed=False, on_parameter=lambda _param: None)
    timer._clock = clock = _nodeclock.Clock(timer._roots, broken_task_id)
    for _index in range(timer.node_count):
        clock.add()
    hooks = [(node.register_prehook(clock.prehook(i)), node.register_hook(clock.posthook(i)))
             for i, node in enumerate(timer._nodes)]
    loss.backward()
    for pre, post in hooks:
        pre.remove()
        post.remove()
    assert torch.equal(2 * torch.exp(weight * 2), weight.grad)
    assert isinstance(timer.error, RuntimeError) and "lookup 0 failed" == str(timer.error)
    assert () == timer.finish(slowest_kept=5).totals


def test_hooks_of_a_task_that_ran_no_root_first_are_ignored() -> None:
    """A non-root node whose pre-hook runs first (another task) starts nothing; post-hooks without
    the pass's own task count nothing; the own task's hooks count once each."""
    assert _nodeclock is not None
    tasks = [7]
    clock = _nodeclock.Clock(1, lambda: tasks[0])
    root, child = clock.add(), clock.add()
    pre_root, post_root = clock.prehook(root), clock.posthook(root)
    pre_child, post_child = clock.prehook(child), clock.posthook(child)
    assert None is pre_child(())  # a non-root first: another pass
    assert None is post_child((), ())
    assert ([0, 0], [0.0, 0.0]) == clock.totals()
    pre_root(()), post_root((), ())
    tasks[0] = 8  # another task through the same child
    pre_child(()), post_child((), ())
    tasks[0] = 7
    pre_child(()), post_child((), ())
    calls, seconds = clock.totals()
    assert [1, 1] == calls and all(s >= 0 for s in seconds)
    assert clock.error is None


def test_hook_indices_are_checked_and_the_clock_accepts_calls_from_any_thread() -> None:
    """No hook for a slot that was never added; hooks called from another thread are counted in
    that thread's task only (torch's graph task id is per thread outside a pass: -1)."""
    assert _nodeclock is not None
    clock = _nodeclock.Clock(1, torch._C._current_graph_task_id)
    with pytest.raises(IndexError):
        clock.prehook(0)
    index = clock.add()
    pre, post = clock.prehook(index), clock.posthook(index)
    results: list[Any] = []
    worker = threading.Thread(target=lambda: results.extend([pre(()), post((), ())]))
    worker.start()
    worker.join()
    assert [None, None] == results
    assert ([1], ) == clock.totals()[:1]
    with pytest.raises(TypeError):
        _nodeclock.Clock(1, "not callable")


def test_node_types_of_the_c_timing_are_named_as_torch_names_them() -> None:
    """The labels come from the nodes (C++ and Python nodes alike), not from the hooks."""
    weight = torch.ones(3, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(lambda w: (w * 2).exp(), weight, use_reentrant=True).sum()
    with timing_hooks("c"):
        timer = PassTimer(roots_of([out]), detailed=False, on_parameter=lambda _param: None)
    out.backward()
    names = {name for name, _calls, _seconds in timer.finish(slowest_kept=1).totals}
    assert {"SumBackward0", "CheckpointFunctionBackward", "AccumulateGrad"} == names
    assert "CheckpointFunctionBackward" == node_type(out.grad_fn.next_functions[0][0])  # type: ignore[union-attr]


@pytest.mark.parametrize("hooks", ["c", "python"])
def test_status_says_what_times_the_nodes_and_the_python_hooks_are_logged_once_at_install(
        hooks: str, caplog: pytest.LogCaptureFixture) -> None:
    """`torchpulse status` names the hooks; a probe installed without the C module says why, once."""
    caplog.set_level(logging.INFO, logger="torchpulse")
    with timing_hooks(hooks), autograd_agent() as agent:
        status = agent.probes["autograd"].status()["node_timing"]
    slower = [r.getMessage() for r in caplog.records if "times nodes the slower way" in r.getMessage()]
    if hooks == "c":
        assert ("C hooks (Python hooks on logged passes)", []) == (status, slower)
    else:
        reason = "the C module _nodeclock was not built"
        expected = f"torchpulse: autograd probe times nodes the slower way (reason='{reason}')"
        assert (f"Python hooks ({reason})", [expected]) == (status, slower)
