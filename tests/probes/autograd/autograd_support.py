"""Tiny models and agent helpers shared by the autograd probe tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from tests.support import local_agent, series


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
    layer = torch.nn.TransformerEncoderLayer(d_model, 2, dim_feedforward=2 * d_model, dropout=0.0, batch_first=True)
    return torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


def passes(agent: Any, kind: str) -> float:
    agent.drain()
    return float(agent.store.value("backward_passes_total", (kind,)) or 0.0)


def node_values(agent: Any, family: str) -> dict[str, float]:
    agent.drain()
    return {labels[0]: value for labels, value in series(agent, family).items()}


def events(agent: Any, name: str) -> list[dict[str, Any]]:
    return [dict(e.fields) for e in [*agent._events, *agent._requested] if e.event == name]
