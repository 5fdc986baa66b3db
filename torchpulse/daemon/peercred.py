"""Who is on the other end of a Unix socket (SO_PEERCRED)."""

from __future__ import annotations

import socket
import struct

from torchpulse.daemon.registry import Peer

_UCRED = struct.Struct("3i")


def peer_of(sock: socket.socket | None) -> Peer | None:
    if sock is None or not hasattr(socket, "SO_PEERCRED"):
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except OSError:
        return None
    pid, uid, gid = _UCRED.unpack(raw)
    return Peer(pid=pid, uid=uid, gid=gid)
