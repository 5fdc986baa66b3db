"""Zero-code attach in awkward places: DataLoader workers, spawned ranks, remote attach on an old Python."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support import REPO, DaemonProcess, rejected_frames, run_job, select, wait_for
from torchpulse.daemon.client import request_status

JOB = textwrap.dedent("""
    import sys, torch
    from torch.utils.data import DataLoader, TensorDataset

    def main():
        data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
        loader = DataLoader(data, batch_size=8, num_workers=2, multiprocessing_context=sys.argv[1])
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for x, y in loader:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()

    if __name__ == "__main__":
        main()
    """)


def _spawned_env(daemon: DaemonProcess, **extra: str) -> dict[str, str]:
    """The daemon's environment without launcher variables: ranks learn who they are from torch.distributed."""
    env = {
        k: v
        for k, v in daemon.env(OMP_NUM_THREADS="1").items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS")
    }
    return {**env, **extra}


def _by_rank(daemon: DaemonProcess, name: str, run: str) -> dict[str, float]:
    return {dict(k)["rank"]: v for k, v in select(daemon.scrape(), name, run=run).items()}


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_never_become_ranks(daemon: DaemonProcess, tmp_path: Path, context: str) -> None:
    """Under `torchpulse run` only the training process connects; fork and spawn workers do not."""
    result = run_job(JOB, tmp_path, f"dl-{context}", daemon.env(), context)
    assert (0, "") == (result.returncode, _without_resource_tracker_warnings(result.stderr))
    connected = [e for e in daemon.log_lines() if e.get("event") == "agent connected"]
    assert 1 == len(connected)
    steps = select(daemon.scrape(), "torchpulse_optimizer_steps_total", run=f"dl-{context}")
    assert [8.0] == list(steps.values())


# Each item is perturbed along its own input gradient (adversarial augmentation): a backward pass
# in the worker, which the autograd probe sees. A forkserver child ends with os._exit (no last
# flush), so its workers live for several flush intervals, as any real one does.
GRADIENT_IN_WORKER_JOB = textwrap.dedent("""
    import sys, time, torch
    from torch.utils.data import DataLoader, Dataset

    class Perturbed(Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, index):
            time.sleep(0.02)  # a worker that lives past a few flushes, as real ones do
            x = torch.randn(4, requires_grad=True)
            (x * x).sum().backward()
            return (x + 0.01 * x.grad.sign()).detach(), torch.randn(1)

    def main():
        loader = DataLoader(Perturbed(), batch_size=4, num_workers=1, multiprocessing_context=sys.argv[1])
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for x, y in loader:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()

    if __name__ == "__main__":
        main()
    """)


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_a_started_dataloader_worker_that_runs_backward_is_not_a_rank(
    daemon: DaemonProcess, tmp_path: Path, context: str
) -> None:
    """A spawn or forkserver worker imports torch afresh; one that runs autograd must not connect as the rank."""
    result = run_job(
        GRADIENT_IN_WORKER_JOB,
        tmp_path,
        f"dlg-{context}",
        daemon.env(RANK="0", WORLD_SIZE="1", TORCHPULSE_FLUSH_INTERVAL="0.05"),
        context,
    )
    assert (0, "") == (result.returncode, _without_resource_tracker_warnings(result.stderr))
    wait_for(
        lambda: (
            [8.0] == list(select(daemon.scrape(), "torchpulse_optimizer_steps_total", run=f"dlg-{context}").values())
        )
    )
    connected = [e for e in daemon.log_lines() if e.get("event") == "agent connected"]
    assert 1 == len(connected), connected


SPAWNED_RANKS_JOB = textwrap.dedent("""
    import sys, torch, torch.distributed as dist, torch.multiprocessing as mp

    def rank_main(rank, world_size, store):
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3 + rank):
            opt.zero_grad()
            model(torch.ones(1, 2)).sum().backward()
            opt.step()

    if __name__ == "__main__":
        mp.spawn(rank_main, args=(2, sys.argv[1]), nprocs=2)
    """)


def test_ranks_started_by_torch_multiprocessing_spawn_report_their_own_rank(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    """No RANK in their environment: each spawned rank reports the rank and world size it initialised.

    The agent reads them when it first connects, after the first steps: these ranks exit with their
    group still up, so even a connection first made at exit is made with the group initialised.
    """
    result = run_job(SPAWNED_RANKS_JOB, tmp_path, "spawned", _spawned_env(daemon), str(tmp_path / "store"))
    assert (0, "") == (result.returncode, result.stderr)
    wait_for(lambda: {"0": 3.0, "1": 4.0} == _by_rank(daemon, "torchpulse_optimizer_steps_total", "spawned"))
    assert ["2"] == [dict(k)["world_size"] for k in select(daemon.scrape(), "torchpulse_run_info", run="spawned")]


def test_ranks_spawned_inside_one_slurm_task_report_their_own_rank(daemon: DaemonProcess, tmp_path: Path) -> None:
    """`srun` starts one task per node and the task spawns its ranks: they inherit SLURM_PROCID=0 and
    SLURM_NTASKS=1, which name the task, not them. Once torch.distributed is initialised its rank wins."""
    env = _spawned_env(daemon, SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_JOB_ID="4242")
    result = run_job(SPAWNED_RANKS_JOB, tmp_path, "slurm-spawned", env, str(tmp_path / "store"))
    assert (0, "") == (result.returncode, result.stderr)
    wait_for(lambda: {"0": 3.0, "1": 4.0} == _by_rank(daemon, "torchpulse_optimizer_steps_total", "slurm-spawned"))
    info = select(daemon.scrape(), "torchpulse_run_info", run="slurm-spawned")
    assert ["2"] == [dict(k)["world_size"] for k in info]


PROCESS_ASYNC_SAVE_JOB = textwrap.dedent("""
    import sys, time, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    if __name__ == "__main__":
        out = sys.argv[1]
        dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=0, world_size=1)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        pending = None
        for step in range(5):
            opt.zero_grad()
            model(torch.ones(3, 4)).sum().backward()
            opt.step()
            if step in (1, 3):
                if pending is not None:
                    pending.result()
                pending = dcp.async_save({"model": model.state_dict()}, checkpoint_id=f"{out}/ckpt-{step}",
                                         async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        pending.result()
        time.sleep(1.0)  # the background process lives on meanwhile: long enough for its agent to speak
        dist.destroy_process_group()
    """)


def test_process_based_async_save_is_announced_once_per_save_by_the_rank_alone(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    """DCP's PROCESS checkpointer saves in a spawned background process that calls `save` itself.

    Under `torchpulse run` that process gets an agent too; it must not announce the saves a second
    time (nor, having nothing else to say, connect at all).
    """
    env = _spawned_env(daemon, TORCHPULSE_FLUSH_INTERVAL="0.05")
    result = run_job(PROCESS_ASYNC_SAVE_JOB, tmp_path, "process-save", env, str(tmp_path))
    assert 0 == result.returncode, result.stderr
    saved = {str(tmp_path / "ckpt-1"), str(tmp_path / "ckpt-3")}
    wait_for(lambda: saved == {e.get("path") for e in daemon.log_lines() if e.get("event") == "checkpoint saved"})
    counts = select(daemon.scrape(), "torchpulse_checkpoint_save_duration_seconds_count", run="process-save")
    assert {(("api", "async_save"), ("rank", "0"), ("run", "process-save")): 2.0} == counts
    connected = [
        e for e in daemon.log_lines() if e.get("event") == "agent connected" and e.get("run") == "process-save"
    ]
    assert 1 == len(connected), connected


STEPPING_JOB = textwrap.dedent("""
    import os, sys, time, torch

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    deadline = time.monotonic() + float(sys.argv[1])
    while time.monotonic() < deadline and not os.path.exists(sys.argv[2]):
        opt.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        time.sleep(0.02)
    """)


def test_a_second_job_under_the_same_run_name_is_refused_its_rank_and_says_so_once(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    """Two jobs with one run name both report rank 0. The first keeps it; the second trains on, refused
    (it retries), with one warning on its stderr however often it retried, and the rank's totals are the
    first job's alone instead of alternating between the two."""
    script = tmp_path / "job.py"
    script.write_text(STEPPING_JOB)
    stop = tmp_path / "stop"
    env = daemon.env(OMP_NUM_THREADS="1", TORCHPULSE_FLUSH_INTERVAL="0.05", RANK="0", WORLD_SIZE="1")
    command = [sys.executable, "-m", "torchpulse", "run", "--run-name", "shared", "--", sys.executable, str(script)]
    first = subprocess.Popen([*command, "120", str(stop)], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: bool(_by_rank(daemon, "torchpulse_optimizer_steps_total", "shared")), timeout=60)
        second = subprocess.run(
            [*command, "4", str(tmp_path / "never")], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
        )
        assert 0 == second.returncode, second.stderr
        refusals = [line for line in second.stderr.splitlines() if "daemon refused this agent" in line]
        assert 1 == len(refusals) and "rank_taken" in refusals[0], second.stderr
        assert rejected_frames(daemon).get("rank_taken", 0) >= 2  # it did retry
        holders = [r.pid for s in request_status(daemon.socket_path).runs if s.run == "shared" for r in s.ranks]
        assert [first.pid] == holders  # `torchpulse run` execs the job: its pid is the first job's
    finally:
        stop.touch()
        first.wait(60)


def _without_resource_tracker_warnings(stderr: str) -> str:
    """stderr minus CPython's resource-tracker warnings about the job's own DataLoader queues.

    Once in make test (spawn context, loaded machine) the tracker reported "1 leaked
    semaphore" whose name was already unlinked: a shutdown race between DataLoader's
    queue finalizers and the tracker. torchpulse uses no multiprocessing objects; run
    by hand, the job printed it in 1 of 51 runs under `torchpulse run` and 0 of 51
    without, and never in 12 reruns of this test.
    """
    lines = stderr.splitlines(keepends=True)
    kept, skip_next = [], False
    for line in lines:
        if skip_next:  # the `warnings.warn(...)` source line printed under each warning
            skip_next = False
            continue
        if "multiprocessing/resource_tracker.py" in line and "UserWarning: resource_tracker:" in line:
            skip_next = True
            continue
        kept.append(line)
    return "".join(kept)


@pytest.mark.process
@pytest.mark.skipif(sys.version_info >= (3, 14), reason="remote attach is available on this Python")
def test_attach_on_python_before_3_14_explains_and_exits_2() -> None:
    """`torchpulse attach PID` needs sys.remote_exec; older Pythons get one clear line and status 2."""
    result = subprocess.run(
        [sys.executable, "-m", "torchpulse", "attach", "1"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert 2 == result.returncode
    assert result.stderr.startswith("torchpulse: attach needs Python >= 3.14 (sys.remote_exec)")


EARLY_STEP_SPAWNED_JOB = textwrap.dedent("""
    import sys, time, torch, torch.distributed as dist, torch.multiprocessing as mp

    def rank_main(rank, world_size, store):
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if rank == 1:
            opt.step()  # a warm-up step before the group exists: its agent connects, as rank 0
            time.sleep(1.0)  # a few flushes
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
        if rank == 1:  # rank 0 steps nothing: its agent never connects, nothing takes rank 0 over
            for _ in range(3):
                opt.step()
            time.sleep(1.0)
        dist.barrier()
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(rank_main, args=(2, sys.argv[1]), nprocs=2)
    """)


def test_a_spawned_rank_that_connected_before_init_process_group_reconnects_as_its_rank(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    """A spawned rank connects as rank 0 (no RANK, no group yet); once the group names it rank 1, it says
    goodbye as rank 0 (which then reads exited, not crashed) and connects again as rank 1 with all its totals."""
    result = run_job(
        EARLY_STEP_SPAWNED_JOB,
        tmp_path,
        "early",
        _spawned_env(daemon, TORCHPULSE_FLUSH_INTERVAL="0.1"),
        str(tmp_path / "store"),
    )
    assert (0, "") == (result.returncode, result.stderr)

    def by_rank(name: str) -> dict[str, float]:
        return _by_rank(daemon, name, "early")

    wait_for(lambda: 4.0 == by_rank("torchpulse_optimizer_steps_total").get("1"))
    assert {"1": 1.0} == {r: v for r, v in by_rank("torchpulse_agent_exited").items() if r == "1"}
    # Rank 0's series were this process's first hello: said goodbye, so exited and forgotten later, not down.
    assert by_rank("torchpulse_agent_up").get("0", 0.0) == 0.0
    assert by_rank("torchpulse_agent_exited").get("0", 1.0) == 1.0
