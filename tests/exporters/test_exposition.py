"""The exposition: supervised collectors, text rendering of agent series, escaping (also through a real scrape)."""

from __future__ import annotations

import math
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from msgspec.structs import replace
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from tests.support import parse_exposition, require_tool, select, start_daemon, wait_for
from torchpulse.catalog import CATALOG
from torchpulse.daemon.registry import Registry
from torchpulse.exporters.prometheus import build_exposition
from torchpulse.protocol import Batch, Hello, HistogramSample, Sample, encode

HELLO = Hello('we"ird\\run\n', 3, 0, 4, 1, "h", "2.13.0", "0.1.0", "cmd", 0.0)


class Broken:
    name = "broken"

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("torchpulse_half", "emitted before the failure", value=1.0)
        raise RuntimeError("collector bug")


def _registry_with_one_rank() -> Registry:
    registry = Registry()
    run, rank = registry.connect(HELLO, None)
    registry.apply(
        run,
        rank,
        Batch(
            1,
            0.0,
            [
                Sample("optimizer_steps_total", ('Ad"am#0',), 5.0),
                Sample("optimizer_learning_rate", ("Adam#0", "0"), math.inf),
            ],
            [HistogramSample("optimizer_step_duration_seconds", ("Adam#0",), (1,) * 19, 2.5)],
            [],
        ),
    )
    return registry


def test_a_failing_collector_is_reported_and_the_scrape_survives() -> None:
    """A collector that raises adds nothing (not even its partial output) and reports success 0."""
    exposition = build_exposition(_registry_with_one_rank(), [Broken()])
    samples = parse_exposition(exposition.render().decode())
    assert {"broken": 0.0, "daemon": 1.0, "agents": 1.0, "agent_series": 1.0} == {
        dict(k)["collector"]: v for k, v in select(samples, "torchpulse_scrape_collector_success").items()
    }
    assert {} == select(samples, "torchpulse_half")


def test_agent_series_render_escaped_labels_histograms_and_infinities() -> None:
    """Rendered text parses back to the same labels and values, with cumulative buckets."""
    samples = parse_exposition(build_exposition(_registry_with_one_rank()).render().decode())
    run = 'we"ird\\run\n'
    assert [5.0] == list(select(samples, "torchpulse_optimizer_steps_total", run=run, optimizer='Ad"am#0').values())
    assert [math.inf] == list(select(samples, "torchpulse_optimizer_learning_rate", rank="3").values())
    buckets = select(samples, "torchpulse_optimizer_step_duration_seconds_bucket", le="+Inf")
    assert ([19.0], [19.0]) == (
        list(buckets.values()),
        list(select(samples, "torchpulse_optimizer_step_duration_seconds_count").values()),
    )


def test_negative_bucket_counts_are_refused_before_they_count_as_a_series() -> None:
    """Cumulative buckets must not decrease: a histogram with a negative count is refused and counted."""
    registry = Registry()
    run, rank = registry.connect(HELLO, None)
    registry.apply(
        run,
        rank,
        Batch(
            1, 0.0, [], [HistogramSample("optimizer_step_duration_seconds", ("Adam#0",), (-5,) + (1,) * 18, 2.5)], []
        ),
    )
    assert (0, 0, 1) == (run.series, rank.series, registry.series_rejected["bad_buckets"])


def test_a_histogram_sum_that_is_nan_inf_or_negative_is_refused_and_the_last_good_one_stays() -> None:
    """Histograms observe durations (every one in the catalog): a bad `_sum` would poison the mean."""
    assert [] == [f.name for f in CATALOG.values() if f.kind == "histogram" and not f.name.endswith("_seconds")]
    registry = Registry()
    run, rank = registry.connect(HELLO, None)
    good = (1,) * 19
    registry.apply(
        run, rank, Batch(1, 0.0, [], [HistogramSample("optimizer_step_duration_seconds", ("Adam#0",), good, 2.5)], [])
    )
    for bad in (math.nan, math.inf, -1.0):
        registry.apply(
            run,
            rank,
            Batch(2, 0.0, [], [HistogramSample("optimizer_step_duration_seconds", ("Adam#0",), (2,) * 19, bad)], []),
        )
    assert (good, 2.5) == rank.histograms[("optimizer_step_duration_seconds", ("Adam#0",))]
    assert 3 == registry.series_rejected["bad_value"]


def test_a_counter_that_is_nan_inf_or_negative_is_refused_and_the_last_good_total_stays() -> None:
    """Counters render only finite non-negative totals (NaN would make every rate() NaN); gauges may be NaN."""
    registry = Registry()
    run, rank = registry.connect(HELLO, None)
    registry.apply(run, rank, Batch(1, 0.0, [Sample("optimizer_steps_total", ("Adam#0",), 7.0)], [], []))
    for bad in (math.nan, math.inf, -1.0):
        registry.apply(
            run,
            rank,
            Batch(
                2,
                0.0,
                [
                    Sample("optimizer_steps_total", ("Adam#0",), bad),
                    Sample("backward_passes_total", ("backward",), bad),
                ],
                [],
                [],
            ),
        )
    registry.apply(run, rank, Batch(3, 0.0, [Sample("grad_norm", (), math.nan)], [], []))
    assert 7.0 == rank.values[("optimizer_steps_total", ("Adam#0",))]
    assert ("backward_passes_total", ("backward",)) not in rank.values
    assert math.isnan(rank.values[("grad_norm", ())])
    assert (2, 6) == (run.series, registry.series_rejected["bad_value"])
    samples = parse_exposition(build_exposition(registry).render().decode())
    assert {"bad_value": 6.0} == {
        dict(k)["reason"]: v
        for k, v in select(samples, "torchpulse_daemon_series_rejected_total").items()
        if dict(k)["reason"] == "bad_value"
    }


def test_status_text_escapes_control_characters_in_agent_names() -> None:
    from torchpulse.daemon.client import format_status
    from torchpulse.protocol import RankStatus, RunStatus, StatusReply

    reply = StatusReply(
        "0.1.0",
        1.0,
        1,
        0,
        {},
        [RunStatus("evil\nrun \x1b[2J", 1, False, [RankStatus(0, 1, "host\rX", True, 0, 0, 0.0)])],
    )
    text = format_status(reply)
    assert "run evil\\nrun \\x1b[2J (running" in text and "host\\rX" in text
    assert "\x1b" not in text and "\r" not in text


def test_ctl_text_escapes_control_characters_in_the_run_name() -> None:
    """`torchpulse ctl` echoes the run it was given; a run nobody serves must not reach the terminal raw."""
    from torchpulse.daemon.client import format_ctl
    from torchpulse.protocol import CtlReply

    text = format_ctl(CtlReply(run="evil\x1b[2J", command="trace", results=[]))
    assert "run evil\\x1b[2J: no such run" in text and "\x1b" not in text


def test_a_new_process_with_the_same_pid_and_host_starts_from_empty_series() -> None:
    """A container restarted in its pod often runs the job as the same pid on the same host: only a
    hello with the same started_at is the same process reconnecting (its series kept); another one
    starts empty, so a stale gauge of the dead process cannot keep an alert firing."""
    registry = Registry()
    run, rank = registry.connect(HELLO, None)
    registry.apply(run, rank, Batch(1, 0.0, [Sample("grad_nonfinite_parameters", (), 3.0)], [], []))
    _, same = registry.connect(HELLO, None)
    kept = dict(same.values)
    registry.disconnect(run, same, owned=True)  # the old process died: its connection closed
    _, restarted = registry.connect(replace(HELLO, started_at=HELLO.started_at + 60.0), None)
    assert ({("grad_nonfinite_parameters", ()): 3.0}, {}, 0) == (kept, dict(restarted.values), run.series)


@pytest.mark.process
def test_label_text_with_quotes_backslashes_and_control_characters_survives_a_real_scrape(tmp_path: Path) -> None:
    """Run, host and command with `"`, `\\`, newline, CR, NUL and non-ASCII come back exactly; promtool is silent."""
    weird = 'a"b\\c\nd\re\tf\x00g\u2028h\x7f\ufeff\u00e9\U0001f600'
    command = (weird * 40)[:512]
    daemon = start_daemon(tmp_path)
    try:
        with socket.socket(socket.AF_UNIX) as agent:
            agent.settimeout(10)
            agent.connect(str(daemon.socket_path))
            agent.sendall(encode(Hello(weird, 0, 0, 1, os.getpid(), weird, "2.13.0", "0.1.0", command, time.time())))
            agent.recv(4096)
            agent.sendall(encode(Batch(1, time.time(), [Sample("optimizer_steps_total", (weird,), 3.0)], [], [])))
            wait_for(lambda: bool(select(daemon.scrape(), "torchpulse_optimizer_steps_total")))
            text = daemon.scrape_text()
    finally:
        daemon.stop()
    promtool = subprocess.run(
        [require_tool("promtool"), "check", "metrics"],
        input=text.encode(),
        capture_output=True,
        timeout=60,
        check=False,
    )
    samples = parse_exposition(text)
    assert (0, b"", b"") == (promtool.returncode, promtool.stdout, promtool.stderr)
    assert [3.0] == list(select(samples, "torchpulse_optimizer_steps_total", run=weird, optimizer=weird).values())
    assert [1.0] == list(select(samples, "torchpulse_run_info", run=weird, host=weird, command=command).values())
