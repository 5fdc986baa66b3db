"""The shared after-import finder: every waiting callback runs once, cancelled ones never."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from torchpulse.probes.agent.after_import import _FINDER, AfterImport


@pytest.fixture
def module_dir(tmp_path: Path) -> Iterator[Path]:
    (tmp_path / "tp_late_module.py").write_text("VALUE = 42\n")
    sys.path.insert(0, str(tmp_path))
    try:
        yield tmp_path
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("tp_late_module", None)


def test_two_waiters_on_one_module_both_run_once_after_it_executes(module_dir: Path) -> None:
    seen: list[tuple[str, int]] = []

    def waiter(tag: str) -> AfterImport:
        return AfterImport("tp_late_module", lambda m: seen.append((tag, m.VALUE)))

    waiter("a"), waiter("b")
    import tp_late_module  # noqa: F401

    assert [("a", 42), ("b", 42)] == seen
    assert "tp_late_module" not in _FINDER.waiting


def test_a_removed_waiter_never_runs(module_dir: Path) -> None:
    seen: list[ModuleType] = []
    kept = AfterImport("tp_late_module", seen.append)
    AfterImport("tp_late_module", lambda m: pytest.fail("cancelled callback ran")).remove()
    import tp_late_module

    assert [tp_late_module] == seen
    kept.remove()  # after it ran: a no-op


def test_other_imports_pass_through_untouched(module_dir: Path) -> None:
    hook = AfterImport("tp_never_imported", lambda m: pytest.fail("wrong module"))
    try:
        import tp_late_module

        assert 42 == tp_late_module.VALUE
        assert _FINDER in sys.meta_path
    finally:
        hook.remove()
    assert "tp_never_imported" not in _FINDER.waiting
