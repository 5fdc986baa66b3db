"""Checks of a command's arguments, made on the sender thread the moment it arrives.

A typo is then answered at once, also by a rank that is not stepping, and what
reaches the training thread is known to be in range: a huge `steps` would keep
the profiler recording into the job's memory, a tiny rate gives a sampling
period msgpack cannot carry back, an unbounded `passes` logs every node for
ever.
"""

from __future__ import annotations

import math
from collections.abc import Collection

from torchpulse.limits import MAX_LOG_PASSES, MAX_TRACE_STEPS, MIN_SAMPLE_RATE
from torchpulse.probes.agent import trace_capture
from torchpulse.probes.agent.config import unknown_probe_error
from torchpulse.protocol import CALLER_UID_ARG, Command


class CommandFailed(Exception):
    """A command that cannot be done; its text is what the user sees."""


def check_arguments(command: Command, probes: Collection[str]) -> int | None:
    """Raise CommandFailed naming the first bad argument of a command applied at a step boundary.

    A trace's directory is opened here, once, and returned (the caller keeps or closes it): the
    trace is written into the directory checked now, and the training thread never waits on it.
    `probes` are the probe names this agent knows.
    """
    args, name = command.args, command.name
    if name in ("enable", "disable", "sample"):
        probe = args.get("probe")
        if not isinstance(probe, str) or not probe:
            raise CommandFailed("missing argument: probe")
        if (error := unknown_probe_error(probe, probes)) is not None:
            raise CommandFailed(error)
    if name == "sample":
        rate = args.get("rate")
        if (
            not isinstance(rate, int | float)
            or isinstance(rate, bool)
            or not math.isfinite(rate)
            or not (rate == 0 or MIN_SAMPLE_RATE <= rate <= 1)
        ):
            raise CommandFailed(f"rate must be 0 (off) or a number from {MIN_SAMPLE_RATE:g} to 1, got {_shown(rate)}")
    elif name == "autograd-log":
        _count(args.get("passes"), "passes", MAX_LOG_PASSES)
    elif name == "trace":
        _count(args.get("steps"), "steps", MAX_TRACE_STEPS)
        start = args.get("start_step")
        if start is not None and (not isinstance(start, int) or isinstance(start, bool)):
            raise CommandFailed(f"start_step must be an integer, got {_shown(start)}")
        try:
            return trace_capture.open_out_dir(args.get("out"), args.get(CALLER_UID_ARG))
        except ValueError as exc:
            raise CommandFailed(str(exc)) from None
    return None


def _shown(value: object) -> str:
    return repr(value)[:40]


def _count(value: object, name: str, most: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= most:
        raise CommandFailed(f"{name} must be an integer from 1 to {most}, got {_shown(value)}")
