"""Checkpoint announcements from agents, checked before the daemon validates and watches what they name.

Every user in the agent socket's group can connect, and the daemon reads with its own permissions
(often a project group's) and exports what it finds: an announcement is passed on only for a
directory of the announcing user (SO_PEERCRED), in their own or a shared writable parent, and
never on a kernel filesystem (announcing /proc/PID/x made the daemon watch all of /proc).

A job in a container names the path in its own mount namespace. The agent sends the directory's st_dev and
st_ino with it, and the announcement is passed on only where the daemon's path names that same directory: a
checkpoint bind-mounted at another host path was otherwise validated as whatever unrelated directory the host
had at the container's path.
"""

from __future__ import annotations

import asyncio
import functools
import stat
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Final

import structlog

from torchpulse.bounds import TokenBucket
from torchpulse.daemon.checkpoints.mounts import fs_type_of, read_mounts
from torchpulse.daemon.checkpoints.paths import normalize
from torchpulse.daemon.logs import cut
from torchpulse.daemon.offloop import off_loop
from torchpulse.daemon.peercred import Peer
from torchpulse.limits import MAX_PENDING_ANNOUNCEMENTS
from torchpulse.protocol import CheckpointSaved, LogEvent, checkpoint_saved

log = structlog.get_logger("torchpulse.daemon.server")  # the logger these lines always had

# Kernel filesystems: a directory there may well be the announcing user's (their process's /proc/PID, a
# delegated cgroup), but the daemon must never watch and walk the tree above it (all of /proc).
KERNEL_FILESYSTEMS: Final = frozenset(
    {
        "proc",
        "sysfs",
        "cgroup",
        "cgroup2",
        "devtmpfs",
        "devpts",
        "debugfs",
        "tracefs",
        "securityfs",
        "selinuxfs",
        "bpf",
        "configfs",
        "pstore",
        "mqueue",
        "hugetlbfs",
        "fusectl",
        "efivarfs",
        "binfmt_misc",
        "rpc_pipefs",
        "nsfs",
    }
)


class Announcements:
    """One connection's checkpoint announcements, each checked off the loop, in order, one at a time.

    The check stats the announced directory, which never returns on a hung mount: one thread per
    connection at most, and a bounded queue behind it. What it logs counts against the rank's budget
    for its own events, which an agent flooding announcements would otherwise get round.
    """

    def __init__(
        self,
        peer: Peer | None,
        deliver: Callable[[str, int, CheckpointSaved], None],
        tasks: set[asyncio.Task[None]],
        log_budget: TokenBucket,
    ) -> None:
        self._uid = peer.uid if peer is not None else None
        self._deliver = deliver
        self._tasks = tasks
        self._log_budget = log_budget
        self._queue: deque[tuple[str, int, CheckpointSaved]] = deque()
        self._check: asyncio.Task[None] | None = None

    def route(self, run: str, rank: int, events: list[LogEvent]) -> None:
        for event in events:
            saved = checkpoint_saved(event)
            if saved is None:
                continue
            if not saved.validate or not saved.path.startswith("/"):
                # Nothing to watch: the service skips ranks other than 0, refuses relative paths, skips URLs.
                self._deliver(run, rank, saved)
            elif len(self._queue) >= MAX_PENDING_ANNOUNCEMENTS:
                if self._log_budget.take(time.monotonic()):
                    log.warning(
                        "checkpoint announcement dropped: too many wait for their check on this connection",
                        run=run,
                        rank=rank,
                        path=cut(saved.path),
                        uid=self._uid,
                    )
            else:
                self._queue.append((run, rank, saved))
        if self._queue and self._check is None:
            self._check = asyncio.create_task(self._drain(), name="torchpulse-announcement-checks")
            self._tasks.add(self._check)
            self._check.add_done_callback(self._tasks.discard)

    async def _drain(self) -> None:
        try:
            while self._queue:
                run, rank, saved = self._queue.popleft()
                try:
                    check = functools.partial(announcement_refused, saved.path, self._uid, saved.identity())
                    refused = await off_loop(check, "torchpulse-announcement-check")
                except Exception:  # a daemon bug costs this announcement, never the next ones
                    log.exception("checkpoint announcement check failed", run=run, rank=rank, path=cut(saved.path))
                    continue
                if refused is None:
                    self._deliver(run, rank, saved)
                elif self._log_budget.take(time.monotonic()):
                    log.warning(
                        "checkpoint announcement refused: not validated, its directory not watched",
                        run=run,
                        rank=rank,
                        path=cut(saved.path),
                        uid=self._uid,
                        reason=refused,
                        fix="a [checkpoints] root in the daemon's config is watched whoever owns it",
                    )
        finally:
            self._check = None


def announcement_refused(path: str, uid: int | None, identity: tuple[int, int] | None = None) -> str | None:
    """Why an agent of `uid` may not have the daemon validate `path` and watch its parent; None when it may.

    Blocking (stats; a network filesystem may stall). The daemon reads with its own permissions,
    often a project group's, and exports what it finds: a job points it only at directories its
    own user owns (root's at any), and nobody's at a kernel filesystem. `identity` is (st_dev, st_ino)
    of the directory the job saved, when its agent sent it: `path` must name that directory here too.
    """
    if uid is None:
        return "the announcing process cannot be identified (no SO_PEERCRED)"
    try:
        # What the service validates and whose parent it watches: the path normalized as it does, `..` taken
        # lexically. Resolving the path as sent instead checked another directory when a `..` followed a
        # symlink (`mine/link/../../theirs/ck` passed as a directory of the job's user).
        real = Path(normalize(path)).resolve(strict=True)
    except (OSError, ValueError, RuntimeError) as exc:  # RuntimeError: a symlink loop
        reason = f"cannot be resolved: {getattr(exc, 'strerror', None) or exc}"
        return reason if identity is None else f"{reason} ({_OTHER_NAMESPACE})"
    if identity is not None and (mismatch := _another_directory(real, identity)):
        return mismatch
    mounts = read_mounts()
    for directory in (real, real.parent):
        fs_type = fs_type_of(str(directory), mounts)
        if fs_type in KERNEL_FILESYSTEMS:
            return f"{directory} is on a kernel filesystem ({fs_type})"
    if uid == 0:
        return None
    for directory in (real, real.parent):
        try:
            info = directory.stat()
        except OSError as exc:
            return f"cannot stat {directory}: {exc.strerror or exc}"
        if info.st_uid == uid:
            continue
        if directory == real.parent and info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            # A team's shared checkpoint directory (group-writable, often setgid): the job made its
            # checkpoint there, as other users may; watching it is what the team's jobs ask for.
            continue
        return f"{directory} belongs to uid {info.st_uid}, not to the job's user (uid {uid})"
    return None


# Why a path the job saved to is missing or another directory here; what the user does about it.
_OTHER_NAMESPACE = (
    "if the job runs in a container (another mount namespace), mount the checkpoint directory at "
    "the same path in it as on the daemon's host, or list its host path as a [checkpoints] root"
)


def _another_directory(real: Path, identity: tuple[int, int]) -> str | None:
    """Why `real` is not the directory the job saved (identity: its st_dev, st_ino there); None when it is."""
    try:
        info = real.stat()
    except OSError as exc:
        return f"cannot stat {real}: {exc.strerror or exc}"
    here = (info.st_dev, info.st_ino)
    if here == identity:
        return None
    # The directory the job wrote has another identity: another mount namespace, a `..` that a symlink
    # leads elsewhere in the job, or a directory replaced since the save. Validating it would report on
    # a checkpoint the job never wrote.
    return (
        f"{real} is not the directory the job saved (device:inode {identity[0]}:{identity[1]} in the job, "
        f"{here[0]}:{here[1]} here); {_OTHER_NAMESPACE}"
    )
