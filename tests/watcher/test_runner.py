"""The validation worker's output is read with a real cap, whatever the worker writes."""

from __future__ import annotations

import asyncio
import json
import sys
import tracemalloc

import pytest

from torchpulse.checkpoints.model import Level, Status, ValidationResult
from torchpulse.checkpoints.worker import Limits
from torchpulse.daemon import checkpoint_runner

MIB = 1 << 20


def _worker_writing(monkeypatch: pytest.MonkeyPatch, script: str) -> None:
    monkeypatch.setattr(checkpoint_runner, "worker_command", lambda path, level, limits: [sys.executable, "-c", script])


def _validate_traced() -> tuple[ValidationResult, int]:
    """The result, and the most memory the daemon side held meanwhile."""
    tracemalloc.start()
    try:
        result = asyncio.run(checkpoint_runner.validate("/ckpt", Level.DATA, Limits(timeout_seconds=60)))
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_flood_on_both_pipes_is_capped_and_the_last_json_line_still_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """16 MiB of noise on stdout and stderr each, then the result: the daemon keeps about 1 MiB of it."""
    monkeypatch.setattr(checkpoint_runner, "MAX_OUTPUT_BYTES", MIB)
    result = ValidationResult("/ckpt", Status.VALID, Level.DATA, (), {"bytes": 7})
    _worker_writing(monkeypatch, "import sys\n"
                    "for _ in range(16):\n"
                    "    sys.stderr.write('e' * (1 << 20)); sys.stdout.write(('o' * 1023 + '\\n') * 1024)\n"
                    f"sys.stdout.write({json.dumps(result.to_json())!r} + '\\n\\n')\n")
    got, peak = _validate_traced()
    assert (Status.VALID, 7) == (got.status, got.stats["bytes"])
    assert peak < 4 * MIB


def test_a_failing_worker_reports_the_last_line_of_its_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    _worker_writing(monkeypatch, "import sys\n"
                    "sys.stderr.write('x' * (1 << 20) + '\\nTraceback...\\nMemoryError: out of memory\\n')\n"
                    "sys.exit(1)\n")
    got, peak = _validate_traced()
    assert (Status.ERROR, "worker failed: MemoryError: out of memory") == (got.status, got.findings[0].message)
    assert peak < 1 * MIB
