"""The README stays true to the code: every exported metric family is documented."""

from __future__ import annotations

import re

from tests.support import REPO, parse_exposition
from torchpulse.catalog import CATALOG
from torchpulse.daemon.config import Config
from torchpulse.daemon.service import Daemon

README = (REPO / "README.md").read_text()


def _documented() -> set[str]:
    names = set()
    for cell in re.findall(r"^\| `([^|]+)\|", README, flags=re.MULTILINE):
        names.update(re.findall(r"([a-z_]+)`", cell))
    return names


def test_every_agent_family_is_in_the_readme() -> None:
    """Each family of the agent catalog has a row in the README's metric tables."""
    assert set() == set(CATALOG) - _documented()


def test_every_daemon_family_is_in_the_readme() -> None:
    """Each family the daemon's own collectors export has a row in the README's metric tables."""
    daemon = Daemon(Config())
    exported = {name.removeprefix("torchpulse_").removesuffix("_bucket").removesuffix("_count")
                .removesuffix("_sum") for name, _ in parse_exposition(daemon.exposition.render().decode())}
    undocumented = {name for name in exported if name not in _documented() and f"{name}_total" not in _documented()
                    and name.removesuffix("_total") not in _documented()}
    assert set() == undocumented
