"""Watcher fixtures: real DCP checkpoints from the checkpoint tests' save script."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from tests.checkpoints.conftest import SAVE_SCRIPT, run_ranks
from torchpulse.daemon.checkpoint_config import CheckpointsConfig
from torchpulse.daemon.checkpoint_service import CheckpointService

__all__ = ["SAVE_SCRIPT", "run_ranks", "run_service", "save_single"]


def run_service(tmp_path: Path, config: CheckpointsConfig,
                body: Callable[[CheckpointService], Awaitable[None]]) -> None:
    """Run `body` against a started CheckpointService (state in tmp_path/state), closed afterwards."""
    async def main() -> None:
        (tmp_path / "state").mkdir(exist_ok=True)
        service = CheckpointService(config, tmp_path / "state")
        await service.start()
        try:
            await body(service)
        finally:
            await service.close()

    asyncio.run(main())


def save_single(out: Path) -> None:
    """One real single-process DCP save into `out` (its own process, like a job)."""
    subprocess.run([sys.executable, str(SAVE_SCRIPT), "single", str(out)], check=True, timeout=120,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.fixture(scope="session")
def saved_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A committed checkpoint to copy into watched roots (copying is faster than saving)."""
    out = tmp_path_factory.mktemp("saved") / "ckpt"
    save_single(out)
    return out


def commit_copy(source: Path, target: Path) -> None:
    """Copy data files, then commit the way DCP does: write `.metadata.tmp`, rename it."""
    target.mkdir(parents=True)
    for item in source.iterdir():
        if item.name != ".metadata":
            shutil.copy2(item, target / item.name)
    shutil.copyfile(source / ".metadata", target / ".metadata.tmp")
    (target / ".metadata.tmp").rename(target / ".metadata")
