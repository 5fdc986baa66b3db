"""Clients of the agent socket other than agents: `status` requests in crowds or never read, the
metrics address a daemon is given, and the lines `torchpulse ctl` prints.

Real daemon processes, real sockets, a real training job under `torchpulse run`; measured from
/proc and from the clients' side.
"""

from __future__ import annotations

import contextlib
import resource
import shlex
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import REPO, DaemonProcess, read_daemon_frame, select, start_daemon, wait_for
from torchpulse import cli
from torchpulse.daemon.client import request_status
from torchpulse.daemon.config import ConfigError, parse_listen
from torchpulse.protocol import (
    ErrorReply,
    Hello,
    StatusReply,
    StatusRequest,
    Welcome,
    encode,
)

RUNS, RANKS = 500, 8  # 4,000 crashed ranks, kept for the lost grace period: `status` lists them all
HOST = "node-" + "x" * 190  # a long host name: a reply of about 1.2 MB


def _populate(daemon: DaemonProcess, runs: int = RUNS) -> None:
    """Ranks that said hello and went without a goodbye: the daemon remembers each one."""
    for run in range(runs):
        for rank in range(RANKS):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(10)
                sock.connect(str(daemon.socket_path))
                sock.sendall(
                    encode(
                        Hello(
                            f"run-{run:04d}",
                            rank,
                            rank,
                            RANKS,
                            100_000 + rank,
                            HOST,
                            "2.13.0",
                            "0.1.0",
                            "train.py",
                            1.0,
                        )
                    )
                )
                sock.recv(4096)  # Welcome
    wait_for(lambda: runs == len(request_status(daemon.socket_path).runs), timeout=30)


def _hello(daemon: DaemonProcess, run: str, rank: int = 0) -> tuple[float, object, socket.socket]:
    """Seconds from connecting to the daemon's answer to a hello, the answer, and the agent's connection."""
    start = time.perf_counter()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    while True:
        try:
            sock.connect(str(daemon.socket_path))
            break
        except BlockingIOError:
            # A Unix socket's connect() with a timeout fails at once with EAGAIN while the listen backlog
            # is full (the daemon still accepting a burst of clients): part of the wait, so retried.
            if time.perf_counter() - start > 30:
                raise
            time.sleep(0.005)
    sock.sendall(encode(Hello(run, rank, rank, 1, 4242, "h", "2.13.0", "0.1.0", "train.py", 2.0)))
    answer = read_daemon_frame(sock)
    return time.perf_counter() - start, answer, sock


def _status_clients(daemon: DaemonProcess, count: int) -> list[socket.socket]:
    """Connections that send StatusRequest and never read the reply."""
    clients = []
    for _ in range(count):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(str(daemon.socket_path))
        sock.sendall(encode(StatusRequest()))
        clients.append(sock)
    return clients


@pytest.fixture(scope="module")
def known(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """A daemon that knows 4,000 ranks."""
    daemon = start_daemon(tmp_path_factory.mktemp("known"))
    try:
        _populate(daemon)
        yield daemon
    finally:
        daemon.stop()


def test_status_clients_that_never_read_neither_hold_up_agents_nor_hold_a_reply_each(known: DaemonProcess) -> None:
    """300 connections send StatusRequest (a 1.2 MB reply) and never read. Each reply was built on the
    loop in turn (a hello waited seconds for its welcome) and each connection held its own copy until the
    write timeout (300 MB). Now they share a build and the reply, and each holds a chunk of it at most."""
    before = known.rss_mib()
    clients = _status_clients(known, 300)
    try:
        worst_hello, peak = 0.0, before
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            seconds, answer, agent = _hello(known, "newcomer")
            agent.close()
            assert isinstance(answer, Welcome), answer
            worst_hello, peak = max(worst_hello, seconds), max(peak, known.rss_mib())
            time.sleep(0.1)
        # Another `torchpulse status` meanwhile gets the whole reply.
        assert RUNS + 1 == len(request_status(known.socket_path, timeout=30).runs)
    finally:
        for sock in clients:
            sock.close()
    assert (True, True) == (worst_hello < 0.5, peak - before < 120), (worst_hello, peak - before)


def test_status_requests_that_arrive_together_share_one_build(known: DaemonProcess) -> None:
    """Forty clients ask at once (a crowd of `torchpulse status`, a monitoring loop on every node): the
    replies were forty builds, one after another on the loop. Now a build serves every request read
    before it starts: a handful of distinct replies (uptime tells builds apart), each whole."""
    clients = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(40)]
    try:
        for sock in clients:
            sock.settimeout(30)
            sock.connect(str(known.socket_path))
        for sock in clients:
            sock.sendall(encode(StatusRequest()))
        replies = [read_daemon_frame(sock) for sock in clients]
    finally:
        for sock in clients:
            sock.close()
    assert all(isinstance(r, StatusReply) and len(r.runs) >= RUNS for r in replies)
    builds = {r.uptime_seconds for r in replies if isinstance(r, StatusReply)}
    assert len(builds) <= 10, len(builds)


def _received(sock: socket.socket) -> int:
    """Bytes the daemon sent on `sock` until it closed it."""
    sock.settimeout(10)
    total = 0
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(1 << 16):
            total += len(chunk)
    return total


def test_past_the_budget_the_status_client_stuck_the_longest_is_cut_off(known: DaemonProcess) -> None:
    """Seventy clients ask one after another, each for a reply built anew (1.2 MB: 84 MB in all), and read
    nothing. The replies were held until the write timeout; now past 64 MiB the oldest connections are cut
    off (their replies end early), and the newest still gets its reply whole."""
    whole = len(encode(request_status(known.socket_path, timeout=30)))
    clients: list[socket.socket] = []
    try:
        for _ in range(70):
            [sock] = _status_clients(known, 1)
            clients.append(sock)
            # A request read while a build is pending shares that build, and a shared body counts once against
            # the budget. A sleep "longer than two builds" let builds be shared where a loaded machine built
            # slowly; once this client's reply has started (its build ran), the next request gets a build of
            # its own, however long builds take.
            sock.settimeout(30)
            assert sock.recv(1, socket.MSG_PEEK), "the daemon closed the connection without a reply"
        first, last = _received(clients[0]), _received(clients[-1])
    finally:
        for sock in clients:
            sock.close()
    assert (True, True) == (first < whole / 2, abs(last - whole) < 10_000), (first, last, whole)


def test_a_status_reply_shows_every_rank_welcomed_before_it_was_asked_for(known: DaemonProcess) -> None:
    """Builds are shared, never reused for a later request: while other clients ask all the time, a rank
    that got its welcome is in the next reply (a reply reused from before would leave it out)."""
    stop = threading.Event()

    def crowd() -> None:
        while not stop.is_set():
            request_status(known.socket_path, timeout=30)

    threads = [threading.Thread(target=crowd) for _ in range(2)]
    for thread in threads:
        thread.start()
    agents = []
    try:
        for rank in range(15):
            _seconds, answer, agent = _hello(known, "causal", rank)
            agents.append(agent)
            assert isinstance(answer, Welcome), answer
            reply = request_status(known.socket_path, timeout=30)
            assert [rank + 1] == [len(run.ranks) for run in reply.runs if run.run == "causal"]
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        for agent in agents:
            agent.close()


def _few_descriptors() -> None:
    # 200 descriptors: the daemon holds at most 72 connections (its limit less the reserve for files).
    resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200))


@pytest.mark.process
def test_at_the_connection_limit_a_stuck_status_client_gives_way_to_an_agent(tmp_path: Path) -> None:
    """Status clients that never read fill every connection slot: agents' hellos and `torchpulse status`
    were refused until the write timeout cut them off. Now the one stuck the longest gives way."""
    daemon = start_daemon(tmp_path, preexec=_few_descriptors)
    try:
        _populate(daemon, runs=250)  # a reply of 600 kB: more than the kernel takes for a client
        clients = _status_clients(daemon, 80)
        try:
            time.sleep(1.5)  # past STUCK_STATUS_SECONDS, well inside the write timeout
            _seconds, answer, agent = _hello(daemon, "arrives-late")
            agent.close()
            status = subprocess.run(
                [sys.executable, "-m", "torchpulse", "status", "--socket", str(daemon.socket_path)],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=60,
            )
        finally:
            for sock in clients:
                sock.close()
        assert (True, 0) == (isinstance(answer, Welcome), status.returncode), (answer, status.stderr)
        assert not isinstance(answer, ErrorReply)
    finally:
        daemon.stop()


@pytest.mark.process
@pytest.mark.parametrize(
    ("listen", "port"), [("127.0.0.1:99999", "99999"), ("127.0.0.1:65536", "65536"), ("127.0.0.1:-1", "-1")]
)
def test_a_metrics_port_out_of_range_is_refused_as_such(tmp_path: Path, listen: str, port: str) -> None:
    """`--listen 127.0.0.1:99999` said "expected HOST:PORT": the form is right, the number is not a port."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchpulse",
            "daemon",
            "--socket",
            str(tmp_path / "a.sock"),
            "--state-dir",
            str(tmp_path / "state"),
            "--listen",
            listen,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    expected = (
        f"torchpulse: invalid configuration: daemon.listen: port {port} in {listen!r} is out of range: "
        "a port is 1 to 65535 (0 picks a free one)"
    )
    assert (2, [expected]) == (result.returncode, result.stderr.strip().splitlines())


@pytest.mark.process
def test_a_port_out_of_range_in_the_config_file_is_refused_naming_the_file(tmp_path: Path) -> None:
    """The same words for `listen =` in the file, which the error names."""
    config = tmp_path / "tp.toml"
    config.write_text('[daemon]\nlisten = "0.0.0.0:65536"\n')
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchpulse",
            "daemon",
            "--config",
            str(config),
            "--socket",
            str(tmp_path / "a.sock"),
            "--state-dir",
            str(tmp_path / "state"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    expected = (
        f"torchpulse: invalid configuration: {config}: daemon.listen: port 65536 in '0.0.0.0:65536' is out "
        "of range: a port is 1 to 65535 (0 picks a free one)"
    )
    assert (2, [expected]) == (result.returncode, result.stderr.strip().splitlines())


def test_ports_at_the_ends_of_the_range_are_taken_and_a_port_of_5000_digits_is_refused() -> None:
    """0 (a free port, as tests use) and 65535 are ports; 5,000 digits failed with int()'s ValueError
    (a traceback on the command line) instead of a configuration error."""
    assert [("127.0.0.1", 0), ("::1", 65535)] == [parse_listen("127.0.0.1:0"), parse_listen("[::1]:65535")]
    with pytest.raises(ConfigError, match="is out of range"):
        parse_listen("127.0.0.1:" + "9" * 5000)


# A small loop stepping ~100 times a second.
JOB = """
import time, torch
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
while True:
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    time.sleep(0.01)
"""


@pytest.mark.process
def test_every_ctl_command_prints_one_clean_line_per_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A real job under `torchpulse run`: each command's line says what happened once, in words ("ok  ok
    changed=False" before), and the rest is key=value fields that shlex reads whole."""
    daemon = start_daemon(tmp_path)
    script = tmp_path / "job.py"
    script.write_text(JOB)
    job = subprocess.Popen(
        [sys.executable, "-m", "torchpulse", "run", "--run-name", "tiny", "--", sys.executable, str(script)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=daemon.env(OMP_NUM_THREADS="1", TORCHPULSE_PROBES="optimizer"),
    )
    try:
        wait_for(lambda: 1 == sum(select(daemon.scrape(), "torchpulse_agent_up", run="tiny").values()), timeout=60)

        def ctl(*args: str) -> str:
            cli.main(
                ["ctl", *args, "--run", "tiny", "--rank", "0", "--socket", str(daemon.socket_path), "--timeout", "30"]
            )
            return capsys.readouterr().out.rstrip("\n")

        head = "rank   0  ok            "
        assert [
            head + "autograd enabled",
            head + "autograd was already enabled",
            head + "timing the nodes of every pass",
            head + "logging every autograd node of the next 2 passes",
        ] == [
            ctl("enable", "autograd"),
            ctl("enable", "autograd"),
            ctl("sample", "autograd", "1"),
            ctl("autograd-log", "2"),
        ]
        wait_for(lambda: "autograd_slowest=" in ctl("status"), timeout=30)
        status = ctl("status")
        fields = dict(word.split("=", 1) for word in shlex.split(status.removeprefix(head)))
        assert (True, ["step", "step_rate", "probes"]) == (status.startswith(head + "step="), list(fields)[:3])
        assert "ms, " in fields["autograd_slowest"]  # five nodes and their times, in one field
        assert [
            head + "node timing off",
            head + "autograd disabled",
            head + "autograd was already disabled",
            "rank   0  failed        the cudagraphs probe is not enabled",
        ] == [
            ctl("sample", "autograd", "0"),
            ctl("disable", "autograd"),
            ctl("disable", "autograd"),
            ctl("cudagraph-dump"),
        ]
        trace = ctl("trace", "--steps", "1", "--out", str(tmp_path / "tr"))
        assert trace.startswith(head + "trace written  first_step="), trace
    finally:
        job.kill()
        job.wait(30)
        daemon.stop()
