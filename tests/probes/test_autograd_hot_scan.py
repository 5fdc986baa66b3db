"""CPU gradients scanned by the C hook as the engine accumulates them, and where that must not happen."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.probes.autograd_support import autograd_agent, events, span_reader, tiny_transformer
from torchpulse.probes.autograd_nonfinite import GradCheck, _gradscan

pytestmark = pytest.mark.skipif(_gradscan is None, reason="the C module _gradscan was not built")


@contextmanager
def hooking_every_gradient() -> Iterator[Any]:
    """An autograd agent whose check hooks every gradient: the tiny models' are all small."""
    with autograd_agent() as agent:
        agent.probes["autograd"]._check.hook_min_bytes = 0
        yield agent


def _ours(param: torch.Tensor) -> list[Any]:
    hooks = param._post_accumulate_grad_hooks or {}
    return [hook for hook in hooks.values() if _gradscan is not None and isinstance(hook, _gradscan.Hook)]


def _answered_per_pass(agent: Any) -> list[int]:
    """Spy on the check: how many gradients the hooks had answered when each pass ended (every
    gradient gets a hook here: the tiny models' are all below the default's smallest)."""
    check = agent.probes["autograd"]._check
    check.hook_min_bytes = 0
    seen: list[int] = []
    launch = check.launch

    def spy(*args: Any) -> None:
        seen.append(len(check._answers))
        launch(*args)

    check.launch = spy
    return seen


def _run(agent: Any, poison: dict[int, list[str]], steps: int = 8,
         during: Callable[[int, torch.nn.Module], None] | None = None) -> list[tuple[int, str]]:
    """Train a tiny transformer; at step k, the named parameters' gradients turn NaN (or Inf)."""
    model = tiny_transformer()
    named = dict(model.named_parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(2, 4, 32)
    for step in range(steps):
        if during is not None:
            during(step, model)
        handles = [named[name].register_hook(lambda g, i=i: g * (math.nan if i % 2 else math.inf))
                   for i, name in enumerate(poison.get(step, []))]
        model(x).square().mean().backward()
        for handle in handles:
            handle.remove()
        optimizer.zero_grad(set_to_none=True)
    agent.drain()
    return sorted((e["pass_index"], e["names"]) for e in events(agent, "autograd.nonfinite_gradients"))


POISON = {2: ["layers.0.linear1.weight"], 4: ["layers.1.self_attn.in_proj_weight", "layers.0.norm2.bias"],
          5: ["layers.1.linear2.bias"], 7: ["layers.0.self_attn.out_proj.weight"]}


@pytest.mark.parametrize("way", ["shim", "bindings"])
def test_the_hooks_answer_the_same_as_the_scan_after_the_pass(way: str) -> None:
    """Every pass but the first (which finds the parameters) is answered by the hooks, and each
    non-finite pass names the same parameters as a probe that reads only after the pass, whichever
    way the C module learns where gradients lie."""
    with span_reader(way), autograd_agent() as agent:
        answered = _answered_per_pass(agent)
        during = _run(agent, POISON)
        model_parameters = len(list(tiny_transformer().parameters()))
        assert [0] + [model_parameters] * 7 == answered
        assert agent.probes["autograd"].status()["cpu_gradient_reader"].endswith("during the pass")
    with span_reader(way), autograd_agent() as agent:
        agent.probes["autograd"]._check.stop_hooking()
        answered = _answered_per_pass(agent)
        after = _run(agent, POISON)
        assert [0] * 8 == answered
    assert during == after
    assert [2, 4, 5, 7] == [index for index, _names in during]
    assert "layers.1.self_attn.in_proj_weight" in dict(during)[4]
    assert "layers.0.norm2.bias" in dict(during)[4]


def test_a_hook_of_the_jobs_own_after_ours_is_seen_and_ours_moves_behind_it() -> None:
    """The job's post-accumulate hook writes NaN after ours ran: that pass is read after the pass,
    and from the next one on ours runs last and sees it."""
    def poison_later(step: int, model: torch.nn.Module) -> None:
        if step == 3:
            model.layers[0].linear2.weight.register_post_accumulate_grad_hook(spoil)

    def spoil(param: torch.Tensor) -> None:
        param.grad.view(-1)[5] = math.nan

    with autograd_agent() as agent:
        answered = _answered_per_pass(agent)
        during = _run(agent, {}, steps=6, during=poison_later)
        assert [(i, "layers.0.linear2.weight") for i in (3, 4, 5)] == during
        assert 0 == answered[0] and all(count > 0 for count in answered[1:])


def _hook_count(model: torch.nn.Module) -> int:
    return sum(len(_ours(p)) for p in model.parameters())


def test_only_gradients_big_enough_to_gain_get_a_hook() -> None:
    from torchpulse.probes.autograd_nonfinite import GradCheck

    big = GradCheck.hook_min_bytes // 4
    model = torch.nn.Sequential(torch.nn.Linear(big, 1), torch.nn.Linear(1, big // 2))
    with autograd_agent() as agent:
        for _ in range(2):
            model(torch.randn(2, big)).sum().backward()
        assert [1, 0, 0, 0] == [len(_ours(p)) for p in model.parameters()]
        assert agent.probes["autograd"]._check.known == 4


def test_hooks_leave_with_the_probe_and_do_nothing_while_it_is_switched_off() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    x = torch.randn(4, 8)
    with autograd_agent() as agent:
        probe = agent.probes["autograd"]
        probe._check.hook_min_bytes = 0
        for _ in range(2):
            model(x).sum().backward()
        assert 4 == _hook_count(model)
        probe.enabled = False  # switched off: the hooks stay, disarmed
        (model(x) * math.nan).sum().backward()
        assert 4 == _hook_count(model)
        assert 0 == len(probe._check._answers)
        model.zero_grad(set_to_none=True)
        probe.enabled = True
        model(x).sum().backward()
        agent.drain()
        assert 0 == agent.store.value("grad_nonfinite_passes_total", ())
        probe.uninstall()
        assert 0 == _hook_count(model)
        probe.install()
        for _ in range(3):
            model(x).sum().backward()
        assert 4 == _hook_count(model)
    assert 0 == _hook_count(model)


def test_the_hooks_keep_no_gradient_alive_after_the_pass() -> None:
    with hooking_every_gradient() as agent:
        model = torch.nn.Linear(64, 64)
        for _ in range(3):
            model(torch.randn(2, 64)).sum().backward()
            grad = weakref.ref(model.weight.grad)
            model.zero_grad(set_to_none=True)
            assert grad() is None
        assert 0 == len(agent.probes["autograd"]._check._answers)


def test_a_model_cast_in_place_is_still_read_right() -> None:
    """`model.double()` keeps the Parameter objects and their float32 hooks: those skip the
    float64 gradients, which are read after the pass."""
    with autograd_agent() as agent:
        answered = _answered_per_pass(agent)
        model = tiny_transformer()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        target = model.layers[1].linear1.weight
        for step in range(6):
            if step == 3:
                model.double()
            x = torch.randn(2, 4, 32, dtype=target.dtype)
            handle = target.register_hook(lambda g: g * math.nan) if step == 4 else None
            model(x).square().mean().backward()
            if handle is not None:
                handle.remove()
            optimizer.zero_grad(set_to_none=True)
        agent.drain()
        assert [(4, "layers.1.linear1.weight")] == [
            (e["pass_index"], e["names"]) for e in events(agent, "autograd.nonfinite_gradients")]
        assert answered[1] > 0 and 0 == answered[4]


def test_compiled_autograd_passes_find_no_hook_and_are_still_checked() -> None:
    from torch._dynamo import compiled_autograd

    with hooking_every_gradient() as agent:
        model = torch.nn.Linear(4, 1)
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
        assert 2 == _hook_count(model)
        with compiled_autograd._enable(torch.compile(backend="eager")):
            for step in range(2):
                scale = math.nan if step == 1 else 1.0
                (model(torch.randn(3, 4)) * scale).sum().backward()
                model.zero_grad(set_to_none=True)
                assert 0 == _hook_count(model)
        agent.drain()
        assert 1 == agent.store.value("grad_nonfinite_passes_total", ())
        model(torch.randn(3, 4)).sum().backward()
        assert 0 == _hook_count(model)  # not placed again: the job uses compiled autograd
    torch._dynamo.reset()


def test_under_torch_distributed_gradients_are_read_after_the_pass(tmp_path: Path) -> None:
    """DDP all-reduces gradients in place after they are accumulated: a real gloo group of one."""
    import torch.distributed as dist

    with hooking_every_gradient() as agent:
        model = torch.nn.Linear(4, 1)
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
        assert 2 == _hook_count(model)
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
        try:
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            for step in range(3):
                scale = math.nan if step == 1 else 1.0
                (ddp(torch.randn(3, 4)) * scale).sum().backward()
                model.zero_grad(set_to_none=True)
                assert 0 == _hook_count(model)
        finally:
            dist.destroy_process_group()
        agent.drain()
        assert 1 == agent.store.value("grad_nonfinite_passes_total", ())


def test_every_hooked_gradient_of_a_big_model_is_answered_and_the_bad_ones_named() -> None:
    """300 hooked parameters (the hooks' table of answers grows and rehashes twice): each is answered by
    its hook, exactly the non-finite ones are named, and nothing is held once the pass is over."""
    params = [torch.nn.Parameter(torch.ones(8)) for _ in range(300)]
    bad = {0, 7, 150, 299}
    check = GradCheck(max_pending=4, norms=False)
    check.hook_min_bytes = 0
    for param in params:
        check.track(param)
    for step in range(2):
        check.arm()
        scale = [math.nan if step and i in bad else 1.0 for i in range(len(params))]
        sum((param * factor).sum() for param, factor in zip(params, scale, strict=True)).backward()
        assert len(params) == len(check._answers)
        check.launch(step, "backward")
        check.disarm()
        [result] = check.poll()
        assert len(params) == result.checked
        assert {id(params[i]) for i in (bad if step else ())} == {id(ref()) for ref in result.nonfinite}
        assert 0 == len(check._answers)
        for param in params:
            param.grad = None
