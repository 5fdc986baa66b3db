"""What a root holds right now: committed checkpoints and saves that never committed.

Blocking filesystem reads (a network filesystem may stall), so the service
runs these in a thread. Nothing here keeps state.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from torchpulse.checkpoints.model import DATA_SUFFIXES
from torchpulse.daemon.checkpoints.watcher import is_metadata_name
from torchpulse.limits import MAX_SCAN_DEPTH

# Only DCP writes `.distcp` files, so only they make a directory without `.metadata` a save that has not
# committed. Safetensors files also come from Hugging Face's Trainer and `save_pretrained` (and DCP's own
# HuggingFaceStorageWriter), which never write a `.metadata`: such a directory is no unfinished DCP save.
UNCOMMITTED_SUFFIXES: Final = (".distcp",)


@dataclass(frozen=True, slots=True)
class Committed:
    path: str
    key: str
    committed_at: float


@dataclass(frozen=True, slots=True)
class Uncommitted:
    path: str
    # mtime of the newest `.distcp` file: what identifies this state of the save.
    newest_write: float
    # The later of that and the directory's mtime: the save is given up on this long after it. Removing
    # `.metadata` touches the directory, so a checkpoint that retention is deleting (`.metadata` gone, old
    # shards still there) or that an overwrite in place is committing again is not an old unfinished save.
    settled_at: float


@dataclass(frozen=True, slots=True)
class Scan:
    committed: list[Committed] = field(default_factory=list)
    uncommitted: list[Uncommitted] = field(default_factory=list)
    # Directories with safetensors files and no DCP `.metadata` (Hugging Face layouts): not validated.
    unvalidated: list[str] = field(default_factory=list)


def _metadata_names(names: list[str]) -> list[str]:
    found = sorted(name for name in names if is_metadata_name(name))
    # `.metadata` is the commit marker whenever it is there.
    return [".metadata"] if ".metadata" in found else found


def metadata_key(path: str) -> tuple[str, float] | None:
    """(the key of the checkpoint in `path`, the mtime of its metadata), or None when `path` has no metadata.

    The key is inode:mtime_ns:size of the metadata, the commit marker DCP writes
    last. An overwrite in place rewrites the shards first, so one that crashed
    half way leaves new shards under the old, unchanged metadata: a mix that
    `dcp.load` accepts. Data newer than the metadata therefore adds
    `;rewritten@<its mtime_ns>`, and a directory validated before is validated
    again. Data older than the metadata (a pristine save) adds nothing: keys
    stored before the suffix existed still match, and nothing is validated anew.
    """
    try:
        directory = Path(path)
        names = [entry.name for entry in directory.iterdir()]
        stats = [(directory / name).stat() for name in _metadata_names(names)]
    except (OSError, ValueError):  # ValueError: a NUL byte in the path
        return None
    if not stats:
        return None
    key = ";".join(f"{st.st_ino}:{st.st_mtime_ns}:{st.st_size}" for st in stats)
    # In nanoseconds, as the validator's TP-CKPT-004 compares them: a float mtime can round two writes together.
    newest_data = _newest_data_stat(path, names, DATA_SUFFIXES)
    if newest_data is not None and newest_data.st_mtime_ns > max(st.st_mtime_ns for st in stats):
        key += f";rewritten@{newest_data.st_mtime_ns}"
    return key, max(st.st_mtime for st in stats)


def newest_data_write(directory: str, names: Iterable[str], suffixes: tuple[str, ...] = DATA_SUFFIXES) -> float | None:
    """mtime of the newest data file (by `suffixes`) among `names`, or None when there is none."""
    newest = _newest_data_stat(directory, names, suffixes)
    return None if newest is None else newest.st_mtime


def _newest_data_stat(directory: str, names: Iterable[str], suffixes: tuple[str, ...]) -> os.stat_result | None:
    """The stat of the newest data file (by `suffixes`) among `names`, or None when there is none.

    Only regular files count (symlinks followed): a dangling shard symlink or a
    directory named `*.distcp` is no data, and the sweep and the validation must
    agree on this or the save is validated again at every sweep.
    """
    newest: os.stat_result | None = None
    base = Path(directory)  # once: this runs for every shard of every checkpoint at each sweep
    for name in names:
        if not name.endswith(suffixes):
            continue
        try:
            st = (base / name).stat()
        except (OSError, ValueError):
            continue
        if stat.S_ISREG(st.st_mode) and (newest is None or st.st_mtime_ns > newest.st_mtime_ns):
            newest = st
    return newest


def uncommitted(directory: str, names: list[str]) -> Uncommitted | None:
    """`directory` as a DCP save without `.metadata`, or None when it holds no `.distcp` file."""
    newest = newest_data_write(directory, names, UNCOMMITTED_SUFFIXES)
    if newest is None:
        return None
    try:
        touched = Path(directory).stat().st_mtime
    except (OSError, ValueError):
        touched = newest
    return Uncommitted(directory, newest, max(newest, touched))


def scan(root: str, max_depth: int = MAX_SCAN_DEPTH) -> Scan:
    """Walk `root` (not following symlinks); unreadable directories are skipped."""
    try:
        return _scan(root, max_depth)
    except ValueError:  # a NUL byte: no such directory can exist
        return Scan()


def _scan(root: str, max_depth: int) -> Scan:
    result = Scan()
    base_depth = root.rstrip(os.sep).count(os.sep)
    for dirpath, dirnames, filenames in os.walk(root, onerror=None, followlinks=False):
        if dirpath.count(os.sep) - base_depth >= max_depth:
            dirnames.clear()
        if _metadata_names(filenames):
            found = metadata_key(dirpath)
            if found is not None:
                result.committed.append(Committed(dirpath, *found))
            # A checkpoint's own subdirectories are not other checkpoints.
            dirnames.clear()
            continue
        save = uncommitted(dirpath, filenames)
        if save is not None:
            result.uncommitted.append(save)
        elif newest_data_write(dirpath, filenames) is not None:
            result.unvalidated.append(dirpath)
    return result


def deleted(paths: list[str]) -> list[bool]:
    """Whether each directory is gone for good, not merely out of reach.

    Gone: it does not exist and its nearest existing ancestor has entries. An
    unmounted network filesystem leaves an empty mount point behind, and a
    record forgotten then would cost a full re-validation after the remount.
    Any other error (permissions, a stale handle) counts as out of reach.
    """
    return [_deleted(path) for path in paths]


def _deleted(path: str) -> bool:
    try:
        Path(path).stat()
        return False
    except FileNotFoundError:
        pass
    except OSError:
        return False
    except ValueError:  # a NUL byte: it cannot exist
        return True
    for ancestor in Path(path).parents:
        try:
            with os.scandir(ancestor) as entries:
                return next(entries, None) is not None
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError:
            return False
    return False
