"""Bounds on what a process writes about others: text cut to a length, events to a rate.

Shared by the daemon (what agents and clients send it, before it reaches the journal), the
checkpoint validator (findings) and the probes (their own warnings).
"""

from __future__ import annotations


def cut(text: str, limit: int) -> str:
    """`text`, or its first `limit` characters and how many more there were."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit:,} more characters)"


class TokenBucket:
    """`burst` events at once, then `rate` a second; counts the refused ones in `suppressed`."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self._tokens = burst
        self._stamp = now
        self.suppressed = 0

    def take(self, now: float) -> bool:
        """Whether one more event may go out at `now` (a monotonic time); a refused one is counted."""
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        self.suppressed += 1
        return False
