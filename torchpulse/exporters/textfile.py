"""node_exporter textfile output: the same exposition, written atomically to a .prom file."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest


def write_textfile(registry: CollectorRegistry, path: Path) -> None:
    """Write the exposition next to `path` and rename it into place (never a partial file)."""
    data = generate_latest(registry)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
