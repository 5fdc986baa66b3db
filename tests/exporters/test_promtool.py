"""Every family the daemon can export, at once, through `promtool check metrics`: served and as a textfile."""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import require_tool
from torchpulse.catalog import CATALOG
from torchpulse.daemon.checkpoints.stats import CheckpointStats, DurationHistogram
from torchpulse.daemon.registry import Registry
from torchpulse.exporters.collectors.checkpoints import CheckpointCollector
from torchpulse.exporters.prometheus import build_exposition
from torchpulse.exporters.textfile import write_textfile
from torchpulse.protocol import Batch, Hello, HistogramSample, Sample

HELLO = Hello("run-1", 0, 0, 1, 1, "host", "2.13.0", "0.1.0", "python train.py", 0.0)


def _everything() -> bytes:
    """An exposition with a series in every catalog family and every family of the daemon's own collectors."""
    registry = Registry()
    run, rank = registry.connect(HELLO, None)
    samples = [Sample(name, ("x",) * len(f.labels), 1.0) for name, f in CATALOG.items() if f.kind != "histogram"]
    histograms = [
        HistogramSample(name, ("x",) * len(f.labels), (1,) * (len(f.buckets) + 1), 2.5)
        for name, f in CATALOG.items()
        if f.kind == "histogram"
    ]
    registry.apply(run, rank, Batch(1, 0.0, samples, histograms, []))
    assert len(CATALOG) == rank.series
    stats = CheckpointStats()
    root = stats.root("/ckpt")
    root.validations["valid"] = 1
    root.last_validation = root.last_valid = root.latest_committed = root.last_announced = 1.7e9
    root.last_status, root.findings, root.bytes, root.incomplete = "invalid", {("TP-CKPT-001", "error"): 2}, 10, 1
    stats.durations["data"] = DurationHistogram()
    stats.durations["data"].observe(3.0)
    return build_exposition(registry, [CheckpointCollector(stats)]).render()


def _promtool(text: bytes) -> tuple[int, str, str]:
    result = subprocess.run(
        [require_tool("promtool"), "check", "metrics"], input=text, capture_output=True, timeout=60, check=False
    )
    return result.returncode, result.stdout.decode(), result.stderr.decode()


@pytest.mark.process
def test_every_family_passes_promtool_with_no_complaint() -> None:
    """Names, units, HELP, TYPE and histogram series of every family: promtool prints nothing."""
    assert (0, "", "") == _promtool(_everything())


def test_no_family_is_exposed_twice() -> None:
    """A second TYPE line for a name fails the whole scrape: catalog and daemon collectors never share a name."""
    types = Counter(re.findall(r"^# TYPE (\S+) ", _everything().decode(), flags=re.MULTILINE))
    assert [] == [name for name, count in types.items() if count > 1]
    assert {f.exposed_name for f in CATALOG.values()} <= set(types)


@pytest.mark.process
def test_the_textfile_is_the_same_exposition_and_passes_promtool(tmp_path: Path) -> None:
    """What node_exporter reads is byte for byte the exposition, with no timestamps (it refuses those)."""
    data = _everything()
    path = tmp_path / "torchpulse.prom"
    write_textfile(data, path)
    assert (data, [path]) == (path.read_bytes(), list(tmp_path.iterdir()))
    assert (0, "", "") == _promtool(path.read_bytes())
    stamped = [s.name for f in text_string_to_metric_families(data.decode()) for s in f.samples if s.timestamp]
    assert [] == stamped
