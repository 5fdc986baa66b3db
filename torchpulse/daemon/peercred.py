"""Who is on the other end of a Unix socket (SO_PEERCRED, SO_PEERGROUPS)."""

from __future__ import annotations

import array
import socket
import struct

from torchpulse.daemon.registry import Peer

_UCRED = struct.Struct("3i")
# Not exported by Python's socket module; Linux >= 4.13.
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
_MAX_GROUPS = 1024


def _groups(sock: socket.socket) -> frozenset[int]:
    """Supplementary groups of the peer, read from the socket (works under ProtectProc=invisible)."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * _MAX_GROUPS)
    except OSError:
        return frozenset()
    groups = array.array("I")
    groups.frombytes(raw[: len(raw) - len(raw) % 4])
    return frozenset(groups)


def peer_of(sock: socket.socket | None) -> Peer | None:
    if sock is None or not hasattr(socket, "SO_PEERCRED"):
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except OSError:
        return None
    pid, uid, gid = _UCRED.unpack(raw)
    return Peer(pid=pid, uid=uid, gid=gid, groups=_groups(sock) | {gid})
