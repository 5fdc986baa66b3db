"""`torchpulse daemon`: load config, set up logging, run until SIGTERM."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import structlog

from torchpulse.daemon import config as config_module
from torchpulse.daemon import logs
from torchpulse.daemon.config import ConfigError
from torchpulse.daemon.service import Daemon


def run_daemon(config_path: str | None, socket: str | None, listen: str | None, state_dir: str | None) -> int:
    path = Path(config_path) if config_path else None
    try:
        config = config_module.load(path)
        config = config_module.with_overrides(
            config,
            socket=Path(socket) if socket else None,
            listen=listen,
            state_dir=Path(state_dir) if state_dir else None,
        )
        if listen is not None:
            config_module.parse_listen(listen)
    except ConfigError as exc:
        print(f"torchpulse: invalid configuration: {exc}", file=sys.stderr)
        return 2
    logs.configure(config.daemon.log_format, config.daemon.log_level)
    log = structlog.get_logger("torchpulse.daemon")
    daemon = Daemon(config, path)
    try:
        asyncio.run(daemon.run())
    except OSError as exc:
        log.error("daemon failed to start", error=str(exc))
        return 1
    return 0
