"""node_exporter textfile output: the same exposition, written atomically to a .prom file."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_textfile(data: bytes, path: Path) -> None:
    """Write `data` next to `path` and rename it into place (never a partial file)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        Path(tmp).chmod(0o644)
        Path(tmp).replace(path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def remove_textfile(path: Path) -> None:
    """On a clean stop: node_exporter would otherwise serve the last values (`agent_up 1`) for ever."""
    path.unlink(missing_ok=True)
