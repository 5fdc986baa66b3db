"""`torchpulse daemon`: load config, set up logging, run until SIGTERM."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import structlog

from torchpulse.daemon import config as config_module
from torchpulse.daemon import logs, systemd
from torchpulse.daemon.checkpoints import config as checkpoint_config
from torchpulse.daemon.config import ConfigError
from torchpulse.daemon.server import raise_descriptor_limit
from torchpulse.daemon.service import Daemon


def run_daemon(
    config_path: str | None,
    socket: str | None,
    listen: str | None,
    state_dir: str | None,
    log_format: str | None = None,
    log_level: str | None = None,
) -> int:
    path = Path(config_path) if config_path else None
    overrides = config_module.Overrides(
        socket=Path(socket) if socket else None,
        listen=listen,
        state_dir=Path(state_dir) if state_dir else None,
        log_format=log_format,
        log_level=log_level,
    )
    try:
        config = config_module.with_overrides(config_module.load(path), overrides)
        if listen is not None:
            config_module.parse_listen(listen)
        checkpoint_config.from_config(config)
    except ConfigError as exc:
        print(f"torchpulse: invalid configuration: {exc}", file=sys.stderr)
        return 2
    logs.configure(config.daemon.log_format, config.daemon.log_level)
    log = structlog.get_logger("torchpulse.daemon")
    # Socket activation: systemd holds the agent socket across daemon restarts.
    try:
        passed = systemd.listen_fds_with_names()
    except OSError as exc:
        log.error("LISTEN_FDS names a descriptor that is not open; not starting", error=str(exc))
        return 1
    inherited = next((sock for name, sock in passed if name == "agent"), None)
    if inherited is None and len(passed) == 1:
        inherited = passed[0][1]
    if inherited is not None:
        log.info("using the agent socket passed by systemd", path=str(inherited.getsockname()))
    raise_descriptor_limit()
    daemon = Daemon(config, path, inherited_socket=inherited, overrides=overrides)
    try:
        asyncio.run(daemon.run())
    except OSError as exc:
        log.error("daemon failed to start", error=str(exc))
        return 1
    return 0
