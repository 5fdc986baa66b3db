"""What a checkpoint path must be to be validated and recorded here, and what a directory holds on disk."""

from __future__ import annotations

import os
from pathlib import Path

from torchpulse.daemon.checkpoints.log_once import LogOnce
from torchpulse.daemon.checkpoints.scan import Uncommitted, newest_data_write, uncommitted
from torchpulse.limits import MAX_PATH_BYTES


def normalize(path: str) -> str:
    """The path the service validates and watches: `..` taken lexically, as `os.path.normpath` does."""
    path = os.path.normpath(path)
    # POSIX normpath keeps a leading "//"; to the kernel it is "/".
    return "/" + path.lstrip("/") if path.startswith("//") else path


def unusable(path: str) -> str | None:
    """Why `path` cannot be a checkpoint directory or root here, or None when it can."""
    if "\0" in path:
        return "contains a NUL byte"
    if not path.startswith("/"):
        return "is not an absolute path"
    try:
        # SQLite and the metric labels take UTF-8 only; a lone surrogate (a non-UTF-8 name) cannot be stored.
        size = len(path.encode())
    except UnicodeEncodeError:
        return "is not valid UTF-8"
    if size > MAX_PATH_BYTES:
        return "is too long"
    return None


def unusable_root(path: str) -> str | None:
    """Why an announced path cannot be taken (nor its parent made a root), or None when it can."""
    return unusable(path) or ("is the filesystem root" if path == "/" else None)


def incomplete_key_for(newest_write: float) -> str:
    """The key of a save that never committed: its newest write, so a later write makes it news again."""
    return f"incomplete:{newest_write!r}"


def _names(path: str) -> list[str] | None:
    try:
        return [entry.name for entry in Path(path).iterdir()]
    except (OSError, ValueError):
        return None


def uncommitted_save(path: str) -> Uncommitted | None:
    """`path` as a save that has not committed (as the sweep sees it), or None when it is none."""
    names = _names(path)
    return None if names is None else uncommitted(path, names)


def newest_data(path: str) -> float | None:
    """mtime of the newest data file in `path`: an overwrite in place moves it."""
    names = _names(path)
    return None if names is None else newest_data_write(path, names)


def usable(path: str, log_once: LogOnce) -> bool:
    """Whether a path found on disk can be validated and recorded (a non-UTF-8 name cannot); logs why not."""
    problem = unusable(path)
    if problem is not None:
        log_once(
            f"unusable {path}", "checkpoint path cannot be recorded; not validated", path=repr(path), reason=problem
        )
    return problem is None
