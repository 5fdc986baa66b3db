"""Fault tests reuse the watcher's real saved checkpoint."""

from tests.watcher.conftest import saved_checkpoint

__all__ = ["saved_checkpoint"]
