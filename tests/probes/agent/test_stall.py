"""A rank that stops stepping: its stall flag, its threshold, and the training thread's stack."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from tests.support import local_agent
from torchpulse.probes.agent.agent import Agent
from torchpulse.probes.agent.stall import STALL_INTERVAL_FACTOR

STALLED = "rank stalled: no optimizer step for longer than its threshold"


@pytest.fixture
def agent() -> Iterator[Agent]:
    """An agent with the optimizer probe whose stall threshold is 0.3 s (the sender never runs: drain() is it)."""
    made = local_agent(("optimizer",), stall_seconds=0.3, first_step_stall_seconds=1.0)
    assert isinstance(made, Agent)
    yield made
    made.shutdown()


def _steps(optimizer: torch.optim.Optimizer, model: torch.nn.Module, count: int, every: float = 0.0) -> None:
    for _ in range(count):
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(every)


def _events(agent: Agent, event: str) -> list[dict[str, object]]:
    return [dict(e.fields) for e in list(agent._events) if e.event == event]


def _parked_in_a_function_of_the_test(release: threading.Event) -> None:
    release.wait(30)


def test_a_rank_is_flagged_when_it_stops_stepping_and_cleared_when_it_steps_again(agent: Agent) -> None:
    """The flag is 0 from the start, 1 once no step came for the threshold (logged once, with the stack of
    the thread that steps: here, the test's), and 0 again at the next step; the last step's time is exported."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert 0.0 == agent.store.value("agent_stalled", ())
    _steps(optimizer, model, 3)
    before = time.time()
    agent.drain()
    assert 0.0 == agent.store.value("agent_stalled", ())
    last = agent.store.value("agent_last_step_timestamp_seconds", ())
    assert last is not None and before - 1.0 < last <= before + 0.01
    time.sleep(0.4)
    agent.drain()
    agent.drain()  # once per stall, not once per flush
    [stalled] = _events(agent, STALLED)
    assert (1.0, 3, "MainThread") == (agent.store.value("agent_stalled", ()), stalled["step"], stalled["thread"])
    assert 0.3 == stalled["threshold_seconds"]
    assert ", in test_a_rank_is_flagged_when_it_stops_stepping_and_cleared_when_it_steps_again\n" in str(
        stalled["stack"]
    )
    _steps(optimizer, model, 1)
    agent.drain()
    assert (0.0, 1) == (agent.store.value("agent_stalled", ()), len(_events(agent, "rank resumed stepping")))


def test_before_its_first_step_a_rank_has_the_first_step_threshold(agent: Agent) -> None:
    """Compiles and data loading come before the first step: 1 s here, not the 0.3 s of later steps."""
    torch.nn.Linear(2, 2)(torch.ones(1, 2)).sum().backward()  # a probe saw training: the agent is active
    agent.record(lambda: None)
    assert 1.0 == agent.stall.threshold()
    time.sleep(0.4)
    agent.drain()
    assert 0.0 == agent.store.value("agent_stalled", ())
    time.sleep(0.7)
    agent.drain()
    assert 1.0 == agent.store.value("agent_stalled", ())


def test_slow_steps_raise_the_threshold_to_ten_times_their_p99(agent: Agent) -> None:
    """A job whose steps take 0.1 s pages after 10 x 0.1 s, not after the configured 0.3 s."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _steps(optimizer, model, 4, every=0.1)
    assert STALL_INTERVAL_FACTOR * 0.1 <= agent.stall.threshold() < STALL_INTERVAL_FACTOR * 0.2
    time.sleep(0.3)
    agent.drain()
    assert 0.0 == agent.store.value("agent_stalled", ())


def test_stacks_answers_at_once_with_the_stack_of_the_thread_that_steps(agent: Agent) -> None:
    """The job trains in a thread of its own, now parked in a function: `stacks` shows that function there, and
    how long ago the thread stepped, without waiting for a step boundary that will not come."""
    release = threading.Event()

    def train() -> None:
        model = torch.nn.Linear(2, 2)
        _steps(torch.optim.SGD(model.parameters(), lr=0.1), model, 2)
        _parked_in_a_function_of_the_test(release)

    trainer = threading.Thread(target=train, name="trainer")
    trainer.start()
    try:
        deadline = time.monotonic() + 10
        while ", in _parked_in_a_function_of_the_test\n" not in str(agent.control.stacks()["stack"]):
            assert time.monotonic() < deadline, agent.control.stacks()
            time.sleep(0.01)
        answer = agent.control.stacks()
        assert ("trainer", 2) == (answer["thread"], answer["step"])
        since = answer["seconds_since_step"]
        assert isinstance(since, float) and 0 <= since < 10
    finally:
        release.set()
        trainer.join()
