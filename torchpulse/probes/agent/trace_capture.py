"""`ctl trace`: a torch.profiler capture of whole optimizer steps, and where its file goes.

The profiler starts and stops on the training thread at step boundaries (see
`control`); writing the Chrome trace, tens of megabytes of JSON for a real
model, happens on a thread of its own so that the job steps on meanwhile.

The caller chooses the directory and may be another user than the job's (a
member of `control_group`); the daemon tells the agent who it is. Such a
caller (not root) gets no directory created for them and no file written where
only the job's user could put it: the directory must exist and be theirs, or be
a shared one with the sticky bit (/tmp). It is checked and opened when the
command arrives, and the file is written through that open directory
(`/proc/self/fd/N/`), so renaming or swapping the path for a symlink meanwhile
cannot move the write elsewhere. Kineto writes `<path>.tmp`
following symlinks and renames it, so a file name they could predict would let
them point it at any file the job may write: the name ends in a random token.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

from torchpulse.limits import MAX_RUN_CHARS_IN_NAME, MAX_TRACE_DIR_CHARS
from torchpulse.protocol import Command

if TYPE_CHECKING:
    from torch.profiler import profile

# A directory opened for a trace: never blocks on a FIFO, never leaks into a child the job forks.
_OPEN_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NONBLOCK


@dataclass
class Trace:
    command: Command
    start_step: int
    steps: int
    out: Path
    # `out` opened when the trace was accepted: the file goes into this directory, wherever `out` points by then.
    dir_fd: int
    profiler: profile | None = None

    @property
    def last_step(self) -> int:
        return self.start_step + self.steps - 1

    def close(self) -> None:
        """Let go of the directory; idempotent (the trace may end on several paths)."""
        fd, self.dir_fd = self.dir_fd, -1
        close_dir(fd)


def close_dir(fd: int | None) -> None:
    """Close a directory `open_out_dir` returned; None and -1 (none, or closed already) are let be."""
    if fd is not None and fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)


def open_out_dir(out: object, caller_uid: object = None) -> int:
    """The trace directory opened (created first when the caller may have it created); ValueError otherwise.

    Checked when the command arrives, so a typo fails before the job pays for a trace. `caller_uid`
    None (no daemon said who asks) is the job's own request.
    """
    if not isinstance(out, str) or not out:
        raise ValueError("missing argument: out")
    path = Path(out)
    if "\0" in out or len(out) > MAX_TRACE_DIR_CHARS or not path.is_absolute():
        raise ValueError(f"out must be an absolute directory path, got {out[:100]!r}")
    foreign = _foreign_caller(caller_uid)
    if foreign is None:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise ValueError(f"{out} is not a directory") from None
        except OSError as exc:
            raise ValueError(f"cannot create {out}: {exc.strerror or exc}") from None
    try:
        fd = os.open(out, _OPEN_DIR_FLAGS)
    except FileNotFoundError:
        if foreign is None:
            raise ValueError(f"{out} was removed as it was created") from None
        raise ValueError(
            f"{out} does not exist, and is not created for another user than the job's "
            f"(uid {os.geteuid()}): {_FOREIGN_RULE}"
        ) from None
    except NotADirectoryError:
        raise ValueError(f"{out} is not a directory") from None
    except OSError as exc:
        raise ValueError(f"cannot open {out}: {exc.strerror or exc}") from None
    try:
        if foreign is not None:
            _check_foreign_dir(fd, out, foreign)
        if not os.access(".", os.W_OK | os.X_OK, dir_fd=fd):
            raise ValueError(f"{out} is not writable by the job (uid {os.geteuid()})")
    except BaseException:
        os.close(fd)
        raise
    return fd


_FOREIGN_RULE = "trace into a directory of your own that the job may write to, or a shared one such as /tmp"


def _foreign_caller(caller_uid: object) -> int | None:
    """The sender's uid when it is neither root nor the job's user (-1 when the daemon's value is unusable)."""
    if caller_uid is None:
        return None
    if not isinstance(caller_uid, int) or isinstance(caller_uid, bool):
        return -1
    return None if caller_uid in (0, os.geteuid()) else caller_uid


def _check_foreign_dir(fd: int, out: str, caller: int) -> None:
    """Another user may have the job write only into their own directory or a sticky shared one."""
    info = os.fstat(fd)
    shared = bool(info.st_mode & stat.S_ISVTX and info.st_mode & stat.S_IWOTH)
    if info.st_uid != caller and not shared:
        raise ValueError(
            f"{out} belongs to uid {info.st_uid}, not to the sender (uid {caller}) of this trace of "
            f"another user's job (uid {os.geteuid()}): {_FOREIGN_RULE}"
        )


def start_profiler() -> profile:
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    profiler = profile(activities=activities)
    profiler.start()
    return profiler


def stop_quietly(profiler: profile) -> None:
    with contextlib.suppress(Exception):  # already broken; the failure is reported by the caller
        profiler.stop()
    release(profiler)


def release(profiler: profile | None) -> None:
    """Free the recorded events now, and with them Kineto's handle on a file it failed to write.

    `torch.profiler.profile` is in a reference cycle (its action map holds its own bound methods), so
    without this its events and that handle (a deleted partial file keeping a full disk full) last until
    a full garbage collection, which a training loop may not run for a long time.
    """
    with contextlib.suppress(Exception):
        if profiler is not None:
            profiler.profiler = None


def write(trace: Trace, run: str, rank: int) -> Path:
    """Export the stopped profiler's trace into `trace.out` (its opened directory); OSError when no file came of it."""
    safe_run = "".join(c if c.isalnum() or c in "-_." else "_" for c in run)[:MAX_RUN_CHARS_IN_NAME]
    name = (
        f"{safe_run}-rank{rank}-steps{trace.start_step}-{trace.last_step}-{int(time.time())}-"
        f"{secrets.token_hex(4)}.json"
    )
    path = trace.out / name
    if trace.profiler is None:
        raise RuntimeError("the profiler of this trace never started")
    trace.profiler.export_chrome_trace(f"{_through(trace.dir_fd)}/{name}")
    # Kineto logs a failed write (full disk, a directory gone or read-only) and returns as if it had written.
    try:
        info = os.lstat(name, dir_fd=trace.dir_fd)
    except FileNotFoundError:
        info = None
    if info is None or not stat.S_ISREG(info.st_mode) or info.st_size == 0:
        why = _why_not_written(trace)  # before the partial file is removed, which may free the space
        with contextlib.suppress(OSError):
            os.unlink(f"{name}.tmp", dir_fd=trace.dir_fd)
        raise OSError(f"torch.profiler did not write {path}: {why}")
    return path


def _through(dir_fd: int) -> str:
    """A path naming the opened directory itself, for Kineto, which takes a path (resolved by the kernel)."""
    return f"/proc/self/fd/{dir_fd}"


# Less free space than this after a failed write: the file system is what stopped it.
FULL_DISK_BYTES = 1 << 20


def _why_not_written(trace: Trace) -> str:
    """A likely cause the user can act on; Kineto itself only logs "Failed to write to log file!"."""
    out = trace.out
    try:
        fs = os.statvfs(trace.dir_fd)
        removed = os.fstat(trace.dir_fd).st_nlink == 0
    except OSError as exc:
        return f"{out} is unusable now ({exc.strerror or exc})"
    if removed:
        return f"{out} was removed"
    if fs.f_blocks > 0 and fs.f_bavail * fs.f_frsize < FULL_DISK_BYTES:  # /proc and the like have no blocks
        return f"the file system of {out} is full ({fs.f_bavail * fs.f_frsize} bytes free)"
    if not os.access(".", os.W_OK | os.X_OK, dir_fd=trace.dir_fd):
        return f"{out} is no longer writable by the job"
    return "torch's reason is on the job's stderr"
