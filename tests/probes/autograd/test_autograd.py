"""Autograd probe: passes by kind, compile-time filtering, live control, uninstall, safety."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.autograd.graph
from torch.utils.checkpoint import checkpoint

from tests.probes.autograd.autograd_support import (
    autograd_agent,
    events,
    node_values,
    passes,
    tiny_transformer,
)
from torchpulse.probes.agent.store import OTHER
from torchpulse.probes.autograd.config import AutogradConfig

ORIGINAL_RUN_BACKWARD = torch.autograd.graph._engine_run_backward


@pytest.fixture(scope="module")
def compiled_mlp() -> Iterator[torch.nn.Module]:
    """One tiny compiled model shared by the module (aot_eager: AOTAutograd without inductor)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    yield torch.compile(model, backend="aot_eager")
    torch._dynamo.reset()


def test_training_loop_counts_passes_by_kind_exactly(compiled_mlp: torch.nn.Module) -> None:
    """backward, autograd.backward, autograd.grad and a compiled model's backward, nothing else."""
    with autograd_agent() as agent:
        model = tiny_transformer()
        x = torch.randn(2, 4, 32)
        for _ in range(3):
            model(x).mean().backward()
        torch.autograd.backward(model(x).mean())
        inp = torch.randn(2, 4, 32, requires_grad=True)
        torch.autograd.grad(model(inp).mean(), inp)
        for _ in range(2):
            compiled_mlp(torch.randn(4, 8)).sum().backward()
        assert 6 == passes(agent, "backward")
        assert 1 == passes(agent, "grad")
        assert 0 == passes(agent, "reentrant")


def test_compilation_adds_no_passes() -> None:
    """AOTAutograd traces the joint graph through the engine at compile time; that is not a pass."""
    with autograd_agent() as agent:
        model = torch.compile(torch.nn.Linear(4, 1), backend="aot_eager", dynamic=False)
        out = model(torch.randn(3, 4)).sum()  # compiles here
        assert 0 == passes(agent, "backward") + passes(agent, "grad")
        out.backward()
        assert 1 == passes(agent, "backward")
        assert "CompiledFunctionBackward" in node_values(agent, "autograd_node_calls_total")
    torch._dynamo.reset()


def test_compiled_autograd_pass_has_its_own_kind() -> None:
    """A pass under compiled autograd counts as compiled_autograd and gets no node hooks."""
    from torch._dynamo import compiled_autograd

    with autograd_agent(sample_every="1") as agent:
        model = torch.nn.Linear(4, 1)
        with compiled_autograd._enable(torch.compile(backend="eager")):
            for _ in range(2):
                model(torch.randn(3, 4)).sum().backward()
        assert 2 == passes(agent, "compiled_autograd")
        assert 0 == passes(agent, "backward")
        assert 0 == agent.store.value("autograd_sampled_passes_total", ())  # at 0 since install
        assert 2 == agent.probes["autograd"]._check.known  # still checked for non-finite grads
    torch._dynamo.reset()


@pytest.mark.filterwarnings("error")  # Dynamo warns when it meets the probe's own code
@pytest.mark.parametrize(("compiled_autograd", "kind"), [(False, "backward"), (True, "compiled_autograd")])
def test_backward_inside_a_compiled_step_is_counted(compiled_autograd: bool, kind: str) -> None:
    """`loss.backward()` inside a torch.compile'd step: Dynamo must not trace the wrapper (where
    is_compiling() would read True and hide the pass) nor the node hooks of a timed and logged
    pass; with compiled autograd on, the passes have their own kind."""
    from torch._dynamo.utils import counters

    counters.clear()
    options = {"sample_every": "1", "log_passes": "1"}
    with torch._dynamo.config.patch(compiled_autograd=compiled_autograd), autograd_agent(**options) as agent:
        model = torch.nn.Linear(4, 1)

        @torch.compile(backend="eager")
        def step(x: torch.Tensor) -> None:
            model(x).sum().backward()

        for _ in range(2):
            step(torch.randn(3, 4))
        assert 2 == passes(agent, kind)
        assert 2 == agent.probes["autograd"]._check.known
        timed = 0 if compiled_autograd else 2  # compiled autograd passes get no node hooks
        assert timed == (agent.store.value("autograd_sampled_passes_total", ()) or 0)
        assert (timed > 0) == bool(events(agent, "autograd.node"))
        if not compiled_autograd:  # which traces torch's own generators (sympy) itself
            assert {} == dict(counters["unimplemented"])  # no frame of ours reached Dynamo
    torch._dynamo.reset()


def test_reentrant_checkpoint_pass_is_counted_apart() -> None:
    """The inner pass of reentrant checkpointing is `reentrant`; `backward` stays one per call."""
    with autograd_agent() as agent:
        layer = torch.nn.Linear(8, 8)
        x = torch.randn(2, 8, requires_grad=True)
        checkpoint(layer, x, use_reentrant=True).sum().backward()
        assert (1, 1) == (passes(agent, "backward"), passes(agent, "reentrant"))


def test_set_sample_every_applies_at_the_next_pass() -> None:
    """Timing every pass after the live change; 0 switches timing off."""
    with autograd_agent(sample_every="1000") as agent:
        probe = agent.probes["autograd"]
        weight = torch.randn(4, requires_grad=True)
        for _ in range(3):  # only the first is timed
            (weight * 2).sum().backward()
        probe.set_sample_every(1)
        for _ in range(3):
            (weight * 2).sum().backward()
        probe.set_sample_every(0)
        for _ in range(3):
            (weight * 2).sum().backward()
        agent.drain()
        assert 4 == agent.store.value("autograd_sampled_passes_total", ())


def test_top_k_node_types_keep_their_label_rest_fold_into_other() -> None:
    """With top_nodes=3 the three slowest types of the first sampled pass get labels."""
    with autograd_agent(sample_every="1", top_nodes="3") as agent:
        model = tiny_transformer()
        model(torch.randn(2, 4, 32)).mean().backward()
        labels = node_values(agent, "autograd_node_seconds_total")
        assert 4 == len(labels)
        assert OTHER in labels


def test_detach_restores_torch_and_leaves_no_hook_on_a_live_graph(monkeypatch: Any) -> None:
    """A graph built while attached and run after detach sees neither wrapper nor hooks."""
    from torchpulse.probes.autograd.nodes import PassTimer

    calls = [0]

    def counted(factory: Any) -> Any:
        def make(self: PassTimer, index: int) -> Any:
            hook = factory(self, index)

            def spy(*args: Any) -> None:
                calls[0] += 1
                hook(*args)

            return spy

        return make

    monkeypatch.setattr(PassTimer, "_make_prehook", counted(PassTimer._make_prehook))
    monkeypatch.setattr(PassTimer, "_make_posthook", counted(PassTimer._make_posthook))
    weight = torch.randn(4, requires_grad=True)
    with autograd_agent(sample_every="1") as agent:
        out = (weight * 2).exp().sum()
        out.backward(retain_graph=True)  # sampled: hooks registered and removed
        assert calls[0] > 0
        calls[0] = 0
        agent.probes["autograd"].set_sample_every(0)
        out.backward(retain_graph=True)
        assert 0 == calls[0]
        later = (weight * 3).sum()
    assert ORIGINAL_RUN_BACKWARD is torch.autograd.graph._engine_run_backward
    assert ORIGINAL_RUN_BACKWARD is torch.autograd._engine_run_backward  # type: ignore[attr-defined]
    out.backward()
    later.backward()
    assert 0 == calls[0]


@pytest.mark.probe_errors
def test_probe_bug_disables_the_probe_and_never_reaches_the_job(monkeypatch: Any) -> None:
    """An error inside the probe: the pass completes, gradients are right, the error is counted."""
    from torchpulse.probes.autograd.nonfinite import GradCheck

    def broken(*_args: Any) -> None:
        raise RuntimeError("probe bug")

    monkeypatch.setattr(GradCheck, "launch", broken)
    with autograd_agent() as agent:
        weight = torch.ones(3, requires_grad=True)
        (weight * 2).sum().backward()
        assert torch.equal(torch.full((3,), 2.0), weight.grad)
        assert agent.probes["autograd"].enabled is False
        agent.drain()
        assert 1 == agent.store.value("agent_probe_errors_total", ("autograd",))
        assert ORIGINAL_RUN_BACKWARD is torch.autograd.graph._engine_run_backward


def test_the_job_sees_its_own_exceptions_and_hooks_are_removed() -> None:
    """A failing pass raises the job's error unchanged and still counts."""
    with autograd_agent(sample_every="1") as agent:
        weight = torch.randn(3, requires_grad=True)
        out = (weight * 2).sum()
        out.backward()
        with pytest.raises(RuntimeError, match="second time"):
            out.backward()
        assert 2 == passes(agent, "backward")
        assert agent.probes["autograd"].enabled


def test_gradients_are_bitwise_identical_with_the_probe() -> None:
    """Timing and logging every pass change no gradient."""

    def grads() -> list[torch.Tensor]:
        model = tiny_transformer()
        model(torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(1))).mean().backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    expected = grads()
    with autograd_agent(sample_every="1", log_passes="1", grad_norm="1"):
        actual = grads()
    assert all(torch.equal(e, a) for e, a in zip(expected, actual, strict=True))


@pytest.mark.parametrize(
    "options", [{"autograd_sample_every": "-1"}, {"autograd_nonfinite": "maybe"}, {"autograd_top_nodes": "0"}]
)
def test_invalid_options_are_refused(options: dict[str, str]) -> None:
    """Settings are validated when the probe is built (attach() then skips it with a warning)."""
    with pytest.raises(ValueError):
        AutogradConfig.from_options(options)
