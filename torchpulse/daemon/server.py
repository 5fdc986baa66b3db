"""The agent socket: an asyncio Unix-socket server speaking `torchpulse.protocol`.

A connection is an agent (Hello, then Batches) or a one-shot client
(StatusRequest). Anything else is counted as a rejected frame, answered with
an ErrorReply when the socket still works, and the connection is closed; the
server itself never stops for a bad peer.

Every user in the socket's group can connect, so what a peer may do is tied to
its uid (SO_PEERCRED): a run belongs to the user whose agents report it, and a
checkpoint announcement makes the daemon (reading with its own permissions)
validate and watch only directories of the announcing user.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import resource
import socket
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from torchpulse.aio import HeldReplies, close_connection
from torchpulse.daemon.checkpoints.announcements import Announcements, CheckpointSink
from torchpulse.daemon.connections import AgentLink, ConnectionTable
from torchpulse.daemon.control import ControlHub
from torchpulse.daemon.ctl_session import serve_ctl
from torchpulse.daemon.frames import FrameReader
from torchpulse.daemon.logs import cut
from torchpulse.daemon.peercred import Peer, peer_of
from torchpulse.daemon.registry import Registry
from torchpulse.daemon.runs import RankState, RunState
from torchpulse.daemon.socket_file import SocketFile
from torchpulse.daemon.status_replies import StatusReplies
from torchpulse.daemon.writes import StalledReader, drain
from torchpulse.limits import (
    AGENT_IDLE_TIMEOUT,
    AGENT_SOCKET_MAX_CONNECTIONS,
    AGENT_SOCKET_WRITE_TIMEOUT,
    CLIENT_RESERVE,
    FD_RESERVE,
    FIRST_FRAME_TIMEOUT,
    MAX_DETAIL_CHARS,
    MAX_STATUS_HELD_BYTES,
    REJECT_LOG_INTERVAL,
    STATUS_WRITE_CHUNK,
    STUCK_STATUS_SECONDS,
)
from torchpulse.protocol import (
    Batch,
    CommandResult,
    CtlRequest,
    ErrorReply,
    FrameError,
    Goodbye,
    Hello,
    StatusReply,
    StatusRequest,
    Welcome,
    encode,
)
from torchpulse.version import __version__

log = structlog.get_logger("torchpulse.daemon.server")

Registered = tuple[RunState, RankState]


class AgentServer:
    def __init__(
        self,
        registry: Registry,
        links: ConnectionTable,
        status: Callable[[], StatusReply],
        control: ControlHub,
        checkpoints: CheckpointSink | None = None,
    ) -> None:
        self.registry = registry
        self.links = links  # which connection speaks for each rank: this server is its one writer
        self.checkpoints = checkpoints  # announcements go there once checked
        self.status = status
        self.control = control
        self._server: asyncio.AbstractServer | None = None
        self._socket_file = SocketFile(self._serve)
        self._frames = FrameReader()
        self._last_reject_log: dict[str, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.max_connections = connection_limit()
        self._connection_ids = itertools.count(1)
        self._announcing: set[asyncio.Task[None]] = set()  # announcement checks, ended at close
        self._status_replies = StatusReplies(status)
        self._status_held = HeldReplies(MAX_STATUS_HELD_BYTES, STATUS_WRITE_CHUNK, self._status_cut_off)

    async def start(self, path: Path | None, sock: socket.socket | None = None) -> None:
        """Listen on `path`, or on an already bound socket (socket activation)."""
        if sock is None:
            assert path is not None
            self._server = await self._socket_file.listen(path)
        else:
            self._server = await asyncio.start_unix_server(self._serve, sock=sock)

    async def rebind_if_removed(self) -> None:
        """Bind the socket path again when its file went away (see `SocketFile.rebind_if_removed`)."""
        if self._server is None:
            return
        server = await self._socket_file.rebind_if_removed()
        if server is not None:
            old, self._server = self._server, server
            old.close()  # its socket file is gone: nobody can reach it; open connections stay

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            for check in list(self._announcing):
                check.cancel()
            await asyncio.gather(*self._announcing, return_exceptions=True)
            self._status_replies.close()
            await self._server.wait_closed()
        self._socket_file.remove()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        connection = next(self._connection_ids)
        peer = peer_of(writer.get_extra_info("socket"))
        registered: Registered | None = None
        announcements: Announcements | None = None
        try:
            # At the limit, a client that does not read its status reply gives way: it would hold its slot
            # until AGENT_SOCKET_WRITE_TIMEOUT while agents' hellos were refused.
            if len(self._tasks) > self.max_connections and not self._status_held.cut_off_oldest(
                stuck_for=STUCK_STATUS_SECONDS
            ):
                raise FrameError(
                    "too_many_connections", f"the daemon already holds {self.max_connections} connections; retrying"
                )
            while True:
                timeout = FIRST_FRAME_TIMEOUT if registered is None else AGENT_IDLE_TIMEOUT
                frame = await self._frames.read(reader, timeout)
                if frame is None:
                    return
                if registered is None:
                    if isinstance(frame, Hello):
                        registered, older = self._register(frame, peer, writer, connection)
                        self._welcome(frame, older, writer)
                        if self.checkpoints is not None:
                            budget = self.links.budget(registered[1]).events
                            announcements = Announcements(peer, self.checkpoints, self._announcing, budget)
                    elif isinstance(frame, StatusRequest):
                        await self._send_status(writer)
                        return
                    elif isinstance(frame, CtlRequest):
                        await serve_ctl(self.control, frame, peer, reader, writer)
                        return
                    else:
                        raise FrameError("no_hello", "the first frame of a connection must be hello")
                elif not self._owns(registered, connection):
                    return  # a newer hello for this rank took over; what is left here is stale
                elif isinstance(frame, Batch):
                    run, rank = registered
                    events = self.registry.apply(run, rank, frame)
                    self.links.budget(rank).write(run.name, rank.hello.rank, events)
                    if announcements is not None:
                        announcements.route(run.name, rank.hello.rank, events)
                elif isinstance(frame, CommandResult):
                    self.control.resolve(frame, registered[1], connection)
                elif isinstance(frame, Goodbye):
                    self.registry.goodbye(registered[1])
                    continue
                else:
                    raise FrameError("unexpected_type", f"{type(frame).__name__} is not valid after hello")
                await drain(writer)
        except FrameError as exc:
            self._reject(exc, writer, peer)
        except TimeoutError:
            reason = "timeout" if registered is None else "idle"
            self._reject(FrameError(reason, "no complete frame within the timeout"), writer, peer)
        except (ConnectionError, asyncio.CancelledError):
            pass
        except StalledReader:
            writer.transport.abort()  # a graceful close would wait for it to read, a second AGENT_SOCKET_WRITE_TIMEOUT
        except Exception as exc:  # a daemon bug must cost one connection, never the daemon
            self._reject(
                FrameError("internal_error", f"the daemon failed on this frame: {exc!r}"), writer, peer, exc_info=True
            )
        finally:
            if registered is not None:
                self._closed(registered, connection)
            await close_connection(writer, AGENT_SOCKET_WRITE_TIMEOUT)
            if task is not None:
                self._tasks.discard(task)

    def _register(
        self, hello: Hello, peer: Peer | None, writer: asyncio.StreamWriter, connection: int
    ) -> tuple[Registered, AgentLink | None]:
        """Register the rank the hello speaks for, on this connection from now on.

        Returns the rank and the connection that spoke for it until now, if one did. Nothing that can
        raise runs between the registry's connect and the claim: once the caller holds the rank, its
        close marks the rank disconnected whatever fails after.
        """
        if self.registry.connections >= self.max_connections - CLIENT_RESERVE:
            raise FrameError(
                "too_many_connections",
                f"the daemon already holds {self.registry.connections} agent connections; retrying",
            )
        run = self.registry.runs.get(hello.run)
        _refuse_another_users_run(run, hello, peer)
        previous = run.ranks.get(hello.rank) if run is not None else None
        older = self.links.link(previous) if previous is not None else None
        registered = self.registry.connect(hello, peer)
        self.links.claim(registered[1], AgentLink(connection, writer.write, writer.close))
        return registered, older

    @staticmethod
    def _welcome(hello: Hello, older: AgentLink | None, writer: asyncio.StreamWriter) -> None:
        if older is not None:
            # The older connection is dead or about to be: its frames must not
            # overwrite newer totals, nor its close mark the rank disconnected.
            older.close()
        writer.write(encode(Welcome(__version__)))
        log.info(
            "agent connected",
            run=hello.run,
            rank=hello.rank,
            pid=hello.pid,
            host=hello.host,
            torch=hello.torch_version,
        )

    def _owns(self, registered: Registered, connection: int) -> bool:
        """Whether `connection` still speaks for its rank (no newer hello took it over)."""
        run, rank = registered
        return self.registry.current(run, rank) and self.links.owns(rank, connection)

    def _closed(self, registered: Registered, connection: int) -> None:
        run, rank = registered
        owned = self._owns(registered, connection)
        if owned:
            self.links.budget(rank).report_suppressed(run.name, rank.hello.rank, time.monotonic(), final=True)
        self.registry.disconnect(run, rank, owned)
        self.links.release(rank, connection)
        self.control.disconnected(connection)
        # Without a goodbye the process crashed, failed, was killed or hangs: the journal says so
        # at the level an operator looks at (a connection a newer hello took over is no news).
        crashed = owned and not rank.exited
        (log.warning if crashed else log.info)(
            "agent disconnected",
            run=run.name,
            rank=rank.hello.rank,
            pid=rank.hello.pid,
            said_goodbye=rank.exited,
        )

    async def _send_status(self, writer: asyncio.StreamWriter) -> None:
        """The status reply, shared with the requests around this one, written as the client reads it."""
        body = await self._status_replies.next()
        self._status_held.make_room(body)
        # drain() then returns only once the transport's buffer is empty: it copies at most one chunk
        # of the shared reply, whatever the client leaves unread.
        writer.transport.set_write_buffer_limits(high=0)
        try:
            async with asyncio.timeout(AGENT_SOCKET_WRITE_TIMEOUT):
                await self._status_held.write(writer, body)
        except TimeoutError:
            raise StalledReader from None

    def _status_cut_off(self, connections: int) -> None:
        log.warning(
            "status clients cut off: they do not read their replies, and the replies held for them "
            "passed the budget or their connections the limit",
            connections=connections,
            max_held_bytes=MAX_STATUS_HELD_BYTES,
            max_connections=self.max_connections,
        )

    def _reject(self, exc: FrameError, writer: asyncio.StreamWriter, peer: Peer | None, exc_info: bool = False) -> None:
        self.registry.reject_frame(exc.reason)
        detail = cut(str(exc), MAX_DETAIL_CHARS)
        now = time.monotonic()
        if now - self._last_reject_log.get(exc.reason, -REJECT_LOG_INTERVAL) >= REJECT_LOG_INTERVAL:
            self._last_reject_log[exc.reason] = now
            log.warning(
                "rejected a frame and closed the connection",
                reason=exc.reason,
                detail=detail,
                peer_pid=peer.pid if peer else None,
                peer_uid=peer.uid if peer else None,
                exc_info=exc_info,
            )
        with contextlib.suppress(Exception):
            writer.write(encode(ErrorReply(exc.reason, detail)))


def _refuse_another_users_run(run: RunState | None, hello: Hello, peer: Peer | None) -> None:
    """A run is its user's: another user's hello may neither add a rank to it nor take one over.

    Otherwise any member of the socket's group could put series (and a rank that alerts as down)
    into someone else's run, receive the `ctl` commands meant for it, or reconnect as one of its
    ranks once that rank's connection dropped.
    """
    if run is None:
        return
    uid = peer.uid if peer is not None else None
    owner = min((other for other in run.reporting_uids if other is not None and other != uid), default=None)
    if owner is not None:
        raise FrameError(
            "run_owned",
            f"run {hello.run!r} is reported by another user (uid {owner}) on this "
            "node; give this job another run name (TORCHPULSE_RUN, --run-name); retrying",
        )


def connection_limit() -> int:
    """AGENT_SOCKET_MAX_CONNECTIONS, or fewer when the descriptor limit could not hold them."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return AGENT_SOCKET_MAX_CONNECTIONS
    return max(CLIENT_RESERVE + 1, min(AGENT_SOCKET_MAX_CONNECTIONS, soft - FD_RESERVE))


def raise_descriptor_limit() -> None:
    """Soft RLIMIT_NOFILE up to the hard one (1024 by default by hand; the unit sets 16384)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    most = AGENT_SOCKET_MAX_CONNECTIONS + FD_RESERVE
    wanted = most if hard == resource.RLIM_INFINITY else min(hard, most)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
