"""`make demo`: a daemon, a real 2-rank training job under `torchpulse run`, and what was exported."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchpulse.daemon.client import format_status, request_status
from torchpulse.summary import (
    format_checkpoint_saves,
    format_checkpoints,
    format_node_times,
    format_probe_table,
    format_table,
    summarize,
)
from torchpulse.terminal import printable


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"daemon exited early:\n{log.read_text()}")
        try:
            _scrape(url)
            return
        except OSError:
            time.sleep(0.1)
    raise SystemExit("daemon did not come up within 30 s")


def _wait_validated(url: str, expected: int, timeout: float = 90.0) -> None:
    """Checkpoint validation runs in a worker after the save: give it time to report."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        total = sum(
            float(line.rsplit(" ", 1)[1])
            for line in _scrape(url).splitlines()
            if line.startswith("torchpulse_checkpoint_validations_total{")
        )
        if total >= expected:
            return
        time.sleep(0.5)


# The demo's daemon gives up waiting for a half-written save after this long (30 minutes by default).
DEMO_INCOMPLETE_AFTER_SECONDS = 2


def crash_an_overwrite(checkpoint: Path) -> Path:
    """What a save into an existing checkpoint directory leaves when it dies half way: DCP rewrote a shard,
    then the process was killed before it wrote the new `.metadata`. The old metadata now describes a mix."""
    shard = sorted(checkpoint.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes())
    return shard


def _logged(log: Path, event: str, describe: Callable[[dict[str, Any]], str]) -> list[str]:
    """The daemon's `event` lines (JSON lines: its stderr is a file), described one per line, by rank."""
    lines: list[tuple[str, str]] = []
    for text in log.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(text)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("event") == event:
            lines.append((str(entry.get("rank")), f"rank {entry.get('rank')} {entry.get('level')}: {describe(entry)}"))
    # What the job sent (exception text, parameter names), as the daemon logged it: escaped before it
    # reaches the terminal.
    return [printable(line) for _rank, line in sorted(lines)]


def _save_failure(entry: dict[str, Any]) -> str:
    return f"{entry.get('api')} to {entry.get('path')} raised {entry.get('error')}: {entry.get('message')}"


def _nonfinite(entry: dict[str, Any]) -> str:
    return (
        f"pass {entry.get('pass_index')} ({entry.get('kind')}): non-finite gradients in "
        f"{entry.get('parameters')} of {entry.get('checked')} parameters: {entry.get('names')}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--keep", action="store_true", help="leave the daemon running at the end")
    args = parser.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix="torchpulse-demo-"))
    sock, port = workdir / "agent.sock", _free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    log = workdir / "daemon.log"
    config = workdir / "torchpulse.toml"
    config.write_text(f"[checkpoints]\nincomplete_after_seconds = {DEMO_INCOMPLETE_AFTER_SECONDS}\n")
    print(f"== starting the daemon (socket {sock}, metrics {url})")
    with log.open("wb") as log_file:
        daemon = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torchpulse",
                "daemon",
                "--socket",
                str(sock),
                "--config",
                str(config),
                "--listen",
                f"127.0.0.1:{port}",
                "--state-dir",
                str(workdir / "state"),
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_ready(url, daemon, log)
        checkpoints = workdir / "checkpoints"
        job_args = [
            "--steps",
            str(args.steps),
            "--compile",
            "--nan-at-step",
            str(max(1, args.steps // 4)),
            "--checkpoint-dir",
            str(checkpoints),
            "--checkpoint-every",
            str(max(1, args.steps // 2)),
            "--fail-save-at-step",
            str(max(1, args.steps * 3 // 4)),
        ]
        job = [
            sys.executable,
            "-m",
            "torchpulse",
            "run",
            "--socket",
            str(sock),
            "--run-name",
            "demo",
            "--",
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={args.ranks}",
            "-m",
            "torchpulse.demo_job",
            *job_args,
        ]
        # The command as it runs (`torchrun` is `python -m torch.distributed.run`), so it can be copied.
        print(
            f"== training: torchpulse run --socket {sock} --run-name demo -- torchrun --standalone "
            f"--nproc-per-node {args.ranks} -m torchpulse.demo_job {' '.join(job_args)}"
        )
        print(
            "   (a compiled metric that breaks its graph and recompiles both halves when the sequence\n"
            "    length doubles, one injected NaN gradient,\n"
            "    DCP checkpoints that the daemon validates, and one checkpoint save that fails on purpose)"
        )
        started = time.monotonic()
        env = dict(os.environ, OMP_NUM_THREADS="1")
        result = subprocess.run(job, env=env, check=False)
        print(f"== job finished with exit code {result.returncode} in {time.monotonic() - started:.1f} s")
        _wait_validated(url, expected=2)
        exposition = _scrape(url)
        rows = summarize(exposition)
        print("\n== per-rank summary, read back from /metrics\n")
        print(format_table(rows))
        print("\n== what the autograd and compile probes saw\n")
        print(format_probe_table(rows))
        for line in _logged(log, "autograd.nonfinite_gradients", _nonfinite):
            print(f"   daemon log: {line}")
        print(
            "\n== where backward time goes: node types timed on sampled passes (the first pass, then about\n"
            "   every 100th: TORCHPULSE_OPT_AUTOGRAD_SAMPLE_EVERY), slowest first\n"
        )
        print(format_node_times(rows))
        print(
            "\n== checkpoint saves the probe counted (the failure is the job's deliberate one; alert: "
            "CheckpointSaveFailed)\n"
        )
        print(format_checkpoint_saves(rows))
        for line in _logged(log, "checkpoint save failed", _save_failure):
            print(f"   daemon log: {line}")
        print("\n== checkpoints, validated by the daemon (torchpulse check PATH does the same by hand)\n")
        print(format_checkpoints(exposition))
        latest = max(checkpoints.glob("step-*"))
        shard = crash_an_overwrite(latest)
        print(
            f"\n== a save into {latest.name}/ that died half way (simulated: {shard.name} rewritten in place "
            "under\n   the old .metadata, which dcp.load accepts); once the shards are quiet for "
            f"incomplete_after_seconds\n   ({DEMO_INCOMPLETE_AFTER_SECONDS} s here, 30 min by default) the daemon "
            "validates it again (alert: CheckpointInvalid)\n"
        )
        _wait_validated(url, expected=3)
        exposition = _scrape(url)
        print(format_checkpoints(exposition))
        print("\n== torchpulse status\n")
        print(format_status(request_status(sock)))
        families = sorted({line.split(" ")[2] for line in exposition.splitlines() if line.startswith("# TYPE")})
        print(f"\n== {len(families)} metric families exported, e.g.:")
        for line in exposition.splitlines():
            if line.startswith("torchpulse_optimizer_steps_total") or line.startswith("torchpulse_agent_up"):
                print(f"   {line}")
        if args.keep:
            print(
                f"\nMetrics: {url}\nThe daemon keeps running (pid {daemon.pid}, log {log}); "
                f"stop it with: kill {daemon.pid}"
            )
        else:
            print(
                f"\nMetrics were served at {url}; the daemon stops now. "
                "`.venv/bin/python -m torchpulse.demo --keep` leaves it running."
            )
        return result.returncode
    finally:
        if not args.keep:
            daemon.terminate()
            daemon.wait(10)
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
