"""Shared, session-scoped real checkpoints (written once, copied by tests that mutate)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import built_once
from tests.support.checkpoints import run_ranks


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
