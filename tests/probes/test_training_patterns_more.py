"""More real training patterns against the probes: meta-device FLOP counts, Python modes, failed steps."""

from __future__ import annotations

import gc
import math
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from tests.probes.autograd_support import events, passes
from tests.probes.test_training_patterns import mlp, training_agent, value


def test_a_flop_count_on_the_meta_device_leaves_the_autograd_probe_on() -> None:
    """Counting FLOPs with a meta-device model (Lightning's measure_flops) runs a real pass on tensors
    without data: the probe keeps counting and finds a later NaN (it switched itself off)."""
    torch.manual_seed(0)
    with training_agent() as agent:
        with torch.device("meta"):
            meta_model, meta_x = mlp(64, 128, 10), torch.randn(32, 64)
        counter = FlopCounterMode(display=False)
        with counter:
            meta_model(meta_x).sum().backward()
        # Forward and both weight gradients, and the first layer's input gradient is not needed.
        assert 2 * 32 * (2 * 64 * 128 + 3 * 128 * 10) == counter.get_total_flops()
        model = mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        head: torch.nn.Linear = model[2]  # type: ignore[assignment]
        for step in range(4):
            handle = head.weight.register_hook(lambda g: g * math.nan) if step == 2 else None  # type: ignore[no-untyped-call]
            model(torch.randn(2, 4)).sum().backward()
            if handle is not None:
                handle.remove()
            if step != 2:
                optimizer.step()
            optimizer.zero_grad()
        assert (5, 1.0, 0.0, 1.0) == (
            passes(agent, "backward"), value(agent, "agent_probe_enabled", "autograd"),
            value(agent, "agent_probe_errors_total", "autograd"), value(agent, "grad_nonfinite_passes_total"))
        [event] = events(agent, "autograd.nonfinite_gradients")
        assert (3, "2.weight") == (event["pass_index"], event["names"])


class _DispatchLog(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """A job's op log at the dispatcher (as DebugMode or a memory tracker sees ops)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _logged_steps(mode: _DispatchLog) -> tuple[list[str], list[torch.Tensor]]:
    """Three training steps, each forward and backward under `mode`: its log and the final weights."""
    torch.manual_seed(0)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        with mode:
            torch.nn.functional.mse_loss(model(torch.randn(8, 4)), torch.randn(8, 1)).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad()
    return mode.ops, [p.detach().clone() for p in model.parameters()]


def test_the_jobs_dispatch_mode_sees_only_its_own_ops() -> None:
    """Passes under the job's own dispatch mode (DebugMode, a memory tracker): the non-finite check's
    reductions do not show up in what the mode records, and the job's numbers stay the same."""
    ops, weights = _logged_steps(_DispatchLog())
    with training_agent() as agent:
        attached_ops, attached_weights = _logged_steps(_DispatchLog())
        assert (3, 0.0) == (passes(agent, "backward"), value(agent, "grad_nonfinite_passes_total"))
    assert ops == attached_ops
    assert all(torch.equal(a, b) for a, b in zip(weights, attached_weights, strict=True))


def test_a_step_that_raised_is_counted_when_the_job_drops_its_optimizer() -> None:
    """A step that raises (out of memory in its closure) and a job that falls back to a new optimizer,
    as OOM retries do: the failed step is counted though that optimizer never steps again."""
    torch.manual_seed(0)
    model = mlp()

    def out_of_memory() -> torch.Tensor:
        raise RuntimeError("out of memory (simulated)")

    with training_agent() as agent:
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        raised = 0
        for step in range(3):
            model(torch.randn(2, 4)).sum().backward()
            try:
                optimizer.step(out_of_memory) if step == 0 else optimizer.step()
            except RuntimeError:
                raised += 1
                del optimizer
                gc.collect()
                optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
            optimizer.zero_grad()
        assert (1, 1.0, 2.0) == (raised, value(agent, "optimizer_step_errors_total", "Adam#0"),
                                 value(agent, "optimizer_steps_total", "Adam#0"))
