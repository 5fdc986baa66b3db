"""Checkpoint probe: time `torch.distributed.checkpoint.save`/`async_save`, announce the path, count failures.

The daemon validates what rank 0 of the saving process group announces (one
node per checkpoint; a process saving without one announces its own) and
watches the checkpoint's parent directory from then on. The save itself is
untouched: same arguments, same return value, its exceptions propagate.

A save that raises (a `save`, an `async_save` while staging, or an async
upload whose future ends in an exception) counts in
`checkpoint_save_failures_total{api,error}` (error: the class of what went
wrong, for DCP's CheckpointException that of the first failing rank's exception)
and logs a warning event; the job
still gets the very same exception. Failures are `Exception`s and DCP's
`CheckpointException` (a `BaseException` in torch 2.13); KeyboardInterrupt,
SystemExit and the like pass uncounted. A cancelled upload future is no
failure (only the job, or its executor's shutdown, cancels one): it logs an
info event and counts nothing.

`torch.distributed.checkpoint` takes ~0.9 s to import, so the probe does not
import it: when the job has not imported it yet, a meta-path hook patches
`state_dict_saver` right after it executes, before the package's
`from .state_dict_saver import save, async_save` re-exports the names.

Limit: a reference the job took before the probe attached
(`from torch.distributed.checkpoint import save` in a module imported before
a remote attach) still points at torch's function, so those saves are not seen.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Final, NamedTuple

from torchpulse.limits import MAX_ERROR_CHARS, MAX_ERROR_LABELS, MAX_MESSAGE_CHARS
from torchpulse.probes.agent.probe import Probe
from torchpulse.probes.agent.store import BoundedLabel
from torchpulse.protocol import CHECKPOINT_SAVED_EVENT

if TYPE_CHECKING:
    from torchpulse.probes.agent.agent import Agent

SAVER: Final = "torch.distributed.checkpoint.state_dict_saver"
PACKAGE: Final = "torch.distributed.checkpoint"
# Holds CheckpointException; state_dict_saver imports it (through .utils) before the probe patches.
API_MODULE: Final = "torch.distributed.checkpoint.api"
APIS: Final = ("save", "async_save")
SAVE_FAILED_EVENT: Final = "checkpoint save failed"
SAVE_CANCELLED_EVENT: Final = "checkpoint save cancelled"
# fsspec's protocols for local files: DCP writes such a checkpoint_id through FsspecWriter.
LOCAL_URLS: Final = ("file://", "local://")


def checkpoint_path(kwargs: dict[str, Any]) -> str | None:
    """Where the save writes: `checkpoint_id`, else the storage writer's `path`, made absolute."""
    target = kwargs.get("checkpoint_id")
    if not target:  # as torch's writers' `reset`: an empty checkpoint_id leaves the writer's path as it is
        target = getattr(kwargs.get("storage_writer"), "path", None)
    if target is None:
        return None
    text = os.fspath(target) if isinstance(target, str | os.PathLike) else str(target)
    if text.startswith(LOCAL_URLS):
        # fsspec's local files: a path the daemon can validate like any other.
        text = local_url_path(text)
    # Another URL (s3://, gs://) stays as it is; the daemon ignores what is not a local path.
    return text if "://" in text else absolute_path(text)


def directory_identity(path: str | None, validate: bool) -> tuple[int, int] | None:
    """(st_dev, st_ino) of the checkpoint directory the save just wrote, for the announcement that asks for its
    validation; None for other ranks, URLs, or a directory already gone.

    Taken on the thread that saw the save end, one stat of a directory it just wrote: the daemon compares it with
    what the same path names on its side (another mount namespace, a container, can name another directory).
    """
    if not validate or path is None or "://" in path:
        return None
    try:
        info = Path(path).stat()
    except (OSError, ValueError):  # ValueError: a NUL in the path
        return None
    return info.st_dev, info.st_ino


def local_url_path(url: str) -> str:
    """The local path DCP's FsspecWriter writes `url` to, as fsspec resolves it; `url` itself without fsspec.

    fsspec takes what follows `file://` as a path: `file://localhost/ck` and `file://ck` are relative to
    the job's cwd, `%20` stays as it is, `~` is expanded. Without fsspec DCP cannot save to a URL at all.
    """
    try:
        from fsspec.core import url_to_fs  # type: ignore[import-untyped]
    except ImportError:
        return url
    try:
        return str(url_to_fs(url)[1])
    except (ValueError, OSError):  # OSError: the job's cwd is gone
        return url


def absolute_path(text: str) -> str:
    """`text` made absolute and normalized as the kernel resolves it; `text` itself when the cwd is gone.

    A `..` after a symlink leads out of the link's target, not back to the link's directory: the path up to
    its last `..` is resolved (only then), the rest stays as written (a symlinked root keeps its name).
    """
    try:
        path = Path(text).absolute()  # a relative path asks for the cwd: a deleted (or stale NFS) one raises
    except OSError:
        return text
    parts = path.parts
    if os.pardir in parts:
        last = len(parts) - 1 - parts[::-1].index(os.pardir)
        with contextlib.suppress(OSError, RuntimeError):  # RuntimeError: a symlink loop; the save failed then
            path = Path(*parts[: last + 1]).resolve().joinpath(*parts[last + 1 :])
    return os.path.normpath(path)


def call_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The save's arguments by name: `kwargs`, plus a `storage_writer` passed second.

    torch's `_api_bc_check` still accepts the pre-2.2 order `save(state_dict, storage_writer)`
    (with a warning): without this, such a save would be announced with no path, so never validated.
    """
    if len(args) == 2 and "storage_writer" not in kwargs:
        return {**kwargs, "storage_writer": args[1]}
    return kwargs


def is_coordinator(kwargs: dict[str, Any]) -> bool:
    """True where torch writes the checkpoint's `.metadata`: rank 0 of the save's process group.

    A save on a subgroup that leaves out global rank 0 is otherwise validated by no one. Without a
    process group (`no_dist`, or none initialized) DCP saves this process's checkpoint alone and
    writes its `.metadata` whatever RANK says: rank-local saves and srun task arrays land where
    rank 0 never announces, so each process asks for its own.
    """
    import torch.distributed as dist

    if kwargs.get("no_dist") or not (dist.is_available() and dist.is_initialized()):
        return True
    return bool(dist.get_rank(kwargs.get("process_group")) == 0)


class _Patch:
    """Replaces `saver.<name>`; `remove` restores it and the package's re-export.

    Either is left alone when someone patched over our wrapper since. The
    package is looked up at removal: under the import hook it re-exported
    the wrapper after the patch was made.
    """

    def __init__(self, saver: ModuleType, name: str, original: Any, wrapper: Any) -> None:
        self.saver, self.name, self.original, self.wrapper = saver, name, original, wrapper
        setattr(saver, name, wrapper)
        package = sys.modules.get(PACKAGE)
        if package is not None and getattr(package, name, None) is original:
            setattr(package, name, wrapper)

    def remove(self) -> None:
        for module in (self.saver, sys.modules.get(PACKAGE)):
            if module is not None and getattr(module, self.name, None) is self.wrapper:
                setattr(module, self.name, self.original)


class SaveFailure(NamedTuple):
    """What the log keeps of a failed save: plain strings, so no traceback (and its frames' tensors) stays alive."""

    error: str  # class of the exception the job got
    cause: str | None  # class of the first failing rank's exception inside a CheckpointException
    message: str


def describe_failure(exc: BaseException) -> SaveFailure:
    """Class, cause and a one-line message of `exc`; a CheckpointException is described by its first failure.

    Its own text is a traceback per failing rank: the first rank's exception is the useful part.
    """
    failures = getattr(exc, "failures", None)
    inner: BaseException | None = None
    if isinstance(failures, dict) and failures:
        wrapped = next(iter(failures.values()))
        first = wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped
        inner = first if isinstance(first, BaseException) else None
    shown = exc if inner is None else inner
    message = "".join(traceback.format_exception_only(type(shown), shown)).strip()
    if inner is not None and isinstance(failures, dict):
        message = f"{len(failures)} rank(s) failed, the first with {message}"
    return SaveFailure(type(exc).__name__, None if inner is None else type(inner).__name__, message[:MAX_MESSAGE_CHARS])


def failure_types() -> tuple[type[BaseException], ...]:
    """The exceptions that are failed saves: `Exception`, and DCP's CheckpointException, a BaseException."""
    checkpoint_exception = getattr(sys.modules.get(API_MODULE), "CheckpointException", None)
    if isinstance(checkpoint_exception, type) and issubclass(checkpoint_exception, BaseException):
        return (Exception, checkpoint_exception)
    return (Exception,)


def _called_by_dcp(dcp_dir: str) -> bool:
    """True when the caller is a module under `dcp_dir`, torch.distributed.checkpoint's own directory (saves are
    rare: a frame look is cheap). A job's own `.../distributed/checkpoint/` package is no part of it."""
    return sys._getframe(2).f_code.co_filename.startswith(dcp_dir)


class CheckpointProbe(Probe):
    name = "checkpoint"

    def __init__(self, agent: Agent) -> None:
        super().__init__(agent)
        # Sender thread only; kept across uninstall so a re-install stays within the bound.
        self._errors = BoundedLabel(MAX_ERROR_LABELS)
        self._failures: tuple[type[BaseException], ...] = (Exception,)

    def _install(self) -> None:
        self._install_after_import(SAVER, lambda: self._patch(sys.modules[SAVER]))

    def _patch(self, saver: ModuleType) -> None:
        self._failures = failure_types()
        dcp_dir = f"{Path(saver.__file__ or '').parent}{os.sep}"  # where torch.distributed.checkpoint's modules are
        for api in APIS:
            original = getattr(saver, api, None)
            if original is not None:
                self._keep(_Patch(saver, api, original, self._wrap(api, original, dcp_dir)))

    def _wrap(self, api: str, original: Callable[..., Any], dcp_dir: str) -> Callable[..., Any]:
        probe, agent, failures = self, self.agent, self._failures
        announce = self.guard(self._announce, traceable=False)
        failed = self.guard(self._failed, traceable=False)

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            # async_save's upload thread calls `save`: that is not a second save.
            if not (probe.enabled and agent.enabled) or _called_by_dcp(dcp_dir):
                return original(*args, **kwargs)
            started = time.perf_counter()
            try:
                result = original(*args, **kwargs)
            except failures as exc:
                failed(api, call_arguments(args, kwargs), started, exc)
                raise  # the very same object; a KeyboardInterrupt or SystemExit never comes here
            announce(api, call_arguments(args, kwargs), started, result)
            return result

        wrapper.__torchpulse_original__ = original  # type: ignore[attr-defined]
        return wrapper

    def _announce(self, api: str, kwargs: dict[str, Any], started: float, result: Any) -> None:
        path = checkpoint_path(kwargs)
        validate = is_coordinator(kwargs)
        if api == "save":
            seconds = time.perf_counter() - started
            self.agent.record(self._saved, api, path, validate, seconds, directory_identity(path, validate))
            return
        # async_save returns a Future, or an AsyncSaveResponse whose upload is the commit.
        upload = getattr(result, "upload_completion", result)
        add_done_callback = getattr(upload, "add_done_callback", None)
        if add_done_callback is None:
            return

        def uploaded(future: Any) -> None:
            if future.cancelled():
                self.agent.record(self._cancelled, api, path)
                return
            error = future.exception()
            if error is None:
                seconds = time.perf_counter() - started
                self.agent.record(self._saved, api, path, validate, seconds, directory_identity(path, validate))
            elif isinstance(error, self._failures):
                self.agent.record(self._save_failed, api, path, describe_failure(error), time.perf_counter() - started)

        add_done_callback(self.guard(uploaded, traceable=False))

    def _failed(self, api: str, kwargs: dict[str, Any], started: float, exc: BaseException) -> None:
        """The save raised (job's thread): describe it now, count it on the sender thread."""
        seconds = time.perf_counter() - started
        self.agent.record(self._save_failed, api, checkpoint_path(kwargs), describe_failure(exc), seconds)

    def _saved(
        self, api: str, path: str | None, validate: bool, seconds: float, identity: tuple[int, int] | None
    ) -> None:
        """Sender thread: fold into the histogram and queue the announcement."""
        self.agent.store.observe("checkpoint_save_duration_seconds", (api,), seconds)
        if path is not None:
            known = {} if identity is None else {"device": identity[0], "inode": identity[1]}
            self.agent.emit(
                "info",
                CHECKPOINT_SAVED_EVENT,
                path=path,
                api=api,
                duration_seconds=round(seconds, 6),
                validate=validate,
                **known,
            )

    def _save_failed(self, api: str, path: str | None, failure: SaveFailure, seconds: float) -> None:
        """Sender thread: count the failure under a bounded `error` label and log it in full."""
        # DCP wraps every failure in a CheckpointException: the cause says what went wrong.
        error = self._errors((failure.cause or failure.error)[:MAX_ERROR_CHARS] or "unknown")
        self.agent.store.inc("checkpoint_save_failures_total", (api, error))
        self.agent.emit(
            "warning",
            SAVE_FAILED_EVENT,
            path=path,
            api=api,
            error=failure.error,
            cause=failure.cause,
            message=failure.message,
            duration_seconds=round(seconds, 6),
        )

    def _cancelled(self, api: str, path: str | None) -> None:
        """Sender thread: a cancelled upload wrote no checkpoint; the job asked for that, so only log it."""
        self.agent.emit("info", SAVE_CANCELLED_EVENT, path=path, api=api)
