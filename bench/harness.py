"""Side-by-side timing helpers: interleaved variants, medians and ratios in one run.

The machine is shared and noisy, so absolute times are not comparable across
runs; each benchmark alternates its variants in short blocks and reports the
ratio of medians measured in the same process at the same time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Variant:
    name: str
    enter: Callable[[], None]
    leave: Callable[[], None]


def interleaved(step: Callable[[], None], variants: Sequence[Variant], rounds: int, steps_per_block: int,
                warmup: int = 5, settle: int = 1) -> dict[str, list[float]]:
    """Per-step wall times of `step` under each variant, alternating variant order every round.

    The first `settle` steps after each switch are run but not timed: they pay for the switch
    (caches refilled after an install or uninstall), which a job that attaches once never does.
    """
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    for _ in range(warmup):
        step()
    for round_index in range(rounds):
        order = variants if round_index % 2 == 0 else list(reversed(variants))
        for variant in order:
            variant.enter()
            try:
                for _ in range(settle):
                    step()
                for _ in range(steps_per_block):
                    start = time.perf_counter()
                    step()
                    times[variant.name].append(time.perf_counter() - start)
            finally:
                variant.leave()
    return times


def paired_ratio(times: dict[str, list[float]], name: str, baseline: str, block: int) -> float:
    """Median over rounds of (block median / baseline block median of the same round).

    Blocks of one round ran back to back, so slow drifts of a shared machine
    cancel out of each pair.
    """
    ours, base = times[name], times[baseline]
    ratios = [
        statistics.median(ours[i:i + block]) / statistics.median(base[i:i + block])
        for i in range(0, min(len(ours), len(base)), block)
    ]
    return statistics.median(ratios)


def report(title: str, times: dict[str, list[float]], baseline: str, budgets: dict[str, float],
           block: int) -> bool:
    """Print medians and paired ratios against `baseline`; True when every budget holds."""
    print(f"\n{title}")
    print(f"  {'variant':<28} {'steps':>6} {'median':>11} {'ratio':>7}  budget")
    ok = True
    for name, values in times.items():
        median = statistics.median(values)
        ratio = paired_ratio(times, name, baseline, block)
        budget = budgets.get(name)
        verdict = "" if budget is None else (f"<= {budget}  {'ok' if ratio <= budget else 'OVER'}")
        ok = ok and (budget is None or ratio <= budget)
        print(f"  {name:<28} {len(values):>6} {median * 1e3:>8.3f} ms {ratio:>7.4f}  {verdict}")
    return ok
