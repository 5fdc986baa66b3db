"""The agent's one connection to the daemon: connect, check who listens, say hello, back off, reconnect.

Before its hello the agent checks who listens (SO_PEERCRED, see `torchpulse.peer`): a socket path
another user got hold of does not receive the job's metrics nor send it commands. Only the sender
thread uses it.
"""

from __future__ import annotations

import random
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

from torchpulse.catalog import HISTOGRAM_BOUNDS
from torchpulse.framing import FrameReader
from torchpulse.paths import socket_path_too_long
from torchpulse.peer import daemon_uids, peer_credentials
from torchpulse.probes.agent.logs import get_logger
from torchpulse.protocol import ErrorReply, FrameError, Goodbye, Hello, Welcome, decode_daemon_frame, encode, utf8
from torchpulse.version import __version__

if TYPE_CHECKING:
    from torchpulse.probes.agent.agent import Agent

log = get_logger("torchpulse.agent")
# Sent in every hello of this process: with pid and host it tells the daemon a reconnecting
# process (keep its series) from a new one that got the same pid on the same host (a container
# restarted in its pod, where the job is often pid 1): that one starts from empty series.
PROCESS_STARTED_AT = time.time()
# The job's stderr says when the daemon went away and came back, but a daemon restarted again and
# again (a crash loop, a weekly upgrade over a job running for months) must not write two lines
# each time for as long as the job runs: the first few outages, then at most one an interval.
FREE_UNREACHABLE_NOTES = 3
UNREACHABLE_NOTE_INTERVAL = 3600.0
# A write to a daemon that just died raises EPIPE; without this flag it also raises SIGPIPE, which
# kills a job that restored the default disposition (common in scripts that pipe their output).
SEND_FLAGS = getattr(socket, "MSG_NOSIGNAL", 0)


class DaemonLink:
    """The socket to the daemon (None while not connected) and when to try again."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.config = agent.config
        self.sock: socket.socket | None = None
        self.reader = FrameReader()
        self._backoff = self.config.backoff_initial
        self.next_attempt = 0.0
        self._warned_unreachable = False
        self._unreachable_notes = 0
        self._last_unreachable_note = 0.0
        self.gave_up = False
        # (rank, world size) the daemon was told in the hello of the open connection.
        self.hello_identity: tuple[int, int] | None = None
        self._refusals_warned: set[str] = set()

    def due(self) -> bool:
        """Whether to try connecting now."""
        return self.sock is None and not self.gave_up and time.monotonic() >= self.next_attempt

    def connect(self) -> None:
        path = str(self.config.socket_path)
        too_long = socket_path_too_long(path)
        if too_long is not None:
            # connect() would refuse it on every retry, as a bare OSError: one clear line, no retries.
            self.gave_up = True
            log.warning(
                "the daemon's socket path is too long to connect to; training continues without metrics",
                socket=path,
                reason=too_long,
                fix="set TORCHPULSE_SOCKET to a shorter path",
            )
            return
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError as exc:  # EMFILE: the job holds every descriptor; try again later
            self.schedule_retry(exc)
            return
        sock.settimeout(self.config.connect_timeout)
        hello = self.hello()
        try:
            sock.connect(path)
            if not self._trusted_daemon(sock, path):
                sock.close()
                self.schedule_retry(None)
                return
            sock.sendall(encode(hello), SEND_FLAGS)
            reply = self._read_reply(sock)
        except (OSError, FrameError) as exc:
            sock.close()
            self.schedule_retry(exc)
            return
        if isinstance(reply, ErrorReply):
            sock.close()
            self.gave_up = reply.code == "version_mismatch"
            if reply.code not in self._refusals_warned:  # once per reason until connected: it retries for ever
                self._refusals_warned.add(reply.code)
                log.warning("daemon refused this agent", code=reply.code, message=reply.message)
            self.schedule_retry(None)
            return
        sock.settimeout(self.config.send_timeout)
        self.sock = sock
        self.hello_identity = (hello.rank, hello.world_size)
        self._backoff = self.config.backoff_initial
        # The daemon may have restarted and know nothing of us.
        self.agent.store.mark_all_dirty()
        if self._warned_unreachable:
            log.warning("reconnected to the daemon; counters continue from their running totals", socket=path)
        self._warned_unreachable = False
        self._refusals_warned.clear()

    def _trusted_daemon(self, sock: socket.socket, path: str) -> bool:
        """Whether the listener is a daemon the job may talk to; checked before the hello, which
        names the job, and before any command (a trace writes files as the job's user) can arrive."""
        credentials = peer_credentials(sock)
        trusted = daemon_uids(Path(path))
        if credentials is not None and credentials.uid in trusted:
            return True
        uid = None if credentials is None else credentials.uid
        refusal = f"untrusted daemon uid {uid} on {path}"
        if refusal not in self._refusals_warned:  # once per listener until connected: it retries for ever
            self._refusals_warned.add(refusal)
            log.warning(
                "not connecting: another user listens on the daemon's socket; training continues without "
                "metrics and the agent retries",
                socket=path,
                uid="unknown (no SO_PEERCRED)" if uid is None else uid,
                trusted=sorted(trusted),
                fix="start your own daemon, or set TORCHPULSE_SOCKET to a socket in a directory of the "
                "user whose daemon you mean",
            )
        return False

    def _read_reply(self, sock: socket.socket) -> Welcome | ErrorReply:
        deadline = time.monotonic() + self.config.connect_timeout
        reader = FrameReader()
        while time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionResetError("daemon closed the connection during the handshake")
            for body in reader.feed(chunk):
                frame = decode_daemon_frame(body)
                if isinstance(frame, Welcome | ErrorReply):
                    return frame
        raise TimeoutError("no answer to hello")

    def schedule_retry(self, exc: BaseException | None) -> None:
        if not self._warned_unreachable and exc is not None and self._may_note_unreachable():
            # The one line a job without a daemon shows on stderr.
            later = (
                {"later": f"further outages are reported at most once every {UNREACHABLE_NOTE_INTERVAL:g}s"}
                if self._unreachable_notes == FREE_UNREACHABLE_NOTES
                else {}
            )
            log.warning(
                "daemon not reachable; training continues and metrics are sent once it is up",
                socket=str(self.config.socket_path),
                error=type(exc).__name__,
                **later,
            )
            self._warned_unreachable = True
        delay = self._backoff * random.uniform(0.8, 1.2)
        self.next_attempt = time.monotonic() + delay
        self._backoff = min(self._backoff * 2, self.config.backoff_max)

    def _may_note_unreachable(self) -> bool:
        """Whether this outage gets its line (and its "reconnected" line) on the job's stderr."""
        now = time.monotonic()
        if (
            self._unreachable_notes >= FREE_UNREACHABLE_NOTES
            and now - self._last_unreachable_note < UNREACHABLE_NOTE_INTERVAL
        ):
            return False
        self._unreachable_notes += 1
        self._last_unreachable_note = now
        return True

    def hello(self) -> Hello:
        ident = self.agent.identity
        try:
            import torch

            torch_version = str(torch.__version__)
        except ImportError:
            torch_version = "unknown"
        return Hello(
            run=utf8(ident.run),
            rank=ident.rank,
            local_rank=ident.local_rank,
            world_size=ident.world_size,
            pid=ident.pid,
            host=utf8(ident.host),
            torch_version=torch_version,
            agent_version=__version__,
            command=utf8(ident.command),
            started_at=PROCESS_STARTED_AT,
            histogram_bounds=HISTOGRAM_BOUNDS,
        )

    def identity_changed(self) -> bool:
        ident = self.agent.identity
        return (ident.rank, ident.world_size) != self.hello_identity

    def rehello(self) -> None:
        """Connected before torch.distributed named this process's rank: say goodbye and connect as that rank.

        The goodbye keeps the rank it spoke for from looking crashed (see Registry.goodbye). Only the
        world size changed: no goodbye, which would give the rank up for a moment; the new hello of
        this same process takes its rank over.
        """
        ident = self.agent.identity
        log.info(
            "rank learned from torch.distributed; reconnecting as it",
            rank=ident.rank,
            world_size=ident.world_size,
            was=self.hello_identity,
        )
        if self.hello_identity is None or ident.rank != self.hello_identity[0]:
            self.send_frame(encode(Goodbye("identity")))
        self.close()
        self.connect()  # which sends every running total again, now under the new rank

    def send_frame(self, frame: bytes) -> bool:
        """Send one frame; on failure close the connection and schedule the next attempt."""
        assert self.sock is not None
        try:
            self.sock.sendall(frame, SEND_FLAGS)
            return True
        except OSError as exc:
            self.disconnect(exc)
            return False

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
            self.reader = FrameReader()

    def disconnect(self, exc: BaseException) -> None:
        self.close()
        self.schedule_retry(exc)
