"""The catalog refuses families that would break the metric naming contract."""

from __future__ import annotations

import pytest

from torchpulse.catalog import Family


@pytest.mark.parametrize(
    ("name", "kind", "labels"),
    [
        ("pool_total", "gauge", ()),
        ("step_seconds_total", "histogram", ()),
        ("steps_total", "counter", ("bad-name",)),
        ("steps_total", "counter", ("__reserved",)),
        ("step_seconds", "histogram", ("le",)),
        ("steps_total", "counter", ("kind", "kind")),
    ],
)
def test_family_breaking_the_naming_contract_is_refused(name: str, kind: str, labels: tuple[str, ...]) -> None:
    """`_total` only on counters; label names valid for Prometheus, not reserved, not repeated."""
    buckets = (1.0,) if kind == "histogram" else ()
    with pytest.raises(ValueError):
        Family(name, kind, "help", labels, buckets)  # type: ignore[arg-type]
