"""One validation in a killable worker process, awaited without blocking the loop.

`torchpulse.checkpoints.worker.validate_in_worker` does the same with
`subprocess.run`; in a thread that cannot be cancelled, so a daemon stopping
in the middle of a 10-minute validation would wait for it (and systemd would
SIGKILL the daemon and orphan the worker). Here the worker is an asyncio
child: cancelling the await kills it, and the checkpoint, never recorded, is
validated again after the restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time

from torchpulse.checkpoints.model import Finding, Level, Severity, Status, ValidationResult
from torchpulse.checkpoints.worker import Limits

# Enough for the one JSON line; a runaway worker cannot fill the daemon's memory.
MAX_OUTPUT_BYTES = 16 << 20


def worker_command(path: str, level: Level, limits: Limits) -> list[str]:
    """The argv contract of `python -m torchpulse.checkpoints.worker`."""
    return [sys.executable, "-m", "torchpulse.checkpoints.worker", path, level.value, str(limits.memory_bytes),
            "1" if limits.idle_io else "0", "1" if limits.drop_cache else "0"]


def error_result(path: str, level: Level, message: str, started: float) -> ValidationResult:
    return ValidationResult(path=path, status=Status.ERROR, level=level,
                            findings=(Finding("TP-CKPT-000", Severity.ERROR, path, message),),
                            stats={"duration_seconds": round(time.monotonic() - started, 6)})


async def validate(path: str, level: Level, limits: Limits) -> ValidationResult:
    """Validate `path` in a worker; a crash, OOM or timeout becomes status "error"."""
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *worker_command(path, level, limits), stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, limit=MAX_OUTPUT_BYTES,
        # Its own process group: a ^C to the daemon's terminal is the daemon's to handle.
        start_new_session=True,
    )
    try:
        async with asyncio.timeout(limits.timeout_seconds):
            stdout, stderr = await proc.communicate()
    except TimeoutError:
        await _kill(proc)
        return error_result(path, level, f"worker timed out after {limits.timeout_seconds:g} s", started)
    except BaseException:
        await asyncio.shield(_kill(proc))
        raise
    lines = stdout.decode(errors="replace").strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        return error_result(path, level, f"worker failed: {tail[0][:300]}", started)
    try:
        return ValidationResult.from_json(json.loads(lines[-1]))
    except (ValueError, KeyError, AssertionError) as exc:
        return error_result(path, level, f"worker answered garbage: {exc!r}"[:300], started)


async def _kill(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    await proc.wait()
