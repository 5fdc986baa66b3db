"""Which observer a root needs, from the filesystem type in the mount table.

inotify only sees writes made through this kernel: on NFS, CIFS, Lustre,
GPFS and FUSE filesystems another node's save never raises an event, so
those roots are polled. Reading (`/proc/self/mountinfo`) is separate from
parsing so the parser is tested on fixture text.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

MOUNTINFO: Final = Path("/proc/self/mountinfo")
NETWORK_FILESYSTEMS: Final = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "lustre",
        "gpfs",
        "ceph",
        "glusterfs",
        "9p",
        "afs",
        "beegfs",
        "wekafs",
        "panfs",
        "virtiofs",
    }
)


@dataclass(frozen=True, slots=True)
class Mount:
    mount_point: str
    fs_type: str


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal.
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def parse_mountinfo(text: str) -> list[Mount]:
    """Mount points and filesystem types; malformed lines are skipped."""
    mounts: list[Mount] = []
    for line in text.splitlines():
        before, sep, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if not sep or len(fields) < 5 or not tail:
            continue
        mounts.append(Mount(_unescape(fields[4]), tail[0]))
    return mounts


def read_mounts(path: Path = MOUNTINFO) -> list[Mount]:
    try:
        return parse_mountinfo(path.read_text())
    except OSError:
        return []


def fs_type_of(path: str, mounts: list[Mount]) -> str:
    """The filesystem type of the mount holding `path` (the longest matching mount point wins)."""
    path = os.path.normpath(path)
    best, best_len = "", -1
    for mount in mounts:
        point = mount.mount_point.rstrip("/") or "/"
        inside = path == point or path.startswith(point + "/") or point == "/"
        # Later lines win a tie: they are mounted on top of earlier ones.
        if inside and len(point) >= best_len:
            best, best_len = mount.fs_type, len(point)
    return best


def needs_polling(fs_type: str) -> bool:
    return fs_type in NETWORK_FILESYSTEMS or fs_type == "fuse" or fs_type.startswith("fuse.")


def choose_observer(path: str, configured: str, mounts: list[Mount]) -> str:
    """ "inotify" or "polling": an explicit choice wins, "auto" looks at the filesystem."""
    if configured != "auto":
        return configured
    # A root that does not exist yet is judged by the nearest existing parent's mount.
    return "polling" if needs_polling(fs_type_of(path, mounts)) else "inotify"
