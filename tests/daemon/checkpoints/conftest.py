"""Watcher fixtures: real DCP checkpoints from the checkpoint tests' save script."""

from __future__ import annotations

import asyncio
import ctypes
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import DaemonProcess
from tests.support.checkpoints import FakeWorker, save
from torchpulse.daemon.checkpoints import runner as checkpoint_runner
from torchpulse.daemon.checkpoints.service import CheckpointService
from torchpulse.demo import crash_an_overwrite

__all__ = [
    "CLONE_NEWNS",
    "MS_BIND",
    "MS_PRIVATE",
    "MS_REC",
    "NOBODY",
    "enter_user_namespace",
    "file_modes_bind",
    "hidden_proc",
    "idle",
    "logged",
    "rewrite_a_shard",
    "save_single",
    "shut_out",
    "tried",
]
PR_CAPBSET_DROP = 24
# Root passes every permission check through these two; without them, file modes bind it as any other user.
CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 1, 2
CAP_SYS_PTRACE = 19  # root sees every process whatever /proc's hidepid says, unless it lacks this
NOBODY = 65534
CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18


async def idle(service: CheckpointService, timeout: float = 20.0) -> None:
    """Until the service has nothing queued nor running (after a moment for events still in flight)."""
    await asyncio.sleep(0.1)
    deadline = asyncio.get_running_loop().time() + timeout
    while service.queue.in_flight or service.queue.pending:
        assert asyncio.get_running_loop().time() < deadline, "the service did not settle"
        await asyncio.sleep(0.02)


def file_modes_bind() -> Callable[[], None]:
    """A preexec_fn for a daemon that file modes bind, as they bind the `torchpulse` user it runs as in production.

    The tests run as root, which ignores modes (a chmod as root proves nothing). The child drops
    CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from its bounding set, so the daemon it execs keeps uid 0, owner of
    the interpreter and of everything the test made, but cannot enter a directory of another user with mode 700.
    Not root: nothing to drop. Skips where the kernel refuses (no CAP_SETPCAP).
    """
    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:
        for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
            if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")

    if os.geteuid() != 0:
        return lambda: None
    return tried(preexec, "cannot drop root's file permission override")


def hidden_proc() -> Callable[[], None]:
    """A preexec_fn for a daemon as the systemd unit runs it (PrivateMounts=yes, ProtectProc=invisible): a mount
    namespace of its own with /proc mounted hidepid=invisible, and without CAP_SYS_PTRACE, so that root's daemon,
    like the unit's `torchpulse` user, sees no process of another user there. Needs root; skips without."""
    if os.geteuid() != 0:
        pytest.skip("hiding other users' processes from the daemon needs root")
    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:
        def check(result: int, what: str) -> None:
            if result != 0:
                raise OSError(ctypes.get_errno(), what)

        check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
        check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
        # gid= names the group that still sees everything: 0 by default, which root's daemon is in and the unit's
        # `torchpulse` user is not; 65533 is a group of nobody's here.
        hide = b"hidepid=invisible,gid=65533"
        check(libc.mount(b"proc", b"/proc", b"proc", 0, hide), "mount -t proc -o hidepid=invisible")
        check(libc.prctl(PR_CAPBSET_DROP, CAP_SYS_PTRACE, 0, 0, 0), "prctl(PR_CAPBSET_DROP, CAP_SYS_PTRACE)")

    return tried(preexec, "cannot mount a private /proc with hidepid")


def tried(preexec: Callable[[], None], refused: str) -> Callable[[], None]:
    """`preexec` once it has run in a trial child; where the kernel refuses it, the test skips saying `refused`."""
    try:
        subprocess.run([sys.executable, "-c", "pass"], preexec_fn=preexec, check=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"{refused} here: {exc}")
    return preexec


def enter_user_namespace(libc: ctypes.CDLL, uid: int, gid: int, flags: int = 0) -> None:
    """In a preexec_fn: unshare a user namespace (and the namespaces in `flags`) where the caller's uid and gid
    map onto themselves, the only ids there."""
    if libc.unshare(CLONE_NEWUSER | flags) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER)")
    Path("/proc/self/setgroups").write_text("deny")
    Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
    Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")


def shut_out(path: Path, mode: int = 0o700) -> None:
    """`path` as another user's directory with `mode` (as root: owned by nobody; otherwise the mode's owner
    bits cleared too, so that the test's own user is shut out as well)."""
    if os.geteuid() == 0:
        os.chown(path, NOBODY, NOBODY)
        path.chmod(mode)
    else:
        path.chmod(mode & 0o077)


def save_single(out: Path) -> None:
    """One real single-process DCP save into `out` (its own process, like a job)."""
    save("single", out)


def logged(logs: list[dict[str, Any]], prefix: str) -> list[dict[str, Any]]:
    """The captured log entries (structlog's `capture_logs`) whose event starts with `prefix`."""
    return [entry for entry in logs if str(entry["event"]).startswith(prefix)]


def rewrite_a_shard(checkpoint: Path) -> Path:
    """Write one `.distcp` file again under the old `.metadata`, as a DCP overwrite in place that crashed before
    its commit leaves it (the same bytes: what the metadata says about them stays true, only time tells)."""
    shard = crash_an_overwrite(checkpoint)
    assert shard.stat().st_mtime_ns > (checkpoint / ".metadata").stat().st_mtime_ns
    return shard


@pytest.fixture
def worker(monkeypatch: pytest.MonkeyPatch) -> FakeWorker:
    """A fast stand-in for the validation worker process (test_service.py keeps its slower one)."""
    fake = FakeWorker(seconds=0.01)
    monkeypatch.setattr(checkpoint_runner, "validate", fake)
    return fake


@pytest.fixture
def stopper() -> Iterator[list[DaemonProcess]]:
    """Daemons a test started, stopped at its end whatever happened."""
    daemons: list[DaemonProcess] = []
    yield daemons
    for daemon in daemons:
        daemon.stop()
