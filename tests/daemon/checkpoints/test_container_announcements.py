"""A job in another mount namespace (a container) announces paths of its own view: the daemon validates a path only
where it names the directory the job saved, never an unrelated one that its host has at that path; and the directory
it checks is the one it will validate, the announced path normalized as the service normalizes it."""

from __future__ import annotations

import ctypes
import importlib
import os
import shutil
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.daemon.checkpoints.conftest import (
    CLONE_NEWNS,
    MS_BIND,
    MS_PRIVATE,
    MS_REC,
    NOBODY,
    enter_user_namespace,
    hidden_proc,
    tried,
)
from tests.support import DaemonProcess, select, start_daemon, wait_for
from torchpulse.daemon.checkpoints.announcements import Refused, checked_announcement, found_under_roots
from torchpulse.limits import MAX_ANNOUNCED_SUFFIX_PARTS
from torchpulse.probes.checkpoint import directory_identity
from torchpulse.protocol import CHECKPOINT_SAVED_EVENT, FieldValue, LogEvent, checkpoint_saved

ANNOUNCE_JOB = Path(__file__).with_name("announce_job.py")
REFUSED = "checkpoint announcement refused: not validated, its directory not watched"


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


def _refused(path: Path, uid: int, identity: tuple[int, int] | None, roots: tuple[str, ...] = ()) -> str | None:
    checked = checked_announcement(str(path), uid, identity, roots)
    return checked.reason if isinstance(checked, Refused) else None


def test_a_path_that_names_another_directory_here_than_in_the_job_is_refused(tmp_path: Path) -> None:
    saved, other = tmp_path / "saved", tmp_path / "other"
    saved.mkdir()
    other.mkdir()
    uid = os.getuid()
    assert str(saved) == checked_announcement(str(saved), uid, _identity(saved), ())
    assert _refused(other, uid, None) is None  # an agent that sent no identity: as before
    refused = _refused(other, uid, _identity(saved))
    assert refused is not None and refused.startswith(f"{other} is not the directory the job saved (device:inode ")
    assert "mount the checkpoint directory at the same path in it as on the daemon's host" in refused
    # Root's announcements skip the ownership checks, not this one: a container's root is the host's root.
    assert _refused(other, 0, _identity(saved)) == refused
    missing = _refused(tmp_path / "only-in-the-job", uid, _identity(saved))
    assert missing is not None and missing.startswith(
        "cannot be resolved: No such file or directory (if the job runs in a container"
    )


def test_a_directory_the_job_saved_at_another_path_is_found_under_a_configured_root_by_its_trailing_parts(
    tmp_path: Path,
) -> None:
    """The pod mounts the host's volume/ at /ckpt: its /ckpt/run/step-1 is the host's volume/run/step-1."""
    volume, decoy = tmp_path / "volume", tmp_path / "decoy"
    (volume / "run" / "step-1").mkdir(parents=True)
    (decoy / "run" / "step-1").mkdir(parents=True)  # the same parts under a root tried first: another directory
    identity = _identity(volume / "run" / "step-1")
    announced = "/ckpt/run/step-1"
    roots = (str(decoy), str(volume))
    assert str(volume / "run" / "step-1") == checked_announcement(announced, os.getuid(), identity, roots)
    # The volume's parent as the root: the container's mount point is named like the host directory.
    assert str(volume / "run" / "step-1") == checked_announcement(
        f"/mnt/{volume.name}/run/step-1", os.getuid(), identity, (str(tmp_path),)
    )
    # `..` is taken lexically, as the service takes it, before the suffixes are cut.
    assert str(volume / "run" / "step-1") == checked_announcement("/ckpt/run/x/../step-1", os.getuid(), identity, roots)
    refused = _refused(Path(announced), os.getuid(), _identity(decoy / "run" / "step-1"), (str(volume),))
    assert refused is not None and refused.endswith("(nor under any of the 1 configured roots)")
    assert "list the host directory its volume comes from as a [checkpoints] root" in refused


def test_a_directory_found_under_a_root_is_still_checked_for_its_owner(tmp_path: Path) -> None:
    """Finding the job's directory under a root proves which directory it is, not that it is the job's user's."""
    volume = tmp_path / "volume"
    (volume / "step-1").mkdir(parents=True)
    identity = _identity(volume / "step-1")
    if os.getuid() == 0:
        owner = 65534  # another user's directory in root's eyes: the announcing job is uid 12345
        os.chown(volume / "step-1", owner, owner)
        job = 12345
    else:
        owner, job = os.getuid(), os.getuid() + 1
    refused = _refused(Path("/ckpt/step-1"), job, identity, (str(volume),))
    assert f"{volume / 'step-1'} belongs to uid {owner}, not to the job's user (uid {job})" == refused


def test_the_suffixes_tried_under_a_root_are_bounded(tmp_path: Path) -> None:
    """A path of thousands of components costs at most MAX_ANNOUNCED_SUFFIX_PARTS stats per root."""
    deep = tmp_path.joinpath(*["d"] * (MAX_ANNOUNCED_SUFFIX_PARTS + 1))
    deep.mkdir(parents=True)
    announced = "/job" + "/d" * (MAX_ANNOUNCED_SUFFIX_PARTS + 1)
    assert found_under_roots(announced, _identity(deep), (str(tmp_path),)) is None
    within = tmp_path.joinpath(*["d"] * MAX_ANNOUNCED_SUFFIX_PARTS)
    assert str(within) == found_under_roots(announced, _identity(within), (str(tmp_path),))


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
        check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
        check(libc.mount(bytes(source), bytes(target), None, MS_BIND, None), "mount --bind")

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


def _job_in_a_pod(socket_path: Path, volume: Path, mount_point: Path, pod_only: Path) -> int:
    """A job as a pod runs it, forked (the venv is root's, not executable by others): its own mount namespace where
    the host's `volume` is mounted at `mount_point` and a tmpfs at `pod_only`, /proc mounted hidepid, and uid
    NOBODY; it saves step-1 under each with the agent attached, then exits. Its exit code."""
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            for result, what in (
                (libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)"),
                (libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /"),
                (libc.mount(bytes(volume), bytes(mount_point), None, MS_BIND, None), "mount --bind"),
                (libc.mount(b"tmpfs", bytes(pod_only), b"tmpfs", 0, b"mode=1777"), "mount -t tmpfs"),
                (libc.mount(b"proc", b"/proc", b"proc", 0, b"hidepid=invisible"), "mount -t proc"),
            ):
                if result != 0:
                    raise OSError(ctypes.get_errno(), what)
            # What the job imports, lazily too, imported while root's venv is still readable: a first save in the
            # pod's own tmpfs, before the agent is attached.
            import torch
            import torch.distributed.checkpoint as dcp

            from torchpulse.probes.attach import attach, detach

            dcp.save({"w": torch.ones(4, 4)}, checkpoint_id=str(pod_only / "imports"), no_dist=True)
            for module in (
                "torchpulse.probes.agent.agent",
                "torchpulse.probes.agent.sender",
                "torchpulse.probes.checkpoint",
            ):
                importlib.import_module(module)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            attach(probes=("checkpoint",), socket=str(socket_path), run="pod-run")
            for saved in (mount_point / "run-a" / "step-1", pod_only / "step-1"):
                dcp.save({"w": torch.ones(4, 4)}, checkpoint_id=str(saved), no_dist=True)
            detach()
            code = 0
        except BaseException:
            traceback.print_exc()  # shown with the test's failure
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.process
def test_a_pod_that_mounts_its_checkpoint_volume_at_another_path_gets_it_validated_under_the_configured_root(
    shared: Path, stopper: list[DaemonProcess]
) -> None:
    """The pod (own mount namespace, /proc hidepid, uid nobody) saves to /…/pod/ckpt/run-a/step-1, which is the
    host's volume/run-a/step-1; the daemon (private /proc, hidepid, as its unit runs it) has volume as a root.

    The root is polled once an hour, so only the announcement can have it validated during the test; nothing of
    the job's is read but the directory itself, found by the path's trailing parts after the job has exited.
    A save to a directory only the pod has is refused saying how to mount or configure."""
    daemon_preexec = hidden_proc()
    volume, pod = shared / "volume", shared / "pod"
    mount_point, pod_only = pod / "ckpt", pod / "scratch"
    for directory in (volume, mount_point, pod_only):
        directory.mkdir(parents=True)
    os.chown(volume, NOBODY, NOBODY)
    config = shared / "torchpulse.toml"
    config.write_text(
        f'[checkpoints]\npoll_interval_seconds = 3600.0\nroots = [{{ path = "{volume}", observer = "polling" }}]\n'
    )
    daemon = start_daemon(shared, extra_args=["--config", str(config)], preexec=daemon_preexec)
    stopper.append(daemon)
    daemon.socket_path.chmod(0o666)  # as the socket unit's group lets the job's user in
    with subprocess.Popen(["sleep", "60"], user=NOBODY, group=NOBODY, extra_groups=[]) as other:
        try:  # what the daemon sees of /proc: no process of another user's
            seen = [
                subprocess.run(["test", "-e", f"/proc/{other.pid}"], preexec_fn=p).returncode
                for p in (None, daemon_preexec)
            ]
        finally:
            other.kill()
    assert [0, 1] == seen

    assert 0 == _job_in_a_pod(daemon.socket_path, volume, mount_point, pod_only)
    host_path = volume / "run-a" / "step-1"
    assert (host_path / ".metadata").is_file() and not (pod_only / "step-1").exists()

    def lines(event: str) -> list[dict[str, object]]:
        return [line for line in daemon.log_lines() if line.get("event") == event]

    def validated() -> float:
        return sum(
            select(
                daemon.scrape(), "torchpulse_checkpoint_validations_total", root=str(volume), status="valid"
            ).values()
        )

    wait_for(lambda: validated() == 1 and bool(lines(REFUSED)), timeout=60)
    [found] = lines("checkpoint announcement found under a configured root")
    assert (str(mount_point / "run-a" / "step-1"), str(host_path)) == (found["path"], found["found"])
    assert [str(host_path)] == [line["path"] for line in lines("checkpoint validated")]
    [refused] = lines(REFUSED)
    assert str(pod_only / "step-1") == refused["path"]
    reason = str(refused["reason"])
    assert reason.startswith("cannot be resolved: No such file or directory (if the job runs in a container")
    assert reason.endswith("(nor under any of the 1 configured roots)")


def test_the_daemon_checks_the_directory_it_will_validate_not_the_one_a_symlink_and_dotdot_lead_to(
    tmp_path: Path,
) -> None:
    """`mine/link/../../etc` resolves into the job's user's tree but the daemon validates `/etc`, normalized
    lexically: the announcement is refused because /etc belongs to root."""
    uid = os.getuid() if os.getuid() != 0 else 4242
    climb = len(tmp_path.parts)  # `..`s from tmp_path/link up to /
    target = tmp_path.joinpath(*["d"] * climb)
    target.mkdir(parents=True)
    (tmp_path / "etc").mkdir()
    (tmp_path / "link").symlink_to(target)
    if os.getuid() == 0:  # the job's user is another one: its tree is theirs
        for directory in (tmp_path, tmp_path / "etc"):  # what the check looks at: the directory and its parent
            os.chown(directory, uid, uid)
        os.lchown(tmp_path / "link", uid, uid)
    announced = str(tmp_path.joinpath("link", *[".."] * climb, "etc"))
    assert (str(tmp_path / "etc"), "/etc") == (os.path.realpath(announced), os.path.normpath(announced))
    refused = Refused(f"/etc belongs to uid 0, not to the job's user (uid {uid})")
    assert refused == checked_announcement(announced, uid, None, ())
