"""More real training patterns against the probes: meta-device FLOP counts, Python modes, failed steps."""

from __future__ import annotations

import gc
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from tests.probes.autograd.autograd_support import events, passes
from tests.probes.test_training_patterns import mlp, training_agent, value
from tests.support import REPO, local_agent
from torchpulse.probes.optimizer import measure


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
            passes(agent, "backward"),
            value(agent, "agent_probe_enabled", "autograd"),
            value(agent, "agent_probe_errors_total", "autograd"),
            value(agent, "grad_nonfinite_passes_total"),
        )
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
        assert (1, 1.0, 2.0) == (
            raised,
            value(agent, "optimizer_step_errors_total", "Adam#0"),
            value(agent, "optimizer_steps_total", "Adam#0"),
        )


class _Lookahead(torch.optim.Optimizer):
    """Lookahead (Zhang et al. 2019) as third-party libraries write it: a wrapper that steps its base optimizer."""

    def __init__(self, base: torch.optim.Optimizer, k: int = 2, alpha: float = 0.5) -> None:
        self.base, self.k, self.alpha = base, k, alpha
        super().__init__(base.param_groups, {})

    @torch.no_grad()  # type: ignore[misc]
    def step(self, closure: Any = None) -> Any:
        loss = self.base.step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["calls"] = state.get("calls", 0) + 1
                slow = state.setdefault("slow", p.detach().clone())
                if state["calls"] % self.k == 0:
                    slow.add_(p - slow, alpha=self.alpha)
                    p.copy_(slow)
        return loss


def test_a_wrapping_optimizer_is_counted_once_with_the_state_of_the_one_it_wraps() -> None:
    """Lookahead around AdamW: one optimizer series, its steps and time, and a state size that holds
    both AdamW's moments and Lookahead's slow weights (the inner AdamW was a second series, with its state)."""
    torch.manual_seed(0)
    with training_agent() as agent:
        model = mlp()
        inner = torch.optim.AdamW(model.parameters(), lr=0.01)
        optimizer = _Lookahead(inner)
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        agent.drain()
        labels = sorted({labels[0] for (name, labels) in agent.store._values if name == "optimizer_steps_total"})
        expected_bytes = float(measure(inner)[2] + measure(optimizer)[2])
        assert (["_Lookahead#0"], 3.0, expected_bytes) == (
            labels,
            value(agent, "optimizer_steps_total", "_Lookahead#0"),
            value(agent, "optimizer_state_bytes", "_Lookahead#0"),
        )


ZERO_JOB = r"""
import json, os, sys, torch, torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from tests.probes.test_training_patterns import mlp, training_agent
from torchpulse.probes.optimizer import measure
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method=f"file://{sys.argv[2]}", rank=rank, world_size=2)
torch.manual_seed(0)
with training_agent() as agent:
    model = mlp(4, 16, 4)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=0.01)
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    agent.drain()
    series = {f"{name}{list(labels)}": v for (name, labels), v in agent.store._values.items()
              if name in ("optimizer_steps_total", "optimizer_state_bytes")}
    print(json.dumps({"series": series, "local_state_bytes": measure(optimizer.optim)[2]}), flush=True)
dist.destroy_process_group()
# Skip interpreter teardown: on torch 2.13 a gloo thread now and then aborts it (see tests/checkpoints/conftest.py).
os._exit(0)
"""


@pytest.mark.process
def test_zero_redundancy_optimizer_is_one_optimizer_holding_its_local_state(tmp_path: Path) -> None:
    """ZeroRedundancyOptimizer on 2 gloo ranks: per rank one series with 3 steps and the state of that rank's
    shard (the inner AdamW it steps was counted again, as a second optimizer)."""
    store = tmp_path / "store"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", ZERO_JOB, str(rank), str(store)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    results = []
    for proc in ranks:
        out, err = proc.communicate(timeout=120)
        assert 0 == proc.returncode, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    local = [r["local_state_bytes"] for r in results]
    assert [
        {
            "optimizer_steps_total['ZeroRedundancyOptimizer#0']": 3.0,
            "optimizer_state_bytes['ZeroRedundancyOptimizer#0']": float(b),
        }
        for b in local
    ] == [r["series"] for r in results]
    assert 0 < local[0] and 0 < local[1]


def test_cuda_graph_readiness_is_read_for_the_wrapping_optimizer_only() -> None:
    """The CUDA-graph probe's readiness gauges name Lookahead only, not the AdamW it steps inside its step, and
    keep no countdown of either once they are gone."""
    import torch._dynamo  # the CUDA-graph probe finishes installing when the job imports Dynamo

    agent: Any = local_agent(("optimizer", "cudagraphs"), optimizer_state_every=1)
    try:
        model = mlp()
        optimizer = _Lookahead(torch.optim.AdamW(model.parameters(), lr=0.01))
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        agent.drain()
        assert [("_Lookahead#0",)] == [
            labels for (name, labels) in agent.store._values if name == "optimizer_nonstatic_grads"
        ]
        del optimizer
        gc.collect()
        assert {} == agent.probes["cudagraphs"]._due_in  # the wrapped AdamW's countdown went with it
    finally:
        agent.shutdown()


def test_inputs_that_require_grad_stay_out_of_the_norm_on_every_pass() -> None:
    """A gradient penalty (WGAN-GP) fills the interpolated input's `.grad`: the exported norm is the critic's
    parameters' on every pass (before, each pass that searched the graph, here all of them, added the input's)."""
    torch.manual_seed(0)
    with training_agent(sample_every="1", grad_norm="1") as agent:
        critic = mlp()
        optimizer = torch.optim.SGD(critic.parameters(), lr=0.01)
        exported, expected = [], []
        for _ in range(3):
            real, fake, alpha = torch.randn(8, 4), torch.randn(8, 4), torch.rand(8, 1)
            mixed = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
            (slopes,) = torch.autograd.grad(critic(mixed).sum(), mixed, create_graph=True)
            penalty = ((slopes.norm(2, dim=1) - 1) ** 2).mean()
            (critic(fake).mean() - critic(real).mean() + 10 * penalty).backward()
            assert mixed.grad is not None
            norms = [torch.linalg.vector_norm(p.grad) for p in critic.parameters() if p.grad is not None]
            expected.append(float(torch.linalg.vector_norm(torch.stack(norms))))
            exported.append(value(agent, "grad_norm"))
            optimizer.step()
            optimizer.zero_grad()
        close = [e is not None and math.isclose(e, x, rel_tol=1e-5) for e, x in zip(exported, expected, strict=True)]
        assert [True, True, True] == close, (exported, expected)
