"""The checkpoint probe: times DCP saves, announces the path, never changes the save."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support import REPO, histogram_series, local_agent, run_inline_ranks, series, wait_for
from torchpulse.probes.checkpoint import checkpoint_path

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
dcp = pytest.importorskip("torch.distributed.checkpoint")
saver = pytest.importorskip("torch.distributed.checkpoint.state_dict_saver")
ORIGINALS = (saver.save, saver.async_save)


@pytest.fixture
def agent() -> Iterator[Any]:
    agent: Any = local_agent(("checkpoint",))
    yield agent
    agent.shutdown()


def _announcements(agent: Any) -> list[dict[str, object]]:
    agent.drain()
    return [dict(e.fields) for e in agent.take_events(100) if e.event == "checkpoint saved"]


def _events(agent: Any) -> list[tuple[str, str, dict[str, object]]]:
    agent.drain()
    return [(e.level, e.event, dict(e.fields)) for e in agent.take_events(100)]


def _failures(agent: Any) -> dict[tuple[str, ...], float]:
    """Every checkpoint_save_failures_total series in the agent's store, by its (api, error) labels."""
    agent.drain()
    return series(agent, "checkpoint_save_failures_total")


def _saves(agent: Any) -> int:
    return sum(sum(h.bucket_counts) for h in histogram_series(agent, "checkpoint_save_duration_seconds").values())


def _announced(agent: Any) -> list[str]:
    agent.drain()
    return [str(e.fields["path"]) for e in agent.take_events(100) if e.event == "checkpoint saved"]


def _written(under: Path) -> list[str]:
    """The directories under `under` that hold a `.metadata`, i.e. where DCP really wrote a checkpoint."""
    return sorted(str(metadata.parent) for metadata in under.rglob(".metadata"))


def _run(code: str, cwd: Path, *args: str) -> str:
    """`python -c CODE ARGS` in a fresh interpreter (one that has not imported torch._dynamo yet); its stdout."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    assert 0 == out.returncode, out.stderr[-3000:]
    return out.stdout.strip()


@pytest.fixture
def spied(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, list[BaseException]]]:
    """An agent whose probe wraps a spy around torch's own `save`: the spy keeps what torch raised."""
    raised: list[BaseException] = []
    real_save = saver.save

    def spy(*args: Any, **kwargs: Any) -> Any:
        try:
            return real_save(*args, **kwargs)
        except BaseException as exc:
            raised.append(exc)
            raise

    monkeypatch.setattr(saver, "save", spy)
    monkeypatch.setattr(dcp, "save", spy)
    agent: Any = local_agent(("checkpoint",))
    yield agent, raised
    agent.shutdown()


def _under_a_regular_file(tmp_path: Path) -> Path:
    """A checkpoint path whose parent is a regular file: mkdir fails with ENOTDIR, for root too."""
    (tmp_path / "a-file").write_bytes(b"")
    return tmp_path / "a-file" / "ck"


def _wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_save_is_timed_and_announced_with_its_return_value_unchanged(agent: Any, tmp_path: Path) -> None:
    """dcp.save returns its Metadata; the probe records the duration and announces the path."""
    result = dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "ck", no_dist=True)
    assert "Metadata" == type(result).__name__
    [announced] = _announcements(agent)
    assert (str(tmp_path / "ck"), "save", True) == (announced["path"], announced["api"], announced["validate"])
    assert 1 == sum(histogram_series(agent, "checkpoint_save_duration_seconds")[("save",)].bucket_counts)


def test_async_save_is_announced_once_when_its_upload_finishes(agent: Any, tmp_path: Path) -> None:
    """async_save's inner save is not a second save; the announcement comes after the upload."""
    future = dcp.async_save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "ck", no_dist=True)
    getattr(future, "upload_completion", future).result()
    # result() returns once the upload's result is set, before the future runs its done callbacks (ours).
    announced: list[dict[str, object]] = []

    def announced_yet() -> bool:
        announced.extend(_announcements(agent))
        return bool(announced)

    wait_for(announced_yet, timeout=10, interval=0.01)
    time.sleep(0.2)  # a second announcement would come as soon as the first did
    announced += _announcements(agent)
    assert [("async_save", str(tmp_path / "ck"))] == [(a["api"], a["path"]) for a in announced]
    info = (tmp_path / "ck").stat()  # what the daemon compares its own view of the path with
    assert (info.st_dev, info.st_ino) == (announced[0]["device"], announced[0]["inode"])


def test_a_failing_save_raises_its_own_exception_and_announces_nothing(agent: Any) -> None:
    """The job's exception propagates unchanged; no checkpoint is announced."""

    class BrokenWriter(dcp.FileSystemWriter):  # type: ignore[misc,name-defined]
        def write_data(self, plan: Any, planner: Any) -> Any:
            raise RuntimeError("disk full")

    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException) as raised:
        dcp.save({"w": torch.ones(2)}, storage_writer=BrokenWriter("/tmp/tp-never"), no_dist=True)
    assert ("disk full", []) == (str(raised.value.failures[0][0]), _announcements(agent))


def test_a_save_that_fails_for_real_is_counted_once_and_the_job_gets_the_very_same_exception(
    spied: tuple[Any, list[BaseException]], tmp_path: Path
) -> None:
    """A successful save counts no failure; a real dcp.save into a path under a regular file raises torch's own
    CheckpointException object to the caller, counted once (api=save) under its cause and logged."""
    agent, raised = spied
    dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "ok", no_dist=True)
    assert ({}, 1) == (_failures(agent), _saves(agent))
    target = _under_a_regular_file(tmp_path)
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException) as caught:
        dcp.save({"w": torch.ones(2)}, checkpoint_id=target, no_dist=True)
    assert [caught.value] == raised
    assert caught.value is raised[0]
    assert ({("save", "NotADirectoryError"): 1.0}, 1) == (_failures(agent), _saves(agent))


def test_a_failed_save_is_logged_as_a_warning_with_path_api_error_and_cause(agent: Any, tmp_path: Path) -> None:
    """The warning event names the path, the API, the exception class, the first failing rank's exception class
    and a message cut to 500 characters; nothing is announced for validation."""
    target = _under_a_regular_file(tmp_path)
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException):
        dcp.save({"w": torch.ones(2)}, checkpoint_id=target, no_dist=True)
    [(level, event, fields)] = _events(agent)
    assert ("warning", "checkpoint save failed", str(target), "save", "CheckpointException", "NotADirectoryError") == (
        level,
        event,
        fields["path"],
        fields["api"],
        fields["error"],
        fields["cause"],
    )
    message = str(fields["message"])
    assert message.startswith("1 rank(s) failed, the first with NotADirectoryError: [Errno 20] Not a directory")
    assert len(message) <= 500


def test_an_async_save_whose_upload_fails_for_real_is_counted_once(agent: Any, tmp_path: Path) -> None:
    """The upload future of a real async_save ends in CheckpointException: one failure with api=async_save under
    its cause (the upload thread's inner save is not a second one), and no announcement."""
    target = _under_a_regular_file(tmp_path)
    future = dcp.async_save({"w": torch.ones(2)}, checkpoint_id=target, no_dist=True)
    upload = getattr(future, "upload_completion", future)
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException):
        upload.result(timeout=60)
    # The future runs its callbacks after waking result(): wait for ours.
    _wait_for(lambda: bool(_failures(agent)))
    assert {("async_save", "NotADirectoryError"): 1.0} == _failures(agent)
    assert ["checkpoint save failed"] == [event for _, event, _ in _events(agent)]


def test_an_async_save_that_fails_while_staging_is_counted_and_raises_unchanged(agent: Any, tmp_path: Path) -> None:
    """async_save cannot stage a meta tensor and raises at once: the job gets torch's NotImplementedError,
    counted with api=async_save."""
    with pytest.raises(NotImplementedError, match="meta tensor"):
        dcp.async_save({"w": torch.ones(2, device="meta")}, checkpoint_id=tmp_path / "ck", no_dist=True)
    assert {("async_save", "NotImplementedError"): 1.0} == _failures(agent)


def test_error_labels_are_cut_to_64_characters_and_fold_into_other_after_8_names(agent: Any, tmp_path: Path) -> None:
    """A storage writer whose reset raises escapes DCP's wrapping: a 300-character class name becomes a 64-character
    label, and the ninth distinct class of the process is counted as `other`; the log keeps every full name."""
    names = ["E" * 300, *(f"Error{i}" for i in range(1, 9))]

    for name in names:
        error = type(name, (OSError,), {})

        class Refusing(dcp.FileSystemWriter):  # type: ignore[misc,name-defined]
            raises = error

            def reset(self, checkpoint_id: Any = None) -> None:
                raise self.raises("quota exceeded")

        with pytest.raises(error):
            dcp.save(
                {"w": torch.ones(2)},
                checkpoint_id=tmp_path / "ck",
                storage_writer=Refusing(tmp_path / "ck"),
                no_dist=True,
            )
    expected = {("save", label): 1.0 for label in ["E" * 64, *(f"Error{i}" for i in range(1, 8)), "other"]}
    assert expected == _failures(agent)
    assert names == [fields["error"] for _, _, fields in _events(agent)]


def test_a_cancelled_upload_is_logged_and_not_counted(agent: Any, tmp_path: Path) -> None:
    """Only the job (or its executor's shutdown) cancels an upload future: an info event, no failure, no save.

    Each real async_save gets its own one-thread executor that starts the upload at once, so a torch
    upload cannot be cancelled on purpose here: the probe is given a pending future to watch instead."""
    from concurrent.futures import Future

    upload: Future[None] = Future()
    agent.probes["checkpoint"]._announce("async_save", {"checkpoint_id": tmp_path / "ck"}, time.perf_counter(), upload)
    assert upload.cancel()
    assert ({}, 0) == (_failures(agent), _saves(agent))
    cancelled = {"path": str(tmp_path / "ck"), "api": "async_save"}
    assert [("info", "checkpoint save cancelled", cancelled)] == _events(agent)


def test_keyboard_interrupt_in_a_save_passes_through_uncounted(monkeypatch: pytest.MonkeyPatch) -> None:
    """BaseExceptions that are no failed save (Ctrl-C, sys.exit) reach the job as they are and count nothing."""
    interrupt = KeyboardInterrupt()

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise interrupt

    monkeypatch.setattr(saver, "save", interrupted)
    agent: Any = local_agent(("checkpoint",))
    try:
        with pytest.raises(KeyboardInterrupt) as caught:
            saver.save({"w": torch.ones(2)}, checkpoint_id="/tmp/tp-never", no_dist=True)
        assert (True, {}, []) == (caught.value is interrupt, _failures(agent), _events(agent))
        assert agent.probes["checkpoint"].enabled
    finally:
        agent.shutdown()


def test_uninstall_restores_both_module_attributes() -> None:
    """The saver module and the package re-export are wrapped while installed and original after."""
    agent: Any = local_agent(("checkpoint",))
    wrapped = (dcp.save is saver.save, dcp.save is not ORIGINALS[0], saver.async_save is not ORIGINALS[1])
    agent.shutdown()
    assert ((True, True, True), ORIGINALS, ORIGINALS) == (
        wrapped,
        (saver.save, saver.async_save),
        (dcp.save, dcp.async_save),
    )


def test_storage_writer_path_is_used_without_checkpoint_id(tmp_path: Path) -> None:
    """Without checkpoint_id the writer's path is announced, made absolute."""
    writer = dcp.FileSystemWriter(tmp_path / "w")
    assert (str(tmp_path / "w"), None) == (checkpoint_path({"storage_writer": writer}), checkpoint_path({}))


def test_a_local_fsspec_url_is_a_path_to_validate_and_a_remote_one_stays_a_url() -> None:
    """A `file://` URL is announced as the path fsspec writes to (what follows `file://`, not unquoted,
    relative to the cwd unless it starts with `/`); another protocol stays a URL the daemon ignores."""
    assert "/ck/step%2010" == checkpoint_path({"checkpoint_id": "file:///ck/step%2010"})
    assert f"{Path.cwd()}/localhost/ck/a" == checkpoint_path({"checkpoint_id": "file://localhost/ck/a/"})
    assert f"{Path.cwd()}/otherhost/ck" == checkpoint_path({"checkpoint_id": "file://otherhost/ck"})
    assert "s3://bucket/ck" == checkpoint_path({"checkpoint_id": "s3://bucket/ck"})


def test_a_storage_writer_passed_positionally_is_announced_and_named_in_failures(agent: Any, tmp_path: Path) -> None:
    """torch 2.13 still takes the old `save(state_dict, storage_writer)` order (with a warning): the writer's path
    is announced for validation, and a failed save of that form names its path too."""
    with pytest.warns(UserWarning, match="argument order"):
        dcp.save({"w": torch.ones(2)}, dcp.FileSystemWriter(tmp_path / "ck"), no_dist=True)
    assert [(str(tmp_path / "ck"), "save")] == [(a["path"], a["api"]) for a in _announcements(agent)]
    target = _under_a_regular_file(tmp_path)
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.warns(UserWarning, match="argument order"), pytest.raises(CheckpointException):
        dcp.save({"w": torch.ones(2)}, dcp.FileSystemWriter(target), no_dist=True)
    assert [str(target)] == [fields["path"] for _, event, fields in _events(agent) if event == "checkpoint save failed"]


@pytest.mark.process
def test_probe_patches_dcp_imported_after_it_without_importing_it() -> None:
    """Installed before the job imports DCP, the probe neither imports it nor misses it."""
    code = (
        "import sys, torch\n"
        "from tests.support import local_agent\n"
        "agent = local_agent(('checkpoint',))\n"
        "before = 'torch.distributed.checkpoint' in sys.modules\n"
        "import torch.distributed.checkpoint as dcp\n"
        "wrapped = hasattr(dcp.save, '__torchpulse_original__')\n"
        "agent.shutdown()\n"
        "print(before, wrapped, hasattr(dcp.save, '__torchpulse_original__'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "False True False" == out.stdout.strip(), out.stderr[-2000:]


SUBGROUP_RANK = """
import sys, torch, torch.distributed as dist
from tests.support import local_agent
rank, store, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
agent = local_agent(("checkpoint",))
import torch.distributed.checkpoint as dcp
group = dist.new_group([1])
if rank == 1:
    dcp.save({"w": torch.ones(2)}, checkpoint_id=out, process_group=group)
    agent.drain()
    print([e.fields["validate"] for e in agent.take_events(100) if e.event == "checkpoint saved"])
agent.shutdown()
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.process
def test_rank_0_of_the_saving_subgroup_asks_for_validation(tmp_path: Path) -> None:
    """A save on a subgroup without global rank 0 is announced for validation by the subgroup's rank 0."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SUBGROUP_RANK, str(r), str(tmp_path / "store"), str(tmp_path / "ck")],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2"},
        )  # as torchrun sets them
        for r in range(2)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert ["", "[True]"] == [out.strip() for out, _ in outputs], [err[-2000:] for _, err in outputs]


NO_DIST_RANK = """
import sys, torch, torch.distributed as dist
from tests.support import local_agent
rank, store, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
agent = local_agent(("checkpoint",))
import torch.distributed.checkpoint as dcp
dcp.save({"w": torch.ones(2)}, checkpoint_id=f"{out}/rank{rank}/ck", no_dist=True)
agent.drain()
saved = [e.fields for e in agent.take_events(100) if e.event == "checkpoint saved"]
print([(fields["path"][len(out):], fields["validate"]) for fields in saved])
agent.shutdown()
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.process
def test_every_rank_asks_for_validation_of_its_own_no_dist_save(tmp_path: Path) -> None:
    """A `no_dist=True` save is a whole checkpoint of this process alone (it writes its own `.metadata`): rank 1's
    lands where rank 0 never announces, so rank 1 asks for its validation too."""
    results = run_inline_ranks(NO_DIST_RANK, tmp_path, timeout=120)
    assert [f"[('/rank{r}/ck', True)]" for r in range(2)] == [out.strip() for out, _, _ in results], [
        err[-2000:] for _, err, _ in results
    ]


def test_a_save_without_a_process_group_is_validated_on_any_rank(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """No process group (an srun task array, a job that never calls init_process_group): DCP saves as a single
    process, whatever RANK says, so the save is this process's own checkpoint and asks for validation."""
    monkeypatch.setenv("RANK", "3")
    agent: Any = local_agent(("checkpoint",))
    try:
        dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "ck")
        assert [(str(tmp_path / "ck"), True)] == [(a["path"], a["validate"]) for a in _announcements(agent)]
    finally:
        agent.shutdown()


def test_file_urls_are_announced_where_fsspec_wrote_them(
    agent: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fsspec keeps `%20` as it is and reads `file://localhost/x` and `file://x` relative to the cwd: each announced
    path is the directory that holds the checkpoint's `.metadata`."""
    monkeypatch.chdir(tmp_path)
    for url in (f"file://{tmp_path}/step%2010", "file://localhost/ck", "file://relative/ck"):
        dcp.save({"w": torch.ones(2)}, checkpoint_id=url, no_dist=True)
    announced = _announced(agent)
    assert [f"{tmp_path}/step%2010", f"{tmp_path}/localhost/ck", f"{tmp_path}/relative/ck"] == announced
    assert _written(tmp_path) == sorted(announced)


def test_a_dotdot_after_a_symlink_is_announced_where_the_kernel_wrote_and_a_symlinked_path_keeps_its_name(
    agent: Any, tmp_path: Path
) -> None:
    """`link/../ck` leaves the link's target, not the link's directory; `link/ck` is announced as written."""
    (tmp_path / "real" / "deep").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real" / "deep")
    dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "link" / ".." / "ck", no_dist=True)
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "link" / "ck"), no_dist=True)
    assert [str(tmp_path / "real" / "ck"), str(tmp_path / "link" / "ck")] == _announced(agent)
    assert [str(tmp_path / "real" / "ck"), str(tmp_path / "real" / "deep" / "ck")] == _written(tmp_path)


def test_an_empty_checkpoint_id_with_a_storage_writer_is_announced_as_the_writers_path(
    agent: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's FileSystemWriter ignores an empty checkpoint_id and writes to its own path: that path is announced,
    not the job's cwd."""
    monkeypatch.chdir(tmp_path)
    dcp.save({"w": torch.ones(2)}, checkpoint_id="", storage_writer=dcp.FileSystemWriter(tmp_path / "w"), no_dist=True)
    assert ([str(tmp_path / "w")], [str(tmp_path / "w")]) == (_announced(agent), _written(tmp_path))


def test_a_jobs_own_distributed_checkpoint_package_is_not_taken_for_torchs(
    agent: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save called from the job's `distributed/checkpoint/` modules is timed and announced like any other."""
    package = tmp_path / "tpjob" / "distributed" / "checkpoint"
    package.mkdir(parents=True)
    (package / "job.py").write_text(
        "import torch, torch.distributed.checkpoint as dcp\n"
        "def save(path):\n"
        "    dcp.save({'w': torch.ones(2)}, checkpoint_id=path, no_dist=True)\n"
    )
    monkeypatch.syspath_prepend(tmp_path)
    try:
        importlib.import_module("tpjob.distributed.checkpoint.job").save(tmp_path / "ck")
    finally:
        for name in [name for name in sys.modules if name.split(".")[0] == "tpjob"]:
            del sys.modules[name]
    assert [str(tmp_path / "ck")] == _announced(agent)
    assert 1 == sum(histogram_series(agent, "checkpoint_save_duration_seconds")[("save",)].bucket_counts)


FIRST_SAVE = """
import sys, torch
from tests.support import local_agent
agent = local_agent(("checkpoint",))
import torch.distributed.checkpoint as dcp
before = "torch._dynamo" in sys.modules
dcp.save({"w": torch.ones(2)}, checkpoint_id=sys.argv[1], no_dist=True)
agent.drain()
print(before, "torch._dynamo" in sys.modules, [e.event for e in agent.take_events(10)])
agent.shutdown()
"""


@pytest.mark.process
def test_a_save_does_not_import_dynamo_in_the_jobs_thread(tmp_path: Path) -> None:
    """The probe's hooks never import torch._dynamo (0.7 s, which the first save's duration counted)."""
    assert "False False ['checkpoint saved']" == _run(FIRST_SAVE, tmp_path, str(tmp_path / "ck"))


DELETED_CWD = """
import os, sys, torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict_saver as saver
raised = []
real_save = saver.save
def spy(*args, **kwargs):
    try:
        return real_save(*args, **kwargs)
    except BaseException as exc:
        raised.append(exc)
        raise
saver.save = dcp.save = spy
from tests.support import local_agent, series
agent = local_agent(("checkpoint",))
os.mkdir("gone")
os.chdir("gone")
os.rmdir(os.path.join("..", "gone"))
try:
    dcp.save({"w": torch.ones(2)}, checkpoint_id="ck", no_dist=True)
except BaseException as exc:
    caught = exc
agent.drain()
failures = series(agent, "checkpoint_save_failures_total")
paths = [e.fields["path"] for e in agent.take_events(10) if e.event == "checkpoint save failed"]
print(caught is raised[0], agent.probes["checkpoint"].enabled, failures, paths)
agent.shutdown()
"""


@pytest.mark.process
def test_a_save_in_a_deleted_cwd_raises_torchs_own_exception_and_is_counted(tmp_path: Path) -> None:
    """A relative save whose cwd was deleted (a stale NFS cwd alike) fails: the job gets torch's very exception,
    the failure is counted under the relative path, and the probe stays on."""
    assert "True True {('save', 'FileNotFoundError'): 1.0} ['ck']" == _run(DELETED_CWD, tmp_path)
