"""Real training frameworks under `torchpulse run`: optimizer steps and backward passes counted exactly, per rank.

Each job writes what its framework itself counted (global step, accumulation) to a file; the test compares the
daemon's per-rank totals against that, not against a constant.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tests.support import DaemonProcess, run_job, select, wait_for

pytestmark = pytest.mark.slow

# A tiny GPT-2 built from its config (nothing downloaded) trained by the Trainer on synthetic tokens, one epoch of
# exactly STEPS optimizer steps of ACCUMULATION micro-batches each.
HF_TRAINER_JOB = textwrap.dedent("""
    import json, sys

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    out, accumulation, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    batch = 2


    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return batch * accumulation * steps

        def __getitem__(self, index):
            ids = torch.arange(8) * (index + 1) % 64
            return {"input_ids": ids, "labels": ids}


    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=8, bos_token_id=0, eos_token_id=0
    )
    args = TrainingArguments(
        output_dir=f"{out}/trainer",
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        num_train_epochs=1,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
    )
    trainer = Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=Tokens())
    trainer.train()
    with open(f"{out}/counted-rank0.json", "w") as f:
        counted = {"global_step": trainer.state.global_step, "accumulation": trainer.args.gradient_accumulation_steps}
        json.dump(counted, f)
    """)

# As a user runs Lightning DDP on one machine: strategy="ddp" starts the other rank by running this script again.
LIGHTNING_DDP_JOB = textwrap.dedent("""
    import json, sys

    import lightning as L
    import torch
    from torch import nn

    out, accumulation, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])


    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)


    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=steps,
        accumulate_grad_batches=accumulation,
        default_root_dir=out,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=2, num_workers=0))
    with open(f"{out}/counted-rank{trainer.global_rank}.json", "w") as f:
        json.dump({"global_step": trainer.global_step, "accumulation": trainer.accumulate_grad_batches}, f)
    """)


def _counted_by_framework(tmp_path: Path, ranks: int) -> dict[str, dict[str, int]]:
    """What the job's framework counted on each rank (global step, accumulation), by rank."""
    return {str(r): json.loads((tmp_path / f"counted-rank{r}.json").read_text()) for r in range(ranks)}


def _counted_by_torchpulse(daemon: DaemonProcess, run: str) -> dict[str, tuple[dict[str, float], dict[str, float]]]:
    """Per rank: optimizer steps by optimizer, and the non-zero backward passes by kind, as /metrics shows them."""
    samples = daemon.scrape()
    counts: dict[str, tuple[dict[str, float], dict[str, float]]] = {}
    for key, value in select(samples, "torchpulse_optimizer_steps_total", run=run).items():
        counts.setdefault(dict(key)["rank"], ({}, {}))[0][dict(key)["optimizer"]] = value
    for key, value in select(samples, "torchpulse_backward_passes_total", run=run).items():
        if value:
            counts.setdefault(dict(key)["rank"], ({}, {}))[1][dict(key)["kind"]] = value
    return counts


def _all_ranks_exited(daemon: DaemonProcess, run: str, ranks: int) -> None:
    """Wait until every rank said goodbye: its last totals are in, even from a rank the job's process started."""

    def exited() -> dict[str, float]:
        return {dict(k)["rank"]: v for k, v in select(daemon.scrape(), "torchpulse_agent_exited", run=run).items()}

    wait_for(lambda: {str(r): 1.0 for r in range(ranks)} == exited(), timeout=60)


def _probe_errors(daemon: DaemonProcess, run: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {k: v for k, v in select(daemon.scrape(), "torchpulse_agent_probe_errors_total", run=run).items() if v}


def _torchpulse_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("torchpulse")]


def test_hugging_face_trainer_with_gradient_accumulation_is_counted_exactly(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    """Trainer with gradient_accumulation_steps=3: one AdamW step per global step, 3 backward passes a step."""
    env = daemon.env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf-home"))
    result = run_job(HF_TRAINER_JOB, tmp_path, "hf-trainer", env, str(tmp_path), "3", "4")
    assert 0 == result.returncode, result.stderr[-5000:]
    assert [] == _torchpulse_lines(result.stderr)
    counted = _counted_by_framework(tmp_path, ranks=1)
    assert {"0": {"global_step": 4, "accumulation": 3}} == counted
    _all_ranks_exited(daemon, "hf-trainer", ranks=1)
    # The Trainer steps torch's AdamW through accelerate's AcceleratedOptimizer: one optimizer, not two.
    assert {
        rank: ({"AdamW#0": float(c["global_step"])}, {"backward": float(c["global_step"] * c["accumulation"])})
        for rank, c in counted.items()
    } == _counted_by_torchpulse(daemon, "hf-trainer")
    assert {} == _probe_errors(daemon, "hf-trainer")


def test_lightning_ddp_on_two_cpu_processes_is_counted_exactly_on_each_rank(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    """Lightning's ddp strategy relaunching the script as rank 1, accumulate_grad_batches=2 (no_sync micro-steps):
    each rank counts global_step SGD steps and 2 backward passes a step, under one run of world size 2."""
    env = daemon.env(OMP_NUM_THREADS="1")
    result = run_job(LIGHTNING_DDP_JOB, tmp_path, "lightning-ddp", env, str(tmp_path), "2", "3")
    assert 0 == result.returncode, result.stderr[-5000:]
    assert [] == _torchpulse_lines(result.stderr)
    counted = _counted_by_framework(tmp_path, ranks=2)
    assert {"0": {"global_step": 3, "accumulation": 2}, "1": {"global_step": 3, "accumulation": 2}} == counted
    _all_ranks_exited(daemon, "lightning-ddp", ranks=2)
    assert {
        rank: ({"SGD#0": float(c["global_step"])}, {"backward": float(c["global_step"] * c["accumulation"])})
        for rank, c in counted.items()
    } == _counted_by_torchpulse(daemon, "lightning-ddp")
    assert ["2"] == [dict(k)["world_size"] for k in select(daemon.scrape(), "torchpulse_run_info", run="lightning-ddp")]
    assert {} == _probe_errors(daemon, "lightning-ddp")
