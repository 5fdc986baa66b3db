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
import os
import resource
import socket
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

import structlog

from torchpulse.aio import HeldReplies, close_connection
from torchpulse.daemon.checkpoints.announcements import Announcements
from torchpulse.daemon.control import ControlHub, NotAuthorized, logged_ranks
from torchpulse.daemon.log_settings import LOG_LEVELS
from torchpulse.daemon.logs import MAX_NAME_CHARS, bounded_fields, cut
from torchpulse.daemon.peercred import peer_of
from torchpulse.daemon.registry import NODE_LOG_EVENT, Peer, RankState, Registry, RunState
from torchpulse.paths import foreign_control
from torchpulse.protocol import (
    HEADER_SIZE,
    Batch,
    CheckpointSaved,
    CommandResult,
    CtlReply,
    CtlRequest,
    ErrorReply,
    FrameError,
    Goodbye,
    Hello,
    LogEvent,
    StatusReply,
    StatusRequest,
    Welcome,
    decode_agent_frame,
    encode,
    parse_header,
)
from torchpulse.version import __version__

log = structlog.get_logger("torchpulse.daemon.server")
# A peer that connects and says nothing is dropped after this long.
FIRST_FRAME_TIMEOUT: Final = 10.0
# Once a header arrived, its body must follow within this long: a peer cannot park
# a half-sent frame (up to MAX_FRAME_BYTES of buffer) on a connection for ever.
FRAME_BODY_TIMEOUT: Final = 30.0
# An agent sends at least a heartbeat every 5 s; one silent this long is gone
# (a frozen host, a half-open socket) and its connection slot is freed.
AGENT_IDLE_TIMEOUT: Final = 120.0
# Connections held at once, whatever their state: past it a new one is refused,
# before the daemon runs out of descriptors (then it could not even answer
# `torchpulse status` or a scrape). Lowered to fit RLIMIT_NOFILE.
MAX_CONNECTIONS: Final = 1024
FD_RESERVE: Final = 128  # descriptors kept for scrapes, the state store, watchers, workers
# Of those, agents may hold all but these, so `torchpulse status` and `ctl` get in
# while a flood of hellos holds the rest.
CLIENT_RESERVE: Final = 32
# Bodies of large frames being read, all connections together. Such a frame waits
# for room (one may always proceed alone, so no size starves). Small frames skip
# the wait: StreamReader holds at most ~128 KiB per connection besides a pending
# body, so an agent's usual batches never queue behind a peer parking big ones.
MAX_BUFFERED_BYTES: Final = 64 << 20
SMALL_FRAME_BYTES: Final = 64 << 10
# A peer that stops reading what the daemon sends it (a status reply of thousands of ranks)
# is cut off after this long: blocked in drain() or in a graceful close, its connection would
# hold a descriptor, a connection slot and the unsent reply for ever.
WRITE_TIMEOUT: Final = 10.0
# A status reply of thousands of ranks takes the loop tens of milliseconds to build: one build serves every
# StatusRequest read before it starts, and the next one waits as long as the last took (at most this long).
# Each request had its own build: a crowd of `torchpulse status`, or a peer sending StatusRequest on ~1,000
# connections, held agents' hellos and batches for seconds. The loop now spends at most about half of its
# time on status however many ask, and no reply is older than the request it answers.
MAX_STATUS_SPACING: Final = 5.0
# Status replies held for clients that have not read them yet, all connections together (see HeldReplies).
# Each connection that sent StatusRequest and never read held its whole reply in its transport until
# WRITE_TIMEOUT (1,000 connections: hundreds of megabytes). A reply is at most MAX_FRAME_BYTES (4 MiB).
MAX_STATUS_HELD_BYTES: Final = 64 << 20
STATUS_WRITE_CHUNK: Final = 64 << 10
# At the connection limit, a status client still writing after this long gives way to a new connection.
STUCK_STATUS_SECONDS: Final = 1.0
# Rejection warnings are rate-limited: a hostile client must not flood the journal.
REJECT_LOG_INTERVAL: Final = 10.0
# A rejection's detail can quote the frame (msgspec names an unknown type by its value): cut in the
# log line and in the answer, so a peer gets back no megabyte it sent.
MAX_DETAIL_CHARS: Final = 1000
# While a rank's log events are suppressed (see RankState.log_budget), how often the daemon says how many.
SUPPRESSED_REPORT_INTERVAL: Final = 60.0
# Names an agent's event field cannot have: who sent it, and the logger's own parameters.
RESERVED_FIELDS: Final = {
    "event",
    "run",
    "rank",
    "agent_ts",
    "level",
    "timestamp",
    "self",
    "exc_info",
    "exception",
    "stack_info",
}


class StalledReader(Exception):
    """The peer did not take what was written to it within WRITE_TIMEOUT."""


async def drain(writer: asyncio.StreamWriter) -> None:
    """`writer.drain()`, bounded by WRITE_TIMEOUT."""
    try:
        async with asyncio.timeout(WRITE_TIMEOUT):
            await writer.drain()
    except TimeoutError:
        raise StalledReader from None


class StatusReplies:
    """Encoded status replies, built on the loop: one build for all the requests waiting when it starts."""

    def __init__(self, status: Callable[[], StatusReply]) -> None:
        self._status = status
        self._pending: asyncio.Future[bytes] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._not_before = 0.0  # loop time: the last build's end plus its duration

    async def next(self) -> bytes:
        """A reply built after this call (so it shows whatever the caller saw happen before asking)."""
        if self._pending is None:
            loop = asyncio.get_running_loop()
            self._pending = loop.create_future()
            self._timer = loop.call_at(max(loop.time(), self._not_before), self._build)
        # Shielded: one waiter's connection ending (its task cancelled) must not cancel the others' reply.
        return await asyncio.shield(self._pending)

    def _build(self) -> None:
        pending, self._pending, self._timer = self._pending, None, None
        assert pending is not None
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            body = encode(self._status())
        except Exception as exc:  # an oversized reply (FrameError), a daemon bug: each waiter reports it
            pending.set_exception(exc)
        else:
            pending.set_result(body)
        end = loop.time()
        self._not_before = end + min(end - start, MAX_STATUS_SPACING)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._pending is not None:
            self._pending.cancel()
        self._pending = self._timer = None


class AgentServer:
    def __init__(
        self,
        registry: Registry,
        status: Callable[[], StatusReply],
        control: ControlHub,
        on_checkpoint: Callable[[str, int, CheckpointSaved], None] | None = None,
    ) -> None:
        self.registry = registry
        self.on_checkpoint = on_checkpoint
        self.status = status
        self.control = control
        self._server: asyncio.AbstractServer | None = None
        # The socket file this daemon bound (not one systemd passed in), and its inode.
        self._bound: tuple[Path, int] | None = None
        self._rebind_error: str | None = None
        self._last_reject_log: dict[str, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.max_connections = connection_limit()
        self._connection_ids = itertools.count(1)
        self._announcing: set[asyncio.Task[None]] = set()  # announcement checks, ended at close
        self._buffered = 0
        self._buffer_freed = asyncio.Event()
        self._status_replies = StatusReplies(status)
        self._status_held = HeldReplies(MAX_STATUS_HELD_BYTES, STATUS_WRITE_CHUNK, self._status_cut_off)

    async def start(self, path: Path | None, sock: socket.socket | None = None) -> None:
        """Listen on `path`, or on an already bound socket (socket activation)."""
        if sock is None:
            assert path is not None
            self._server = await self._listen_at(path)
        else:
            self._server = await asyncio.start_unix_server(self._serve, sock=sock)

    async def _listen_at(self, path: Path) -> asyncio.AbstractServer:
        """Bind `path` (its directory made, a stale socket removed) and remember the file as this daemon's."""
        _prepare_socket_path(path)
        server = await asyncio.start_unix_server(self._serve, path=str(path))
        # Owner and group; systemd's socket unit sets its own mode instead.
        path.chmod(0o660)
        self._bound = (path, path.lstat().st_ino)
        return server

    async def rebind_if_removed(self) -> None:
        """Bind the socket path again when its file went away (`rm -r` of its directory, a cleaner).

        Connected agents keep their connections, but without the file no agent can
        connect or reconnect and `torchpulse status` finds no daemon until a restart.
        A path that now holds something else (another daemon's socket) is left to it.
        A socket systemd passed in is systemd's to keep.
        """
        if self._bound is None or self._server is None:
            return
        path, inode = self._bound
        try:
            path.lstat()
            return  # still there: ours, or another's (logged at its bind, not stolen here)
        except FileNotFoundError:
            pass
        except OSError:
            return
        try:
            server = await self._listen_at(path)
        except OSError as exc:
            if self._rebind_error != str(exc):  # logged once per reason; retried every housekeeping tick
                self._rebind_error = str(exc)
                log.error(
                    "agent socket removed while running and cannot be bound again; new agents cannot "
                    "connect until a restart",
                    path=str(path),
                    error=str(exc),
                )
            return
        self._rebind_error = None
        old, self._server = self._server, server
        old.close()  # its socket file is gone: nobody can reach it; open connections stay
        log.warning("agent socket removed while running; bound again", path=str(path), old_inode=inode)

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
        if self._bound is not None:
            _remove_own_socket(*self._bound)
            self._bound = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        connection = next(self._connection_ids)
        peer = peer_of(writer.get_extra_info("socket"))
        registered: tuple[RunState, RankState] | None = None
        announcements: Announcements | None = None
        try:
            # At the limit, a client that does not read its status reply gives way: it would hold its slot
            # until WRITE_TIMEOUT while agents' hellos were refused.
            if len(self._tasks) > self.max_connections and not self._status_held.cut_off_oldest(
                stuck_for=STUCK_STATUS_SECONDS
            ):
                raise FrameError(
                    "too_many_connections", f"the daemon already holds {self.max_connections} connections; retrying"
                )
            while True:
                timeout = FIRST_FRAME_TIMEOUT if registered is None else AGENT_IDLE_TIMEOUT
                frame = await self._read_frame(reader, timeout)
                if frame is None:
                    return
                if registered is None:
                    if isinstance(frame, Hello):
                        if self.registry.connections >= self.max_connections - CLIENT_RESERVE:
                            raise FrameError(
                                "too_many_connections",
                                f"the daemon already holds {self.registry.connections} agent connections; retrying",
                            )
                        _refuse_another_users_run(self.registry.runs.get(frame.run), frame, peer)
                        registered = self.registry.connect(frame, peer)
                        state = registered[1]
                        if self.on_checkpoint is not None:
                            announcements = Announcements(peer, self.on_checkpoint, self._announcing, state.log_budget)
                        state.channel, state.close, state.connection = writer.write, writer.close, connection
                        writer.write(encode(Welcome(__version__)))
                        log.info(
                            "agent connected",
                            run=frame.run,
                            rank=frame.rank,
                            pid=frame.pid,
                            host=frame.host,
                            torch=frame.torch_version,
                        )
                    elif isinstance(frame, StatusRequest):
                        await self._send_status(writer)
                        return
                    elif isinstance(frame, CtlRequest):
                        await self._ctl(frame, peer, reader, writer)
                        return
                    else:
                        raise FrameError("no_hello", "the first frame of a connection must be hello")
                elif not self.registry.owns(*registered, connection):
                    return  # a newer hello for this rank took over; what is left here is stale
                elif isinstance(frame, Batch):
                    run, rank = registered
                    events = self.registry.apply(run, rank, frame)
                    self._log_events(run.name, rank, events)
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
            writer.transport.abort()  # a graceful close would wait for it to read, a second WRITE_TIMEOUT
        except Exception as exc:  # a daemon bug must cost one connection, never the daemon
            self._reject(
                FrameError("internal_error", f"the daemon failed on this frame: {exc!r}"), writer, peer, exc_info=True
            )
        finally:
            if registered is not None:
                run, rank = registered
                owned = self.registry.owns(run, rank, connection)
                if owned:
                    _report_suppressed(run.name, rank, time.monotonic(), final=True)
                self.registry.disconnect(run, rank, connection)
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
            await close_connection(writer, WRITE_TIMEOUT)
            if task is not None:
                self._tasks.discard(task)

    async def _send_status(self, writer: asyncio.StreamWriter) -> None:
        """The status reply, shared with the requests around this one, written as the client reads it."""
        body = await self._status_replies.next()
        self._status_held.make_room(body)
        # drain() then returns only once the transport's buffer is empty: it copies at most one chunk
        # of the shared reply, whatever the client leaves unread.
        writer.transport.set_write_buffer_limits(high=0)
        try:
            async with asyncio.timeout(WRITE_TIMEOUT):
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

    async def _ctl(
        self, request: CtlRequest, peer: Peer | None, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        # A ctl client sends one frame, then only waits: the end of its stream means it hung up (Ctrl-C). The
        # command is then dropped here at once: waiting on for a hung rank's answer (up to an hour) held one of
        # the connections kept for status and ctl, so a few abandoned commands could lock operators out.
        reached: list[int] = []
        handling = asyncio.ensure_future(self.control.handle(request, peer, reached))
        hangup = asyncio.ensure_future(reader.read(1))
        sent_more = False
        try:
            await asyncio.wait((handling, hangup), return_when=asyncio.FIRST_COMPLETED)
        finally:
            hangup.cancel()
            if hangup.done() and not hangup.cancelled():
                # A reset connection is a hang-up too (retrieved, so asyncio does not log it); bytes are not.
                sent_more = hangup.exception() is None and bool(hangup.result())
            if not handling.done():
                handling.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await handling  # unwinds at once: its commands leave the table of answers awaited
        if handling.cancelled() and sent_more:
            # Not a hang-up: a client that is still there is told why it gets no answer.
            raise FrameError(
                "unexpected_type",
                "a ctl connection carries one request and then waits for the "
                f"reply, but more bytes followed it: the {cut(request.name, MAX_NAME_CHARS)!r} "
                f"command for run {cut(request.run, MAX_NAME_CHARS)!r} was dropped (ranks it "
                "reached may still apply it)",
            )
        if handling.cancelled():
            log.info(
                "command abandoned by its client; ranks it reached may still apply it",
                command=cut(request.name, MAX_NAME_CHARS),
                run=cut(request.run, MAX_NAME_CHARS),
                ranks_reached=logged_ranks(reached),
                uid=peer.uid if peer else None,
                pid=peer.pid if peer else None,
            )
            return
        try:
            reply: CtlReply | ErrorReply = handling.result()
        except NotAuthorized as exc:
            log.warning(
                "command refused",
                command=cut(request.name, MAX_NAME_CHARS),
                run=cut(request.run, MAX_NAME_CHARS),
                uid=peer.uid if peer else None,
                pid=peer.pid if peer else None,
                reason=str(exc),
            )
            reply = ErrorReply("not_authorized", str(exc))
        writer.write(encode(reply))
        await drain(writer)

    async def _read_frame(self, reader: asyncio.StreamReader, timeout: float) -> object | None:
        try:
            async with asyncio.timeout(timeout):
                header = await reader.readexactly(HEADER_SIZE)
            length = parse_header(header)
            async with asyncio.timeout(FRAME_BODY_TIMEOUT):
                await self._reserve(length)
                try:
                    body = await reader.readexactly(length)
                finally:
                    self._release(length)
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                raise FrameError("truncated", "connection closed in the middle of a frame") from None
            return None
        return decode_agent_frame(body)

    async def _reserve(self, length: int) -> None:
        if length <= SMALL_FRAME_BYTES:
            return
        while self._buffered and self._buffered + length > MAX_BUFFERED_BYTES:
            self._buffer_freed.clear()
            await self._buffer_freed.wait()
        self._buffered += length

    def _release(self, length: int) -> None:
        if length <= SMALL_FRAME_BYTES:
            return
        self._buffered -= length
        self._buffer_freed.set()

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

    @staticmethod
    def _log_events(run: str, state: RankState, events: list[LogEvent]) -> None:
        now = time.monotonic()
        for event in events:
            budget = state.node_log_budget if event.event == NODE_LOG_EVENT else state.log_budget
            if not budget.take(now):
                continue
            level = event.level if event.level in LOG_LEVELS else "info"
            # An agent's field must not override who sent it.
            fields = {(f"field_{k}" if k in RESERVED_FIELDS else k): v for k, v in event.fields.items()}
            getattr(log, level)(
                cut(event.event, MAX_NAME_CHARS),
                run=run,
                rank=state.hello.rank,
                agent_ts=event.ts,
                **bounded_fields(fields),
            )
        _report_suppressed(run, state, now)


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


def _report_suppressed(run: str, state: RankState, now: float, final: bool = False) -> None:
    """One line per interval (and one when the rank leaves) saying how many of its events were not written."""
    suppressed = state.log_budget.suppressed + state.node_log_budget.suppressed
    if not suppressed or (not final and now - state.suppressed_reported_at < SUPPRESSED_REPORT_INTERVAL):
        return
    log.warning(
        "agent log events suppressed: this rank sends more than the daemon writes",
        run=run,
        rank=state.hello.rank,
        suppressed=suppressed,
        autograd_node=state.node_log_budget.suppressed,
        burst=state.log_budget.burst,
        per_second=state.log_budget.rate,
    )
    state.log_budget.suppressed = state.node_log_budget.suppressed = 0
    state.suppressed_reported_at = now


def connection_limit() -> int:
    """MAX_CONNECTIONS, or fewer when the descriptor limit could not hold them."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(CLIENT_RESERVE + 1, min(MAX_CONNECTIONS, soft - FD_RESERVE))


def raise_descriptor_limit() -> None:
    """Soft RLIMIT_NOFILE up to the hard one (1024 by default by hand; the unit sets 16384)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = MAX_CONNECTIONS + FD_RESERVE if hard == resource.RLIM_INFINITY else min(hard, MAX_CONNECTIONS + FD_RESERVE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def _remove_own_socket(path: Path, inode: int) -> None:
    """Remove the socket file this daemon bound, unless something else replaced it since.

    Python 3.11's unix servers leave it behind; a passed-in (socket-activated) one is
    systemd's, which keeps listening on it to start the daemon again.
    """
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
