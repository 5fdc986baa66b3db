"""The script `torchpulse attach PID` injects (Python >= 3.14), run here as the target would run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from torchpulse.remote_attach import write_script

TARGET = r"""
import os, sys
import torch  # a job that already trains
os = "the job's own binding"
# As CPython's remote debugger runs it: the file's code in the __main__ namespace.
exec(compile(open(sys.argv[1]).read(), sys.argv[1], "exec"), globals())
import torchpulse.probes.attach as api
agent = api.current_agent()
print(agent is not None, agent.config.socket_path if agent else None, agent.identity.run if agent else None,
      os, "_torchpulse_remote_attach" in globals())
"""


@pytest.mark.process
def test_the_injected_script_attaches_deletes_itself_and_leaves_the_main_namespace_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # a relative --socket is resolved here, not in the target's directory
    path = write_script("rel.sock", "remote-run")
    # The target is in another directory, with torchpulse not on its path: the script adds it.
    out = subprocess.run(
        [sys.executable, "-c", TARGET, path],
        cwd="/",
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"True {tmp_path / 'rel.sock'} remote-run the job's own binding False" == out.stdout.strip()
    assert "remote attach failed" not in out.stderr
    assert not Path(path).exists()
