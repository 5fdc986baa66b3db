"""The non-finite check under the shapes real jobs take: several bad parameters a pass, a model cast in
place, compiled autograd, torch.distributed, and a model with hundreds of parameters."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests.probes.autograd.autograd_support import autograd_agent, events, tiny_transformer
from torchpulse.probes.autograd.nonfinite import GradCheck


def _run(
    agent: Any,
    poison: dict[int, list[str]],
    steps: int = 8,
    during: Callable[[int, torch.nn.Module], None] | None = None,
) -> list[tuple[int, str]]:
    """Train a tiny transformer; at step k, the named parameters' gradients turn NaN (or Inf)."""
    model = tiny_transformer()
    named = dict(model.named_parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(2, 4, 32)
    for step in range(steps):
        if during is not None:
            during(step, model)
        handles = [
            named[name].register_hook(lambda g, i=i: g * (math.nan if i % 2 else math.inf))
            for i, name in enumerate(poison.get(step, []))
        ]
        model(x).square().mean().backward()
        for handle in handles:
            handle.remove()
        optimizer.zero_grad(set_to_none=True)
    agent.drain()
    return sorted((e["pass_index"], e["names"]) for e in events(agent, "autograd.nonfinite_gradients"))


POISON = {
    2: ["layers.0.linear1.weight"],
    4: ["layers.1.self_attn.in_proj_weight", "layers.0.norm2.bias"],
    5: ["layers.1.linear2.bias"],
    7: ["layers.0.self_attn.out_proj.weight"],
}


def test_each_non_finite_pass_names_exactly_its_bad_parameters() -> None:
    with autograd_agent() as agent:
        found = _run(agent, POISON)
    assert [2, 4, 5, 7] == [index for index, _names in found]
    assert "layers.0.linear1.weight" == dict(found)[2]
    assert "layers.1.self_attn.in_proj_weight" in dict(found)[4]
    assert "layers.0.norm2.bias" in dict(found)[4]
    assert "layers.1.linear2.bias" == dict(found)[5]


def test_the_check_keeps_no_gradient_alive_after_the_pass() -> None:
    with autograd_agent() as agent:
        model = torch.nn.Linear(64, 64)
        for _ in range(3):
            model(torch.randn(2, 64)).sum().backward()
            grad = weakref.ref(model.weight.grad)
            model.zero_grad(set_to_none=True)
            assert grad() is None
        agent.drain()
        assert 3 == agent.store.value("backward_passes_total", ("backward",))


def test_a_model_cast_in_place_is_still_read_right() -> None:
    """`model.double()` keeps the Parameter objects: their float64 gradients are reduced in a group of
    their own from the next pass on."""
    with autograd_agent() as agent:
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
            (e["pass_index"], e["names"]) for e in events(agent, "autograd.nonfinite_gradients")
        ]


def test_compiled_autograd_passes_are_checked() -> None:
    from torch._dynamo import compiled_autograd

    with autograd_agent() as agent:
        model = torch.nn.Linear(4, 1)
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
            model.zero_grad(set_to_none=True)
        with compiled_autograd._enable(torch.compile(backend="eager")):
            for step in range(2):
                scale = math.nan if step == 1 else 1.0
                (model(torch.randn(3, 4)) * scale).sum().backward()
                model.zero_grad(set_to_none=True)
        agent.drain()
        assert 1 == agent.store.value("grad_nonfinite_passes_total", ())
        assert 2 == agent.store.value("backward_passes_total", ("compiled_autograd",))
    torch._dynamo.reset()


def test_under_torch_distributed_the_all_reduced_gradients_are_read(tmp_path: Path) -> None:
    """DDP all-reduces gradients in place at the end of the pass: a real gloo group of one."""
    import torch.distributed as dist

    with autograd_agent() as agent:
        model = torch.nn.Linear(4, 1)
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
        try:
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            for step in range(3):
                scale = math.nan if step == 1 else 1.0
                (ddp(torch.randn(3, 4)) * scale).sum().backward()
                model.zero_grad(set_to_none=True)
        finally:
            dist.destroy_process_group()
        agent.drain()
        assert 1 == agent.store.value("grad_nonfinite_passes_total", ())


def test_every_gradient_of_a_big_model_is_answered_and_the_bad_ones_named() -> None:
    """300 parameters: each is checked, exactly the non-finite ones are named, and the global norm
    is torch's."""
    params = [torch.nn.Parameter(torch.ones(8)) for _ in range(300)]
    bad = {0, 7, 150, 299}
    check = GradCheck(max_pending=4)
    for param in params:
        check.track(param)
    for step in range(2):
        scale = [math.nan if step and i in bad else 1.0 for i in range(len(params))]
        sum((param * factor).sum() for param, factor in zip(params, scale, strict=True)).backward()
        check.launch(step, "backward")
        [result] = check.poll()
        assert len(params) == result.checked
        assert {id(params[i]) for i in (bad if step else ())} == {id(ref()) for ref in result.nonfinite}
        if not step:
            expected = torch.linalg.vector_norm(torch.stack([p.grad for p in params]))  # type: ignore[misc]
            assert math.isclose(float(expected), result.norm, rel_tol=1e-6)
        for param in params:
            param.grad = None
