"""End to end: real training processes under `torchpulse run`, a real daemon, real scrapes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import REPO, DaemonProcess, require_tool, select, wait_for
from torchpulse.summary import histogram_quantile

STEPS = 24


def _job(daemon: DaemonProcess, *args: str, run: str = "it", ranks: int = 2, **env: str) -> list[subprocess.Popen[str]]:
    """Start `ranks` processes of the demo job under `torchpulse run`, like torchrun would."""
    procs = []
    for rank in range(ranks):
        cmd = [
            sys.executable,
            "-m",
            "torchpulse",
            "run",
            "--run-name",
            run,
            "--",
            sys.executable,
            "-m",
            "torchpulse.demo_job",
            *args,
        ]
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=REPO,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=daemon.env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), OMP_NUM_THREADS="1", **env),
            )
        )
    return procs


def _finish(procs: list[subprocess.Popen[str]]) -> list[tuple[int, str]]:
    return [(p.wait(180), p.stderr.read() if p.stderr else "") for p in procs]


def test_two_ranks_report_exact_steps_histograms_and_scheduled_lr(daemon: DaemonProcess) -> None:
    """After N steps on 2 ranks /metrics shows N steps each, N observations, and the scheduler's last lr."""
    results = _finish(_job(daemon, "--steps", str(STEPS), "--lr", "0.01"))
    assert [(0, ""), (0, "")] == results
    samples = daemon.scrape()
    for rank in ("0", "1"):
        steps = select(samples, "torchpulse_optimizer_steps_total", run="it", rank=rank)
        count = select(samples, "torchpulse_optimizer_step_duration_seconds_count", run="it", rank=rank)
        total = select(samples, "torchpulse_optimizer_step_duration_seconds_sum", run="it", rank=rank)
        lr = select(samples, "torchpulse_optimizer_learning_rate", run="it", rank=rank, param_group="0")
        assert ([float(STEPS)], [float(STEPS)]) == (list(steps.values()), list(count.values()))
        # StepLR halves every STEPS/4 steps; the last step ran with lr after 3 halvings.
        assert [0.01 * 0.5**3] == list(lr.values())
        buckets = [
            (float(dict(k)["le"]), v)
            for k, v in select(
                samples, "torchpulse_optimizer_step_duration_seconds_bucket", run="it", rank=rank
            ).items()
        ]
        p50 = histogram_quantile(0.5, buckets)
        assert 0 < next(iter(total.values())) < STEPS * 1.0
        assert 1e-5 < p50 < 1.0
    info = select(samples, "torchpulse_run_info", run="it")
    assert ["2"] == [dict(k)["world_size"] for k in info]


def test_non_finite_passes_are_exported_at_zero_before_the_first_nan(daemon: DaemonProcess) -> None:
    """While the job still trains clean /metrics shows the non-finite counter at 0, and 1 after its NaN
    step: an increase() that Prometheus can see, not a series born at 1."""
    nan_at = 30
    procs = _job(daemon, "--steps", "40", "--step-sleep", "0.1", "--nan-at-step", str(nan_at), run="zeros", ranks=1)
    wait_for(lambda: bool(select(daemon.scrape(), "torchpulse_optimizer_steps_total", run="zeros")), timeout=60)
    samples = daemon.scrape()
    [steps] = select(samples, "torchpulse_optimizer_steps_total", run="zeros", rank="0").values()
    assert steps < nan_at  # else this scrape shows nothing about the time before the NaN
    assert [0.0] == list(select(samples, "torchpulse_grad_nonfinite_passes_total", run="zeros", rank="0").values())
    assert [(0, "")] == _finish(procs)
    assert [1.0] == list(
        select(daemon.scrape(), "torchpulse_grad_nonfinite_passes_total", run="zeros", rank="0").values()
    )


def test_promtool_accepts_the_real_exposition(daemon: DaemonProcess) -> None:
    """`promtool check metrics` on a scrape taken after a real job prints nothing."""
    promtool = require_tool("promtool")
    assert [(0, "")] == _finish(_job(daemon, "--steps", "3", ranks=1))
    result = subprocess.run(
        [promtool, "check", "metrics"], input=daemon.scrape_text(), capture_output=True, text=True, timeout=60
    )
    assert (0, "", "") == (result.returncode, result.stdout, result.stderr)


@pytest.mark.process
def test_job_without_daemon_trains_with_one_warning_line(tmp_path: Path) -> None:
    """With no daemon the job exits 0 and stderr holds exactly one torchpulse warning line."""
    env = dict(os.environ, PYTHONPATH=str(REPO), TORCHPULSE_SOCKET=str(tmp_path / "absent.sock"))
    result = subprocess.run(
        [sys.executable, "-m", "torchpulse", "run", "--", sys.executable, "-m", "torchpulse.demo_job", "--steps", "5"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert 0 == result.returncode
    lines = result.stderr.splitlines()
    assert 1 == len(lines), result.stderr
    assert lines[0].startswith("torchpulse: daemon not reachable; training continues")


@pytest.mark.process
def test_a_socket_path_too_long_for_unix_sockets_is_one_clear_line_and_the_job_trains(tmp_path: Path) -> None:
    """`--socket agent.sock` in a deep directory is made absolute past 107 bytes: one line saying so, exit 0."""
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchpulse",
            "run",
            "--socket",
            "agent.sock",
            "--",
            sys.executable,
            "-m",
            "torchpulse.demo_job",
            "--steps",
            "5",
        ],
        cwd=deep,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = result.stderr.splitlines()
    assert (0, 1) == (result.returncode, len(lines)), result.stderr
    assert lines[0].startswith("torchpulse: the daemon's socket path is too long to connect to; training continues")
    assert f"{len(str(deep / 'agent.sock'))} bytes long; a Unix socket path may have at most 107 bytes" in lines[0]


def test_daemon_killed_and_restarted_mid_job_loses_no_steps(daemon: DaemonProcess) -> None:
    """SIGKILL the daemon mid-job, start a new one: steps_total still ends at exactly N on every rank."""
    steps = 60
    procs = _job(daemon, "--steps", str(steps), "--step-sleep", "0.05")
    wait_for(lambda: bool(select(daemon.scrape(), "torchpulse_optimizer_steps_total", run="it")), timeout=60)
    daemon.stop(signal.SIGKILL)
    time.sleep(0.5)
    restarted = daemon.restart()
    try:
        results = _finish(procs)
        assert [0, 0] == [code for code, _ in results]
        assert all("Traceback" not in err for _, err in results)
        wait_for(lambda: 2 == len(select(restarted.scrape(), "torchpulse_optimizer_steps_total", run="it")))
        assert {"0": float(steps), "1": float(steps)} == {
            dict(k)["rank"]: v
            for k, v in select(restarted.scrape(), "torchpulse_optimizer_steps_total", run="it").items()
        }
    finally:
        restarted.stop()


def test_status_lists_runs_ranks_and_counts(daemon: DaemonProcess) -> None:
    """`torchpulse status` prints the run, both ranks (exited: they ended normally), events received and uptime."""
    assert [(0, ""), (0, "")] == _finish(_job(daemon, "--steps", "3", run="statusrun"))
    result = subprocess.run(
        [sys.executable, "-m", "torchpulse", "status", "--socket", str(daemon.socket_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert 0 == result.returncode
    lines = result.stdout.splitlines()
    assert lines[0].startswith("torchpulse daemon 0.1.0 (pid ")
    assert "run statusrun (ended, world size 2)" in lines
    assert 2 == sum(1 for line in lines if " exited " in line), result.stdout


@pytest.mark.process
def test_status_without_daemon_fails_clearly(tmp_path: Path) -> None:
    """`torchpulse status` with no daemon exits 1 with one line naming the socket."""
    sock = tmp_path / "none.sock"
    result = subprocess.run(
        [sys.executable, "-m", "torchpulse", "status", "--socket", str(sock)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert (1, 1) == (result.returncode, len(result.stderr.splitlines()))
    assert str(sock) in result.stderr


def test_bootstrap_chains_to_an_existing_sitecustomize(daemon: DaemonProcess, tmp_path: Path) -> None:
    """A user's sitecustomize still runs under `torchpulse run`, and the agent still attaches."""
    site = tmp_path / "usersite"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nos.environ['USER_SITECUSTOMIZE_RAN'] = '1'\n")
    code = (
        "import os, torch, torchpulse.probes.attach as api\n"
        "print(os.environ.get('USER_SITECUSTOMIZE_RAN'), api.current_agent() is not None)"
    )
    env = daemon.env(PYTHONPATH=f"{site}{os.pathsep}{REPO}")
    result = subprocess.run(
        [sys.executable, "-m", "torchpulse", "run", "--", sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert ("1 True", "") == (result.stdout.strip(), result.stderr)
