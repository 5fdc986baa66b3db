"""The `[checkpoints]` section: which roots to watch, how, and how to validate.

`Config.extra["checkpoints"]` holds the raw TOML table; `parse` turns it into
a frozen `CheckpointsConfig` and raises `ConfigError` naming the key.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from torchpulse.daemon.config import Config, ConfigError, in_file

OBSERVERS: Final = ("auto", "inotify", "polling")
LEVELS: Final = ("metadata", "data", "load")


@dataclass(frozen=True)
class RootConfig:
    """One configured root; `observer` overrides the section's for this root only."""

    path: str
    observer: str = "auto"

    def __post_init__(self) -> None:
        if not Path(self.path).is_absolute():
            raise ConfigError(f"checkpoints.roots: {self.path!r} is not an absolute path")
        if self.observer not in OBSERVERS:
            raise ConfigError(f"checkpoints.roots: observer of {self.path!r}: expected auto, inotify or polling")


@dataclass(frozen=True)
class CheckpointsConfig:
    roots: tuple[RootConfig, ...] = ()
    level: str = "data"
    observer: str = "auto"
    poll_interval_seconds: float = 5.0
    incomplete_after_seconds: float = 1800.0
    max_concurrent_validations: int = 1
    validation_timeout_seconds: float = 600.0
    validation_memory_limit_bytes: int = 4 << 30
    # Directories announced by agents become roots too; past this many, their
    # metrics share the root label "other" (Prometheus cardinality).
    max_announced_roots: int = 16
    # An announced root with no announcement for this long is no longer watched
    # and its series go away: jobs end, and their slots are needed by new ones.
    announced_root_ttl_seconds: float = 7 * 24 * 3600.0
    # Quiet time after `.metadata` appears before validating, so a burst of
    # events (rename, then attribute changes) makes one validation.
    debounce_seconds: float = 0.2

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ConfigError(f"checkpoints.level: expected metadata, data or load, got {self.level!r}")
        if self.observer not in OBSERVERS:
            raise ConfigError(f"checkpoints.observer: expected auto, inotify or polling, got {self.observer!r}")
        positive = (
            "poll_interval_seconds",
            "incomplete_after_seconds",
            "validation_timeout_seconds",
            "announced_root_ttl_seconds",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"checkpoints.{name}: must be > 0")
        if self.max_concurrent_validations < 1:
            raise ConfigError("checkpoints.max_concurrent_validations: must be >= 1")
        if self.validation_memory_limit_bytes < 1 << 20:
            raise ConfigError("checkpoints.validation_memory_limit_bytes: must be >= 1048576")
        if self.max_announced_roots < 0:
            raise ConfigError("checkpoints.max_announced_roots: must be >= 0")
        if self.debounce_seconds < 0:
            raise ConfigError("checkpoints.debounce_seconds: must be >= 0")
        paths = [root.path for root in self.roots]
        if len(set(paths)) != len(paths):
            raise ConfigError("checkpoints.roots: a root is listed twice")


_NUMBERS: Final = {
    "poll_interval_seconds": float,
    "incomplete_after_seconds": float,
    "validation_timeout_seconds": float,
    "debounce_seconds": float,
    "announced_root_ttl_seconds": float,
    "max_concurrent_validations": int,
    "validation_memory_limit_bytes": int,
    "max_announced_roots": int,
}
_STRINGS: Final = ("level", "observer")


def _root(entry: Any) -> RootConfig:
    if isinstance(entry, str):
        return RootConfig(os.path.normpath(entry))
    if isinstance(entry, Mapping):
        unknown = set(entry) - {"path", "observer"}
        if unknown:
            raise ConfigError(f"checkpoints.roots: unknown key {sorted(unknown)[0]!r} (known: observer, path)")
        path, observer = entry.get("path"), entry.get("observer", "auto")
        if not isinstance(path, str) or not isinstance(observer, str):
            raise ConfigError("checkpoints.roots: a table entry needs path (string) and optional observer (string)")
        return RootConfig(os.path.normpath(path), observer)
    raise ConfigError(f"checkpoints.roots: expected a path string or a table, got {type(entry).__name__}")


def parse(table: Mapping[str, Any]) -> CheckpointsConfig:
    """Validate the raw `[checkpoints]` table."""
    values: dict[str, Any] = {}
    for key, value in table.items():
        if key == "roots":
            if not isinstance(value, list):
                raise ConfigError(f"checkpoints.roots: expected a list, got {type(value).__name__}")
            values["roots"] = tuple(_root(entry) for entry in value)
        elif key in _NUMBERS:
            kind = _NUMBERS[key]
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or (kind is int and not isinstance(value, int))
            ):
                raise ConfigError(
                    f"checkpoints.{key}: expected {'an integer' if kind is int else 'a number'}, "
                    f"got {type(value).__name__}"
                )
            if not math.isfinite(value):
                raise ConfigError(f"checkpoints.{key}: expected a finite number, got {value}")
            values[key] = kind(value)
        elif key in _STRINGS:
            if not isinstance(value, str):
                raise ConfigError(f"checkpoints.{key}: expected str, got {type(value).__name__}")
            values[key] = value
        else:
            known = sorted(["roots", *_NUMBERS, *_STRINGS])
            raise ConfigError(f"checkpoints.{key}: unknown key (known: {', '.join(known)})")
    return CheckpointsConfig(**values)


def from_config(config: Config) -> CheckpointsConfig:
    """The parsed `[checkpoints]` section; its errors name the config file, as the others do."""
    try:
        return parse(config.extra.get("checkpoints", {}))
    except ConfigError as exc:
        raise in_file(config.source, exc) from None
