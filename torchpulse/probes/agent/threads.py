"""What a thread is doing, as the agent's hooks and its sender thread mark it.

Removing a hook while torch iterates that hook table raises in the job, so a
probe that fails inside one of our hooks, or on the agent's own thread (while
the training thread may be iterating), leaves its hooks inert instead. Kept
apart from the probe base so that the sender marks its thread without
importing probes.
"""

from __future__ import annotations

import threading

_state = threading.local()


def inside_hook() -> bool:
    """True while this thread runs one of our hooks, i.e. while torch iterates a hook table."""
    return getattr(_state, "depth", 0) > 0


def enter_hook() -> None:
    _state.depth = getattr(_state, "depth", 0) + 1


def leave_hook() -> None:
    _state.depth -= 1


def mark_agent_thread() -> None:
    """Called by the agent's own thread: probes failing there must not touch hook tables."""
    _state.agent_thread = True


def on_agent_thread() -> bool:
    return bool(getattr(_state, "agent_thread", False))
