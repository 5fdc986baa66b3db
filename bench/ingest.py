"""Daemon ingest and scrape latency under simulated agents.

Run: `.venv/bin/python bench/ingest.py [--seconds S]`.

1. Flood: simulated agents send realistic pre-encoded batches as fast as the
   daemon reads them; reports series updates ("events") decoded and applied
   per second of wall time and per second of daemon CPU (one core).
2. Scrape: 64 runs x 8 ranks connected, each with a realistic snapshot;
   reports /metrics latency p50/p99 idle and while a flood is running.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import statistics
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import bench_dir, percentile, running_daemon
from torchpulse.catalog import CATALOG
from torchpulse.protocol import Batch, Hello, HistogramSample, LogEvent, Sample, encode


def _hello(run: str, rank: int) -> Hello:
    return Hello(run, rank, rank % 8, 8, os.getpid(), "bench", "2.13.0", "0.1.0", "bench", time.time())


def _snapshot(seq: int, optimizers: int = 4) -> Batch:
    """About 30 series, the shape of a rank with the foundation probes on."""
    hist_buckets = len(CATALOG["optimizer_step_duration_seconds"].buckets) + 1
    samples, hists = [], []
    for o in range(optimizers):
        label = f"AdamW#{o}"
        samples += [
            Sample("optimizer_steps_total", (label,), float(seq)),
            Sample("optimizer_learning_rate", (label, "0"), 1e-3),
            Sample("optimizer_learning_rate", (label, "1"), 1e-4),
            Sample("optimizer_parameters", (label,), 100.0),
            Sample("optimizer_parameter_elements", (label,), 1e6),
            Sample("optimizer_state_bytes", (label,), 8e6),
        ]
        hists.append(
            HistogramSample(
                "optimizer_step_duration_seconds",
                (label,),
                tuple(seq if i == 6 else 1 for i in range(hist_buckets)),
                0.01 * seq,
            )
        )
    samples += [
        Sample("agent_probe_enabled", ("optimizer",), 1.0),
        Sample("agent_events_dropped_total", ("buffer_full",), 0.0),
    ]
    return Batch(seq, time.time(), samples, hists, [])


def _flood_batch(seq: int) -> Batch:
    """A large batch of the same realistic series plus one log event (1 in ~500 items)."""
    snap = _snapshot(seq, optimizers=64)
    events = [LogEvent(time.time(), "debug", "bench event", {"n": seq})]
    return Batch(seq, time.time(), snap.samples, snap.histograms, events)


def _flood(sock_path: str, worker: int, connections: int, seconds: float) -> None:
    socks = []
    for c in range(connections):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(sock_path)
        s.sendall(encode(_hello(f"flood-{worker}", c)))
        s.recv(4096)
        socks.append(s)
    frame = encode(_flood_batch(1))
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for s in socks:
            s.sendall(frame)
    for s in socks:
        s.close()


def _items(batch: Batch) -> int:
    return len(batch.samples) + len(batch.histograms) + len(batch.events)


def _scrape(url: str) -> tuple[float, str]:
    start = time.perf_counter()
    with urllib.request.urlopen(url, timeout=30) as response:
        body = response.read().decode()
    return time.perf_counter() - start, body


def _value(body: str, name: str) -> float:
    for line in body.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _wait_idle(pid: int, limit: float = 10.0) -> tuple[float, float]:
    """Wait until the daemon has read what the senders left in its sockets (its CPU time stops moving);
    returns (CPU seconds, monotonic time) as of the last CPU progress seen."""
    cpu, at = _cpu_seconds(pid), time.monotonic()
    deadline = at + limit
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now_cpu = _cpu_seconds(pid)
        if now_cpu == cpu:
            break
        cpu, at = now_cpu, time.monotonic()
    return cpu, at


def _start_flood(sock: Path, workers: int, connections: int, seconds: float) -> list[multiprocessing.Process]:
    procs = [multiprocessing.Process(target=_flood, args=(str(sock), w, connections, seconds)) for w in range(workers)]
    for p in procs:
        p.start()
    return procs


# The idle scrape of 64 runs x 8 ranks (~71k samples): the /metrics-at-scale goal, which today's render misses.
IDLE_SCRAPE_P50_BUDGET = 0.015


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--scrapes", type=int, default=40)
    args = parser.parse_args()
    config = '[runs]\nseries_limit_per_run = 100000\n[daemon]\nlog_level = "info"\n'
    flood: list[multiprocessing.Process] = []
    ranks: list[socket.socket] = []
    with bench_dir("torchpulse-ingest-") as workdir, running_daemon(workdir, config) as bench_daemon:
        try:
            status = _measure(bench_daemon.proc.pid, bench_daemon.socket_path, bench_daemon.url, args, flood, ranks)
        finally:
            for p in flood:  # still sending when this ended early (Ctrl-C, an error)
                if p.is_alive():
                    p.terminate()
                p.join()
            for s in ranks:
                s.close()
    return status


def _measure(
    pid: int,
    sock: Path,
    url: str,
    args: argparse.Namespace,
    flood: list[multiprocessing.Process],
    ranks: list[socket.socket],
) -> int:
    """The figures, printed; 1 when one missed its budget."""
    print(
        f"daemon pid {pid}, {os.cpu_count()} cores; flood batch = "
        f"{_items(_flood_batch(1))} items, {len(encode(_flood_batch(1)))} bytes"
    )

    # 1. Flood. The daemon's CPU time is read once it has also read what the senders left in its
    # sockets, since the counter read afterwards includes those events.
    _, before = _scrape(url)
    cpu0, t0 = _cpu_seconds(pid), time.monotonic()
    flood[:] = _start_flood(sock, 1, 8, args.seconds)
    for p in flood:
        p.join()
    cpu1, t1 = _wait_idle(pid)
    _, after = _scrape(url)
    received = _value(after, "torchpulse_daemon_events_received_total") - _value(
        before, "torchpulse_daemon_events_received_total"
    )
    per_cpu = received / max(cpu1 - cpu0, 1e-9)
    missed: list[str] = []  # the budgets this run missed: the exit status says so to `make bench`
    print("\n1. ingest flood (1 sender process, 8 connections)")
    print(f"   events applied: {received:,.0f} in {t1 - t0:.1f} s wall, daemon CPU {cpu1 - cpu0:.1f} s")
    print(f"   events/s (wall): {received / (t1 - t0):,.0f}")
    print(
        f"   events per daemon CPU-second (one core): {per_cpu:,.0f}   budget >= 200,000  "
        f"{'ok' if per_cpu >= 200_000 else 'UNDER'}"
    )
    if per_cpu < 200_000:
        missed.append("ingest events per CPU-second")

    # 2. 64 runs x 8 ranks connected, then scrape.
    for r in range(64):
        for k in range(8):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            ranks.append(s)
            s.connect(str(sock))
            s.sendall(encode(_hello(f"run-{r:02d}", k)) + encode(_snapshot(100)))
    for s in ranks:
        s.recv(4096)
    time.sleep(0.5)
    latencies = []
    for _ in range(args.scrapes):
        latency, body = _scrape(url)
        latencies.append(latency)
        # The daemon serves a render again to a scrape that comes within the time the render took; a
        # Prometheus scrapes a target every 15 s or more, so each scrape here must pay a fresh render.
        time.sleep(latency)
    series = sum(1 for line in body.splitlines() if line and not line.startswith("#"))
    p50 = statistics.median(latencies)
    print(f"\n2. /metrics with 64 runs x 8 ranks connected ({series:,} samples, {len(body) / 1e6:.1f} MB)")
    print(
        f"   idle:        p50 {p50 * 1e3:.1f} ms  p99 {percentile(latencies, 0.99) * 1e3:.1f} ms   "
        f"budget p50 <= {IDLE_SCRAPE_P50_BUDGET * 1e3:.0f} ms  {'ok' if p50 <= IDLE_SCRAPE_P50_BUDGET else 'OVER'}"
    )
    if p50 > IDLE_SCRAPE_P50_BUDGET:
        missed.append("idle /metrics p50")
    flood[:] = _start_flood(sock, 1, 8, args.seconds)
    time.sleep(0.5)
    loaded: list[float] = []
    while len(loaded) < args.scrapes:  # only scrapes that ended while the flood still ran
        latency = _scrape(url)[0]
        if not all(p.is_alive() for p in flood):
            break
        loaded.append(latency)
        time.sleep(latency)  # a fresh render each time, as above
    for p in flood:
        p.join()
    if loaded:
        print(
            f"   under flood: p50 {statistics.median(loaded) * 1e3:.1f} ms  "
            f"p99 {percentile(loaded, 0.99) * 1e3:.1f} ms  ({len(loaded)} scrapes"
            f"{'' if len(loaded) == args.scrapes else '; the flood ended first: raise --seconds'})"
        )
    else:
        print("   under flood: no scrape ended while the flood ran (raise --seconds)")
    print(f"   daemon RSS: {_rss_mib(pid):.0f} MiB")
    if missed:
        print(f"\nOVER budget: {', '.join(missed)}")
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
