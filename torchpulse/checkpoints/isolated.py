"""`torchpulse check` validates in a forked child, so that a crash of the validator is a message, not exit 139.

CPython's C code trusts what it is handed in places a hostile `.metadata` reaches
(3.11 hashes a dict key recursively with no depth check: a 300 000-deep tuple is a
segfault). The daemon validates in its worker process for that reason; the CLI
forks: the child validates and writes one JSON envelope to a pipe, the parent
reads it, or learns from the exit status which signal ended the child.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import NoReturn, TextIO

from torchpulse.checkpoints.model import Level, ValidationResult
from torchpulse.terminal import printable

_PR_SET_PDEATHSIG = 1
CLEAR_LINE = "\r" + " " * 60 + "\r"
# Signals that mean the validator itself broke (on this input), not that someone stopped it.
_CRASHES = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT, signal.SIGSYS})


class ValidatorFailed(Exception):
    """No verdict: str() is the line to print after `torchpulse check: ` (names already escaped)."""


class ProgressBar:
    """A one-line byte counter on stderr, drawn at most 10 times a second."""

    def __init__(self, total: int, stream: TextIO) -> None:
        self.total, self.done, self.stream, self.last = max(total, 1), 0, stream, 0.0

    def __call__(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= 0.1 or self.done >= self.total:
            self.last = now
            frac = min(self.done / self.total, 1.0)
            bar = "#" * int(frac * 30)
            self.stream.write(f"\r[{bar:<30}] {frac:6.1%} {self.done >> 20} MiB")
            self.stream.flush()

    def close(self) -> None:
        self.stream.write(CLEAR_LINE)
        self.stream.flush()


def _listed_bytes(path: str) -> int:
    """Total size of the regular files in `path`, for the progress bar only (0 if they cannot be listed)."""
    total = 0
    with contextlib.suppress(OSError), os.scandir(path) as it:
        for e in it:
            with contextlib.suppress(OSError):
                if e.is_file(follow_symlinks=False):
                    total += e.stat(follow_symlinks=False).st_size
    return total


def validate_isolated(path: str, level: Level) -> ValidationResult:
    """Validate `path` in a child process; raise ValidatorFailed if it cannot finish or dies."""
    if not _single_threaded():
        # fork() copies only the calling thread: a lock another thread held stays held in the child,
        # which could then hang. `torchpulse check` forks before anything starts a thread; a caller
        # that runs `main()` inside a threaded process (tests that imported torch) validates in place.
        return _verdict(_envelope(path, level))
    sys.stdout.flush()  # or the child's stderr writes would repeat what the parent had buffered
    sys.stderr.flush()
    parent = os.getpid()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        _child(r, w, path, level, parent)  # never returns
    reaped = False
    try:
        os.close(w)
        with os.fdopen(r, "rb") as pipe:
            raw = pipe.read()  # until EOF, while the child runs: a result can be many MB
        status = os.waitpid(pid, 0)[1]
        reaped = True
    finally:
        if not reaped:  # Ctrl-C (the child ignores SIGINT) or any other error here: no validator left running
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
    return _decode(raw, os.waitstatus_to_exitcode(status), path)


def _single_threaded() -> bool:
    try:
        return len(list(Path("/proc/self/task").iterdir())) == 1  # native threads too (torch starts one on import)
    except OSError:
        return threading.active_count() == 1


def _child(r: int, w: int, path: str, level: Level, parent: int) -> NoReturn:
    """Validate, write the envelope to `w`, and leave with os._exit: never run the parent's code after fork."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's Ctrl-C reaches the parent too, which kills us
        os.close(r)
        _die_with_parent(parent)
        # A crash here is what hostile input does, not a bug to debug from a core file the size of the process.
        resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
        data = json.dumps(_envelope(path, level)).encode()  # ASCII: lone surrogates of odd names are escaped
        with os.fdopen(w, "wb") as pipe:
            pipe.write(data)
        code = 0
    finally:
        with contextlib.suppress(BaseException):
            sys.stderr.flush()
        os._exit(code)


def _die_with_parent(parent: int) -> None:
    """Have the kernel kill this child if the parent dies (`kill -9`, a caller's timeout), as Ctrl-C does."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before prctl
        os._exit(1)


def _envelope(path: str, level: Level) -> dict[str, object]:
    """Run the validator with a progress bar on a terminal; its result or its failure, as JSON-able data."""
    bar: ProgressBar | None = None
    if level is not Level.METADATA and sys.stderr.isatty():
        bar = ProgressBar(_listed_bytes(path), sys.stderr)
    try:
        from torchpulse.checkpoints.validate import Options, validate

        return {"result": validate(path, level, Options(progress=bar)).to_json()}
    except (OSError, MemoryError) as exc:
        return {"error": "io", "message": str(exc) or type(exc).__name__}
    except Exception as exc:
        return {"error": "internal", "type": type(exc).__name__, "message": str(exc)}
    finally:
        if bar is not None:
            bar.close()


def _verdict(envelope: Mapping[str, object]) -> ValidationResult:
    """The result in `envelope`, or ValidatorFailed with the message `torchpulse check` printed in-process."""
    result = envelope.get("result")
    if isinstance(result, dict):
        return ValidationResult.from_json(result)
    message = printable(str(envelope.get("message", "")))
    if envelope.get("error") == "io":
        # The validator could not finish: nothing is known about the checkpoint ("cannot tell").
        raise ValidatorFailed(message)
    # A bug of the validator, not a verdict on the checkpoint: a traceback and Python's exit
    # status 1 would read as "invalid".
    raise ValidatorFailed(f"internal error: {printable(str(envelope.get('type')))}: {message[:500]}")


def _decode(raw: bytes, code: int, path: str) -> ValidationResult:
    """The child's result from its envelope and exit code (negative: the signal that ended it)."""
    where = printable(path)
    if code < 0:
        sig = -code
        try:
            name = signal.Signals(sig).name
        except ValueError:  # a real-time signal has no name
            name = f"signal {sig}"
        if sig in _CRASHES:
            raise ValidatorFailed(
                f"the validator crashed ({name}) while reading {where}; the checkpoint is probably hostile or corrupt"
            )
        if sig == signal.SIGKILL:
            raise ValidatorFailed(
                f"the validator was killed (SIGKILL, perhaps by the out-of-memory killer) while "
                f"reading {where}; the checkpoint may need more memory than is free, or be hostile"
            )
        raise ValidatorFailed(f"the validator was stopped by {name} while reading {where}")
    try:
        envelope = json.loads(raw) if code == 0 else None
        if isinstance(envelope, dict):
            return _verdict(envelope)
    except (ValueError, KeyError, TypeError, AssertionError):
        pass
    raise ValidatorFailed(f"the validator failed (exit status {code}, no result) while reading {where}")
