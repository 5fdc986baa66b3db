"""The generated reference stays generated: docs/metrics.md, dashboards/metrics.txt and docs/configuration.md are
what `make docs` writes from the code, the catalog is every family the daemon exports, and the config docs cover
every key, variable and probe option the code reads."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import REPO, DaemonProcess
from torchpulse.catalog import CATALOG, DAEMON_FAMILIES, EXPORTED
from torchpulse.docgen import GENERATED, stale
from torchpulse.docgen.__main__ import main as docgen_main

METRICS_MD = REPO / "docs" / "metrics.md"
PACKAGE = REPO / "torchpulse"


def _documented_families() -> set[str]:
    """The families docs/metrics.md has a table row for."""
    return set(re.findall(r"^\| `(torchpulse_[a-z0-9_]+)` \|", METRICS_MD.read_text(), flags=re.MULTILINE))


def _type_lines(exposition: str) -> dict[str, str]:
    """Family name -> type, from the `# TYPE` lines of an exposition."""
    return {m[0]: m[1] for m in re.findall(r"^# TYPE (\S+) (\S+)$", exposition, flags=re.MULTILINE)}


@pytest.mark.parametrize("path", sorted(GENERATED))
def test_the_generated_file_is_what_the_code_renders(path: str) -> None:
    """Each generated file equals what its renderer makes of the code now; the fix is `make docs`."""
    assert (REPO / path).read_text() == GENERATED[path](), f"{path} is stale: run `make docs`"


def test_docgen_check_says_which_files_are_stale(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m torchpulse.docgen --check` exits 1 naming each missing file, and 0 once they are written."""
    assert 1 == docgen_main(["--check", "--root", str(tmp_path)])
    assert sorted(f"{path} is stale: run `make docs`" for path in GENERATED) == sorted(
        capsys.readouterr().err.splitlines()
    )
    assert 0 == docgen_main(["--root", str(tmp_path)])
    assert ([], 0) == (stale(tmp_path), docgen_main(["--check", "--root", str(tmp_path)]))


def test_metrics_md_names_every_family_of_the_contract() -> None:
    """docs/metrics.md has a row for each family of dashboards/metrics.txt, and for no other."""
    contract = {
        line.split()[0]
        for line in (REPO / "dashboards" / "metrics.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert contract == _documented_families()
    assert {family.exposed_name for family in EXPORTED.values()} == contract


def test_the_daemons_collectors_export_exactly_the_catalogs_daemon_families() -> None:
    """A daemon's scrape (its state persistence known) shows each daemon family of the catalog with its type,
    and no family that is in neither half of the catalog."""
    from torchpulse.daemon.checkpoints.stats import CheckpointStats
    from torchpulse.daemon.config import Config
    from torchpulse.daemon.service import Daemon
    from torchpulse.exporters.collectors.checkpoints import CheckpointCollector
    from torchpulse.exporters.prometheus import Exposition

    text = Daemon(Config()).exposition.render().decode()
    text += Exposition([CheckpointCollector(CheckpointStats(), lambda: True)]).render().decode()
    expected = {family.exposed_name: family.kind for family in DAEMON_FAMILIES.values()}
    assert expected == _type_lines(text)


def test_the_validation_histogram_has_the_bins_the_daemon_counts_in() -> None:
    """The catalog's bounds of checkpoint_validation_duration_seconds are the checkpoint statistics' bins."""
    from torchpulse.daemon.checkpoints.stats import DURATION_BUCKETS

    assert DURATION_BUCKETS == DAEMON_FAMILIES["checkpoint_validation_duration_seconds"].buckets


def test_no_agent_may_send_a_daemon_family() -> None:
    """The agents' catalog (what the wire accepts) and the daemon's own families do not meet."""
    assert set() == set(CATALOG) & set(DAEMON_FAMILIES)


def _string_literals(root: Path) -> set[str]:
    found: set[str] = set()
    # The docs' generator names every variable: it is not one that reads them.
    for path in (p for p in root.rglob("*.py") if "docgen" not in p.parts):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.add(node.value)
    return found


def test_every_variable_the_package_reads_is_documented() -> None:
    """Each TORCHPULSE_* name in the package's code is in docs/configuration.md's tables (options by prefix)."""
    from torchpulse.docgen.configuration import TEST_VARIABLES, VARIABLES

    names = {m for text in _string_literals(PACKAGE) for m in re.findall(r"\bTORCHPULSE_[A-Z_]*[A-Z]\b", text)}
    options = {name for name in names if name.startswith("TORCHPULSE_OPT_")}
    assert set() == names - options - set(VARIABLES)
    conftest = (REPO / "tests" / "conftest.py").read_text()
    assert set(re.findall(r"\bTORCHPULSE_TEST_[A-Z_]+\b", conftest)) == set(TEST_VARIABLES)


def _options_read() -> set[str]:
    """The probe options the probes read with `int_option(options, "name", ...)`."""
    found: set[str] = set()
    for path in (PACKAGE / "probes").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "int_option" and len(node.args) > 1:
                name = node.args[1]
                if isinstance(name, ast.Constant) and isinstance(name.value, str):
                    found.add(name.value)
    return found


def test_every_probe_option_read_is_documented() -> None:
    """Each option a probe reads (the autograd settings and every `int_option`) has a row with its default."""
    from torchpulse.docgen.configuration import probe_option_defaults

    documented = set(probe_option_defaults())
    assert {"compile_top_k", "cudagraph_readiness_every"} <= _options_read()
    assert set() == _options_read() - documented
    configuration = (REPO / "docs" / "configuration.md").read_text()
    assert [] == [o for o in sorted(documented) if f"`TORCHPULSE_OPT_{o.upper()}`" not in configuration]


@pytest.mark.process
def test_metrics_md_names_every_family_of_a_real_scrape_of_the_demo_job(daemon: DaemonProcess, tmp_path: Path) -> None:
    """The demo's job (compiled, a NaN gradient, DCP saves the daemon validates, a failing save) under
    `torchpulse run` against a real daemon: every family of the scrape has its row in docs/metrics.md."""
    job = [
        sys.executable, "-m", "torchpulse", "run", "--run-name", "docs",
        "--", sys.executable, "-m", "torchpulse.demo_job", "--steps", "8", "--compile", "--nan-at-step", "2",
        "--checkpoint-dir", str(tmp_path / "checkpoints"), "--checkpoint-every", "4", "--fail-save-at-step", "6",
    ]  # fmt: skip
    result = subprocess.run(
        job, cwd=REPO, env=daemon.env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=240
    )
    assert 0 == result.returncode, result.stderr
    deadline = time.monotonic() + 90
    while "torchpulse_checkpoint_validations_total{" not in daemon.scrape_text() and time.monotonic() < deadline:
        time.sleep(0.5)
    scraped = set(_type_lines(daemon.scrape_text()))
    assert {"torchpulse_recompiles_total", "torchpulse_checkpoint_save_failures_total"} <= scraped
    assert set() == scraped - _documented_families()
