"""structlog set-up for the daemon: JSON under systemd, readable on a terminal."""

from __future__ import annotations

import logging
import sys

import structlog


def configure(log_format: str = "auto", level: str = "info") -> None:
    use_json = log_format == "json" or (log_format == "auto" and not sys.stderr.isatty())
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


class EventBudget:
    """How many of one agent's log events the daemon writes: a token bucket, counting what it refuses.

    Agents' events become daemon log lines. A buggy or hostile agent can send thousands
    per frame for as long as it runs; written one by one they fill the journal, whose own
    rate limit then drops the daemon's lines about every other job too. A burst (a
    `ctl autograd-log` pass of a large model) is kept whole; past it, `rate` a second.
    """

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self._tokens = burst
        self._stamp = now
        self.suppressed = 0

    def take(self, now: float) -> bool:
        """Whether one more event may be written now; refused ones are counted in `suppressed`."""
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        self.suppressed += 1
        return False
