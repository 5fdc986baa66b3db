"""Identity: launcher variables until torch.distributed is initialised, then its rank and world size."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from torchpulse.probes.agent.identity import current_identity


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_launcher_variables_name_the_rank_before_torch_distributed_is_initialised() -> None:
    ident = current_identity({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"})
    assert (5, 8, 1) == (ident.rank, ident.world_size, ident.local_rank)
    assert (0, 1) == (current_identity({}).rank, current_identity({}).world_size)


@pytest.mark.usefixtures("one_rank_group")
def test_a_one_rank_helper_group_inside_a_launched_job_does_not_rename_the_rank() -> None:
    ident = current_identity({"RANK": "3", "WORLD_SIZE": "4"})
    assert (3, 4) == (ident.rank, ident.world_size)


@pytest.mark.usefixtures("one_rank_group")
def test_torch_distributed_names_the_rank_where_no_launcher_did() -> None:
    ident = current_identity({})
    assert (0, 1) == (ident.rank, ident.world_size)
