"""The load level: torch reads the data, never the .metadata, and leaves neither cache nor files behind."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

from torchpulse.checkpoints.model import Level, Status
from torchpulse.checkpoints.validate import Options, validate

filesystem = pytest.importorskip("torch.distributed.checkpoint.filesystem")


def test_load_level_evicts_every_data_file_after_torch_read_it(
    single_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With drop_cache, each .distcp file gets POSIX_FADV_DONTNEED after torch's reader last read it."""
    events: list[tuple[str, str]] = []
    real_fadvise, real_read = os.posix_fadvise, filesystem.FileSystemReader.read_data

    def fadvise(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_DONTNEED:
            events.append(("evict", Path(f"/proc/self/fd/{fd}").readlink().name))
        real_fadvise(fd, offset, length, advice)

    def read_data(self: Any, plan: Any, planner: Any) -> Any:
        events.append(("read", ""))
        return real_read(self, plan, planner)

    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    monkeypatch.setattr(filesystem.FileSystemReader, "read_data", read_data)
    result = validate(single_root / "single", Level.LOAD, Options(drop_cache=True))
    last_read = max(i for i, (kind, _) in enumerate(events) if kind == "read")
    evicted_after = {name for kind, name in events[last_read:] if kind == "evict"}
    data_files = {p.name for p in (single_root / "single").glob("*.distcp")}
    assert (Status.VALID, data_files) == (result.status, evicted_after & data_files)


def test_load_level_removes_its_rendezvous_directory(
    single_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gloo FileStore's private directory is gone after the load: a daemon validating for weeks leaks none."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    result = validate(single_root / "single", Level.LOAD)
    assert (Status.VALID, []) == (result.status, sorted(p.name for p in tmp_path.iterdir()))


def test_load_level_never_lets_torch_unpickle_the_metadata(single_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's FileSystemReader reads .metadata with plain pickle: the load level must hand it our parse instead."""
    unpickled: list[object] = []

    class Refusing:
        def load(self, *args: object, **kwargs: object) -> object:
            unpickled.append(args)
            raise AssertionError("plain pickle reached .metadata")

    monkeypatch.setattr(filesystem, "pickle", Refusing())
    result = validate(single_root / "single", Level.LOAD)
    assert (Status.VALID, (), []) == (result.status, result.findings, unpickled)
