"""Agent settings, from keyword arguments or the TORCHPULSE_* environment."""

from __future__ import annotations

import math
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from torchpulse.paths import agent_socket_path

DEFAULT_PROBES = ("optimizer", "autograd", "compile", "cudagraphs", "checkpoint")
# What a probe's own bug does (TORCHPULSE_PROBE_ERRORS): "disable" logs it once, counts it and switches that probe
# off while the job trains on; "fatal" ends the process with the traceback, for the probes' own tests and CI,
# where a probe that quietly disabled itself would let a broken probe's test pass.
PROBE_ERROR_MODES = ("disable", "fatal")


class OptionError(ValueError):
    """A probe option that cannot be used; the message names the variable that set it."""


def option_variable(name: str) -> str:
    """The environment variable that sets probe option `name` (`attach(options=...)` uses `name`)."""
    return f"TORCHPULSE_OPT_{name.upper()}"


def parse_int_option(name: str, raw: str) -> int:
    """The value `raw` of probe option `name` as an integer."""
    try:
        return int(str(raw).strip())
    except ValueError:
        raise OptionError(f"{option_variable(name)}: expected an integer, got {raw!r}") from None


def int_option(options: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    """Probe option `name` as an integer >= `minimum`, or `default` when unset."""
    raw = options.get(name)
    if raw is None:
        return default
    value = parse_int_option(name, raw)
    if value < minimum:
        raise OptionError(f"{option_variable(name)}: must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class AgentConfig:
    socket_path: Path
    probes: tuple[str, ...] = DEFAULT_PROBES
    flush_interval: float = 0.25
    # Records the hot path may queue before it drops: about a minute of a fast
    # job's events, a few MB at most.
    buffer_capacity: int = 65536
    max_pending_events: int = 2048
    connect_timeout: float = 1.0
    send_timeout: float = 2.0
    backoff_initial: float = 0.25
    backoff_max: float = 5.0
    optimizer_state_every: int = 100
    probe_errors: str = "disable"
    # A rank is stalled after this long without an optimizer step (or 10x its recent p99 step interval, if
    # longer): TORCHPULSE_STALL_SECONDS; before its first step after TORCHPULSE_FIRST_STEP_STALL_SECONDS.
    stall_seconds: float = 60.0
    first_step_stall_seconds: float = 1800.0
    options: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.flush_interval <= 0:
            raise ValueError("flush_interval must be > 0")
        if self.buffer_capacity < 1 or self.max_pending_events < 1:
            raise ValueError("buffer_capacity and max_pending_events must be >= 1")
        if not 0 < self.backoff_initial <= self.backoff_max:
            raise ValueError("need 0 < backoff_initial <= backoff_max")
        if self.optimizer_state_every < 1:
            raise ValueError("optimizer_state_every must be >= 1")
        if not (self.stall_seconds > 0 and self.first_step_stall_seconds > 0):
            raise ValueError("stall_seconds and first_step_stall_seconds must be > 0")
        if self.probe_errors not in PROBE_ERROR_MODES:
            raise ValueError(f"TORCHPULSE_PROBE_ERRORS: expected disable or fatal, got {self.probe_errors!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> AgentConfig:
        """Build from TORCHPULSE_SOCKET, TORCHPULSE_PROBES, TORCHPULSE_FLUSH_INTERVAL, TORCHPULSE_PROBE_ERRORS,
        TORCHPULSE_STALL_SECONDS and TORCHPULSE_FIRST_STEP_STALL_SECONDS."""
        env = os.environ if env is None else env
        values: dict[str, object] = {"socket_path": agent_socket_path(env)}
        if env.get("TORCHPULSE_PROBES"):
            values["probes"] = probe_names(env["TORCHPULSE_PROBES"])
        if env.get("TORCHPULSE_FLUSH_INTERVAL"):
            values["flush_interval"] = _seconds(env["TORCHPULSE_FLUSH_INTERVAL"], "TORCHPULSE_FLUSH_INTERVAL")
        for variable, key in (
            ("TORCHPULSE_STALL_SECONDS", "stall_seconds"),
            ("TORCHPULSE_FIRST_STEP_STALL_SECONDS", "first_step_stall_seconds"),
        ):
            if env.get(variable):
                values[key] = _seconds(env[variable], variable)
        if env.get("TORCHPULSE_PROBE_ERRORS"):
            values["probe_errors"] = env["TORCHPULSE_PROBE_ERRORS"].strip()
        values["options"] = {
            k[len("TORCHPULSE_OPT_") :].lower(): v for k, v in env.items() if k.startswith("TORCHPULSE_OPT_")
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        if isinstance(values["socket_path"], str):
            values["socket_path"] = Path(values["socket_path"])
        return cls(**values)  # type: ignore[arg-type]


def probe_names(text: str) -> tuple[str, ...]:
    """The probes a comma-separated list names (TORCHPULSE_PROBES, `torchpulse run --probes`), blanks dropped."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def unknown_probe_error(name: str, known: Collection[str], *, option: str | None = None) -> str | None:
    """None when `name` is one of the `known` probe names; else what to tell the user (`option`: where it came from).

    The agent core gets `known` from the probe families' table (`ProbeFactory.known`), never by importing it.
    """
    if name in known:
        return None
    source = f" in {option}" if option is not None else ""
    return f"unknown probe {name[:64]!r}{source} (known: {known_list(known)})"


def known_list(known: Collection[str]) -> str:
    """Probe names as the user reads them in a message: "autograd, checkpoint, ..."."""
    return ", ".join(sorted(known))


def _seconds(raw: str, variable: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:  # nan fails too
        raise ValueError(f"{variable}: expected seconds (a number > 0), got {raw!r}")
    return value
