"""Other users on a shared node: what a member of the socket's group can make the daemon and other users' jobs do.

Cases that need a second user fork a child that drops to uid 65534 (root only; 65533 where a
third user is needed) and talks to a real daemon. The agent's trace rules are checked
in-process, with the sender's uid as the daemon passes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import importlib
import io
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.support import REPO, DaemonProcess, as_user, free_port, local_agent, send_raw, start_daemon, wait_for
from torchpulse import cli
from torchpulse.daemon.client import DaemonUnavailable, request_status, send_ctl
from torchpulse.daemon.connections import AgentLink, ConnectionTable
from torchpulse.daemon.control import ControlHub, NotAuthorized
from torchpulse.daemon.peercred import Peer
from torchpulse.daemon.registry import Registry
from torchpulse.exporters import textfile
from torchpulse.framing import FrameReader
from torchpulse.probes.agent.agent import Agent
from torchpulse.protocol import (
    CALLER_UID_ARG,
    CHECKPOINT_SAVED_EVENT,
    Batch,
    Command,
    CommandResult,
    CtlRequest,
    Goodbye,
    Hello,
    LogEvent,
    decode_daemon_frame,
    encode,
)

OTHER_UID = 65534  # nobody: a user other than the test's
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")


def _as_user(call: Callable[[], bytes], uid: int = OTHER_UID, groups: list[int] | None = None) -> bytes:
    """`call()` run as `uid` (with supplementary `groups`) in a forked child; what it returned."""
    code, out = as_user(lambda: (0, call()), uid, groups)
    assert 0 == code, out
    return out


def _open_daemon(shared: Path, config: str = "") -> DaemonProcess:
    extra = []
    if config:
        (shared / "torchpulse.toml").write_text(config)
        extra = ["--config", str(shared / "torchpulse.toml")]
    daemon = start_daemon(shared, extra_args=extra)
    daemon.socket_path.chmod(0o666)  # as the socket unit's group would let this test's second user in
    return daemon


def _hello(run: str, rank: int) -> Hello:
    return Hello(run, rank, rank, 2, os.getpid(), "h", "2.13.0", "0.1.0", "test", time.time())


def _events(daemon: DaemonProcess, event: str) -> list[dict[str, object]]:
    """Log lines whose event starts with `event`."""
    return [line for line in daemon.log_lines() if str(line.get("event")).startswith(event)]


# -- runs -----------------------------------------------------------------------------------------


@pytest.mark.process
@needs_root
def test_another_user_cannot_add_or_take_over_ranks_of_a_run(shared: Path) -> None:
    """uid 65534 says hello as a new rank of root's run, and as its rank once that rank left: both refused."""
    daemon = _open_daemon(shared)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as owner:
            owner.connect(str(daemon.socket_path))
            owner.sendall(encode(_hello("shared-run", 0)))
            owner.recv(4096)  # Welcome
            as_new_rank = _as_user(lambda: send_raw(daemon.socket_path, encode(_hello("shared-run", 1)), False))
            owner.sendall(encode(Goodbye("exit")))
        wait_for(lambda: not request_status(daemon.socket_path).runs[0].ranks[0].connected)
        as_left_rank = _as_user(lambda: send_raw(daemon.socket_path, encode(_hello("shared-run", 0)), False))
        runs = {run.run: [rank.rank for rank in run.ranks] for run in request_status(daemon.socket_path).runs}
        assert ([True, True], {"shared-run": [0]}) == (
            [b"run_owned" in reply and b"another user (uid 0)" in reply for reply in (as_new_rank, as_left_rank)],
            runs,
        )
    finally:
        daemon.stop()


# -- who may send commands ----------------------------------------------------------------------


def _a_group() -> grp.struct_group:
    """An existing group other than root's and nobody's, to name as control_group."""
    for group in grp.getgrall():
        if group.gr_gid not in (0, OTHER_UID):
            return group
    pytest.skip("no group to use as control_group")


@pytest.mark.process
@needs_root
def test_control_group_counts_supplementary_groups_even_past_256(shared: Path) -> None:
    """A member of control_group through a supplementary group may send commands, also when it is the last of
    300 groups (more than CPython's getsockopt() can carry); without the group the caller is refused."""
    group = _a_group()
    daemon = _open_daemon(shared, f'[daemon]\ncontrol_group = "{group.gr_name}"\n')

    def ctl() -> bytes:
        try:
            send_ctl(daemon.socket_path, CtlRequest("no-such-run", None, "status", {}, 2.0), 10.0)
        except DaemonUnavailable as exc:
            return str(exc).encode()
        return b"accepted"

    try:
        one = _as_user(ctl, groups=[group.gr_gid])
        many = _as_user(ctl, groups=[*range(20_000, 20_299), group.gr_gid])
        none = _as_user(ctl, groups=[])
        assert (b"accepted", b"accepted", True) == (one, many, none.startswith(b"refused: uid 65534 may not"))
    finally:
        daemon.stop()


def _job_as(uid: int, socket_path: Path, run: str) -> int:
    """A training loop with the agent attached, run as `uid` in a forked child until killed: its pid."""
    # Imported, and the model built (an optimizer imports Dynamo), before the fork: the child, as
    # another user, cannot read root's Python installation.
    for module in (
        "torch.profiler",
        "torchpulse.probes.attach",
        "torchpulse.probes.agent.agent",
        "torchpulse.probes.agent.control",
        "torchpulse.probes.optimizer",
        "torchpulse.probes.agent.sender",
    ):
        importlib.import_module(module)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            from torchpulse.probes.attach import attach

            attach(probes=("optimizer",), socket=str(socket_path), run=run)
            while True:
                optimizer.zero_grad()
                model(torch.ones(2, 4)).sum().backward()
                optimizer.step()
                time.sleep(0.01)
        except BaseException:
            traceback.print_exc()  # shown with the test's failure
        finally:
            os._exit(1)
    return pid


def _ctl_as(uid: int, *argv: str) -> tuple[int, str, str]:
    """`torchpulse ctl ARGV` run as `uid` (in a forked child: the venv is root's): status, stdout, stderr."""

    def ctl() -> tuple[int, bytes]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(["ctl", *argv])
        return code, json.dumps([out.getvalue(), err.getvalue()]).encode()

    code, printed = as_user(ctl, uid)
    stdout, stderr = json.loads(printed)
    return code, stdout, stderr


@pytest.mark.process
@needs_root
def test_a_jobs_user_controls_their_own_run_and_no_one_elses(shared: Path) -> None:
    """uid 65534 runs a job: it may `ctl status` and `ctl trace` it (into a directory of its own) without being in
    control_group. uid 65533 is refused on that run with the very words it gets for a run that does not exist."""
    daemon = _open_daemon(shared)
    traces = shared / "job-user-traces"
    traces.mkdir()
    os.chown(traces, OTHER_UID, OTHER_UID)
    job = _job_as(OTHER_UID, daemon.socket_path, "nobody-job")
    socket_arg = ("--socket", str(daemon.socket_path))
    try:

        def connected() -> bool:
            assert (0, 0) == os.waitpid(job, os.WNOHANG), "the job died"
            return any(run.run == "nobody-job" and run.ranks for run in request_status(daemon.socket_path).runs)

        wait_for(connected, timeout=60)
        status = _ctl_as(OTHER_UID, "status", "--run", "nobody-job", *socket_arg)
        trace = _ctl_as(
            OTHER_UID,
            "trace",
            "--run",
            "nobody-job",
            "--steps",
            "2",
            "--out",
            str(traces),
            "--timeout",
            "60",
            *socket_arg,
        )
        on_theirs = _ctl_as(OTHER_UID - 1, "status", "--run", "nobody-job", *socket_arg)
        on_none = _ctl_as(OTHER_UID - 1, "status", "--run", "no-such-run", *socket_arg)
    finally:
        os.kill(job, signal.SIGKILL)
        os.waitpid(job, 0)
        daemon.stop()
    assert (0, True) == (status[0], status[1].startswith("rank   0  ok")), status
    assert (0, True, 1) == (trace[0], "trace written" in trace[1], len(list(traces.iterdir()))), trace
    refusal = (
        "torchpulse: refused: uid 65533 may not send commands to this run (allowed: root, the daemon's user "
        "or the user whose job reports the run)\n"
    )
    assert [(1, "", refusal)] * 2 == [on_theirs, on_none]


def test_a_run_is_its_users_only_while_every_rank_remembered_is_theirs() -> None:
    """uid 4242 may command a run whose ranks all came from its processes; not one with a rank whose sender is
    unknown (no SO_PEERCRED), nor one where a disconnected rank still remembered came from another user."""
    registry = Registry()
    mine = Peer(pid=1, uid=4242, gid=4242)
    registry.connect(_hello("mine", 0), mine)
    registry.connect(_hello("mine", 1), mine)
    registry.connect(_hello("unknown", 0), mine)
    registry.connect(_hello("unknown", 1), None)
    run, gone = registry.connect(_hello("remembered", 0), Peer(pid=2, uid=4243, gid=4243))
    registry.disconnect(run, gone, owned=True)
    registry.connect(_hello("remembered", 1), mine)
    hub = ControlHub(registry, ConnectionTable(), lambda: "")

    def answer(run: str) -> str:
        try:
            reply = asyncio.run(hub.handle(CtlRequest(run, [], "status", {}, 0.1), mine))
        except NotAuthorized:
            return "refused"
        return f"ok: {reply.run}"

    assert ["ok: mine", "refused", "refused"] == [answer(run) for run in ("mine", "unknown", "remembered")]


def _command_sent(frame: bytes) -> Command:
    [body] = FrameReader().feed(frame)
    command = decode_daemon_frame(body)
    assert isinstance(command, Command)
    return command


def test_the_agent_learns_who_asks_for_a_trace_whatever_the_client_claims() -> None:
    """A client's own `caller_uid` is replaced by its SO_PEERCRED uid in the command the rank receives."""
    registry = Registry()
    _, state = registry.connect(_hello("traced", 0), Peer(pid=1, uid=4242, gid=4242))
    sent: list[bytes] = []
    links = ConnectionTable()
    links.claim(state, AgentLink(1, sent.append, lambda: None))
    caller = Peer(pid=2, uid=os.geteuid(), gid=os.getegid())  # the daemon's own user may send commands
    claim = {"steps": 1, "out": "/tmp", "start_step": 5, CALLER_UID_ARG: os.geteuid() + 1}
    asyncio.run(ControlHub(registry, links, lambda: "").handle(CtlRequest("traced", [0], "trace", claim, 0.1), caller))
    assert os.geteuid() == _command_sent(sent[0]).args[CALLER_UID_ARG]


# -- where another user's trace may go ------------------------------------------------------------


def _traced_job() -> tuple[Agent, torch.nn.Module, torch.optim.Optimizer]:
    agent = local_agent(("optimizer",))
    assert isinstance(agent, Agent)
    model = torch.nn.Linear(4, 3)
    return agent, model, torch.optim.SGD(model.parameters(), lr=0.1)


def _trace(out: Path, caller: int, before_steps: Callable[[], None] = lambda: None) -> CommandResult:
    """One 2-step trace asked by uid `caller` of a job run by this test's user; its answer."""
    agent, model, optimizer = _traced_job()
    try:
        agent.control.receive(
            Command(1, "trace", {"steps": 2, "start_step": 2, "out": str(out), CALLER_UID_ARG: caller})
        )
        before_steps()
        for _ in range(4):
            optimizer.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            optimizer.step()
        wait_for(lambda: bool(agent.control.results), timeout=30)
        return agent.control.results[0]
    finally:
        agent.shutdown()


def _foreign_uid() -> int:
    return OTHER_UID if os.geteuid() != OTHER_UID else OTHER_UID - 1


def test_another_users_trace_is_refused_in_the_jobs_own_directories(tmp_path: Path) -> None:
    """A sender who is neither root nor the job's user cannot have the job write into, or create, a directory
    of the job's user (its home, say): refused on arrival, nothing created, nothing written."""
    existing, missing = tmp_path / "home-of-job", tmp_path / "not" / "there"
    existing.mkdir()
    answers = [_trace(existing, _foreign_uid()), _trace(missing, _foreign_uid())]
    assert ([False, False], [], False) == ([a.ok for a in answers], list(existing.iterdir()), missing.parent.exists())
    assert f"belongs to uid {os.geteuid()}, not to the sender (uid {_foreign_uid()})" in answers[0].message
    assert "does not exist, and is not created for another user" in answers[1].message


@needs_root
def test_another_users_trace_goes_into_their_own_directory_or_a_sticky_shared_one(tmp_path: Path) -> None:
    """The sender's own directory and a /tmp-like one (sticky, world-writable) take the file."""
    own, sticky = tmp_path / "sender", tmp_path / "shared-tmp"
    own.mkdir(mode=0o777)
    os.chown(own, OTHER_UID, OTHER_UID)
    sticky.mkdir()
    sticky.chmod(0o1777)
    answers = [_trace(own, OTHER_UID), _trace(sticky, OTHER_UID)]
    assert [(True, "trace written")] * 2 == [(a.ok, a.message) for a in answers], answers
    assert [1, 1] == [len(list(own.iterdir())), len(list(sticky.iterdir()))]


@needs_root
def test_swapping_the_senders_directory_for_a_symlink_does_not_move_the_write(tmp_path: Path) -> None:
    """Accepted into the sender's directory, which they then rename and replace by a symlink to the job's
    directory before the trace is written: the file lands in the directory accepted, the job's stays empty."""
    out, moved, victim = tmp_path / "sender", tmp_path / "sender-moved", tmp_path / "job-private"
    out.mkdir(mode=0o777)
    os.chown(out, OTHER_UID, OTHER_UID)
    victim.mkdir()

    def swap() -> None:
        out.rename(moved)
        out.symlink_to(victim)

    answer = _trace(out, OTHER_UID, before_steps=swap)
    assert ((True, "trace written"), [], 1) == (
        (answer.ok, answer.message),
        list(victim.iterdir()),
        len(list(moved.iterdir())),
    )


# -- checkpoint announcements ---------------------------------------------------------------------


def _announce(daemon: DaemonProcess, run: str, *paths: str) -> bytes:
    """Connect as an agent, announce `paths` as rank 0's checkpoint saves, say goodbye."""
    events = [
        LogEvent(
            time.time(),
            "info",
            CHECKPOINT_SAVED_EVENT,
            {"path": path, "api": "save", "duration_seconds": 1.0, "validate": True},
        )
        for path in paths
    ]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(daemon.socket_path))
        sock.sendall(encode(_hello(run, 0)))
        sock.recv(4096)  # Welcome
        sock.sendall(encode(Batch(1, time.time(), [], [], events)) + encode(Goodbye("exit")))
    return b"sent"


@needs_root
def test_another_users_checkpoint_is_not_validated_nor_its_directory_watched(
    shared: Path, saved_checkpoint: Path
) -> None:
    """uid 65534 announces a checkpoint of root's (readable to the daemon, the job's project group say): refused,
    so the metrics say nothing of it; its own checkpoint, in a directory of its own, is validated."""
    theirs, own = shared / "root-project" / "step-1", shared / "nobody" / "step-1"
    shutil.copytree(saved_checkpoint, theirs)
    shutil.copytree(saved_checkpoint, own)
    for path in (own.parent, own, *own.iterdir()):
        os.chown(path, OTHER_UID, OTHER_UID)
    daemon = _open_daemon(shared)
    try:
        _as_user(lambda: _announce(daemon, "nobody-run", str(theirs), str(own)))
        wait_for(lambda: bool(_events(daemon, "checkpoint validated")), timeout=60)
        [refused] = _events(daemon, "checkpoint announcement refused")
        validated = [line["path"] for line in _events(daemon, "checkpoint validated")]
        roots = {line["root"] for line in daemon.log_lines() if line.get("event") == "watching checkpoint root"}
        assert ([str(own)], {str(own.parent)}, str(theirs)) == (validated, roots, refused["path"])
        assert f"{theirs} belongs to uid 0, not to the job's user (uid {OTHER_UID})" == refused["reason"]
        assert "root-project" not in daemon.scrape_text()
    finally:
        daemon.stop()


@needs_root
def test_a_checkpoint_of_the_jobs_own_in_a_teams_shared_directory_is_validated(
    shared: Path, saved_checkpoint: Path
) -> None:
    """The usual team layout: a group-writable setgid project directory of someone else's, in which each member's
    job writes its own checkpoints. The checkpoint is the job's user's: validated, its directory watched."""
    team = shared / "team-ckpts"
    team.mkdir()
    team.chmod(0o2775)
    own = team / "step-1"
    shutil.copytree(saved_checkpoint, own)
    for path in (own, *own.iterdir()):
        os.chown(path, OTHER_UID, OTHER_UID)
    daemon = _open_daemon(shared)
    try:
        _as_user(lambda: _announce(daemon, "team-run", str(own)))
        wait_for(lambda: bool(_events(daemon, "checkpoint validated")), timeout=60)
        assert ([], [str(own)]) == (
            _events(daemon, "checkpoint announcement refused"),
            [line["path"] for line in _events(daemon, "checkpoint validated")],
        )
    finally:
        daemon.stop()


def test_a_checkpoint_announced_under_proc_never_makes_proc_a_watched_root(daemon: DaemonProcess) -> None:
    """A directory of the job's own on a kernel filesystem (its /proc/PID): refused whoever asks, else the daemon
    would watch all of /proc recursively (gigabytes of memory and log within a minute)."""
    mine = f"/proc/{os.getpid()}/task"
    _announce(daemon, "proc-run", mine)
    wait_for(lambda: bool(_events(daemon, "checkpoint announcement refused")))
    [refused] = _events(daemon, "checkpoint announcement refused")
    assert (mine, "is on a kernel filesystem (proc)") == (refused["path"], str(refused["reason"]).split(" ", 1)[1])
    assert [] == [line for line in daemon.log_lines() if str(line.get("root", "")).startswith("/proc")]


# -- the daemon's own socket ------------------------------------------------------------------------


def _start_failure(socket_dir: Path, tmp_path: Path) -> tuple[int, str]:
    """Exit status and log of a daemon asked to bind its agent socket in `socket_dir`."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchpulse",
            "daemon",
            "--socket",
            str(socket_dir / "agent.sock"),
            "--listen",
            f"127.0.0.1:{free_port()}",
            "--state-dir",
            str(tmp_path / "state"),
            "--log-format",
            "json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.process
@needs_root
def test_the_daemon_will_not_bind_its_socket_where_another_user_could_replace_it(tmp_path: Path) -> None:
    """A directory another user made first (a squatted /tmp/torchpulse-UID), and one anybody may write to
    without the sticky bit: the daemon refuses to start there, saying why, and binds nothing."""
    squatted, open_to_all = tmp_path / "squatted", tmp_path / "open"
    squatted.mkdir()
    os.chown(squatted, OTHER_UID, OTHER_UID)
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    results = [_start_failure(squatted, tmp_path), _start_failure(open_to_all, tmp_path)]
    assert [1, 1] == [code for code, _ in results], results
    assert f"{squatted} belongs to uid {OTHER_UID}, who could replace the socket" in results[0][1]
    assert f"{open_to_all} is writable by other users (mode 777)" in results[1][1]
    assert [[], []] == [list(squatted.iterdir()), list(open_to_all.iterdir())]


@pytest.mark.process
def test_a_sticky_shared_directory_takes_the_socket(tmp_path: Path) -> None:
    """/tmp-like (world-writable, sticky): others cannot remove the socket there, so the daemon binds it."""
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    daemon = start_daemon(tmp_path, socket_path=sticky / "agent.sock")
    try:
        assert stat.S_ISSOCK((sticky / "agent.sock").lstat().st_mode)
    finally:
        daemon.stop()


# -- the textfile in a shared directory ---------------------------------------------------------------


def test_a_temporary_textfile_swapped_for_a_symlink_changes_no_other_files_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a directory others may write to, the temporary file is replaced by a symlink to a private file right
    after it is made: the daemon's mode change goes to its own file, never through the link."""
    victim = tmp_path / "private"
    victim.write_text("secret")
    victim.chmod(0o600)
    made = tempfile.mkstemp

    def mkstemp_then_swap(*args: object, **kwargs: object) -> tuple[int, str]:
        fd, name = made(*args, **kwargs)  # type: ignore[call-overload]
        Path(name).rename(tmp_path / "taken-away")
        Path(name).symlink_to(victim)
        return fd, name

    monkeypatch.setattr(textfile.tempfile, "mkstemp", mkstemp_then_swap)
    textfile.write_textfile(b"torchpulse_up 1\n", tmp_path / "torchpulse.prom")
    assert (0o600, "secret") == (stat.S_IMODE(victim.stat().st_mode), victim.read_text())
