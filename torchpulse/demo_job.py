"""A small real training job for `make demo` and the integration tests.

A 2-layer transformer encoder trained on random tokens with AdamW and a
step-decay schedule, on CPU. It knows nothing about torchpulse: it is run
under `torchpulse run`, which attaches the agent without code changes.
"""

from __future__ import annotations

import argparse
import time

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # Halve the learning rate every quarter of the run, so the exported lr moves.
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=max(1, args.steps // 4), gamma=0.5)
    loss_fn = nn.CrossEntropyLoss()
    for _ in range(args.steps):
        tokens = torch.randint(0, 128, (args.batch, args.seq))
        optimizer.zero_grad(set_to_none=True)
        logits = model(tokens)
        loss = loss_fn(logits.reshape(-1, logits.shape[-1]), tokens.roll(-1, dims=1).reshape(-1))
        loss.backward()
        optimizer.step()
        scheduler.step()
        if args.step_sleep:
            time.sleep(args.step_sleep)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
