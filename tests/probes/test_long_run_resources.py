"""What the agent and its probes hold on to over a long run: memory, descriptors, threads, finalizers.

One real job with every probe on (a compiled model with recompiles up to the limit, graph breaks, DCP
saves) against a real daemon that is killed and restarted under it; and in-process cases for what only a
long run accumulates: attach/detach cycles, a hung daemon at detach, `autograd.grad`-only passes, a probe
that switched itself off while the job builds optimizers.
"""

from __future__ import annotations

import gc
import json
import signal
import socket
import subprocess
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo

from tests.support import REPO, DaemonProcess, local_agent, select, start_daemon, wait_for
from torchpulse.probes.agent.agent import Agent
from torchpulse.probes.agent.config import AgentConfig
from torchpulse.probes.agent.identity import current_identity
from torchpulse.probes.agent.sender import Sender
from torchpulse.probes.families import FAMILY_TABLE

# A job with every probe: a compiled model whose batch changes every 100 steps (one dynamic recompile),
# a function compiled with dynamic=False that gets a new shape every 100 steps until it hits the recompile
# limit, a graph break every 100 steps, a DCP save into a new directory every 250 steps. After each phase it
# prints a snapshot and waits for a line on stdin: the test kills the daemon, then restarts it, meanwhile.
LONG_JOB = r"""
import json, os, sys, threading, weakref
import torch, torch._dynamo, torch.distributed.checkpoint as dcp
from torch._dynamo.utils import counters
import torchpulse

torch._dynamo.config.recompile_limit = 4
agent = torchpulse.attach()
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
forward = torch.compile(model, backend="aot_eager")
static = torch.compile(lambda t: (t * 2).sum(), backend="aot_eager", dynamic=False)

@torch.compile(backend="aot_eager")
def with_break(t):
    t = t + 1
    torch._dynamo.graph_break()
    return t * 2

def snapshot():
    with open("/proc/self/status") as status:
        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))
    samples, histograms = agent.store.snapshot()
    connected = agent._sender.link.sock is not None  # the one descriptor that comes and goes with the daemon
    return {"rss_kb": rss, "fds": len(os.listdir("/proc/self/fd")) - connected, "threads": threading.active_count(),
            "finalizers": len(weakref.finalize._registry), "series": len(samples) + len(histograms),
            "queued": agent.buffer_fill + len(agent._events)}

steps = saves = 0
def train(until, new_shapes):
    global steps, saves
    while steps < until:
        steps += 1
        period = steps // 100
        x = torch.randn(4 + period % 3, 8)
        opt.zero_grad()
        loss = forward(x).mean() + static(torch.randn(2 + (period if new_shapes else period % 3))) * 0.0
        if steps % 100 == 0:
            loss = loss + with_break(x).mean() * 0.0
        loss.backward()
        opt.step()
        if steps % 250 == 0:
            dcp.save({"model": model.state_dict()}, checkpoint_id=f"{sys.argv[1]}/step{steps}", no_dist=True)
            saves += 1

for phase, (until, new_shapes) in enumerate(((800, True), (1600, False), (2400, False), (3200, False))):
    train(until, new_shapes)
    agent.flush(5)
    print(json.dumps(snapshot()), flush=True)
    if phase < 3:
        sys.stdin.readline()
frames = dict(counters["frames"])
print(json.dumps({"flushed": agent.flush(10), "steps": steps, "saves": saves, "frames_ok": frames.get("ok", 0)}),
      flush=True)
torchpulse.detach()
"""


def _open_descriptors() -> int:
    return sum(1 for _ in Path("/proc/self/fd").iterdir())


def _value(daemon: DaemonProcess, family: str, **labels: str) -> float:
    return sum(select(daemon.scrape(), family, run="longrun", **labels).values())


@pytest.mark.process
def test_a_long_job_with_every_probe_stays_flat_and_counts_right_across_daemon_restarts(tmp_path: Path) -> None:
    """After the warm-up (recompiles, the recompile limit, the first saves) descriptors, threads,
    finalizers, series and queued records stay as they were through 2,400 more steps with the daemon
    killed and later restarted, RSS grows by less than 8 MiB, and the restarted daemon ends with the
    job's own counts of steps, passes, saves and compiled frames."""
    daemon = start_daemon(tmp_path)
    job = subprocess.Popen(
        [sys.executable, "-c", LONG_JOB, str(tmp_path / "ckpt")],
        cwd=REPO,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=daemon.env(TORCHPULSE_RUN="longrun", OMP_NUM_THREADS="1"),
    )
    assert job.stdin is not None and job.stdout is not None
    try:
        snapshots = [json.loads(job.stdout.readline())]
        for action in ("kill", "restart", "keep"):
            if action == "kill":
                daemon.stop(signal.SIGKILL)
            elif action == "restart":
                daemon = daemon.restart()
            job.stdin.write("\n")
            job.stdin.flush()
            snapshots.append(json.loads(job.stdout.readline()))
        final = json.loads(job.stdout.readline())
        _out, err = job.communicate(timeout=60)
        assert 0 == job.returncode, err
        warm, *later = snapshots
        for snap in later:
            assert {k: warm[k] for k in ("fds", "threads", "finalizers", "series")} == {
                k: snap[k] for k in ("fds", "threads", "finalizers", "series")
            }, snapshots
            assert snap["queued"] <= 64, snapshots
        assert later[-1]["rss_kb"] - warm["rss_kb"] < 8 * 1024, snapshots
        assert (True, 3200, 12) == (final["flushed"], final["steps"], final["saves"])
        wait_for(lambda: _value(daemon, "torchpulse_optimizer_steps_total") == 3200.0, timeout=10)
        assert {
            "steps": 3200.0,
            "passes": 3200.0,
            "saves": 12.0,
            "frames": float(final["frames_ok"]),
            "limit_hits": 1.0,
        } == {
            "steps": _value(daemon, "torchpulse_optimizer_steps_total"),
            "passes": _value(daemon, "torchpulse_backward_passes_total", kind="backward"),
            "saves": _value(daemon, "torchpulse_checkpoint_save_duration_seconds_count", api="save"),
            "frames": _value(daemon, "torchpulse_compile_frames_total", status="ok"),
            "limit_hits": _value(daemon, "torchpulse_recompile_limit_hits_total"),
        }
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(30)
        daemon.stop()


def test_attach_and_detach_over_and_over_keep_no_agent_alive_while_an_optimizer_lives() -> None:
    """Five agents in turn, one optimizer stepping under each: once shut down, no agent is alive and the
    optimizer carries none of their finalizers (each held its probe, and through it the whole agent)."""
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    agents: list[weakref.ref[Any]] = []
    for _ in range(5):
        agent: Any = local_agent(("optimizer", "cudagraphs", "autograd"), optimizer_state_every=1)
        for _step in range(3):
            model(torch.randn(2, 4)).sum().backward()
            optimizer.step()
        agent.drain()
        agent.shutdown()
        agents.append(weakref.ref(agent))
        del agent
    gc.collect()
    on_optimizer = [
        f
        for f, info in list(weakref.finalize._registry.items())  # type: ignore[attr-defined]
        if info.weakref() is optimizer
    ]
    assert ([], []) == ([ref for ref in agents if ref() is not None], on_optimizer)


@pytest.fixture
def silent_listener(tmp_path: Path) -> Iterator[Path]:
    """A socket that accepts connections into its backlog and never answers: a daemon that hangs."""
    path = tmp_path / "hung.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))
        server.listen(8)
        yield path


def test_a_sender_that_outlives_its_stop_closes_its_wake_up_pipe_when_it_ends(silent_listener: Path) -> None:
    """A detach that stops waiting for the sender (its last hello waits out the connect timeout on a hung
    daemon) leaves no descriptor behind once the thread ends: a job that attaches and detaches under a
    hung daemon would otherwise lose two each time."""
    agent = Agent(AgentConfig(socket_path=silent_listener, connect_timeout=1.5), current_identity(), FAMILY_TABLE)
    agent.emit("info", "something to send")  # so that the agent connects
    before = _open_descriptors()
    sender = Sender(agent)
    sender.start()
    sender.stop(0.2)
    assert sender.is_alive()
    sender.join(10)
    assert (False, before) == (sender.is_alive(), _open_descriptors())


def test_grad_only_passes_keep_no_dead_input_leaves() -> None:
    """A job of `torch.autograd.grad` passes alone (the non-finite check never runs) with every pass timed
    keeps nothing of the input leaves that died with their pass."""
    agent: Any = local_agent(("autograd",), options={"autograd_sample_every": "1"})
    model = torch.nn.Linear(4, 1)
    try:
        for _ in range(50):
            x = torch.randn(2, 4, requires_grad=True)
            torch.autograd.grad(model(x).sum(), [x, *model.parameters()])
        check = agent.probes["autograd"]._check
        assert (0, 0, 0) == (len(check._found), len(check._waiting), len(check._refs))
    finally:
        agent.shutdown()


@pytest.mark.probe_errors
def test_a_cudagraphs_probe_that_switched_itself_off_keeps_no_countdowns(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe fails in its step hook, which stays registered (it cannot be removed from inside the
    hook table torch iterates): a search building optimizer after optimizer leaves no entry behind."""
    import torchpulse.probes.cudagraphs.probe as cudagraphs

    def broken(*_args: Any) -> Any:
        raise RuntimeError("probe bug")

    monkeypatch.setattr(cudagraphs, "measure_readiness", broken)
    agent: Any = local_agent(("cudagraphs",), optimizer_state_every=1)
    probe = agent.probes["cudagraphs"]
    try:
        optimizers = [torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1) for _ in range(20)]
        for optimizer in optimizers:
            optimizer.step()
        del optimizers, optimizer
        gc.collect()
        assert (False, 0) == (probe.enabled, len(probe._due_in))
    finally:
        agent.shutdown()
