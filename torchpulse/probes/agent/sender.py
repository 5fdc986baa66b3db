"""The agent's sender thread: batch, send, reconnect with backoff, never block a step.

The training threads never touch the socket. When the daemon is absent or
slow, the cumulative state simply waits (it is keyed, so it does not grow)
and discrete events are dropped and counted once their bounded queue fills.
The connection itself (`connection.DaemonLink`) and the frames (`batches`)
are the sender's parts.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
import time
from typing import TYPE_CHECKING

from torchpulse.limits import MAX_CHUNKS_PER_READ
from torchpulse.probes.agent.batches import BatchEncoder, split
from torchpulse.probes.agent.connection import DaemonLink
from torchpulse.probes.agent.logs import get_logger
from torchpulse.probes.agent.threads import mark_agent_thread
from torchpulse.protocol import Command, CommandResult, ErrorReply, FrameError, Goodbye, decode_daemon_frame, encode

if TYPE_CHECKING:
    from torchpulse.probes.agent.agent import Agent

log = get_logger("torchpulse.agent")
# An idle agent still sends an empty batch this often, so the daemon sees it alive.
HEARTBEAT_INTERVAL = 5.0


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
        self.link = DaemonLink(agent)
        self._encoder = BatchEncoder(agent.count_oversized)
        self._last_send = 0.0
        self._goodbye = True

    # -- control from other threads ----------------------------------------
    def flush(self, timeout: float) -> bool:
        with self._flushed:
            self._flush_generation += 1
            wanted = self._flush_generation
            self.link.next_attempt = 0.0
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
        self.link.next_attempt = 0.0
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
            self.link.close()
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
            self.link.close()
            self._close_pipe()

    def _internal_error(self, exc: Exception) -> None:
        if type(exc) not in self._errors_logged:
            self._errors_logged.add(type(exc))
            log.warning("agent sender hit an internal error; reconnecting and carrying on", error=repr(exc))
        self.link.close()
        self.link.schedule_retry(None)
        # Not a busy loop if the error repeats at once (a broken wake-up pipe).
        self._stop_event.wait(min(1.0, self.config.flush_interval))

    def _wait(self, deadline: float) -> bool:
        """Sleep until the deadline, a wake-up, or daemon input; True when a full cycle is due."""
        waitables: list[int | socket.socket] = [self._wake_r]
        if self.link.sock is not None:
            waitables.append(self.link.sock)
        ready, _, _ = select.select(waitables, [], [], max(0.0, deadline - time.monotonic()))
        if self._wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 4096)
            return True
        return not ready or time.monotonic() >= deadline

    def _service_commands(self) -> None:
        """Only daemon input arrived: read commands and send any results, nothing else."""
        if self.link.sock is not None:
            self._read_incoming()

    def _cycle(self, final: bool = False) -> None:
        with self._flushed:
            generation = self._flush_generation
        self.agent.drain()
        link = self.link
        if self.agent.active and link.due():
            link.connect()
        if link.sock is not None and link.identity_changed():
            link.rehello()
        ok = link.sock is not None and self._send_changes() and self._read_incoming()
        if final and self._goodbye and link.sock is not None:
            link.send_frame(encode(Goodbye("exit")))
        with self._flushed:
            self._completed_generation = generation
            self._last_flush_ok = ok
            self._flushed.notify_all()

    # -- sending ------------------------------------------------------------
    def _send_changes(self) -> bool:
        samples, histograms = self.agent.store.take_changes()
        events = self.agent.take_events(self.config.max_pending_events)
        now = time.monotonic()
        if not (samples or histograms or events) and now - self._last_send < HEARTBEAT_INTERVAL:
            return True
        self._last_send = now
        delivered_events = 0
        for part in split(samples, histograms, events):
            for frame, part_events in self._encoder.encode(part):
                if frame is not None and not self.link.send_frame(frame):
                    self.agent.store.restore_changes(samples, histograms)
                    # Series are running totals and safe to resend; events of frames already sent are not.
                    self.agent.return_events(events[delivered_events:])
                    return False
                delivered_events += part_events
        return True

    def _send_results(self) -> None:
        results = self.agent.control.results
        while results and self.link.sock is not None:
            result = results.popleft()
            try:
                frame = encode(result)
            except (FrameError, OverflowError, TypeError, UnicodeEncodeError) as exc:
                # A bug's answer (a huge int, a stray object) must still answer, and not cost the connection.
                log.warning("command result could not be encoded", id=result.id, error=repr(exc))
                frame = encode(
                    CommandResult(result.id, False, f"internal error: answer not encodable: {exc!r}"[:500], {})
                )
            if not self.link.send_frame(frame):
                return

    def _read_incoming(self) -> bool:
        """Handle what the daemon sent without waiting for it."""
        sock = self.link.sock
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
                for body in self.link.reader.feed(chunk):
                    frame = decode_daemon_frame(body)
                    if isinstance(frame, ErrorReply):
                        log.warning("daemon reported an error", code=frame.code, message=frame.message)
                    elif isinstance(frame, Command):
                        self.agent.control.receive(frame)
                self._send_results()
            self._send_results()
        except (OSError, FrameError) as exc:
            self.link.disconnect(exc)
            return False
        return True
