"""Probe overhead on a CUDA training step, three benchmarks side by side in one run.

The CPU benchmarks (`overhead.py`, `autograd_overhead.py`, `compile_overhead.py`) build their models and data
on the CPU and have no device option; this script runs their measurements on a device, with their own pieces
(the harness's interleaving and paired ratios, the autograd benchmark's probe and self-time clock, the compile
benchmark's agent and per-step self time) and models big enough that a step takes at least `--min-step-ms`:

1. optimizer probe: a TransformerEncoder under AdamW, probe off vs on (budget <= 1.01);
2. autograd probe: the same model, the defaults (<= 1.01, by the implied ratio: the probe's own time on the
   training thread over the step) and node timing on every pass (<= 1.03, paired median);
3. compile + CUDA-graph probes: an MLP compiled with `mode="reduce-overhead"` (<= 1.005, paired median).

Each step ends with `torch.cuda.synchronize()`, so a step's time is the device's as well as the host's. Node
timing on CUDA measures the host side of each node (the launch of its kernels, which run asynchronously),
not the kernels: the autograd section prints both, for the same backward passes.

    python bench/gpu_overhead.py --device cuda          # on a GPU, about a minute
    python bench/gpu_overhead.py --device cpu --smoke   # the code path on CPU, tiny, budgets not judged
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torchpulse
from bench.autograd_overhead import SelfTime, make_probe
from bench.compile_overhead import BUDGET as COMPILE_BUDGET
from bench.compile_overhead import _frames_compiled, make_agent, per_step_self_time, probes_arm
from bench.harness import Variant, bench_dir, interleaved, median_interval, optimizer_hooks, report, running_daemon
from bench.overhead import _hook_cost, counted_every_step
from torchpulse.probes.agent.agent import Agent
from torchpulse.probes.autograd.probe import AutogradProbe
from torchpulse.probes.optimizer import OptimizerProbe

OPTIMIZER_BUDGET = 1.01
AUTOGRAD_BUDGETS = {"default": 1.01, "every_pass": 1.03}


@dataclass(frozen=True)
class Settings:
    device: torch.device
    smoke: bool
    rounds: int
    block: int
    min_step: float  # seconds

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _median_step(step: Callable[[], None], settings: Settings, steps: int = 5) -> float:
    for _ in range(2):
        step()
    settings.sync()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        settings.sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def calibrated(
    build: Callable[[int], Callable[[], None]], batch: int, settings: Settings, name: str
) -> tuple[int, Callable[[], None], float]:
    """The smallest batch (from `batch`, grown in proportion) whose step takes >= 1.2 x the minimum step time."""
    step = build(batch)
    seconds = _median_step(step, settings)
    for _ in range(4):
        if settings.smoke or seconds >= settings.min_step * 1.2:
            break
        batch = math.ceil(batch * settings.min_step * 1.3 / seconds)
        step = build(batch)
        seconds = _median_step(step, settings)
    print(f"  {name}: batch {batch}, {seconds * 1e3:.1f} ms a step")
    return batch, step, seconds


def _transformer(settings: Settings, d_model: int) -> Callable[[int], tuple[nn.Module, torch.optim.Optimizer]]:
    def build(_batch: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(d_model, nhead=8, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True)
        model = nn.TransformerEncoder(layer, 2 if settings.smoke else 4, enable_nested_tensor=False).to(settings.device)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    return build


def _step_of(
    model: nn.Module, optimizer: torch.optim.Optimizer, data: torch.Tensor, settings: Settings
) -> Callable[[], None]:
    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(data).square().mean().backward()
        optimizer.step()
        settings.sync()

    return step


def _sizes(settings: Settings) -> tuple[int, int, int]:
    """(d_model, seq, first batch) of the transformer."""
    return (64, 16, 2) if settings.smoke else (1024, 256, 8)


def optimizer_overhead(settings: Settings) -> bool:
    print("\n== optimizer probe")
    d_model, seq, first = _sizes(settings)
    build = _transformer(settings, d_model)
    built: list[tuple[nn.Module, torch.optim.Optimizer]] = []

    def make(batch: int) -> Callable[[], None]:
        built[:] = [build(batch)]
        model, optimizer = built[0]
        return _step_of(model, optimizer, torch.randn(batch, seq, d_model, device=settings.device), settings)

    with bench_dir("torchpulse-gpu-bench-") as workdir, running_daemon(workdir) as daemon:
        # Built before the probe is there: the calibration's steps are no arm's.
        batch, model_step, _ = calibrated(make, first, settings, "TransformerEncoder + AdamW")
        agent = torchpulse.attach(socket=str(daemon.socket_path), probes=("optimizer",))
        assert agent is not None
        try:
            probe = agent.probes["optimizer"]
            assert isinstance(probe, OptimizerProbe)
            optimizer = built[0][1]
            steps_run = {True: 0, False: 0}

            def step() -> None:
                steps_run[probe.enabled] += 1
                model_step()

            step()  # the agent adds its step-boundary hook at the first step
            probe.uninstall()
            without_probe = optimizer_hooks()
            probe.install()
            with_probe = optimizer_hooks()
            if with_probe != without_probe + 2:
                raise RuntimeError(f"the optimizer probe registered {with_probe - without_probe} hooks, not 2")

            def probe_back() -> None:
                probe.install()

            variants = [
                Variant("probes off", probe.uninstall, probe_back),
                Variant("optimizer probe on", lambda: None, lambda: None),
            ]
            times = interleaved(step, variants, settings.rounds, settings.block, warmup=2, settle=1)
            ok = report(
                f"TransformerEncoder (d_model {d_model}, batch {batch}, seq {seq}) + AdamW on {settings.device}, "
                f"torch {torch.__version__}",
                times,
                "probes off",
                {"optimizer probe on": OPTIMIZER_BUDGET},
                settings.block,
            )
            seen = counted_every_step(agent, probe, optimizer, steps_run)
            print(f"  one optimizer hook call: {_hook_cost(probe, 2000 if settings.smoke else 5000):.2f} µs")
            return _verdict(ok and seen, times["probes off"], settings)
        finally:
            torchpulse.detach()


def _verdict(ok: bool, off_times: list[float], settings: Settings) -> bool:
    """`ok`, and the step big enough for the budget to mean something (a smoke run judges neither)."""
    off = statistics.median(off_times)
    if settings.smoke:
        print("  smoke run: budgets not judged")
        return True
    if off < settings.min_step:
        print(f"  STEP TOO SMALL: {off * 1e3:.1f} ms < {settings.min_step * 1e3:.0f} ms (raise the batch)")
        return False
    return ok


def autograd_overhead(settings: Settings) -> bool:
    print("\n== autograd probe")
    d_model, seq, first = _sizes(settings)
    build = _transformer(settings, d_model)
    models: list[tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]] = []

    def make(batch: int) -> Callable[[], None]:
        model, optimizer = build(batch)
        data = torch.randn(batch, seq, d_model, device=settings.device)
        models[:] = [(model, optimizer, data)]
        return _step_of(model, optimizer, data, settings)

    batch, step, _ = calibrated(make, first, settings, "TransformerEncoder + AdamW")
    model, _optimizer, data = models[0]
    clock = time.perf_counter  # other threads (the CUDA driver's) share the work: by the wall clock
    default_agent, default_probe = make_probe()
    every_agent, every_probe = make_probe(sample_every="1")
    probes: dict[str, AutogradProbe | None] = {
        "off": None,
        "off_again": None,
        "default": default_probe,
        "every_pass": every_probe,
    }
    agents = {"default": default_agent, "every_pass": every_agent}
    self_times = {"default": SelfTime(default_probe, clock), "every_pass": SelfTime(every_probe, clock)}
    names = list(probes)
    wall: dict[str, list[float]] = {name: [] for name in names}

    def run(name: str) -> None:
        probe = probes[name]
        if probe is not None:
            probe.enabled = True
        start = time.perf_counter()
        step()
        agent = agents.get(name)
        if agent is not None:
            drain_start = clock()
            agent.drain()
            self_times[name].seconds += clock() - drain_start
        wall[name].append(time.perf_counter() - start)
        if probe is not None:
            probe.enabled = False

    warmup, rounds = 2, settings.rounds * 2
    for _ in range(warmup):
        for name in names:
            run(name)
    for values in wall.values():
        values.clear()
    for self_time in self_times.values():
        self_time.restart()
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            run(name)
    off = wall["off"]
    print(f"  TransformerEncoder (d_model {d_model}, batch {batch}, seq {seq}) on {settings.device}")
    print(f"  {'config':<12} {'median ms':>10} {'paired ratio':>13} {'95% interval':>16}")
    paired: dict[str, float] = {}
    for name in names[1:]:
        ratios = [t / o for t, o in zip(wall[name], off, strict=True)]
        low, high = median_interval(ratios)
        paired[name] = statistics.median(ratios)
        print(
            f"  {name:<12} {statistics.median(wall[name]) * 1e3:>10.2f} {paired[name]:>13.4f} {low:>7.4f}-{high:<8.4f}"
        )
    off_total = sum(off)
    per_pass_timing = statistics.median(
        (e - d) / o for e, d, o in zip(wall["every_pass"], wall["default"], off, strict=True)
    )
    every = default_probe.config.sample_every
    implied = 1 + self_times["default"].seconds / off_total + max(0.0, per_pass_timing) / every
    print(
        f"  default: implied ratio {implied:.5f} (self time + 1/{every} of a timed pass's extra {per_pass_timing:.2%})"
    )
    arm_steps = warmup + rounds
    good = True
    for name, agent in agents.items():
        agent.drain()
        passes = agent.store.value("backward_passes_total", ("backward",)) or 0
        sampled = agent.store.value("autograd_sampled_passes_total", ()) or 0
        arm_ok = passes == arm_steps and (name != "every_pass" or sampled == arm_steps)
        good = good and arm_ok
        print(
            f"  {name} probe: {passes:.0f} passes, {sampled:.0f} timed; its arm ran {arm_steps} steps "
            f"({'ok' if arm_ok else 'MISMATCH: the arms are not what they claim'})"
        )
    _node_time_against_kernels(every_agent, every_probe, model, data, settings)
    for probe in (default_probe, every_probe):
        probe.uninstall()
    figures = {"default": implied, "every_pass": paired["every_pass"]}
    for name, budget in AUTOGRAD_BUDGETS.items():
        print(
            f"  {name}: {figures[name]:.4f} against <= {budget}: {'ok' if figures[name] <= budget else 'OVER BUDGET'}"
        )
    within = all(figures[name] <= budget for name, budget in AUTOGRAD_BUDGETS.items())
    return _verdict(good and within, off, settings)


def _node_time_against_kernels(
    agent: Agent, probe: AutogradProbe, model: nn.Module, data: torch.Tensor, settings: Settings
) -> None:
    """What node timing measures here: the seconds it counts per pass against the backward's device time."""

    def node_seconds() -> float:
        agent.drain()
        return sum(v for (family, _), v in agent.store._values.items() if family == "autograd_node_seconds_total")

    before, passes = node_seconds(), 3
    device_seconds = 0.0
    probe.enabled = True
    try:
        for _ in range(passes):
            loss = model(data).square().mean()
            settings.sync()
            if settings.device.type == "cuda":
                start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                start.record()
                loss.backward()
                end.record()
                settings.sync()
                device_seconds += start.elapsed_time(end) / 1e3
            else:
                started = time.perf_counter()
                loss.backward()
                device_seconds += time.perf_counter() - started
            model.zero_grad(set_to_none=True)
    finally:
        probe.enabled = False
    host = (node_seconds() - before) / passes
    clock = "CUDA events" if settings.device.type == "cuda" else "wall clock"
    print(
        f"  node timing on {settings.device}: {host * 1e3:.2f} ms of node time per pass against "
        f"{device_seconds / passes * 1e3:.2f} ms of backward on the device ({clock})"
    )


def compile_overhead(settings: Settings) -> bool:
    print("\n== compile + CUDA-graph probes")
    width, layers, first = (64, 2, 8) if settings.smoke else (4096, 4, 2048)
    parts: list[tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]] = []

    def build(batch: int) -> Callable[[], None]:
        torch.manual_seed(0)
        stack: list[nn.Module] = []
        for _ in range(layers):
            stack += [nn.Linear(width, width), nn.ReLU()]
        model = nn.Sequential(*stack, nn.Linear(width, 10)).to(settings.device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        batch_data = torch.randn(batch, width, device=settings.device)
        parts[:] = [(model, optimizer, batch_data)]
        return _step_of(model, optimizer, batch_data, settings)

    # Calibrated eagerly (a compiled step is not slower): a new batch size after compiling would recompile.
    batch, _, _ = calibrated(build, first, settings, "MLP, eager")
    model, optimizer, batch_data = parts[0]
    mode = "reduce-overhead" if settings.device.type == "cuda" else None
    compiled = torch.compile(model, mode=mode)
    target = torch.randint(0, 10, (batch,), device=settings.device)

    def step() -> None:
        torch.nn.functional.cross_entropy(compiled(batch_data), target).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        settings.sync()

    agent = make_agent()
    probes, enter, leave = probes_arm(agent)

    started = time.perf_counter()
    for _ in range(4):
        step()  # compiles forward and backward; on CUDA warms up and records the graphs
    print(f"  compile + warm-up: {time.perf_counter() - started:.1f} s")
    compiled_before = _frames_compiled()
    times = interleaved(
        step,
        [
            Variant("off", lambda: None, lambda: None),
            Variant("off_again", lambda: None, lambda: None),
            Variant("on", enter, leave),
        ],
        rounds=settings.rounds,
        steps_per_block=settings.block,
        warmup=2,
        settle=2,
    )
    recompiled = _frames_compiled() - compiled_before
    ok = report(
        f"MLP ({layers} x {width}, batch {batch}) compiled with mode={mode!r} on {settings.device}, probes off vs on",
        times,
        "off",
        {"on": COMPILE_BUDGET},
        settings.block,
    )
    if recompiled:
        print(f"  NOT STEADY STATE: {recompiled} frames compiled during the timed rounds")
        ok = False
    per_step_self_time(
        step, agent, list(probes), statistics.median(times["off"]), steps=settings.rounds * settings.block
    )
    return _verdict(ok, times["off"], settings)


SECTIONS: dict[str, Callable[[Settings], bool]] = {
    "optimizer": optimizer_overhead,
    "autograd": autograd_overhead,
    "compile": compile_overhead,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny models and rounds; the budgets are not judged")
    parser.add_argument("--rounds", type=int, help="rounds per benchmark (default 12; smoke 2)")
    parser.add_argument("--block", type=int, help="timed steps per block (default 8; smoke 2)")
    parser.add_argument("--min-step-ms", type=float, default=20.0, help="the smallest step the budgets are for")
    parser.add_argument("--only", choices=sorted(SECTIONS), action="append", help="run only these (repeatable)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: nothing to measure (--device cpu --smoke runs the code path)", file=sys.stderr)
        return 2
    settings = Settings(
        device=device,
        smoke=args.smoke,
        rounds=args.rounds or (2 if args.smoke else 12),
        block=args.block or (2 if args.smoke else 8),
        min_step=args.min_step_ms / 1e3,
    )
    torch.manual_seed(0)
    if device.type == "cpu":
        torch.set_num_threads(1)
    results = {}
    for name in args.only or list(SECTIONS):
        started = time.perf_counter()
        results[name] = SECTIONS[name](settings)
        print(f"  ({name}: {time.perf_counter() - started:.1f} s)")
    print("\n" + "  ".join(f"{name}: {'ok' if ok else 'FAILED'}" for name, ok in results.items()))
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
