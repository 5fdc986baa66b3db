"""A job that saves one DCP checkpoint with the agent attached: `python announce_job.py OUT`."""

from __future__ import annotations

import sys
import warnings

import torch

import torchpulse

warnings.filterwarnings("ignore")

if __name__ == "__main__":
    torchpulse.attach(probes=["checkpoint"])
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(4, 4)}, checkpoint_id=sys.argv[1], no_dist=True)
    torchpulse.detach()
