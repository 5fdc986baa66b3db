"""The DaemonSet's probes, run against a real daemon started with the shipped config."""

from __future__ import annotations

import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.deploy.manifests import DAEMON_CONFIG, container, daemonset
from tests.support import PYTHON, start_daemon

pytestmark = pytest.mark.process


def _http_status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_probes_pass_on_the_shipped_config_and_readiness_fails_without_a_daemon(tmp_path: Path) -> None:
    """Startup and liveness get 200 and readiness exits 0 against the daemon; once it has stopped, readiness exits 1."""
    daemon = container(daemonset(), "daemon")
    readiness = daemon["readinessProbe"]["exec"]["command"]
    http_paths = [daemon[name]["httpGet"]["path"] for name in ("startupProbe", "livenessProbe")]
    # Socket, listen address and state directory move to the test's own; the rest of the file applies.
    proc = start_daemon(tmp_path, extra_args=["--config", str(DAEMON_CONFIG)])
    # The image's console script is this environment's `python -m torchpulse`; the socket is the test's.
    command = [PYTHON, "-m", "torchpulse", *readiness[1:-1], str(proc.socket_path)]
    try:
        statuses = [_http_status(proc.port, path) for path in http_paths]
        ready = subprocess.run(command, capture_output=True, text=True, timeout=60)
        exposition = proc.scrape_text()
    finally:
        proc.stop()
    gone = subprocess.run(command, capture_output=True, text=True, timeout=60)

    assert [200, 200] == statuses
    assert (0, 1) == (ready.returncode, gone.returncode), ready.stderr + gone.stderr
    # The config's checkpoint root is what the daemon watches (missing here, so reported as unreadable).
    assert 'root="/data/checkpoints"' in exposition
