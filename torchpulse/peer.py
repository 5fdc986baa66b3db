"""Who is on the other end of a Unix socket (SO_PEERCRED), and whom an agent takes for its daemon.

Shared by the daemon, which identifies its callers, and the agents, which must not hand a job's
metrics (nor take its commands) from whoever happens to listen on a socket path: under SLURM
without XDG_RUNTIME_DIR the default socket lies in `/tmp/torchpulse-UID`, which another user
can create once the job has started. No torch and no daemon imports here.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from torchpulse.paths import SYSTEM_SOCKET, user_socket_paths

_UCRED = struct.Struct("3i")


@dataclass(frozen=True)
class Credentials:
    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> Credentials | None:
    """The process at the other end (for a listening socket: the one that called listen()), or None
    when the kernel cannot tell."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except OSError:
        return None
    pid, uid, gid = _UCRED.unpack(raw)
    return Credentials(pid=pid, uid=uid, gid=gid)


def daemon_uids(socket_path: Path, env: Mapping[str, str] | None = None) -> frozenset[int]:
    """The users an agent takes for its daemon on `socket_path`.

    Root (also systemd, which listens on the service's socket) and the job's own user always;
    on the system socket also the service's user, who owns its directory or the socket (a
    container that bind-mounts only the socket file sees a directory of its own); on a path the user
    chose (neither the system socket nor a per-user default) also the owner of its directory,
    a colleague's daemon say. Not on a per-user default path: `torchpulse run` passes it on in
    TORCHPULSE_SOCKET, and its `/tmp/torchpulse-UID` may have been made by someone else.
    """
    trusted = {0, os.geteuid()}
    owned_by: tuple[Path, ...]
    if socket_path.resolve() == SYSTEM_SOCKET.resolve():
        # Only root and the service's user can create a file in /run/torchpulse (0755).
        owned_by = (SYSTEM_SOCKET.parent, SYSTEM_SOCKET)
    elif _is_user_default(socket_path, env):
        owned_by = ()
    else:
        owned_by = (socket_path.absolute().parent,)
    for path in owned_by:
        with contextlib.suppress(OSError):  # gone since the connect: nobody more to trust
            trusted.add(path.stat().st_uid)
    return frozenset(trusted)


def _is_user_default(socket_path: Path, env: Mapping[str, str] | None) -> bool:
    # As configured, not resolved: a symlink in a squatted default directory must not make the
    # path look chosen (and its target's owner trusted).
    given = Path(os.path.normpath(socket_path.absolute()))
    return any(given == default for uid in {os.getuid(), os.geteuid()} for default in user_socket_paths(env, uid))
