"""The demo's per-rank summary read back from an exposition with series missing."""

from __future__ import annotations

import math

from torchpulse.summary import format_checkpoints, format_probe_table, format_table, summarize

BUCKETS_ONLY = """\
# HELP torchpulse_optimizer_step_duration_seconds Wall time of optimizer.step() on the host.
# TYPE torchpulse_optimizer_step_duration_seconds histogram
torchpulse_optimizer_step_duration_seconds_bucket{run="r",rank="1",optimizer="SGD#0",le="0.001"} 1.0
torchpulse_optimizer_step_duration_seconds_bucket{run="r",rank="1",optimizer="SGD#0",le="0.01"} 3.0
torchpulse_optimizer_step_duration_seconds_bucket{run="r",rank="1",optimizer="SGD#0",le="+Inf"} 4.0
torchpulse_optimizer_step_duration_seconds_count{run="r",rank="1",optimizer="SGD#0"} 4.0
torchpulse_optimizer_step_duration_seconds_sum{run="r",rank="1",optimizer="SGD#0"} 0.01
"""


def test_a_rank_with_only_step_buckets_is_summarized() -> None:
    """No agent_up and no steps_total (refused by the series limit, or its collector failed): still one row."""
    rows = summarize(BUCKETS_ONLY)
    assert [("r", "1", False, 0.0)] == [(r.run, r.rank, r.up, r.steps) for r in rows]
    assert (0.0055, 0.01) == (round(rows[0].p50, 12), rows[0].p99)
    assert "r    1     no  0      5.50 ms   10.00 ms" in format_table(rows)


def test_an_exposition_without_torchpulse_series_gives_empty_tables() -> None:
    """Nothing to summarize is a header, not an error."""
    rows = summarize("# TYPE other gauge\nother 1.0\n")
    assert ([], 2, 2) == (rows, len(format_table(rows).splitlines()), len(format_probe_table(rows).splitlines()))
    assert "no checkpoint roots" == format_checkpoints("")
    no_observations = BUCKETS_ONLY.replace(" 1.0\n", " 0.0\n").replace(" 3.0\n", " 0.0\n").replace(" 4.0\n", " 0.0\n")
    assert math.isnan(summarize(no_observations)[0].p50)
