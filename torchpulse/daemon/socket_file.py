"""The agent socket's file: bound with a safe mode in a directory no other user controls, bound again when
something removed it while the daemon runs, and removed at exit only if it is still this daemon's."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path

import structlog

from torchpulse.paths import foreign_control

log = structlog.get_logger("torchpulse.daemon.server")
Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class SocketFile:
    def __init__(self, serve: Serve) -> None:
        self._serve = serve
        # The socket file this daemon bound (not one systemd passed in), and its inode.
        self._bound: tuple[Path, int] | None = None
        self._rebind_error: str | None = None

    async def listen(self, path: Path) -> asyncio.AbstractServer:
        """Bind `path` (its directory made, a stale socket removed) and remember the file as this daemon's."""
        _prepare_socket_path(path)
        server = await asyncio.start_unix_server(self._serve, path=str(path))
        # Owner and group; systemd's socket unit sets its own mode instead.
        path.chmod(0o660)
        self._bound = (path, path.lstat().st_ino)
        return server

    async def rebind_if_removed(self) -> asyncio.AbstractServer | None:
        """A new server on the socket path when its file went away (`rm -r` of its directory, a cleaner).

        Connected agents keep their connections, but without the file no agent can
        connect or reconnect and `torchpulse status` finds no daemon until a restart.
        A path that now holds something else (another daemon's socket) is left to it.
        A socket systemd passed in is systemd's to keep.
        """
        if self._bound is None:
            return None
        path, inode = self._bound
        try:
            path.lstat()
            return None  # still there: ours, or another's (logged at its bind, not stolen here)
        except FileNotFoundError:
            pass
        except OSError:
            return None
        try:
            server = await self.listen(path)
        except OSError as exc:
            if self._rebind_error != str(exc):  # logged once per reason; retried every housekeeping tick
                self._rebind_error = str(exc)
                log.error(
                    "agent socket removed while running and cannot be bound again; new agents cannot "
                    "connect until a restart",
                    path=str(path),
                    error=str(exc),
                )
            return None
        self._rebind_error = None
        log.warning("agent socket removed while running; bound again", path=str(path), old_inode=inode)
        return server

    def remove(self) -> None:
        """Remove the socket file this daemon bound, unless something else replaced it since.

        Python 3.11's unix servers leave it behind; a passed-in (socket-activated) one is
        systemd's, which keeps listening on it to start the daemon again.
        """
        if self._bound is None:
            return
        path, inode = self._bound
        self._bound = None
        with contextlib.suppress(OSError):
            st = path.lstat()
            if stat.S_ISSOCK(st.st_mode) and st.st_ino == inode:
                path.unlink()


def _prepare_socket_path(path: Path) -> None:
    """Create the directory, check that no other user controls it, and remove a stale socket of a crashed daemon."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _refuse_foreign_directories(path.parent)
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise FileExistsError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink()
    else:
        raise FileExistsError(f"another daemon is already listening on {path}")
    finally:
        probe.close()


def _refuse_foreign_directories(directory: Path) -> None:
    """PermissionError when a user other than root and the daemon's could replace the socket in `directory`.

    That user would receive every agent's hello, metrics and command answers, and could send them
    commands: a `/tmp/torchpulse-UID` another user made before this user's first daemon, say.
    """
    problem = foreign_control(directory, (0, os.geteuid()))
    if problem is not None:
        raise PermissionError(f"refusing to put the agent socket under {directory}: {problem}")
