"""The pass schedule alone: which passes are due, sampled and logged, and when a live change applies."""

from __future__ import annotations

import pytest

from torchpulse.probes.autograd.schedule import DISCOVER_EVERY, PassSchedule


def _due(schedule: PassSchedule, count: int) -> list[int]:
    return [plan.index for plan in (schedule.plan("backward", True, False) for _ in range(count)) if plan.due]


def test_periods_alternate_one_above_and_one_below_the_setting() -> None:
    """The first pass is due, then the gaps alternate N+1 and N-1, N on average."""
    assert [0, 5, 8, 13, 16] == _due(PassSchedule(4, 0, lambda: None), 17)


def test_timing_off_still_plans_a_parameter_search_every_discover_every_passes() -> None:
    """With timing off, passes are due (searched) but never sampled."""
    schedule = PassSchedule(0, 0, lambda: None)
    plans = [schedule.plan("backward", True, False) for _ in range(DISCOVER_EVERY + 2)]
    assert ([0, DISCOVER_EVERY + 1], []) == (
        [p.index for p in plans if p.due],
        [p.index for p in plans if p.sampled],
    )


def test_a_shorter_period_applies_at_the_next_pass_and_reports_timing_on() -> None:
    """`set_sample_every` waits for the next pass boundary, and then does not wait out the old countdown."""
    switched_on: list[int] = []
    schedule = PassSchedule(0, 0, lambda: switched_on.append(schedule.passes))
    schedule.plan("backward", True, False)  # due: the first pass
    schedule.set_sample_every(1)
    assert ([], 0) == (switched_on, schedule.sample_every)
    assert [True, True] == [schedule.plan("backward", True, False).sampled for _ in range(2)]
    assert ([1], 1) == (switched_on, schedule.sample_every)


def test_logging_counts_down_and_skips_compiled_autograd() -> None:
    """Compiled-autograd passes are neither logged nor sampled, and use none of the logging budget."""
    schedule = PassSchedule(1, 0, lambda: None)
    schedule.log_next_passes(2)
    compiled = schedule.plan("compiled_autograd", True, True)
    logged = [schedule.plan("backward", True, False).logged for _ in range(3)]
    assert ((False, False), [True, True, False], 0) == ((compiled.logged, compiled.sampled), logged, schedule.log_left)


@pytest.mark.parametrize("change", ["set_sample_every", "log_next_passes"])
def test_negative_settings_are_refused(change: str) -> None:
    """A negative period or pass count is an error for the caller (the control channel answers it)."""
    with pytest.raises(ValueError):
        getattr(PassSchedule(1, 0, lambda: None), change)(-1)
