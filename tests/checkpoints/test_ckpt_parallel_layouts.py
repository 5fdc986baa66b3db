"""Pristine checkpoints of real parallel training layouts (FSDP1, HSDP, FSDP2 + TP, pipeline, ...): all valid.

Run as a script, this file writes them (`w4 OUT RANK WORLD STORE` once per rank, and
`w3` likewise), so each save is a genuine multi-process torch save over gloo.
"""

from __future__ import annotations

import sys
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch import nn

from torchpulse.checkpoints.model import Level, Severity, Status, ValidationResult
from torchpulse.checkpoints.validate import validate

SCRIPT = Path(__file__)
LEVELS = [Level.METADATA, Level.DATA, Level.LOAD]


# --- the saves (run in child processes, one per rank) ---------------------------------------


def _mlp(seed: int = 0, sizes: tuple[int, int, int] = (4, 8, 5)) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(sizes[0], sizes[1]), nn.ReLU(), nn.Linear(sizes[1], sizes[2]))


def _stepped(model: nn.Module, inputs: int = 4, **kwargs: object) -> torch.optim.Optimizer:
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, **kwargs)  # type: ignore[arg-type]
    model(torch.randn(3, inputs)).sum().backward()
    optim.step()
    optim.zero_grad()
    return optim


def _save(path: Path, model: nn.Module, optim: torch.optim.Optimizer, flat: bool = False, **kwargs: object) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    msd, osd = get_state_dict(model, optim, options=options)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path, **kwargs)


class _Tied(nn.Module):
    """Output weight tied to the embedding, BatchNorm buffers, a frozen layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 6)
        self.norm = nn.BatchNorm1d(6)
        self.frozen = nn.Linear(6, 6).requires_grad_(False)
        self.out = nn.Linear(6, 10, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.frozen(self.norm(self.emb(x))))  # type: ignore[no-any-return]


def _fsdp1_saves(out: Path, world: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy, StateDictType

    cpu = torch.device("cpu")
    legacy = FSDP(_mlp(), device_id=cpu)
    optim = _stepped(legacy)
    with FSDP.state_dict_type(legacy, StateDictType.SHARDED_STATE_DICT):
        msd, osd = legacy.state_dict(), FSDP.optim_state_dict(legacy, optim)
    assert type(msd["0.weight"]).__name__ == "ShardedTensor"
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out / "fsdp1_sharded_state_dict")
    model = FSDP(_mlp(), device_id=cpu, use_orig_params=True)
    _save(out / "fsdp1", model, _stepped(model))
    model = FSDP(_mlp(), device_id=cpu)
    _save(out / "fsdp1_flat_optim", model, _stepped(model), flat=True)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    model = FSDP(_mlp(), device_id=cpu, device_mesh=mesh, sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                 use_orig_params=True)  # fmt: skip
    _save(out / "fsdp1_hybrid", model, _stepped(model))


def _two_d_saves(out: Path, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    model = _mlp()
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    _save(out / "hsdp", model, _stepped(model))
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    for name, kwargs in (("fsdp_tp", {}), ("fsdp_tp_per_rank_metadata", {"use_collectives": False})):
        model = _mlp(sizes=(4, 8, 6))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        placements = {type(p).__name__ for p in model[0].weight.placements}  # type: ignore[union-attr]
        assert placements == {"_StridedShard", "Shard"}, placements
        _save(out / name, model, _stepped(model), **kwargs)


def _pipeline_saves(out: Path, rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # Each rank a stage of its own: disjoint FQNs, an optimizer of its own (torchtitan: flat layout).
    torch.manual_seed(rank)
    stage = nn.ModuleDict({f"layers{rank}": nn.Linear(4, 4)})
    optim = _stepped(stage[f"layers{rank}"])
    _save(out / "pipeline", stage, optim, flat=True)
    # The nested layout puts every stage's params list under one key: DCP keeps one rank's.
    _save(out / "pipeline_nested", stage, optim)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))
    pp = mesh.get_local_rank("pp")
    torch.manual_seed(pp)
    stage = nn.ModuleDict({f"layers{pp}": nn.Linear(4, 5)})
    fully_shard(stage[f"layers{pp}"], mesh=mesh["dp"])
    _save(out / "pipeline_fsdp", stage, _stepped(stage[f"layers{pp}"]), flat=True)


def _planner_saves(out: Path, rank: int, world: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = _mlp()
    fully_shard(model, mesh=mesh)
    optim = _stepped(model)
    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    assert (rank == 0) == bool(msd)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out / "full_state_dict_cpu_offload")
    _save(out / "fsdp_dedup_to_lowest_rank", model, optim, planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True))
    replicated = _mlp()
    optim = _stepped(replicated)
    _save(out / "dedup_to_lowest_rank", replicated, optim, planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True))
    # Not flattened, each of "model" and "optim" is one pickled bytes item: valid for a replicated model.
    _save(out / "not_flattened", replicated, optim, planner=DefaultSavePlanner(flatten_state_dict=False))
    tied = _Tied()
    fully_shard(tied, mesh=mesh)
    optim = torch.optim.AdamW([p for p in tied.parameters() if p.requires_grad], lr=1e-3)
    tied(torch.randint(0, 10, (4,))).sum().backward()
    optim.step()
    _save(out / "tied_frozen_buffers", tied, optim)
    model = _mlp()
    fully_shard(model, mesh=mesh)
    optim = _stepped(model, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 0.9**s)
    sched.step()
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd, "lr_scheduler": sched.state_dict(), "rng": torch.get_rng_state()},
             checkpoint_id=out / "fused_with_scheduler")  # fmt: skip


def _fsdp2_saves(out: Path, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    # 7 and 5 rows over 3 ranks: 3, 3, 1 and 2, 2, 1.
    model = _mlp(sizes=(5, 7, 5))
    for layer in (model[0], model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    _save(out / "uneven_no_reshard", model, _stepped(model, inputs=5))
    model = _mlp()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in (model[0], model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    _save(out / "bf16_compute", model, _stepped(model))
    # A bf16 model with its norm kept in fp32 (Hugging Face's _keep_in_fp32_modules).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8).bfloat16(), nn.LayerNorm(8), nn.Linear(8, 5).bfloat16())
    for layer in model:
        fully_shard(layer, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model[2](model[1](model[0](torch.randn(3, 4).bfloat16()).float()).bfloat16()).float().sum().backward()
    optim.step()
    _save(out / "bf16_with_fp32_norm", model, optim)
    _pickled_dtensor_saves(out, mesh)


def _pickled_dtensor_saves(out: Path, mesh: object) -> None:
    import types

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor

    # Not flattened, each rank's whole state dict is one bytes item; DCP writes one rank's: shards are lost.
    model = _mlp()
    fully_shard(model, mesh=mesh)
    _save(out / "fsdp_not_flattened", model, _stepped(model), planner=DefaultSavePlanner(flatten_state_dict=False))
    # A replicated DTensor inside an object: every rank's copy is the whole tensor, nothing is lost.
    replicated = distribute_tensor(torch.arange(6.0), mesh, [Replicate()])  # type: ignore[arg-type]
    dcp.save({"ema": types.SimpleNamespace(weight=replicated)}, checkpoint_id=out / "replicated_in_object")


def save_distributed(kind: str, out: Path, rank: int, world: int, store: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))  # fmt: skip
    if kind == "w4":
        _fsdp1_saves(out, world)
        _two_d_saves(out, world)
        _pipeline_saves(out, rank, world)
        _planner_saves(out, rank, world)
    else:
        _fsdp2_saves(out, world)
    dist.destroy_process_group()
    (out / f".done-{kind}-{rank}").touch()


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    sys.path.insert(0, str(SCRIPT.parent))
    save_distributed(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    raise SystemExit(0)


# --- the tests ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("parallel_layouts")
    from tests.support.checkpoints import run_ranks  # here: this file also runs as the ranks' script

    assert ([0] * 4, [0] * 3) == (run_ranks("w4", root, 4, timeout=180.0, script=SCRIPT),
                                  run_ranks("w3", root, 3, timeout=180.0, script=SCRIPT))  # fmt: skip
    return root


def findings_of(result: ValidationResult) -> set[tuple[str, str]]:
    return {(f.rule, f.severity.value) for f in result.findings}


NO_OPTIMIZER_STATE = {("TP-CKPT-017", "info")}
PICKLED_TENSORS = {("TP-CKPT-025", "info")}  # read from the data level on
VALID = [
    "fsdp1_sharded_state_dict", "fsdp1", "fsdp1_flat_optim", "fsdp1_hybrid", "hsdp", "fsdp_tp",
    "fsdp_tp_per_rank_metadata", "pipeline", "pipeline_fsdp", "full_state_dict_cpu_offload",
    "fsdp_dedup_to_lowest_rank", "dedup_to_lowest_rank", "tied_frozen_buffers", "fused_with_scheduler",
    "uneven_no_reshard", "bf16_compute", "bf16_with_fp32_norm",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS, ids=[lv.value for lv in LEVELS])
@pytest.mark.parametrize("kind", VALID)
def test_pristine_parallel_layout_is_valid(layouts: Path, kind: str, level: Level) -> None:
    """FSDP1, HSDP, FSDP2 + TP, pipeline stages, full-state and deduplicating saves are valid with no finding."""
    result = validate(layouts / kind, level)
    assert (Status.VALID, set()) == (result.status, findings_of(result))


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS, ids=[lv.value for lv in LEVELS])
def test_not_flattened_save_is_valid_with_nothing_to_check(layouts: Path, level: Level) -> None:
    """`DefaultSavePlanner(flatten_state_dict=False)` pickles each state dict whole: valid, its tensors unverified."""
    result = validate(layouts / "not_flattened", level)
    expected = NO_OPTIMIZER_STATE | (PICKLED_TENSORS if level is not Level.METADATA else set())
    assert (Status.VALID, expected) == (result.status, findings_of(result))


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS, ids=[lv.value for lv in LEVELS])
def test_sharded_tensors_pickled_whole_lose_all_ranks_shards_but_one(layouts: Path, level: Level) -> None:
    """FSDP2 saved with flatten_state_dict=False: the model and optimizer items hold one rank's DTensor shards,
    an error from the data level on (TP-CKPT-027); the metadata level cannot see inside the items."""
    result = validate(layouts / "fsdp_not_flattened", level)
    if level is Level.METADATA:
        assert (Status.VALID, NO_OPTIMIZER_STATE) == (result.status, findings_of(result))
    else:
        assert (Status.INVALID, [("TP-CKPT-027", "model"), ("TP-CKPT-027", "optim")]) == (
            result.status,
            sorted((f.rule, f.subject) for f in result.findings if f.severity is Severity.ERROR),
        )


@pytest.mark.slow
def test_a_replicated_dtensor_pickled_in_an_object_loses_nothing(layouts: Path) -> None:
    """Every rank's copy of a Replicate DTensor is the whole tensor: only unverifiable (TP-CKPT-025), valid."""
    result = validate(layouts / "replicated_in_object", Level.DATA)
    assert (Status.VALID, NO_OPTIMIZER_STATE | PICKLED_TENSORS) == (result.status, findings_of(result))


@pytest.mark.slow
def test_nested_pipeline_stages_lose_all_params_lists_but_one(layouts: Path) -> None:
    """Every stage saves `optim.param_groups.0.params`; DCP keeps one rank's, so 3 stages' 6 params are in no list."""
    result = validate(layouts / "pipeline_nested", Level.DATA)
    subjects = [f.message.split()[0] for f in result.findings if f.rule == "TP-CKPT-015"]
    assert (Status.INVALID, {("TP-CKPT-015", "error")}, 6) == (result.status, findings_of(result), len(set(subjects)))


@pytest.mark.slow
def test_ranks_with_nothing_to_write_leave_empty_files(layouts: Path) -> None:
    """A full_state_dict save leaves 0-byte files of ranks 1 to 3 that no item names: nothing to warn about."""
    path = layouts / "full_state_dict_cpu_offload"
    empty = sorted(p.name for p in path.iterdir() if p.suffix == ".distcp" and p.stat().st_size == 0)
    assert (["__1_0.distcp", "__2_0.distcp", "__3_0.distcp"], set()) == (
        empty, findings_of(validate(path, Level.METADATA)))  # fmt: skip


@pytest.mark.slow
def test_an_unreferenced_file_with_bytes_is_still_debris(layouts: Path, tmp_path: Path) -> None:
    """The same empty rank file, once it holds bytes, is reported unreferenced (TP-CKPT-008)."""
    from ckpt_corrupt import corrupt_copy

    broken = corrupt_copy(layouts / "full_state_dict_cpu_offload", tmp_path / "c",
                          lambda d: (d / "__3_0.distcp").write_bytes(b"stale"))  # fmt: skip
    result = validate(broken, Level.METADATA)
    assert (Status.VALID, [("TP-CKPT-008", "__3_0.distcp")]) == (
        result.status, [(f.rule, f.subject) for f in result.findings])  # fmt: skip


@pytest.mark.slow
def test_a_lost_rank_file_is_still_found(layouts: Path, tmp_path: Path) -> None:
    """Deleting one rank's data file of an HSDP checkpoint is a missing-file error (TP-CKPT-005), nothing else."""
    from ckpt_corrupt import corrupt_copy

    broken = corrupt_copy(layouts / "hsdp", tmp_path / "hsdp", lambda d: (d / "__2_0.distcp").unlink())
    result = validate(broken, Level.DATA)
    assert (Status.INVALID, [("TP-CKPT-005", "__2_0.distcp")]) == (
        result.status, [(f.rule, f.subject) for f in result.findings])  # fmt: skip


@pytest.mark.slow
def test_a_dropped_strided_shard_is_a_gap(layouts: Path, tmp_path: Path) -> None:
    """A chunk of an FSDP2 + TP (`_StridedShard`) weight dropped from the metadata is a tiling error."""
    from ckpt_corrupt import corrupt_copy, drop_chunk

    broken = corrupt_copy(layouts / "fsdp_tp", tmp_path / "tp", lambda d: drop_chunk(d, "model.0.weight", 1))
    errors = {f.rule for f in validate(broken, Level.METADATA).findings if f.severity is Severity.ERROR}
    assert {"TP-CKPT-010"} == errors
