"""Structure of the Grafana dashboard, checked against the metric contract."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from dashboard_files import (
    DASHBOARD_JSON,
    DASHBOARDS,
    HISTOGRAM_SERIES,
    Family,
    Rule,
    dashboard_targets,
    grafana_to_promql,
)

GRAFANA_BUILTINS = {"__rate_interval", "__range", "__interval", "__all"}
ROWS = ["Overview", "Training", "Compilation", "CUDA graphs", "Checkpoints", "Autograd"]
METRIC = re.compile(r"(?<![:\w])(torchpulse_[a-z0-9_]+)(?![:\w])")
RECORDED = re.compile(r"\b([a-z_]+:[a-z0-9_]+(?::[a-z0-9_]+)*)\b")
SELECTOR = re.compile(r"\b(torchpulse_[a-z0-9_]+)\{([^}]*)\}")


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [panel for panel in dashboard["panels"] if panel["type"] != "row"]


def _family(name: str, contract: dict[str, Family]) -> Family | None:
    if name in contract:
        return contract[name]
    for suffix in HISTOGRAM_SERIES:
        base = name.removesuffix(suffix)
        if base != name and base in contract and contract[base].kind == "histogram":
            return contract[base]
    return None


@pytest.mark.process
def test_dashboard_json_is_generated_from_build_dashboard() -> None:
    """torchpulse.json is exactly what build_dashboard.py writes (edit the script, not the JSON)."""
    script = DASHBOARDS / "grafana" / "build_dashboard.py"
    generated = subprocess.run(
        [sys.executable, "-c", f"import runpy; print(runpy.run_path({str(script)!r})['render'](), end='')"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert generated == DASHBOARD_JSON.read_text()


def test_rows_cover_every_area(dashboard: dict[str, Any]) -> None:
    """The dashboard has one row per area, in order."""
    rows = [panel["title"] for panel in dashboard["panels"] if panel["type"] == "row"]
    assert rows == ROWS


def test_every_panel_has_title_description_datasource_and_unit(dashboard: dict[str, Any]) -> None:
    """Each panel has a title, a description, the ${datasource} variable and a unit."""
    problems = []
    for panel in _panels(dashboard):
        if not panel.get("title"):
            problems.append(f"panel {panel['id']}: no title")
        if len(panel.get("description", "")) < 40:
            problems.append(f"{panel['title']}: no useful description")
        if panel.get("datasource") != {"type": "prometheus", "uid": "${datasource}"}:
            problems.append(f"{panel['title']}: datasource is not ${{datasource}}")
        for target in panel["targets"]:
            if target.get("datasource") != panel["datasource"]:
                problems.append(f"{panel['title']}: a query has another datasource")
        if not panel["fieldConfig"]["defaults"].get("unit"):
            problems.append(f"{panel['title']}: no unit")
        if not panel["targets"]:
            problems.append(f"{panel['title']}: no query")
    assert problems == []


def test_panel_ids_unique_and_grid_fits(dashboard: dict[str, Any]) -> None:
    """Panel ids are unique and no panel leaves the 24-column grid."""
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    outside = [p["title"] for p in dashboard["panels"] if p["gridPos"]["x"] + p["gridPos"]["w"] > 24]
    assert outside == []


def test_no_panel_options_are_null_and_variable_ids_are_unique(dashboard: dict[str, Any]) -> None:
    """What the dashboard SDK's builders write by default and Grafana misreads: a panel of no option set as
    `"options": null`, and one id shared by every variable (Grafana keys variables by id)."""
    null_options = [p["title"] for p in dashboard["panels"] if p["type"] != "row" and p.get("options") is None]
    ids = [variable.get("id", variable["name"]) for variable in dashboard["templating"]["list"]]
    assert ([], len(ids)) == (null_options, len(set(ids)))


def test_template_variables(dashboard: dict[str, Any]) -> None:
    """datasource is a Prometheus datasource variable; run and rank come from torchpulse metrics."""
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["run"]["query"]["query"] == "label_values(torchpulse_run_info, run)"
    assert variables["rank"]["query"]["query"] == 'label_values(torchpulse_agent_up{run=~"$run"}, rank)'
    for name in ("run", "rank"):
        assert variables[name]["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


def test_every_variable_used_is_defined(dashboard: dict[str, Any]) -> None:
    """Every $variable in a query or a variable definition is a dashboard variable or a Grafana builtin."""
    defined = {variable["name"] for variable in dashboard["templating"]["list"]} | GRAFANA_BUILTINS
    text = "\n".join(expr for _title, expr in dashboard_targets(dashboard))
    text += "\n".join(str(v.get("query")) for v in dashboard["templating"]["list"])
    used = set(re.findall(r"\$\{?(\w+)", text))
    assert used - defined == set()


def test_queries_use_only_contract_metrics_and_labels(
    dashboard: dict[str, Any], contract: dict[str, Family], rules: list[Rule]
) -> None:
    """Every metric in a dashboard query or a rule is in metrics.txt (or recorded by a rule), with its labels."""
    recorded = {rule.name for rule in rules if rule.kind == "record"}
    exprs = [expr for _title, expr in dashboard_targets(dashboard)] + [rule.expr for rule in rules]
    unknown, bad_labels = set(), set()
    for expr in exprs:
        unknown |= {name for name in METRIC.findall(expr) if _family(name, contract) is None}
        unknown |= set(RECORDED.findall(expr.replace("$__", ""))) - recorded
        for name, matchers in SELECTOR.findall(expr):
            family = _family(name, contract)
            labels = set(re.findall(r"(\w+)\s*[=!]~?", matchers))
            allowed = (family.labels if family else frozenset()) | {"le"}
            bad_labels |= {f"{name}{{{label}}}" for label in labels - allowed}
    assert (unknown, bad_labels) == (set(), set())


def test_contract_has_no_prometheus_owned_labels(contract: dict[str, Family]) -> None:
    """No family declares job or instance, and counters end in _total."""
    assert [f.name for f in contract.values() if {"job", "instance"} & f.labels] == []
    assert [f.name for f in contract.values() if f.kind == "counter" and not f.name.endswith("_total")] == []
    assert {f.kind for f in contract.values()} <= {"counter", "gauge", "histogram", "info"}


def test_every_expression_parses_as_promql(
    dashboard: dict[str, Any], tmp_path: Path, require_tool: Callable[[str], str]
) -> None:
    """promtool parses every dashboard query (variables substituted) as a recording rule."""
    promtool = require_tool("promtool")
    rules_file = tmp_path / "dashboard_exprs.yml"
    lines = ["groups:", "  - name: dashboard", "    rules:"]
    for index, (_title, expr) in enumerate(dashboard_targets(dashboard)):
        lines.append(f"      - record: dashboard_expr_{index}")
        lines.append("        expr: |")
        lines.extend(f"          {line}" for line in grafana_to_promql(expr).splitlines())
    rules_file.write_text("\n".join(lines) + "\n")

    result = subprocess.run(
        [promtool, "check", "rules", str(rules_file)], capture_output=True, text=True, timeout=60, check=False
    )

    assert result.returncode == 0, result.stdout + result.stderr


def test_contract_agrees_with_the_agent_catalog(contract: dict[str, Family]) -> None:
    """Families that agents send (torchpulse.catalog) have the same type here; skipped until the catalog imports."""
    try:
        from torchpulse.catalog import CATALOG
    except ImportError as exc:  # the catalog is written in parallel with this issue
        import pytest

        pytest.skip(f"torchpulse.catalog does not import yet: {exc}")
    mismatched = {
        family.exposed_name: (family.kind, contract[family.exposed_name].kind)
        for family in CATALOG.values()
        if family.exposed_name in contract and family.kind != contract[family.exposed_name].kind
    }
    assert mismatched == {}


def test_every_agent_family_is_in_the_contract_with_its_type_and_labels(contract: dict[str, Family]) -> None:
    """metrics.txt lists each family agents send (the catalog), with `run` and `rank` added by the daemon:
    a family missing there cannot be used by a dashboard, and a label drift would go unnoticed."""
    from torchpulse.catalog import CATALOG

    expected = {
        f"torchpulse_{name}": (family.kind, frozenset(("run", "rank", *family.labels)))
        for name, family in CATALOG.items()
    }
    listed = {name: (contract[name].kind, contract[name].labels) for name in expected if name in contract}
    assert expected == listed
