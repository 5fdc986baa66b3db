"""The compile probe in real processes: the job's output is untouched, and metrics reach a real daemon."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO, DaemonProcess, select, wait_for

# Recompiles, a graph break and a recompile-limit hit: everything torch may print about.
JOB = r"""
import logging, os, sys
logging.basicConfig(level=logging.DEBUG)  # a user whose root handler would print anything that leaks
import torch
if os.environ.get("WITH_PROBE") == "1":
    import torchpulse
    torchpulse.attach(probes=("optimizer", "compile", "cudagraphs"))
torch._dynamo.config.recompile_limit = 2

def f(x, k):
    return x * k

def g(x):
    x = x.sin()
    torch._dynamo.graph_break()
    return x.cos()

compiled = torch.compile(f, backend="eager", dynamic=False)
for n in (1, 2, 3, 4):
    compiled(torch.randn(n), 2)
torch.compile(g, backend="eager")(torch.randn(2))
print("done", file=sys.stderr)
if os.environ.get("WITH_PROBE") == "1":
    torchpulse.detach()
"""


def _stderr(tmp_path: Path, daemon: DaemonProcess, with_probe: bool, **env: str) -> bytes:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    full_env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(REPO),
        "WITH_PROBE": "1" if with_probe else "0",
        # torch's default format carries time and pid; everything else is compared byte for byte.
        "TORCH_LOGS_FORMAT": "%(levelname)s:%(name)s:%(message)s",
        # A reachable daemon, so the agent has nothing of its own to say.
        "TORCHPULSE_SOCKET": str(daemon.socket_path),
        **env,
    }
    done = subprocess.run(
        [sys.executable, str(script)], env=full_env, capture_output=True, timeout=240, cwd=tmp_path, check=True
    )
    return done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("torch_logs", ["", "recompiles,graph_breaks"])
def test_job_stderr_is_byte_identical_with_the_probe(tmp_path: Path, daemon: DaemonProcess, torch_logs: str) -> None:
    """Same stderr with and without the probe, also when TORCH_LOGS asks for recompiles."""
    env = {"TORCH_LOGS": torch_logs} if torch_logs else {}
    without = _stderr(tmp_path, daemon, False, **env)
    with_probe = _stderr(tmp_path, daemon, True, **env)
    assert b"recompile_limit" in without
    if torch_logs:
        assert b"Recompiling function f" in without
        assert b"Graph break in user code" in without
    assert without.decode() == with_probe.decode()


@pytest.mark.slow
def test_recompiles_reach_the_daemon(daemon: DaemonProcess, tmp_path: Path) -> None:
    """A real job's recompiles, graph break and limit hit are scraped from a real daemon."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = daemon.env(WITH_PROBE="1", TORCHPULSE_RUN="compile-e2e")
    subprocess.run([sys.executable, str(script)], env=env, capture_output=True, timeout=240, check=True)

    def scraped() -> bool:
        return bool(select(daemon.scrape(), "torchpulse_recompile_limit_hits_total", run="compile-e2e"))

    wait_for(scraped, timeout=30)
    samples = daemon.scrape()
    function = f"f ({tmp_path.name}/job.py:10)"
    assert [1.0] == list(
        select(
            samples, "torchpulse_recompiles_total", run="compile-e2e", function=function, reason="tensor_size"
        ).values()
    )
    assert [1.0] == list(
        select(samples, "torchpulse_recompile_limit_hits_total", run="compile-e2e", function=function).values()
    ), select(
        samples, "torchpulse_recompile_limit_hits_total", run="compile-e2e"
    )  # seen once under load: which labels?
    assert 1.0 == sum(select(samples, "torchpulse_graph_breaks_total", run="compile-e2e").values())
    # f twice, g, and the resume function after its graph break.
    assert [4.0] == list(select(samples, "torchpulse_compile_frames_total", run="compile-e2e", status="ok").values())


LATE_DYNAMO_JOB = r"""
import sys, torch
from tests.support import local_agent
agent = local_agent(("optimizer", "autograd", "compile", "cudagraphs", "checkpoint"))
loaded_at_attach = sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules)
model = torch.nn.Linear(4, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.randn(2, 4)).sum().backward()
optimizer.step()  # torch's first optimizer step imports Dynamo: the probes finish installing then
# ...without importing Inductor's CUDA-graph trees (~0.8 s at that step) to look for managers.
trees_after_step = "torch._inductor.cudagraph_trees" in sys.modules
compiled = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
compiled(torch.randn(3))
compiled(torch.randn(5))  # a shape recompile
agent.drain()
frames = agent.store.value("compile_frames_total", ("ok",))
errors = sum(agent.store.value("agent_probe_errors_total", (p,)) or 0 for p in agent.probes)
agent.shutdown()
print(loaded_at_attach, trees_after_step, frames, errors)
"""


@pytest.mark.process
def test_attach_imports_no_dynamo_and_still_sees_compiles_after_the_job_imports_it() -> None:
    """Attach leaves Dynamo and Inductor unimported (an early Dynamo import makes DDP over gloo
    hang at exit now and then); the compile probe installs when the job imports Dynamo, and
    installing imports no CUDA-graph tree module either."""
    out = subprocess.run([sys.executable, "-c", LATE_DYNAMO_JOB], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert "[] False 2.0 0" == out.stdout.strip(), out.stderr[-3000:]
