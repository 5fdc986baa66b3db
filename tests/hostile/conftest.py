"""Hostile-input fixtures: a real saved checkpoint (written once per session), a directory all users reach."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

SAVE_SCRIPT = Path(__file__).resolve().parent.parent / "checkpoints" / "ckpt_save.py"


@pytest.fixture(scope="session")
def saved_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A genuine single-process DCP checkpoint (AdamW state, bytes items): never mutate, copy it."""
    out = tmp_path_factory.mktemp("hostile") / "single"
    subprocess.run([sys.executable, str(SAVE_SCRIPT), "single", str(out)], check=True, timeout=120)
    return out


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory every user can traverse (pytest's tmp_path is the test user's alone)."""
    path = Path(tempfile.mkdtemp(prefix="torchpulse-users-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
