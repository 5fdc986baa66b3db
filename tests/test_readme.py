"""The README stays true to the code: metric tables, listed label values, alerts and commands."""

from __future__ import annotations

import re
import shlex

from tests.support import REPO, parse_exposition
from torchpulse.catalog import CATALOG
from torchpulse.daemon.config import Config
from torchpulse.daemon.service import Daemon

README = (REPO / "README.md").read_text()


def _documented() -> set[str]:
    names = set()
    for cell in re.findall(r"^\| `([^|]+)\|", README, flags=re.MULTILINE):
        names.update(re.findall(r"([a-z_]+)`", cell))
    return names


def test_every_agent_family_is_in_the_readme() -> None:
    """Each family of the agent catalog has a row in the README's metric tables."""
    assert set() == set(CATALOG) - _documented()


def test_every_daemon_family_is_in_the_readme() -> None:
    """Each family the daemon's own collectors export has a row in the README's metric tables."""
    daemon = Daemon(Config())
    exported = {
        name.removeprefix("torchpulse_").removesuffix("_bucket").removesuffix("_count").removesuffix("_sum")
        for name, _ in parse_exposition(daemon.exposition.render().decode())
    }
    undocumented = {
        name
        for name in exported
        if name not in _documented()
        and f"{name}_total" not in _documented()
        and name.removesuffix("_total") not in _documented()
    }
    assert set() == undocumented


def _table_rows() -> dict[str, tuple[str, set[str]]]:
    """README metric-table rows: family (no prefix) -> (type, labels)."""
    rows = {}
    for line in README.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        for name in re.findall(r"`([a-z_]+)`", cells[0]):
            rows[name] = (cells[1], {label.strip() for label in cells[2].split(",") if label.strip()})
    return rows


def test_metric_tables_give_each_family_its_type_and_labels() -> None:
    """Type and labels of every README row match the metric contract (dashboards/metrics.txt) and the catalog."""
    contract = {}
    for line in (REPO / "dashboards" / "metrics.txt").read_text().splitlines():
        fields = line.split("#")[0].split()
        if fields:
            kind = "gauge" if fields[1] == "info" else fields[1]
            labels = set(fields[2].split(",")) if len(fields) > 2 else set()
            contract[fields[0].removeprefix("torchpulse_")] = (kind, labels)
    for name, family in CATALOG.items():
        assert contract[name] == (family.kind, {"run", "rank", *family.labels}), name
    rows = _table_rows()
    assert {} == {name: (row, contract.get(name)) for name, row in rows.items() if contract.get(name) != row}


def _backticked_after(intro: str, end: str) -> set[str]:
    start = README.index(intro) + len(intro)
    return set(re.findall(r"`([a-z_]+)`", README[start : README.index(end, start)]))


def test_listed_label_values_are_the_codes_own() -> None:
    """The recompile, CUDA-graph skip and re-record reasons the README lists are exactly the classifier's."""
    from torchpulse.probes.compile.reasons import CUDAGRAPH_SKIP_REASONS, RECOMPILE_REASONS, RERECORD_REASONS

    assert set(RECOMPILE_REASONS) == _backticked_after("`reason` of `recompiles_total` is one of", ";")
    assert set(CUDAGRAPH_SKIP_REASONS) == _backticked_after("CUDA-graph skip reasons:", "(on CPU")
    assert set(RERECORD_REASONS) == _backticked_after("re-record reasons:", ". ")


def test_the_alerts_listed_are_the_rules_files() -> None:
    """The alert names in "Dashboards and alerts" are exactly those of dashboards/prometheus/torchpulse.rules.yml."""
    rules = (REPO / "dashboards" / "prometheus" / "torchpulse.rules.yml").read_text()
    start = README.index("`dashboards/prometheus/torchpulse.rules.yml`: alerts")
    listed = set(re.findall(r"\b[A-Z][a-z]+(?:[A-Z][a-z]+)+\b", README[start : README.index("recording rules", start)]))
    assert set(re.findall(r"^\s*- alert:\s*(\S+)", rules, flags=re.MULTILINE)) == listed


def test_every_torchpulse_command_shown_parses() -> None:
    """Each `torchpulse ...` line of the README's sh blocks is accepted by the CLI's own parsers."""
    from torchpulse import cli
    from torchpulse.checkpoints import cli as check_cli

    blocks = re.findall(r"```sh\n(.*?)```", README, flags=re.DOTALL)
    commands = [
        shlex.split(line, comments=True)[1:]
        for block in blocks
        for line in block.splitlines()
        if line.startswith("torchpulse ")
    ]
    assert len(commands) > 15
    refused = []
    for argv in commands:
        try:
            if argv[0] == "check":
                check_cli._parser().parse_args(argv[1:])
            else:
                cli._parser().parse_args(argv)
        except SystemExit:
            refused.append(shlex.join(["torchpulse", *argv]))
    assert [] == refused
