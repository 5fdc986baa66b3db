"""The compile probe on torches whose CompilationMetrics lack fields 2.13 has (`recompile_reason`, `is_forward`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch._dynamo.utils

from tests.support import local_agent, series
from torchpulse.probes.compile.probe import Compilation, is_recompile_id
from torchpulse.probes.compile.reasons import function_label
from torchpulse.probes.torch_compat import features


@dataclasses.dataclass
class OldMetrics:
    """The fields torch 2.4's CompilationMetrics has that the probe reads: no reason, no is_forward."""

    compile_id: str
    co_name: str = "step"
    co_filename: str = "/job/train.py"
    co_firstlineno: int = 7
    fail_type: str | None = None
    fail_reason: str | None = None


@pytest.fixture
def agent() -> Iterator[Any]:
    agent: Any = local_agent(("compile",))
    yield agent
    agent.shutdown()


@pytest.mark.parametrize(
    ("compile_id", "expected"),
    [
        ("0/0", False),
        ("0/1", True),
        ("3/2_1", True),
        ("3/0_1", False),
        ("!0/3/1", True),
        ("!0/3/0", False),
        ("?", False),
        ("0", False),
    ],
)
def test_a_compile_id_tells_a_recompile(compile_id: str, expected: bool) -> None:
    """The frame's compile index (after any compiled-autograd prefix, before a restart suffix) is above 0."""
    assert expected == is_recompile_id(compile_id)


def test_records_without_reasons_count_recompiles_as_other(agent: Any) -> None:
    """Where torch records no reason, a frame's second compile is still a recompile, of reason `other`."""
    probe = agent.probes["compile"]
    probe._reasons_known = False  # what `_install_with_dynamo` finds on such a torch
    for compile_id in ("0/0", "0/1", "0/2"):
        agent.record(probe._on_compilation, Compilation.of(OldMetrics(compile_id)))
    agent.drain()
    label = function_label("step", "/job/train.py", 7)
    assert {(label, "other"): 2.0} == series(agent, "recompiles_total")
    assert {("ok",): 3.0, ("failed",): 0.0} == series(agent, "compile_frames_total")


def test_a_limit_hit_torch_2_10_records_as_recompile_limit_exceeded_is_no_recompile(agent: Any) -> None:
    """Torch 2.8-2.10 fail the frame with RecompileLimitExceeded and keep the last recompile reason on it:
    one limit hit, and no `tensor_size` recompile."""

    @dataclasses.dataclass
    class Metrics210(OldMetrics):
        is_forward: bool = True
        recompile_reason: str | None = "tensor 'x' size mismatch at index 0. expected 3, actual 4"

    probe = agent.probes["compile"]
    agent.record(
        probe._on_compilation,
        Compilation.of(Metrics210("0/8", fail_type="RecompileLimitExceeded", fail_reason="recompile_limit reached")),
    )
    agent.drain()
    label = function_label("step", "/job/train.py", 7)
    assert {(label,): 1.0} == series(agent, "recompile_limit_hits_total")
    assert {} == series(agent, "recompiles_total")


def count_fn(x: torch.Tensor, n: int) -> torch.Tensor:
    return x * n


def test_recompiles_match_the_compile_ids_torch_recorded(agent: Any) -> None:
    """On any torch, the probe counts one recompile per successful compile whose id says it is one."""
    torch._dynamo.utils.clear_compilation_metrics()
    compiled = torch.compile(count_fn, backend="eager", dynamic=False)
    for n in (1, 2, 3):
        compiled(torch.randn(3), n)
    agent.drain()
    metrics = torch._dynamo.utils.get_compilation_metrics()
    expected = [m for m in metrics if is_recompile_id(str(m.compile_id)) and m.fail_type is None]
    assert 2 == len(expected)
    label = function_label(count_fn.__name__, count_fn.__code__.co_filename, count_fn.__code__.co_firstlineno)
    reason = "python_value" if features.has("compilation_metrics_recompile_reason") else "other"
    assert {(label, reason): float(len(expected))} == series(agent, "recompiles_total")
