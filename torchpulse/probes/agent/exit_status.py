"""How this process is ending: normally, or after an uncaught exception or a failing `sys.exit()`.

At exit the agent says goodbye, and the daemon then shows the rank `exited` and no down
alert fires, only when the process ends normally. CPython runs atexit handlers alike after
a clean return, an uncaught exception and `sys.exit(1)`, and keeps the exit status to
itself, so the two usual ways a Python job fails are noted as they happen:
`sys.excepthook` sees an uncaught exception (a torchrun worker, a plain script), and
`sys.exit` a failing status (`torch.multiprocessing.spawn` ranks call `sys.exit(1)` after
an exception; scripts call it on errors). A KeyboardInterrupt is a deliberate stop, not a
failure.

Not seen: `raise SystemExit(1)` and `exit()`/`quit()`, which bypass `sys.exit`; a failing
`sys.exit()` that the job catches and survives is still taken for a failure. A `sys.exit()` in an atexit
callback is not one: Python ignores it and keeps the status. `os._exit()`
and signals skip atexit altogether: no goodbye, the rank reads as gone, as it should.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from types import TracebackType
from typing import NoReturn, Protocol, cast

from torchpulse.limits import MAX_CAUSE_CHARS

ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], object]


class Exit(Protocol):
    """`sys.exit` as CPython has it: a status of any object (printed, status 1), or none."""

    def __call__(self, *status: object) -> NoReturn: ...


_failure: str | None = None
# (our excepthook, the one it chains to, our exit, the one it calls), while installed.
_installed: tuple[ExceptHook, ExceptHook, Exit, Exit] | None = None


def failure() -> str | None:
    """Why the process is failing ("RuntimeError", "sys.exit(3)"), or None while nothing failed."""
    return _failure


def install() -> None:
    """Wrap `sys.excepthook` and `sys.exit` (once; both still do what they did)."""
    global _installed
    if _installed is not None:
        return
    previous_hook = sys.excepthook
    # typeshed has sys.exit take `str | int | None`; CPython's takes any object, and the job may pass one.
    previous_exit = cast(Exit, sys.exit)

    def excepthook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if not issubclass(exc_type, KeyboardInterrupt):
            _note(exc_type.__name__)
        previous_hook(exc_type, exc, tb)

    def exit(*status: object) -> NoReturn:
        # SystemExit in another thread ends only that thread; the process's status is the main thread's.
        # Nor does one in an atexit callback (the main thread has ended by then): Python prints it and
        # exits with the status it already had.
        main = threading.main_thread()
        if status and _fails(status[0]) and threading.current_thread() is main and main.is_alive():
            _note(f"sys.exit({status[0]!r})")
        previous_exit(*status)

    sys.excepthook, sys.exit = excepthook, exit
    _installed = (excepthook, previous_hook, exit, previous_exit)


def uninstall() -> None:
    """Put back what `install` wrapped, unless someone wrapped it again since."""
    global _installed
    if _installed is None:
        return
    hook, previous_hook, exit, previous_exit = _installed
    if sys.excepthook is hook:
        sys.excepthook = previous_hook
    if sys.exit is exit:
        sys.exit = previous_exit
    _installed = None


def forget() -> None:
    """In a forked child: its own life starts without the parent's failure."""
    global _failure
    _failure = None


def _fails(status: object) -> bool:
    # sys.exit(None) and sys.exit(0) succeed; any other int fails, and so does another object (printed,
    # status 1). No `!=` on an arbitrary object: an array's would raise inside the job's sys.exit.
    if status is None:
        return False
    return status != 0 if isinstance(status, int) else True


def _note(cause: str) -> None:
    global _failure
    _failure = cause[:MAX_CAUSE_CHARS]
