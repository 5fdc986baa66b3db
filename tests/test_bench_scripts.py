"""The benchmarks' own machinery: the statistics they print, the interleaving, clean-up, and that each script starts.

Cheap checks only; the benchmarks themselves are run by `make bench`, never by the tests.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.harness import Variant, bench_dir, interleaved, median_interval, paired_ratio, paired_ratios, percentile
from tests.support import REPO

SCRIPTS = [
    "overhead.py",
    "compile_overhead.py",
    "autograd_overhead.py",
    "ingest.py",
    "load.py",
    "checkpoint.py",
    "watcher_latency.py",
]


def test_paired_ratio_is_the_median_of_per_round_block_median_ratios() -> None:
    # Two rounds of 3 steps per variant, in the order `interleaved` appends them.
    times = {"off": [1.0, 2.0, 3.0, 10.0, 10.0, 40.0], "on": [2.0, 2.2, 9.0, 11.0, 11.0, 11.0]}
    # Round 1: median 2.2 / median 2.0; round 2: 11.0 / 10.0.
    assert paired_ratios(times, "on", "off", 3) == pytest.approx([1.1, 1.1])
    times["on"][4] = 15.0  # round 2 median becomes 11.0 still: block medians resist one outlier
    assert paired_ratio(times, "on", "off", 3) == pytest.approx(1.1)
    three = {"off": [1.0, 1.0, 1.0], "on": [1.2, 0.9, 1.05]}
    assert paired_ratio(three, "on", "off", 1) == pytest.approx(1.05)


def test_paired_ratios_refuse_lists_that_are_not_whole_rounds() -> None:
    with pytest.raises(ValueError, match="whole rounds"):
        paired_ratios({"off": [1.0, 1.0, 1.0], "on": [1.0, 1.0]}, "on", "off", 1)
    with pytest.raises(ValueError, match="whole rounds"):
        paired_ratios({"off": [1.0, 1.0, 1.0], "on": [1.0, 1.0, 1.0]}, "on", "off", 2)


def test_median_interval_uses_the_textbook_order_statistics() -> None:
    values = [float(i) for i in range(1, 101)]  # value = its 1-based rank
    assert median_interval(values[::-1]) == (40.0, 61.0)  # n = 100: ranks 40 and 61, whatever the input order
    assert median_interval([float(i) for i in range(1, 11)]) == (1.0, 10.0)  # n = 10: the whole sample
    assert median_interval([3.0]) == (3.0, 3.0)


@pytest.mark.parametrize("n", [*range(1, 60), 100, 200, 300, 1000])
def test_median_interval_covers_the_median_at_least_95_percent(n: int) -> None:
    """Exact coverage of [X(low), X(high)] for any continuous distribution: P(low < B <= high), B ~ Bin(n, 1/2)."""
    low, high = median_interval([float(i) for i in range(n)])  # 0-based indices of the chosen order statistics
    coverage = sum(math.comb(n, k) for k in range(int(low) + 1, int(high) + 1)) / 2**n
    assert coverage >= 0.95 or (low, high) == (0, n - 1)


def test_percentile_is_nearest_rank() -> None:
    forty = [float(i) for i in range(1, 41)]
    assert percentile(forty, 0.99) == 40.0  # ceil(39.6) = 40th value: the maximum, not the 39th
    assert percentile(forty, 0.5) == 20.0
    assert percentile([float(i) for i in range(1, 101)], 0.99) == 99.0
    assert percentile([5.0], 0.99) == 5.0


def test_interleaved_alternates_the_order_and_times_only_settled_steps() -> None:
    log: list[str] = []
    current = ["none"]

    def step() -> None:
        log.append(current[0])

    def variant(name: str) -> Variant:
        return Variant(name, lambda: current.__setitem__(0, name), lambda: current.__setitem__(0, "none"))

    times = interleaved(step, [variant("a"), variant("b")], rounds=3, steps_per_block=2, warmup=4, settle=1)
    assert [len(v) for v in times.values()] == [6, 6]
    # Warm-up outside any variant, then ABBA...: each block is 1 settle step + 2 timed steps.
    assert log == ["none"] * 4 + ["a"] * 3 + ["b"] * 3 + ["b"] * 3 + ["a"] * 3 + ["a"] * 3 + ["b"] * 3


def test_bench_dir_is_removed_on_success_and_on_failure() -> None:
    with bench_dir("tp-test-bench-") as path:
        (path / "file").write_text("x")
    assert not path.exists()
    with pytest.raises(RuntimeError), bench_dir("tp-test-bench-") as path:
        raise RuntimeError("benchmark failed")
    assert not path.exists()


def test_bench_dir_keeps_a_failed_run_only_when_asked_and_not_on_ctrl_c(capsys: pytest.CaptureFixture[str]) -> None:
    kept: Path | None = None
    try:
        with pytest.raises(RuntimeError), bench_dir("tp-test-bench-", keep_on_error=True) as kept:
            raise RuntimeError("benchmark failed")
        assert kept.exists()
        assert str(kept) in capsys.readouterr().err
    finally:
        if kept is not None:
            import shutil

            shutil.rmtree(kept, ignore_errors=True)
    with pytest.raises(KeyboardInterrupt), bench_dir("tp-test-bench-", keep_on_error=True) as path:
        raise KeyboardInterrupt
    assert not path.exists()


@pytest.mark.process
@pytest.mark.parametrize("script", SCRIPTS)
def test_every_benchmark_answers_help_as_the_makefile_runs_it(script: str) -> None:
    """`--help` both as a script (README, Makefile) and, for compile_overhead, as a module (`-m`)."""
    commands = [[sys.executable, str(REPO / "bench" / script), "--help"]]
    if script == "compile_overhead.py":
        commands.append([sys.executable, "-m", "bench.compile_overhead", "--help"])
    for command in commands:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert "usage:" in done.stdout
