"""Run a validation in a separate, killable process with time and memory limits.

The daemon never imports torch and must survive any checkpoint, so data and
load levels run here: `python -m torchpulse.checkpoints.worker` applies its own
limits (address space, low I/O priority), validates, and prints one JSON result.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass

from torchpulse.checkpoints.model import Finding, Level, Severity, Status, ValidationResult

_IOPRIO_WHO_PROCESS = 1
_IOPRIO_CLASS_IDLE = 3
_IOPRIO_CLASS_SHIFT = 13
_SYS_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}


@dataclass(frozen=True, slots=True)
class Limits:
    timeout_seconds: float = 600.0
    # Address space, not RSS: torch maps ~1-2 GB of libraries before reading anything.
    memory_bytes: int = 8 << 30
    idle_io: bool = True
    drop_cache: bool = True

    def __post_init__(self) -> None:
        if self.timeout_seconds <= 0 or self.memory_bytes <= 0:
            raise ValueError("limits must be positive")


def _error_result(path: str, level: Level, message: str, started: float) -> ValidationResult:
    return ValidationResult(
        path=path,
        status=Status.ERROR,
        level=level,
        findings=(Finding("TP-CKPT-000", Severity.ERROR, path, message),),
        stats={"duration_seconds": round(time.monotonic() - started, 6)},
    )


def validate_in_worker(
    path: str | os.PathLike[str], level: Level = Level.DATA, limits: Limits | None = None
) -> ValidationResult:
    """Validate `path` in a child process; a crash, OOM or timeout becomes status "error"."""
    limits = limits or Limits()
    started = time.monotonic()
    cmd = [
        sys.executable,
        "-m",
        "torchpulse.checkpoints.worker",
        os.fspath(path),
        level.value,
        str(limits.memory_bytes),
        "1" if limits.idle_io else "0",
        "1" if limits.drop_cache else "0",
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, timeout=limits.timeout_seconds, check=False, text=True)
    except subprocess.TimeoutExpired:
        return _error_result(str(path), level, f"worker timed out after {limits.timeout_seconds:g} s", started)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        return _error_result(str(path), level, f"worker failed: {tail[0][:300]}", started)
    return ValidationResult.from_json(json.loads(lines[-1]))


def _lower_io_priority() -> None:
    # ioprio_set has no libc wrapper; idle class means "only when the disk is free".
    number = _SYS_IOPRIO_SET.get(os.uname().machine)
    if number is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall(number, _IOPRIO_WHO_PROCESS, 0, _IOPRIO_CLASS_IDLE << _IOPRIO_CLASS_SHIFT)


def _main(argv: list[str]) -> int:
    path, level_name, memory, idle_io, drop_cache = argv
    resource.setrlimit(resource.RLIMIT_AS, (int(memory), int(memory)))
    if idle_io == "1":
        _lower_io_priority()
    os.nice(10)
    from torchpulse.checkpoints.validate import Options, validate

    level = Level(level_name)
    started = time.monotonic()
    try:
        result = validate(path, level, Options(drop_cache=drop_cache == "1"))
    except (OSError, MemoryError) as exc:
        result = _error_result(path, level, f"{type(exc).__name__}: {exc}", started)
    sys.stdout.write(json.dumps(result.to_json()) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
