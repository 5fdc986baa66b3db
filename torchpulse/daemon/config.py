"""Daemon configuration: embedded defaults, a TOML file, then command-line flags.

Every section is a small frozen dataclass validated in `__post_init__`; an
unknown key or a wrong type is a `ConfigError` that names the key.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchpulse.bounds import cut
from torchpulse.daemon.log_settings import LOG_FORMATS, LOG_LEVELS
from torchpulse.paths import DEFAULT_LISTEN, default_socket_path, default_state_dir, socket_path_too_long


class ConfigError(ValueError):
    """A config problem, phrased for the person who wrote the file."""


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    digits = port.removeprefix("-")
    # ASCII digits only: str.isdigit() takes "\u00b2" (then int() fails) and Arabic-Indic "\u0661\u0660"
    # (int() reads it as port 10).
    if not sep or not (digits.isascii() and digits.isdigit()):
        raise ConfigError(f"listen: expected HOST:PORT, got {value!r}")
    # A number that is no port is a different mistake from a malformed address: say which. Its length is
    # checked before int(), which raises ValueError past 4,300 digits (a traceback instead of this line).
    if port.startswith("-") or len(digits.lstrip("0")) > 5 or int(digits) > 65535:
        raise ConfigError(
            f"listen: port {cut(port, 20)} in {cut(value, 80)!r} is out of range: a port is 1 to "
            "65535 (0 picks a free one)"
        )
    host = host.strip("[]")
    if not host:
        # ":PORT" means every interface to Go exporters (node_exporter's --web.listen-address) and
        # loopback to others: either reading exposes or hides /metrics by surprise, so ask which.
        raise ConfigError(
            f"listen: {value!r} names no host; write 127.0.0.1:{port} (this machine only) or "
            f"0.0.0.0:{port} (every interface)"
        )
    return host, int(port)


@dataclass(frozen=True)
class DaemonSection:
    socket: Path = field(default_factory=default_socket_path)
    listen: str = DEFAULT_LISTEN
    state_dir: Path = field(default_factory=default_state_dir)
    log_format: str = "auto"
    log_level: str = "info"
    control_group: str = ""
    textfile: str = ""
    textfile_interval_seconds: float = 15.0

    def __post_init__(self) -> None:
        # Checked here, not left to bind(): its OSError would name neither the key nor the limit.
        too_long = socket_path_too_long(self.socket)
        if too_long is not None:
            raise ConfigError(f"daemon.socket: {str(self.socket)!r}: {too_long}; choose a shorter path")
        try:
            parse_listen(self.listen)
        except ConfigError as exc:
            raise ConfigError(f"daemon.{exc}") from None
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"daemon.log_format: expected auto, json or console, got {self.log_format!r}")
        if self.log_level.lower() not in LOG_LEVELS:
            raise ConfigError(
                f"daemon.log_level: expected debug, info, warning, error or critical, got {self.log_level!r}"
            )
        if self.textfile_interval_seconds <= 0:
            raise ConfigError("daemon.textfile_interval_seconds: must be > 0")


@dataclass(frozen=True)
class RunsSection:
    grace_period_seconds: float = 300.0
    # A run that ended with a rank lost (no goodbye: a crash, a kill) stays longer, so that
    # TorchpulseAgentDown keeps firing until the job comes back or someone has seen it.
    lost_grace_period_seconds: float = 3600.0
    series_limit_per_run: int = 5000
    max_runs: int = 1000
    max_ranks_per_run: int = 1024

    def __post_init__(self) -> None:
        for name in ("grace_period_seconds", "lost_grace_period_seconds"):
            if getattr(self, name) < 0:
                raise ConfigError(f"runs.{name}: must be >= 0")
        for name in ("series_limit_per_run", "max_runs", "max_ranks_per_run"):
            if getattr(self, name) < 1:
                raise ConfigError(f"runs.{name}: must be >= 1")


@dataclass(frozen=True)
class Config:
    daemon: DaemonSection = field(default_factory=DaemonSection)
    runs: RunsSection = field(default_factory=RunsSection)
    # Sections of later features are kept as raw tables until their owners parse them.
    extra: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The file these values came from: the owners of `extra` name it in their errors too.
    source: Path | None = None


KNOWN_EXTRA_SECTIONS = ("checkpoints",)


def _coerce(section: str, key: str, value: Any, hint: Any) -> Any:
    name = f"{section}.{key}"
    origin = typing.get_origin(hint)
    if hint is Path:
        if not isinstance(value, str):
            raise ConfigError(f"{name}: expected a path string, got {type(value).__name__}")
        if not value:
            # Path("") is ".": the socket would be the working directory, the state written into it ("/" under
            # systemd). Leave the key out for its default.
            raise ConfigError(f"{name}: expected a path, got an empty string (leave the key out for the default)")
        return Path(value)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{name}: expected a number, got {type(value).__name__}")
        if not math.isfinite(value):
            # TOML has nan and inf; every comparison with nan is false, so no check would catch it.
            raise ConfigError(f"{name}: expected a finite number, got {value}")
        return float(value)
    if hint in (int, str, bool):
        if type(value) is not hint:
            raise ConfigError(f"{name}: expected {hint.__name__}, got {type(value).__name__}")
        return value
    if origin in (list, tuple) or isinstance(hint, types.GenericAlias):
        if not isinstance(value, list):
            raise ConfigError(f"{name}: expected a list, got {type(value).__name__}")
        return value
    return value


def _section(cls: type[Any], name: str, table: Any) -> Any:
    if not isinstance(table, dict):
        raise ConfigError(f"{name}: expected a table")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in table:
        if key not in known:
            raise ConfigError(f"{name}.{key}: unknown key (known: {', '.join(sorted(known))})")
    values = {key: _coerce(name, key, value, hints[key]) for key, value in table.items()}
    try:
        return cls(**values)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name}: {exc}") from None


def from_mapping(data: dict[str, Any]) -> Config:
    """Build a Config from parsed TOML, rejecting unknown sections and keys."""
    for section, value in data.items():
        if section in ("daemon", "runs", *KNOWN_EXTRA_SECTIONS):
            continue
        if not isinstance(value, dict):
            # A key above the first table header (`listen = ...` without `[daemon]`), not a section.
            owner = next(
                (
                    f"[{cls_name}]"
                    for cls_name, cls in (("daemon", DaemonSection), ("runs", RunsSection))
                    if section in {f.name for f in dataclasses.fields(cls)}
                ),
                None,
            )
            where = f"it belongs under {owner}" if owner else "keys go under [daemon], [runs] or [checkpoints]"
            raise ConfigError(f"{section}: unknown key outside any table ({where})")
        raise ConfigError(f"{section}: unknown section")
    extra = {name: data[name] for name in KNOWN_EXTRA_SECTIONS if name in data}
    for name, table in extra.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{name}: expected a table")
    return Config(
        daemon=_section(DaemonSection, "daemon", data.get("daemon", {})),
        runs=_section(RunsSection, "runs", data.get("runs", {})),
        extra=extra,
    )


def load(path: Path | None) -> Config:
    """Defaults when `path` is None, else the file (errors name the file and key)."""
    if path is None:
        return Config()
    try:
        with path.open("rb") as handle:
            data = tomllib.load(handle)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    # tomllib lets these two through: a file saved in Latin-1 (a "é" in a comment) and arrays nested past the
    # recursion limit. Uncaught, one failed the start with a traceback and a SIGHUP stopped the running daemon.
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not valid TOML: not UTF-8 (byte {exc.start} is {exc.object[exc.start]:#04x})"
        ) from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid TOML: nested too deeply") from None
    try:
        return dataclasses.replace(from_mapping(data), source=path)
    except ConfigError as exc:
        raise in_file(path, exc) from None


def in_file(path: Path | None, error: ConfigError) -> ConfigError:
    """`error` prefixed with the file it is about (unchanged for the embedded defaults)."""
    return error if path is None else ConfigError(f"{path}: {error}")


@dataclass(frozen=True)
class Overrides:
    """Command-line flags: they win over the file, at start and at every reload."""

    socket: Path | None = None
    listen: str | None = None
    state_dir: Path | None = None
    log_format: str | None = None
    log_level: str | None = None


def with_overrides(config: Config, overrides: Overrides) -> Config:
    changes = {
        f.name: getattr(overrides, f.name)
        for f in dataclasses.fields(overrides)
        if getattr(overrides, f.name) is not None
    }
    return dataclasses.replace(config, daemon=dataclasses.replace(config.daemon, **changes))
