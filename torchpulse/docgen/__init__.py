"""The generated reference: docs/metrics.md and dashboards/metrics.txt from the metric catalog,
docs/configuration.md from the config code. `make docs` (`python -m torchpulse.docgen`) writes them;
`python -m torchpulse.docgen --check` and tests/test_docs.py fail while a file differs from what the
code renders."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Final

from torchpulse.docgen.configuration import CONFIGURATION_MD, render_configuration_md
from torchpulse.docgen.metrics import CONTRACT_TXT, METRICS_MD, render_contract, render_metrics_md

# Each generated file, relative to the repository root, and what renders it.
GENERATED: Final[dict[str, Callable[[], str]]] = {
    METRICS_MD: render_metrics_md,
    CONTRACT_TXT: render_contract,
    CONFIGURATION_MD: render_configuration_md,
}


def stale(root: Path) -> list[str]:
    """The generated files under `root` whose content is not what the code renders now."""
    out = []
    for path, render in GENERATED.items():
        file = root / path
        if not file.is_file() or file.read_text() != render():
            out.append(path)
    return out


def write(root: Path) -> list[str]:
    """Render every generated file under `root`; return those that changed."""
    changed = []
    for path, render in GENERATED.items():
        file, text = root / path, render()
        if not file.is_file() or file.read_text() != text:
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_text(text)
            changed.append(path)
    return changed
