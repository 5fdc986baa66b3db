"""Pristine checkpoints written by torch APIs and options the other tests do not use: all valid.

Run as a script, this file writes them (`single OUT`, or `dist OUT RANK WORLD STORE`
once per rank), so each save is a genuine torch save in a process of its own.
"""

from __future__ import annotations

import io
import json
import pickle
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch import nn

from torchpulse.checkpoints.model import Level, Severity, Status, ValidationResult
from torchpulse.checkpoints.validate import validate

SCRIPT = Path(__file__)
LEVELS = [Level.METADATA, Level.DATA, Level.LOAD]


# --- the saves (run in a child process) ------------------------------------------------


def _model_and_optimizer(
    opt: Callable[..., torch.optim.Optimizer], **kwargs: object
) -> tuple[nn.Module, torch.optim.Optimizer]:
    from ckpt_save import make_model

    model = make_model()
    return model, opt(model.parameters(), lr=1e-3, **kwargs)


def _save(path: Path, model: nn.Module, optim: object, flat: bool = False, **extra: object) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    msd, osd = get_state_dict(model, optim, options=options)  # type: ignore[arg-type]
    dcp.save({"model": msd, "optim": osd, **extra}, checkpoint_id=path)


def _stepped(opt: Callable[..., torch.optim.Optimizer], **kwargs: object) -> tuple[nn.Module, torch.optim.Optimizer]:
    from ckpt_save import train_step

    model, optim = _model_and_optimizer(opt, **kwargs)
    train_step(model, optim)
    return model, optim


def _writer_variants(out: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from ckpt_save import make_model
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = _stepped(torch.optim.AdamW)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    per_item = FileSystemWriter(out / "file_per_item_4_threads", single_file_per_rank=False, thread_count=4)
    dcp.save(state, storage_writer=per_item)
    no_sync = FileSystemWriter(
        out / "two_threads_no_sync_copy_ahead", thread_count=2, sync_files=False, per_thread_copy_ahead=1
    )
    dcp.save(state, storage_writer=no_sync)
    # An older, bigger checkpoint of another shape (one file per item), then overwritten in place.
    older = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 3))
    older_opt = torch.optim.Adagrad(older.parameters())
    older(torch.randn(2, 16)).sum().backward()
    older_opt.step()
    omsd, oosd = get_state_dict(older, older_opt)
    dcp.save({"model": omsd, "optim": oosd},
             storage_writer=FileSystemWriter(out / "overwritten", single_file_per_rank=False))  # fmt: skip
    time.sleep(0.02)
    dcp.save(state, storage_writer=FileSystemWriter(out / "overwritten", overwrite=True))
    dcp.save(state, checkpoint_id=out / "no_dist", no_dist=True)
    dcp.async_save(state, checkpoint_id=out / "async_thread").result()
    source = out / "plain.pt"
    torch.save({"model": make_model().state_dict(), "optim": osd}, source)
    from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

    torch_save_to_dcp(source, out / "torch_save_to_dcp")
    source.unlink()


def _content_variants(out: Path) -> None:
    model, optim = _stepped(torch.optim.AdamW)
    tied = torch.randn(4, 4)
    tensors = {
        "bf16": torch.randn(3, 4).bfloat16(),
        "fp16": torch.randn(5).half(),
        "int64": torch.arange(7),
        "bool": torch.tensor([True, False, True]),
        "complex64": torch.randn(3, dtype=torch.complex64),
        "scalar": torch.tensor(3.5),
        "int_scalar": torch.tensor(7),
        "empty": torch.empty(0),
        "empty_rows": torch.empty(0, 4),
        "transposed": torch.randn(3, 5).t(),
        "sliced_rows": torch.randn(10, 4)[2:7],
        "sliced_cols": torch.randn(4, 6)[:, 1:3],
        "every_third": torch.randn(10)[::3],
        "expanded": torch.randn(1, 3).expand(4, 3),
        "tied_a": tied,
        "tied_b": tied,
        "row_of_tied": tied[1],
    }
    objects = {
        "epoch": 3, "lr": 0.5, "name": "run-a", "flag": True, "nothing": None, "pair": (1, 2),
        "nested": {"list": [1, 2, {"t": torch.ones(2)}], "deeper": {"t": torch.arange(3)}},
        "buffer": io.BytesIO(b"hello"),
        "pickled": pickle.dumps({"a": 1, "b": [2.0, "x"]}),
    }  # fmt: skip
    _save(out / "dtypes_views_objects", model, optim, tensors=tensors, objects=objects)


def _optimizer_variants(out: Path) -> None:
    from ckpt_save import make_model, train_step

    _save(out / "sgd_momentum", *_stepped(torch.optim.SGD, momentum=0.9))
    _save(out / "sgd_no_momentum", *_stepped(torch.optim.SGD))
    _save(out / "adagrad", *_stepped(torch.optim.Adagrad))
    _save(out / "adamw_before_first_step", *_model_and_optimizer(torch.optim.AdamW))
    _save(out / "adamw_before_first_step_flat", *_model_and_optimizer(torch.optim.AdamW), flat=True)

    # Two optimizers merged into one state dict by get_state_dict: disjoint state names.
    for flat in (False, True):
        model = make_model()
        adam = torch.optim.AdamW(model[0].parameters())
        sgd = torch.optim.SGD(model[2].parameters(), lr=0.1, momentum=0.9)
        model(torch.randn(3, 4)).sum().backward()
        adam.step()
        sgd.step()
        _save(out / ("two_optimizers_flat" if flat else "two_optimizers"), model, (adam, sgd), flat=flat)

    # amsgrad is a param-group option: only that group keeps max_exp_avg_sq.
    for flat in (False, True):
        model = make_model()
        groups = [{"params": model[0].parameters(), "amsgrad": True}, {"params": model[2].parameters()}]
        adam = torch.optim.Adam(groups)
        train_step(model, adam)
        _save(out / ("amsgrad_one_group_flat" if flat else "amsgrad_one_group"), model, adam, flat=flat)

    # A group added after two steps (torch's own fine-tuning example) has taken one step.
    for flat in (False, True):
        model = make_model()
        adam = torch.optim.AdamW(model[0].parameters())
        train_step(model, adam, steps=2)
        adam.add_param_group({"params": model[2].parameters(), "lr": 0.5})
        train_step(model, adam)
        _save(out / ("group_added_later_flat" if flat else "group_added_later"), model, adam, flat=flat)

    _save(out / "adafactor", *_stepped(torch.optim.Adafactor))
    _save(out / "adafactor_flat", *_stepped(torch.optim.Adafactor), flat=True)

    model = make_model()
    lbfgs = torch.optim.LBFGS(model.parameters(), history_size=3, max_iter=3)

    def closure() -> torch.Tensor:
        lbfgs.zero_grad()
        loss = model(torch.randn(3, 4)).pow(2).sum()
        loss.backward()
        return loss

    lbfgs.step(closure)  # type: ignore[no-untyped-call]
    _save(out / "lbfgs", model, lbfgs)


def save_single(out: Path) -> None:
    _writer_variants(out)
    _content_variants(out)
    _optimizer_variants(out)


def save_distributed(out: Path, rank: int, world: int, store: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from ckpt_save import make_model, train_step
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))  # fmt: skip
    mesh = init_device_mesh("cpu", (world,))
    # DDP-style: every rank holds the same full tensors; DCP writes each once.
    model = make_model()
    optim = torch.optim.AdamW(model.parameters())
    train_step(model, optim)
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd, "epoch": 3}, checkpoint_id=out / "replicated")
    # Tensor parallel: column- then row-wise sharded layers, DTensor optimizer state.
    torch.manual_seed(0)
    tp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 6))
    parallelize_module(tp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    tp_optim = torch.optim.AdamW(tp.parameters())
    train_step(tp, tp_optim)
    msd, osd = get_state_dict(tp, tp_optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out / "tensor_parallel")
    # Raw placements, uneven sizes, a 2-D mesh.
    full = torch.arange(42.0).reshape(7, 6)
    mesh2 = init_device_mesh("cpu", (1, world))
    placements = {
        "rows": distribute_tensor(full, mesh, [Shard(0)]),
        "cols": distribute_tensor(full, mesh, [Shard(1)]),
        "replicated": distribute_tensor(full, mesh, [Replicate()]),
        "three": distribute_tensor(torch.arange(3.0), mesh, [Shard(0)]),
        "one": distribute_tensor(torch.arange(1.0), mesh, [Shard(0)]),
        "bf16_cols": distribute_tensor(full.bfloat16(), mesh, [Shard(1)]),
        "mesh2d": distribute_tensor(full, mesh2, [Shard(0), Shard(1)]),
    }
    dcp.save(placements, checkpoint_id=out / "placements")
    dist.destroy_process_group()
    (out / f".done-dist-{rank}").touch()


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    sys.path.insert(0, str(SCRIPT.parent))
    if sys.argv[1] == "single":
        save_single(Path(sys.argv[2]))
    else:
        save_distributed(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    raise SystemExit(0)


# --- the tests ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("variants")
    subprocess.run([sys.executable, str(SCRIPT), "single", str(root)], check=True)
    return root


def findings_of(result: ValidationResult) -> set[tuple[str, str]]:
    return {(f.rule, f.severity.value) for f in result.findings}


NO_OPTIMIZER_STATE = {("TP-CKPT-017", "info")}
# What each pristine variant justly reports besides nothing; every one of them is valid.
EXPECTED: dict[str, set[tuple[str, str]]] = {
    "file_per_item_4_threads": set(),
    "two_threads_no_sync_copy_ahead": set(),
    # The older save's per-item files are debris the new metadata does not reference.
    "overwritten": {("TP-CKPT-008", "warning")},
    "no_dist": set(),
    "async_thread": set(),
    "torch_save_to_dcp": set(),
    "sgd_momentum": set(),
    "sgd_no_momentum": NO_OPTIMIZER_STATE,  # torch keeps no SGD state without momentum
    "adagrad": set(),
    "adamw_before_first_step": set(),
    "adamw_before_first_step_flat": set(),
}
# The BytesIO is pickled with a global: reported as not verifiable, never executed.
DATA_EXPECTED = {"dtypes_views_objects": {("TP-CKPT-025", "info")}}


@pytest.mark.parametrize("level", LEVELS, ids=[lv.value for lv in LEVELS])
@pytest.mark.parametrize("kind", [*EXPECTED, "dtypes_views_objects"])
def test_pristine_variant_is_valid(variants: Path, kind: str, level: Level) -> None:
    """Writer options, async and converted saves, odd dtypes, views, tied tensors and objects are valid."""
    result = validate(variants / kind, level)
    expected = EXPECTED.get(kind, set()) | (DATA_EXPECTED.get(kind, set()) if level is not Level.METADATA else set())
    assert (Status.VALID, expected) == (result.status, findings_of(result))


def test_overwrite_leaves_only_the_older_saves_files_unreferenced(variants: Path) -> None:
    """After an overwrite in place, the new metadata's files are all current; only older files are debris."""
    result = validate(variants / "overwritten", Level.DATA)
    unreferenced = {f.subject for f in result.findings if f.rule == "TP-CKPT-008"}
    assert ("__0_0.distcp" not in unreferenced, True) == (True, len(unreferenced) > 0)


@pytest.mark.parametrize("level", LEVELS, ids=[lv.value for lv in LEVELS])
@pytest.mark.parametrize(
    "kind", ["two_optimizers", "two_optimizers_flat", "amsgrad_one_group", "amsgrad_one_group_flat"]
)
def test_param_groups_may_keep_different_state(variants: Path, kind: str, level: Level) -> None:
    """State names are compared within a param group: merged optimizers and per-group amsgrad are valid."""
    result = validate(variants / kind, level)
    assert (Status.VALID, set()) == (result.status, findings_of(result))


@pytest.mark.parametrize("level", LEVELS, ids=[lv.value for lv in LEVELS])
@pytest.mark.parametrize("kind", ["group_added_later", "group_added_later_flat"])
def test_a_param_group_added_later_has_its_own_step(variants: Path, kind: str, level: Level) -> None:
    """`add_param_group` after two steps: that group's step is 1, the first group's 3; valid."""
    result = validate(variants / kind, level)
    assert (Status.VALID, set()) == (result.status, findings_of(result))


@pytest.mark.parametrize("level", LEVELS, ids=[lv.value for lv in LEVELS])
@pytest.mark.parametrize("kind", ["adafactor", "adafactor_flat", "lbfgs"])
def test_state_not_shaped_like_its_parameter(variants: Path, kind: str, level: Level) -> None:
    """Adafactor's factored row_var/col_var (variance for vectors) and LBFGS's flat vectors are valid."""
    result = validate(variants / kind, level)
    assert (Status.VALID, set()) == (result.status, findings_of(result))


# --- the rules still catch the same breakage in these layouts ---------------------------


def _drop(key: str) -> Callable[[Path], None]:
    def corrupt(d: Path) -> None:
        from ckpt_corrupt import entry, load_md, save_md

        md = load_md(d)
        del md.state_dict_metadata[key], md.storage_data[entry(md, key)[0]], md.planner_data[key]
        save_md(d, md)

    return corrupt


def _replace(key: str, value: torch.Tensor) -> Callable[[Path], None]:
    def corrupt(d: Path) -> None:
        from ckpt_corrupt import load_md, replace_item, save_md

        md = load_md(d)
        replace_item(d, md, key, value)
        tensor_md = md.state_dict_metadata[key]
        tensor_md.size = value.shape
        tensor_md.chunks[0].sizes = value.shape
        save_md(d, md)

    return corrupt


BROKEN = [
    ("two_optimizers_flat", "TP-CKPT-014", _drop("optim.state.0.bias.exp_avg")),
    ("amsgrad_one_group", "TP-CKPT-014", _drop("optim.state.0.bias.max_exp_avg_sq")),
    ("adafactor", "TP-CKPT-014", _drop("optim.state.0.weight.col_var")),
    ("adafactor", "TP-CKPT-013", _replace("optim.state.0.weight.row_var", torch.ones(4, 1))),
    ("adafactor", "TP-CKPT-013", _replace("optim.state.0.bias.variance", torch.ones(4))),
    ("group_added_later", "TP-CKPT-016", _replace("optim.state.2.bias.step", torch.tensor(7.0))),
    ("group_added_later_flat", "TP-CKPT-016", _replace("optim.state.0.weight.step", torch.tensor(1.0))),
]


@pytest.mark.parametrize(("kind", "rule", "corruption"), BROKEN, ids=[f"{k}-{r}" for k, r, _ in BROKEN])
def test_breakage_within_a_group_is_still_found(
    variants: Path, tmp_path: Path, kind: str, rule: str, corruption: Callable[[Path], None]
) -> None:
    """A missing state entry, a misshapen factored state and an unequal step inside one group are errors."""
    from ckpt_corrupt import corrupt_copy

    broken = corrupt_copy(variants / kind, tmp_path / kind, corruption)
    result = validate(broken, Level.DATA)
    errors = {f.rule for f in result.findings if f.severity is Severity.ERROR}
    assert (Status.INVALID, {rule}) == (result.status, errors)


def test_cli_json_on_a_file_per_item_checkpoint(variants: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`torchpulse check --format json` in its child process says valid, exit status 0, one file per item."""
    from torchpulse.checkpoints.cli import main

    code = main([str(variants / "file_per_item_4_threads"), "--level", "data", "--format", "json"])
    out = json.loads(capsys.readouterr().out)
    stats = out["stats"]
    assert (0, "valid", [], stats["chunks"]) == (code, out["status"], out["findings"], stats["files"] - 1)


# --- several real ranks -------------------------------------------------------------------


@pytest.fixture(scope="module")
def dist_variants(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dist_variants")
    from tests.support.checkpoints import run_ranks  # here: this file also runs as the ranks' script

    assert [0, 0] == run_ranks("dist", root, 2, timeout=180.0, script=SCRIPT)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS, ids=[lv.value for lv in LEVELS])
@pytest.mark.parametrize(("kind", "expected"), [("replicated", set()), ("tensor_parallel", set()),
                                                ("placements", NO_OPTIMIZER_STATE)])  # fmt: skip
def test_pristine_two_rank_variants_are_valid(
    dist_variants: Path, kind: str, expected: set[tuple[str, str]], level: Level
) -> None:
    """Replicated (deduplicated) tensors, tensor-parallel DTensors and Shard(0)/Shard(1)/2-D placements are valid."""
    result = validate(dist_variants / kind, level)
    assert (Status.VALID, expected) == (result.status, findings_of(result))


def test_variants_were_written_by_this_torch(variants: Path) -> None:
    """Every variant directory holds a committed .metadata (a save that silently did nothing would pass)."""
    kinds = [*EXPECTED, "dtypes_views_objects", "two_optimizers", "two_optimizers_flat", "amsgrad_one_group",
             "amsgrad_one_group_flat", "group_added_later", "group_added_later_flat", "adafactor", "adafactor_flat",
             "lbfgs"]  # fmt: skip
    assert [] == [k for k in kinds if not (variants / k / ".metadata").is_file()]


def test_flat_group_options_are_compared_without_printing_them() -> None:
    """A hostile option value of lists sharing lists (2**60 characters as text) is compared at once."""
    from torchpulse.checkpoints.model import StoredBytes
    from torchpulse.checkpoints.rules.optimizer import OptimizerLayout, StateKey, param_groups, step_consistency

    shared: list[object] = [1]
    for _ in range(60):
        shared = [shared, shared]
    layout = OptimizerLayout(
        state={f"o.state.{p}.step": StateKey("o", p, "step") for p in ("w", "b")},
        params_lists={},
        params={},
        group_options={"o": {p: {"lr": f"o.param_groups.{p}.lr"} for p in ("w", "b")}},
    )
    items = {"o.param_groups.w.lr": StoredBytes("o.param_groups.w.lr", True, shared),
             "o.param_groups.b.lr": StoredBytes("o.param_groups.b.lr", True, 0.1),
             "o.state.w.step": StoredBytes("o.state.w.step", True, 3),
             "o.state.b.step": StoredBytes("o.state.b.step", True, 1)}  # fmt: skip
    groups = param_groups(layout, items)["o"]
    assert (True, []) == (groups["w"] != groups["b"], step_consistency(layout, [], items))
