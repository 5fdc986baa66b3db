"""Warnings about a path or a run that a job would otherwise repeat at every save, logged once each."""

from __future__ import annotations

import structlog

from torchpulse.limits import MAX_LOGGED_ONCE

log = structlog.get_logger("torchpulse.daemon.checkpoints")


class LogOnce:
    def __init__(self) -> None:
        self._logged: set[str] = set()

    def __call__(self, key: str, event: str, level: str = "warning", **fields: object) -> None:
        if key in self._logged:
            return
        if len(self._logged) >= MAX_LOGGED_ONCE:
            self._logged.clear()
        self._logged.add(key)
        getattr(log, level)(event, **fields)

    def news_again(self, key: str) -> None:
        """What `key` reports is news again (its cause went away and may come back)."""
        self._logged.discard(key)
