"""The watcher in a real daemon: real DCP saves, both observers, restarts, a crashed save, an agent."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.daemon.checkpoints.conftest import enter_user_namespace, save_single, tried
from tests.support import DaemonProcess, select, start_daemon, wait_for
from tests.support.checkpoints import commit_copy, run_ranks

pytestmark = pytest.mark.slow
ANNOUNCE_JOB = Path(__file__).with_name("announce_job.py")


def _config(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "torchpulse.toml"
    path.write_text(f"[checkpoints]\n{body}")
    return ["--config", str(path)]


def _count(daemon: DaemonProcess, name: str, **labels: str) -> float:
    return sum(select(daemon.scrape(), name, **labels).values())


def _validated_paths(daemon: DaemonProcess) -> list[str]:
    return [str(line["path"]) for line in daemon.log_lines() if line.get("event") == "checkpoint validated"]


@pytest.mark.parametrize("observer", ["inotify", "polling"])
def test_real_saves_are_validated_once_across_a_restart(
    tmp_path: Path, observer: str, stopper: list[DaemonProcess]
) -> None:
    """A save is validated, a save made while the daemon is down is found at start, none twice."""
    root = tmp_path / "ckpt"
    root.mkdir()
    args = _config(tmp_path, f'roots = [{{ path = "{root}", observer = "{observer}" }}]\npoll_interval_seconds = 0.5\n')
    daemon = start_daemon(tmp_path, extra_args=args)
    stopper.append(daemon)
    save_single(root / "step-1")
    wait_for(
        lambda: 1 == _count(daemon, "torchpulse_checkpoint_validations_total", root=str(root), status="valid"),
        timeout=60,
    )
    assert 0 == daemon.stop()
    save_single(root / "step-2")
    again = daemon.restart()
    stopper.append(again)
    wait_for(
        lambda: 1 == _count(again, "torchpulse_checkpoint_validations_total", root=str(root), status="valid"),
        timeout=60,
    )
    save_single(root / "step-3")
    wait_for(
        lambda: 2 == _count(again, "torchpulse_checkpoint_validations_total", root=str(root), status="valid"),
        timeout=60,
    )
    samples = again.scrape()
    assert {"valid": 1.0, "invalid": 0.0, "incomplete": 0.0, "error": 0.0} == {
        dict(k)["status"]: v for k, v in select(samples, "torchpulse_checkpoint_last_status", root=str(root)).items()
    }
    assert ([str(root / "step-1")], [str(root / "step-2"), str(root / "step-3")]) == (
        _validated_paths(daemon),
        _validated_paths(again),
    )
    watching = [line for line in again.log_lines() if line.get("event") == "watching checkpoint root"]
    assert [observer] == [line["observer"] for line in watching]


def test_a_save_with_a_killed_rank_is_reported_incomplete(tmp_path: Path, stopper: list[DaemonProcess]) -> None:
    """Rank 1 SIGKILLed mid-save leaves data but no .metadata: the sweep reports it incomplete."""
    root = tmp_path / "ckpt"
    args = _config(tmp_path, f'roots = ["{root}"]\nincomplete_after_seconds = 1\n')
    root.mkdir()
    daemon = start_daemon(tmp_path, extra_args=args)
    stopper.append(daemon)
    codes = run_ranks("crash", root / "step-1", 2, timeout=90)
    assert -9 == codes[1]
    wait_for(lambda: 1 == _count(daemon, "torchpulse_checkpoint_incomplete", root=str(root)), timeout=30)
    wait_for(
        lambda: 1 == _count(daemon, "torchpulse_checkpoint_last_status", root=str(root), status="incomplete"),
        timeout=30,
    )
    findings = select(daemon.scrape(), "torchpulse_checkpoint_findings", root=str(root), rule="TP-CKPT-001")
    assert [1.0] == list(findings.values())


def test_a_save_announced_by_the_agent_is_validated_under_its_parent(
    tmp_path: Path, stopper: list[DaemonProcess]
) -> None:
    """Rank 0's probe announces the save: the daemon validates it with root = the parent directory."""
    daemon = start_daemon(tmp_path)
    stopper.append(daemon)
    out = tmp_path / "job" / "step-7"
    subprocess.run([sys.executable, str(ANNOUNCE_JOB), str(out)], env=daemon.env(), check=True, timeout=120)
    parent = str(out.parent)
    wait_for(
        lambda: 1 == _count(daemon, "torchpulse_checkpoint_validations_total", root=parent, status="valid"), timeout=60
    )
    saves = select(daemon.scrape(), "torchpulse_checkpoint_save_duration_seconds_count", api="save")
    assert [1.0] == list(saves.values())


def _with_inotify_watches(limit: int) -> Callable[[], None]:
    """A preexec_fn: the child runs in its own user namespace, where the kernel grants it `limit` inotify watches
    (the limit of a user namespace is its own: nothing outside the test is touched)."""
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()

    def preexec() -> None:
        enter_user_namespace(libc, uid, gid)
        Path("/proc/sys/user/max_inotify_watches").write_text(str(limit))

    return tried(preexec, "cannot limit inotify watches in a user namespace")


def test_a_root_past_the_kernels_inotify_watch_limit_is_polled_and_nothing_waits_for_a_sweep(
    tmp_path: Path, saved_checkpoint: Path, stopper: list[DaemonProcess]
) -> None:
    """Two watches: the root and step-1. step-2's directory cannot be watched (ENOSPC from the kernel); the
    daemon says so, polls the root, and validates step-2 and step-3 long before the 60 s sweep."""
    root = tmp_path / "ckpt"
    root.mkdir()
    args = _config(tmp_path, f'roots = [{{ path = "{root}", observer = "inotify" }}]\npoll_interval_seconds = 0.5\n')
    daemon = start_daemon(tmp_path, extra_args=args, preexec=_with_inotify_watches(2))
    stopper.append(daemon)

    def valid(count: int) -> Callable[[], bool]:
        return lambda: (
            count == _count(daemon, "torchpulse_checkpoint_validations_total", root=str(root), status="valid")
        )

    for step in (1, 2, 3):
        commit_copy(saved_checkpoint, root / f"step-{step}")
        wait_for(valid(step), timeout=30)
    fallbacks = [line for line in daemon.log_lines() if str(line.get("event")).startswith("inotify cannot watch")]
    assert [(str(root), "inotify watch limit reached")] == [(line["root"], line["error"]) for line in fallbacks]
