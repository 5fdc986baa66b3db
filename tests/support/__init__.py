"""Helpers for tests that run real processes: daemon, training jobs, scrapes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from filelock import FileLock
from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from torchpulse.protocol import HistogramSample

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable


def built_once(base: Path, name: str, build: Callable[[Path], None]) -> Path:
    """`base/name`, made by `build` once per test run: the first of the parallel runner's workers to ask builds
    it under a file lock while the others wait, then all read it. `base` is the run's shared temporary directory
    (see tests/conftest.py's `run_tmp`). A build that failed is tried again by the next to ask."""
    path, done = base / name, base / f"{name}.done"
    with FileLock(base / f"{name}.lock"):
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)
            build(path)
            done.touch()
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(predicate: Callable[[], bool], timeout: float = 20.0, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise TimeoutError(f"condition not met within {timeout}s")


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_exposition(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def select(samples: Samples, name: str, **labels: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Samples of `name` whose labels include `labels`."""
    return {
        key: value
        for (sample_name, key), value in samples.items()
        if sample_name == name and all(dict(key).get(k) == v for k, v in labels.items())
    }


@dataclass
class DaemonProcess:
    socket_path: Path
    port: int
    state_dir: Path
    log_path: Path
    proc: subprocess.Popen[bytes]
    extra_args: list[str] = field(default_factory=list)

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    def rss_mib(self) -> float:
        """The daemon's resident memory now, in MiB."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def descriptors(self) -> int:
        """How many descriptors the daemon holds open now."""
        return sum(1 for _ in Path(f"/proc/{self.proc.pid}/fd").iterdir())

    def settled_descriptors(self, quiet: float = 1.0) -> int:
        """The daemon's descriptor count once it has not changed for `quiet` seconds.

        The daemon closes its side of a connection its client is done with (a status reply read, a scrape
        answered, an agent gone) a loop pass or more later, much later on a loaded machine: a count read at
        once can include it. Such a baseline never sees `baseline + 5` with five new connections (the closing
        one goes), and `<= baseline` would pass with one of them still open.
        """
        changes: list[tuple[float, int]] = []  # (since when, count)

        def settled() -> bool:
            now, count = time.monotonic(), self.descriptors()
            if not changes or changes[-1][1] != count:
                changes.append((now, count))
            return now - changes[-1][0] >= quiet

        wait_for(settled, timeout=20)
        return changes[-1][1]

    def last_frame_after(self, run: str, rank: int = 0) -> float | None:
        """A time (time.monotonic(): one clock for every process) before which the daemon's last frame from
        `rank` of `run` did not arrive; None while the daemon has no such rank."""
        from torchpulse.daemon.client import request_status

        asked = time.monotonic()  # before the daemon's own "now": the bound errs early, never late
        for state in request_status(self.socket_path).runs:
            for rank_status in state.ranks:
                if state.run == run and rank_status.rank == rank:
                    # last_seen_seconds_ago is rounded to the millisecond: a margin of one keeps the bound sound.
                    return asked - rank_status.last_seen_seconds_ago - 0.001
        return None

    def scrape_text(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            return str(response.read().decode())

    def scrape(self) -> Samples:
        return parse_exposition(self.scrape_text())

    def log_lines(self) -> list[dict[str, object]]:
        lines = []
        for line in self.log_path.read_text().splitlines():
            try:
                lines.append(json.loads(line))
            except ValueError:
                continue
        return lines

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env["TORCHPULSE_SOCKET"] = str(self.socket_path)
        env["PYTHONPATH"] = str(REPO)
        env.update(extra)
        return env

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return int(self.proc.returncode)

    def restart(self) -> DaemonProcess:
        """Start a new daemon process on the same socket, port and state."""
        return start_daemon(self.state_dir.parent, self.socket_path, self.port, self.extra_args)


def sigint_as_at_a_terminal() -> None:
    """`preexec_fn` for a child that a test sends SIGINT as Ctrl-C: a test suite started in the background
    by a non-interactive shell (`make test &`, some CI runners) has SIGINT ignored, every child inherits
    that, and Python then installs no KeyboardInterrupt handler: the signal would do nothing at all."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def child_of(pid: int, arg: bytes | None = None, timeout: float = 20.0) -> int:
    """The pid of a process whose parent is `pid` and, given `arg`, whose command line has that argument (a
    child forked but not yet exec'd still has its parent's)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat, argv = (entry / "stat").read_text(), (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:  # gone meanwhile
                continue
            # The field after "(comm) state" is the ppid.
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and (arg is None or arg in argv):
                return int(entry.name)
        time.sleep(0.005)
    raise AssertionError(
        f"process {pid} started no child{'' if arg is None else f' with argument {arg!r}'} within {timeout} s"
    )


def reload_config(daemon: DaemonProcess, config: Path, text: str, event: str = "config reloaded") -> None:
    """Rewrite the daemon's config file, send SIGHUP, and wait for the daemon to log `event`."""
    config.write_text(text)
    daemon.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: any(e.get("event") == event for e in daemon.log_lines()))


def start_daemon(
    tmp: Path,
    socket_path: Path | None = None,
    port: int | None = None,
    extra_args: list[str] | None = None,
    env: Mapping[str, str] | None = None,
    preexec: Callable[[], None] | None = None,
) -> DaemonProcess:
    socket_path = socket_path or tmp / "agent.sock"
    port = port or free_port()
    state_dir = tmp / "state"
    log_path = tmp / f"daemon-{time.monotonic_ns()}.log"
    args = [
        PYTHON,
        "-m",
        "torchpulse",
        "daemon",
        "--socket",
        str(socket_path),
        "--listen",
        f"127.0.0.1:{port}",
        "--state-dir",
        str(state_dir),
        *(extra_args or []),
    ]
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            args,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=dict(env) if env is not None else None,
            preexec_fn=preexec,
        )
    daemon = DaemonProcess(socket_path, port, state_dir, log_path, proc, list(extra_args or []))

    def ready() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode}: {log_path.read_text()}")
        try:
            daemon.scrape_text()
        except OSError:
            return False
        return socket_path.exists()

    wait_for(ready, timeout=30)
    return daemon


def local_agent(probes: tuple[str, ...] = (), **config: object) -> object:
    """A real Agent whose probes are installed but whose sender never starts.

    Tests call `agent.drain()` and read `agent.store` directly; call
    `agent.shutdown()` at the end to uninstall the probes.
    """
    from torchpulse.probes.agent.agent import Agent
    from torchpulse.probes.agent.config import AgentConfig
    from torchpulse.probes.agent.identity import current_identity
    from torchpulse.probes.families import FAMILY_TABLE

    agent = Agent(
        AgentConfig(socket_path=Path("/nonexistent/torchpulse.sock"), probes=probes, **config),  # type: ignore[arg-type]
        current_identity(),
        FAMILY_TABLE,
    )
    for name in probes:
        probe = FAMILY_TABLE.make(name, agent)
        assert probe is not None, name
        probe.install()
        agent.probes[name] = probe
    agent.control.install()
    return agent


def series(agent: Any, family: str, *leading: str) -> dict[tuple[str, ...], float]:
    """Every series of counter or gauge `family` in `agent`'s store, by its label values, read from the store's
    public snapshot; with `leading`, only those whose labels begin with these values (an optimizer's, say).

    What the store holds now: call `agent.drain()` first for what the probes recorded since.
    """
    _require_kind(family, "counter", "gauge")
    samples, _ = agent.store.snapshot()
    return {s.labels: s.value for s in samples if s.family == family and s.labels[: len(leading)] == leading}


def histogram_series(agent: Any, family: str) -> dict[tuple[str, ...], HistogramSample]:
    """Every series of histogram `family` in `agent`'s store (bucket counts and sum), by its label values."""
    _require_kind(family, "histogram")
    _, found = agent.store.snapshot()
    return {h.labels: h for h in found if h.family == family}


def _require_kind(family: str, *kinds: str) -> None:
    """Fail unless `family` is in the catalog and of one of `kinds`: a misspelt name would read as no series."""
    from torchpulse.catalog import CATALOG

    assert family in CATALOG and CATALOG[family].kind in kinds, f"{family} is no catalog family of kind {kinds}"


# Debian packages of the external tools tests use; CI installs them (see .ci/run and the README).
TOOL_PACKAGES = {"promtool": "prometheus", "prometheus": "prometheus"}


def as_user(call: Callable[[], tuple[int, bytes]], uid: int, groups: list[int] | None = None) -> tuple[int, bytes]:
    """`call()` in a forked child that dropped to `uid` (with supplementary `groups`, else none): the exit
    code and bytes it returned (99 and the exception's repr if it raised). Forked, not exec'd: the venv's
    python is not executable by other users here. Needs root."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 99
        try:
            os.close(read_end)
            os.setgroups(groups or [])
            os.setgid(uid)
            os.setuid(uid)
            code, out = call()
            os.write(write_end, out)
        except BaseException as exc:
            os.write(write_end, f"child failed: {exc!r}".encode())
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        out = pipe.read()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), out


def require_tool(name: str) -> str:
    """A tool's path; skip without it, but fail when $CI is set (CI must provide it)."""
    import shutil

    import pytest

    path = shutil.which(name)
    if path is not None:
        return path
    reason = f"{name} is not installed (Debian package: {TOOL_PACKAGES.get(name, 'systemd')})"
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must provide it")
    pytest.skip(reason)


def send_raw(socket_path: Path, data: bytes, close_write: bool = True) -> bytes:
    """Write raw bytes to the agent socket and return everything the daemon answers until it closes."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(socket_path))
        sock.sendall(data)
        if close_write:
            sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def rejected_frames(daemon: DaemonProcess) -> dict[str, float]:
    """Non-zero `torchpulse_daemon_frames_rejected_total` by reason."""
    samples = select(daemon.scrape(), "torchpulse_daemon_frames_rejected_total")
    return {dict(k)["reason"]: v for k, v in samples.items() if v}


def run_job(source: str, tmp_path: Path, run: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """`torchpulse run --run-name RUN -- python job.py ARGS` for a job script with `source`."""
    script = tmp_path / "job.py"
    script.write_text(source)
    return subprocess.run(
        [sys.executable, "-m", "torchpulse", "run", "--run-name", run, "--", sys.executable, str(script), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def run_inline_ranks(source: str, tmp: Path, timeout: float, world: int = 2) -> list[tuple[str, str, int]]:
    """`python -c SOURCE RANK TMP/store TMP` for each rank, with RANK and WORLD_SIZE set as torchrun sets
    them; (stdout, stderr, exit status) of each, in rank order."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", source, str(r), str(tmp / "store"), str(tmp)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(world)},
        )
        for r in range(world)
    ]
    outputs = [p.communicate(timeout=timeout) for p in procs]
    return [(out, err, p.returncode) for (out, err), p in zip(outputs, procs, strict=True)]


def read_daemon_frame(sock: socket.socket) -> object:
    """One whole frame from the daemon on a raw agent connection, decoded; fails if the daemon hangs up."""
    from torchpulse.protocol import HEADER, HEADER_SIZE, decode_daemon_frame

    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            assert chunk, "the daemon closed the connection"
            data += chunk
        return data

    _magic, _version, _reserved, length = HEADER.unpack(exactly(HEADER_SIZE))
    return decode_daemon_frame(exactly(length))
