"""Probe overhead on a CPU training step: probes off vs on, interleaved, median ratio.

Run: `.venv/bin/python bench/overhead.py [--rounds N]`. Also measures the
cost of one optimizer hook call in microseconds. Needs no daemon: one is
started on a temporary socket so the agent's sender really sends.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torchpulse
from bench.harness import Variant, bench_dir, interleaved, optimizer_hooks, report, running_daemon
from torchpulse.probes.agent.agent import Agent
from torchpulse.probes.optimizer import OptimizerProbe


def _model_step(d_model: int, batch: int, seq: int) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=4 * d_model, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.randn(batch, seq, d_model)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(data).square().mean().backward()
        optimizer.step()

    return model, optimizer, step


def counted_every_step(
    agent: Agent, probe: OptimizerProbe, optimizer: torch.optim.Optimizer, steps_run: dict[bool, int]
) -> bool:
    """Whether the probe counted exactly the steps run with it installed (`steps_run[True]`), printed: else the
    arms were not what they claim."""
    agent.flush()
    counted = agent.store.value("optimizer_steps_total", (probe.label_of(optimizer),)) or 0
    seen = counted == steps_run[True]
    print(
        f"  the probe counted {counted:.0f} steps: {steps_run[True]} ran with it installed, "
        f"{steps_run[False]} without ({'ok' if seen else 'MISMATCH: the arms are not what they claim'})"
    )
    return seen


def _hook_cost(probe: object, iterations: int = 20000) -> float:
    """Added µs per hook call, from an optimizer whose step does no work."""
    param = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.SGD([param], lr=0.1)

    def loop() -> float:
        start = time.perf_counter()
        for _ in range(iterations):
            optimizer.step()
        return (time.perf_counter() - start) / iterations

    on, off = [], []
    for _ in range(5):
        on.append(loop())
        probe.uninstall()  # type: ignore[attr-defined]
        off.append(loop())
        probe.install()  # type: ignore[attr-defined]
    # Two hooks (pre and post) run per step.
    return (statistics.median(on) - statistics.median(off)) / 2 * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps-per-block", type=int, default=10)
    parser.add_argument("--d-model", type=int, default=256)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    with bench_dir("torchpulse-bench-") as workdir, running_daemon(workdir) as daemon:
        agent = torchpulse.attach(socket=str(daemon.socket_path), probes=("optimizer",))
        assert agent is not None
        try:
            probe = agent.probes["optimizer"]
            assert isinstance(probe, OptimizerProbe)
            _, optimizer, model_step = _model_step(args.d_model, 8, 128)
            # Steps run with the probe installed and without, to check against what the probe counted.
            steps_run = {True: 0, False: 0}

            def step() -> None:
                steps_run[probe.enabled] += 1
                model_step()

            # The agent keeps a step-boundary hook of its own (`ctl` commands) in both arms: ~2 µs a step,
            # not the optimizer probe's. The probe's two hooks must be gone in one arm and there in the other.
            step()  # the agent adds that hook's pre-hook at the first step
            probe.uninstall()
            without_probe = optimizer_hooks()
            probe.install()
            with_probe = optimizer_hooks()
            if with_probe != without_probe + 2:
                raise RuntimeError(f"the optimizer probe registered {with_probe - without_probe} hooks, not 2")

            def probe_off() -> None:
                probe.uninstall()
                if optimizer_hooks() != without_probe:
                    raise RuntimeError("'probes off' still has the optimizer probe's hooks registered")

            def probe_back() -> None:
                probe.install()
                if optimizer_hooks() != with_probe:
                    raise RuntimeError("the optimizer probe did not register its hooks again")

            variants = [
                Variant("probes off", probe_off, probe_back),
                Variant("optimizer probe on", lambda: None, lambda: None),
            ]
            # "probes off" uninstalls on enter and reinstalls on leave.
            times = interleaved(step, variants, args.rounds, args.steps_per_block)
            ok = report(
                f"2-layer TransformerEncoder (d_model {args.d_model}, batch 8, seq 128), CPU, "
                f"torch {torch.__version__}, {os.cpu_count()} cores",
                times,
                "probes off",
                {"optimizer probe on": 1.01},
                args.steps_per_block,
            )
            print()
            seen = counted_every_step(agent, probe, optimizer, steps_run)
            print(f"  one optimizer hook call: {_hook_cost(probe):.2f} µs (pre + post hook per step)")
            agent.flush()
            print(f"  events dropped by the agent: {agent.dropped_total}")
            return 0 if ok and seen else 1
        finally:
            torchpulse.detach()


if __name__ == "__main__":
    raise SystemExit(main())
