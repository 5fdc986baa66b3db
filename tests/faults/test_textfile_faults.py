"""The node_exporter textfile output when its directory vanishes or its filesystem fills up: the daemon serves on."""

from __future__ import annotations

import ctypes
import ctypes.util
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support import DaemonProcess, select, start_daemon, wait_for

CLONE_NEWNS = 0x00020000
MS_REC, MS_PRIVATE = 0x4000, 0x40000


def _textfile_daemon(tmp_path: Path, prom: Path, preexec: Callable[[], None] | None = None) -> DaemonProcess:
    config = tmp_path / "tp.toml"
    config.write_text(f'[daemon]\ntextfile = "{prom}"\ntextfile_interval_seconds = 0.2\n')
    return start_daemon(tmp_path, extra_args=["--config", str(config)], preexec=preexec)


def _warnings(daemon: DaemonProcess) -> list[str]:
    return [str(e.get("error")) for e in daemon.log_lines() if e.get("event") == "cannot write the textfile output"]


def _serves(daemon: DaemonProcess) -> bool:
    return [1.0] == list(select(daemon.scrape(), "torchpulse_build_info").values())


@pytest.mark.process
def test_a_vanished_directory_is_logged_and_the_file_returns_with_it(tmp_path: Path) -> None:
    """rm -r of the textfile directory: a warning, scrapes go on, and the file is back once the directory is."""
    directory = tmp_path / "textfile"
    directory.mkdir()
    prom = directory / "torchpulse.prom"
    daemon = _textfile_daemon(tmp_path, prom)
    try:
        wait_for(prom.exists)
        shutil.rmtree(directory)
        wait_for(lambda: "No such file or directory" in _warnings(daemon))
        assert _serves(daemon)
        directory.mkdir()
        wait_for(prom.exists)
        assert (True, ["torchpulse.prom"]) == (_serves(daemon), sorted(p.name for p in directory.iterdir()))
    finally:
        daemon.stop()


def _tiny_tmpfs(target: Path) -> None:
    """In the daemon's child before exec: a private mount namespace with a one-page tmpfs on `target`."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0 or libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        raise OSError(ctypes.get_errno(), "unshare")
    if libc.mount(b"tmpfs", str(target).encode(), b"tmpfs", 0, b"size=4k") != 0:
        raise OSError(ctypes.get_errno(), "mount")


def _require_mounts(tmp_path: Path) -> None:
    """Skip unless a child can build the namespace (root, and not a container that forbids it)."""
    probe = tmp_path / "mount-probe"
    probe.mkdir()
    try:
        subprocess.run(["true"], preexec_fn=lambda: _tiny_tmpfs(probe), check=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"needs root and mount namespaces to build a full filesystem: {exc}")


@pytest.mark.process
def test_a_full_filesystem_is_logged_and_leaves_no_partial_file(tmp_path: Path) -> None:
    """ENOSPC on a 4 KiB tmpfs (the exposition is larger): warnings, no .prom and no temporary left, scrapes answer."""
    directory = tmp_path / "full"
    directory.mkdir()
    daemon = _textfile_daemon(tmp_path, directory / "torchpulse.prom", preexec=lambda: _tiny_tmpfs(directory))
    try:
        wait_for(lambda: _warnings(daemon).count("No space left on device") >= 2)
        # The mount lives only in the daemon's namespace: look through its root.
        seen = sorted(p.name for p in Path(f"/proc/{daemon.proc.pid}/root{directory}").iterdir())
        assert ([], True, None) == (seen, _serves(daemon), daemon.proc.poll())
    finally:
        daemon.stop()
