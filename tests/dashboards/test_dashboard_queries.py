"""Dashboard queries evaluated by promtool on synthetic series: what a panel shows in the cases that matter."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from dashboard_files import grafana_to_promql, stat_count_targets

# Grafana's $__rate_interval for a 15 s scrape interval (4 scrapes); the dashboard's default range.
RATE_INTERVAL, RANGE = "1m", "1h"
HISTOGRAMS_WITH_MEAN = ("torchpulse_optimizer_step_duration_seconds", "torchpulse_backward_duration_seconds")
RARE_EVENT_HISTOGRAMS = (
    "torchpulse_checkpoint_save_duration_seconds",
    "torchpulse_checkpoint_validation_duration_seconds",
)
# One label set carrying every label the panels group by, and a second that differs in each of them.
LABELS_A = 'run="r", rank="0", kind="backward", optimizer="AdamW", api="save", level="full"'
LABELS_B = 'run="r", rank="1", kind="grad", optimizer="AdamW", api="save", level="full"'


def _promql(expr: str) -> str:
    expr = expr.replace("$__rate_interval", RATE_INTERVAL).replace("$__range", RANGE)
    return grafana_to_promql(expr)


def _by_labels(labels: str, expr: str) -> str:
    """The labels of `labels` (a series' label text) that the expression's outer `sum by (...)` keeps."""
    match = re.search(r"sum by \(([^)]*)\)", expr)
    keep = {name.strip() for name in match.group(1).split(",")} - {"le"} if match else set()
    pairs = [pair.strip() for pair in labels.split(",")]
    return "{" + ", ".join(pair for pair in pairs if pair.split("=")[0] in keep) + "}"


def _promtool_expect(
    promtool: str,
    tmp_path: Path,
    series: dict[str, str],
    checks: list[tuple[str, str, dict[str, float]]],
    interval: str = "15s",
) -> subprocess.CompletedProcess[str]:
    """Run `promtool test rules` with `series` ({selector: values}) and (expr, eval_time, {labels: value}) checks."""
    test: dict[str, Any] = {
        "interval": interval,
        "input_series": [{"series": name, "values": values} for name, values in series.items()],
        "promql_expr_test": [
            {
                "expr": expr,
                "eval_time": eval_time,
                "exp_samples": [{"labels": labels, "value": value} for labels, value in samples.items()],
            }
            for expr, eval_time, samples in checks
        ],
    }
    path = tmp_path / "dashboard_queries.test.yml"
    path.write_text(json.dumps({"rule_files": [], "evaluation_interval": "1m", "tests": [test]}, indent=1))
    return subprocess.run(
        [promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path
    )


def test_stat_panels_that_count_show_zero_when_nothing_matches(
    dashboard: dict[str, Any], tmp_path: Path, require_tool: Callable[[str], str]
) -> None:
    """With no agent and no run, every counting stat query returns 0 (`or vector(0)`), never "No data"."""
    queries = stat_count_targets(dashboard)
    unrelated = {'up{job="torchpulse", instance="node1:10187"}': "1x20"}

    result = _promtool_expect(
        require_tool("promtool"), tmp_path, unrelated, [(_promql(expr), "4m", {"{}": 0}) for _title, expr in queries]
    )

    assert {"Agents connected", "Runs"} <= {title for title, _expr in queries}
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("histogram", HISTOGRAMS_WITH_MEAN)
def test_latency_panels_plot_the_mean_that_quantiles_miss_inside_one_bucket(
    histogram: str, dashboard: dict[str, Any], tmp_path: Path, require_tool: Callable[[str], str]
) -> None:
    """Steady 0.30 s and 0.45 s steps read p50 0.375 s both (one bucket); the panel's mean tells 0.30 from 0.45."""
    targets = next(
        panel["targets"]
        for panel in dashboard["panels"]
        if any(f"{histogram}_bucket" in target["expr"] for target in panel.get("targets", []))
    )
    means = [t["expr"] for t in targets if f"{histogram}_sum" in t["expr"] and f"{histogram}_count" in t["expr"]]
    p50 = next(t["expr"] for t in targets if t["expr"].startswith("histogram_quantile(0.5,"))
    series = {}
    # One step a second, 15 s scrapes: count +15 per scrape, sum +15 * duration, every step in (0.25, 0.5].
    for labels, seconds in ((LABELS_A, 0.30), (LABELS_B, 0.45)):
        series[f'{histogram}_bucket{{{labels}, le="0.25"}}'] = "0x40"
        series[f'{histogram}_bucket{{{labels}, le="0.5"}}'] = "0+15x40"
        series[f'{histogram}_bucket{{{labels}, le="+Inf"}}'] = "0+15x40"
        series[f"{histogram}_count{{{labels}}}"] = "0+15x40"
        series[f"{histogram}_sum{{{labels}}}"] = f"0+{15 * seconds}x40"
    checks = [(_promql(p50), "5m", {_by_labels(LABELS_A, p50): 0.375, _by_labels(LABELS_B, p50): 0.375})]
    checks += [(_promql(m), "5m", {_by_labels(LABELS_A, m): 0.30, _by_labels(LABELS_B, m): 0.45}) for m in means]

    result = _promtool_expect(require_tool("promtool"), tmp_path, series, checks)

    assert len(means) == 1
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("histogram", RARE_EVENT_HISTOGRAMS)
def test_rare_event_quantile_panels_show_the_last_events_between_them(
    histogram: str, dashboard: dict[str, Any], tmp_path: Path, require_tool: Callable[[str], str]
) -> None:
    """Saves (and their validations) 30 minutes apart, each 10-30 s: 25 minutes after the last one the
    panel still shows its quantiles, interpolated in the (10, 30] bucket."""
    quantile_exprs = [
        target["expr"]
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
        if f"{histogram}_bucket" in target["expr"]
    ]
    # 1-minute samples: one event at 10 min, one at 40 min.
    series = {
        f'{histogram}_bucket{{{LABELS_A}, le="10"}}': "0x70",
        f'{histogram}_bucket{{{LABELS_A}, le="30"}}': "0x9 1x30 2x30",
        f'{histogram}_bucket{{{LABELS_A}, le="+Inf"}}': "0x9 1x30 2x30",
    }
    checks = []
    for expr in quantile_exprs:
        quantile = float(expr.removeprefix("histogram_quantile(").split(",", 1)[0])
        checks.append((_promql(expr), "65m", {_by_labels(LABELS_A, expr): 10 + 20 * quantile}))

    result = _promtool_expect(require_tool("promtool"), tmp_path, series, checks, interval="1m")

    assert quantile_exprs != []
    assert result.returncode == 0, result.stdout + result.stderr
