"""Who this process is: run name, rank and the facts that go into run_info."""

from __future__ import annotations

import os
import shlex
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Identity:
    run: str
    rank: int
    local_rank: int
    world_size: int
    host: str
    pid: int
    command: str


def _first_int(env: Mapping[str, str], names: tuple[str, ...], default: int) -> int:
    for name in names:
        value = env.get(name, "").strip()
        if value.lstrip("-").isdigit():
            return int(value)
    return default


def run_name(env: Mapping[str, str]) -> str:
    """Pick the run label: explicit name, then launcher ids, then a generated one."""
    for name in ("TORCHPULSE_RUN", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        value = env.get(name, "").strip()
        # torchrun without --rdzv-id reports the literal run id "none".
        if value and value != "none":
            return value
    # Set by `torchpulse run` so that every rank it starts agrees on a name.
    return env.get("TORCHPULSE_RUN_FALLBACK") or generate_run_name()


def generate_run_name() -> str:
    host = socket.gethostname().split(".")[0]
    return f"{host}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def current_identity(env: Mapping[str, str] | None = None) -> Identity:
    """Read the identity from the usual torchrun, SLURM and MPI variables."""
    env = os.environ if env is None else env
    return Identity(
        run=run_name(env),
        rank=_first_int(env, ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"), 0),
        local_rank=_first_int(env, ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"), 0),
        world_size=_first_int(env, ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"), 1),
        host=socket.gethostname(),
        pid=os.getpid(),
        # Bounded: run_info carries it as a label value.
        command=shlex.join([sys.executable, *sys.argv])[:256],
    )
