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
from collections import deque

from torchpulse.checkpoints.model import Finding, Level, Severity, Status, ValidationResult
from torchpulse.checkpoints.worker import Limits
from torchpulse.limits import MAX_WORKER_OUTPUT_BYTES, MAX_WORKER_STDERR_BYTES

# Read size, and the pipe readers' buffer limit (asyncio buffers up to twice it).
CHUNK_BYTES = 64 << 10


def worker_command(path: str, level: Level, limits: Limits) -> list[str]:
    """The argv contract of `python -m torchpulse.checkpoints.worker`."""
    return [
        sys.executable,
        "-m",
        "torchpulse.checkpoints.worker",
        path,
        level.value,
        str(limits.memory_bytes),
        "1" if limits.idle_io else "0",
        "1" if limits.drop_cache else "0",
    ]


def error_result(path: str, level: Level, message: str, started: float) -> ValidationResult:
    return ValidationResult(
        path=path,
        status=Status.ERROR,
        level=level,
        findings=(Finding("TP-CKPT-000", Severity.ERROR, path, message),),
        stats={"duration_seconds": round(time.monotonic() - started, 6)},
    )


async def validate(path: str, level: Level, limits: Limits) -> ValidationResult:
    """Validate `path` in a worker; a crash, OOM or timeout becomes status "error"."""
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *worker_command(path, level, limits),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        limit=CHUNK_BYTES,
        # Its own process group: a ^C to the daemon's terminal is the daemon's to handle.
        start_new_session=True,
    )
    try:
        async with asyncio.timeout(limits.timeout_seconds):
            # Both pipes drained at once: a worker blocked on a full stderr pipe never finishes its stdout.
            assert proc.stdout is not None and proc.stderr is not None
            line, error_line, _ = await asyncio.gather(
                _last_line_of(proc.stdout, MAX_WORKER_OUTPUT_BYTES),
                _last_line_of(proc.stderr, MAX_WORKER_STDERR_BYTES),
                proc.wait(),
            )
    except TimeoutError:
        await _kill(proc)
        return error_result(path, level, f"worker timed out after {limits.timeout_seconds:g} s", started)
    except BaseException:
        await asyncio.shield(_kill(proc))
        raise
    if proc.returncode != 0 or not line:
        message = error_line.decode(errors="replace").strip() or f"exit status {proc.returncode}"
        return error_result(path, level, f"worker failed: {message[:300]}", started)
    try:
        return ValidationResult.from_json(json.loads(line))
    except (ValueError, KeyError, TypeError, AssertionError) as exc:
        return error_result(path, level, f"worker answered garbage: {exc!r}"[:300], started)


async def _last_line_of(stream: asyncio.StreamReader, cap: int) -> bytes:
    """Read `stream` to its end and return its last non-blank line, from (about) its last `cap` bytes.

    `communicate` keeps everything. Whole chunks are dropped from the head (a
    bytearray trimmed at the head is reallocated, briefly twice its size), and
    they are gone when this returns: only the line outlives the read.
    """
    chunks: deque[bytes] = deque()
    size = 0
    while chunk := await stream.read(CHUNK_BYTES):
        chunks.append(chunk)
        size += len(chunk)
        while size - len(chunks[0]) >= cap:
            size -= len(chunks.popleft())
    return _last_line(chunks)


def _last_line(chunks: deque[bytes]) -> bytes:
    """The last non-blank line, joined from the chunks it spans only."""
    parts: list[bytes] = []
    for chunk in reversed(chunks):
        if not parts:
            chunk = chunk.rstrip()  # trailing blank lines and the final newline
            if not chunk:
                continue
        cut = chunk.rfind(b"\n")
        if cut >= 0:
            parts.append(chunk[cut + 1 :])
            break
        parts.append(chunk)
    return b"".join(reversed(parts))


async def _kill(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    await proc.wait()
