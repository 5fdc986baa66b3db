"""The feature table: each private torch surface a probe reads is detected at its first question, and
kept with the reason it is missing, so a probe degrades one feature at a time with a logged reason.

Each family's module registers its detectors here when it is imported (the package imports them all).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Feature:
    name: str
    available: bool
    reason: str = ""


def _check(name: str, probe: Callable[[], object]) -> Feature:
    try:
        result = probe()
    except Exception as exc:  # any import or attribute drift means "not here"
        return Feature(name, False, f"{type(exc).__name__}: {exc}")
    if result is False:
        return Feature(name, False, "not present in this torch")
    return Feature(name, True)


# Feature name -> its detector: each family's module registers its own (see the package's __init__).
_DETECTORS: dict[str, Callable[[], object]] = {}
FEATURES: dict[str, Feature] = {}


def register(name: str, detector: Callable[[], object]) -> None:
    """Add a feature to the table; a detector raises or returns False where the feature is missing."""
    if name in _DETECTORS:
        raise ValueError(f"torch feature {name!r} registered twice")
    _DETECTORS[name] = detector


def feature(name: str) -> Feature:
    """One row of the feature-detection table, detected at the first question, then kept."""
    found = FEATURES.get(name)
    if found is None:
        found = FEATURES[name] = _check(name, _DETECTORS[name])
    return found


def has(name: str) -> bool:
    return feature(name).available


def missing(*names: str) -> list[Feature]:
    return [feature(name) for name in names if not feature(name).available]
