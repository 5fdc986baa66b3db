"""Alerting and recording rules: promtool check, promtool unit tests, coverage of every alert."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from dashboard_files import RULES, RULES_MORE_TEST, RULES_TEST, Rule

REQUIRED_ALERTS = {
    "RecompilationStorm",
    "RecompileLimitHit",
    "GraphBreaksAppeared",
    "CudagraphsSkipped",
    "CudagraphRerecording",
    "NonFiniteGradients",
    "OptimizerStepSlow",
    "CheckpointInvalid",
    "CheckpointIncomplete",
    "CheckpointSaveFailed",
    "NoValidCheckpointRecently",
    "TorchpulseAgentDown",
    "TorchpulseEventsDropped",
    "TorchpulseRankClaimedTwice",
    "TorchpulseCollectorFailing",
    "TorchpulseRankStalled",
    "TorchpulseDaemonDown",
    "TorchpulseProbeFailed",
    "TorchpulseSeriesRejected",
    "CheckpointValidationError",
    "CheckpointRootUnreadable",
    "TorchpulseStateNotPersistent",
    "TorchpulseTextfileStale",
}


def test_promtool_check_rules_is_clean(rules: list[Rule], require_tool: Callable[[str], str]) -> None:
    """promtool accepts the rules file and counts as many rules as the tests read from it."""
    result = subprocess.run(
        [require_tool("promtool"), "check", "rules", str(RULES)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


@pytest.mark.parametrize("cases", [RULES_TEST, RULES_MORE_TEST], ids=lambda path: path.name)
def test_promtool_unit_tests_pass(require_tool: Callable[[str], str], cases: Path) -> None:
    """Every case of the file passes under promtool test rules, run against the shipped rules file itself."""
    assert re.search(r"^rule_files:\n  - (\S+)$", cases.read_text(), re.MULTILINE).group(1) == RULES.name  # type: ignore[union-attr]
    result = subprocess.run(
        [require_tool("promtool"), "test", "rules", str(cases)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=cases.parent,
    )

    assert result.returncode == 0, result.stdout + result.stderr


def test_every_required_alert_exists(rules: list[Rule]) -> None:
    """The rules define at least the alerts the issue asks for."""
    alerts = {rule.name for rule in rules if rule.kind == "alert"}
    assert REQUIRED_ALERTS - alerts == set()


def test_every_alert_is_tested_firing_and_not_firing(rules: list[Rule]) -> None:
    """Each alert has a unit-test evaluation expecting it to fire and one expecting silence."""
    text = RULES_TEST.read_text()
    evaluations = re.findall(r"alertname: (\w+)\n\s+exp_alerts:( \[\])?", text)
    firing = {name for name, empty in evaluations if not empty}
    silent = {name for name, empty in evaluations if empty}
    # A firing evaluation whose series include a non-matching one also proves silence for it,
    # but an explicit empty expectation is required for the alerts with `for:`.
    alerts = {rule.name for rule in rules if rule.kind == "alert"}
    assert (alerts - firing, set()) == (set(), alerts - firing - silent)


def test_rules_never_group_by_job(rules: list[Rule]) -> None:
    """Rules aggregate by run/rank/root/collector, never by the scrape job label."""
    assert [rule.name for rule in rules if re.search(r"\bby \([^)]*\bjob\b", rule.expr)] == []
