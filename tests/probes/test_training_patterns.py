"""Real training patterns against the probes: closures, accumulation, AMP, checkpointing, GANs, rebuilds,
meta-device FLOP counts, Python dispatch modes, failed steps, wrapping and sharded optimizers."""

from __future__ import annotations

import gc
import json
import math
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from tests.probes.autograd.autograd_support import events, node_values, passes
from tests.support import REPO, histogram_series, local_agent, series
from torchpulse.probes.optimizer import measure


@contextmanager
def training_agent(**options: str) -> Iterator[Any]:
    """A local agent with the autograd and optimizer probes, as a job gets by default."""
    agent: Any = local_agent(("autograd", "optimizer"), options={f"autograd_{k}": v for k, v in options.items()})
    try:
        yield agent
    finally:
        agent.shutdown()


def mlp(inputs: int = 4, hidden: int = 8, outputs: int = 1) -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(inputs, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, outputs))


def nonfinite(params: Any) -> int:
    """Ground truth: parameters whose gradient holds NaN or Inf right now."""
    return sum(1 for p in params if p.grad is not None and not torch.isfinite(p.grad).all())


def value(agent: Any, name: str, *labels: str) -> float | None:
    agent.drain()
    result: float | None = agent.store.value(name, labels)
    return result


def lbfgs_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Every tensor LBFGS holds in its state, the history lists included."""
    total = 0
    for state in optimizer.state.values():
        for item in state.values():
            for tensor in item if isinstance(item, list) else [item]:
                if isinstance(tensor, torch.Tensor):
                    total += tensor.numel() * tensor.element_size()
    return total


def counted_closure(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, sleep: float = 0.0
) -> tuple[Callable[[], torch.Tensor], list[float]]:
    """A training step as a closure (zero_grad, forward, MSE loss, backward) and the list its calls append to."""
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    calls: list[float] = []

    def closure() -> torch.Tensor:
        calls.append(time.perf_counter())
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        time.sleep(sleep)
        return loss

    return closure, calls


def test_lbfgs_counts_every_closure_pass_and_one_step_per_call() -> None:
    """LBFGS runs the closure (forward + backward) several times inside one step(): each is a
    backward pass, each step() one optimizer step, and a clean run reports no non-finite pass."""
    torch.manual_seed(0)
    with training_agent() as agent:
        model = mlp()
        optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
        closure, calls = counted_closure(model, optimizer)
        for _ in range(3):
            optimizer.step(closure)  # type: ignore[no-untyped-call]
        closures = len(calls)
        assert closures > 3  # several passes per step, else this test shows nothing
        assert (closures, 3.0, 0.0, 0.0) == (
            passes(agent, "backward"),
            value(agent, "optimizer_steps_total", "LBFGS#0"),
            value(agent, "grad_nonfinite_passes_total"),
            value(agent, "grad_nonfinite_parameters"),
        )


def step_seconds(agent: Any, label: str) -> tuple[int, float]:
    """Steps timed and their total seconds, as the optimizer probe recorded them."""
    agent.drain()
    histogram = histogram_series(agent, "optimizer_step_duration_seconds")[(label,)]
    return sum(histogram.bucket_counts), histogram.total


@pytest.mark.parametrize("keyword", [False, True], ids=["lbfgs-positional", "lightning-keyword"])
def test_a_steps_time_leaves_out_the_closure_it_runs(keyword: bool) -> None:
    """LBFGS evaluates its closure several times per step; Lightning passes every training step as
    `step(closure=...)`. The forward and backward passes inside are not optimizer time: a closure that
    sleeps 30 ms per call leaves the step's time well under one call's, and the step gets its loss."""
    torch.manual_seed(0)
    with training_agent() as agent:
        model = mlp()
        optimizer: torch.optim.Optimizer = (
            torch.optim.SGD(model.parameters(), lr=0.1)
            if keyword
            else torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
        )
        closure, calls = counted_closure(model, optimizer, sleep=0.03)
        losses = [
            optimizer.step(closure=closure) if keyword else optimizer.step(closure)  # type: ignore[no-untyped-call]
            for _ in range(3)
        ]
        assert all(isinstance(loss, torch.Tensor) for loss in losses)
        steps, seconds = step_seconds(agent, f"{type(optimizer).__name__}#0")
        assert len(calls) >= 3 and steps == 3
        assert seconds < 0.03, f"{len(calls)} closure calls of 30 ms, yet the steps took {seconds:.3f} s"


def test_lbfgs_nonfinite_closure_passes_are_counted_like_any_other() -> None:
    """A NaN loss in one closure call poisons LBFGS's later iterates: every pass after which a
    gradient held NaN is counted, as many as a check after each backward finds."""
    torch.manual_seed(0)
    with training_agent() as agent:
        model = mlp()
        optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
        x, y = torch.randn(16, 4), torch.randn(16, 1)
        calls, truth = 0, 0

        def closure() -> torch.Tensor:
            nonlocal calls, truth
            calls += 1
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y) * (math.nan if calls == 3 else 1.0)
            loss.backward()
            truth += nonfinite(model.parameters()) > 0
            return loss

        for _ in range(2):
            optimizer.step(closure)  # type: ignore[no-untyped-call]
        assert truth > 0
        assert (calls, truth) == (passes(agent, "backward"), value(agent, "grad_nonfinite_passes_total"))


def test_lbfgs_state_bytes_include_its_history() -> None:
    """LBFGS keeps its curvature history (old_dirs, old_stps) as lists of flat tensors, most of
    its state: the state-bytes gauge counts them (it counted only the top-level tensors)."""
    torch.manual_seed(0)
    with training_agent() as agent:
        model = torch.nn.Linear(64, 8)
        optimizer = torch.optim.LBFGS(model.parameters(), max_iter=10, history_size=5)
        x, y = torch.randn(32, 64), torch.randn(32, 8)

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        optimizer.step(closure)  # type: ignore[no-untyped-call]
        [state] = optimizer.state.values()
        assert 5 == len(state["old_dirs"])  # the history is full after one step of 10 iterations
        expected = lbfgs_state_bytes(optimizer)
        assert expected > 10 * 520 * 4  # 2 x 5 history copies of the 520 parameter elements
        assert (expected, float(expected)) == (measure(optimizer)[2], value(agent, "optimizer_state_bytes", "LBFGS#0"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_grad_scaler_accumulation_counts_the_poisoned_micro_batch_passes_and_names_them(dtype: torch.dtype) -> None:
    """Four micro-batches per step under CPU autocast and GradScaler, zeroed with set_to_none=False:
    an Inf in one micro-batch makes the scaler skip that step; the passes after which the
    accumulated gradient held it are counted and the parameters named, and the gauge returns to 0."""
    torch.manual_seed(0)
    with training_agent() as agent:
        model = mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        truth, steps = 0, 0
        for step in range(4):
            for micro in range(4):
                x = torch.randn(4, 4)
                if (step, micro) == (1, 1):
                    x[0, 0] = math.inf
                with torch.autocast("cpu", dtype=dtype):
                    loss = model(x).float().square().mean() / 4
                scaler.scale(loss).backward()
                truth += nonfinite(model.parameters()) > 0
            scale = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            steps += scaler.get_scale() >= scale  # a skipped step lowers the scale
            optimizer.zero_grad(set_to_none=False)
        assert (3, 3) == (steps, truth)  # the poisoned micro-batch and the two after it
        assert (16, 3.0, 3.0, 0.0) == (
            passes(agent, "backward"),
            value(agent, "optimizer_steps_total", "SGD#0"),
            value(agent, "grad_nonfinite_passes_total"),
            value(agent, "grad_nonfinite_parameters"),
        )
        reported = events(agent, "autograd.nonfinite_gradients")
        assert [5, 6, 7] == [e["pass_index"] for e in reported]
        # An Inf input reaches the first layer's weight (Inf * 0 gives NaN downstream too).
        assert all("0.weight" in str(e["names"]).split(",") for e in reported)


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_adds_no_backward_pass_and_finds_a_nan_inside(reentrant: bool) -> None:
    """The recomputation under torch.utils.checkpoint is no pass of its own (reentrant: one inner
    pass of kind reentrant per checkpoint); timed nodes stay per pass; a NaN inside is named."""
    torch.manual_seed(0)
    with training_agent(sample_every="1") as agent:
        inner, head = mlp(4, 8, 4), torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD([*inner.parameters(), *head.parameters()], lr=0.01)
        truth = 0
        for step in range(4):
            handle = inner[2].weight.register_hook(lambda g: g * math.nan) if step == 2 else None
            x = torch.randn(2, 4, requires_grad=reentrant)  # reentrant needs an input that requires grad
            head(checkpoint(inner, x, use_reentrant=reentrant)).sum().backward()
            if handle is not None:
                handle.remove()
            truth += nonfinite([*inner.parameters(), *head.parameters()]) > 0
            if step != 2:  # skip the update, as GradScaler would
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        assert (4, 4 if reentrant else 0, 4) == (
            passes(agent, "backward"),
            passes(agent, "reentrant"),
            value(agent, "autograd_sampled_passes_total"),
        )
        calls = node_values(agent, "autograd_node_calls_total")
        if reentrant:  # the inner pass runs inside CheckpointFunctionBackward, timed as that node
            assert (4.0, 4.0) == (calls["CheckpointFunctionBackward"], calls["AddmmBackward0"])
        else:  # three Linear layers a pass, the recomputed ones once each
            assert (12.0, 4.0) == (calls["AddmmBackward0"], calls["TanhBackward0"])
        assert (1, 1.0) == (truth, value(agent, "grad_nonfinite_passes_total"))
        [event] = events(agent, "autograd.nonfinite_gradients")
        assert (2, "2.weight") == (event["pass_index"], event["names"])


def test_gan_with_two_optimizers_and_schedulers() -> None:
    """A GAN: two optimizers over disjoint parameters, LR schedulers stepping each, the generator
    pass also reaching the discriminator. Passes, steps per optimizer, learning rates of the last
    steps and the one non-finite generator pass are what the loop itself saw."""
    torch.manual_seed(0)
    with training_agent() as agent:
        gen, disc = mlp(2, 8, 4), mlp(4, 8, 1)
        opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3)
        opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3)
        sched_d = torch.optim.lr_scheduler.StepLR(opt_d, step_size=2, gamma=0.5)
        sched_g = torch.optim.lr_scheduler.CosineAnnealingLR(opt_g, T_max=10)
        bce = torch.nn.BCEWithLogitsLoss()
        truth, g_steps, lrs = 0, 0, (0.0, 0.0)
        for step in range(6):
            fake = gen(torch.randn(4, 2))
            opt_d.zero_grad()
            (bce(disc(torch.randn(4, 4)), torch.ones(4, 1)) + bce(disc(fake.detach()), torch.zeros(4, 1))).backward()
            truth += nonfinite([*gen.parameters(), *disc.parameters()]) > 0
            opt_d.step()
            opt_g.zero_grad()
            handle = gen[2].bias.register_hook(lambda g: g * math.nan) if step == 3 else None
            bce(disc(fake), torch.ones(4, 1)).backward()
            if handle is not None:
                handle.remove()
            truth += nonfinite([*gen.parameters(), *disc.parameters()]) > 0
            if step != 3:
                opt_g.step()
                g_steps += 1
            lrs = (opt_d.param_groups[0]["lr"], opt_g.param_groups[0]["lr"])
            sched_d.step()
            sched_g.step()
        # The skipped generator step leaves its NaN grad until its next zero_grad: the next
        # discriminator pass ends with it still there (a pass *after which* a gradient held NaN).
        assert 2 == truth
        assert (12, 6.0, float(g_steps), float(truth)) == (
            passes(agent, "backward"),
            value(agent, "optimizer_steps_total", "Adam#0"),
            value(agent, "optimizer_steps_total", "Adam#1"),
            value(agent, "grad_nonfinite_passes_total"),
        )
        assert lrs == (
            value(agent, "optimizer_learning_rate", "Adam#0", "0"),
            value(agent, "optimizer_learning_rate", "Adam#1", "0"),
        )
        assert [(7, 1), (8, 1)] == [
            (e["pass_index"], e["parameters"]) for e in events(agent, "autograd.nonfinite_gradients")
        ]


def test_a_param_group_added_mid_run_is_checked_and_measured() -> None:
    """Progressive unfreezing: a frozen head joins the optimizer through add_param_group; from its
    first step on its non-finite gradients are found, and the parameter gauges include it."""
    torch.manual_seed(0)
    with training_agent() as agent:
        body, head = mlp(4, 8, 4), torch.nn.Linear(4, 1)
        head.requires_grad_(False)
        optimizer = torch.optim.SGD(body.parameters(), lr=0.01)
        for step in range(6):
            if step == 2:
                head.requires_grad_(True)
                optimizer.add_param_group({"params": head.parameters(), "lr": 0.001})
            handle = head.weight.register_hook(lambda g: g * math.inf) if step == 4 else None
            head(body(torch.randn(2, 4))).sum().backward()
            if handle is not None:
                handle.remove()
            if step != 4:
                optimizer.step()
            optimizer.zero_grad()
        assert (5.0, 1.0, 6.0, 8.0 * 4 + 8 + 4 * 8 + 4 + 4 + 1) == (
            value(agent, "optimizer_steps_total", "SGD#0"),
            value(agent, "grad_nonfinite_passes_total"),
            value(agent, "optimizer_parameters", "SGD#0"),
            value(agent, "optimizer_parameter_elements", "SGD#0"),
        )
        [event] = events(agent, "autograd.nonfinite_gradients")
        assert (4, "weight") == (event["pass_index"], event["names"])


# Far enough apart for the probe's throttle of searches for rebuilt models (one per 10 passes).
REBUILDS = (3, 15)


def _build_reusing_an_id(dead: set[int], build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """A new model built after the old one was dropped (to free its memory, as OOM and divergence
    recovery does) whose parameters include one at the address of a dead one (`dead`: the ids of
    the dropped model's parameters), as CPython's allocator soon gives. Candidates are kept until
    one does, so that each lands elsewhere; the others are dropped unused."""
    gc.collect()  # the dropped model's parameters must really be freed
    candidates = []
    for _ in range(1000):
        model = build()
        if dead & {id(p) for p in model.parameters()}:
            return model
        candidates.append(model)
    # Another thread's objects (the agent's sender) can take the freed slots for good: then the
    # scenario did not happen here. test_autograd_nonfinite forces the collision deterministically.
    pytest.skip("the allocator gave no rebuilt parameter a dead parameter's address this time")


def test_a_rebuilt_model_whose_parameters_reuse_dead_ids_is_checked() -> None:
    """A model dropped and rebuilt (with its optimizer) often gets parameters at the addresses of
    the dead ones: they are checked from the first pass (the dead ids used to hide them until the
    next sampled pass, and from every pass before the optimizer's first step)."""
    torch.manual_seed(0)
    with training_agent() as agent:
        model: torch.nn.Module = mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        truth = []
        for step in range(18):
            if step in REBUILDS:
                dead = {id(p) for p in model.parameters()}
                del model, optimizer
                model = _build_reusing_an_id(dead, mlp)
                optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            x = torch.randn(2, 4)
            if step in REBUILDS:
                x[0, 0] = math.nan  # the first pass of each rebuilt model
            model(x).sum().backward()
            truth.append(nonfinite(model.parameters()))
            if step not in REBUILDS:
                optimizer.step()
            optimizer.zero_grad()
            agent.drain()  # names are resolved while the model lives, as the sender thread does
        assert [3 if step in REBUILDS else 0 for step in range(18)] == truth  # all but the last bias
        reported = events(agent, "autograd.nonfinite_gradients")
        assert [(step, 3, 4) for step in REBUILDS] == [
            (e["pass_index"], e["parameters"], e["checked"]) for e in reported
        ]
        assert all("0.bias,0.weight,2.weight" == ",".join(sorted(str(e["names"]).split(","))) for e in reported)


def _sgd(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for param in model.parameters():
            param.add_(param.grad, alpha=-0.01)


def test_a_rebuilt_model_without_a_torch_optimizer_is_checked_at_once() -> None:
    """A hand-written update (no torch optimizer hook to find the new parameters): a rebuilt model
    whose parameter reuses a dead id is still checked from its first pass, not 100 passes later."""
    torch.manual_seed(0)
    with training_agent() as agent:
        model = torch.nn.Linear(4, 2)
        for step in range(12):
            if step == 2:
                dead = {id(p) for p in model.parameters()}
                del model
                model = _build_reusing_an_id(dead, lambda: torch.nn.Linear(4, 2))  # type: ignore[assignment]
            scale = math.inf if step >= 5 else 1.0
            (model(torch.ones(1, 4)) * scale).sum().backward()
            if step < 5:
                _sgd(model)
            model.zero_grad()
        assert (7.0, 2.0) == (value(agent, "grad_nonfinite_passes_total"), value(agent, "grad_nonfinite_parameters"))


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
        labels = sorted({labels[0] for labels in series(agent, "optimizer_steps_total")})
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
    samples, _ = agent.store.snapshot()
    series = {f"{s.family}{list(s.labels)}": s.value for s in samples
              if s.family in ("optimizer_steps_total", "optimizer_state_bytes")}
    print(json.dumps({"series": series, "local_state_bytes": measure(optimizer.optim)[2]}), flush=True)
dist.destroy_process_group()
# Skip interpreter teardown: on torch 2.13 a gloo thread now and then aborts it (see tests/support/checkpoints.py).
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
        assert [("_Lookahead#0",)] == list(series(agent, "optimizer_nonstatic_grads"))
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
