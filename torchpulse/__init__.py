"""torchpulse: a profiling daemon for PyTorch training jobs.

`import torchpulse; torchpulse.attach()` starts the in-process agent. This
module stays import-light (no torch) because the daemon imports it too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchpulse.version import __version__

__all__ = ["__version__", "attach", "detach"]

if TYPE_CHECKING:
    from torchpulse.probes.agent.agent import Agent


def attach(**options: Any) -> Agent | None:
    """Start the agent and install its probes; see `torchpulse.probes.attach.attach`."""
    # Imported here, not above: the daemon imports this package too, and must not import torch.
    from torchpulse.probes.attach import attach as _attach

    return _attach(**options)


def detach() -> None:
    """Remove every hook and send the last batch."""
    from torchpulse.probes.attach import detach as _detach

    _detach()
