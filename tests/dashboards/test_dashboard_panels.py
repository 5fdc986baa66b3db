"""Dashboard panels over realistic series that earlier versions of their queries got wrong."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dashboard_files import grafana_to_promql


def _panel(dashboard: dict[str, Any], title: str) -> dict[str, Any]:
    return next(panel for panel in dashboard["panels"] if panel["title"] == title)


def _promtool_exprs(
    promtool: str, tmp_path: Path, series: dict[str, str], checks: list[tuple[str, str, dict[str, float]]]
) -> subprocess.CompletedProcess[str]:
    """`promtool test rules` of (expr, eval_time, {labels: value}) over `series` ({selector: values}, 1m apart)."""
    test = {
        "interval": "1m",
        "input_series": [{"series": name, "values": values} for name, values in series.items()],
        "promql_expr_test": [
            {"expr": expr, "eval_time": at, "exp_samples": [{"labels": k, "value": v} for k, v in samples.items()]}
            for expr, at, samples in checks
        ],
    }
    path = tmp_path / "panel_queries.test.yml"
    path.write_text(json.dumps({"rule_files": [], "evaluation_interval": "1m", "tests": [test]}))
    return subprocess.run(
        [promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path
    )


def test_findings_of_a_root_two_daemons_watch_are_counted_once(
    dashboard: dict[str, Any], tmp_path: Path, require_tool: Callable[[str], str]
) -> None:
    """A shared root configured on two nodes: both daemons validate its newest checkpoint and export the same
    2 findings. The table shows 2 (a sum showed 4), like the other per-root queries (max by root)."""
    expr = _panel(dashboard, "Findings by rule")["targets"][0]["expr"]
    series = {
        f'torchpulse_checkpoint_findings{{root="/ckpt/a", rule="TP-CKPT-003", severity="error", instance="{node}",'
        ' job="torchpulse"}': "2x10"
        for node in ("node1:10187", "node2:10187")
    }
    labels = '{root="/ckpt/a", rule="TP-CKPT-003", severity="error"}'

    result = _promtool_exprs(require_tool("promtool"), tmp_path, series, [(grafana_to_promql(expr), "5m", {labels: 2})])

    assert result.returncode == 0, result.stdout + result.stderr


def test_compile_time_shows_the_wall_time_of_a_rank_not_the_sum_over_ranks(
    dashboard: dict[str, Any], tmp_path: Path, require_tool: Callable[[str], str]
) -> None:
    """Two ranks that each spend 30 s a minute in inductor compile side by side: the job lost 30 s a minute
    (60 s over the panel's 2-minute interval here), not twice that."""
    expr = _panel(dashboard, "Compile time by phase")["targets"][0]["expr"]
    series = {
        f'torchpulse_compile_duration_seconds_sum{{run="r", rank="{rank}", phase="inductor"}}': "0+30x10"
        for rank in (0, 1)
    }
    promql = grafana_to_promql(expr.replace("$__rate_interval", "2m"))

    expected = {'{run="r", phase="inductor"}': 60}
    result = _promtool_exprs(require_tool("promtool"), tmp_path, series, [(promql, "5m", expected)])

    assert result.returncode == 0, result.stdout + result.stderr


def _unit_of(panel: dict[str, Any], ref: str) -> str:
    unit: str = panel["fieldConfig"]["defaults"]["unit"]
    for override in panel["fieldConfig"]["overrides"]:
        if override["matcher"] == {"id": "byFrameRefID", "options": ref}:
            unit = next((p["value"] for p in override["properties"] if p["id"] == "unit"), unit)
    return unit


def test_byte_gauges_are_shown_in_bytes(dashboard: dict[str, Any]) -> None:
    """A query over a *_bytes gauge is shown in bytes, also in a panel whose other queries have another unit
    (the CUDA-graph pool beside the copies per second read 2 GiB as "2.15 Gcps")."""
    wrong = [
        (panel["title"], target["refId"], _unit_of(panel, target["refId"]))
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
        if re.search(r"torchpulse_\w+_bytes\b", target["expr"]) and _unit_of(panel, target["refId"]) != "bytes"
    ]
    assert wrong == []


def test_red_thresholds_can_turn_something_red(dashboard: dict[str, Any]) -> None:
    """A threshold override matches a series the panel draws (legends name them), and a time series panel with
    a red threshold draws it (Grafana's default, thresholdsStyle off, shows none)."""
    problems = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        legends = [target.get("legendFormat", "") for target in panel["targets"]]
        red = len(panel["fieldConfig"]["defaults"]["thresholds"]["steps"]) > 1
        for override in panel["fieldConfig"]["overrides"]:
            if not any(p["id"] == "thresholds" for p in override["properties"]):
                continue
            red = True
            matcher = override["matcher"]
            if matcher["id"] == "byName" and matcher["options"] not in legends:
                problems.append(f"{panel['title']}: no series is named {matcher['options']!r} ({legends})")
            if matcher["id"] == "byRegexp" and not any(re.search(matcher["options"], legend) for legend in legends):
                problems.append(f"{panel['title']}: no legend matches {matcher['options']!r}")
        style = panel["fieldConfig"]["defaults"].get("custom", {}).get("thresholdsStyle", {}).get("mode", "off")
        if panel["type"] == "timeseries" and red and style == "off":
            problems.append(f"{panel['title']}: red threshold never drawn")
    assert problems == []
