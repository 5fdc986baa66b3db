"""Helpers for the checkpoint tests and the daemon's checkpoint service tests, in whichever package they are:
real DCP saves by the save script, a stand-in for the validation worker, commits the way DCP makes them."""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tests.support import REPO

if TYPE_CHECKING:  # the daemon's modules are imported where they are used: tests/conftest.py needs SAVE_SCRIPT only
    from torchpulse.checkpoints.model import Level, ValidationResult
    from torchpulse.checkpoints.worker import Limits
    from torchpulse.daemon.checkpoints.config import CheckpointsConfig
    from torchpulse.daemon.checkpoints.service import CheckpointService

SAVE_SCRIPT = REPO / "tests" / "checkpoints" / "ckpt_save.py"


def save(kind: str, out: Path, timeout: float = 120.0) -> None:
    """One real single-process save of the save script's `kind` into `out` (its own process, like a job)."""
    subprocess.run(
        [sys.executable, str(SAVE_SCRIPT), kind, str(out)],
        check=True,
        timeout=timeout,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def run_ranks(kind: str, out: Path, world: int, timeout: float = 120.0, script: Path = SAVE_SCRIPT) -> list[int]:
    """Start `world` real processes of `script KIND OUT RANK WORLD STORE` that save together over gloo.

    Each rank touches `OUT/.done-KIND-RANK` when it finished; returns their exit codes.

    A rank that finished its save and `destroy_process_group()` and then aborted
    (SIGABRT) at interpreter exit counts as 0: on torch 2.13, with 4 gloo ranks
    on 2 cores, a gloo thread now and then takes the GIL during finalization
    (pytorch/pytorch#190489). That is torch's teardown, not the checkpoint.
    """
    out.mkdir(parents=True, exist_ok=True)
    store = out / f".store-{kind}-{world}"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), kind, str(out), str(r), str(world), str(store)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for r in range(world)
    ]
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
    store.unlink(missing_ok=True)
    done = [(out / f".done-{kind}-{r}").exists() for r in range(world)]
    for r in range(world):
        (out / f".done-{kind}-{r}").unlink(missing_ok=True)
    return [0 if code == -signal.SIGABRT and finished else code for code, finished in zip(codes, done, strict=True)]


def commit_copy(source: Path, target: Path) -> None:
    """Copy data files, then commit the way DCP does: write `.metadata.tmp`, rename it."""
    target.mkdir(parents=True)
    for item in source.iterdir():
        if item.name != ".metadata":
            shutil.copy2(item, target / item.name)
    shutil.copyfile(source / ".metadata", target / ".metadata.tmp")
    (target / ".metadata.tmp").rename(target / ".metadata")


def tiny_checkpoint(path: Path) -> None:
    """A committed checkpoint as far as the watcher can tell (the fake worker reads nothing)."""
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"x")


class FakeWorker:
    """Stands in for the worker process: counts calls and the most that ran at once."""

    def __init__(self, seconds: float = 0.05) -> None:
        self.seconds = seconds
        self.invalid: set[str] = set()  # paths reported invalid
        self.calls: list[str] = []
        self.running = self.most = 0

    async def __call__(self, path: str, level: Level, limits: Limits) -> ValidationResult:
        from torchpulse.checkpoints.model import Status, ValidationResult

        self.calls.append(path)
        self.running += 1
        self.most = max(self.most, self.running)
        await asyncio.sleep(self.seconds)
        self.running -= 1
        status = Status.INVALID if path in self.invalid else Status.VALID
        return ValidationResult(path, status, level, (), {"bytes": 10})

    def called(self, times: int) -> bool:
        return times == len(self.calls)


def run_service(
    tmp_path: Path, config: CheckpointsConfig, body: Callable[[CheckpointService], Awaitable[None]]
) -> None:
    """Run `body` against a started CheckpointService (state in tmp_path/state), closed afterwards."""
    from torchpulse.daemon.checkpoints.service import CheckpointService

    async def main() -> None:
        (tmp_path / "state").mkdir(exist_ok=True)
        service = CheckpointService(config, tmp_path / "state")
        await service.start()
        try:
            await body(service)
        finally:
            await service.close()

    asyncio.run(main())


async def until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Until `predicate()` holds, the event loop running meanwhile; fails after `timeout` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not met"
        await asyncio.sleep(0.02)


async def heartbeat(gaps: list[float]) -> None:
    """Until cancelled, append how long each 10 ms sleep of the loop really took: a blocked loop shows."""
    while True:
        before = time.monotonic()
        await asyncio.sleep(0.01)
        gaps.append(time.monotonic() - before)
