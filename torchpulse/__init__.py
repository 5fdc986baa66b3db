"""torchpulse: a profiling daemon for PyTorch training jobs.

`import torchpulse; torchpulse.attach()` starts the in-process agent. This
module stays import-light (no torch) because the daemon imports it too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["__version__", "attach", "detach"]

if TYPE_CHECKING:
    from torchpulse.probes.agent import Agent


def attach(**options: Any) -> Agent | None:
    """Start the agent and install its probes; see `torchpulse.probes.api.attach`."""
    from torchpulse.probes.api import attach as _attach

    return _attach(**options)


def detach() -> None:
    """Remove every hook and send the last batch."""
    from torchpulse.probes.api import detach as _detach

    _detach()
