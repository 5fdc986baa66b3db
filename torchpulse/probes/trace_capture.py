"""`ctl trace`: a torch.profiler capture of whole optimizer steps, and where its file goes.

The profiler starts and stops on the training thread at step boundaries (see
`control`); writing the Chrome trace, tens of megabytes of JSON for a real
model, happens on a thread of its own so that the job steps on meanwhile.

The caller chooses the directory and may be another user than the job's (a
member of `control_group`), in a directory they own. Kineto writes
`<path>.tmp` following symlinks and renames it, so a file name they could
predict would let them point it at any file the job may write: the name ends in
a random token.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchpulse.protocol import Command

# The run's part of a file name: long enough to recognise, short of NAME_MAX (255).
MAX_RUN_CHARS_IN_NAME = 64
MAX_OUT_CHARS = 4096


@dataclass
class Trace:
    command: Command
    start_step: int
    steps: int
    out: Path
    profiler: Any = None

    @property
    def last_step(self) -> int:
        return self.start_step + self.steps - 1


def check_out_dir(out: object) -> Path:
    """The trace directory, created if need be; ValueError with the user's message when unusable.

    Checked when the command arrives, so a typo fails before the job pays for a trace.
    """
    if not isinstance(out, str) or not out:
        raise ValueError("missing argument: out")
    path = Path(out)
    if "\0" in out or len(out) > MAX_OUT_CHARS or not path.is_absolute():
        raise ValueError(f"out must be an absolute directory path, got {out[:100]!r}")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ValueError(f"{out} is not a directory") from None
    except OSError as exc:
        raise ValueError(f"cannot create {out}: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{out} is not writable by the job (uid {os.geteuid()})")
    return path


def start_profiler() -> Any:
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    profiler = profile(activities=activities)
    profiler.start()
    return profiler


def stop_quietly(profiler: Any) -> None:
    with contextlib.suppress(Exception):  # already broken; the failure is reported by the caller
        profiler.stop()
    release(profiler)


def release(profiler: Any) -> None:
    """Free the recorded events now, and with them Kineto's handle on a file it failed to write.

    `torch.profiler.profile` is in a reference cycle (its action map holds its own bound methods), so
    without this its events and that handle (a deleted partial file keeping a full disk full) last until
    a full garbage collection, which a training loop may not run for a long time.
    """
    with contextlib.suppress(Exception):
        profiler.profiler = None


def write(trace: Trace, run: str, rank: int) -> Path:
    """Export the stopped profiler's trace into `trace.out`; OSError when no file came of it."""
    safe_run = "".join(c if c.isalnum() or c in "-_." else "_" for c in run)[:MAX_RUN_CHARS_IN_NAME]
    name = (f"{safe_run}-rank{rank}-steps{trace.start_step}-{trace.last_step}-{int(time.time())}-"
            f"{secrets.token_hex(4)}.json")
    path = trace.out / name
    trace.profiler.export_chrome_trace(str(path))
    # Kineto logs a failed write (full disk, a directory gone or read-only) and returns as if it had written.
    try:
        info = path.lstat()
    except FileNotFoundError:
        info = None
    if info is None or not stat.S_ISREG(info.st_mode) or info.st_size == 0:
        why = _why_not_written(trace.out)  # before the partial file is removed, which may free the space
        with contextlib.suppress(OSError):
            path.with_name(f"{path.name}.tmp").unlink()
        raise OSError(f"torch.profiler did not write {path}: {why}")
    return path


# Less free space than this after a failed write: the file system is what stopped it.
FULL_DISK_BYTES = 1 << 20


def _why_not_written(out: Path) -> str:
    """A likely cause the user can act on; Kineto itself only logs "Failed to write to log file!"."""
    try:
        fs = os.statvfs(out)
    except OSError as exc:
        return f"{out} is unusable now ({exc.strerror or exc})"
    if fs.f_blocks > 0 and fs.f_bavail * fs.f_frsize < FULL_DISK_BYTES:  # /proc and the like have no blocks
        return f"the file system of {out} is full ({fs.f_bavail * fs.f_frsize} bytes free)"
    if not os.access(out, os.W_OK | os.X_OK):
        return f"{out} is no longer writable by the job"
    return "torch's reason is on the job's stderr"
