"""The demo's per-rank summary read back from an exposition with series missing."""

from __future__ import annotations

import math

from torchpulse.summary import (
    format_checkpoint_saves,
    format_checkpoints,
    format_node_times,
    format_probe_table,
    format_table,
    summarize,
)

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


SAVES = """\
# HELP torchpulse_checkpoint_save_duration_seconds Wall time of a save.
# TYPE torchpulse_checkpoint_save_duration_seconds histogram
torchpulse_checkpoint_save_duration_seconds_bucket{run="r",rank="0",api="save",le="+Inf"} 2.0
torchpulse_checkpoint_save_duration_seconds_count{run="r",rank="0",api="save"} 2.0
torchpulse_checkpoint_save_duration_seconds_sum{run="r",rank="0",api="save"} 0.5
# HELP torchpulse_checkpoint_save_failures_total Saves that raised.
# TYPE torchpulse_checkpoint_save_failures_total counter
torchpulse_checkpoint_save_failures_total{run="r",rank="0",api="save",error="NotADirectoryError"} 1.0
torchpulse_checkpoint_save_failures_total{run="r",rank="1",api="async_save",error="OSError"} 2.0
torchpulse_checkpoint_save_failures_total{run="r",rank="1",api="save",error="NotADirectoryError"} 1.0
# HELP torchpulse_agent_up Connected.
# TYPE torchpulse_agent_up gauge
torchpulse_agent_up{run="r",rank="2"} 1.0
"""


def test_checkpoint_saves_and_failures_are_summarized_per_rank() -> None:
    """Saves that returned and failures by api and error, per rank; a rank that never saved has no row."""
    lines = format_checkpoint_saves(summarize(SAVES)).splitlines()
    assert [
        ["r", "0", "2", "1", "save", "NotADirectoryError", "x1"],
        ["r", "1", "0", "3", "async_save", "OSError", "x2,", "save", "NotADirectoryError", "x1"],
    ] == [line.split() for line in lines[2:]]
    assert "no checkpoint saves" == format_checkpoint_saves(summarize(BUCKETS_ONLY))


NODE_TIMES = """\
# HELP torchpulse_autograd_sampled_passes_total Passes timed node by node.
# TYPE torchpulse_autograd_sampled_passes_total counter
torchpulse_autograd_sampled_passes_total{run="r",rank="10"} 3.0
torchpulse_autograd_sampled_passes_total{run="r",rank="2"} 1.0
# HELP torchpulse_autograd_node_seconds_total Time in nodes of sampled passes.
# TYPE torchpulse_autograd_node_seconds_total counter
torchpulse_autograd_node_seconds_total{run="r",rank="10",node="AccumulateGrad"} 0.002
torchpulse_autograd_node_seconds_total{run="r",rank="10",node="AddmmBackward0"} 0.0125
torchpulse_autograd_node_seconds_total{run="r",rank="10",node="other"} 0.004
torchpulse_autograd_node_seconds_total{run="r",rank="10",node="MmBackward0"} 0.001
torchpulse_autograd_node_seconds_total{run="r",rank="2",node="AddmmBackward0"} 1.5
# HELP torchpulse_autograd_node_calls_total Node executions in sampled passes.
# TYPE torchpulse_autograd_node_calls_total counter
torchpulse_autograd_node_calls_total{run="r",rank="10",node="AccumulateGrad"} 81.0
torchpulse_autograd_node_calls_total{run="r",rank="10",node="AddmmBackward0"} 21.0
torchpulse_autograd_node_calls_total{run="r",rank="10",node="other"} 9.0
torchpulse_autograd_node_calls_total{run="r",rank="10",node="MmBackward0"} 6.0
torchpulse_autograd_node_calls_total{run="r",rank="2",node="AddmmBackward0"} 7.0
"""


def test_node_times_show_the_slowest_types_per_rank_in_rank_order() -> None:
    """Ranks in numeric order; the top 3 node types by time (other included), slowest first, with calls."""
    rows = [line.split(None, 3) for line in format_node_times(summarize(NODE_TIMES)).splitlines()[2:]]
    assert [
        ["r", "2", "1", "AddmmBackward0 1.50 s x7"],
        ["r", "10", "3", "AddmmBackward0 12.50 ms x21, other 4.00 ms x9, AccumulateGrad 2.00 ms x81"],
    ] == rows
    assert "no sampled passes" == format_node_times(summarize(SAVES))
