"""exit_status: uncaught exceptions and failing sys.exit() are noted; everything else passes through."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

import pytest

from torchpulse.probes.agent import exit_status


@pytest.fixture
def installed() -> Iterator[None]:
    exit_status.forget()
    exit_status.install()
    try:
        yield
    finally:
        exit_status.uninstall()
        exit_status.forget()


@pytest.mark.usefixtures("installed")
@pytest.mark.parametrize(
    ("status", "noted"),
    [(None, None), (0, None), (False, None), (3, "sys.exit(3)"), ("bad config", "sys.exit('bad config')")],
)
def test_sys_exit_still_raises_system_exit_and_only_a_failing_status_is_noted(
    status: object, noted: str | None
) -> None:
    with pytest.raises(SystemExit) as raised:
        sys.exit(status)  # type: ignore[arg-type]
    assert (status, noted) == (raised.value.code, exit_status.failure())


@pytest.mark.usefixtures("installed")
def test_a_sys_exit_in_another_thread_ends_only_that_thread_and_is_not_noted() -> None:
    def worker() -> None:
        with contextlib.suppress(SystemExit):  # threading would swallow it too; pytest's thread hook would not
            sys.exit(1)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert exit_status.failure() is None


def test_the_excepthook_notes_the_exception_class_but_not_a_keyboard_interrupt(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[type[BaseException]] = []
    monkeypatch.setattr(sys, "excepthook", lambda t, e, tb: seen.append(t))
    exit_status.forget()
    exit_status.install()
    try:
        sys.excepthook(KeyboardInterrupt, KeyboardInterrupt(), None)
        assert exit_status.failure() is None
        sys.excepthook(RuntimeError, RuntimeError("NCCL timeout"), None)
        assert "RuntimeError" == exit_status.failure()
        assert [KeyboardInterrupt, RuntimeError] == seen  # the job's own hook still runs
    finally:
        exit_status.uninstall()
        exit_status.forget()


def test_uninstall_restores_both_and_leaves_a_later_wrapper_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    original_hook, original_exit = sys.excepthook, sys.exit
    exit_status.install()
    exit_status.uninstall()
    assert (original_hook, original_exit) == (sys.excepthook, sys.exit)
    exit_status.install()
    later = monkeypatch.setattr(sys, "exit", lambda *a: None) or sys.exit
    exit_status.uninstall()
    assert (original_hook, later) == (sys.excepthook, sys.exit)
