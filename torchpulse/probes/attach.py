"""attach() / detach(): the one call a training script needs."""

from __future__ import annotations

import atexit
import os
import threading
from typing import TYPE_CHECKING

from torchpulse.probes.agent import exit_status
from torchpulse.probes.agent.agent import Agent
from torchpulse.probes.agent.config import AgentConfig
from torchpulse.probes.agent.identity import current_identity
from torchpulse.probes.agent.logs import get_logger
from torchpulse.probes.families import FAMILY_TABLE

if TYPE_CHECKING:
    from torchpulse.probes.agent.store import MetricStore

log = get_logger("torchpulse.agent")

# Oldest torch the probes attach to (with a logged reason per missing feature below 2.10).
MIN_TORCH = (2, 4)

_lock = threading.Lock()
_agent: Agent | None = None
_fork_hook_registered = False
# ((pid, run, rank), running totals) of the agent detach() stopped last: an attach() after it, as the same
# run and rank, continues them. The daemon knows a process by its pid and start time and keeps its series;
# totals sent again from 0 would run backwards. Another run or rank starts from empty series.
_previous_store: tuple[tuple[int, str, int], MetricStore] | None = None


def current_agent() -> Agent | None:
    agent = _agent
    return agent if agent is not None and agent.enabled and agent.pid == os.getpid() else None


def _torch_supported() -> bool:
    import torch

    try:
        major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    except ValueError:
        return True
    if (major, minor) < MIN_TORCH:
        log.warning("torch too old for torchpulse probes; not attaching", torch_version=torch.__version__)
        return False
    return True


def attach(
    *,
    probes: tuple[str, ...] | list[str] | None = None,
    socket: str | None = None,
    run: str | None = None,
    **config: object,
) -> Agent | None:
    """Start this process's agent and install the probes (all configured ones by default).

    Attaching twice returns the running agent with a warning. Returns None when
    torch is too old.
    """
    global _agent, _fork_hook_registered
    with _lock:
        if current_agent() is not None:
            log.warning("torchpulse already attached in this process; ignoring the second attach()")
            return _agent
        if not _torch_supported():
            return None
        env = dict(os.environ)
        if run is not None:
            env["TORCHPULSE_RUN"] = run
        agent_config = AgentConfig.from_env(
            env, socket_path=socket, probes=tuple(probes) if probes is not None else None, **config
        )
        identity = current_identity(env)
        previous = _previous_store
        agent = Agent(
            agent_config,
            identity,
            FAMILY_TABLE,
            previous[1] if previous is not None and previous[0] == (os.getpid(), identity.run, identity.rank) else None,
        )
        for name in agent_config.probes:
            probe = FAMILY_TABLE.make(name, agent)
            if probe is not None:
                probe.install()
                agent.probes[name] = probe
        agent.control.install()
        exit_status.install()
        agent.start()
        _agent = agent
        if not _fork_hook_registered:
            os.register_at_fork(after_in_child=_after_fork_in_child)
            atexit.register(_at_exit)
            _fork_hook_registered = True
        return agent


def detach() -> None:
    """Uninstall every probe, send the last batch and stop the agent thread."""
    _detach(goodbye=True)


def _detach(goodbye: bool) -> None:
    global _agent, _previous_store
    with _lock:
        agent, _agent = _agent, None
    if agent is not None:
        exit_status.uninstall()
        agent.shutdown(goodbye=goodbye)
        if agent.stopped:
            _previous_store = ((agent.pid, agent.identity.run, agent.identity.rank), agent.store)


def _after_fork_in_child() -> None:
    global _agent, _lock, _previous_store
    _previous_store = None
    # Another thread may have held the lock at fork time; the child starts clean.
    _lock = threading.Lock()
    agent, _agent = _agent, None
    exit_status.forget()
    if agent is not None:
        agent.forget_after_fork()


def _at_exit() -> None:
    agent = _agent
    if agent is not None and agent.pid == os.getpid():
        # A failing process sends its last values but no goodbye: the daemon shows the rank
        # gone, not exited, and the down alert fires for it as for a killed one.
        failure = exit_status.failure()
        if failure is not None and agent.reports():  # an event would make a process that never trained connect
            agent.emit("warning", "process exiting on failure", cause=failure)
        _detach(goodbye=failure is None)
