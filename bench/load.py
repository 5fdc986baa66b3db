"""Sustained, realistic load: 512 simulated agents at 50 steps/s against one real daemon.

Run: `.venv/bin/python bench/load.py [--minutes M] [--agents N]`.

Every simulated agent speaks the real protocol (Hello, then Batch frames of
catalog series) the way `torchpulse.probes.agent.sender` does: running totals,
only the series that changed, one flush every 250 ms (staggered across agents),
a full snapshot after connecting, a sampled autograd pass every 100 steps, a
compile at start-up, and now and then a recompile with its log event. All
agents live in this one process on non-blocking sockets so that the daemon has
a core of its own on a 2-core machine.

Printed: daemon CPU share and RSS over time (with a plateau verdict), events
applied per second, /metrics latency p50/p99 while loaded, and every drop with
where and why it happened (daemon-side rejection counters, the simulated
agents' `agent_events_dropped_total{reason}`, and whether the daemon's running
totals match what the agents sent).
"""

from __future__ import annotations

import argparse
import bisect
import math
import os
import random
import selectors
import socket
import statistics
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import bench_dir, percentile, running_daemon
from bench.ingest import _cpu_seconds, _rss_mib
from torchpulse.catalog import CATALOG
from torchpulse.protocol import Batch, Hello, HistogramSample, LogEvent, Sample, encode

FLUSH_INTERVAL = 0.25
# The /metrics-at-scale goals at the default load (512 agents at 50 steps/s): loaded scrapes, the daemon's peak
# RSS and its CPU. Today's render misses the scrape figures; the exit status says so to `make bench`.
LOADED_SCRAPE_P50_BUDGET = 0.025
LOADED_SCRAPE_P99_BUDGET = 0.060
RSS_PEAK_BUDGET_MIB = 96.0
CPU_SHARE_BUDGET = 0.29
RANKS_PER_RUN = 8
# What a real agent keeps of undelivered log events (AgentConfig.max_pending_events).
MAX_PENDING_EVENTS = 2048
# A real agent's sender blocks in sendall; here a connection whose unsent bytes
# exceed this is "blocked", and the interval's log events wait or are dropped.
BLOCKED_BYTES = 256 << 10
AUTOGRAD_NODES = tuple(
    f"{op}Backward0"
    for op in (
        "Mm",
        "Addmm",
        "Mul",
        "Add",
        "Gelu",
        "NativeLayerNorm",
        "Softmax",
        "Bmm",
        "View",
        "Transpose",
        "Embedding",
        "NllLoss",
        "LogSoftmax",
        "Sum",
        "Expand",
        "Clone",
        "Div",
        "Sub",
        "Pow",
        "Mean",
        "Unsafe",
        "Split",
        "Cat",
        "Permute",
    )
)
RECOMPILE_REASONS = ("size_mismatch", "dtype_mismatch", "guard_failed", "global_changed")
WARMUP_STEPS = 50 * 60


class Histogram:
    """Running per-bucket counts as the agent's store keeps them."""

    def __init__(self, family: str) -> None:
        self.bounds = CATALOG[family].buckets
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value


@dataclass
class SimAgent:
    """One rank's agent: cumulative state plus an outbound byte queue."""

    run: str
    rank: int
    rng: random.Random
    sock: socket.socket | None = None
    out: bytearray = field(default_factory=bytearray)
    seq: int = 0
    steps: int = 0
    backward: int = 0
    sampled: int = 0
    frames: int = 0
    recompiles: dict[tuple[str, str], int] = field(default_factory=dict)
    node_seconds: dict[str, float] = field(default_factory=dict)
    node_calls: dict[str, int] = field(default_factory=dict)
    step_hist: Histogram = field(default_factory=lambda: Histogram("optimizer_step_duration_seconds"))
    backward_hist: Histogram = field(default_factory=lambda: Histogram("backward_duration_seconds"))
    compile_hist: Histogram = field(default_factory=lambda: Histogram("compile_duration_seconds"))
    pending_events: list[LogEvent] = field(default_factory=list)
    dropped: dict[str, int] = field(default_factory=lambda: {"buffer_full": 0, "events_overflow": 0})
    blocked_flushes: int = 0

    def hello(self) -> Hello:
        return Hello(
            self.run,
            self.rank,
            self.rank % RANKS_PER_RUN,
            RANKS_PER_RUN,
            os.getpid() * 1000 + self.rank,
            "bench-node",
            "2.13.0",
            "0.1.0",
            "python train.py --config big.yaml",
            time.time(),
        )

    def snapshot(self) -> list[Sample]:
        """Series a real agent sends once after connecting (probe state, optimizer shape)."""
        opt = "AdamW#0"
        samples = [Sample("agent_probe_enabled", (p,), 1.0) for p in ("optimizer", "autograd", "compile", "cudagraphs")]
        samples += [Sample("agent_events_dropped_total", (r,), float(n)) for r, n in self.dropped.items()]
        samples += [
            Sample("optimizer_parameters", (opt,), 148.0),
            Sample("optimizer_parameter_elements", (opt,), 1.2e8),
            Sample("optimizer_state_bytes", (opt,), 9.6e8),
            Sample("optimizer_capturable", (opt, "0"), 0.0),
            Sample("cudagraph_trees", (), 1.0),
            Sample("cudagraph_nodes", (), 412.0),
            Sample("cudagraph_pool_bytes", (), 2.1e9),
        ]
        return samples

    def step_interval(self, steps: int, now: float) -> Batch:
        """Advance `steps` training steps and return the batch of series that changed."""
        rng, opt = self.rng, "AdamW#0"
        samples: list[Sample] = []
        hists: list[HistogramSample] = []
        if self.seq == 0:
            samples += self.snapshot()
            for _phase in ("dynamo", "aot", "inductor"):
                self.compile_hist.observe(rng.uniform(0.5, 20.0))
            samples.append(Sample("compile_frames_total", ("ok",), 3.0))
            samples.append(Sample("graph_breaks_total", ("data_dependent", "model.py:212"), 1.0))
            hists.append(
                HistogramSample(
                    "compile_duration_seconds", ("inductor",), tuple(self.compile_hist.counts), self.compile_hist.total
                )
            )
        for _ in range(steps):
            self.step_hist.observe(rng.lognormvariate(math.log(0.004), 0.3))
            self.backward_hist.observe(rng.lognormvariate(math.log(0.012), 0.2))
        self.steps += steps
        self.backward += steps
        lr = 3e-4 * 0.5 * (1 + math.cos(math.pi * (self.steps % 100_000) / 100_000))
        samples += [
            Sample("optimizer_steps_total", (opt,), float(self.steps)),
            Sample("optimizer_learning_rate", (opt, "0"), lr),
            Sample("optimizer_learning_rate", (opt, "1"), lr * 0.1),
            Sample("backward_passes_total", ("full",), float(self.backward)),
            Sample("grad_norm", (), rng.uniform(0.5, 2.0)),
        ]
        hists += [
            HistogramSample(
                "optimizer_step_duration_seconds", (opt,), tuple(self.step_hist.counts), self.step_hist.total
            ),
            HistogramSample(
                "backward_duration_seconds", ("full",), tuple(self.backward_hist.counts), self.backward_hist.total
            ),
        ]
        if self.steps // 100 != (self.steps - steps) // 100:  # one sampled autograd pass per 100 steps
            self.sampled += 1
            samples.append(Sample("autograd_sampled_passes_total", (), float(self.sampled)))
            for node in AUTOGRAD_NODES:
                self.node_seconds[node] = self.node_seconds.get(node, 0.0) + rng.uniform(1e-5, 1e-3)
                self.node_calls[node] = self.node_calls.get(node, 0) + rng.randint(1, 48)
                samples.append(Sample("autograd_node_seconds_total", (node,), self.node_seconds[node]))
                samples.append(Sample("autograd_node_calls_total", (node,), float(self.node_calls[node])))
        # Recompiles cluster at the start (shapes settling), then come about once a minute per rank.
        every = 2.0 if self.steps < WARMUP_STEPS else 60.0
        if rng.random() < FLUSH_INTERVAL / every:
            key = (f"forward_{rng.randint(0, 1)}", rng.choice(RECOMPILE_REASONS))
            self.recompiles[key] = self.recompiles.get(key, 0) + 1
            samples.append(Sample("recompiles_total", key, float(self.recompiles[key])))
            self.pending_events.append(
                LogEvent(
                    now,
                    "info",
                    "recompile",
                    {
                        "function": key[0],
                        "reason": key[1],
                        "detail": f"tensor 'x' size mismatch at index 0. expected {rng.randint(1, 64)}, actual 7",
                    },
                )
            )
        if self.blocked_flushes:
            samples += [Sample("agent_events_dropped_total", (r,), float(n)) for r, n in self.dropped.items()]
        self.seq += 1
        events, self.pending_events = self.pending_events, []
        return Batch(self.seq, now, samples, hists, events)


def _scrape(url: str) -> tuple[float, str]:
    start = time.perf_counter()
    with urllib.request.urlopen(url, timeout=30) as response:
        body = response.read().decode()
    return time.perf_counter() - start, body


def _sum(body: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose label text contains every `labels` pair."""
    total = 0.0
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    for line in body.splitlines():
        if (line.startswith(name + " ") or line.startswith(name + "{")) and all(w in line for w in wanted):
            total += float(line.rsplit(" ", 1)[1])
    return total


class Scraper(threading.Thread):
    """Prometheus stand-in: scrapes /metrics every `interval` seconds and keeps the latencies."""

    def __init__(self, url: str, interval: float) -> None:
        super().__init__(daemon=True)
        self.url, self.interval = url, interval
        self.latencies: list[float] = []
        self.failures = 0
        self.last_body = ""
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(self.interval):
            try:
                latency, self.last_body = _scrape(self.url)
                self.latencies.append(latency)
            except OSError:
                self.failures += 1


def _connect(agent: SimAgent, sock_path: Path) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(sock_path))
    sock.sendall(encode(agent.hello()))
    sock.settimeout(10)
    sock.recv(4096)  # Welcome
    sock.setblocking(False)
    agent.sock = sock


def _flush(agent: SimAgent, now: float, steps: int) -> None:
    if len(agent.out) > BLOCKED_BYTES:
        # The real sender would still be inside sendall: counters catch up in the
        # next batch (running totals), but log events beyond the bound are lost.
        agent.blocked_flushes += 1
        overflow = len(agent.pending_events) - MAX_PENDING_EVENTS
        if overflow > 0:
            agent.dropped["events_overflow"] += overflow
            del agent.pending_events[:overflow]
        return
    agent.out += encode(agent.step_interval(steps, now))
    agent.frames += 1


def _pump(agent: SimAgent) -> None:
    assert agent.sock is not None
    try:
        sent = agent.sock.send(agent.out)
    except BlockingIOError:
        return
    del agent.out[:sent]


def _read_incoming(agent: SimAgent) -> None:
    assert agent.sock is not None
    try:
        while agent.sock.recv(65536):
            pass
    except BlockingIOError:
        return


def run_load(sock_path: Path, url: str, pid: int, args: argparse.Namespace) -> int:
    rng = random.Random(7)
    agents = [
        SimAgent(f"load-{i // RANKS_PER_RUN:03d}", i % RANKS_PER_RUN, random.Random(rng.random()))
        for i in range(args.agents)
    ]
    for agent in agents:
        _connect(agent, sock_path)
    selector = selectors.DefaultSelector()
    for agent in agents:
        assert agent.sock is not None
        selector.register(agent.sock, selectors.EVENT_READ, agent)
    steps_per_flush = args.steps_per_second * FLUSH_INTERVAL
    scraper = Scraper(url, args.scrape_interval)
    duration = args.minutes * 60.0
    sample_every = max(5.0, duration / 24)
    start = time.monotonic()
    # Agent i flushes at start + i/N * interval + k * interval: an even spread, as unsynchronised ranks give.
    offsets = [FLUSH_INTERVAL * i / len(agents) for i in range(len(agents))]
    next_due = [start + o for o in offsets]
    carry = [0.0] * len(agents)
    _, body0 = _scrape(url)
    events0 = _sum(body0, "torchpulse_daemon_events_received_total")
    cpu0 = cpu_prev = _cpu_seconds(pid)
    t_prev = start
    events_prev = events0
    series: list[tuple[float, float, float, float, float]] = []  # t, cpu share, rss MiB, events/s, series held
    scraper.start()
    print(f"{'t (s)':>7} {'daemon CPU':>10} {'RSS MiB':>8} {'events/s':>10} {'series':>8} {'scrape p50':>10}")
    next_sample = start + sample_every
    index = 0
    while True:
        now = time.monotonic()
        if now >= start + duration:
            break
        # Flush every agent that is due (round-robin over the staggered schedule).
        while next_due[index] <= now:
            carry[index] += steps_per_flush
            steps = int(carry[index])
            carry[index] -= steps
            _flush(agents[index], time.time(), steps)
            next_due[index] += FLUSH_INTERVAL
            _pump(agents[index])
            index = (index + 1) % len(agents)
        for agent in agents:
            if agent.out:
                _pump(agent)
        wait = max(0.0, min(next_due[index], next_sample) - time.monotonic())
        for key, _ in selector.select(timeout=min(wait, 0.01)):
            _read_incoming(key.data)
        if now >= next_sample:
            cpu = _cpu_seconds(pid)
            body = scraper.last_body or _scrape(url)[1]
            events = _sum(body, "torchpulse_daemon_events_received_total")
            recent = scraper.latencies[-10:] or [0.0]
            span = now - t_prev
            row = (
                now - start,
                (cpu - cpu_prev) / span,
                _rss_mib(pid),
                (events - events_prev) / span,
                _sum(body, "torchpulse_run_series"),
            )
            series.append(row)
            print(
                f"{row[0]:7.0f} {row[1]:10.1%} {row[2]:8.1f} {row[3]:10,.0f} {row[4]:8,.0f} "
                f"{statistics.median(recent) * 1e3:8.1f} ms",
                flush=True,
            )
            cpu_prev, t_prev, events_prev = cpu, now, events
            next_sample += sample_every
    end = time.monotonic()
    scraper.stop_event.set()
    scraper.join()
    # Let the daemon read what is still in flight, then take the final figures.
    for _ in range(200):
        for agent in agents:
            if agent.out:
                _pump(agent)
        if not any(agent.out for agent in agents):
            break
        time.sleep(0.01)
    time.sleep(1.0)
    # The daemon's CPU before the final scrape: rendering it is not part of the load.
    cpu_total = _cpu_seconds(pid) - cpu0
    _, body = _scrape(url)
    events_total = _sum(body, "torchpulse_daemon_events_received_total") - events0
    ok = report(args, agents, series, scraper, body, end - start, cpu_total, events_total)
    for agent in agents:
        assert agent.sock is not None
        agent.sock.close()
    return 0 if ok else 1


def report(
    args: argparse.Namespace,
    agents: list[SimAgent],
    series: list[tuple[float, float, float, float, float]],
    scraper: Scraper,
    body: str,
    elapsed: float,
    cpu_total: float,
    events_total: float,
) -> bool:
    """Print the figures; False when a guarantee failed (a failed scrape, totals that do not match) or, at the
    default load, a figure missed its budget."""
    print(
        f"\nran {elapsed:.0f} s with {len(agents)} agents ({len(agents) // RANKS_PER_RUN} runs x {RANKS_PER_RUN} "
        f"ranks) at {args.steps_per_second:g} steps/s each, flush every {FLUSH_INTERVAL * 1e3:.0f} ms"
    )
    frames = sum(a.frames for a in agents)
    print(f"frames sent: {frames:,} ({frames / elapsed:,.0f}/s)")
    print(f"daemon CPU: {cpu_total:.1f} s in {elapsed:.0f} s = {cpu_total / elapsed:.1%} of one core")
    print(f"events applied: {events_total:,.0f} = {events_total / elapsed:,.0f}/s")
    lat = scraper.latencies
    if lat:
        print(
            f"/metrics while loaded: {len(lat)} scrapes every {args.scrape_interval:g} s, "
            f"p50 {statistics.median(lat) * 1e3:.1f} ms, p99 {percentile(lat, 0.99) * 1e3:.1f} ms, "
            f"max {max(lat) * 1e3:.1f} ms, failures {scraper.failures}, "
            f"{sum(1 for line in body.splitlines() if line and line[0] != '#'):,} samples, {len(body) / 1e6:.1f} MB"
        )
    # RSS plateau: after the warm-up third, the second half's median must not exceed the first's beyond
    # noise. Medians, because a sample taken while a 7 MB scrape is being rendered reads ~15 MiB high.
    steady = [row for row in series if row[0] >= elapsed / 3]
    if len(steady) >= 4:
        half = len(steady) // 2
        first = statistics.median(r[2] for r in steady[:half])
        second = statistics.median(r[2] for r in steady[half:])
        growth = second - first
        new_series = steady[-1][4] - steady[0][4]
        verdict = "PLATEAU" if growth <= max(1.0, 0.01 * first) else "GROWING"
        print(
            f"RSS: {series[0][2]:.1f} MiB at {series[0][0]:.0f} s, peak {max(r[2] for r in series):.1f} MiB; "
            f"steady medians {first:.1f} -> {second:.1f} MiB ({growth:+.1f} MiB) while series held went "
            f"{new_series:+,.0f} -> {verdict}"
        )
    else:
        print("RSS: too few samples for a plateau verdict (run longer)")
    print("drops:")
    frames_rejected = _sum(body, "torchpulse_daemon_frames_rejected_total")
    series_rejected = _sum(body, "torchpulse_daemon_series_rejected_total")
    run_rejected = _sum(body, "torchpulse_run_series_rejected")
    print(
        f"  daemon: frames rejected {frames_rejected:.0f}, series rejected {series_rejected:.0f}, "
        f"run series limit refusals {run_rejected:.0f}"
    )
    for reason in ("buffer_full", "events_overflow"):
        sim = sum(a.dropped[reason] for a in agents)
        seen = _sum(body, "torchpulse_agent_events_dropped_total", reason=reason)
        print(f"  agents: events_dropped{{reason={reason}}} {sim} (daemon shows {seen:.0f})")
    blocked = sum(a.blocked_flushes for a in agents)
    print(f"  agents: flushes skipped because the socket was still blocked: {blocked}")
    sent_steps = sum(a.steps for a in agents)
    applied_steps = _sum(body, "torchpulse_optimizer_steps_total")
    print(
        f"  running totals: steps sent {sent_steps:,}, daemon holds {applied_steps:,.0f} "
        f"({'match' if sent_steps == applied_steps else 'MISMATCH'})"
    )
    missed = _missed_budgets(args, lat, series, cpu_total / elapsed)
    if missed:
        print(f"OVER budget: {', '.join(missed)}")
    return sent_steps == applied_steps and scraper.failures == 0 and not missed


def _missed_budgets(
    args: argparse.Namespace, latencies: list[float], series: list[tuple[float, float, float, float, float]], cpu: float
) -> list[str]:
    """The budgets missed, judged only at the load they were set for (other loads print figures to read)."""
    if (args.agents, args.steps_per_second) != (512, 50.0) or not latencies or not series:
        return []
    peak = max(row[2] for row in series)
    print(
        f"budgets: /metrics p50 <= {LOADED_SCRAPE_P50_BUDGET * 1e3:.0f} ms, p99 <= "
        f"{LOADED_SCRAPE_P99_BUDGET * 1e3:.0f} ms; RSS peak <= {RSS_PEAK_BUDGET_MIB:.0f} MiB; "
        f"daemon CPU <= {CPU_SHARE_BUDGET:.0%} of one core"
    )
    checks = {
        "/metrics p50": statistics.median(latencies) <= LOADED_SCRAPE_P50_BUDGET,
        "/metrics p99": percentile(latencies, 0.99) <= LOADED_SCRAPE_P99_BUDGET,
        "RSS peak": peak <= RSS_PEAK_BUDGET_MIB,
        "daemon CPU": cpu <= CPU_SHARE_BUDGET,
    }
    return [name for name, ok in checks.items() if not ok]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--agents", type=int, default=512)
    parser.add_argument("--steps-per-second", type=float, default=50.0)
    parser.add_argument("--scrape-interval", type=float, default=1.0)
    args = parser.parse_args()
    config = '[daemon]\nlog_level = "info"\n'
    # Removed at the end; kept (with the daemon log) when the run failed.
    with (
        bench_dir("torchpulse-load-", keep_on_error=True) as workdir,
        running_daemon(workdir, config, log=True) as daemon,
    ):
        log_path = daemon.log_path
        assert log_path is not None
        print(f"daemon pid {daemon.proc.pid}, {os.cpu_count()} cores, log {log_path}; load for {args.minutes:g} min")
        try:
            return run_load(daemon.socket_path, daemon.url, daemon.proc.pid, args)
        finally:
            print(f"daemon log: {log_path.stat().st_size / 1e6:.1f} MB written")


if __name__ == "__main__":
    raise SystemExit(main())
