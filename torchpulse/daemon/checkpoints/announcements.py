"""Checkpoint announcements from agents, checked before the daemon validates and watches what they name.

Every user in the agent socket's group can connect, and the daemon reads with its own permissions
(often a project group's) and exports what it finds: an announcement is passed on only for a
directory of the announcing user (SO_PEERCRED), in their own or a shared writable parent, and
never on a kernel filesystem (announcing /proc/PID/x made the daemon watch all of /proc).

A job in a container names the path in its own mount namespace. The agent sends the directory's st_dev and
st_ino with it, and the announcement is passed on only where the daemon's path names that same directory: a
checkpoint bind-mounted at another host path was otherwise validated as whatever unrelated directory the host
had at the container's path. Where the daemon's path names another directory, the job's is looked for under
the configured roots by the path's trailing components (a pod's /ckpt/run/step-1 is the volume's R/run/step-1)
and passed on with the daemon's path.
"""

from __future__ import annotations

import asyncio
import functools
import stat
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Final, Protocol

import msgspec
import structlog

from torchpulse.bounds import TokenBucket
from torchpulse.daemon.checkpoints.mounts import fs_type_of, read_mounts
from torchpulse.daemon.checkpoints.paths import normalize
from torchpulse.daemon.logs import cut
from torchpulse.daemon.offloop import off_loop
from torchpulse.daemon.peercred import Peer
from torchpulse.limits import MAX_ANNOUNCED_SUFFIX_PARTS, MAX_PENDING_ANNOUNCEMENTS
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


class CheckpointSink(Protocol):
    """Where checked announcements go (the checkpoint service), and the roots it watches whoever owns them."""

    def announce(self, run: str, rank: int, saved: CheckpointSaved) -> None: ...

    def configured_roots(self) -> tuple[str, ...]: ...


class Announcements:
    """One connection's checkpoint announcements, each checked off the loop, in order, one at a time.

    The check stats the announced directory, which never returns on a hung mount: one thread per
    connection at most, and a bounded queue behind it. What it logs counts against the rank's budget
    for its own events, which an agent flooding announcements would otherwise get round.
    """

    def __init__(
        self,
        peer: Peer | None,
        sink: CheckpointSink,
        tasks: set[asyncio.Task[None]],
        log_budget: TokenBucket,
    ) -> None:
        self._uid = peer.uid if peer is not None else None
        self._sink = sink
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
                self._sink.announce(run, rank, saved)
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
                    roots = self._sink.configured_roots()  # read on the loop, which owns the config
                    check = functools.partial(checked_announcement, saved.path, self._uid, saved.identity(), roots)
                    checked = await off_loop(check, "torchpulse-announcement-check")
                except Exception:  # a daemon bug costs this announcement, never the next ones
                    log.exception("checkpoint announcement check failed", run=run, rank=rank, path=cut(saved.path))
                    continue
                if isinstance(checked, str):
                    self._deliver(run, rank, saved, checked)
                elif self._log_budget.take(time.monotonic()):
                    log.warning(
                        "checkpoint announcement refused: not validated, its directory not watched",
                        run=run,
                        rank=rank,
                        path=cut(saved.path),
                        uid=self._uid,
                        reason=checked.reason,
                        fix="a [checkpoints] root in the daemon's config is watched whoever owns it",
                    )
        finally:
            self._check = None

    def _deliver(self, run: str, rank: int, saved: CheckpointSaved, path: str) -> None:
        if path != saved.path:
            if self._log_budget.take(time.monotonic()):
                log.info(
                    "checkpoint announcement found under a configured root",
                    run=run,
                    rank=rank,
                    path=cut(saved.path),
                    found=cut(path),
                )
            saved = msgspec.structs.replace(saved, path=path)
        self._sink.announce(run, rank, saved)


@dataclass(frozen=True, slots=True)
class Refused:
    """Why an announcement is not validated: its directory is not watched either."""

    reason: str


def checked_announcement(
    path: str, uid: int | None, identity: tuple[int, int] | None, roots: Sequence[str]
) -> str | Refused:
    """The daemon's path of the directory an agent of `uid` announced at `path`, or why it may not have it validated.

    Blocking (stats; a network filesystem may stall). The daemon reads with its own permissions,
    often a project group's, and exports what it finds: a job points it only at directories its
    own user owns (root's at any), and nobody's at a kernel filesystem. `identity` is (st_dev, st_ino)
    of the directory the job saved, when its agent sent it: the daemon's path must name that directory. Where
    `path` names another one here (a container's view), the directory is looked for under the configured
    `roots` by the path's trailing components.
    """
    if uid is None:
        return Refused("the announcing process cannot be identified (no SO_PEERCRED)")
    here = _here(path, identity)
    if isinstance(here, str) and identity is not None:
        found = found_under_roots(path, identity, roots)
        if found is None:
            return Refused(f"{here} (nor under any of the {len(roots)} configured roots)" if roots else here)
        path, here = found, _here(found, identity)  # resolved as the service will, the identity checked again
    if isinstance(here, str):
        return Refused(here)
    refused = _not_the_users(here, uid)
    return path if refused is None else Refused(refused)


def found_under_roots(path: str, identity: tuple[int, int], roots: Sequence[str]) -> str | None:
    """`root/suffix` for the first configured root and trailing components of `path`, longest first, that name the
    directory `identity` names; None when none does.

    A volume mounted at /ckpt in a pod is some host directory R: the job's /ckpt/run/step-1 is R/run/step-1, or
    R/ckpt/run/step-1 where R is its parent. One stat per try, a bounded number: no root's tree is walked, and
    nothing of the job's (its /proc, which may be gone or hidden) is read.
    """
    parts = PurePosixPath(normalize(path)).parts[1:][-MAX_ANNOUNCED_SUFFIX_PARTS:]
    for start in range(len(parts)):
        for root in roots:
            candidate = normalize(str(PurePosixPath(root, *parts[start:])))
            try:
                info = Path(candidate).stat()
            except (OSError, ValueError):
                continue
            if stat.S_ISDIR(info.st_mode) and (info.st_dev, info.st_ino) == identity:
                return candidate
    return None


def _here(path: str, identity: tuple[int, int] | None) -> Path | str:
    """`path` resolved here, or why it names no directory here or not the one the job saved."""
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
    return real


def _not_the_users(real: Path, uid: int) -> str | None:
    """Why the checkpoint directory `real` is not one a job of `uid` may have validated; None when it is."""
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
    "the same path in it as on the daemon's host, or list the host directory its volume comes from as a "
    "[checkpoints] root, where the daemon then finds it by the path's trailing components"
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
