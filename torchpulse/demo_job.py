"""A small real training job for `make demo` and the integration tests.

A 2-layer transformer encoder trained on random tokens with AdamW and a
step-decay schedule, on CPU; DistributedDataParallel over gloo when started
by torchrun. Options exercise every probe: a compiled helper that breaks its
graph and recompiles when the sequence length doubles (once per half of the
broken graph: two frames), an injected non-finite gradient (the step is then
skipped, as GradScaler would), DCP checkpoints, and one save that fails on purpose
(caught by the job, which trains on). It knows nothing about torchpulse: it
runs under `torchpulse run`, which attaches the agent without code changes.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from torch import nn


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 128, d_model: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=4 * d_model, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))  # type: ignore[no-any-return]


def token_accuracy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    hits = (logits.argmax(-1) == targets).float()
    # A data-dependent Python branch: Dynamo breaks the graph here.
    torch._dynamo.graph_break()
    return hits.mean()


def _distributed() -> bool:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "MASTER_ADDR" in os.environ:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        return True
    return False


def _save(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    from torch.distributed.checkpoint import state_dict_saver
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state_dict_saver.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(path))


def _save_that_fails(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """A save into a path under /dev/null: mkdir fails on every rank (root included), as on a broken mount."""
    from torch.distributed.checkpoint.api import CheckpointException

    target = Path("/dev/null") / f"step-{step:06d}"
    loud = int(os.environ.get("RANK", "0")) == 0
    if loud:
        print(
            f"demo_job: step {step}: DELIBERATE failing checkpoint save to {target} (cannot be a directory)", flush=True
        )
    try:
        _save(model, optimizer, target)
    except CheckpointException as exc:  # a BaseException in torch 2.13: `except Exception` misses it
        if loud:
            cause = next(iter(exc.failures.values()))[0]
            print(
                f"demo_job: step {step}: the deliberate save failed as intended ({type(exc).__name__}: "
                f"{type(cause).__name__}); caught, training goes on",
                flush=True,
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step")
    parser.add_argument("--compile", action="store_true", help="compile a metric helper (it breaks its graph)")
    parser.add_argument("--nan-at-step", type=int, default=-1, help="make one gradient NaN at this step")
    parser.add_argument("--checkpoint-dir", type=Path, help="save a DCP checkpoint here every --checkpoint-every")
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument(
        "--fail-save-at-step",
        type=int,
        default=-1,
        help="attempt one checkpoint save that fails on purpose at this step (caught)",
    )
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    torch.set_num_threads(1)
    distributed = _distributed()
    model: nn.Module = TinyLM()
    if distributed:
        # Gradients are averaged over gloo, as a real data-parallel job does.
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # Halve the learning rate every quarter of the run, so the exported lr moves.
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=max(1, args.steps // 4), gamma=0.5)
    loss_fn = nn.CrossEntropyLoss()
    accuracy = torch.compile(token_accuracy) if args.compile else token_accuracy
    head_bias = next(p for n, p in model.named_parameters() if n.endswith("head.bias"))
    for step in range(1, args.steps + 1):
        # The second half of the run uses longer sequences: a shape recompile of each compiled frame.
        seq = args.seq if step <= args.steps // 2 else args.seq * 2
        tokens = torch.randint(0, 128, (args.batch, seq))
        optimizer.zero_grad(set_to_none=True)
        logits = model(tokens)
        targets = tokens.roll(-1, dims=1)
        loss = loss_fn(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        hook = (
            head_bias.register_hook(lambda g: g * float("nan"))  # type: ignore[no-untyped-call]
            if step == args.nan_at_step
            else None
        )
        loss.backward()
        if hook is not None:
            hook.remove()
        with torch.no_grad():
            accuracy(logits, targets)
        if all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in model.parameters()):
            optimizer.step()  # skipped on non-finite gradients, as GradScaler does
        scheduler.step()
        if args.checkpoint_dir is not None and step % args.checkpoint_every == 0:
            _save(model, optimizer, args.checkpoint_dir / f"step-{step:06d}")
        if step == args.fail_save_at_step:
            _save_that_fails(model, optimizer, step)
        if args.step_sleep:
            time.sleep(args.step_sleep)
    if distributed:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
