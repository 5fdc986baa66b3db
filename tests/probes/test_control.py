"""Commands applied at the step boundary of the training thread."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.support import local_agent
from torchpulse.probes.agent import Agent
from torchpulse.protocol import Command


def _setup() -> tuple[Agent, torch.nn.Module, torch.optim.Optimizer]:
    agent = local_agent(("optimizer",))
    assert isinstance(agent, Agent)
    model = torch.nn.Linear(4, 3)
    return agent, model, torch.optim.SGD(model.parameters(), lr=0.1)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, n: int = 1) -> None:
    for _ in range(n):
        optimizer.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()


def test_disabling_the_optimizer_probe_from_its_own_hook_does_not_break_the_step() -> None:
    """A disable applied inside the post-hook leaves inert hooks, and detach removes them later."""
    from torch.optim.optimizer import _global_optimizer_post_hooks

    before = len(_global_optimizer_post_hooks)
    agent, model, optimizer = _setup()
    try:
        _step(model, optimizer)
        agent.control.receive(Command(1, "disable", {"probe": "optimizer"}))
        _step(model, optimizer, 3)
        agent.drain()
        assert [(1, True, {"probe": "optimizer", "changed": True})] == [
            (r.id, r.ok, r.data) for r in agent.control.results]
        assert 2.0 == agent.store.value("optimizer_steps_total", ("SGD#0",))
    finally:
        agent.shutdown()
    assert before == len(_global_optimizer_post_hooks)


def test_reenabling_reuses_the_inert_hooks() -> None:
    """Enable after an in-hook disable resumes counting without registering hooks twice."""
    from torch.optim.optimizer import _global_optimizer_post_hooks

    agent, model, optimizer = _setup()
    try:
        registered = len(_global_optimizer_post_hooks)
        agent.control.receive(Command(1, "disable", {"probe": "optimizer"}))
        _step(model, optimizer)
        agent.probes["optimizer"].install()
        _step(model, optimizer, 2)
        agent.drain()
        assert registered == len(_global_optimizer_post_hooks)
        assert 3.0 == agent.store.value("optimizer_steps_total", ("SGD#0",))
    finally:
        agent.shutdown()


def test_trace_covers_exactly_the_requested_steps(tmp_path: Path) -> None:
    """A trace for steps 3..5 records exactly three optimizer steps and reports its path."""
    agent, model, optimizer = _setup()
    try:
        agent.control.receive(Command(7, "trace", {"steps": 3, "start_step": 3, "out": str(tmp_path)}))
        _step(model, optimizer, 8)
        [result] = list(agent.control.results)
        assert (True, 3, 5) == (result.ok, result.data["first_step"], result.data["last_step"])
        events = json.loads(Path(str(result.data["path"])).read_text())["traceEvents"]
        steps = [e for e in events if e.get("name", "").startswith("Optimizer.step#SGD.step")]
        assert 3 == len(steps)
    finally:
        agent.shutdown()


def test_trace_for_a_step_already_past_fails_clearly(tmp_path: Path) -> None:
    """Asking to start at a step the rank already finished is refused with the current step named.

    The command arrives after step 4 and applies at the next boundary, after step 5.
    """
    agent, model, optimizer = _setup()
    try:
        _step(model, optimizer, 4)
        agent.control.receive(Command(2, "trace", {"steps": 2, "start_step": 2, "out": str(tmp_path)}))
        _step(model, optimizer)
        [result] = list(agent.control.results)
        assert (False, "missed the start step 2: this rank already finished step 5; retry with a larger "
                "start margin") == (result.ok, result.message)
    finally:
        agent.shutdown()


def test_status_answers_at_once_and_unknown_commands_are_refused() -> None:
    """status needs no safe point; an unknown command gets a clear failure."""
    agent, model, optimizer = _setup()
    try:
        _step(model, optimizer, 2)
        agent.control.receive(Command(1, "status", {}))
        agent.control.receive(Command(2, "explode", {}))
        status, unknown = list(agent.control.results)
        assert (2, "optimizer") == (status.data["step"], status.data["probes"])
        assert (False, "unknown command 'explode'") == (unknown.ok, unknown.message)
    finally:
        agent.shutdown()


def test_status_shows_the_slowest_autograd_nodes_and_cudagraph_dump_answers() -> None:
    """With the autograd and cudagraphs probes on, status names slow node types and the dump reports trees."""
    agent = local_agent(("optimizer", "autograd", "cudagraphs"))
    assert isinstance(agent, Agent)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        _step(model, optimizer, 2)
        agent.control.receive(Command(1, "status", {}))
        agent.control.receive(Command(2, "cudagraph-dump", {}))
        _step(model, optimizer)
        status, dump = list(agent.control.results)
        assert "AddmmBackward0" in str(status.data["autograd_slowest"])
        assert (True, True, 0) == (dump.ok, dump.data["available"], dump.data["trees"])
    finally:
        agent.shutdown()


def test_commands_that_reinstall_hooks_never_raise_into_the_step() -> None:
    """disable, enable, disable (each re-registering hooks), also with a job's own global post-hook
    registered after attach: every step completes and every command is answered."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    agent, model, optimizer = _setup()
    seen: list[int] = []
    try:
        _step(model, optimizer)
        for n, name in enumerate(["disable", "enable", "disable", "enable"], start=1):
            agent.control.receive(Command(n, name, {"probe": "optimizer"}))
            _step(model, optimizer)
            if n == 2:
                user = register_optimizer_step_post_hook(lambda *_: seen.append(1))
        _step(model, optimizer, 2)
        assert [(n, True) for n in range(1, 5)] == [(r.id, r.ok) for r in agent.control.results]
        assert seen, "the job's own hook ran"
        user.remove()
    finally:
        agent.shutdown()


class _Lookahead(torch.optim.Optimizer):
    """The usual wrapper shape (timm, torch_optimizer, ZeroRedundancyOptimizer): step() steps another."""

    def __init__(self, base: torch.optim.Optimizer) -> None:
        self.base = base
        super().__init__(base.param_groups, {})

    def step(self, closure: object = None) -> None:  # type: ignore[override]
        self.base.step()


def test_a_wrapping_optimizer_counts_steps_and_an_idle_first_optimizer_is_replaced() -> None:
    """The outer optimizer of a wrapper is the main one; an optimizer that stepped first (an LR finder's)
    and then stopped is replaced once another steps twice without it; commands apply throughout."""
    agent, model, finder = _setup()
    try:
        _step(model, finder, 3)
        optimizer = _Lookahead(torch.optim.SGD(model.parameters(), lr=0.1))
        _step(model, optimizer, 2)  # the second step makes it the main optimizer
        agent.control.receive(Command(1, "status", {}))
        agent.control.receive(Command(2, "disable", {"probe": "optimizer"}))
        _step(model, optimizer, 5)
        assert 3 + 2 + 5 - 1 == agent.step  # the first step of the new optimizer is not a boundary
        assert [1, 2] == [r.id for r in agent.control.results]
        assert finder is not None
    finally:
        agent.shutdown()
