"""Readers for the dashboard, the rules file and the metric contract (dashboards/metrics.txt)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"
DASHBOARD_JSON = DASHBOARDS / "grafana" / "torchpulse.json"
RULES = DASHBOARDS / "prometheus" / "torchpulse.rules.yml"
RULES_TEST = DASHBOARDS / "prometheus" / "torchpulse.rules.test.yml"
# Cases for realistic series that earlier rules got wrong (warm-ups, start-up overflows, reentrant passes).
RULES_MORE_TEST = DASHBOARDS / "prometheus" / "torchpulse.rules.more_test.yml"
CONTRACT = DASHBOARDS / "metrics.txt"
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")


@dataclass(frozen=True)
class Family:
    """One metric family of the contract."""

    name: str
    kind: str
    labels: frozenset[str]


@dataclass(frozen=True)
class Rule:
    """One rule of the rules file: its name (alert or record) and its expression."""

    kind: str
    name: str
    expr: str


def read_contract(path: Path = CONTRACT) -> dict[str, Family]:
    """Parse metrics.txt: `name type [labels,...]` per line, '#' comments."""
    families: dict[str, Family] = {}
    for line in path.read_text().splitlines():
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        name, kind, *rest = fields
        labels = frozenset(rest[0].split(",")) if rest else frozenset()
        families[name] = Family(name, kind, labels)
    return families


def read_rules(path: Path = RULES) -> list[Rule]:
    """Extract alert/record names and expressions from the rules file (no YAML library needed).

    Handles the two spellings the file uses: `expr: <one line>` and `expr: |` followed
    by an indented block. test_prometheus_rules.py checks the count against promtool's.
    """
    lines = path.read_text().splitlines()
    rules: list[Rule] = []
    current: tuple[str, str] | None = None
    index = 0
    while index < len(lines):
        line = lines[index]
        head = re.match(r"^\s*- (alert|record): (\S+)\s*$", line)
        if head:
            current = (head.group(1), head.group(2))
        expr = re.match(r"^(\s*)expr: (.*)$", line)
        if expr and current is not None:
            indent, value = len(expr.group(1)), expr.group(2).strip()
            if value in ("|", "|-", ">", ">-"):
                block: list[str] = []
                index += 1
                while index < len(lines) and (
                    not lines[index].strip() or len(lines[index]) - len(lines[index].lstrip()) > indent
                ):
                    block.append(lines[index].strip())
                    index += 1
                value = "\n".join(block).strip()
                index -= 1
            rules.append(Rule(current[0], current[1], value))
            current = None
        index += 1
    return rules


def dashboard_targets(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """Return (panel title, expr) for every query of every panel."""
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel.get("targets", [])]


def stat_count_targets(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of the stat-panel queries that count or sum into one number (no `by`):
    with nothing to count they must give 0 (`or vector(0)`), not Grafana's "No data"."""
    return [
        (panel["title"], target["expr"])
        for panel in dashboard["panels"]
        if panel["type"] == "stat"
        for target in panel["targets"]
        if re.match(r"(count|sum)\s*\(", target["expr"])
    ]


def grafana_to_promql(expr: str, run: str = ".*", rank: str = ".*") -> str:
    """Replace Grafana's template variables with values Prometheus accepts."""
    replacements = {
        "$__rate_interval": "15s",
        "$__range": "5m",
        "$__interval": "5s",
        "${run}": run,
        "$run": run,
        "${rank}": rank,
        "$rank": rank,
    }
    for variable, value in replacements.items():
        expr = expr.replace(variable, value)
    return expr
