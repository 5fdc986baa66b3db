"""Observer choice from the mount table: polling for network and FUSE filesystems."""

from __future__ import annotations

import pytest

from torchpulse.daemon.checkpoints.mounts import Mount, choose_observer, fs_type_of, parse_mountinfo

MOUNTINFO = """\
22 1 0:21 / / rw,relatime - ext4 /dev/vda rw
30 22 0:40 / /scratch rw - lustre 10.0.0.1@tcp:/fs rw
31 22 0:41 / /home/user/remote rw - fuse.sshfs host:/x rw
32 22 0:42 / /data rw - nfs4 srv:/data rw
33 32 0:43 / /data/local rw - xfs /dev/sdb rw
34 22 0:44 / /mnt/with\\040space rw - cifs //srv/share rw
garbage line
"""


def test_mountinfo_parses_mount_points_and_types() -> None:
    """Each well-formed line gives a mount point (unescaped) and a filesystem type."""
    mounts = parse_mountinfo(MOUNTINFO)
    assert Mount("/mnt/with space", "cifs") == mounts[-1]
    assert 6 == len(mounts)


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/scratch/run1", "polling"),
        ("/home/user/remote/ckpt", "polling"),
        ("/data/run", "polling"),
        ("/data/local/run", "inotify"),  # a local disk mounted under an NFS mount
        ("/datax/run", "inotify"),  # a prefix of a mount point is not inside it
        ("/mnt/with space/ckpt", "polling"),
        ("/var/lib/ckpt", "inotify"),
    ],
)
def test_auto_polls_network_and_fuse_filesystems(path: str, expected: str) -> None:
    """auto picks polling on nfs, cifs, lustre and fuse.*, inotify on local filesystems."""
    assert expected == choose_observer(path, "auto", parse_mountinfo(MOUNTINFO))


def test_an_explicit_observer_wins_over_the_mount_table() -> None:
    """A root configured with inotify on NFS gets inotify (the operator knows the writers are local)."""
    assert ("inotify", "lustre") == (
        choose_observer("/scratch/x", "inotify", parse_mountinfo(MOUNTINFO)),
        fs_type_of("/scratch/x", parse_mountinfo(MOUNTINFO)),
    )
