"""Default locations shared by the daemon, the agents and the CLI (no torch here)."""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Final

# 9100-9999 (the Prometheus exporter range) is fully allocated; 10187 sits past
# it, where new exporters are placed. Override with --listen or `listen`.
DEFAULT_PORT: Final = 10187
DEFAULT_LISTEN: Final = f"127.0.0.1:{DEFAULT_PORT}"
# Linux's sun_path holds 108 bytes with the terminating NUL; bind() and connect() refuse a
# longer path with a bare "AF_UNIX path too long", and systemd refuses it in a socket unit.
MAX_SOCKET_PATH_BYTES: Final = 107
# Where the system service listens (systemd/torchpulse.socket).
SYSTEM_SOCKET: Final = Path("/run/torchpulse/agent.sock")


def socket_path_too_long(path: str | os.PathLike[str]) -> str | None:
    """Why `path` cannot name a Unix socket, or None when it can."""
    length = len(os.fsencode(path))
    if length <= MAX_SOCKET_PATH_BYTES:
        return None
    return (
        f"the path is {length} bytes long; a Unix socket path may have at most {MAX_SOCKET_PATH_BYTES} "
        f"bytes ({MAX_SOCKET_PATH_BYTES + 1} with the terminating NUL)"
    )


def default_socket_path(env: Mapping[str, str] | None = None, uid: int | None = None) -> Path:
    """`/run/torchpulse/agent.sock` as root, else under the user's runtime dir."""
    env = os.environ if env is None else env
    uid = os.getuid() if uid is None else uid
    if uid == 0:
        return SYSTEM_SOCKET
    runtime = env.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "torchpulse" / "agent.sock"
    return _tmp_socket_path(uid)


def _tmp_socket_path(uid: int) -> Path:
    return Path(f"/tmp/torchpulse-{uid}") / "agent.sock"


def user_socket_paths(env: Mapping[str, str] | None = None, uid: int | None = None) -> tuple[Path, ...]:
    """Where a daemon of user `uid` listens by default: under the runtime dir, or in /tmp without one."""
    uid = os.getuid() if uid is None else uid
    if uid == 0:
        return ()
    return tuple(dict.fromkeys((default_socket_path(env, uid), _tmp_socket_path(uid))))


def agent_socket_path(
    env: Mapping[str, str] | None = None, uid: int | None = None, system_socket: Path = SYSTEM_SOCKET
) -> Path:
    """Where an agent or client looks for the daemon: `TORCHPULSE_SOCKET`; else the user's own
    daemon's socket when it exists; else the system service's socket when it exists; else the
    user's default (a daemon started later in this session)."""
    env = os.environ if env is None else env
    explicit = env.get("TORCHPULSE_SOCKET")
    if explicit:
        return Path(explicit)
    uid = os.getuid() if uid is None else uid
    own = default_socket_path(env, uid)
    if own == system_socket:
        return own
    # A socket under a directory another user controls (a `/tmp/torchpulse-UID` made by someone
    # else) may be theirs: the job would send them its metrics and take their commands.
    try:
        trusted = foreign_control(own.parent, (0, uid)) is None
    except FileNotFoundError:
        trusted = True  # no socket there yet: the user's daemon makes the directory, and checks it
    except OSError:
        trusted = False
    if trusted and _is_socket(own):
        return own  # a daemon of the user's own
    # A job of any user on a node with the service installed finds it with no setting; the
    # socket unit keeps the file while the daemon restarts.
    return system_socket if _is_socket(system_socket) or not trusted else own


def foreign_control(directory: Path, trusted: tuple[int, ...]) -> str | None:
    """Why a user outside `trusted` could replace a socket in `directory`, or None when none can.

    Each directory on the way (and each symlink), as given and as resolved, must belong to a
    trusted uid and be writable by nobody else unless sticky (as /tmp is). A missing directory
    raises FileNotFoundError.
    """
    seen = [(d, d.lstat()) for d in (directory, *directory.parents)]  # as given: symlinks on the way too
    resolved = directory.resolve(strict=True)
    seen += [(d, d.stat()) for d in (resolved, *resolved.parents)]  # the directories they lead to
    for entry, info in seen:
        if info.st_uid not in trusted:
            return f"{entry} belongs to uid {info.st_uid}, who could replace the socket; choose a directory of your own"
        if (
            stat.S_ISDIR(info.st_mode)
            and info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
            and not info.st_mode & stat.S_ISVTX
        ):
            return (
                f"{entry} is writable by other users (mode {stat.S_IMODE(info.st_mode):o}), "
                "who could replace the socket"
            )
    return None


def _is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(path.stat().st_mode)
    except OSError:
        return False


def default_state_dir(env: Mapping[str, str] | None = None, uid: int | None = None) -> Path:
    env = os.environ if env is None else env
    uid = os.getuid() if uid is None else uid
    if uid == 0:
        return Path("/var/lib/torchpulse")
    base = env.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "torchpulse"
