"""Allowed values of the daemon's log settings: `daemon.log_format`/`--log-format`, `daemon.log_level`/
`--log-level`, and the levels an agent's log event may carry. Nothing imported: the CLI's parser reads it."""

from __future__ import annotations

from typing import Final

LOG_FORMATS: Final = ("auto", "json", "console")
LOG_LEVELS: Final = ("debug", "info", "warning", "error", "critical")
