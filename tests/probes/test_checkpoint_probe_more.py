"""The checkpoint probe with real saves: where the announced path points, what a save costs, the guard's promises."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support import REPO, local_agent
from torchpulse.daemon.checkpoints.announcements import Refused, checked_announcement

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
dcp = pytest.importorskip("torch.distributed.checkpoint")


@pytest.fixture
def agent() -> Iterator[Any]:
    agent: Any = local_agent(("checkpoint",))
    yield agent
    agent.shutdown()


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
    assert 1 == sum(agent.store._histograms[("checkpoint_save_duration_seconds", ("save",))].counts)


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
from tests.support import local_agent
agent = local_agent(("checkpoint",))
os.mkdir("gone")
os.chdir("gone")
os.rmdir(os.path.join("..", "gone"))
try:
    dcp.save({"w": torch.ones(2)}, checkpoint_id="ck", no_dist=True)
except BaseException as exc:
    caught = exc
agent.drain()
failures = {labels: value for (name, labels), value in agent.store._values.items()
            if name == "checkpoint_save_failures_total"}
paths = [e.fields["path"] for e in agent.take_events(10) if e.event == "checkpoint save failed"]
print(caught is raised[0], agent.probes["checkpoint"].enabled, failures, paths)
agent.shutdown()
"""


@pytest.mark.process
def test_a_save_in_a_deleted_cwd_raises_torchs_own_exception_and_is_counted(tmp_path: Path) -> None:
    """A relative save whose cwd was deleted (a stale NFS cwd alike) fails: the job gets torch's very exception,
    the failure is counted under the relative path, and the probe stays on."""
    assert "True True {('save', 'FileNotFoundError'): 1.0} ['ck']" == _run(DELETED_CWD, tmp_path)


def test_the_daemon_checks_the_directory_it_will_validate_not_the_one_a_symlink_and_dotdot_lead_to(
    tmp_path: Path,
) -> None:
    """`mine/link/../../etc` resolves into the job's user's tree but the daemon validates `/etc`, normalized
    lexically: the announcement is refused because /etc belongs to root."""
    uid = os.getuid() if os.getuid() != 0 else 4242
    climb = len(tmp_path.parts)  # `..`s from tmp_path/link up to /
    target = tmp_path.joinpath(*["d"] * climb)
    target.mkdir(parents=True)
    (tmp_path / "etc").mkdir()
    (tmp_path / "link").symlink_to(target)
    if os.getuid() == 0:  # the job's user is another one: its tree is theirs
        for directory in (tmp_path, tmp_path / "etc"):  # what the check looks at: the directory and its parent
            os.chown(directory, uid, uid)
        os.lchown(tmp_path / "link", uid, uid)
    announced = str(tmp_path.joinpath("link", *[".."] * climb, "etc"))
    assert (str(tmp_path / "etc"), "/etc") == (os.path.realpath(announced), os.path.normpath(announced))
    refused = Refused(f"/etc belongs to uid 0, not to the job's user (uid {uid})")
    assert refused == checked_announcement(announced, uid, None, ())
