"""Checkpoint probe: time `torch.distributed.checkpoint.save`/`async_save` and announce the path.

The daemon validates what rank 0 announces (one node per checkpoint) and
watches the checkpoint's parent directory from then on. The save itself is
untouched: same arguments, same return value, its exceptions propagate.

`torch.distributed.checkpoint` takes ~0.9 s to import, so the probe does not
import it: when the job has not imported it yet, a meta-path hook patches
`state_dict_saver` right after it executes, before the package's
`from .state_dict_saver import save, async_save` re-exports the names.

Limit: a reference the job took before the probe attached
(`from torch.distributed.checkpoint import save` in a module imported before
a remote attach) still points at torch's function, so those saves are not seen.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, Final

from torchpulse.probes.base import Probe
from torchpulse.protocol import CHECKPOINT_SAVED_EVENT

SAVER: Final = "torch.distributed.checkpoint.state_dict_saver"
PACKAGE: Final = "torch.distributed.checkpoint"
APIS: Final = ("save", "async_save")


def checkpoint_path(kwargs: dict[str, Any]) -> str | None:
    """Where the save writes: `checkpoint_id`, else the storage writer's `path`, made absolute."""
    target = kwargs.get("checkpoint_id")
    if target is None:
        target = getattr(kwargs.get("storage_writer"), "path", None)
    if target is None:
        return None
    text = os.fspath(target) if isinstance(target, str | os.PathLike) else str(target)
    # A URL (s3://, fsspec) stays as it is; the daemon ignores what is not a local path.
    return text if "://" in text else os.path.normpath(Path(text).absolute())


def is_coordinator(kwargs: dict[str, Any], global_rank: int) -> bool:
    """True where torch writes the checkpoint's `.metadata`: rank 0 of the save's process group.

    A save on a subgroup that leaves out global rank 0 is otherwise validated by no one.
    """
    import torch.distributed as dist

    if kwargs.get("no_dist") or not (dist.is_available() and dist.is_initialized()):
        return global_rank == 0
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


def _called_by_dcp() -> bool:
    """True when the caller is torch.distributed.checkpoint itself (saves are rare: a frame look is cheap)."""
    caller = sys._getframe(2).f_code.co_filename
    return f"{os.sep}distributed{os.sep}checkpoint{os.sep}" in caller


class CheckpointProbe(Probe):
    name = "checkpoint"

    def _install(self) -> None:
        self._install_after_import(SAVER, lambda: self._patch(sys.modules[SAVER]))

    def _patch(self, saver: ModuleType) -> None:
        for api in APIS:
            original = getattr(saver, api, None)
            if original is not None:
                self._keep(_Patch(saver, api, original, self._wrap(api, original)))

    def _wrap(self, api: str, original: Callable[..., Any]) -> Callable[..., Any]:
        probe, agent = self, self.agent
        announce = self.guard(self._announce)

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            # async_save's upload thread calls `save`: that is not a second save.
            if not (probe.enabled and agent.enabled) or _called_by_dcp():
                return original(*args, **kwargs)
            started = time.perf_counter()
            result = original(*args, **kwargs)
            announce(api, kwargs, started, result)
            return result

        wrapper.__torchpulse_original__ = original  # type: ignore[attr-defined]
        return wrapper

    def _announce(self, api: str, kwargs: dict[str, Any], started: float, result: Any) -> None:
        path = checkpoint_path(kwargs)
        validate = is_coordinator(kwargs, self.agent.identity.rank)
        if api == "save":
            self.agent.record(self._saved, api, path, validate, time.perf_counter() - started)
            return
        # async_save returns a Future, or an AsyncSaveResponse whose upload is the commit.
        upload = getattr(result, "upload_completion", result)
        add_done_callback = getattr(upload, "add_done_callback", None)
        if add_done_callback is None:
            return

        def uploaded(future: Any) -> None:
            if not future.cancelled() and future.exception() is None:
                self.agent.record(self._saved, api, path, validate, time.perf_counter() - started)

        add_done_callback(self.guard(uploaded))

    def _saved(self, api: str, path: str | None, validate: bool, seconds: float) -> None:
        """Sender thread: fold into the histogram and queue the announcement."""
        self.agent.store.observe("checkpoint_save_duration_seconds", (api,), seconds)
        if path is not None:
            self.agent.emit("info", CHECKPOINT_SAVED_EVENT, path=path, api=api, duration_seconds=round(seconds, 6),
                            validate=validate)
