"""Side-by-side timing helpers: interleaved variants, medians and ratios in one run.

The machine is shared and noisy, so absolute times are not comparable across
runs; each benchmark alternates its variants in short blocks and reports the
ratio of medians measured in the same process at the same time.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Variant:
    name: str
    enter: Callable[[], None]
    leave: Callable[[], None]


def interleaved(step: Callable[[], None], variants: Sequence[Variant], rounds: int, steps_per_block: int,
                warmup: int = 5, settle: int = 1) -> dict[str, list[float]]:
    """Per-step wall times of `step` under each variant, alternating variant order every round.

    The first `settle` steps after each switch are run but not timed: they pay for the switch
    (caches refilled after an install or uninstall), which a job that attaches once never does.
    """
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    for _ in range(warmup):
        step()
    for round_index in range(rounds):
        order = variants if round_index % 2 == 0 else list(reversed(variants))
        for variant in order:
            variant.enter()
            try:
                for _ in range(settle):
                    step()
                for _ in range(steps_per_block):
                    start = time.perf_counter()
                    step()
                    times[variant.name].append(time.perf_counter() - start)
            finally:
                variant.leave()
    return times


def paired_ratio(times: dict[str, list[float]], name: str, baseline: str, block: int) -> float:
    """Median over rounds of (block median / baseline block median of the same round).

    Blocks of one round ran back to back, so slow drifts of a shared machine
    cancel out of each pair.
    """
    ours, base = times[name], times[baseline]
    ratios = [
        statistics.median(ours[i:i + block]) / statistics.median(base[i:i + block])
        for i in range(0, min(len(ours), len(base)), block)
    ]
    return statistics.median(ratios)


def report(title: str, times: dict[str, list[float]], baseline: str, budgets: dict[str, float],
           block: int) -> bool:
    """Print medians and paired ratios against `baseline`; True when every budget holds."""
    print(f"\n{title}")
    print(f"  {'variant':<28} {'steps':>6} {'median':>11} {'ratio':>7}  budget")
    ok = True
    for name, values in times.items():
        median = statistics.median(values)
        ratio = paired_ratio(times, name, baseline, block)
        budget = budgets.get(name)
        verdict = "" if budget is None else (f"<= {budget}  {'ok' if ratio <= budget else 'OVER'}")
        ok = ok and (budget is None or ratio <= budget)
        print(f"  {name:<28} {len(values):>6} {median * 1e3:>8.3f} ms {ratio:>7.4f}  {verdict}")
    return ok


@dataclass(frozen=True)
class BenchDaemon:
    proc: subprocess.Popen[bytes]
    socket_path: Path
    url: str
    log_path: Path | None


@contextmanager
def running_daemon(workdir: Path, config: str | None = None, log: bool = False,
                   timeout: float = 30.0) -> Iterator[BenchDaemon]:
    """A real daemon on a free port under `workdir`, ready when `/metrics` answers; stopped on exit.

    `config` is TOML text for `--config`; with `log` its output goes to `workdir/daemon.log`.
    """
    sock, log_path = workdir / "agent.sock", (workdir / "daemon.log" if log else None)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    args = [sys.executable, "-m", "torchpulse", "daemon", "--socket", str(sock), "--listen", f"127.0.0.1:{port}",
            "--state-dir", str(workdir / "state")]
    if config is not None:
        (workdir / "tp.toml").write_text(config)
        args += ["--config", str(workdir / "tp.toml")]
    with (log_path.open("wb") if log_path else open(os.devnull, "wb")) as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    daemon = BenchDaemon(proc, sock, f"http://127.0.0.1:{port}/metrics", log_path)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(daemon.url, timeout=5):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the daemon did not come up (exit status {proc.poll()})") from None
                time.sleep(0.05)
        yield daemon
    finally:
        proc.terminate()
        proc.wait(10)
