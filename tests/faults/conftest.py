"""Fault tests reuse the watcher's real saved checkpoint."""

from tests.daemon.checkpoints.conftest import saved_checkpoint

__all__ = ["saved_checkpoint"]
