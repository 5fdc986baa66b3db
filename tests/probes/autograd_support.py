"""Tiny models and agent helpers shared by the autograd probe tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from tests.support import local_agent


@contextmanager
def autograd_agent(**options: str) -> Iterator[Any]:
    """A local agent with only the autograd probe, options given as `autograd_<name>`."""
    agent: Any = local_agent(("autograd",), options={f"autograd_{k}": v for k, v in options.items()})
    try:
        yield agent
    finally:
        agent.shutdown()


def tiny_transformer(d_model: int = 32, layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model, 2, dim_feedforward=2 * d_model,
                                             dropout=0.0, batch_first=True)
    return torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


def passes(agent: Any, kind: str) -> float:
    agent.drain()
    return float(agent.store.value("backward_passes_total", (kind,)) or 0.0)


def node_values(agent: Any, family: str) -> dict[str, float]:
    agent.drain()
    return {labels[0]: value for (name, labels), value in agent.store._values.items() if name == family}


def events(agent: Any, name: str) -> list[dict[str, Any]]:
    return [dict(e.fields) for e in [*agent._events, *agent._requested] if e.event == name]


@contextmanager
def span_reader(way: str) -> Iterator[None]:
    """The C scan learns where tensors lie through torch's C shim ("shim") or its Python bindings
    ("bindings") inside the block, and as before after it."""
    from torchpulse.probes import autograd_nonfinite

    module = autograd_nonfinite._gradscan
    if module is None:
        pytest.skip("the C module _gradscan was not built: torch reads every gradient")
    assert way in ("shim", "bindings")
    was_on = module.torch_shim_enabled()
    module.use_torch_shim(autograd_nonfinite._shim_codes() if way == "shim" else None)
    try:
        yield
    finally:
        module.use_torch_shim(autograd_nonfinite._shim_codes() if was_on else None)


HOOK_KINDS = ("c", "python")


@contextmanager
def timing_hooks(kind: str) -> Iterator[None]:
    """Sampled passes are timed by the C hooks ("c", where `_nodeclock` was built) or by the Python
    ones ("python", the logging mode's and the fallback) inside the block."""
    from torchpulse.probes import autograd_nodes

    assert kind in HOOK_KINDS
    saved = autograd_nodes._nodeclock
    if kind == "c" and saved is None:
        pytest.skip("the C module _nodeclock was not built: the Python hooks time every node")
    if kind == "python":
        autograd_nodes._nodeclock = None
    try:
        yield
    finally:
        autograd_nodes._nodeclock = saved
