"""The probe families, in one table: the only place that names them.

The agent core never imports a family; `attach()` hands the core this table
(a `ProbeFactory`), and the control channel's `ctl enable NAME` makes a probe
through it. A family's module is imported only when its probe is made: the
compile probe's module reads Dynamo's surfaces, and a job that runs without it
should not pay for the import. Importing this module imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Final

from torchpulse.probes.agent.config import OptionError, unknown_probe_error
from torchpulse.probes.agent.logs import get_logger

if TYPE_CHECKING:
    from torchpulse.probes.agent.agent import Agent
    from torchpulse.probes.agent.probe import Probe

log = get_logger("torchpulse.agent")

# Probe name -> "module:Class" of a Probe subclass.
FAMILIES: Final[dict[str, str]] = {
    "optimizer": "torchpulse.probes.optimizer:OptimizerProbe",
    "compile": "torchpulse.probes.compile.probe:CompileProbe",
    "cudagraphs": "torchpulse.probes.cudagraphs.probe:CudaGraphProbe",
    "autograd": "torchpulse.probes.autograd.probe:AutogradProbe",
    "checkpoint": "torchpulse.probes.checkpoint:CheckpointProbe",
}


class Families:
    """Makes the probes of `FAMILIES` (the agent core's `ProbeFactory`)."""

    known: frozenset[str] = frozenset(FAMILIES)

    def make(self, name: str, agent: Agent) -> Probe | None:
        """A new probe of family `name`, or None (logged) where it is unknown, misconfigured or cannot run."""
        if (error := unknown_probe_error(name, self.known)) is not None:
            log.warning("unknown probe; skipped", probe=name, error=error)
            return None
        target = FAMILIES[name]
        # Here, not at the top: `torchpulse run` checks `--probes` against this table without importing torch.
        from torchpulse.probes.agent.probe import Probe

        module_name, _, class_name = target.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
            if not (isinstance(cls, type) and issubclass(cls, Probe)):
                raise TypeError(f"{target} is not a Probe")
            return cls(agent)
        except OptionError as exc:
            log.warning("probe option invalid; probe skipped", probe=name, error=str(exc))
        except Exception as exc:
            log.warning("probe unavailable on this torch; skipped", probe=name, error=repr(exc))
        return None


FAMILY_TABLE: Final = Families()
