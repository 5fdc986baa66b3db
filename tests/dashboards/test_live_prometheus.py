"""A real Prometheus scrapes a real daemon while a real training job runs; every query must work.

Every expression of the dashboard and of the rules goes through Prometheus'
HTTP API. None may error, and the panels of what the demo job exercises
(agents, runs, optimizer, daemon health) must return data.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from dashboard_files import Family, Rule, dashboard_targets, grafana_to_promql, stat_count_targets
from prometheus_client.parser import text_string_to_metric_families

RUN = "live-prometheus"
# Families the CPU demo job and the daemon produce; a query over these alone must return data.
EXERCISED = {
    "torchpulse_agent_up",
    "torchpulse_run_info",
    "torchpulse_optimizer_steps_total",
    "torchpulse_optimizer_step_duration_seconds_bucket",
    "torchpulse_optimizer_step_duration_seconds_sum",
    "torchpulse_optimizer_step_duration_seconds_count",
    "torchpulse_optimizer_learning_rate",
    "torchpulse_optimizer_parameters",
    "torchpulse_daemon_events_received_total",
    "torchpulse_scrape_collector_success",
    "torchpulse_scrape_collector_duration_seconds",
}

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _get(url: str, timeout: float = 10) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def _wait(what: str, check: Callable[[], bool], proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{what}: process exited with {proc.returncode}")
        with contextlib.suppress(OSError, ValueError):
            if check():
                return
        time.sleep(0.25)
    pytest.fail(f"{what}: not within {timeout} s")


@contextlib.contextmanager
def _started(command: list[str], log: Path, **kwargs: Any) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **kwargs)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(15)


def _query(base: str, expr: str) -> dict[str, Any]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        reply: dict[str, Any] = _get(url)
    except urllib.error.HTTPError as exc:  # 400/422 carry the PromQL error as JSON
        reply = json.loads(exc.read())
    return reply


def _metrics(expr: str) -> set[str]:
    import re

    return set(re.findall(r"(?<![:\w])(torchpulse_[a-z0-9_]+)(?![:\w])", expr))


def contract_mismatches(exposition: str, contract: dict[str, Family]) -> dict[str, tuple[str, str]]:
    """Families of a real scrape that metrics.txt lacks or lists with another type or other labels."""
    kinds = {"info": "gauge"}  # run_info and build_info are exposed as gauges
    mismatches: dict[str, tuple[str, str]] = {}
    for family in text_string_to_metric_families(exposition):
        name = family.name + "_total" if family.type == "counter" else family.name
        labels = sorted({label for sample in family.samples for label in sample.labels} - {"le"})
        exported = f"{family.type} {','.join(labels)}"
        listed = contract.get(name)
        # A family with no sample yet (no findings, no rank) shows its type only.
        listed_labels = ",".join(sorted(listed.labels)) if listed and family.samples else ""
        expected = f"{kinds.get(listed.kind, listed.kind)} {listed_labels}" if listed else "missing"
        if exported != expected:
            mismatches[name] = (exported, expected)
    return mismatches


def test_every_dashboard_and_rule_expression_runs_against_live_data(
    tmp_path: Path,
    dashboard: dict[str, Any],
    rules: list[Rule],
    contract: dict[str, Family],
    require_tool: Callable[[str], str],
) -> None:
    """Daemon + demo job + Prometheus (1 s scrapes): all queries succeed, exercised panels have data, counting
    stat panels read 0 for a run nobody trains, and every family the daemon really exports is in metrics.txt
    with its type and labels."""
    try:
        import torchpulse.cli  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"torchpulse.cli does not import yet: {exc}")
    prometheus = require_tool("prometheus")
    agent_socket = tmp_path / "agent.sock"
    daemon_port, prometheus_port = _free_port(), _free_port()
    metrics_url = f"http://127.0.0.1:{daemon_port}/metrics"
    base = f"http://127.0.0.1:{prometheus_port}"
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: torchpulse\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{daemon_port}']}}]\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    daemon_cmd = [
        sys.executable, "-m", "torchpulse", "daemon", "--socket", str(agent_socket),
        "--listen", f"127.0.0.1:{daemon_port}", "--state-dir", str(tmp_path / "state"),
    ]  # fmt: skip
    prometheus_cmd = [
        prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{prometheus_port}",
    ]  # fmt: skip
    job_cmd = [
        sys.executable, "-m", "torchpulse", "run", "--socket", str(agent_socket), "--run-name", RUN,
        "--", sys.executable, "-m", "torchpulse.demo_job", "--steps", "100000", "--step-sleep", "0.05",
    ]  # fmt: skip

    with (
        _started(daemon_cmd, tmp_path / "daemon.log", env=env) as daemon,
        _started(prometheus_cmd, tmp_path / "prometheus.log") as prom,
    ):
        _wait("daemon /metrics", lambda: urllib.request.urlopen(metrics_url, timeout=2).status == 200, daemon, 60)
        _wait("prometheus ready", lambda: urllib.request.urlopen(f"{base}/-/ready", timeout=2).status == 200, prom, 60)
        with _started(job_cmd, tmp_path / "job.log", env=env) as job:
            stepping = f'sum(rate(torchpulse_optimizer_steps_total{{run="{RUN}"}}[5s])) > 0'
            _wait("steps in Prometheus", lambda: bool(_query(base, stepping)["data"]["result"]), job, 120)
            time.sleep(5)  # several more scrapes, so every rate() window holds samples

            run_values = _get(f"{base}/api/v1/label/run/values?match[]=torchpulse_run_info")["data"]
            with urllib.request.urlopen(metrics_url, timeout=10) as response:
                exposition = response.read().decode()
            errors, empty, with_data = [], [], 0
            queries = [(title, grafana_to_promql(expr, run=RUN)) for title, expr in dashboard_targets(dashboard)]
            queries += [(f"rule {rule.name}", rule.expr) for rule in rules]
            for title, expr in queries:
                reply = _query(base, expr)
                if reply.get("status") != "success":
                    errors.append(f"{title}: {reply.get('error')}: {expr}")
                elif reply["data"]["result"]:
                    with_data += 1
                elif _metrics(expr) and _metrics(expr) <= EXERCISED and not title.startswith("rule "):
                    empty.append(f"{title}: {expr}")
            # A run nobody trains: counting stat panels read 0, not "No data".
            not_zero = []
            for title, expr in stat_count_targets(dashboard):
                result = _query(base, grafana_to_promql(expr, run="no-such-run"))["data"]["result"]
                if [sample["value"][1] for sample in result] != ["0"]:
                    not_zero.append(f"{title}: {result}: {expr}")

    print(f"{len(queries)} queries ran, {with_data} returned data")
    assert RUN in run_values
    assert contract_mismatches(exposition, contract) == {}
    assert errors == []
    assert empty == []
    assert not_zero == []
