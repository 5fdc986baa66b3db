"""node_exporter textfile output: the same exposition, written atomically to a .prom file."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_textfile(data: bytes, path: Path) -> None:
    """Write `data` next to `path` and rename it into place (never a partial file).

    The directory may be writable by others (a shared textfile directory): the temporary file is
    created exclusively (mkstemp) and its mode set through the descriptor, since a chmod by name
    would follow a symlink put in its place meanwhile and change the mode of the file it names.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), 0o644)  # node_exporter runs as another user
            handle.write(data)
        Path(tmp).replace(path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def remove_textfile(path: Path) -> None:
    """On a clean stop: node_exporter would otherwise serve the last values (`agent_up 1`) for ever."""
    path.unlink(missing_ok=True)
