"""`torchpulse run -- CMD`: exec CMD with the agent bootstrap on PYTHONPATH."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from torchpulse.paths import agent_socket_path
from torchpulse.probes.identity import generate_run_name

BOOTSTRAP_DIR = Path(__file__).resolve().parent / "probes" / "bootstrap"


def launch_env(base: Mapping[str, str], socket: str | None, run_name: str | None,
               probes: str | None) -> dict[str, str]:
    """The environment CMD runs in: socket, run name, bootstrap first on PYTHONPATH."""
    env = dict(base)
    env["TORCHPULSE_SOCKET"] = socket or str(agent_socket_path(base))
    if run_name:
        env["TORCHPULSE_RUN"] = run_name
    # Shared by every process CMD starts (all torchrun ranks), used only when
    # neither TORCHPULSE_RUN nor a launcher's run id names the run.
    env.setdefault("TORCHPULSE_RUN_FALLBACK", generate_run_name())
    if probes:
        env["TORCHPULSE_PROBES"] = probes
    existing = env.get("PYTHONPATH", "")
    parts = [p for p in existing.split(os.pathsep) if p and Path(p).resolve() != BOOTSTRAP_DIR]
    env["PYTHONPATH"] = os.pathsep.join([str(BOOTSTRAP_DIR), *parts])
    env["TORCHPULSE_BOOTSTRAP"] = "1"
    return env


def launch(cmd: Sequence[str], *, socket: str | None = None, run_name: str | None = None,
           probes: str | None = None) -> int:
    if not cmd:
        print("usage: torchpulse run [--socket PATH] [--run-name NAME] -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    env = launch_env(os.environ, socket, run_name, probes)
    try:
        os.execvpe(cmd[0], list(cmd), env)
    except OSError as exc:
        print(f"torchpulse: cannot run {cmd[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached: exec replaced this process
