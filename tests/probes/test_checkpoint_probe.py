"""The checkpoint probe: times DCP saves, announces the path, never changes the save."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support import REPO, local_agent
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


def test_save_is_timed_and_announced_with_its_return_value_unchanged(agent: Any, tmp_path: Path) -> None:
    """dcp.save returns its Metadata; the probe records the duration and announces the path."""
    result = dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "ck", no_dist=True)
    assert "Metadata" == type(result).__name__
    [announced] = _announcements(agent)
    assert (str(tmp_path / "ck"), "save", True) == (announced["path"], announced["api"], announced["validate"])
    assert 1 == sum(agent.store._histograms[("checkpoint_save_duration_seconds", ("save",))].counts)


def test_async_save_is_announced_once_when_its_upload_finishes(agent: Any, tmp_path: Path) -> None:
    """async_save's inner save is not a second save; the announcement comes after the upload."""
    future = dcp.async_save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "ck", no_dist=True)
    getattr(future, "upload_completion", future).result()
    assert [("async_save", str(tmp_path / "ck"))] == [(a["api"], a["path"]) for a in _announcements(agent)]


def test_a_failing_save_raises_its_own_exception_and_announces_nothing(agent: Any) -> None:
    """The job's exception propagates unchanged; no checkpoint is announced."""

    class BrokenWriter(dcp.FileSystemWriter):  # type: ignore[misc,name-defined]
        def write_data(self, plan: Any, planner: Any) -> Any:
            raise RuntimeError("disk full")

    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(CheckpointException) as raised:
        dcp.save({"w": torch.ones(2)}, storage_writer=BrokenWriter("/tmp/tp-never"), no_dist=True)
    assert ("disk full", []) == (str(raised.value.failures[0][0]), _announcements(agent))


def test_uninstall_restores_both_module_attributes() -> None:
    """The saver module and the package re-export are wrapped while installed and original after."""
    agent: Any = local_agent(("checkpoint",))
    wrapped = (dcp.save is saver.save, dcp.save is not ORIGINALS[0], saver.async_save is not ORIGINALS[1])
    agent.shutdown()
    assert ((True, True, True), ORIGINALS, ORIGINALS) == (
        wrapped, (saver.save, saver.async_save), (dcp.save, dcp.async_save))


def test_storage_writer_path_is_used_without_checkpoint_id(tmp_path: Path) -> None:
    """Without checkpoint_id the writer's path is announced, made absolute."""
    writer = dcp.FileSystemWriter(tmp_path / "w")
    assert (str(tmp_path / "w"), None) == (checkpoint_path({"storage_writer": writer}), checkpoint_path({}))


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


def test_rank_0_of_the_saving_subgroup_asks_for_validation(tmp_path: Path) -> None:
    """A save on a subgroup without global rank 0 is announced for validation by the subgroup's rank 0."""
    procs = [
        subprocess.Popen([sys.executable, "-c", SUBGROUP_RANK, str(r), str(tmp_path / "store"), str(tmp_path / "ck")],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2"})  # as torchrun sets them
        for r in range(2)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert ["", "[True]"] == [out.strip() for out, _ in outputs], [err[-2000:] for _, err in outputs]
