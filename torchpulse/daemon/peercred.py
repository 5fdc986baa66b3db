"""Who is on the other end of a Unix socket (SO_PEERCRED, SO_PEERGROUPS), and whether that process still runs."""

from __future__ import annotations

import array
import ctypes
import errno
import os
import socket
from dataclasses import dataclass

from torchpulse.peer import peer_credentials

# Not exported by Python's socket module; Linux >= 4.13.
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
# CPython's getsockopt() refuses a buffer over 1024 bytes ("buflen out of range"): 256 groups.
_PY_GETSOCKOPT_MAX = 1024
_NGROUPS_MAX = 65536  # Linux's limit on supplementary groups


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int
    groups: frozenset[int] = frozenset()


def still_running(peer: Peer | None) -> bool:
    """Whether the process that opened a connection still exists (pid from SO_PEERCRED, in our namespace).

    A connection outlives its process where a forked child inherited the socket (a DataLoader
    worker of a crashed rank): then a restarted rank takes over. Unknown (no peer credentials,
    a pid from another namespace): assume it runs.
    """
    if peer is None or peer.pid <= 0:
        return True
    try:
        os.kill(peer.pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: another user's process, alive
        return True
    return True


def _peergroups_past_python_limit(fd: int) -> bytes | None:
    """SO_PEERGROUPS through libc for a peer in more than 256 groups (the kernel said ERANGE)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        size = ctypes.c_uint32(4 * _NGROUPS_MAX)
        buffer = ctypes.create_string_buffer(size.value)
        if libc.getsockopt(fd, socket.SOL_SOCKET, SO_PEERGROUPS, buffer, ctypes.byref(size)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return buffer.raw[: size.value]


def _groups(sock: socket.socket) -> frozenset[int] | None:
    """Supplementary groups of the peer, read from the socket (works under ProtectProc=invisible).

    None when the kernel cannot tell: `control.peer_groups` then falls back to /proc.
    """
    try:
        raw: bytes | None = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, _PY_GETSOCKOPT_MAX)
    except OSError as exc:
        raw = _peergroups_past_python_limit(sock.fileno()) if exc.errno == errno.ERANGE else None
    if raw is None:
        return None
    groups = array.array("I")
    groups.frombytes(raw[: len(raw) - len(raw) % 4])
    return frozenset(groups)


def peer_of(sock: socket.socket | None) -> Peer | None:
    if sock is None or (credentials := peer_credentials(sock)) is None:
        return None
    groups = _groups(sock)
    # Known groups always include the primary one, so an empty set means "unknown" to `peer_groups`.
    known = frozenset() if groups is None else groups | {credentials.gid}
    return Peer(pid=credentials.pid, uid=credentials.uid, gid=credentials.gid, groups=known)
