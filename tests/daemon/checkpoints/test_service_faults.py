"""The checkpoint service under faults: hostile paths, deep trees, hung mounts, a full disk, inotify limits."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import functools
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs
from watchdog.observers import inotify_c

from tests.daemon.checkpoints.conftest import logged
from tests.support.checkpoints import FakeWorker, heartbeat, run_service, tiny_checkpoint, until
from torchpulse.daemon.checkpoints import roots as checkpoint_roots
from torchpulse.daemon.checkpoints import sweeps as checkpoint_sweeps
from torchpulse.daemon.checkpoints import watcher
from torchpulse.daemon.checkpoints.config import CheckpointsConfig, RootConfig
from torchpulse.daemon.checkpoints.mounts import Mount
from torchpulse.daemon.checkpoints.root_set import RootSet
from torchpulse.daemon.checkpoints.scan import deleted, metadata_key, scan
from torchpulse.daemon.checkpoints.service import CheckpointService
from torchpulse.daemon.checkpoints.state import StateStore
from torchpulse.daemon.checkpoints.watcher import Watcher, WatchEvent
from torchpulse.protocol import CheckpointSaved

# Deeper than watchdog's recursive walks go (the recursion limit, in a fresh thread).
TOO_DEEP = 1000


def _saved(path: str) -> CheckpointSaved:
    return CheckpointSaved(path, "save", 1.0, True)


@pytest.fixture
def default_recursion_limit() -> Iterator[None]:
    """The trees below are too deep for Python's default limit of 1000; another test in the same
    process (a dependency) may have raised it, and then the walks succeed."""
    saved = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    yield
    sys.setrecursionlimit(saved)


def _deep_tree(parent: Path, depth: int = TOO_DEEP) -> None:
    """parent/d/d/.../d, made with directory descriptors (the path outgrows PATH_MAX)."""
    fd = os.open(parent, os.O_RDONLY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            inner = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = inner
    finally:
        os.close(fd)


def _remove_deep_tree(parent: Path, depth: int = TOO_DEEP) -> None:
    """shutil.rmtree recurses too (pytest's clean-up would fail): remove from the bottom up with descriptors."""
    if not (parent / "d").exists():
        return
    fds = [os.open(parent, os.O_RDONLY)]
    try:
        for _ in range(depth - 1):
            fds.append(os.open("d", os.O_RDONLY, dir_fd=fds[-1]))
        while fds:
            fd = fds.pop()
            os.rmdir("d", dir_fd=fd)
            os.close(fd)
    finally:
        for fd in fds:
            os.close(fd)


# -- 1: hostile announced paths -------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["/ckpt/job\x00x/step-1", "/ckpt/job\ud800/step-1", "relative/step-1", "/"])
def test_an_unusable_announced_path_is_refused_once_and_never_stored(
    tmp_path: Path, worker: FakeWorker, bad: str
) -> None:
    """A NUL byte, a lone surrogate, a relative path, `/`: logged once, no exception, no root, sweeps work."""
    good = tmp_path / "job" / "step-1"
    tiny_checkpoint(good)
    config = CheckpointsConfig(debounce_seconds=0.0)

    async def body(service: CheckpointService) -> None:
        service.announce("bad", 0, _saved(bad))
        service.announce("bad", 0, _saved(bad))
        service.announce("good", 0, _saved(str(good)))
        await service.sweep()
        await until(lambda: len(worker.calls) == 1)
        assert [str(good.parent)] == service.roots()

    with capture_logs() as logs:
        run_service(tmp_path, config, body)
    assert [repr(bad)] == [entry["path"] for entry in logged(logs, "announced checkpoint path refused")]
    assert [] == logged(logs, "checkpoint sweep failed")
    store = StateStore(tmp_path / "state")
    assert [str(good.parent)] == list(store.announced_roots())
    store.close()


def test_saves_to_a_url_are_skipped_with_one_line_per_run_not_one_warning_per_save(
    tmp_path: Path, worker: FakeWorker
) -> None:
    """The probe sends fsspec URLs on as they are (documented: the daemon ignores them)."""

    async def body(service: CheckpointService) -> None:
        for step in range(3):
            service.announce("run", 0, _saved(f"s3://bucket/job/step-{step}"))
        await service.sweep()
        assert [] == service.roots()

    with capture_logs() as logs:
        run_service(tmp_path, CheckpointsConfig(debounce_seconds=0.0), body)
    assert [] == logged(logs, "announced checkpoint path refused")
    assert ["run"] == [entry["run"] for entry in logged(logs, "checkpoints saved to a URL")]
    assert [] == worker.calls


def test_an_exception_in_announce_never_reaches_the_agent_server(
    tmp_path: Path, worker: FakeWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def body(service: CheckpointService) -> None:
        def broken(self: RootSet, path: str) -> str | None:
            raise RuntimeError("bug")

        monkeypatch.setattr(RootSet, "root_of", broken)
        service.announce("run", 0, _saved(str(tmp_path / "job" / "step-1")))

    with capture_logs() as logs:
        run_service(tmp_path, CheckpointsConfig(), body)
    assert ["run"] == [entry["run"] for entry in logged(logs, "checkpoint announcement failed")]


def test_unusable_announced_roots_stored_by_older_versions_are_forgotten_at_start(
    tmp_path: Path, worker: FakeWorker
) -> None:
    """A NUL byte or `/` in the announced_roots table made every start raise; now they are dropped for good."""
    (tmp_path / "state").mkdir()
    good = tmp_path / "job"
    good.mkdir()
    store = StateStore(tmp_path / "state")
    now = time.time()
    for root in ("/ckpt/job\x00x", "/", str(good)):
        store.touch_announced_root(root, now)
    store.close()

    async def body(service: CheckpointService) -> None:
        assert [str(good)] == service.roots()
        await service.sweep()

    run_service(tmp_path, CheckpointsConfig(), body)
    store = StateStore(tmp_path / "state")
    assert [str(good)] == list(store.announced_roots())
    store.close()


def test_scans_and_watches_of_a_path_with_a_nul_byte_fail_softly(tmp_path: Path) -> None:
    bad = str(tmp_path / "a\x00b")
    assert ([], [], None, [True]) == (scan(bad).committed, scan(bad).uncommitted, metadata_key(bad), deleted([bad]))
    loop = asyncio.new_event_loop()
    try:
        outcome = Watcher(loop, lambda event: None, 1.0).ensure(bad, "polling")
    finally:
        loop.close()
    assert outcome.error is not None and "null" in outcome.error


# -- 2: trees too deep to walk, dead emitter threads -------------------------------------------------
def _run_removing_deep_trees(
    tmp_path: Path, root: Path, config: CheckpointsConfig, body: Callable[[CheckpointService], Awaitable[None]]
) -> list[dict[str, Any]]:
    """Run the service with captured logs; the deep tree goes, wherever the body left it."""
    try:
        with capture_logs() as logs:
            run_service(tmp_path, config, body)
    finally:
        _remove_deep_tree(tmp_path / "deep")
        _remove_deep_tree(root / "deep")
    return logs


async def _swept_until_watched(service: CheckpointService, root: str, timeout: float = 60.0) -> None:
    """Sweeps (each re-watches lost roots) until `root` is polled again; a sweep waits for a watch
    operation only for a while, so one sweep may not be enough on a loaded machine."""
    deadline = asyncio.get_running_loop().time() + timeout
    while service.watcher is None or service.watcher.watched() != {root: "polling"}:
        assert asyncio.get_running_loop().time() < deadline, service.watcher and service.watcher.watched()
        await service.sweep()
        await asyncio.sleep(0.1)


@pytest.mark.usefixtures("default_recursion_limit")
def test_a_tree_too_deep_to_walk_is_a_watch_error_retried_at_sweeps(tmp_path: Path, worker: FakeWorker) -> None:
    """RecursionError in watchdog's first walk: start works, the error is logged once, a later sweep watches."""
    root = tmp_path / "root"
    (root / "deep").mkdir(parents=True)
    _deep_tree(root / "deep")
    config = CheckpointsConfig(
        roots=(RootConfig(str(root), "polling"),), poll_interval_seconds=0.1, debounce_seconds=0.0
    )

    async def body(service: CheckpointService) -> None:
        assert service.watcher is not None
        # The polling emitter walks in its own thread: the watch is lost once that walk fails.
        await until(lambda: service.watcher is not None and {} == service.watcher.watched(), timeout=60)
        await service.sweep()
        (root / "deep").rename(tmp_path / "deep")
        await _swept_until_watched(service, str(root))

    logs = _run_removing_deep_trees(tmp_path, root, config, body)
    errors = [entry["error"] for entry in logged(logs, "cannot watch checkpoint root")]
    assert 1 == len(errors) and "RecursionError" in errors[0]


@pytest.mark.usefixtures("default_recursion_limit")
def test_a_tree_grown_too_deep_while_polled_is_watched_again_once_it_is_gone(
    tmp_path: Path, worker: FakeWorker
) -> None:
    """The polling thread's RecursionError loses the watch (not a silently dead thread); it comes back."""
    root = tmp_path / "root"
    root.mkdir()
    config = CheckpointsConfig(
        roots=(RootConfig(str(root), "polling"),), poll_interval_seconds=0.1, debounce_seconds=0.0
    )

    async def body(service: CheckpointService) -> None:
        assert service.watcher is not None
        (root / "deep").mkdir()
        _deep_tree(root / "deep")
        # Walking 1000 levels takes seconds on a loaded machine (the whole suite on 2 cores).
        await until(lambda: service.watcher is not None and {} == service.watcher.watched(), timeout=60)
        (root / "deep").rename(tmp_path / "deep")
        await _swept_until_watched(service, str(root))
        tiny_checkpoint(root / "step-1")  # found by the polling watch, no sweep needed
        await until(lambda: len(worker.calls) == 1, timeout=60)

    logs = _run_removing_deep_trees(tmp_path, root, config, body)
    assert ["backend_error"] == [entry["reason"] for entry in logged(logs, "checkpoint root watch lost")]


def test_a_root_whose_emitter_thread_died_is_not_reported_watched(tmp_path: Path) -> None:
    async def main() -> None:
        watch = Watcher(asyncio.get_running_loop(), lambda event: None, 0.1)
        try:
            assert watch.ensure(str(tmp_path), "polling").changed
            [emitter] = next(iter(watch._watches.values())).observer.emitters
            emitter.stop()  # as if its thread had died
            emitter.join(5)
            assert {} == watch.watched()
            assert watch.ensure(str(tmp_path), "polling").changed
            assert {str(tmp_path): "polling"} == watch.watched()
        finally:
            watch.stop()

    asyncio.run(main())


# -- 3: a checkpoint saved directly under / --------------------------------------------------------------
def test_a_checkpoint_directly_under_the_filesystem_root_never_makes_it_a_root(
    tmp_path: Path, worker: FakeWorker
) -> None:
    """`/ckpt` is validated (attempted: it does not exist here) without watching `/`; other jobs keep their roots."""
    top = "/torchpulse-test-no-such-checkpoint"
    job = tmp_path / "jobB" / "step-1"
    tiny_checkpoint(job)

    async def body(service: CheckpointService) -> None:
        service.announce("a", 0, _saved(top))
        service.announce("b", 0, _saved(str(job)))
        await until(lambda: service.stats.root(str(job.parent)).validations["valid"] == 1)
        # Newest first: `top`'s attempt may come after the job's validation on a loaded machine.
        await until(lambda: bool(logged(logs, "checkpoint vanished before validation")))
        assert [str(job.parent)] == service.roots()

    with capture_logs() as logs:
        run_service(tmp_path, CheckpointsConfig(debounce_seconds=0.0), body)
    assert [top] == [entry["path"] for entry in logged(logs, "checkpoint vanished before validation")]
    assert [top] == [entry["path"] for entry in logged(logs, "checkpoint saved directly under /")]


# -- 4: a hung mount blocks neither the loop nor the other roots ------------------------------------------
def test_a_hung_root_blocks_neither_the_loop_nor_the_other_roots(
    tmp_path: Path, worker: FakeWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first snapshot and the scan of one root never return: start, SIGHUP, announcements and sweeps go on."""
    hung, good = tmp_path / "hung", tmp_path / "good"
    hung.mkdir()
    good.mkdir()
    release = threading.Event()
    monkeypatch.setattr(checkpoint_sweeps, "SETTLE_SECONDS", 0.3)  # scans
    monkeypatch.setattr(checkpoint_roots, "SETTLE_SECONDS", 0.3)  # watch operations
    snapshot = watcher._SafePollingEmitter.on_thread_start
    real_scan = checkpoint_sweeps.scan

    def hanging_snapshot(self: watcher._SafePollingEmitter) -> None:
        if self.watch.path == str(hung):
            release.wait(30)
        snapshot(self)

    def hanging_scan(root: str) -> Any:
        if root == str(hung):
            release.wait(30)
        return real_scan(root)

    monkeypatch.setattr(watcher._SafePollingEmitter, "on_thread_start", hanging_snapshot)
    monkeypatch.setattr(checkpoint_sweeps, "scan", hanging_scan)
    config = CheckpointsConfig(
        roots=(RootConfig(str(hung), "polling"), RootConfig(str(good), "polling")),
        poll_interval_seconds=0.1,
        debounce_seconds=0.0,
    )
    gaps: list[float] = []

    async def main() -> None:
        (tmp_path / "state").mkdir()
        service = CheckpointService(config, tmp_path / "state")
        beat = asyncio.create_task(heartbeat(gaps))
        try:
            await asyncio.wait_for(service.start(), 5)
            assert service.watcher is not None
            assert {str(good): "polling"} == service.watcher.watched()
            service.apply_config(CheckpointsConfig(roots=config.roots, poll_interval_seconds=0.2, debounce_seconds=0.0))
            tiny_checkpoint(tmp_path / "job" / "step-1")
            service.announce("run", 0, _saved(str(tmp_path / "job" / "step-1")))
            tiny_checkpoint(good / "step-1")
            for _ in range(3):
                await asyncio.wait_for(service.sweep(), 5)
            await until(lambda: len(worker.calls) == 2)
            assert {str(good): "polling", str(tmp_path / "job"): "inotify"} == service.watcher.watched()
            started = time.monotonic()
            await service.sweep()  # the hung root's operations are old now: not waited for again
            assert time.monotonic() - started < 0.25
        finally:
            release.set()
            beat.cancel()
            await service.close()

    asyncio.run(main())
    assert max(gaps) < 0.5


# -- 5: a state store that cannot be written -------------------------------------------------------------
def test_a_state_store_that_cannot_be_written_does_not_revalidate_at_every_sweep(
    tmp_path: Path, worker: FakeWorker
) -> None:
    root = tmp_path / "root"
    for step in range(3):
        tiny_checkpoint(root / f"step-{step}")
    config = CheckpointsConfig(roots=(RootConfig(str(root), "inotify"),), debounce_seconds=0.0)

    async def body(service: CheckpointService) -> None:
        assert service.store is not None
        service.store._db.execute("PRAGMA query_only=ON")  # a full or read-only state filesystem
        await until(lambda: len(worker.calls) == 3)
        for _ in range(3):
            await service.sweep()
        await asyncio.sleep(0.1)

    run_service(tmp_path, config, body)
    assert 3 == len(worker.calls)


# -- 6: the inotify -> polling fallback is sticky and happens at the first watch too -----------------------
def test_a_fallback_to_polling_survives_sighup_until_the_root_observer_changes(
    tmp_path: Path, worker: FakeWorker
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    config = CheckpointsConfig(roots=(RootConfig(str(root)),), debounce_seconds=0.0)  # auto: inotify here

    async def body(service: CheckpointService) -> None:
        assert service.watcher is not None
        assert {str(root): "inotify"} == service.watcher.watched()
        service._on_watch_event(WatchEvent("backend_error", str(root), str(root), "inotify watch limit reached"))
        await service.sweep()
        assert {str(root): "polling"} == service.watcher.watched()
        service.apply_config(config)  # SIGHUP, nothing changed
        service.announce("run", 0, _saved(str(tmp_path / "job" / "step-1")))  # a new announced root
        await service.sweep()
        assert "polling" == service.watcher.watched()[str(root)]
        service.apply_config(CheckpointsConfig(roots=(RootConfig(str(root), "inotify"),), debounce_seconds=0.0))
        await service.sweep()
        assert "inotify" == service.watcher.watched()[str(root)]

    run_service(tmp_path, config, body)


def test_inotify_out_of_watches_at_the_first_watch_falls_back_to_polling(
    tmp_path: Path, worker: FakeWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "root"
    root.mkdir()

    def out_of_watches(self: Any) -> None:
        raise OSError(errno.ENOSPC, "inotify watch limit reached")

    monkeypatch.setattr(watcher._SafeInotifyEmitter, "on_thread_start", out_of_watches)
    config = CheckpointsConfig(roots=(RootConfig(str(root)),), poll_interval_seconds=0.1, debounce_seconds=0.0)

    async def body(service: CheckpointService) -> None:
        assert service.watcher is not None
        assert {str(root): "polling"} == service.watcher.watched()
        tiny_checkpoint(root / "step-1")
        await until(lambda: len(worker.calls) == 1)

    with capture_logs() as logs:
        run_service(tmp_path, config, body)
    assert [] == logged(logs, "cannot watch checkpoint root")
    assert [str(root)] == [entry["root"] for entry in logged(logs, "inotify cannot watch")]


class WatchBudget:
    """inotify_add_watch as the kernel answers once the user's watches run out: ENOSPC past `left` more watches."""

    def __init__(self, left: int) -> None:
        self.left = left
        self.refused: list[bytes] = []
        self.real = inotify_c.inotify_add_watch

    def __call__(self, fd: int, path: bytes, mask: int) -> int:
        if self.left <= 0:
            self.refused.append(path)
            ctypes.set_errno(errno.ENOSPC)
            return -1
        self.left -= 1
        return int(self.real(fd, path, mask))


@pytest.mark.parametrize("existing", [0, 3], ids=["new-directory", "at-start"])
def test_running_out_of_inotify_watches_below_the_root_falls_back_to_polling(
    tmp_path: Path, worker: FakeWorker, monkeypatch: pytest.MonkeyPatch, existing: int
) -> None:
    """watchdog ignores a subdirectory it cannot watch: ENOSPC there (at the first walk, or for a checkpoint
    directory created later) must still make the root polled, logged, and no checkpoint wait for a sweep."""
    root = tmp_path / "root"
    root.mkdir()
    for step in range(existing):
        tiny_checkpoint(root / f"old-{step}")
    budget = WatchBudget(left=2)  # the root and one directory
    monkeypatch.setattr(inotify_c, "inotify_add_watch", budget)
    # The sweeps run every 60 s: whatever is validated below was found by a watch (or the catch-up after a loss).
    config = CheckpointsConfig(roots=(RootConfig(str(root)),), poll_interval_seconds=0.1, debounce_seconds=0.0)

    async def body(service: CheckpointService) -> None:
        assert service.watcher is not None
        await until(lambda: len(worker.calls) == existing)
        await asyncio.sleep(0.2)  # the first sweep's scan is over
        for step in range(3):
            tiny_checkpoint(root / f"step-{step}")
            await until(functools.partial(worker.called, existing + step + 1))
        assert {str(root): "polling"} == service.watcher.watched()

    with capture_logs() as logs:
        run_service(tmp_path, config, body)
    assert [] != budget.refused
    assert ["inotify watch limit reached"] == [entry["error"] for entry in logged(logs, "inotify cannot watch")]


# -- 7: a symlinked root into a network mount ---------------------------------------------------------------
def test_a_symlinked_root_into_an_nfs_mount_is_polled(tmp_path: Path, worker: FakeWorker) -> None:
    target = tmp_path / "nfs" / "ckpt"
    target.mkdir(parents=True)
    link = tmp_path / "link"
    link.symlink_to(target)
    mounts = [Mount("/", "ext4"), Mount(os.path.realpath(tmp_path / "nfs"), "nfs4")]
    config = CheckpointsConfig(roots=(RootConfig(str(link)),))
    (tmp_path / "state").mkdir()

    async def main() -> None:
        service = CheckpointService(config, tmp_path / "state", mounts=mounts)
        await service.start()
        try:
            assert service.watcher is not None
            assert {str(link): "polling"} == service.watcher.watched()
            assert [str(link)] == service.roots()  # the label stays the configured path
        finally:
            await service.close()

    asyncio.run(main())


def test_a_symlinked_root_watched_with_inotify_sees_new_checkpoints_and_follows_a_repointed_link(
    tmp_path: Path, worker: FakeWorker
) -> None:
    """inotify does not follow a symlinked root: the watch is on its target, events are reported under the link,
    and the link pointed elsewhere is followed from the next sweep on (no sweep finds these: they run every 60 s)."""
    first, second = tmp_path / "nvme-a" / "ckpt", tmp_path / "nvme-b" / "ckpt"
    first.mkdir(parents=True)
    second.mkdir(parents=True)
    link = tmp_path / "ckpt"
    link.symlink_to(first)
    config = CheckpointsConfig(roots=(RootConfig(str(link), "inotify"),), debounce_seconds=0.0)

    async def body(service: CheckpointService) -> None:
        await asyncio.sleep(0.2)  # the first sweep's scan is over
        # Each wait is for the result, not the call: the fake worker is called before it answers, and a loaded
        # machine can put the answer after the next poll (and a relink before it: step-1 is then gone).
        tiny_checkpoint(link / "step-1")
        await until(lambda: service.stats.root(str(link)).validations["valid"] == 1)
        link.unlink()
        link.symlink_to(second)
        await service.sweep()
        tiny_checkpoint(link / "step-2")
        await until(lambda: service.stats.root(str(link)).validations["valid"] == 2)

    run_service(tmp_path, config, body)
    assert [str(link / "step-1"), str(link / "step-2")] == worker.calls


# -- minor: dangling shard symlinks and directories named like shards -------------------------------------------
def test_dangling_shard_symlinks_and_shard_named_directories_do_not_revalidate_each_sweep(
    tmp_path: Path, worker: FakeWorker
) -> None:
    root = tmp_path / "root"
    with_dir, with_link, only_link = root / "stepA", root / "stepB", root / "stepC"
    for step in (with_dir, with_link, only_link):
        step.mkdir(parents=True)
    old = time.time() - 100
    for step in (with_dir, with_link):
        (step / "__0_0.distcp").touch()
        os.utime(step / "__0_0.distcp", (old, old))
    (with_dir / "sub.distcp").mkdir()
    os.utime(with_dir / "sub.distcp", (old + 10, old + 10))
    (with_link / "__1_0.distcp").symlink_to("/nonexistent")
    (only_link / "__0_0.distcp").symlink_to("/nonexistent")
    config = CheckpointsConfig(
        roots=(RootConfig(str(root), "inotify"),), incomplete_after_seconds=2.0, debounce_seconds=0.0
    )

    async def body(service: CheckpointService) -> None:
        await until(lambda: len(worker.calls) == 2)
        for _ in range(3):
            await service.sweep()
            await asyncio.sleep(0.05)
        assert 2 == service.stats.root(str(root)).incomplete

    with capture_logs() as logs:
        run_service(tmp_path, config, body)
    assert sorted([str(with_dir), str(with_link)]) == sorted(worker.calls)
    assert [] == logged(logs, "checkpoint vanished")


def test_a_watchdog_with_other_inotify_internals_still_watches_with_one_warning(
    tmp_path: Path, worker: FakeWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watch-limit hook uses watchdog 7's private InotifyWatchGroup: if its shape differs, the root is
    watched by watchdog's own start (a commit is still seen at once) and the lost hook is said once."""
    from torchpulse.daemon.checkpoints import watcher as watcher_module

    def other_shape(*_args: object, **_kwargs: object) -> None:
        raise TypeError("__init__() got an unexpected keyword argument 'follow_symlink'")

    monkeypatch.setattr(watcher_module, "InotifyWatchGroup", other_shape)
    monkeypatch.setattr(watcher_module, "_limit_hook_noted", False)
    root = tmp_path / "root"
    root.mkdir()
    config = CheckpointsConfig(roots=(RootConfig(str(root)),), poll_interval_seconds=0.1, debounce_seconds=0.0)

    async def body(service: CheckpointService) -> None:
        assert service.watcher is not None
        await asyncio.sleep(0.2)  # the first sweep's scan is over; the next is 60 s away
        tiny_checkpoint(root / "step-0")
        await until(functools.partial(worker.called, 1))
        assert {str(root): "inotify"} == service.watcher.watched()

    with capture_logs() as logs:
        run_service(tmp_path, config, body)
    assert 1 == len(
        logged(
            logs,
            "this watchdog's inotify internals differ: running out of inotify watches below "
            "a root is noticed only by the periodic sweep",
        )
    )
