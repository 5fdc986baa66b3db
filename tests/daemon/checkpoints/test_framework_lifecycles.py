"""Checkpoint lifecycles of real training frameworks, validated by the real worker process.

Retention deleting old `step-N/` directories, an overwrite in place whose shards
are rewritten while the previous save is validated, one that crashed under a
validated `.metadata`, a `latest` symlink on a polled root, and the Hugging Face
files that share checkpoint roots with DCP saves.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from tests.daemon.checkpoints.conftest import idle, rewrite_a_shard
from tests.support.checkpoints import commit_copy, run_service
from torchpulse.daemon.checkpoints.config import CheckpointsConfig, RootConfig
from torchpulse.daemon.checkpoints.service import CheckpointService
from torchpulse.protocol import CheckpointSaved

pytestmark = pytest.mark.slow


async def _until(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not met"
        await asyncio.sleep(0.02)


def _validations(service: CheckpointService, root: Path) -> dict[str, int]:
    return {status: n for status, n in service.stats.root(str(root)).validations.items() if n}


def _hugging_face_files(root: Path) -> None:
    """What a Hugging Face Trainer and a plain torch job leave beside DCP checkpoints, as they write it."""
    from safetensors.torch import save_file

    weights = {"linear.weight": torch.ones(2, 2)}
    for step in (500, 1000):
        checkpoint = root / f"checkpoint-{step}"
        checkpoint.mkdir(parents=True)
        save_file(weights, str(checkpoint / "model.safetensors"))
        torch.save({"state": {}, "param_groups": []}, checkpoint / "optimizer.pt")
        (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    sharded = root / "final"  # save_pretrained of a bigger model: shards and an index
    sharded.mkdir()
    save_file(weights, str(sharded / "model-00001-of-00001.safetensors"))
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"linear.weight": "model-00001-of-00001.safetensors"}})
    )
    torch.save(weights, root / "model_final.pt")
    (root / "tensorboard").mkdir()
    (root / "tensorboard" / "events.out.tfevents.1.host").write_bytes(b"\0" * 64)
    (root / "logs").mkdir()
    (root / "logs" / "train.log").write_text("step 1000\n")


def _age(directory: Path, seconds: float) -> None:
    """Date every file of `directory` `seconds` back, as a checkpoint saved that long ago."""
    then = time.time() - seconds
    for item in directory.iterdir():
        os.utime(item, (then, then))


def test_hugging_face_and_plain_torch_files_are_neither_incomplete_nor_broken(tmp_path: Path) -> None:
    """Safetensors without a DCP `.metadata` are left alone with one line each, announced or found by a sweep."""
    root = tmp_path / "root"
    _hugging_face_files(root)
    for item in root.rglob("*"):
        os.utime(item, (time.time() - 60, time.time() - 60))
    config = CheckpointsConfig(
        roots=(RootConfig(str(root), "inotify"),), incomplete_after_seconds=0.5, debounce_seconds=0.0
    )

    async def body(service: CheckpointService) -> None:
        service.announce("run", 0, CheckpointSaved(str(root / "final"), "save", 0.1, True))
        for _ in range(3):
            await service.sweep()
        await asyncio.sleep(0.3)  # a validation would have started by now
        await _until(lambda: not service.queue.in_flight and not service.queue.pending)
        assert ({}, 0, None) == (
            _validations(service, root),
            service.stats.root(str(root)).incomplete,
            service.stats.root(str(root)).last_status,
        )

    with capture_logs() as logs:
        run_service(tmp_path, config, body)
    told = sorted(str(entry["path"]) for entry in logs if str(entry["event"]).startswith("not a DCP checkpoint"))
    assert [str(root / name) for name in ("checkpoint-1000", "checkpoint-500", "final")] == told


def test_retention_deleting_an_old_checkpoint_is_not_an_incomplete_save(tmp_path: Path, saved_checkpoint: Path) -> None:
    """Retention removes `.metadata` first and the hour-old shards slowly: not reported incomplete meanwhile."""
    root = tmp_path / "root"
    config = CheckpointsConfig(
        roots=(RootConfig(str(root), "inotify"),), incomplete_after_seconds=5.0, debounce_seconds=0.0, level="metadata"
    )
    old = root / "step-10"
    commit_copy(saved_checkpoint, old)
    _age(old, 3600)

    async def body(service: CheckpointService) -> None:
        await _until(lambda: _validations(service, root) == {"valid": 1})
        (old / ".metadata").unlink()  # shutil.rmtree's directory order put it first; big shards unlink slowly
        for _ in range(4):
            await service.sweep()
            assert 0 == service.stats.root(str(root)).incomplete
            await asyncio.sleep(0.2)
        await _until(lambda: not service.queue.in_flight and not service.queue.pending)
        shutil.rmtree(old)
        await service.sweep()
        assert ({"valid": 1}, "valid", 0) == (
            _validations(service, root),
            service.stats.root(str(root)).last_status,
            service.stats.root(str(root)).incomplete,
        )

    run_service(tmp_path, config, body)


def test_shards_rewritten_in_place_while_validated_report_nothing_until_the_save_commits(
    tmp_path: Path, saved_checkpoint: Path
) -> None:
    """The next save into the same directory rewrites the shards under the old `.metadata` while the worker reads
    them: no error, no invalid, neither from that validation nor from a sweep; the commit is validated."""
    root = tmp_path / "root"
    ckpt = root / "latest"
    config = CheckpointsConfig(roots=(RootConfig(str(root), "inotify"),), debounce_seconds=0.0)
    shards = sorted(saved_checkpoint.glob("*.distcp"))

    async def body(service: CheckpointService) -> None:
        commit_copy(saved_checkpoint, ckpt)
        await _until(lambda: bool(service.queue.in_flight))
        for shard in shards:  # the worker is still starting (importing torch): it reads the new shards
            shutil.copyfile(shard, ckpt / shard.name)
        await _until(lambda: not service.queue.in_flight)
        await service.sweep()  # finds the checkpoint: its metadata was never validated to the end
        await asyncio.sleep(0.1)
        await _until(lambda: not service.queue.in_flight and not service.queue.pending)
        assert ({}, None) == (_validations(service, root), service.stats.root(str(root)).last_status)
        shutil.copyfile(saved_checkpoint / ".metadata", ckpt / ".metadata.tmp")
        (ckpt / ".metadata.tmp").rename(ckpt / ".metadata")  # the save commits
        await _until(lambda: bool(_validations(service, root)))
        assert ({"valid": 1}, "valid") == (_validations(service, root), service.stats.root(str(root)).last_status)

    run_service(tmp_path, config, body)


def test_an_overwrite_in_place_that_crashed_under_a_validated_metadata_turns_the_root_invalid(
    tmp_path: Path, saved_checkpoint: Path
) -> None:
    """`latest/` was validated; the next save rewrote a shard and crashed before its `.metadata`. Once the shards
    have been quiet for incomplete_after_seconds, the root's last status is invalid (TP-CKPT-004), validated once;
    the save after it, committed, makes it valid again."""
    root = tmp_path / "root"
    ckpt = root / "latest"
    config = CheckpointsConfig(
        roots=(RootConfig(str(root), "inotify"),), incomplete_after_seconds=1.5, debounce_seconds=0.0, level="metadata"
    )

    async def body(service: CheckpointService) -> None:
        stats = service.stats.root(str(root))
        commit_copy(saved_checkpoint, ckpt)
        await _until(lambda: stats.last_status == "valid")
        rewritten_at = time.monotonic()
        rewrite_a_shard(ckpt)
        await service.sweep()
        await idle(service)
        assert time.monotonic() - rewritten_at < config.incomplete_after_seconds, "too slow to see it pending"
        assert ({"valid": 1}, "valid") == (_validations(service, root), stats.last_status)
        await _until(lambda: stats.last_status != "valid")  # by the sweeps every 0.5 s
        assert "invalid" == stats.last_status
        assert ("TP-CKPT-004", "error") in stats.findings
        for _ in range(3):
            await service.sweep()
            await idle(service)
        assert {"valid": 1, "invalid": 1} == _validations(service, root)
        shutil.copyfile(saved_checkpoint / ".metadata", ckpt / ".metadata.tmp")
        (ckpt / ".metadata.tmp").rename(ckpt / ".metadata")  # the next save commits
        await _until(lambda: stats.last_status == "valid")
        assert ({"valid": 2, "invalid": 1}, {}) == (_validations(service, root), stats.findings)

    run_service(tmp_path, config, body)


def test_a_latest_symlink_on_a_polled_root_is_not_a_second_checkpoint(tmp_path: Path, saved_checkpoint: Path) -> None:
    """A polled root is walked like inotify watches it: `latest -> step-N` is not validated again under `latest`."""
    root = tmp_path / "root"
    root.mkdir()
    config = CheckpointsConfig(
        roots=(RootConfig(str(root), "polling"),), poll_interval_seconds=0.1, debounce_seconds=0.0, level="metadata"
    )

    async def body(service: CheckpointService) -> None:
        for step in (1, 2):
            commit_copy(saved_checkpoint, root / f"step-{step}")
            (root / "latest.tmp").symlink_to(f"step-{step}")
            (root / "latest.tmp").replace(root / "latest")
            await _until(lambda n=step: _validations(service, root) == {"valid": n})  # type: ignore[misc]
        await asyncio.sleep(0.5)
        await _until(lambda: not service.queue.in_flight and not service.queue.pending)

    with capture_logs() as logs:
        run_service(tmp_path, config, body)
    validated = [entry["path"] for entry in logs if entry["event"] == "checkpoint validated"]
    assert sorted([str(root / "step-1"), str(root / "step-2")]) == sorted(validated)
