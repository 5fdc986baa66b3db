"""A real saved checkpoint for the hostile-input tests, written once per session by the shared saver."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SAVE_SCRIPT = Path(__file__).resolve().parent.parent / "checkpoints" / "ckpt_save.py"


@pytest.fixture(scope="session")
def saved_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A genuine single-process DCP checkpoint (AdamW state, bytes items): never mutate, copy it."""
    out = tmp_path_factory.mktemp("hostile") / "single"
    subprocess.run([sys.executable, str(SAVE_SCRIPT), "single", str(out)], check=True, timeout=120)
    return out
