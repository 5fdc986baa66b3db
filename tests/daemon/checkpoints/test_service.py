"""The checkpoint service in-process, with a fake worker: debounce, de-duplication, concurrency."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

import pytest

from tests.daemon.checkpoints.conftest import idle, rewrite_a_shard
from tests.support.checkpoints import FakeWorker, commit_copy, run_service, tiny_checkpoint, until
from torchpulse.checkpoints.model import Finding, Level, Severity, Status, ValidationResult
from torchpulse.checkpoints.worker import Limits
from torchpulse.daemon.checkpoints import runner as checkpoint_runner
from torchpulse.daemon.checkpoints.config import CheckpointsConfig, RootConfig
from torchpulse.daemon.checkpoints.scan import metadata_key
from torchpulse.daemon.checkpoints.service import CheckpointService
from torchpulse.exporters.collectors.checkpoints import CheckpointCollector
from torchpulse.protocol import CheckpointSaved


@pytest.fixture
def worker(monkeypatch: pytest.MonkeyPatch) -> FakeWorker:
    fake = FakeWorker()
    monkeypatch.setattr(checkpoint_runner, "validate", fake)
    return fake


def test_events_and_announcements_for_one_checkpoint_validate_it_once(
    tmp_path: Path, saved_checkpoint: Path, worker: FakeWorker
) -> None:
    """A commit event, a sweep and two announcements of the same checkpoint make one validation."""
    root = tmp_path / "root"
    root.mkdir()
    config = CheckpointsConfig(roots=(RootConfig(str(root), "inotify"),), debounce_seconds=0.1)

    async def body(service: CheckpointService) -> None:
        commit_copy(saved_checkpoint, root / "step-1")
        saved = CheckpointSaved(str(root / "step-1"), "save", 0.1, True)
        service.announce("run", 0, saved)
        service.announce("run", 0, saved)
        await service.sweep()
        await until(lambda: service.stats.root(str(root)).validations["valid"] >= 1)
        await asyncio.sleep(0.5)

    run_service(tmp_path, config, body)
    assert [str(root / "step-1")] == worker.calls


def test_validations_never_exceed_the_concurrency_limit(
    tmp_path: Path, saved_checkpoint: Path, worker: FakeWorker
) -> None:
    """Five checkpoints committed together run two at a time and all get validated."""
    root = tmp_path / "root"
    root.mkdir()
    config = CheckpointsConfig(
        roots=(RootConfig(str(root), "inotify"),), max_concurrent_validations=2, debounce_seconds=0.0
    )

    async def body(service: CheckpointService) -> None:
        for step in range(5):
            commit_copy(saved_checkpoint, root / f"step-{step}")
        await until(lambda: service.stats.root(str(root)).validations["valid"] == 5)

    run_service(tmp_path, config, body)
    assert (5, 2) == (len(set(worker.calls)), worker.most)


def test_a_restart_skips_validated_checkpoints_and_finds_new_ones(
    tmp_path: Path, saved_checkpoint: Path, worker: FakeWorker
) -> None:
    """State in SQLite: after a restart only the checkpoint committed while down is validated."""
    root = tmp_path / "root"
    root.mkdir()
    config = CheckpointsConfig(roots=(RootConfig(str(root), "polling"),), poll_interval_seconds=0.2)

    async def first(service: CheckpointService) -> None:
        commit_copy(saved_checkpoint, root / "step-1")
        await until(lambda: service.stats.root(str(root)).validations["valid"] == 1)

    run_service(tmp_path, config, first)
    commit_copy(saved_checkpoint, root / "step-2")

    async def second(service: CheckpointService) -> None:
        await until(lambda: service.stats.root(str(root)).validations["valid"] == 1)
        await service.sweep()
        assert "valid" == service.stats.root(str(root)).last_status

    run_service(tmp_path, config, second)
    assert [str(root / "step-1"), str(root / "step-2")] == worker.calls


def test_an_overwrite_in_place_is_validated_again(tmp_path: Path, saved_checkpoint: Path, worker: FakeWorker) -> None:
    """A new `.metadata` (new inode) in a validated directory is a new checkpoint."""
    root = tmp_path / "root"
    root.mkdir()
    config = CheckpointsConfig(roots=(RootConfig(str(root), "inotify"),), debounce_seconds=0.05)

    async def body(service: CheckpointService) -> None:
        commit_copy(saved_checkpoint, root / "step-1")
        await until(lambda: service.stats.root(str(root)).validations["valid"] == 1)
        shutil.rmtree(root / "step-1")
        commit_copy(saved_checkpoint, root / "step-1")
        await until(lambda: service.stats.root(str(root)).validations["valid"] == 2)

    run_service(tmp_path, config, body)
    assert 2 == len(worker.calls)


def test_the_key_of_a_checkpoint_names_data_written_after_its_metadata(tmp_path: Path) -> None:
    """A pristine checkpoint keeps the key stored before shards counted; a shard newer by 1 ns changes it."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shard, metadata = ckpt / "__0_0.distcp", ckpt / ".metadata"
    shard.write_bytes(b"shard")
    metadata.write_bytes(b"metadata")
    committed_ns = 1_700_000_000_123_456_789
    os.utime(metadata, ns=(committed_ns, committed_ns))
    st = metadata.stat()
    pristine = (f"{st.st_ino}:{committed_ns}:{st.st_size}", st.st_mtime)
    (ckpt / "late.distcp").mkdir()  # neither a directory nor a dangling symlink is data
    os.utime(ckpt / "late.distcp", ns=(committed_ns + 5, committed_ns + 5))
    (ckpt / "gone.distcp").symlink_to(ckpt / "nowhere")
    for shard_ns in (committed_ns - 10**9, committed_ns):
        os.utime(shard, ns=(shard_ns, shard_ns))
        assert [pristine, pristine] == [metadata_key(str(ckpt)), metadata_key(str(ckpt))]
    # 1 ns later: the same float mtime, a different save.
    os.utime(shard, ns=(committed_ns + 1, committed_ns + 1))
    assert (f"{pristine[0]};rewritten@{committed_ns + 1}", st.st_mtime) == metadata_key(str(ckpt))
    os.utime(shard, ns=(committed_ns + 2, committed_ns + 2))
    assert (f"{pristine[0]};rewritten@{committed_ns + 2}", st.st_mtime) == metadata_key(str(ckpt))


def test_shards_rewritten_under_a_validated_metadata_are_validated_again_once_quiet(
    tmp_path: Path, saved_checkpoint: Path, worker: FakeWorker
) -> None:
    """A validated `latest/` whose overwrite in place crashed (new shards, old `.metadata`): left alone while the
    shards are recent, validated once (here invalid) when they have been quiet, not again by later sweeps; the
    next save that commits is validated again."""
    root = tmp_path / "root"
    ckpt = root / "latest"
    config = CheckpointsConfig(
        roots=(RootConfig(str(root), "inotify"),), incomplete_after_seconds=2.0, debounce_seconds=0.0
    )

    async def body(service: CheckpointService) -> None:
        stats = service.stats.root(str(root))
        commit_copy(saved_checkpoint, ckpt)
        await until(lambda: stats.last_status == "valid")
        for _ in range(3):  # a pristine checkpoint's key is stable
            await service.sweep()
            await idle(service)
        assert worker.called(1)
        worker.invalid.add(str(ckpt))  # what the real worker finds then: TP-CKPT-004
        rewritten_at = time.monotonic()
        rewrite_a_shard(ckpt)
        await service.sweep()
        await idle(service)
        assert time.monotonic() - rewritten_at < config.incomplete_after_seconds, "too slow to see it pending"
        assert (1, "valid") == (len(worker.calls), stats.last_status)
        await until(lambda: stats.last_status == "invalid")  # by the sweeps every 0.5 s
        for _ in range(3):
            await service.sweep()
            await idle(service)
        assert worker.called(2)
        worker.invalid.clear()
        shutil.copyfile(saved_checkpoint / ".metadata", ckpt / ".metadata.tmp")
        (ckpt / ".metadata.tmp").rename(ckpt / ".metadata")  # the next save commits
        await until(lambda: stats.last_status == "valid")
        assert ({"valid": 2, "invalid": 1}, 3) == ({k: n for k, n in stats.validations.items() if n}, len(worker.calls))

    run_service(tmp_path, config, body)
    assert [str(ckpt)] * 3 == worker.calls


def test_a_deleted_root_is_logged_and_watched_again_when_it_returns(
    tmp_path: Path, saved_checkpoint: Path, worker: FakeWorker
) -> None:
    """Removing the root is a logged event, not a crash; once recreated its checkpoints are validated."""
    from structlog.testing import capture_logs

    root = tmp_path / "root"
    root.mkdir()
    config = CheckpointsConfig(
        roots=(RootConfig(str(root), "inotify"),), incomplete_after_seconds=2, debounce_seconds=0.05
    )

    async def body(service: CheckpointService) -> None:
        await asyncio.sleep(0.2)
        shutil.rmtree(root)
        await asyncio.sleep(0.5)
        root.mkdir()
        await service.sweep()
        commit_copy(saved_checkpoint, root / "step-1")
        await until(lambda: len(worker.calls) == 1)

    with capture_logs() as logs:
        run_service(tmp_path, config, body)
    lost = [e for e in logs if e["event"].startswith("checkpoint root watch lost")]
    assert ["root_deleted"] == [e["reason"] for e in lost]


def test_announced_roots_past_the_cap_fold_into_other(
    tmp_path: Path, saved_checkpoint: Path, worker: FakeWorker
) -> None:
    """Rank 0 announcements add parent roots up to the cap; later ones are validated under root="other"."""
    config = CheckpointsConfig(max_announced_roots=1, debounce_seconds=0.0)
    first, second = tmp_path / "jobA" / "step-1", tmp_path / "jobB" / "step-1"
    commit_copy(saved_checkpoint, first)
    commit_copy(saved_checkpoint, second)

    async def body(service: CheckpointService) -> None:
        service.announce("a", 0, CheckpointSaved(str(first), "save", 1.0, True))
        service.announce("b", 0, CheckpointSaved(str(second), "save", 1.0, True))
        service.announce("b", 1, CheckpointSaved(str(second), "save", 1.0, False))
        await until(lambda: len(worker.calls) == 2)
        await until(lambda: service.stats.root("other").validations["valid"] == 1)

    run_service(tmp_path, config, body)
    assert sorted([str(first), str(second)]) == sorted(worker.calls)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_an_announced_root_expires_after_the_ttl_and_frees_its_slot(
    tmp_path: Path, saved_checkpoint: Path, worker: FakeWorker
) -> None:
    """A job that stopped saving loses its watched root (series too), persistently; a new job gets the slot."""
    config = CheckpointsConfig(max_announced_roots=1, debounce_seconds=0.0, announced_root_ttl_seconds=100.0)
    first, second = tmp_path / "jobA" / "step-1", tmp_path / "jobB" / "step-1"
    commit_copy(saved_checkpoint, first)
    commit_copy(saved_checkpoint, second)
    clock = Clock()
    (tmp_path / "state").mkdir()

    async def main() -> None:
        service = CheckpointService(config, tmp_path / "state", clock=clock)
        await service.start()
        try:
            service.announce("a", 0, CheckpointSaved(str(first), "save", 1.0, True))
            await until(lambda: service.stats.root(str(first.parent)).validations["valid"] == 1)
            assert clock.now == service.stats.roots[str(first.parent)].last_announced
            clock.now += 90.0  # a later save of job A keeps its root alive
            service.announce("a", 0, CheckpointSaved(str(first), "save", 1.0, True))
            assert clock.now == service.stats.roots[str(first.parent)].last_announced
            clock.now += 90.0
            await service.sweep()
            assert [str(first.parent)] == service.roots()
            clock.now += 11.0
            await service.sweep()
            assert [] == service.roots()
            assert str(first.parent) not in service.stats.roots
            service.announce("b", 0, CheckpointSaved(str(second), "save", 1.0, True))
            await until(
                lambda: (
                    str(second.parent) in service.stats.roots
                    and service.stats.roots[str(second.parent)].validations["valid"] == 1
                )
            )
        finally:
            await service.close()
        # After a restart: job B's root is back (and job A's, validated before, is not).
        restarted = CheckpointService(config, tmp_path / "state", clock=clock)
        await restarted.start()
        try:
            assert [str(second.parent)] == restarted.roots()
            assert str(first.parent) not in restarted.stats.roots
            assert restarted.stats.roots[str(second.parent)].last_status == "valid"
            assert clock.now == restarted.stats.roots[str(second.parent)].last_announced
            clock.now += 101.0  # nothing announced while it was down, either
            await restarted.sweep()
            assert [] == restarted.roots()
        finally:
            await restarted.close()

    asyncio.run(main())
    assert [str(first), str(second)] == worker.calls


def test_a_root_removed_from_the_config_exports_nothing_after_a_restart(
    tmp_path: Path, saved_checkpoint: Path, worker: FakeWorker
) -> None:
    root = tmp_path / "ckpts"
    commit_copy(saved_checkpoint, root / "step-1")
    config = CheckpointsConfig(roots=(RootConfig(str(root)),), debounce_seconds=0.0)

    async def body(service: CheckpointService) -> None:
        await until(lambda: service.stats.root(str(root)).last_status == "valid")
        # A configured root is watched whatever jobs do: an announcement under it exports no time.
        service.announce("a", 0, CheckpointSaved(str(root / "step-1"), "save", 1.0, True))
        assert service.stats.root(str(root)).last_announced is None

    run_service(tmp_path, config, body)

    async def after(service: CheckpointService) -> None:
        assert str(root) not in service.stats.roots

    run_service(tmp_path, CheckpointsConfig(debounce_seconds=0.0), after)


def test_a_state_database_from_before_the_ttl_keeps_its_announced_roots(tmp_path: Path) -> None:
    import sqlite3

    from torchpulse.daemon.checkpoints.state import DB_NAME, StateStore

    old = sqlite3.connect(tmp_path / DB_NAME)
    old.execute("CREATE TABLE announced_roots (path TEXT PRIMARY KEY, added_at REAL NOT NULL)")
    old.execute("INSERT INTO announced_roots VALUES ('/ckpt/a', 5.0)")
    old.commit()
    old.close()
    store = StateStore(tmp_path)
    assert {"/ckpt/a": 5.0} == store.announced_roots()
    store.touch_announced_root("/ckpt/a", 9.0)
    store.touch_announced_root("/ckpt/b", 7.0)
    assert [("/ckpt/a", 9.0), ("/ckpt/b", 7.0)] == list(store.announced_roots().items())
    store.remove_announced_root("/ckpt/a")
    assert {"/ckpt/b": 7.0} == store.announced_roots()
    store.close()


def test_records_of_deleted_checkpoints_are_forgotten_but_the_newest_stay(
    tmp_path: Path, saved_checkpoint: Path, worker: FakeWorker
) -> None:
    """The state file follows the job's retention; the newest and newest valid records restore series."""
    from torchpulse.daemon.checkpoints.state import StateStore

    root = tmp_path / "root"
    steps = [root / f"step-{n}" for n in range(1, 5)]
    for n, step in enumerate(steps):
        commit_copy(saved_checkpoint, step)
        for item in step.iterdir():  # the shards too: ones newer than the metadata are an overwrite in progress
            os.utime(item, (1000.0 + n, 1000.0 + n))
    worker.invalid.add(str(steps[3]))
    config = CheckpointsConfig(roots=(RootConfig(str(root), "inotify"),), debounce_seconds=0.0)

    async def body(service: CheckpointService) -> None:
        await until(lambda: sum(service.stats.root(str(root)).validations.values()) == 4)
        for step in (steps[0], steps[2], steps[3]):
            shutil.rmtree(step)
        await service.prune()

    run_service(tmp_path, config, body)
    store = StateStore(tmp_path / "state")
    # step-1 is gone; step-2 exists; step-3 is the newest valid, step-4 the newest.
    assert [False, True, True, True] == [store.key_of(str(step)) is not None for step in steps]
    store.close()

    async def unmounted(service: CheckpointService) -> None:
        shutil.rmtree(steps[1])  # the root is now empty, as an unmounted mount point looks
        await service.prune()

    run_service(tmp_path, config, unmounted)
    store = StateStore(tmp_path / "state")
    assert store.key_of(str(steps[1])) is not None
    store.close()


def test_the_findings_metric_counts_the_findings_a_capped_result_did_not_list(
    tmp_path: Path, saved_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker lists 1,000 of 150,000 findings and a summary: the series and the log say 150,000."""
    from structlog.testing import capture_logs

    listed = [Finding("TP-CKPT-009", Severity.ERROR, "w", f"chunk at [{i}] has no storage entry") for i in range(1000)]
    listed.append(Finding("TP-CKPT-009", Severity.ERROR, "", "... and 149,000 more findings of this rule omitted"))

    async def capped_worker(path: str, level: Level, limits: Limits) -> ValidationResult:
        return ValidationResult(
            path, Status.INVALID, level, tuple(listed), {"bytes": 10}, counts={("TP-CKPT-009", "error"): 150_000}
        )

    monkeypatch.setattr(checkpoint_runner, "validate", capped_worker)
    root = tmp_path / "root"
    root.mkdir()
    config = CheckpointsConfig(roots=(RootConfig(str(root), "inotify"),), debounce_seconds=0.0)

    async def body(service: CheckpointService) -> None:
        commit_copy(saved_checkpoint, root / "step-1")
        await until(lambda: service.stats.root(str(root)).last_status == "invalid")
        collected = CheckpointCollector(service.stats).collect()
        family = next(m for m in collected if m.name == "torchpulse_checkpoint_findings")
        assert [({"root": str(root), "rule": "TP-CKPT-009", "severity": "error"}, 150_000.0)] == [
            (s.labels, s.value) for s in family.samples
        ]

    with capture_logs() as logs:
        run_service(tmp_path, config, body)
    assert [150_000] == [e["findings"] for e in logs if e["event"] == "checkpoint validated"]


class GatedWorker(FakeWorker):
    """The first validation waits for the gate: a backlog builds up behind it."""

    def __init__(self) -> None:
        super().__init__(seconds=0.0)
        self.gate = asyncio.Event()

    async def __call__(self, path: str, level: Level, limits: Limits) -> ValidationResult:
        if self.calls:
            return await super().__call__(path, level, limits)
        self.calls.append(path)
        await self.gate.wait()
        return ValidationResult(path, Status.VALID, level, (), {"bytes": 10})


def test_saves_faster_than_validations_validate_the_newest_checkpoint_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three saves committed during a long validation: the newest is validated next, the backlog after it."""
    worker = GatedWorker()
    monkeypatch.setattr(checkpoint_runner, "validate", worker)
    root = tmp_path / "root"
    root.mkdir()
    # Polled once an hour: the announcements alone say what was committed, in this order.
    config = CheckpointsConfig(
        roots=(RootConfig(str(root), "polling"),), poll_interval_seconds=3600.0, debounce_seconds=0.0
    )
    steps = [root / f"step-{n}" for n in range(1, 5)]

    async def body(service: CheckpointService) -> None:
        await asyncio.sleep(0.2)  # the first sweep's scan is over
        for step in steps:
            tiny_checkpoint(step)
            service.announce("run", 0, CheckpointSaved(str(step), "save", 1.0, True))
            if step == steps[0]:
                await until(lambda: [str(steps[0])] == worker.calls)
            await asyncio.sleep(0.05)
        worker.gate.set()
        await until(lambda: service.stats.root(str(root)).validations["valid"] == 4)
        assert "valid" == service.stats.root(str(root)).last_status

    run_service(tmp_path, config, body)
    assert [str(steps[n]) for n in (0, 3, 2, 1)] == worker.calls


def test_a_checkpoint_overwritten_while_validated_is_validated_again_with_slots_to_spare(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With two validation slots, the re-validation of a checkpoint rewritten under the first one is not lost."""
    step = tmp_path / "root" / "step-1"
    tiny_checkpoint(step)

    class OverwritingWorker(FakeWorker):
        async def __call__(self, path: str, level: Level, limits: Limits) -> ValidationResult:
            if not self.calls:  # the job saves into the same directory again meanwhile
                (step / ".metadata.tmp").write_bytes(b"the next save")
                (step / ".metadata.tmp").rename(step / ".metadata")
            return await super().__call__(path, level, limits)

    worker = OverwritingWorker()
    monkeypatch.setattr(checkpoint_runner, "validate", worker)
    config = CheckpointsConfig(
        roots=(RootConfig(str(step.parent), "polling"),),
        poll_interval_seconds=3600.0,
        max_concurrent_validations=2,
        debounce_seconds=0.0,
    )

    async def body(service: CheckpointService) -> None:
        await until(lambda: service.stats.root(str(step.parent)).validations["valid"] == 1)
        await asyncio.sleep(0.3)

    run_service(tmp_path, config, body)
    assert [str(step), str(step)] == worker.calls


def test_deleting_the_latest_checkpoint_makes_the_newest_one_left_the_latest(
    tmp_path: Path, saved_checkpoint: Path, worker: FakeWorker
) -> None:
    """An operator deletes the invalid newest checkpoint (as CheckpointInvalid asks): the root's status is its
    newest remaining checkpoint's at the next sweep, and with none left no status is exported (before: the
    deleted checkpoint's status and findings stayed until the next save, across restarts too)."""
    root = tmp_path / "root"
    steps = [root / f"step-{n}" for n in range(1, 4)]
    for n, step in enumerate(steps):
        commit_copy(saved_checkpoint, step)
        for item in step.iterdir():
            os.utime(item, (1000.0 + n, 1000.0 + n))
    worker.invalid.add(str(steps[2]))
    config = CheckpointsConfig(roots=(RootConfig(str(root), "inotify"),), debounce_seconds=0.0)
    seen: list[tuple[str | None, str | None]] = []

    async def body(service: CheckpointService) -> None:
        stats = service.stats.root(str(root))
        await until(lambda: sum(stats.validations.values()) == 3)
        seen.append((stats.last_status, stats.latest_path))
        shutil.rmtree(steps[2])
        await service.sweep()
        seen.append((stats.last_status, stats.latest_path))
        # An emptied root looks like an unmounted mount point: only a root with entries left tells a deletion.
        (root / "notes.txt").write_text("retention ran")
        for step in steps[:2]:
            shutil.rmtree(step)
        await service.sweep()
        seen.append((stats.last_status, stats.latest_path))

    run_service(tmp_path, config, body)
    assert [("invalid", str(steps[2])), ("valid", str(steps[1])), (None, None)] == seen
