"""The daemon's lifecycle: listeners, housekeeping, signals, reload, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from torchpulse.daemon import config as config_module
from torchpulse.daemon import logs, systemd
from torchpulse.daemon.checkpoints import config as checkpoint_config
from torchpulse.daemon.checkpoints.service import CheckpointService
from torchpulse.daemon.config import Config, ConfigError, Overrides, parse_listen
from torchpulse.daemon.connections import ConnectionTable
from torchpulse.daemon.control import ControlHub
from torchpulse.daemon.offloop import off_loop
from torchpulse.daemon.registry import Registry
from torchpulse.daemon.server import AgentServer
from torchpulse.exporters.collectors.checkpoints import CheckpointCollector
from torchpulse.exporters.http import MetricsServer
from torchpulse.exporters.prometheus import build_exposition
from torchpulse.exporters.textfile import remove_textfile, write_textfile
from torchpulse.protocol import RankStatus, RunStatus, StatusReply
from torchpulse.version import __version__

log = structlog.get_logger("torchpulse.daemon")
HOUSEKEEPING_INTERVAL = 1.0
STATUS_INTERVAL = 15.0
# How long a stop waits for the textfile's last write and its removal (a hung mount gives up).
TEXTFILE_STOP_SECONDS = 5.0


def _no_checkpoint_summary() -> tuple[int, int]:
    return 0, 0


@dataclass
class Daemon:
    config: Config
    config_path: Path | None = None
    inherited_socket: socket.socket | None = None
    overrides: Overrides = field(default_factory=Overrides)
    registry: Registry = field(init=False)
    on_ready: list[Callable[[Daemon], None]] = field(default_factory=list)
    # (checkpoint roots, roots whose latest checkpoint is not valid), for STATUS=.
    checkpoint_summary: Callable[[], tuple[int, int]] = _no_checkpoint_summary

    def __post_init__(self) -> None:
        runs = self.config.runs
        self.registry = Registry(
            runs.series_limit_per_run,
            runs.grace_period_seconds,
            runs.max_runs,
            runs.max_ranks_per_run,
            runs.lost_grace_period_seconds,
        )
        self.checkpoints = CheckpointService(checkpoint_config.from_config(self.config), self.config.daemon.state_dir)
        if self.checkpoint_summary is _no_checkpoint_summary:
            self.checkpoint_summary = self.checkpoints.summary
        self.exposition = build_exposition(
            self.registry, extra=[CheckpointCollector(self.checkpoints.stats, self.checkpoints.state_persistent)]
        )
        links = ConnectionTable()
        self.control = ControlHub(self.registry, links, lambda: self.config.daemon.control_group)
        self.agents = AgentServer(self.registry, links, self.status, self.control, checkpoints=self.checkpoints)
        self.metrics = MetricsServer(self.exposition)
        self._stopping = asyncio.Event()
        self._reload_requested = False
        # The textfile write in flight: in a thread, so a hung textfile mount never stalls the loop.
        self._textfile_write: asyncio.Future[None] | None = None
        self._textfile_stalled = False
        # Removals of a textfile output that a reload renamed or switched off.
        self._textfile_removals: set[asyncio.Task[None]] = set()
        self.started = time.monotonic()

    def status(self) -> StatusReply:
        now = time.monotonic()
        runs = [
            RunStatus(
                run=run.name,
                world_size=run.info.world_size if run.info else 0,
                ended=run.ended_at is not None,
                ranks=[
                    RankStatus(
                        rank=rank,
                        pid=st.hello.pid,
                        host=st.hello.host,
                        connected=st.connected,
                        exited=st.exited,
                        events_received=st.events_received,
                        events_dropped=st.events_dropped,
                        last_seen_seconds_ago=round(now - st.last_seen, 3),
                    )
                    for rank, st in sorted(run.ranks.items())
                ],
            )
            for run in self.registry.runs.values()
        ]
        return StatusReply(
            daemon_version=__version__,
            uptime_seconds=round(now - self.started, 3),
            pid=os.getpid(),
            events_received=self.registry.events_received,
            frames_rejected=dict(self.registry.frames_rejected),
            runs=runs,
        )

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.stop)
        loop.add_signal_handler(signal.SIGINT, self.stop)
        loop.add_signal_handler(signal.SIGHUP, self._request_reload)
        daemon_cfg = self.config.daemon
        host, port = parse_listen(daemon_cfg.listen)
        try:
            await self.agents.start(daemon_cfg.socket, self.inherited_socket)
            await self.metrics.start(host, port)
            # Opens (and makes) the state directory; a daemon that cannot write it stays up, says so once, and
            # exports torchpulse_daemon_state_persistent 0: a refused start would lose the metrics and agents too.
            await self.checkpoints.start()
        except BaseException:
            # A failed start (the metrics port taken, usually): the socket file bound above would stay behind,
            # and agents would get "connection refused" from a dead socket instead of "no daemon". A textfile
            # that a killed daemon left goes too: node_exporter would serve its agent_up 1 and frozen counters
            # for as long as the restart loop lasts.
            await self.metrics.close()
            await self.agents.close()
            await self._remove_textfile(self.config.daemon.textfile)
            raise
        log.info(
            "daemon ready",
            version=__version__,
            pid=os.getpid(),
            socket="inherited" if self.inherited_socket else str(daemon_cfg.socket),
            metrics=f"http://{_url_host(host)}:{self.metrics.port}/metrics",
        )
        for callback in self.on_ready:
            callback(self)
        systemd.notify("READY=1\n" + self._status_line())
        interval = systemd.watchdog_interval()
        # Pinged from this loop: a hung loop misses the deadline and systemd restarts it.
        watchdog = asyncio.create_task(systemd.watchdog_pinger(interval)) if interval else None
        try:
            await self._housekeeping()
        finally:
            log.info("daemon stopping")
            if watchdog is not None:
                watchdog.cancel()
            await self.agents.close()
            await self.metrics.close()
            await self.checkpoints.close()
            await asyncio.gather(*self._textfile_removals, return_exceptions=True)
            await self._remove_textfile(self.config.daemon.textfile)

    def _status_line(self) -> str:
        runs, ranks = self.registry.counts()
        roots, not_valid = self.checkpoint_summary()
        return systemd.status_message(runs=runs, ranks=ranks, checkpoint_roots=roots, checkpoints_not_valid=not_valid)

    def stop(self) -> None:
        if not self._stopping.is_set():
            systemd.notify("STOPPING=1")
        self._stopping.set()

    def _request_reload(self) -> None:
        self._reload_requested = True

    async def _housekeeping(self) -> None:
        last_textfile = last_status = 0.0
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), HOUSEKEEPING_INTERVAL)
            expired, departed = self.registry.prune()
            for name in expired:
                log.info("run expired after its grace period", run=name)
            for name, rank in departed:
                log.info("exited rank forgotten after its grace period; its run goes on", run=name, rank=rank)
            if self._reload_requested:
                self._reload_requested = False
                self.reload()
            await self.agents.rebind_if_removed()
            textfile = self.config.daemon.textfile
            now = time.monotonic()
            if now - last_status >= STATUS_INTERVAL:
                last_status = now
                systemd.notify(self._status_line())
            if textfile and now - last_textfile >= self.config.daemon.textfile_interval_seconds:
                last_textfile = now
                self._start_textfile_write(Path(textfile))

    def reload(self) -> None:
        """SIGHUP: re-read the config file; keep running on the old one if it is bad."""
        systemd.notify(systemd.reloading_message())
        try:
            self._reload()
        finally:
            systemd.notify("READY=1\n" + self._status_line())

    def _reload(self) -> None:
        try:
            new = config_module.with_overrides(config_module.load(self.config_path), self.overrides)
            checkpoints = checkpoint_config.from_config(new)
        except ConfigError as exc:
            log.error("config reload failed; keeping the running config", error=str(exc))
            return
        running = self.config.daemon
        # Bound or opened at start: these keep their running values until a restart.
        fixed = ("socket", "listen", "state_dir")
        changed = [k for k in fixed if getattr(new.daemon, k) != getattr(running, k)]
        if changed:
            log.warning("these keys need a restart to take effect", keys=changed)
        self.registry.series_limit_per_run = new.runs.series_limit_per_run
        self.registry.grace_period = new.runs.grace_period_seconds
        self.registry.lost_grace_period = new.runs.lost_grace_period_seconds
        self.registry.max_runs = new.runs.max_runs
        self.registry.max_ranks_per_run = new.runs.max_ranks_per_run
        self.checkpoints.apply_config(checkpoints)
        self.config = config_module.with_overrides(
            new, Overrides(socket=running.socket, listen=running.listen, state_dir=running.state_dir)
        )
        if running.textfile and running.textfile != new.daemon.textfile:
            # Left in place, node_exporter would serve its frozen values (agent_up 1) for as long as it runs.
            removal = asyncio.create_task(self._remove_textfile(running.textfile), name="remove old textfile")
            self._textfile_removals.add(removal)
            removal.add_done_callback(self._textfile_removals.discard)
        log.info("config reloaded", path=str(self.config_path) if self.config_path else None)
        # Last, so that the line above still reaches a log that was at info.
        if (new.daemon.log_format, new.daemon.log_level) != (running.log_format, running.log_level):
            logs.configure(new.daemon.log_format, new.daemon.log_level)

    def _start_textfile_write(self, path: Path) -> None:
        if self._textfile_write is not None and not self._textfile_write.done():
            if not self._textfile_stalled:
                self._textfile_stalled = True
                log.warning(
                    "the previous textfile write has not finished (a hung filesystem?); skipping writes until it does",
                    path=str(path),
                )
            return
        self._textfile_stalled = False
        # Rendered here: the registry changes on this loop and must not be read from another thread.
        data = self.exposition.render()
        self._textfile_write = off_loop(functools.partial(_write_textfile, data, path), "torchpulse-textfile")

    async def _remove_textfile(self, textfile: str) -> None:
        """At a stop, or when a reload moved the output elsewhere or switched it off."""
        if not textfile:
            return
        # The last write first, or it could put the file back after the removal.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(TEXTFILE_STOP_SECONDS):
                if self._textfile_write is not None:
                    # Shielded: a timeout here must not mark a hung write finished for the writes to come.
                    await asyncio.shield(self._textfile_write)
                await off_loop(functools.partial(_remove_textfile, Path(textfile)), "torchpulse-textfile")
            return
        log.warning("could not remove the textfile output (a hung filesystem?)", path=textfile)


def _url_host(host: str) -> str:
    """`host` as a URL writes it: an IPv6 address in brackets (RFC 3986 3.2.2), or its last group reads as the port."""
    return f"[{host}]" if ":" in host else host


def _write_textfile(data: bytes, path: Path) -> None:
    try:
        write_textfile(data, path)
    except OSError as exc:
        log.warning("cannot write the textfile output", path=str(path), error=exc.strerror)
    except Exception:  # awaited at stop: nothing may end the stop early
        log.exception("textfile write failed", path=str(path))


def _remove_textfile(path: Path) -> None:
    try:
        remove_textfile(path)
    except OSError as exc:
        log.warning("cannot remove the textfile output", path=str(path), error=exc.strerror)
    except Exception:  # awaited at stop and by a reload's removal task: nothing may end either early
        log.exception("textfile removal failed", path=str(path))
