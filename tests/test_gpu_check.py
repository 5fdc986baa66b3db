"""`bench/gpu_check.py --dry-run`: without CUDA every CUDA step of the GPU check is SKIPPED and its CPU parts run
for real (a daemon, the job under `torchpulse run`, two ranks and a DCP save, the benchmarks' code, /metrics
against torch's counters), so that the command a GPU session runs cannot rot where there is no GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import REPO

pytestmark = pytest.mark.slow

SKIPPED = [
    "SKIPPED(no CUDA: collected and skipped)",  # pytest -m cuda ran
    "SKIPPED(no CUDA)  steps under torch.cuda.set_sync_debug_mode('error')",
    "SKIPPED(no CUDA: no CUDA-graph trees)  recordings, warm-ups, trees, nodes, pool bytes",
    "SKIPPED(no CUDA: capturable and readiness are about CUDA params)",
    "SKIPPED(no CUDA)  the saved state on the GPU",
    "SKIPPED(no CUDA: they are for a GPU step of >= 20 ms)  the budgets",
    "SKIPPED(no CUDA)  node time against the backward's device time",
]
PASSED = [
    "PASS  the command runs: pytest -m cuda exited 0",
    "PASS  torchpulse run -- python bench/gpu_check_job.py train --device cpu (the default mode) exited 0",
    "PASS  the agent said goodbye",
    "PASS  no probe errors in run gpu-check-train",
    "PASS  cudagraph skips, all reasons (counters['inductor']['cudagraph_skips']): /metrics 2.0 == torch 2.0",
    "PASS  skips with reason cpu_device (all of them: no CUDA device): /metrics 2.0 == torch 2.0",
    "PASS  Adam#0 non-static grads (Dynamo's _is_static_for_cudagraphs): /metrics 0.0 == torch 0.0",
    "PASS  AdamW#1 CPU `step` tensors of CUDA params: /metrics 0.0 == torch 0.0",
    "PASS  non-finite passes (1 made by the job on the CPU): /metrics 1.0 == the job 1.0",
    "PASS  parameters the daemon's log names (torch.isfinite on each grad): /metrics ['head.bias'] == torch",
    "PASS  torchpulse run -- torchrun --nproc-per-node=2 (2 ranks on CPU over gloo, DCP save) exited 0",
    "PASS  optimizer steps by rank: /metrics {'0': 4.0, '1': 4.0} == the job {'0': 4.0, '1': 4.0}",
    "PASS  the daemon's validations of the announced checkpoint, by status: /metrics {'valid': 1.0} == expected",
    "PASS  bench/gpu_overhead.py --device cpu --smoke exited 0",
]
SUMMARY = [
    "  1. cuda-marked tests (pytest -m cuda): PASS, 1 SKIPPED",
    "  2. training job under torchpulse run (CPU, default mode): PASS, 1 SKIPPED",
    "  3. 2 ranks over gloo and a DCP save validated by the daemon: PASS, 1 SKIPPED",
    "  6. what node timing measures on CUDA: SKIPPED",
]


def test_the_dry_run_runs_the_cpu_parts_for_real_and_skips_every_cuda_step() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_check.py"), "--dry-run"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
    )
    report = done.stdout
    assert 0 == done.returncode, report[-8000:] + done.stderr[-4000:]
    assert [] == [line for line in SKIPPED + PASSED + SUMMARY if line not in report], report[-8000:]
    assert [] == [line for line in report.splitlines() if "FAIL" in line]
    assert report.rstrip().endswith("OK")
