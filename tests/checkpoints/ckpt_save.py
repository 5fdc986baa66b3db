"""Writes real DCP checkpoints for the tests: `python ckpt_save.py KIND OUT [RANK WORLD STORE]`.

Run as a script (one process per rank) so every save is a genuine torch 2.13
save: single process, FSDP2 and DDP on gloo, flat layout, zstd, safetensors,
per-rank metadata, and saves that crash on purpose.
"""

from __future__ import annotations

import os
import signal
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

warnings.filterwarnings("ignore")


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    # 5 output rows shard unevenly over 2 and 4 ranks (4 ranks: 2, 2, 1, 0 rows).
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 5))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 1) -> None:
    for _ in range(steps):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()


def save_single(kind: str, out: Path) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, opt)
    flat = kind == "flat"
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=flat))
    if kind == "single":
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=out)
    elif kind == "flat":
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=out)
    elif kind == "model_only":
        dcp.save({"model": msd}, checkpoint_id=out)
    elif kind == "zstd":
        from torch.distributed.checkpoint._extension import ZStandard

        writer = FileSystemWriter(out, _extensions=[ZStandard()])
        dcp.save({"model": msd, "optim": osd}, storage_writer=writer)
    elif kind == "safetensors":
        from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

        dcp.save(msd, storage_writer=HuggingFaceStorageWriter(str(out)))
    elif kind == "overwrite_crash":
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=out)
        train_step(model, opt, steps=2)
        msd, osd = get_state_dict(model, opt)

        def crash(*_args: object, **_kwargs: object) -> None:
            os._exit(17)  # data files rewritten, .metadata still the old one

        FileSystemWriter.finish = crash  # type: ignore[method-assign]
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=out)
    else:
        raise SystemExit(f"unknown kind {kind}")


def save_distributed(kind: str, out: Path, rank: int, world: int, store: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=30),
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    mesh = init_device_mesh("cpu", (world,))
    model = make_model()
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, opt)
    msd, osd = get_state_dict(model, opt)
    if kind in ("fsdp", "fsdp_only"):
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=out / f"fsdp{world}")
    if kind == "fsdp":
        ddp = DistributedDataParallel(make_model())
        dopt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        train_step(ddp, dopt)
        dmsd, dosd = get_state_dict(ddp, dopt)
        dcp.save({"model": dmsd, "optim": dosd}, checkpoint_id=out / f"ddp{world}")
        dcp.save(
            {"model": msd, "optim": osd},
            checkpoint_id=out / f"percollective{world}",
            use_collectives=False,
        )
    elif kind == "crash":
        from torch.distributed.checkpoint import FileSystemWriter

        original = FileSystemWriter.write_data

        def die_after_write(self: FileSystemWriter, plan: object, planner: object) -> object:
            result = original(self, plan, planner)  # type: ignore[arg-type]
            if rank == world - 1:
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        FileSystemWriter.write_data = die_after_write  # type: ignore[assignment]
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=out)
    dist.destroy_process_group()
    if kind != "crash":  # (that one's directory is the checkpoint itself, watched by a daemon)
        # Everything this rank had to do is done: a crash from here on is torch's interpreter teardown.
        (out / f".done-{kind}-{rank}").touch()


SINGLE_KINDS = ("single", "flat", "model_only", "zstd", "safetensors")


if __name__ == "__main__":
    kind, out = sys.argv[1], Path(sys.argv[2])
    if kind == "all_single":
        for each in SINGLE_KINDS:
            save_single(each, out / each)
        raise SystemExit(0)
    if len(sys.argv) > 3:
        save_distributed(kind, out, int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    else:
        save_single(kind, out)
