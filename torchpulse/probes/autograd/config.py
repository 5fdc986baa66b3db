"""Settings of the autograd probe, read from `TORCHPULSE_OPT_AUTOGRAD_*` options."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from torchpulse.probes.agent.config import OptionError, option_variable, parse_int_option

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


@dataclass(frozen=True)
class AutogradConfig:
    """Validated settings; `from_options` maps `autograd_<field>` options onto the fields."""

    # A sampled pass costs ~7 µs per node (hook registration dominates); one in
    # 100 keeps the amortized cost far below the 0.5% budget even for
    # launch-bound GPU steps with thousands of nodes.
    sample_every: int = 100
    # Node types exported with their own label; the rest fold into `other`.
    top_nodes: int = 20
    # Slowest nodes of the last sampled pass kept for `torchpulse status`.
    slowest_kept: int = 10
    nonfinite: bool = True
    # Export the global gradient norm as a gauge (the check computes it either way; off keeps a
    # series that few dashboards read out of the exposition).
    grad_norm: bool = False
    # Autograd logging for the first N passes (the control channel can ask later).
    log_passes: int = 0
    # Checks whose device-side result is not yet readable; more means the
    # device is far behind and the oldest is dropped rather than waited for.
    max_pending_checks: int = 16
    # Parameter names listed in one non-finite log event.
    max_names_logged: int = 16

    def __post_init__(self) -> None:
        if self.sample_every < 0:
            raise ValueError("autograd sample_every must be >= 0 (0 disables node timing)")
        if self.top_nodes < 1 or self.slowest_kept < 0:
            raise ValueError("autograd top_nodes must be >= 1 and slowest_kept >= 0")
        if self.log_passes < 0:
            raise ValueError("autograd log_passes must be >= 0")
        if self.max_pending_checks < 1 or self.max_names_logged < 1:
            raise ValueError("autograd max_pending_checks and max_names_logged must be >= 1")

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> AutogradConfig:
        """Raises OptionError naming the variable of a value that cannot be used."""
        values: dict[str, Any] = {}
        for spec in fields(cls):
            name = f"autograd_{spec.name}"
            raw = options.get(name)
            if raw is None:
                continue
            # Ranges are the dataclass's to check (below), with every setting given named.
            values[spec.name] = _parse_bool(name, raw) if spec.type == "bool" else parse_int_option(name, raw)
        try:
            return cls(**values)
        except ValueError as exc:
            given = ", ".join(option_variable(f"autograd_{k}") for k in sorted(values))
            raise OptionError(f"{exc} (set by {given})") from None


def _parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise OptionError(f"{option_variable(name)}: expected a boolean (1/0, true/false, yes/no, on/off), got {raw!r}")
