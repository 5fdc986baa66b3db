"""Default locations shared by the daemon, the agents and the CLI (no torch here)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Final

# 9100-9999 (the Prometheus exporter range) is fully allocated; 10187 sits past
# it, where new exporters are placed. Override with --listen or `listen`.
DEFAULT_PORT: Final = 10187
DEFAULT_LISTEN: Final = f"127.0.0.1:{DEFAULT_PORT}"
# Linux's sun_path holds 108 bytes with the terminating NUL; bind() and connect() refuse a
# longer path with a bare "AF_UNIX path too long", and systemd refuses it in a socket unit.
MAX_SOCKET_PATH_BYTES: Final = 107


def socket_path_too_long(path: str | os.PathLike[str]) -> str | None:
    """Why `path` cannot name a Unix socket, or None when it can."""
    length = len(os.fsencode(path))
    if length <= MAX_SOCKET_PATH_BYTES:
        return None
    return (f"the path is {length} bytes long; a Unix socket path may have at most {MAX_SOCKET_PATH_BYTES} "
            f"bytes ({MAX_SOCKET_PATH_BYTES + 1} with the terminating NUL)")


def default_socket_path(env: Mapping[str, str] | None = None, uid: int | None = None) -> Path:
    """`/run/torchpulse/agent.sock` as root, else under the user's runtime dir."""
    env = os.environ if env is None else env
    uid = os.getuid() if uid is None else uid
    if uid == 0:
        return Path("/run/torchpulse/agent.sock")
    runtime = env.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "torchpulse" / "agent.sock"
    return Path(f"/tmp/torchpulse-{uid}") / "agent.sock"


def agent_socket_path(env: Mapping[str, str] | None = None) -> Path:
    """Where an agent or client looks for the daemon: `TORCHPULSE_SOCKET`, else the default."""
    env = os.environ if env is None else env
    explicit = env.get("TORCHPULSE_SOCKET")
    return Path(explicit) if explicit else default_socket_path(env)


def default_state_dir(env: Mapping[str, str] | None = None, uid: int | None = None) -> Path:
    env = os.environ if env is None else env
    uid = os.getuid() if uid is None else uid
    if uid == 0:
        return Path("/var/lib/torchpulse")
    base = env.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "torchpulse"
