"""Non-finite gradients after each pass, and the parameter names they are reported under."""

from __future__ import annotations

import gc
import math
from typing import Any

import pytest
import torch

from tests.probes.autograd.autograd_support import autograd_agent, events, tiny_transformer
from torchpulse.probes.autograd.names import NameResolver, parameter_names

NAN_STEP = 3


def _train(agent: Any, *, inject: bool, steps: int = 6) -> None:
    """A loop that skips the optimizer step on non-finite gradients, as GradScaler does."""
    model = tiny_transformer()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(2, 4, 32)
    target = model.layers[1].linear1.weight
    for step in range(steps):
        handle = target.register_hook(lambda g: g * math.nan) if inject and step == NAN_STEP else None
        model(x).square().mean().backward()
        if handle is not None:
            handle.remove()
        if all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    agent.drain()


# The answers are the same whether or not the global norm is exported as a gauge.
READERS = pytest.mark.parametrize("grad_norm", ["0", "1"], ids=["no-gauge", "gauge"])


@READERS
def test_nan_in_one_gradient_is_counted_once_and_named(grad_norm: str) -> None:
    """NaN at step k: one non-finite pass, one parameter, named in the log event."""
    with autograd_agent(grad_norm=grad_norm) as agent:
        _train(agent, inject=True)
        assert 1 == agent.store.value("grad_nonfinite_passes_total", ())
        assert 0 == agent.store.value("grad_nonfinite_parameters", ())  # the last passes were clean
        [event] = events(agent, "autograd.nonfinite_gradients")
        assert (NAN_STEP, 1, "layers.1.linear1.weight") == (event["pass_index"], event["parameters"], event["names"])
        if grad_norm == "1":
            assert math.isfinite(agent.store.value("grad_norm", ()))  # the last pass was clean


def test_a_model_dropped_before_the_sender_reads_its_check_still_has_its_parameters_named() -> None:
    """A `main()` that returns right after its non-finite pass frees the model before the agent's sender thread
    handles the check: the names are resolved at the pass, on the training thread, so its line still has them,
    whether or not the resolver had named that model before."""
    logged = []
    for named_before in (True, False):
        with autograd_agent() as agent:
            model = torch.nn.Linear(3, 1)
            for _ in range(2 if named_before else 1):
                (model(torch.ones(1, 3)) * math.inf).sum().backward()
                model.zero_grad(set_to_none=True)
                if named_before and not events(agent, "autograd.nonfinite_gradients"):
                    agent.drain()  # the first line names the model: its parameters are in the resolver's cache
            del model
            gc.collect()
            agent.drain()
            logged.append([(e["parameters"], e["names"]) for e in events(agent, "autograd.nonfinite_gradients")])
    assert [[(2, "bias,weight")] * 2, [(2, "bias,weight")]] == logged


def test_the_parameter_gauge_returns_to_zero_after_a_clean_pass() -> None:
    """One AMP-style blip (step skipped, gradients zeroed): the counter keeps it, the gauge that
    the alert reads as "still non-finite" goes back to 0 at the next clean pass."""
    with autograd_agent() as agent:
        model = torch.nn.Linear(4, 2)
        values = []
        for step in range(3):
            scale = math.inf if step == 1 else 1.0
            (model(torch.ones(1, 4)) * scale).sum().backward()
            model.zero_grad(set_to_none=True)
            agent.drain()
            values.append(
                (
                    agent.store.value("grad_nonfinite_passes_total", ()),
                    agent.store.value("grad_nonfinite_parameters", ()),
                )
            )
        assert [(0, 0), (1, 2), (1, 0)] == values


def test_a_job_that_stays_nan_logs_a_burst_then_one_line_a_minute_and_counts_every_pass() -> None:
    """A loss gone NaN for good: every pass counted, but the log (the daemon's journal, per rank)
    gets NONFINITE_LOG_BURST lines, then one a minute saying how many passes it left out."""
    from torchpulse.probes.autograd import probe as autograd

    with autograd_agent() as agent:
        model = torch.nn.Linear(4, 2)
        model.weight.register_hook(lambda g: g * math.nan)
        for _ in range(50):
            model(torch.ones(1, 4)).sum().backward()
            model.zero_grad(set_to_none=True)
        agent.drain()
        assert 50 == agent.store.value("grad_nonfinite_passes_total", ())
        logged = events(agent, "autograd.nonfinite_gradients")
        assert list(range(autograd.NONFINITE_LOG_BURST)) == [e["pass_index"] for e in logged]
        probe = agent.probes["autograd"]
        probe._nonfinite_log._stamp -= autograd.NONFINITE_LOG_INTERVAL  # a minute later
        model(torch.ones(1, 4)).sum().backward()
        agent.drain()
        last = events(agent, "autograd.nonfinite_gradients")[-1]
        assert (50, 50 - autograd.NONFINITE_LOG_BURST) == (last["pass_index"], last["passes_not_logged"])


@READERS
def test_the_same_run_without_injection_counts_zero(grad_norm: str) -> None:
    """No NaN: the counter stays at 0, the norm gauge (when asked for) is finite and positive."""
    with autograd_agent(grad_norm=grad_norm) as agent:
        _train(agent, inject=False)
        assert 0 == agent.store.value("grad_nonfinite_passes_total", ())
        assert [] == events(agent, "autograd.nonfinite_gradients")
        if grad_norm == "1":
            assert 0 < agent.store.value("grad_norm", ()) < math.inf


def test_grad_norm_matches_torch_and_is_off_by_default() -> None:
    """The gauge equals clip_grad_norm_'s total norm; without the option it is not exported."""
    model = tiny_transformer()
    x = torch.randn(2, 4, 32)
    with autograd_agent(grad_norm="1") as agent:
        model(x).mean().backward()
        agent.drain()
        expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        assert agent.store.value("grad_norm", ()) == pytest.approx(float(expected), rel=1e-5)
    model.zero_grad()
    with autograd_agent() as agent:
        model(x).mean().backward()
        agent.drain()
        assert agent.store.value("grad_norm", ()) is None


def test_autograd_grad_passes_are_not_checked() -> None:
    """torch.autograd.grad accumulates nothing into .grad: no check, even with NaN results."""
    with autograd_agent() as agent:
        weight = torch.ones(3, requires_grad=True)
        (weight * 2).sum().backward()  # discovers the parameter
        weight.grad = torch.full((3,), math.nan)
        torch.autograd.grad((weight * 2).sum(), weight)
        agent.drain()
        assert 0 == agent.store.value("grad_nonfinite_passes_total", ())


def test_gradients_with_freed_storage_are_skipped() -> None:
    """FSDP frees unsharded storage: a gradient without storage is not read. (A parameter without storage whose
    gradient has some is: tests/integration/test_distributed_probes.py, FSDP2 without gradient sync.)"""
    with autograd_agent() as agent:
        weight = torch.nn.Parameter(torch.ones(3))
        (weight * 2).sum().backward()
        weight.grad = torch.full((3,), math.nan)
        weight.grad.untyped_storage().resize_(0)
        (torch.ones(3, requires_grad=True) * weight.grad.new_ones(3)).sum().backward()
        agent.drain()
        assert 0 == agent.store.value("grad_nonfinite_passes_total", ())


class _User(torch.nn.Module):
    """A user's module with a child that happens to be called `module`."""

    def __init__(self) -> None:
        super().__init__()
        self.module = torch.nn.Linear(2, 2)


def test_wrapper_prefixes_are_stripped_at_wrapper_boundaries_only() -> None:
    """_orig_mod (compile) and module (DataParallel) go; a user's own `module` child stays."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    inner = torch.nn.Sequential(_User(), checkpoint_wrapper(torch.nn.Linear(2, 2)))
    wrapped = torch.compile(torch.nn.DataParallel(inner), backend="eager")
    names = sorted(name for _, name in parameter_names(wrapped).values())
    assert ["0.module.bias", "0.module.weight", "1.bias", "1.weight"] == names


def test_resolver_finds_names_from_the_live_modules() -> None:
    """A parameter of any live module tree is named from its root; strangers get a shape."""
    model = torch.compile(tiny_transformer(), backend="eager")
    resolver = NameResolver()
    param = model._orig_mod.layers[0].self_attn.out_proj.weight
    assert "layers.0.self_attn.out_proj.weight" == resolver.name(param)
    assert "<unnamed (3,)>" == resolver.name(torch.nn.Parameter(torch.ones(3)))


def test_resolver_names_a_model_built_since_its_last_scan_at_once(monkeypatch: Any) -> None:
    """A rebuilt model is named without waiting out the rescan interval; a parameter that no
    module holds costs one scan, not one per report."""
    resolver = NameResolver()
    first = torch.nn.Linear(2, 2)
    assert ["weight"] == resolver.names([first.weight])
    scans = []
    rescan = resolver.rescan
    monkeypatch.setattr(resolver, "rescan", lambda objects: (scans.append(1), rescan(objects)))
    rebuilt = torch.nn.Sequential(torch.nn.Linear(2, 3))
    stray = torch.nn.Parameter(torch.ones(4))
    assert ["0.bias", "<unnamed (4,)>"] == resolver.names([rebuilt[0].bias, stray])
    assert ["<unnamed (4,)>", "0.weight"] == resolver.names([stray, rebuilt[0].weight])
    assert 1 == len(scans)


@READERS
def test_half_precision_gradients_are_reduced_in_float32_and_mixed_dtypes_grouped(grad_norm: str) -> None:
    """Finite fp16/bf16 grads whose norm exceeds fp16's range are not non-finite; a NaN among
    float32, float64 and bfloat16 parameters is found in its own dtype group."""
    half = torch.nn.Parameter(torch.zeros(400, dtype=torch.float16))
    brain = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    single = torch.nn.Parameter(torch.zeros(3))
    double = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    with autograd_agent(grad_norm=grad_norm) as agent:
        # d/dx of (x * 10000).sum() is 10000 per element: norm 200000, past fp16's 65504.
        loss = (half * 10000).float().sum() + (brain * 2).float().sum() + single.sum() + double.sum().float()
        loss.backward()
        agent.drain()
        assert 0 == agent.store.value("grad_nonfinite_passes_total", ())
        expected = math.sqrt(400 * 10000.0**2 + 3 * 4 + 3 + 3)
        if grad_norm == "1":
            assert agent.store.value("grad_norm", ()) == pytest.approx(expected, rel=1e-3)
        brain.grad = None
        loss = (brain * math.nan).float().sum() + single.sum() + (half * 1).float().sum()
        loss.backward()
        agent.drain()
        assert 1 == agent.store.value("grad_nonfinite_passes_total", ())
        assert 1 == agent.store.value("grad_nonfinite_parameters", ())


def test_finite_gradients_whose_float32_norm_overflows_are_not_called_nonfinite() -> None:
    """Elements near 1e20 square past float32's range; the gradients are finite (GradScaler
    would step), so nothing is counted and the norm gauge keeps its finite value."""
    single = torch.nn.Parameter(torch.zeros(4))
    brain = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    with autograd_agent(grad_norm="1") as agent:
        ((single * 1e20).sum() + (brain.float() * 1e20).sum()).backward()
        agent.drain()
        assert 0 == agent.store.value("grad_nonfinite_passes_total", ())
        expected = torch.linalg.vector_norm(torch.cat([single.grad.double(), brain.grad.double()]))
        assert agent.store.value("grad_norm", ()) == pytest.approx(float(expected), rel=1e-6)


def test_sparse_gradients_are_checked_by_their_values() -> None:
    """nn.Embedding(sparse=True): the stored values of the sparse gradient are reduced (as
    GradScaler reads them), so an Inf there is found and named."""
    with autograd_agent(grad_norm="1") as agent:
        embedding = torch.nn.Embedding(10, 3, sparse=True)
        embedding(torch.tensor([1, 2])).sum().backward()
        agent.drain()
        assert agent.store.value("grad_norm", ()) == pytest.approx(math.sqrt(6))
        embedding.weight.register_hook(lambda g: g * math.inf)
        embedding.zero_grad(set_to_none=True)
        embedding(torch.tensor([1, 2])).sum().backward()
        agent.drain()
        assert (1, 1) == (
            agent.store.value("grad_nonfinite_passes_total", ()),
            agent.store.value("grad_nonfinite_parameters", ()),
        )
        assert ["weight"] == [e["names"] for e in events(agent, "autograd.nonfinite_gradients")]


@pytest.mark.parametrize("dtype", [torch.complex64, torch.float8_e5m2, torch.float8_e4m3fn])
def test_complex_and_float8_gradients_are_checked(dtype: torch.dtype) -> None:
    """Complex gradients are reduced too, and float8 ones (no norm kernel) after widening: a clean
    pass counts nothing, a NaN is found, and neither switches the probe off."""
    with autograd_agent() as agent:
        param = torch.nn.Parameter(torch.ones(3, dtype=dtype))
        for scale in (2.0, math.nan):
            wide = param.to(torch.complex64 if dtype.is_complex else torch.float32) * scale
            (torch.view_as_real(wide) if dtype.is_complex else wide).sum().backward()
            param.grad = None
        agent.drain()
        assert agent.probes["autograd"].enabled
        assert 1 == agent.store.value("grad_nonfinite_passes_total", ())


def test_a_second_model_and_a_reentrant_checkpoint_are_checked_from_their_optimizers_first_step() -> None:
    """Parameters outside the graphs searched so far (a GAN's generator stepped by its own optimizer,
    a block under reentrant activation checkpointing) are checked from their optimizer's first step."""
    from torch.utils.checkpoint import checkpoint

    with autograd_agent() as agent:
        disc, gen = torch.nn.Linear(4, 1), torch.nn.Linear(4, 4)
        inner, head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (disc, gen, inner, head)]
        gen.weight.register_hook(lambda g: torch.full_like(g, math.inf))
        inner.weight.register_hook(lambda g: torch.full_like(g, math.nan))
        disc(torch.randn(2, 4)).sum().backward()  # pass 0: the first graph search sees only disc
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        for _ in range(4):  # two passes per step, so a plain period-N search would alias
            disc(gen(torch.randn(2, 4))).sum().backward()
            head(checkpoint(inner, torch.randn(2, 4, requires_grad=True), use_reentrant=True)).sum().backward()
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
        agent.drain()
        assert 8 == agent.store.value("grad_nonfinite_passes_total", ())
        # The generator's inf, then (its grad not yet zeroed) both it and the checkpointed NaN.
        assert [1, 2] * 4 == [e["parameters"] for e in events(agent, "autograd.nonfinite_gradients")]


def test_a_rebuilt_model_is_checked_from_its_first_pass() -> None:
    """A model rebuilt mid-run (reloaded after a divergence) is searched for at its first pass,
    not at the next sampled one: its optimizer may skip every step while gradients are NaN."""
    with autograd_agent() as agent:
        model = torch.nn.Linear(4, 2)
        model(torch.ones(1, 4)).sum().backward()  # pass 0 finds the first model's parameters
        model = torch.nn.Linear(4, 2)
        model.weight.register_hook(lambda g: g * math.nan)
        model(torch.ones(1, 4)).sum().backward()
        agent.drain()
        assert (1, 1) == (
            agent.store.value("grad_nonfinite_passes_total", ()),
            agent.store.value("grad_nonfinite_parameters", ()),
        )


def test_a_gradient_edge_output_does_not_switch_the_probe_off() -> None:
    """torch.distributed.pipelining runs weight backwards from GradientEdges, not tensors."""
    from torch.autograd.graph import get_gradient_edge

    with autograd_agent() as agent:
        weight = torch.randn(3, requires_grad=True)
        hidden = weight * 2
        out = hidden.sum()
        (grad,) = torch.autograd.grad([get_gradient_edge(out)], [weight], [torch.ones(())])
        agent.drain()
        assert [2.0, 2.0, 2.0] == grad.tolist()
        assert agent.probes["autograd"].enabled
        assert 1 == agent.store.value("backward_passes_total", ("grad",))


def test_a_new_parameter_at_a_dead_parameters_id_is_tracked(monkeypatch: Any) -> None:
    """CPython soon gives a dropped model's parameter addresses to a rebuilt one's: the id collision is
    forced here (deterministic, unlike the allocator) and the new parameter must still be checked."""
    import builtins

    from torchpulse.probes.autograd import nonfinite as autograd_nonfinite

    check = autograd_nonfinite.GradCheck(max_pending=4)
    old = torch.nn.Parameter(torch.zeros(2))
    check.track(old)
    dead_id = id(old)
    del old
    new = torch.nn.Parameter(torch.zeros(2))
    monkeypatch.setattr(
        autograd_nonfinite, "id", lambda obj: dead_id if obj is new else builtins.id(obj), raising=False
    )
    check.track(new)
    new.grad = torch.tensor([1.0, math.nan])
    check.launch(0, "backward")
    [result] = check.poll()
    assert (1, 1) == (result.checked, len(result.nonfinite))
    assert result.nonfinite[0]() is new
