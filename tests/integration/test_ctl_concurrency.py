"""`torchpulse ctl` across a daemon restart and a client that hangs up: real daemon processes, real training jobs."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.integration.test_ctl import _ctl, _jobs, _stop, _wait_connected
from tests.support import REPO, DaemonProcess, sigint_as_at_a_terminal, wait_for
from torchpulse.daemon.connections import AgentLink, ConnectionTable
from torchpulse.daemon.control import ControlHub
from torchpulse.daemon.peercred import Peer
from torchpulse.daemon.registry import Registry
from torchpulse.protocol import HEADER, Command, CtlRequest, Hello, decode_daemon_frame


def test_an_answer_meant_for_the_daemon_before_a_restart_does_not_answer_a_new_command(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    """A trace waits in the agent for a far step when the daemon is SIGKILLed; the new daemon's first trace
    supersedes it, and the agent answers the old one ("superseded") on its new connection. That answer is
    not the new command's: with ids counted from 1 in every daemon it was, and the client was told its own
    trace, accepted and waiting, had failed."""
    procs = _jobs(daemon, "ids", steps=100000, sleep=0.02, ranks=1)
    current = daemon
    try:
        _wait_connected(current, "ids", 1)
        far = 1_000_000
        first = _ctl(
            current,
            "trace",
            "--run",
            "ids",
            "--start-step",
            str(far),
            "--steps",
            "1",
            "--out",
            str(tmp_path),
            "--timeout",
            "1",
        )
        assert first.stdout.startswith("rank   0  timeout"), first.stdout + first.stderr
        current.proc.kill()
        current.proc.wait(10)
        current = current.restart()
        _wait_connected(current, "ids", 1)
        second = _ctl(
            current,
            "trace",
            "--run",
            "ids",
            "--start-step",
            str(far + 5),
            "--steps",
            "1",
            "--out",
            str(tmp_path),
            "--timeout",
            "2",
        )
        # Its own answer: still waiting for step far + 5, so a timeout (the old trace's "superseded" is not it).
        assert second.stdout.startswith("rank   0  timeout       no answer within 2s"), second.stdout + second.stderr
        assert "superseded" not in second.stdout
    finally:
        _stop(procs)
        current.stop()


def test_a_command_right_after_a_restart_answers_for_every_rank_still_reconnecting(daemon: DaemonProcess) -> None:
    """The daemon is SIGKILLed and down long enough for the agents to back off; the first `ctl status` sent
    to the new one, before the ranks are back, answers for both ranks (it waited for them), instead of
    "no such run" or a reply leaving out a rank with exit status 0."""
    procs = _jobs(daemon, "back", steps=100000, sleep=0.02, ranks=2)
    current = daemon
    try:
        _wait_connected(current, "back", 2)
        current.proc.kill()
        current.proc.wait(10)
        time.sleep(3)  # the agents' retries are 2 s and then 4 s apart by now
        current = current.restart()
        result = _ctl(current, "status", "--run", "back", "--timeout", "20")
        lines = result.stdout.splitlines()
        assert 0 == result.returncode, result.stdout + result.stderr
        assert [True, True] == [line.startswith(f"rank   {rank}  ok ") for rank, line in enumerate(lines)], lines
        assert 2 == len(lines)
        assert all(p.poll() is None for p in procs)
    finally:
        _stop(procs)
        current.stop()


def _enable_waiting_on_a_stopped_rank(
    daemon: DaemonProcess, run: str
) -> tuple[list[subprocess.Popen[str]], subprocess.Popen[str]]:
    """A one-rank job, stopped (SIGSTOP), and a `ctl enable autograd` client waiting for its answer."""
    procs = _jobs(daemon, run, steps=100000, sleep=0.02, ranks=1)
    try:
        _wait_connected(daemon, run, 1)
        procs[0].send_signal(signal.SIGSTOP)
        client = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torchpulse",
                "ctl",
                "enable",
                "autograd",
                "--run",
                run,
                "--timeout",
                "3600",
                "--socket",
                str(daemon.socket_path),
            ],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=daemon.env(),
            preexec_fn=sigint_as_at_a_terminal,
        )
        wait_for(lambda: any(e.get("event") == "command received" for e in daemon.log_lines()))
    except BaseException:
        procs[0].send_signal(signal.SIGCONT)
        _stop(procs)
        raise
    return procs, client


def test_a_client_gone_before_the_answer_is_let_go_at_once_and_the_rank_still_applies_it(daemon: DaemonProcess) -> None:
    """`ctl enable` waits for a stopped rank and its user presses Ctrl-C: the client exits 130 without a
    traceback, and the daemon drops the command at once, while the rank is still stopped (it used to wait for
    the answer, up to the client's timeout of an hour, holding a connection kept for status and ctl); the rank
    applies the command when it steps again, and the next command works."""
    procs, client = _enable_waiting_on_a_stopped_rank(daemon, "gone")
    try:
        client.send_signal(signal.SIGINT)
        _, stderr = client.communicate(timeout=10)
        assert (130, "") == (client.returncode, stderr)  # the shell's status for Ctrl-C, no traceback
        wait_for(lambda: any(str(e.get("event", "")).startswith("command abandoned") for e in daemon.log_lines()))
        procs[0].send_signal(signal.SIGCONT)
        status = _ctl(daemon, "status", "--run", "gone", "--timeout", "10")
        assert 0 == status.returncode, status.stdout + status.stderr
        wait_for(lambda: "probes=autograd,optimizer" in _ctl(daemon, "status", "--run", "gone").stdout)
        abandoned = [e for e in daemon.log_lines() if str(e.get("event", "")).startswith("command abandoned")]
        assert [("enable", "gone", [0])] == [
            (e.get("command"), e.get("run"), e.get("ranks_reached")) for e in abandoned
        ]
        assert [] == [
            e
            for e in daemon.log_lines()
            if e.get("level") in ("warning", "error") and e.get("event") != "agent disconnected"
        ]
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGCONT)
        _stop(procs)


def test_a_daemon_gone_while_a_command_waits_is_reported_at_once_with_what_may_still_happen(
    daemon: DaemonProcess,
) -> None:
    """The daemon dies while `ctl enable` waits for a stopped rank: the client says so at once, exit 1, and that
    the rank may still apply the command (it has it), instead of waiting out its timeout."""
    procs, client = _enable_waiting_on_a_stopped_rank(daemon, "died")
    try:
        daemon.proc.kill()
        _, stderr = client.communicate(timeout=20)
        assert (
            1,
            "torchpulse: the daemon closed the connection without answering; ranks it reached may still "
            "apply the command\n",
        ) == (client.returncode, stderr)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGCONT)
        _stop(procs)


def test_right_after_a_start_a_command_waits_for_a_run_it_may_have_but_not_for_more_ranks_than_a_run_holds() -> None:
    """In-process, a daemon just started: a command for a run not back yet waits (up to half its timeout), one
    for more ranks than a run may hold here returns at once (each poll would walk them all: a 4 MiB request
    names about 800,000)."""
    registry = Registry(max_ranks_per_run=4)
    hub = ControlHub(registry, ConnectionTable(), lambda: "")

    def waited(ranks: list[int] | None) -> float:
        started = time.monotonic()
        asyncio.run(hub.handle(CtlRequest("nowhere", ranks, "status", {}, 1.0), Peer(os.getpid(), 0, 0)))
        return time.monotonic() - started

    assert (True, True) == (0.45 <= waited([0, 1]) < 0.9, waited(list(range(5))) < 0.1)


def test_a_command_is_on_every_rank_connection_before_the_hub_first_waits() -> None:
    """In-process: `handle` cancelled at its first wait, as a client's hang-up cancels it, has written the
    command to both ranks, names them as reached, and leaves no answer awaited. The writes used to be left to
    tasks of their own, started a loop pass later: a client gone in between (Ctrl-C right after its "command
    received" line) had its command reach no rank, while the log said ranks might still apply it."""
    registry = Registry()
    links = ConnectionTable()
    hub = ControlHub(registry, links, lambda: "")
    written: dict[int, list[bytes]] = {0: [], 1: []}
    for rank in (0, 1):
        _run, state = registry.connect(Hello("r", rank, 0, 2, 4242, "h", "2.13.0", "0.1.0", "test", 0.0), None)
        links.claim(state, AgentLink(rank + 1, written[rank].append, lambda: None))

    async def cancelled_at_first_wait() -> list[int]:
        reached: list[int] = []
        request = CtlRequest("r", None, "enable", {"probe": "autograd"}, 60.0)
        handling = asyncio.ensure_future(hub.handle(request, Peer(os.getpid(), os.geteuid(), os.getegid()), reached))
        await asyncio.sleep(0)  # `handle` runs up to its first wait
        handling.cancel()
        await asyncio.gather(handling, return_exceptions=True)
        return reached

    reached = asyncio.run(cancelled_at_first_wait())
    commands = [[decode_daemon_frame(frame[HEADER.size :]) for frame in written[rank]] for rank in (0, 1)]
    assert [0, 1] == reached
    assert [["enable"], ["enable"]] == [[c.name for c in sent if isinstance(c, Command)] for sent in commands]
    assert {} == hub._waiting
