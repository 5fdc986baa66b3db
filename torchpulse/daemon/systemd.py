"""systemd glue: sd_notify, socket activation and the service watchdog.

Standard library only (the daemon never imports torch, and libsystemd is not a
dependency): each function speaks the documented wire protocol directly, see
sd_notify(3), sd_listen_fds(3) and sd_watchdog_enabled(3). Everything is a
no-op outside systemd, so the daemon runs the same by hand and in tests.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable

__all__ = [
    "SD_LISTEN_FDS_START",
    "listen_fds",
    "listen_fds_with_names",
    "notify",
    "reloading_message",
    "status_message",
    "watchdog_interval",
    "watchdog_pinger",
]

# sd_listen_fds(3): passed descriptors are numbered consecutively from 3.
SD_LISTEN_FDS_START = 3

_UNNAMED_FD = "unknown"  # the name systemd reports when FileDescriptorName= is unset


def notify(state: str) -> bool:
    """Send one sd_notify datagram (e.g. ``"READY=1"``); False when not under systemd.

    ``state`` holds newline-separated ``KEY=VALUE`` assignments. The socket is
    ``$NOTIFY_SOCKET``: a filesystem path, or an abstract name written with a
    leading ``@``. Send errors are reported as False, never raised: a lost
    status line must not take the daemon down. The send never blocks either:
    it runs on the event loop, and a full receive queue in PID 1 must not stall
    the loop (a dropped ping is retried on the next interval).
    """
    address = _notify_address(os.environ.get("NOTIFY_SOCKET", ""))
    if address is None:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK) as sock:
            sock.sendto(state.encode("utf-8"), address)
    except OSError:  # BlockingIOError included: the receiver's queue is full
        return False
    return True


def _notify_address(raw: str) -> str | bytes | None:
    if raw.startswith("@"):
        # Abstract namespace: the kernel name starts with a NUL byte instead of '@'.
        return b"\0" + raw[1:].encode("utf-8")
    if raw.startswith("/"):
        return raw
    # Unset, empty, or a transport this module does not speak (systemd >= 254 "vsock:").
    return None


def status_message(*, runs: int, ranks: int, checkpoint_roots: int, checkpoints_not_valid: int) -> str:
    """Build the one-line ``STATUS=`` shown by ``systemctl status torchpulse``."""
    return (
        f"STATUS={runs} runs, {ranks} ranks connected; "
        f"{checkpoint_roots} checkpoint roots, {checkpoints_not_valid} not valid"
    )


def reloading_message() -> str:
    """Build ``RELOADING=1`` with the ``MONOTONIC_USEC=`` that systemd >= 253 requires."""
    monotonic_usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    return f"RELOADING=1\nMONOTONIC_USEC={monotonic_usec}"


def listen_fds(*, unset_environment: bool = True) -> list[socket.socket]:
    """Return the sockets passed by socket activation, in order; empty when there are none."""
    return [sock for _name, sock in listen_fds_with_names(unset_environment=unset_environment)]


def listen_fds_with_names(*, unset_environment: bool = True) -> list[tuple[str, socket.socket]]:
    """Return ``(name, socket)`` for each passed descriptor, named by ``FileDescriptorName=``.

    The descriptors are honoured only when ``$LISTEN_PID`` is this process, so a
    child that inherited the variables does not steal its parent's sockets. They
    are marked close-on-exec (the validation worker must not hold the agent
    socket open), and the variables are removed unless ``unset_environment`` is
    False, so nothing spawned later sees them.
    """
    try:
        count = _passed_fd_count()
        names = os.environ.get("LISTEN_FDNAMES", "").split(":") if count else []
    finally:
        if unset_environment:
            for key in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
                os.environ.pop(key, None)
    if len(names) != count:
        # sd_listen_fds_with_names() treats a length mismatch as "no names".
        names = [_UNNAMED_FD] * count
    passed: list[tuple[str, socket.socket]] = []
    for offset, name in enumerate(names):
        fd = SD_LISTEN_FDS_START + offset
        os.set_inheritable(fd, False)
        # fileno= makes Python read family, type and protocol from the descriptor itself.
        passed.append((name or _UNNAMED_FD, socket.socket(fileno=fd)))
    return passed


def _passed_fd_count() -> int:
    try:
        pid = int(os.environ.get("LISTEN_PID", ""))
        count = int(os.environ.get("LISTEN_FDS", ""))
    except ValueError:
        return 0
    if pid != os.getpid() or count <= 0:
        return 0
    return count


def watchdog_interval() -> float | None:
    """Return how often to send ``WATCHDOG=1`` (half of ``WatchdogSec=``), or None when off."""
    pid_text = os.environ.get("WATCHDOG_PID")
    if pid_text is not None:
        try:
            if int(pid_text) != os.getpid():
                return None
        except ValueError:
            return None
    try:
        usec = int(os.environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    # Half the timeout, as sd_watchdog_enabled(3) recommends: one late ping is not fatal.
    return usec / 2 / 1_000_000


async def watchdog_pinger(interval: float, *, send: Callable[[str], bool] = notify) -> None:
    """Send ``WATCHDOG=1`` every ``interval`` seconds until cancelled.

    Run it as a task on the daemon's own event loop: the pings prove that the
    loop still turns, so a loop blocked by a synchronous call misses them and
    systemd restarts the daemon, while a busy validation worker (a separate
    process) does not delay them.
    """
    if interval <= 0:
        raise ValueError(f"watchdog interval must be positive, got {interval}")
    while True:
        send("WATCHDOG=1")
        await asyncio.sleep(interval)
