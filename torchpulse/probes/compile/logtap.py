"""Read torch's log records without changing what the job prints.

A handler would not do: `logger.info()` drops a record before any handler runs
unless the logger is enabled for INFO, and adding a handler to a
non-propagating torch artifact logger silences Python's `lastResort` output.
So a tap is a *logger filter*: when the logger is not enabled for the level we
need, the tap lowers that logger's level and then refuses (for everyone) each
record the logger would not have passed before, so propagation, torch's own
stderr handlers and the user's root handlers see exactly what they saw before.
Whoever sets the level later (`torch._logging.set_logs`, the user, dictConfig)
sets the baseline: the tap answers that logger's `setLevel`, because the level's
value alone cannot tell, when it equals the tap's own, whose it is now.
`refresh()` catches what bypasses `setLevel` (an assignment to `.level`).
A logger that a logging configuration disabled (`dictConfig`/`fileConfig` with
`disable_existing_loggers`, their default, disable every logger that exists, torch's
included) drops records before any filter: the tap re-enables it with a falsy
non-bool marker and refuses every record, until a configuration writes `disabled` again.
Known gap: `logging.disable(level)` still hides records from the tap.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Final

Sink = Callable[[logging.LogRecord], None]
# What the tap writes to `logger.disabled` of a logger others disabled: falsy, so logging passes records
# to the filters, and no bool, so a configuration that enables or disables the logger later (it writes
# True or False) tells from it.
_ENABLED_BY_TAP: Final = 0

_lock: Final = threading.Lock()
_taps: dict[str, _LoggerTap] = {}


class _LoggerTap(logging.Filter):
    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self.logger = logger
        self.sinks: dict[int, tuple[int, Sink]] = {}
        self._baseline = logger.level  # the level the logger has without us
        self._applied: int | None = None  # the level we set, None when we set nothing
        self._undisabled = False  # the logger is disabled for everyone else; only the tap enabled it
        self._set_level = self._set_by_others  # one bound method, so that detach() recognises it

    def attach(self) -> None:
        self.logger.addFilter(self)
        # An instance attribute shadows Logger.setLevel for this logger only.
        setattr(self.logger, "setLevel", self._set_level)  # noqa: B010

    def detach(self) -> None:
        self.logger.removeFilter(self)
        if self.logger.__dict__.get("setLevel") is self._set_level:
            delattr(self.logger, "setLevel")

    def _set_by_others(self, level: int | str) -> None:
        logging.Logger.setLevel(self.logger, level)  # validates, and clears logging's level caches
        with _lock:
            if _taps.get(self.logger.name) is not self:
                return  # a caller kept `logger.setLevel` from before our detach
            self._baseline = self.logger.level
            self._applied = None
            self.apply()

    def _write(self, level: int) -> None:
        logging.Logger.setLevel(self.logger, level)

    # -- level bookkeeping (under _lock) -------------------------------------
    def _sync_disabled(self) -> None:
        state = self.logger.disabled
        if _by_tap(state):
            return
        self._undisabled = bool(state)
        if self._undisabled:
            self.logger.disabled = _ENABLED_BY_TAP  # type: ignore[assignment]

    def _needed(self) -> int:
        return min((level for level, _sink in self.sinks.values()), default=logging.CRITICAL)

    def apply(self) -> None:
        self._sync_disabled()
        if self._applied is not None and self.logger.level != self._applied:
            # Someone else set a level after us: theirs is the new baseline.
            self._baseline = self.logger.level
            self._applied = None
        if self._applied is None:
            self._baseline = self.logger.level
        needed = self._needed()
        if self._baseline_effective() <= needed:
            if self._applied is not None:
                self._write(self._baseline)
                self._applied = None
            return
        if self.logger.level != needed:
            self._write(needed)
        self._applied = needed

    def restore(self) -> None:
        if self._applied is not None and self.logger.level == self._applied:
            self._write(self._baseline)
        self._applied = None
        if self._undisabled and _by_tap(self.logger.disabled):
            self.logger.disabled = True
        self._undisabled = False

    def _baseline_effective(self) -> int:
        if self._baseline != logging.NOTSET:
            return self._baseline
        parent = self.logger.parent
        return parent.getEffectiveLevel() if parent is not None else logging.WARNING

    # -- per record ----------------------------------------------------------
    def hides(self, record: logging.LogRecord) -> bool:
        if self._undisabled:
            if _by_tap(self.logger.disabled):
                return True
            self._undisabled = False  # a configuration enabled the logger since: its level decides again
        return self._applied is not None and record.levelno < self._baseline_effective()

    def filter(self, record: logging.LogRecord) -> bool:
        for level, sink in list(self.sinks.values()):
            if record.levelno >= level:
                # A sink must never break torch's logging call.
                with contextlib.suppress(Exception):
                    sink(record)
        return not self.hides(record)


def _by_tap(disabled: object) -> bool:
    """Whether a `logger.disabled` value is the tap's marker (logging itself only tests truthiness)."""
    return type(disabled) is int and disabled == _ENABLED_BY_TAP


class LogTap:
    """A removable subscription of `sink` to records of `logger_name` at `level` and above."""

    def __init__(self, logger_name: str, level: int, sink: Sink) -> None:
        self.logger_name = logger_name
        with _lock:
            tap = _taps.get(logger_name)
            if tap is None:
                tap = _taps[logger_name] = _LoggerTap(logging.getLogger(logger_name))
                tap.attach()
            tap.sinks[id(self)] = (level, sink)
            tap.apply()
        self._tap: _LoggerTap | None = tap

    def refresh(self) -> None:
        """Re-assert the level if another party changed it (cheap when nothing changed)."""
        tap = self._tap
        if (
            tap is not None
            and tap._applied is not None
            and tap.logger.level == tap._applied
            and not tap.logger.disabled
        ):
            return
        if tap is not None:
            with _lock:
                tap.apply()

    def hides(self, record: logging.LogRecord) -> bool:
        """Whether the logger passes `record` only because of taps: everyone else refuses it."""
        tap = self._tap
        return tap is not None and tap.hides(record)

    def remove(self) -> None:
        tap, self._tap = self._tap, None
        if tap is None:
            return
        with _lock:
            tap.sinks.pop(id(self), None)
            if tap.sinks:
                tap.apply()
                return
            tap.restore()
            tap.detach()
            if _taps.get(self.logger_name) is tap:
                del _taps[self.logger_name]
