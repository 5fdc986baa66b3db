"""The agent's sender thread: batch, send, reconnect with backoff, never block a step.

The training threads never touch the socket. When the daemon is absent or
slow, the cumulative state simply waits (it is keyed, so it does not grow)
and discrete events are dropped and counted once their bounded queue fills.

Before its hello the agent checks who listens (SO_PEERCRED, see `torchpulse.peer`): a
socket path another user got hold of does not receive the job's metrics nor send it commands.
"""

from __future__ import annotations

import contextlib
import os
import random
import select
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchpulse.catalog import HISTOGRAM_BOUNDS
from torchpulse.framing import FrameReader
from torchpulse.paths import socket_path_too_long
from torchpulse.peer import daemon_uids, peer_credentials
from torchpulse.probes.agent.logs import get_logger
from torchpulse.probes.agent.threads import mark_agent_thread
from torchpulse.protocol import (
    Batch,
    Command,
    CommandResult,
    ErrorReply,
    FieldValue,
    FrameError,
    Goodbye,
    Hello,
    HistogramSample,
    LogEvent,
    Sample,
    Welcome,
    decode_daemon_frame,
    encode,
    utf8,
)
from torchpulse.version import __version__

if TYPE_CHECKING:
    from torchpulse.probes.agent.agent import Agent

log = get_logger("torchpulse.agent")
# Items per frame: keeps usual frames far below MAX_FRAME_BYTES (larger ones are halved, see _encode).
MAX_ITEMS_PER_FRAME = 2000
Part = tuple[list[Sample], list[HistogramSample], list[LogEvent]]
# Sent in every hello of this process: with pid and host it tells the daemon a reconnecting
# process (keep its series) from a new one that got the same pid on the same host (a container
# restarted in its pod, where the job is often pid 1): that one starts from empty series.
PROCESS_STARTED_AT = time.time()
# An idle agent still sends an empty batch this often, so the daemon sees it alive.
HEARTBEAT_INTERVAL = 5.0
# The job's stderr says when the daemon went away and came back, but a daemon restarted again and
# again (a crash loop, a weekly upgrade over a job running for months) must not write two lines
# each time for as long as the job runs: the first few outages, then at most one an interval.
FREE_UNREACHABLE_NOTES = 3
UNREACHABLE_NOTE_INTERVAL = 3600.0
# Socket reads (64 KiB each) handled per call before the thread gets back to its own cycle.
MAX_CHUNKS_PER_READ = 16
# A write to a daemon that just died raises EPIPE; without this flag it also raises SIGPIPE, which
# kills a job that restored the default disposition (common in scripts that pipe their output).
SEND_FLAGS = getattr(socket, "MSG_NOSIGNAL", 0)


class Sender(threading.Thread):
    def __init__(self, agent: Agent) -> None:
        super().__init__(name="torchpulse-agent", daemon=True)
        self.agent = agent
        self.config = agent.config
        self._stop_event = threading.Event()
        # A pipe rather than an Event, so one select() waits for a wake-up and
        # for commands from the daemon at once: commands apply within ms.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._pipe_lock = threading.Lock()
        self._pipe_open = True
        self._errors_logged: set[type[BaseException]] = set()
        self._flushed = threading.Condition()
        self._flush_generation = 0
        self._completed_generation = 0
        self._last_flush_ok = False
        self._sock: socket.socket | None = None
        self._reader = FrameReader()
        self._seq = 0
        self._last_send = 0.0
        self._backoff = self.config.backoff_initial
        self._next_attempt = 0.0
        self._warned_unreachable = False
        self._unreachable_notes = 0
        self._last_unreachable_note = 0.0
        self._gave_up = False
        self.connected_once = False
        # (rank, world size) the daemon was told in the hello of the open connection.
        self._hello_identity: tuple[int, int] | None = None
        self._refusals_warned: set[str] = set()
        self._goodbye = True

    # -- control from other threads ----------------------------------------
    def flush(self, timeout: float) -> bool:
        with self._flushed:
            self._flush_generation += 1
            wanted = self._flush_generation
            self._next_attempt = 0.0
            self.wake()
            self._flushed.wait_for(lambda: self._completed_generation >= wanted, timeout)
            return self._completed_generation >= wanted and self._last_flush_ok

    def wake(self) -> None:
        with self._pipe_lock:
            if self._pipe_open:  # a closed descriptor number may be the job's file by now
                with contextlib.suppress(BlockingIOError, OSError):
                    os.write(self._wake_w, b"!")

    def stop(self, timeout: float, goodbye: bool = True) -> None:
        """End the thread after a last cycle; `goodbye`: tell the daemon this is a normal exit or detach."""
        self._goodbye = goodbye
        self._stop_event.set()
        self._next_attempt = 0.0
        self.wake()
        self.join(timeout)
        if not self.is_alive():
            self._close_pipe()

    def _close_pipe(self) -> None:
        """Close the wake-up pipe, once: by `stop`, or by the thread itself when `stop` stopped waiting for it
        (a hung daemon holds the last cycle up to send_timeout + connect_timeout): a job that attaches and
        detaches again and again must not leave two descriptors behind each time."""
        with self._pipe_lock:
            if self._pipe_open:
                self._pipe_open = False
                os.close(self._wake_r)
                os.close(self._wake_w)

    def forget_after_fork(self) -> None:
        """In a forked child (no thread runs here): close our copies of the parent's descriptors.

        Left open, a DataLoader worker keeps the parent's daemon connection alive after the parent
        died, so the daemon does not see the rank go away until every worker exits.
        """
        with contextlib.suppress(OSError):
            self._close()
        # Not under _pipe_lock: another parent thread may have held it at fork time, and it stays held here.
        self._pipe_lock = threading.Lock()
        if self._pipe_open:
            self._pipe_open = False
            for fd in (self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    os.close(fd)

    # -- the thread ---------------------------------------------------------
    def run(self) -> None:
        mark_agent_thread()
        next_flush = time.monotonic() + self.config.flush_interval
        while not self._stop_event.is_set():
            try:
                if self._wait(next_flush):
                    next_flush = time.monotonic() + self.config.flush_interval
                    self._cycle()
                else:
                    self._service_commands()
            except Exception as exc:  # a bug here must cost one cycle, never the job's metrics for good
                self._internal_error(exc)
                next_flush = time.monotonic() + self.config.flush_interval
        try:
            self._cycle(final=True)
        except Exception as exc:
            self._internal_error(exc)
        finally:
            self._close()
            self._close_pipe()

    def _internal_error(self, exc: Exception) -> None:
        if type(exc) not in self._errors_logged:
            self._errors_logged.add(type(exc))
            log.warning("agent sender hit an internal error; reconnecting and carrying on", error=repr(exc))
        self._close()
        self._schedule_retry(str(self.config.socket_path), None)
        # Not a busy loop if the error repeats at once (a broken wake-up pipe).
        self._stop_event.wait(min(1.0, self.config.flush_interval))

    def _wait(self, deadline: float) -> bool:
        """Sleep until the deadline, a wake-up, or daemon input; True when a full cycle is due."""
        waitables: list[Any] = [self._wake_r]
        if self._sock is not None:
            waitables.append(self._sock)
        ready, _, _ = select.select(waitables, [], [], max(0.0, deadline - time.monotonic()))
        if self._wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 4096)
            return True
        return not ready or time.monotonic() >= deadline

    def _service_commands(self) -> None:
        """Only daemon input arrived: read commands and send any results, nothing else."""
        if self._sock is not None:
            self._read_incoming()

    def _cycle(self, final: bool = False) -> None:
        with self._flushed:
            generation = self._flush_generation
        self.agent.drain()
        if self._sock is None and self.agent.active and not self._gave_up and time.monotonic() >= self._next_attempt:
            self._connect()
        if self._sock is not None and self._identity_changed():
            self._rehello()
        ok = self._sock is not None and self._send_changes() and self._read_incoming()
        if final and self._goodbye and self._sock is not None:
            self._send_frame(encode(Goodbye("exit")))
        with self._flushed:
            self._completed_generation = generation
            self._last_flush_ok = ok
            self._flushed.notify_all()

    # -- connection ---------------------------------------------------------
    def _connect(self) -> None:
        path = str(self.config.socket_path)
        too_long = socket_path_too_long(path)
        if too_long is not None:
            # connect() would refuse it on every retry, as a bare OSError: one clear line, no retries.
            self._gave_up = True
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
            self._schedule_retry(path, exc)
            return
        sock.settimeout(self.config.connect_timeout)
        hello = self._hello()
        try:
            sock.connect(path)
            if not self._trusted_daemon(sock, path):
                sock.close()
                self._schedule_retry(path, None)
                return
            sock.sendall(encode(hello), SEND_FLAGS)
            reply = self._read_reply(sock)
        except (OSError, FrameError) as exc:
            sock.close()
            self._schedule_retry(path, exc)
            return
        if isinstance(reply, ErrorReply):
            sock.close()
            self._gave_up = reply.code == "version_mismatch"
            if reply.code not in self._refusals_warned:  # once per reason until connected: it retries for ever
                self._refusals_warned.add(reply.code)
                log.warning("daemon refused this agent", code=reply.code, message=reply.message)
            self._schedule_retry(path, None)
            return
        sock.settimeout(self.config.send_timeout)
        self._sock = sock
        self._hello_identity = (hello.rank, hello.world_size)
        self._backoff = self.config.backoff_initial
        # The daemon may have restarted and know nothing of us.
        self.agent.store.mark_all_dirty()
        if self._warned_unreachable:
            log.warning("reconnected to the daemon; counters continue from their running totals", socket=path)
        self._warned_unreachable = False
        self._refusals_warned.clear()
        self.connected_once = True

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

    def _schedule_retry(self, path: str, exc: BaseException | None) -> None:
        if not self._warned_unreachable and exc is not None and self._may_note_unreachable():
            # The one line a job without a daemon shows on stderr.
            later = (
                {"later": f"further outages are reported at most once every {UNREACHABLE_NOTE_INTERVAL:g}s"}
                if self._unreachable_notes == FREE_UNREACHABLE_NOTES
                else {}
            )
            log.warning(
                "daemon not reachable; training continues and metrics are sent once it is up",
                socket=path,
                error=type(exc).__name__,
                **later,
            )
            self._warned_unreachable = True
        delay = self._backoff * random.uniform(0.8, 1.2)
        self._next_attempt = time.monotonic() + delay
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

    def _hello(self) -> Hello:
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

    def _identity_changed(self) -> bool:
        ident = self.agent.identity
        return (ident.rank, ident.world_size) != self._hello_identity

    def _rehello(self) -> None:
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
            was=self._hello_identity,
        )
        if self._hello_identity is None or ident.rank != self._hello_identity[0]:
            self._send_frame(encode(Goodbye("identity")))
        self._close()
        self._connect()  # which sends every running total again, now under the new rank

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            self._reader = FrameReader()

    def _disconnect(self, exc: BaseException) -> None:
        self._close()
        self._schedule_retry(str(self.config.socket_path), exc)

    # -- sending ------------------------------------------------------------
    def _send_changes(self) -> bool:
        samples, histograms = self.agent.store.take_changes()
        events = self.agent.take_events(self.config.max_pending_events)
        now = time.monotonic()
        if not (samples or histograms or events) and now - self._last_send < HEARTBEAT_INTERVAL:
            return True
        self._last_send = now
        delivered_events = 0
        for part in _split(samples, histograms, events):
            for frame, part_events in self._encode(part):
                if frame is not None and not self._send_frame(frame):
                    self.agent.store.restore_changes(samples, histograms)
                    # Series are running totals and safe to resend; events of frames already sent are not.
                    self.agent.return_events(events[delivered_events:])
                    return False
                delivered_events += part_events
        return True

    def _encode(self, part: Part) -> list[tuple[bytes | None, int]]:
        """Frames for `part` with the events each carries; a frame over MAX_FRAME_BYTES is halved.

        MAX_ITEMS_PER_FRAME keeps usual batches small, but 2,000 events with 4 KiB details (a
        recompile storm's guard texts) exceed the daemon's frame limit: sent whole, the batch
        would fail to encode, and its events be lost uncounted with the connection reset.
        One item that alone exceeds it is dropped and counted (None in place of its frame).
        """
        self._seq += 1
        batch = Batch(self._seq, time.time(), *part)
        try:
            try:
                return [(encode(batch), len(part[2]))]
            except UnicodeEncodeError:
                # A surrogate-escaped byte from argv, a path or the environment: sent as "?".
                return [(encode(_utf8_batch(batch)), len(part[2]))]
        except FrameError:
            if len(part[0]) + len(part[1]) + len(part[2]) <= 1:
                self.agent.count_oversized()
                return [(None, len(part[2]))]
            first, second = _halves(part)
            return self._encode(first) + self._encode(second)

    def _send_results(self) -> None:
        results = self.agent.control.results
        while results and self._sock is not None:
            result = results.popleft()
            try:
                frame = encode(result)
            except (FrameError, OverflowError, TypeError, UnicodeEncodeError) as exc:
                # A bug's answer (a huge int, a stray object) must still answer, and not cost the connection.
                log.warning("command result could not be encoded", id=result.id, error=repr(exc))
                frame = encode(
                    CommandResult(result.id, False, f"internal error: answer not encodable: {exc!r}"[:500], {})
                )
            if not self._send_frame(frame):
                return

    def _send_frame(self, frame: bytes) -> bool:
        assert self._sock is not None
        try:
            self._sock.sendall(frame, SEND_FLAGS)
            return True
        except OSError as exc:
            self._disconnect(exc)
            return False

    def _read_incoming(self) -> bool:
        """Handle what the daemon sent without waiting for it."""
        sock = self._sock
        assert sock is not None
        try:
            # Bounded, and answers go out chunk by chunk: a peer that streams commands
            # gets back-pressure instead of a sender thread that never cycles again
            # and answers that pile up in the job's memory.
            for _ in range(MAX_CHUNKS_PER_READ):
                if not select.select([sock], [], [], 0)[0]:
                    break
                chunk = sock.recv(65536)
                if not chunk:
                    raise ConnectionResetError("daemon closed the connection")
                for body in self._reader.feed(chunk):
                    frame = decode_daemon_frame(body)
                    if isinstance(frame, ErrorReply):
                        log.warning("daemon reported an error", code=frame.code, message=frame.message)
                    elif isinstance(frame, Command):
                        self.agent.control.receive(frame)
                self._send_results()
            self._send_results()
        except (OSError, FrameError) as exc:
            self._disconnect(exc)
            return False
        return True


def _utf8_value(value: FieldValue) -> FieldValue:
    return utf8(value) if isinstance(value, str) else value


def _utf8_batch(batch: Batch) -> Batch:
    return Batch(
        batch.seq,
        batch.sent_at,
        [Sample(utf8(s.family), tuple(utf8(v) for v in s.labels), s.value) for s in batch.samples],
        [
            HistogramSample(utf8(h.family), tuple(utf8(v) for v in h.labels), h.bucket_counts, h.total)
            for h in batch.histograms
        ],
        [
            LogEvent(e.ts, utf8(e.level), utf8(e.event), {utf8(k): _utf8_value(v) for k, v in e.fields.items()})
            for e in batch.events
        ],
    )


def _split(samples: list[Sample], histograms: list[HistogramSample], events: list[LogEvent]) -> list[Part]:
    if len(samples) + len(histograms) + len(events) <= MAX_ITEMS_PER_FRAME:
        return [(samples, histograms, events)]
    n = MAX_ITEMS_PER_FRAME
    parts: list[Part] = []
    parts += [(samples[i : i + n], [], []) for i in range(0, len(samples), n)]
    parts += [([], histograms[i : i + n], []) for i in range(0, len(histograms), n)]
    parts += [([], [], events[i : i + n]) for i in range(0, len(events), n)]
    return parts


def _halves(part: Part) -> tuple[Part, Part]:
    """The items of `part` cut in two at the middle, in order (events keep theirs)."""
    samples, histograms, events = part
    rest = (len(samples) + len(histograms) + len(events)) // 2
    head_samples = samples[:rest]
    rest -= len(head_samples)
    head_histograms = histograms[:rest]
    rest -= len(head_histograms)
    head_events = events[:rest]
    return (
        (head_samples, head_histograms, head_events),
        (samples[len(head_samples) :], histograms[len(head_histograms) :], events[len(head_events) :]),
    )
