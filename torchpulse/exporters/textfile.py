"""node_exporter textfile output: the same exposition, written atomically to a .prom file."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from torchpulse.exporters.prometheus import Exposition


def write_textfile(exposition: Exposition, path: Path) -> None:
    """Write the exposition next to `path` and rename it into place (never a partial file)."""
    data = exposition.render()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        Path(tmp).chmod(0o644)
        Path(tmp).replace(path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
