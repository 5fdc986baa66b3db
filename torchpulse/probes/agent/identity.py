"""Who this process is: run name, rank and the facts that go into run_info."""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from torchpulse.probes.agent.command_line import shown_command


@dataclass(frozen=True)
class Identity:
    """Who this process is; `rank` and `world_size` come from torch.distributed once it is initialised.

    Before that, from the launcher's variables. torch.distributed wins because a launcher names the
    process it started, and that process may start the ranks itself: `torch.multiprocessing.spawn`
    inside an `srun` or `mpirun` task gives every rank the task's SLURM_PROCID (and under no launcher
    there is no RANK at all). A rank learns who it is from its own `init_process_group(rank=...)`,
    after the agent attached. The agent first reads them when it connects, after the first step it
    saw, and reconnects as the rank torch.distributed names if that differs; a rank that destroyed
    its group before its agent could first connect (daemon down all along) keeps the launcher's
    values, or rank 0.
    """

    run: str
    # None where no launcher variable named it; torch.distributed, once initialised, overrides it.
    env_rank: int | None
    local_rank: int
    env_world_size: int | None
    host: str
    pid: int
    command: str
    # (rank, world size) read from torch.distributed; kept after destroy_process_group().
    _distributed: list[tuple[int, int]] = field(default_factory=list, init=False, repr=False, compare=False)

    @property
    def rank(self) -> int:
        return self._named(self.env_rank, 0, default=0)

    @property
    def world_size(self) -> int:
        return self._named(self.env_world_size, 1, default=1)

    def _named(self, by_launcher: int | None, index: int, default: int) -> int:
        """torch.distributed's (rank, world size)[index], else the launcher's value, else `default`."""
        distributed = self._from_torch_distributed()
        # A one-process group inside a job launched as several (a helper group of one rank) names no rank.
        if distributed is not None and (distributed[1] > 1 or (self.env_world_size or 1) <= 1):
            return distributed[index]
        return by_launcher if by_launcher is not None else default

    def _from_torch_distributed(self) -> tuple[int, int] | None:
        if not self._distributed:
            # Never imports it: a job that has not imported torch.distributed has not initialised it.
            dist = sys.modules.get("torch.distributed")
            try:
                if dist is None or not (dist.is_available() and dist.is_initialized()):
                    return None
                self._distributed.append((int(dist.get_rank()), int(dist.get_world_size())))
            except Exception:  # a half-initialised or torn-down group: the launcher's values stand
                return None
        return self._distributed[0]


def _env_int(env: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    for name in names:
        value = env.get(name, "").strip()
        if value.lstrip("-").isdigit():
            return int(value)
    return None


def _first_int(env: Mapping[str, str], names: tuple[str, ...], default: int) -> int:
    value = _env_int(env, names)
    return default if value is None else value


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
    """Read the identity from the usual torchrun, SLURM and MPI variables (then torch.distributed)."""
    env = os.environ if env is None else env
    return Identity(
        run=run_name(env),
        env_rank=_env_int(env, ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")),
        local_rank=_first_int(env, ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"), 0),
        env_world_size=_env_int(env, ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")),
        host=socket.gethostname(),
        pid=os.getpid(),
        command=shown_command([sys.executable, *sys.argv]),
    )
