"""The validation worker's output is read with a real cap, whatever the worker writes."""

from __future__ import annotations

import asyncio
import json
import pickle
import sys
import tracemalloc
from pathlib import Path

import pytest

from torchpulse.checkpoints.model import Level, Severity, Status, ValidationResult
from torchpulse.checkpoints.validate import MAX_FINDINGS_PER_RULE
from torchpulse.checkpoints.worker import Limits
from torchpulse.daemon.checkpoints import runner as checkpoint_runner

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


@pytest.mark.process
def test_a_flood_on_both_pipes_is_capped_and_the_last_json_line_still_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """16 MiB of noise on stdout and stderr each, then the result: the daemon keeps about 1 MiB of it."""
    monkeypatch.setattr(checkpoint_runner, "MAX_WORKER_OUTPUT_BYTES", MIB)
    result = ValidationResult("/ckpt", Status.VALID, Level.DATA, (), {"bytes": 7})
    _worker_writing(
        monkeypatch,
        "import sys\n"
        "for _ in range(16):\n"
        "    sys.stderr.write('e' * (1 << 20)); sys.stdout.write(('o' * 1023 + '\\n') * 1024)\n"
        f"sys.stdout.write({json.dumps(result.to_json())!r} + '\\n\\n')\n",
    )
    got, peak = _validate_traced()
    assert (Status.VALID, 7) == (got.status, got.stats["bytes"])
    assert peak < 4 * MIB


@pytest.mark.process
def test_a_failing_worker_reports_the_last_line_of_its_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    _worker_writing(
        monkeypatch,
        "import sys\n"
        "sys.stderr.write('x' * (1 << 20) + '\\nTraceback...\\nMemoryError: out of memory\\n')\n"
        "sys.exit(1)\n",
    )
    got, peak = _validate_traced()
    assert (Status.ERROR, "worker failed: MemoryError: out of memory") == (got.status, got.findings[0].message)
    assert peak < 1 * MIB


def _chunks_without_storage(directory: Path, chunks: int) -> None:
    """A committed checkpoint whose one tensor has `chunks` chunks and not one storage entry."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    pieces = [ChunkStorageMetadata(torch.Size([i]), torch.Size([1])) for i in range(chunks)]
    tensor = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([chunks]), pieces)
    directory.mkdir()
    (directory / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={"w": tensor}, storage_data={})))


@pytest.mark.process
def test_more_findings_than_the_output_cap_holds_are_summarised_not_a_failed_worker(tmp_path: Path) -> None:
    """150,000 chunks without storage (21 MB of findings listed): invalid, 1,000 listed, the true count kept."""
    chunks = 150_000
    _chunks_without_storage(tmp_path / "ckpt", chunks)
    limits = Limits(timeout_seconds=120)
    result = asyncio.run(checkpoint_runner.validate(str(tmp_path / "ckpt"), Level.METADATA, limits))
    listed = [f for f in result.findings if f.rule == "TP-CKPT-009"]
    omitted = chunks - MAX_FINDINGS_PER_RULE
    assert (Status.INVALID, MAX_FINDINGS_PER_RULE + 1) == (result.status, len(listed)), result.findings[:1]
    assert (Severity.ERROR, f"... and {omitted:,} more findings of this rule omitted") == (
        listed[-1].severity,
        listed[-1].message,
    )
    assert chunks == result.finding_counts()[("TP-CKPT-009", "error")]
    assert len(json.dumps(result.to_json())) < MIB
