"""Shared, session-scoped real checkpoints (written once, copied by tests that mutate)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import built_once

SAVE_SCRIPT = Path(__file__).with_name("ckpt_save.py")


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


@pytest.fixture(scope="session")
def dist2_root(run_tmp: Path) -> Path:
    """2-rank FSDP2, 2-rank DDP and 2-rank per-rank-metadata checkpoints, saved once per run."""

    def save(root: Path) -> None:
        assert [0, 0] == run_ranks("fsdp", root, 2)

    return built_once(run_tmp, "dist2", save)


@pytest.fixture(scope="session")
def dist4_root(run_tmp: Path) -> Path:
    """A 4-rank FSDP2 checkpoint: the 5-row layer shards 2, 2, 1, 0 (a zero-size chunk); saved once per run."""

    def save(root: Path) -> None:
        assert [0, 0, 0, 0] == run_ranks("fsdp_only", root, 4)

    return built_once(run_tmp, "dist4", save)
