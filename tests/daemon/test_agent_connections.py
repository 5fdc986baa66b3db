"""Who speaks for a rank, and how many may: takeovers, command answers, connection and buffer caps."""

from __future__ import annotations

import asyncio
import math
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import REPO, DaemonProcess, read_daemon_frame, rejected_frames, select, start_daemon, wait_for
from torchpulse.daemon import frames as frames_module
from torchpulse.daemon import server as server_module
from torchpulse.daemon.client import request_status, send_ctl
from torchpulse.daemon.connections import ConnectionTable
from torchpulse.daemon.control import ControlHub
from torchpulse.daemon.peercred import Peer
from torchpulse.daemon.registry import Registry
from torchpulse.daemon.server import AgentServer
from torchpulse.protocol import (
    HEADER,
    Batch,
    Command,
    CommandResult,
    CtlReply,
    CtlRequest,
    ErrorReply,
    Goodbye,
    Hello,
    LogEvent,
    Sample,
    StatusReply,
    Welcome,
    encode,
)


def _hello(run: str, rank: int, pid: int = 4242) -> Hello:
    return Hello(run, rank, 0, 1, pid, "h", "2.13.0", "0.1.0", "test", 0.0)


def _connect(path: Path, hello: Hello) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    deadline = time.monotonic() + 10
    while True:
        try:
            sock.connect(str(path))
            break
        except BlockingIOError:
            # A Unix socket's connect() with a timeout fails at once with EAGAIN while the listen
            # backlog is full (a loaded machine, a daemon still accepting the earlier ones of a flood).
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
    sock.sendall(encode(hello))
    return sock


def _connected(daemon: DaemonProcess, run: str) -> list[int]:
    return sorted(
        r.rank for s in request_status(daemon.socket_path).runs if s.run == run for r in s.ranks if r.connected
    )


class Ctl(threading.Thread):
    """`torchpulse ctl` in the background, while the test plays the agents."""

    def __init__(self, daemon: DaemonProcess, request: CtlRequest) -> None:
        super().__init__(daemon=True)
        self.daemon_process, self.request = daemon, request
        self.reply: CtlReply | None = None

    def run(self) -> None:
        self.reply = send_ctl(self.daemon_process.socket_path, self.request, timeout=20)


def test_a_log_field_named_self_is_logged_and_the_batch_kept(daemon: DaemonProcess) -> None:
    """Field names are the agent's: one that clashes with the logger's parameters costs nothing."""
    events = [
        LogEvent(0.0, "info", f"odd.{n}", fields)
        for n, fields in enumerate([{"a": 1}, {"self": "x", "event": "y"}, {"b": 2}])
    ]
    with _connect(daemon.socket_path, _hello("fields", 0, os.getpid())) as sock:
        read_daemon_frame(sock)
        sock.sendall(encode(Batch(1, 0.0, [Sample("optimizer_steps_total", ("SGD#0",), 3.0)], [], events)))
        wait_for(lambda: {"odd.0", "odd.1", "odd.2"} <= {str(e.get("event")) for e in daemon.log_lines()})
        assert (
            3.0
            == select(daemon.scrape(), "torchpulse_optimizer_steps_total", run="fields")[
                (("optimizer", "SGD#0"), ("rank", "0"), ("run", "fields"))
            ]
        )
    logged = next(e for e in daemon.log_lines() if e.get("event") == "odd.1")
    assert ("x", "y") == (logged["field_self"], logged["field_event"])
    assert {} == rejected_frames(daemon)


def test_a_reconnect_takes_the_rank_over_and_the_old_connection_goes_quiet(daemon: DaemonProcess) -> None:
    """A second hello of the same process for a rank owns it; the old socket is closed by the daemon, its
    late frames change nothing, and its close does not mark the rank gone. Another process claiming the
    rank meanwhile is refused; once the rank's connection closes, it may have it."""
    old = _connect(daemon.socket_path, _hello("takeover", 0))
    read_daemon_frame(old)
    old.sendall(encode(Batch(1, 0.0, [Sample("optimizer_steps_total", ("SGD#0",), 5.0)], [], [])))
    wait_for(lambda: bool(select(daemon.scrape(), "torchpulse_optimizer_steps_total", run="takeover")))
    new = _connect(daemon.socket_path, _hello("takeover", 0))
    read_daemon_frame(new)
    new.sendall(encode(Batch(1, 0.0, [Sample("optimizer_steps_total", ("SGD#0",), 9.0)], [], [])))
    assert b"" == old.recv(1024)  # closed by the daemon at the takeover
    with pytest.raises(OSError):  # the first late frame may still fit in the socket buffer
        old.sendall(encode(Batch(2, 0.0, [Sample("optimizer_steps_total", ("SGD#0",), 1.0)], [], [])))
        old.sendall(b"x" * 65536)
    old.close()

    def steps() -> float:
        return select(daemon.scrape(), "torchpulse_optimizer_steps_total", run="takeover")[
            (("optimizer", "SGD#0"), ("rank", "0"), ("run", "takeover"))
        ]

    wait_for(lambda: 9.0 == steps())
    assert [0] == _connected(daemon, "takeover")
    assert 1.0 == select(daemon.scrape(), "torchpulse_agent_up", run="takeover")[(("rank", "0"), ("run", "takeover"))]
    # Another process while the one that opened the rank's connection runs (this one): refused, nothing
    # of the rank changes. Taking turns, the two would overwrite each other's totals.
    other = _connect(daemon.socket_path, _hello("takeover", 0, pid=4343))
    refusal = read_daemon_frame(other)
    assert isinstance(refusal, ErrorReply) and "rank_taken" == refusal.code, refusal
    assert "held by pid 4242" in refusal.message
    other.close()
    # The daemon counted the refusal before sending it, but a scrape may be served the render of the one
    # above: the exporter reuses a render younger than the time it took.
    wait_for(lambda: "rank_taken" in rejected_frames(daemon))
    assert {"rank_taken": 1.0} == rejected_frames(daemon)
    assert 9.0 == steps()
    # Once that connection closed, a restarted process (new pid) has the rank, and its run counts only
    # its own series.
    new.close()
    wait_for(lambda: [] == _connected(daemon, "takeover"))
    newer = _connect(daemon.socket_path, _hello("takeover", 0, pid=4343))
    assert isinstance(read_daemon_frame(newer), Welcome)
    newer.sendall(encode(Batch(1, 0.0, [Sample("optimizer_steps_total", ("SGD#0",), 2.0)], [], [])))
    wait_for(lambda: 2.0 == steps())
    assert [0] == _connected(daemon, "takeover")
    assert 1.0 == select(daemon.scrape(), "torchpulse_run_series", run="takeover")[(("run", "takeover"),)]
    newer.close()


ORPHANED_CONNECTION = """
import os, socket, sys, time
from torchpulse.protocol import Hello, encode
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(sys.argv[1])
sock.sendall(encode(Hello("orphaned", 0, 0, 1, os.getpid(), "h", "2.13.0", "0.1.0", "crashed", 0.0)))
sock.recv(65536)  # the welcome
child = os.fork()
if child == 0:  # a forked worker inherits the socket and outlives the rank
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    time.sleep(120)
    os._exit(0)
print(os.getpid(), child, flush=True)
"""


def test_a_restarted_rank_takes_over_a_connection_that_only_a_forked_child_of_the_dead_one_holds(
    daemon: DaemonProcess,
) -> None:
    """The rank that opened the connection died, but a forked child (a DataLoader worker) keeps the socket
    open: the daemon still sees a connection. The process behind it (SO_PEERCRED) is gone, so the restarted
    rank is no second claimant: it takes the rank over at once."""
    crashed = subprocess.run(
        [sys.executable, "-c", ORPHANED_CONNECTION, str(daemon.socket_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    dead_pid, orphan = map(int, crashed.stdout.split())
    try:
        assert [0] == _connected(daemon, "orphaned")
        with _connect(daemon.socket_path, _hello("orphaned", 0, pid=dead_pid + 1)) as restarted:
            assert isinstance(read_daemon_frame(restarted), Welcome)
            assert [0] == _connected(daemon, "orphaned")
            assert {} == rejected_frames(daemon)
    finally:
        os.kill(orphan, 9)


def test_a_rank_given_up_with_a_goodbye_goes_to_another_process_while_its_connection_lingers(
    daemon: DaemonProcess,
) -> None:
    """A goodbye gives the rank up (an agent that learnt another rank from torch.distributed, a detach),
    though its connection may outlive it: a forked child holding the socket, a close not read yet. Then
    another process claiming the rank is no second claimant: it takes the rank over, not rank_taken."""
    with _connect(daemon.socket_path, _hello("given-up", 0, os.getpid())) as leaving:
        assert isinstance(read_daemon_frame(leaving), Welcome)
        leaving.sendall(encode(Goodbye("identity")))
        wait_for(
            lambda: (
                [(0, True)]
                == [
                    (r.rank, r.exited)
                    for s in request_status(daemon.socket_path).runs
                    if s.run == "given-up"
                    for r in s.ranks
                ]
            )
        )
        with _connect(daemon.socket_path, _hello("given-up", 0, pid=4343)) as taker:
            assert isinstance(read_daemon_frame(taker), Welcome)
            assert b"" == leaving.recv(1024)  # closed by the daemon at the takeover
            assert [(0, 4343, True, False)] == [
                (r.rank, r.pid, r.connected, r.exited)
                for s in request_status(daemon.socket_path).runs
                if s.run == "given-up"
                for r in s.ranks
            ]
    assert {} == rejected_frames(daemon)


def test_command_answers_count_only_from_the_rank_they_were_sent_to(daemon: DaemonProcess) -> None:
    """Another run's agent guessing the command id cannot answer for the victim; an inf step counter
    from the victim is refused (the last good total plans the trace)."""
    victim = _connect(daemon.socket_path, _hello("victim", 0))
    other = _connect(daemon.socket_path, _hello("other", 0))
    read_daemon_frame(victim)
    read_daemon_frame(other)
    victim.sendall(encode(Batch(1, 0.0, [Sample("optimizer_steps_total", ("SGD#0",), 5.0)], [], [])))
    victim.sendall(encode(Batch(2, 0.0, [Sample("optimizer_steps_total", ("SGD#0",), math.inf)], [], [])))
    wait_for(
        lambda: (
            1.0 == select(daemon.scrape(), "torchpulse_daemon_series_rejected_total").get((("reason", "bad_value"),))
        )
    )
    assert [5.0] == list(select(daemon.scrape(), "torchpulse_optimizer_steps_total", run="victim").values())
    for name in ("status", "trace"):
        ctl = Ctl(daemon, CtlRequest("victim", None, name, {}, 10.0))
        ctl.start()
        command = read_daemon_frame(victim)
        assert isinstance(command, Command)
        if name == "trace":  # the daemon first asks the rank for its step counter, to plan the start
            assert "status" == command.name
            victim.sendall(encode(CommandResult(command.id, True, "ok", {})))
            command = read_daemon_frame(victim)
            assert isinstance(command, Command)
            start = command.args["start_step"]
            assert isinstance(start, int) and 5 < start < 2**53  # the last good total, not inf, plus a lead
        for guess in range(command.id - 2, command.id + 3):
            other.sendall(encode(CommandResult(guess, True, "spoofed", {})))
        victim.sendall(encode(CommandResult(command.id, True, "real", {})))
        ctl.join(20)
        assert ctl.reply is not None
        assert [("ok", "real")] == [(r.status, r.message) for r in ctl.reply.results], name
    victim.close()
    other.close()


@pytest.fixture
def low_fd_daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (300, 300))

    daemon = start_daemon(tmp_path, preexec=limit)
    yield daemon
    daemon.stop()


@pytest.mark.process
def test_a_flood_of_agents_stops_below_the_descriptor_limit_and_status_still_answers(
    low_fd_daemon: DaemonProcess,
) -> None:
    """300 descriptors: 172 connections at most, 140 of them agents; further hellos are refused with a
    reason, and `torchpulse status` and scrapes keep working."""
    limit = 300 - server_module.FD_RESERVE - server_module.CLIENT_RESERVE
    socks = [_connect(low_fd_daemon.socket_path, _hello("flood", rank, pid=10_000 + rank)) for rank in range(limit + 5)]
    try:
        replies = [type(read_daemon_frame(sock)).__name__ for sock in socks]
        assert {"Welcome": limit, "ErrorReply": 5} == {name: replies.count(name) for name in set(replies)}
        # Counted before each refusal was sent, but a scrape may be served an earlier render (the exporter
        # reuses one younger than the time it took): the one of the daemon's readiness check, say.
        wait_for(lambda: 5 <= sum(rejected_frames(low_fd_daemon).values()))
        assert {"too_many_connections": 5} == rejected_frames(low_fd_daemon)
        status = request_status(low_fd_daemon.socket_path)
        assert isinstance(status, StatusReply)
        assert limit == len(_connected(low_fd_daemon, "flood"))
    finally:
        for sock in socks:
            sock.close()
    wait_for(lambda: 0.0 == select(low_fd_daemon.scrape(), "torchpulse_daemon_connections")[()])
    assert low_fd_daemon.proc.poll() is None


def test_a_silent_agent_is_dropped_and_parked_large_frames_share_one_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-process server, real sockets: an agent silent past the idle timeout is disconnected; three
    peers parking half-sent 600 KiB frames never hold more than the budget, and an agent's small
    batches pass meanwhile."""
    monkeypatch.setattr(server_module, "AGENT_IDLE_TIMEOUT", 0.5)
    monkeypatch.setattr(frames_module, "MAX_BUFFERED_BYTES", 1 << 20)
    path = tmp_path / "agent.sock"

    async def main() -> None:
        registry = Registry()
        links = ConnectionTable()
        status = StatusReply("x", 0.0, 0, 0, {}, [])
        agents = AgentServer(registry, links, lambda: status, ControlHub(registry, links, lambda: ""))
        await agents.start(path)
        most = 0

        async def watch() -> None:
            nonlocal most
            while True:
                most = max(most, agents._frames._buffered)
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())
        try:
            quiet_reader, quiet = await asyncio.open_unix_connection(str(path))
            quiet.write(encode(_hello("quiet", 0)))
            parked = []
            for rank in range(3):
                reader, writer = await asyncio.open_unix_connection(str(path))
                writer.write(encode(_hello("parked", rank)))
                writer.write(HEADER.pack(b"TP", 1, 0, 600 << 10) + b"x" * (300 << 10))
                parked.append((reader, writer))
            _busy_reader, busy = await asyncio.open_unix_connection(str(path))
            busy.write(encode(_hello("busy", 0)))
            for seq in range(5):
                busy.write(encode(Batch(seq, 0.0, [Sample("optimizer_steps_total", ("SGD#0",), float(seq))], [], [])))
                await asyncio.sleep(0.05)
            state = registry.runs["busy"].ranks[0]
            assert 4.0 == state.values[("optimizer_steps_total", ("SGD#0",))]
            await asyncio.sleep(0.6)
            assert b"idle" in await asyncio.wait_for(quiet_reader.read(), 5)
            assert not registry.runs["quiet"].ranks[0].connected
            for _reader, writer in parked:
                writer.close()
            busy.close()
        finally:
            watcher.cancel()
            await agents.close()
        assert 600 << 10 == most  # one parked frame at a time: two would be 1.2 MiB

    asyncio.run(main())


@pytest.mark.process
def test_a_rank_that_exits_normally_is_exited_not_down_and_is_forgotten_while_its_run_goes_on(tmp_path: Path) -> None:
    """Goodbye tells a normal exit from a crash: agent_exited 1 and `status` says exited; a SIGKILLed
    rank stays agent_exited 0 (TorchpulseAgentDown's case). After the grace period only the exited
    rank is forgotten: its run still has a connected rank (an elastic job scaled down)."""
    config = tmp_path / "tp.toml"
    # Long enough for the checks below to run before rank 1 is forgotten on a loaded machine.
    config.write_text("[runs]\ngrace_period_seconds = 12\n")
    daemon = start_daemon(tmp_path, extra_args=["--config", str(config)])
    killed: subprocess.Popen[bytes] | None = None
    try:
        with _connect(daemon.socket_path, _hello("elastic", 0, os.getpid())) as staying:
            read_daemon_frame(staying)

            def job(rank: int, steps: int) -> subprocess.Popen[bytes]:
                return subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "torchpulse",
                        "run",
                        "--run-name",
                        "elastic",
                        "--",
                        sys.executable,
                        "-m",
                        "torchpulse.demo_job",
                        "--steps",
                        str(steps),
                        "--step-sleep",
                        "0.01",
                    ],
                    cwd=REPO,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    env=daemon.env(RANK=str(rank), WORLD_SIZE="3", OMP_NUM_THREADS="1", TORCHPULSE_PROBES="optimizer"),
                )

            killed = job(2, 100_000)
            # Rank 2 up first: its start (a torch import) must not eat into rank 1's grace period.
            wait_for(lambda: [0, 2] == _connected(daemon, "elastic"), timeout=60)
            assert 0 == job(1, 5).wait(120)
            killed.kill()
            killed.wait(30)
            wait_for(lambda: [0] == _connected(daemon, "elastic"), timeout=30)

            def of(name: str) -> dict[str, float]:
                return {dict(k)["rank"]: v for k, v in select(daemon.scrape(), name, run="elastic").items()}

            assert {"0": 1.0, "1": 0.0, "2": 0.0} == of("torchpulse_agent_up")
            assert {"0": 0.0, "1": 1.0, "2": 0.0} == of("torchpulse_agent_exited")
            (run,) = [r for r in request_status(daemon.socket_path).runs if r.run == "elastic"]
            assert {1: True, 2: False} == {r.rank: r.exited for r in run.ranks if not r.connected}
            status = subprocess.run(
                [sys.executable, "-m", "torchpulse", "status", "--socket", str(daemon.socket_path)],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=60,
                env=daemon.env(),
            )
            states = {
                line.split()[0]: line.split()[1] for line in status.stdout.splitlines() if line.strip()[:1].isdigit()
            }
            assert ("connected", "exited", "gone") == (states["0"], states["1"], states["2"]), status.stdout

            wait_for(lambda: {"0", "2"} == set(of("torchpulse_agent_up")), timeout=30)
            assert any(
                e.get("event") == "exited rank forgotten after its grace period; its run goes on" and e.get("rank") == 1
                for e in daemon.log_lines()
            )
            assert 0.0 == of("torchpulse_agent_up")["2"], "a rank that vanished without goodbye stays down"
            assert not select(daemon.scrape(), "torchpulse_optimizer_steps_total", run="elastic", rank="1")
    finally:
        if killed is not None and killed.poll() is None:
            killed.kill()
            killed.wait(30)
        daemon.stop()


def test_a_process_that_detaches_and_attaches_again_is_no_longer_exited() -> None:
    """Goodbye then a new hello from the same process (detach, attach): connected, not exited, kept."""
    registry = Registry(grace_period=0.0)
    run, _ = registry.connect(_hello("re", 0, 1), None)
    _, rank = registry.connect(_hello("re", 1, 2), None)
    registry.goodbye(rank)
    registry.disconnect(run, rank, owned=True)
    registry.connect(_hello("re", 1, 2), None)
    assert ([], []) == registry.prune(time.monotonic() + 60)
    assert (True, False) == (run.ranks[1].connected, run.ranks[1].exited)
    registry.goodbye(run.ranks[1])
    registry.disconnect(run, run.ranks[1], owned=True)
    assert ([], [("re", 1)]) == registry.prune(time.monotonic() + 60)
    assert [0] == list(run.ranks)


def test_a_run_that_lost_a_rank_stays_down_for_the_lost_grace_period_and_comes_back_with_its_job() -> None:
    """A crashed job (a rank gone without goodbye) stays exported, agent_up 0, for lost_grace_period, not
    the five minutes after which TorchpulseAgentDown would resolve as if it had recovered; a cleanly ended
    run goes after grace_period, and first when max_runs needs room. A restart under the run name is up."""
    registry = Registry(grace_period=300.0, lost_grace_period=3600.0, max_runs=3)
    for name, says_goodbye in (("crashed", False), ("done", True)):
        run, rank = registry.connect(_hello(name, 0, 1), None)
        if says_goodbye:
            registry.goodbye(rank)
        registry.disconnect(run, rank, owned=True)
    now = time.monotonic()
    assert (["done"], []) == registry.prune(now + 301)
    assert ([], []) == registry.prune(now + 3599)
    assert ["crashed"] == list(registry.runs)
    run, rank = registry.connect(_hello("crashed", 0, 2), None)  # the job restarted: up again
    assert (True, False) == (rank.connected, run.lost_a_rank)
    registry.disconnect(run, rank, owned=True)
    for name in ("a", "b"):  # max_runs 3 reached with two more: the next new run needs room
        registry.goodbye(registry.connect(_hello(name, 0, 3), None)[1])
        registry.disconnect(registry.runs[name], registry.runs[name].ranks[0], owned=True)
    registry.connect(_hello("new", 0, 4), None)
    assert {"crashed", "b", "new"} == set(registry.runs), "the cleanly ended run made room, not the crashed one"


def test_a_goodbye_gives_the_rank_up_to_another_live_process_with_the_old_series_forgotten() -> None:
    """Registry alone: the rank's connection is still open after its goodbye and its process still runs,
    yet another process's hello takes the rank over with empty series (the agent server closes the old
    connection: see test_a_rank_given_up_with_a_goodbye_goes_to_another_process_while_its_connection_lingers)."""
    registry = Registry()
    alive = Peer(os.getpid(), os.getuid(), os.getgid())
    run, leaving = registry.connect(_hello("bye", 0, pid=100), alive)
    registry.apply(run, leaving, Batch(1, 0.0, [Sample("optimizer_steps_total", ("SGD#0",), 7.0)], [], []))
    registry.goodbye(leaving)
    _, taker = registry.connect(_hello("bye", 0, pid=200), alive)
    assert taker is run.ranks[0] and taker is not leaving
    assert (True, False, 200, {}, 0) == (taker.connected, taker.exited, taker.hello.pid, taker.values, run.series)
    registry.disconnect(run, leaving, owned=True)  # the old connection's close changes nothing: not current
    assert (True, None, 1) == (taker.connected, run.ended_at, registry.connections)


def test_making_room_for_a_rank_forgets_an_exited_rank_before_a_crashed_one() -> None:
    """At max_ranks_per_run a new rank drops a disconnected one: an exited rank, even a more recent one,
    goes before a crashed rank, whose agent_up 0 is what the down alert is firing on."""
    registry = Registry(max_ranks_per_run=2)
    run, crashed = registry.connect(_hello("room", 0, 1), None)
    registry.disconnect(run, crashed, owned=True)  # no goodbye: down
    _, finished = registry.connect(_hello("room", 1, 2), None)
    registry.goodbye(finished)
    registry.disconnect(run, finished, owned=True)
    registry.connect(_hello("room", 2, 3), None)
    assert [0, 2] == sorted(run.ranks)


def test_a_hello_that_fails_after_the_registry_took_it_leaves_the_rank_disconnected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-process server, a real socket: when the welcome fails (a daemon bug, a transport that refuses
    the write), the connection is refused with internal_error and its close still marks the rank
    disconnected and frees its connection count, so the rank alerts as down rather than looking held."""

    def broken_welcome(hello: Hello, older: object, writer: asyncio.StreamWriter) -> None:
        raise RuntimeError("the welcome failed")

    monkeypatch.setattr(AgentServer, "_welcome", staticmethod(broken_welcome))
    path = tmp_path / "agent.sock"

    async def main() -> tuple[bool, int, float | None, dict[str, int]]:
        registry = Registry()
        links = ConnectionTable()
        status = StatusReply("x", 0.0, 0, 0, {}, [])
        agents = AgentServer(registry, links, lambda: status, ControlHub(registry, links, lambda: ""))
        await agents.start(path)
        try:
            reader, writer = await asyncio.open_unix_connection(str(path))
            writer.write(encode(_hello("failing", 0)))
            await asyncio.wait_for(reader.read(), 10)  # the refusal, then the close
            writer.close()
            deadline = time.monotonic() + 10
            while registry.runs["failing"].ranks[0].connected and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            run = registry.runs["failing"]
            return run.ranks[0].connected, registry.connections, run.ended_at, dict(registry.frames_rejected)
        finally:
            await agents.close()

    connected, connections, ended_at, rejected = asyncio.run(main())
    assert (False, 0, {"internal_error": 1}) == (connected, connections, rejected)
    assert ended_at is not None
