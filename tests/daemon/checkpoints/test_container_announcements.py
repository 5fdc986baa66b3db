"""A job in another mount namespace (a container) announces paths of its own view: the daemon validates a path only
where it names the directory the job saved, never an unrelated one that its host has at that path."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.daemon.checkpoints.conftest import CLONE_NEWNS, enter_user_namespace, tried
from tests.support import DaemonProcess, select, start_daemon, wait_for
from torchpulse.daemon.checkpoints.announcements import announcement_refused
from torchpulse.probes.checkpoint import directory_identity
from torchpulse.protocol import CHECKPOINT_SAVED_EVENT, FieldValue, LogEvent, checkpoint_saved

ANNOUNCE_JOB = Path(__file__).with_name("announce_job.py")
REFUSED = "checkpoint announcement refused: not validated, its directory not watched"
_MS_BIND, _MS_REC, _MS_PRIVATE = 4096, 16384, 1 << 18


def _identity(path: Path) -> tuple[int, int]:
    info = path.stat()
    return info.st_dev, info.st_ino


def test_the_agent_sends_the_identity_of_the_saved_directory_for_the_rank_that_asks_for_validation(
    tmp_path: Path,
) -> None:
    assert _identity(tmp_path) == directory_identity(str(tmp_path), True)
    assert (None, None, None, None) == (
        directory_identity(str(tmp_path), False),  # other ranks validate nothing
        directory_identity("s3://bucket/ck", True),
        directory_identity(str(tmp_path / "gone"), True),
        directory_identity("/a\0b", True),
    )


def test_an_announcement_of_an_older_agent_has_no_identity_and_a_partial_one_counts_as_none() -> None:
    fields: dict[str, FieldValue] = {"path": "/ck", "api": "save", "duration_seconds": 1.0, "validate": True}
    identities = [
        checkpoint_saved(LogEvent(0.0, "info", CHECKPOINT_SAVED_EVENT, {**fields, **extra}))
        for extra in ({}, {"device": 66, "inode": 7}, {"device": 66})
    ]
    assert [None, (66, 7), None] == [saved.identity() if saved else "malformed" for saved in identities]
    assert checkpoint_saved(LogEvent(0.0, "info", CHECKPOINT_SAVED_EVENT, {**fields, "inode": "7"})) is None


def test_a_path_that_names_another_directory_here_than_in_the_job_is_refused(tmp_path: Path) -> None:
    saved, other = tmp_path / "saved", tmp_path / "other"
    saved.mkdir()
    other.mkdir()
    uid = os.getuid()
    assert announcement_refused(str(saved), uid, _identity(saved)) is None
    assert announcement_refused(str(other), uid, None) is None  # an agent that sent no identity: as before
    refused = announcement_refused(str(other), uid, _identity(saved))
    assert refused is not None and refused.startswith(f"{other} is not the directory the job saved (device:inode ")
    assert "mount the checkpoint directory at the same path in it as on the daemon's host" in refused
    # Root's announcements skip the ownership checks, not this one: a container's root is the host's root.
    assert announcement_refused(str(other), 0, _identity(saved)) == refused
    missing = announcement_refused(str(tmp_path / "only-in-the-job"), uid, _identity(saved))
    assert missing is not None and missing.startswith(
        "cannot be resolved: No such file or directory (if the job runs in a container"
    )


def _in_mount_namespace(source: Path, target: Path) -> Callable[[], None]:
    """A preexec_fn: the child gets its own mount namespace (a user namespace too when not root), where `source`
    is bind-mounted at `target`, as a container's volume; nothing outside the child sees the mount."""
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()

    def check(result: int, what: str) -> None:
        if result != 0:
            raise OSError(ctypes.get_errno(), what)

    def preexec() -> None:
        if uid == 0:
            check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
        else:
            enter_user_namespace(libc, uid, gid, CLONE_NEWNS)
        check(libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")
        check(libc.mount(bytes(source), bytes(target), None, _MS_BIND, None), "mount --bind")

    return tried(preexec, "cannot make a mount namespace with a bind mount")


def _announce_in_namespace(daemon: DaemonProcess, out: Path, preexec: Callable[[], None]) -> None:
    subprocess.run(
        [sys.executable, str(ANNOUNCE_JOB), str(out)], env=daemon.env(), check=True, timeout=120, preexec_fn=preexec
    )


@pytest.mark.slow
def test_a_container_that_mounts_its_checkpoints_elsewhere_on_the_host_gets_no_unrelated_directory_validated(
    tmp_path: Path, stopper: list[DaemonProcess], saved_checkpoint: Path
) -> None:
    """The container's /ckpts is the host's volume/ckpts; the host's own /ckpts holds another checkpoint.

    Without the identity the daemon validated the host's unrelated `ckpts/step-1`, valid, as the job's save."""
    view, volume = tmp_path / "ckpts", tmp_path / "volume"
    view.mkdir()
    volume.mkdir()
    preexec = _in_mount_namespace(volume, view)
    shutil.copytree(saved_checkpoint, view / "step-1")  # the unrelated checkpoint the host has at the job's path
    daemon = start_daemon(tmp_path)
    stopper.append(daemon)
    _announce_in_namespace(daemon, view / "step-1", preexec)
    assert (volume / "step-1" / ".metadata").is_file()  # the job's save, where the host sees it

    def lines(event: str) -> list[dict[str, object]]:
        return [line for line in daemon.log_lines() if line.get("event") == event]

    wait_for(lambda: bool(lines(REFUSED) or lines("checkpoint validated")), timeout=60)
    assert [] == [line["path"] for line in lines("checkpoint validated")]
    [refusal] = lines(REFUSED)
    assert str(view / "step-1") == refusal["path"]
    assert str(refusal["reason"]).startswith(f"{view / 'step-1'} is not the directory the job saved")
    saves = select(daemon.scrape(), "torchpulse_checkpoint_save_duration_seconds_count", api="save")
    assert [1.0] == list(saves.values())  # the save itself still counts
    assert {} == select(daemon.scrape(), "torchpulse_checkpoint_validations_total")


@pytest.mark.slow
def test_a_container_that_mounts_its_checkpoints_at_their_host_path_gets_them_validated(
    tmp_path: Path, stopper: list[DaemonProcess]
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    preexec = _in_mount_namespace(shared, shared)  # `-v /shared:/shared`
    daemon = start_daemon(tmp_path)
    stopper.append(daemon)
    _announce_in_namespace(daemon, shared / "step-1", preexec)
    wait_for(
        lambda: (
            1
            == sum(
                select(
                    daemon.scrape(), "torchpulse_checkpoint_validations_total", root=str(shared), status="valid"
                ).values()
            )
        ),
        timeout=60,
    )
    assert [] == [line for line in daemon.log_lines() if line.get("event") == REFUSED]
