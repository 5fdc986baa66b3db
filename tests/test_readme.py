"""The README and the hand-written docs stay true to the code: the commands, names, paths and outputs they show.

The generated docs (docs/metrics.md, docs/configuration.md) are checked against the code in tests/test_docs.py.
"""

from __future__ import annotations

import argparse
import ast
import re
import shlex
from functools import cache
from pathlib import Path

import pytest

from tests.support import REPO
from torchpulse.catalog import EXPORTED
from torchpulse.docgen import GENERATED

README = REPO / "README.md"
MAX_README_LINES = 250
# The hand-written pages: what a person wrote can drift from the code.
WRITTEN = [README, *sorted(p for p in (REPO / "docs").glob("*.md") if str(p.relative_to(REPO)) not in GENERATED)]
ALL_DOCS = [README, *sorted((REPO / "docs").glob("*.md"))]
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")


def _text(paths: list[Path]) -> str:
    return "\n".join(path.read_text() for path in paths)


def _sh_lines(paths: list[Path]) -> list[str]:
    blocks = re.findall(r"```sh\n(.*?)```", _text(paths), flags=re.DOTALL)
    return [line for block in blocks for line in block.splitlines()]


def test_the_readme_stays_a_newcomers_page() -> None:
    """The README has at most 250 lines: reference material lives in docs/."""
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move reference material into docs/"


def _torchpulse_argv(line: str) -> list[str] | None:
    """The arguments of the `torchpulse` command a shell line runs, also behind a launcher (`srun ... torchpulse`)."""
    from torchpulse import cli

    actions = cli._parser()._actions
    subcommands = {name for a in actions if isinstance(a, argparse._SubParsersAction) for name in a.choices}
    words = shlex.split(line, comments=True)
    for index, word in enumerate(words):
        follows = words[index + 1] if index + 1 < len(words) else None
        if word == "torchpulse" and (index == 0 or follows in subcommands):
            return words[index + 1 :]
    return None


def test_every_torchpulse_command_shown_parses() -> None:
    """Each `torchpulse ...` line of the sh blocks of the README and docs is accepted by the CLI's own parsers."""
    from torchpulse import cli
    from torchpulse.checkpoints import cli as check_cli

    commands = [argv for line in _sh_lines(ALL_DOCS) if (argv := _torchpulse_argv(line)) is not None]
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


def test_every_make_target_shown_exists() -> None:
    """Each `make TARGET` the README and docs name is a target of the Makefile."""
    targets = set(re.findall(r"^([a-z][a-z-]*):", (REPO / "Makefile").read_text(), flags=re.MULTILINE))
    shown = set(re.findall(r"`make ([a-z][a-z-]*)", _text(ALL_DOCS)))
    shown |= {line.split()[1] for line in _sh_lines(ALL_DOCS) if line.startswith("make ")}
    assert set() == shown - targets


@cache
def _alerts() -> set[str]:
    rules = (REPO / "dashboards" / "prometheus" / "torchpulse.rules.yml").read_text()
    return set(re.findall(r"^\s*- alert:\s*(\S+)", rules, flags=re.MULTILINE))


def test_the_alerts_listed_are_the_rules_files() -> None:
    """The alert names in the README's "Dashboards and alerts" are exactly those of the rules file."""
    text = README.read_text()
    start = text.index("`dashboards/prometheus/torchpulse.rules.yml`: alerts")
    listed = set(re.findall(r"\b[A-Z][a-z]+(?:[A-Z][a-z]+)+\b", text[start : text.index("recording rules", start)]))
    assert _alerts() == listed


def test_every_alert_named_in_the_docs_is_a_rule() -> None:
    """An alert named anywhere in the README or docs (a CamelCase name that fires) is one of the rules file's."""
    words = set(re.findall(r"\b[A-Z][a-z]+(?:[A-Z][a-z]+)+\b", _text(ALL_DOCS)))
    # The alert-like names: those the rules use plus the words alerts are made of, never a class name of torch's.
    alert_like = {w for w in words if w.startswith("Torchpulse") or w.endswith(("Failed", "Stalled", "Unreadable"))}
    assert set() == alert_like - _alerts()
    assert {"TorchpulseAgentDown", "CheckpointSaveFailed", "NonFiniteGradients"} <= words & _alerts()


def _exported(name: str) -> bool:
    base = name.removeprefix("torchpulse_")
    return base in EXPORTED or any(base.endswith(s) and base.removesuffix(s) in EXPORTED for s in HISTOGRAM_SERIES)


def test_every_metric_named_is_exported() -> None:
    """Each `torchpulse_...` metric name in the README and the hand-written docs is a family of the catalog."""
    named = set(re.findall(r"\btorchpulse_[a-z0-9_]*[a-z0-9]\b", _text(WRITTEN)))
    assert set() == {name for name in named if not _exported(name)}


def test_every_config_key_named_exists() -> None:
    """Each `section.key` the README and the hand-written docs name is a key of the config file."""
    from torchpulse.docgen.configuration import config_keys

    named = set(re.findall(r"`((?:daemon|runs|checkpoints)\.[a-z_]+)`", _text(WRITTEN)))
    assert set() == named - set(config_keys())


def test_every_variable_named_is_documented() -> None:
    """Each `TORCHPULSE_*` variable the README and docs name is in docs/configuration.md's tables."""
    configuration = (REPO / "docs" / "configuration.md").read_text()
    documented = set(re.findall(r"^\| `(TORCHPULSE_[A-Z_<>]+)`", configuration, flags=re.MULTILINE))
    named = set(re.findall(r"\bTORCHPULSE_[A-Z_]*[A-Z]\b", _text(WRITTEN)))
    assert set() == named - documented


def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}


def test_every_path_shown_exists() -> None:
    """Each repository path the README and docs show (a file, a folder, a test named `file::test`) exists."""
    pattern = r"(?<![\w/.-])((?:torchpulse|tests|bench|dashboards|systemd|docs|fuzz)/[\w./-]*[\w/])(?:::(\w+))?"
    missing = []
    for path, test in re.findall(pattern, _text(ALL_DOCS)):
        target = REPO / path
        if not target.exists() or (test and test not in _test_functions(target)):
            missing.append(f"{path}::{test}" if test else path)
    assert [] == sorted(set(missing))


def test_every_doc_linked_exists() -> None:
    """Each relative Markdown link of the README and docs leads to a file of the repository."""
    dead = []
    for page in ALL_DOCS:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            if not (page.parent / target).exists():
                dead.append(f"{page.relative_to(REPO)}: {target}")
    assert [] == dead


def _block_after(text: str, intro: str) -> list[str]:
    start = text.index("```\n", text.index(intro)) + len("```\n")
    return text[start : text.index("```", start)].rstrip("\n").splitlines()


def test_the_status_shown_is_what_torchpulse_status_prints() -> None:
    """The README's `torchpulse status` sample is what the client prints for the run it describes."""
    from torchpulse import __version__
    from torchpulse.daemon.client import format_status
    from torchpulse.protocol import RankStatus, RunStatus, StatusReply

    ranks = [RankStatus(rank, pid, "vm", False, 23, 0, 1.0, exited=True) for rank, pid in ((0, 6633), (1, 6634))]
    reply = StatusReply(__version__, 7.0, 6627, 48, {}, [RunStatus("demo", 2, True, ranks)])
    assert format_status(reply).splitlines() == _block_after(README.read_text(), "`torchpulse status` asks")


def test_the_demo_table_shown_has_the_demos_columns() -> None:
    """The README's per-rank table of `make demo` has the columns the demo's summary prints."""
    from torchpulse.summary import format_table

    header = re.split(r"\s{2,}", format_table([]).splitlines()[0])
    shown = _block_after(README.read_text(), "`make demo` prints a per-rank table")
    assert header == re.split(r"\s{2,}", shown[0])


def _bench_recipe_commands() -> set[str]:
    makefile = (REPO / "Makefile").read_text()
    recipe = makefile[makefile.index("\nbench:") : makefile.index("exit $$status", makefile.index("\nbench:"))]
    commands = re.findall(r"\brun (.+?);", recipe)
    return {c.replace("$(PY)", ".venv/bin/python").replace("env PYTHONPATH=. ", "PYTHONPATH=. ") for c in commands}


def test_the_benchmarks_table_runs_what_make_bench_runs() -> None:
    """docs/benchmarks.md's commands are exactly those of `make bench`, so each figure has its command."""
    text = (REPO / "docs" / "benchmarks.md").read_text()
    rows = [line.split("|")[2].strip() for line in text.splitlines() if line.startswith("| ") and "`" in line]
    commands = {row.strip("`") for row in rows if row != "same"}
    assert _bench_recipe_commands() == commands


def _constants(script: str) -> dict[str, float]:
    source = (REPO / "bench" / script).read_text()
    pairs = re.findall(r"^([A-Z][A-Z0-9_]*) = ([0-9.]+)$", source, flags=re.MULTILINE)
    return {name: float(value) for name, value in pairs}


def test_the_budgets_shown_are_the_benchmarks_own() -> None:
    """The budgets docs/benchmarks.md gives the scrape, load and compile benchmarks are the scripts' constants."""
    ingest, load, compile_ = _constants("ingest.py"), _constants("load.py"), _constants("compile_overhead.py")
    text = (REPO / "docs" / "benchmarks.md").read_text()
    budgets = [
        f"| p50 ≤ {ingest['IDLE_SCRAPE_P50_BUDGET'] * 1e3:.0f} ms |",
        f"p50 ≤ {load['LOADED_SCRAPE_P50_BUDGET'] * 1e3:.0f} ms, p99 ≤ {load['LOADED_SCRAPE_P99_BUDGET'] * 1e3:.0f} ms",
        f"RSS peak ≤ {load['RSS_PEAK_BUDGET_MIB']:.0f} MiB; daemon CPU ≤ {load['CPU_SHARE_BUDGET'] * 100:.0f} %",
        f"| ≤ {compile_['BUDGET']:g} |",
    ]
    assert [] == [budget for budget in budgets if budget not in text]


@pytest.mark.parametrize("page", ["metrics.md", "configuration.md"])
def test_the_readme_marks_the_generated_docs(page: str) -> None:
    """The README's docs table lists each generated page as generated."""
    [row] = [line for line in README.read_text().splitlines() if line.startswith(f"| [docs/{page}]")]
    assert "(generated)" in row
