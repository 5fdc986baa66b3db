"""Side-by-side timing helpers: interleaved variants, paired ratios and their intervals in one run.

The machine is shared and noisy, so absolute times are not comparable across
runs; each benchmark alternates its variants in short blocks and reports the
median over rounds of the per-round ratio to the baseline block of the same
round, with a distribution-free 95% interval. Also shared by the daemon
benchmarks: a real daemon on a temporary socket, a temporary directory that
goes away also on Ctrl-C and SIGTERM, and nearest-rank percentiles.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
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


def interleaved(
    step: Callable[[], None],
    variants: Sequence[Variant],
    rounds: int,
    steps_per_block: int,
    warmup: int = 5,
    settle: int = 1,
) -> dict[str, list[float]]:
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


def paired_ratios(times: dict[str, list[float]], name: str, baseline: str, block: int) -> list[float]:
    """Per round: (block median / baseline block median of the same round), in round order.

    `interleaved` appends `block` steps per variant per round, so slice i of both
    lists is the same round. Blocks of one round ran back to back, so slow drifts
    of a shared machine cancel out of each pair.
    """
    ours, base = times[name], times[baseline]
    if len(ours) != len(base) or len(ours) % block:
        raise ValueError(
            f"{name} ({len(ours)} steps) and {baseline} ({len(base)} steps) are not whole rounds of {block} steps each"
        )
    return [
        statistics.median(ours[i : i + block]) / statistics.median(base[i : i + block])
        for i in range(0, len(ours), block)
    ]


def paired_ratio(times: dict[str, list[float]], name: str, baseline: str, block: int) -> float:
    """Median over rounds of (block median / baseline block median of the same round)."""
    return statistics.median(paired_ratios(times, name, baseline, block))


def median_interval(values: Sequence[float]) -> tuple[float, float]:
    """A distribution-free 95% confidence interval for the median, from order statistics.

    The ranks (1-based) n/2 - 1.96*sqrt(n)/2 rounded down and 1 + n/2 + 1.96*sqrt(n)/2
    rounded up, clamped to the sample: the normal approximation of Binomial(n, 1/2).
    """
    ordered = sorted(values)
    n = len(ordered)
    half_width = 1.96 * math.sqrt(n) / 2
    low = max(0, math.floor(n / 2 - half_width) - 1)
    high = min(n - 1, math.ceil(n / 2 + half_width))
    return ordered[low], ordered[high]


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..1): the smallest value with at least q of the sample at or below it."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def report(title: str, times: dict[str, list[float]], baseline: str, budgets: dict[str, float], block: int) -> bool:
    """Print medians and paired ratios (with a 95% interval) against `baseline`; True when every budget holds.

    The verdict compares the paired median with the budget; the interval says whether that
    verdict is clear of the noise of this run.
    """
    print(f"\n{title}")
    print(f"  {'variant':<28} {'steps':>6} {'median':>11} {'ratio':>7}  {'95% interval':<15}  budget")
    ok = True
    for name, values in times.items():
        median = statistics.median(values)
        ratios = paired_ratios(times, name, baseline, block)
        ratio = statistics.median(ratios)
        low, high = median_interval(ratios)
        budget = budgets.get(name)
        verdict = "" if budget is None else (f"<= {budget}  {'ok' if ratio <= budget else 'OVER'}")
        ok = ok and (budget is None or ratio <= budget)
        print(f"  {name:<28} {len(values):>6} {median * 1e3:>8.3f} ms {ratio:>7.4f}  {low:.4f}-{high:.4f}  {verdict}")
    return ok


def optimizer_hooks() -> int:
    """Optimizer step hooks registered process-wide (torch's private tables; 0 when they are not found): the
    overhead benchmarks check with it that a probe's hooks are there in the arm that claims them, and only there."""
    from torch.optim import optimizer as optim_module

    return sum(
        len(getattr(optim_module, table, {}))
        for table in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")
    )


@contextmanager
def bench_dir(prefix: str, keep_on_error: bool = False) -> Iterator[Path]:
    """A temporary directory removed on the way out, also on Ctrl-C and SIGTERM.

    With `keep_on_error` it is kept, and named, when the benchmark raised (its daemon log is in it).
    """
    path = Path(tempfile.mkdtemp(prefix=prefix))
    keep = False
    try:
        with sigterm_unwinds():
            yield path
    except Exception:
        keep = keep_on_error  # not on Ctrl-C or SIGTERM: then whoever stopped it wants it gone
        raise
    finally:
        if keep:
            print(f"kept {path} (the benchmark failed; the daemon log is there)", file=sys.stderr)
        else:
            shutil.rmtree(path, ignore_errors=True)


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


@contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """SIGTERM (a CI timeout, `kill`) raises SystemExit inside, so that `finally`s stop daemons and
    remove directories; by default it would end the process on the spot. Ctrl-C already unwinds."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


@dataclass(frozen=True)
class BenchDaemon:
    proc: subprocess.Popen[bytes]
    socket_path: Path
    url: str
    log_path: Path | None


@contextmanager
def running_daemon(
    workdir: Path, config: str | None = None, log: bool = False, timeout: float = 30.0
) -> Iterator[BenchDaemon]:
    """A real daemon on a free port under `workdir`, ready when `/metrics` answers; stopped on exit.

    `config` is TOML text for `--config`; with `log` its output goes to `workdir/daemon.log`.
    """
    sock, log_path = workdir / "agent.sock", (workdir / "daemon.log" if log else None)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    args = [
        sys.executable,
        "-m",
        "torchpulse",
        "daemon",
        "--socket",
        str(sock),
        "--listen",
        f"127.0.0.1:{port}",
        "--state-dir",
        str(workdir / "state"),
    ]
    if config is not None:
        (workdir / "tp.toml").write_text(config)
        args += ["--config", str(workdir / "tp.toml")]
    with sigterm_unwinds():
        with log_path.open("wb") if log_path else open(os.devnull, "wb") as out:
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
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
