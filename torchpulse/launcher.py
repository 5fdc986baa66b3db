"""`torchpulse run -- CMD`: exec CMD with the agent bootstrap on PYTHONPATH."""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from torchpulse.paths import agent_socket_path
from torchpulse.probes.agent.identity import generate_run_name
from torchpulse.terminal import printable

BOOTSTRAP_DIR = Path(__file__).resolve().parent / "probes" / "agent" / "bootstrap"
SHELL = "/bin/sh"
USAGE = "usage: torchpulse run [--socket PATH] [--run-name NAME] [--probes LIST] -- COMMAND [ARGS...]"
# python, python3, python3.11, python3.13t: interpreters whose options `launch` reads.
PYTHON_NAME = re.compile(r"python[0-9.]*t?")
# Options that keep the bootstrap from loading: the job runs, silently without an agent.
BOOTSTRAP_OFF = {
    "I": "isolated mode (-I) ignores PYTHONPATH",
    "E": "-E ignores PYTHONPATH",
    "S": "-S skips the site module, which loads the bootstrap",
}


def launch_env(base: Mapping[str, str], socket: str | None, run_name: str | None, probes: str | None) -> dict[str, str]:
    """The environment CMD runs in: socket, run name, bootstrap first on PYTHONPATH."""
    env = dict(base)
    # Absolute: the job may change directory (Hydra does) before its agent first connects.
    env["TORCHPULSE_SOCKET"] = str(Path(socket or agent_socket_path(base)).absolute())
    if run_name:
        env["TORCHPULSE_RUN"] = run_name
    # Shared by every process CMD starts (all torchrun ranks), used only when
    # neither TORCHPULSE_RUN nor a launcher's run id names the run.
    env.setdefault("TORCHPULSE_RUN_FALLBACK", generate_run_name())
    if probes:
        env["TORCHPULSE_PROBES"] = probes
    existing = env.get("PYTHONPATH", "")
    # An empty entry means the current directory to Python (":/lib" from `$PYTHONPATH:/lib`): kept,
    # or the job could no longer import what it imported without torchpulse.
    entries = existing.split(os.pathsep) if existing else []
    parts = [p for p in entries if not p or Path(p).resolve() != BOOTSTRAP_DIR]
    env["PYTHONPATH"] = os.pathsep.join([str(BOOTSTRAP_DIR), *parts])
    env["TORCHPULSE_BOOTSTRAP"] = "1"
    return env


def probes_error(probes: str | None) -> str | None:
    """Why `--probes` cannot be used, or None: a typo caught here, not as one log line per rank later."""
    from torchpulse.probes.agent.config import known_list, probe_names, unknown_probe_error
    from torchpulse.probes.families import FAMILY_TABLE

    if probes is None:
        return None
    names = probe_names(probes)
    if not names:
        # Not what the user meant: the agent reads an empty TORCHPULSE_PROBES as the defaults, and a
        # list of blanks (" , ") as no probe at all.
        return f"--probes names no probe (known: {known_list(FAMILY_TABLE.known)})"
    for name in names:
        if (error := unknown_probe_error(name, FAMILY_TABLE.known, option="--probes")) is not None:
            return error
    return None


def launch(
    cmd: Sequence[str], *, socket: str | None = None, run_name: str | None = None, probes: str | None = None
) -> int:
    if not cmd:
        print(USAGE, file=sys.stderr)
        return 2
    if (error := probes_error(probes)) is not None:
        print(f"torchpulse run: {printable(error)}", file=sys.stderr)
        return 2
    env = launch_env(os.environ, socket, run_name, probes)
    for flag in sorted(python_flags(cmd) & BOOTSTRAP_OFF.keys()):
        # The job must still run as asked; say why it will get no agent, or it just looks untracked.
        print(f"torchpulse: warning: the agent will not attach: {BOOTSTRAP_OFF[flag]}", file=sys.stderr)
    _restore_signals()
    try:
        try:
            os.execvpe(cmd[0], list(cmd), env)
        except OSError as exc:
            if exc.errno != errno.ENOEXEC:
                raise
            # An executable text file without a `#!` line: the shell, env, nohup and timeout (execvp)
            # run it with /bin/sh; so does `torchpulse run -- ./train.sh`.
            path = cmd[0] if os.sep in cmd[0] else shutil.which(cmd[0], path=env.get("PATH", os.defpath))
            if path is None:
                raise
            os.execve(SHELL, [SHELL, path, *cmd[1:]], env)
    except OSError as exc:
        print(f"torchpulse: cannot run {cmd[0]!r}: {exc.strerror}", file=sys.stderr)
        # The shell's convention: 127 not found, 126 found but not executable.
        return 127 if exc.errno == errno.ENOENT else 126
    return 0  # not reached: exec replaced this process


def python_flags(cmd: Sequence[str]) -> set[str]:
    """The one-letter options of a `python ...` command before its script, `-c` or `-m` (`-IS` is I and S).

    Empty for any other command; what follows the script or `-c`/`-m` belongs to the job, not Python.
    """
    flags: set[str] = set()
    if not cmd or not PYTHON_NAME.fullmatch(Path(cmd[0]).name):
        return flags
    args = iter(cmd[1:])
    for arg in args:
        if arg == "--check-hash-based-pycs":
            next(args, None)
            continue
        if not arg.startswith("-") or arg == "-" or arg.startswith("--"):
            break
        for i, char in enumerate(arg[1:], 1):
            if char in "cm":
                return flags
            if char in "WX":  # takes a value: the rest of this word, else the next one
                if i == len(arg) - 1:
                    next(args, None)
                break
            flags.add(char)
    return flags


def _restore_signals() -> None:
    """Undo the dispositions Python set for itself, as subprocess's restore_signals does.

    Python starts with SIGPIPE and SIGXFSZ ignored, and an ignored signal stays ignored
    across exec: without this, `yes | head -1` in a wrapped shell script prints
    "Broken pipe" instead of ending quietly, and a non-Python job sees EPIPE or EFBIG
    errors where it would have been stopped by the signal.
    """
    for name in ("SIGPIPE", "SIGXFSZ"):
        number = getattr(signal, name, None)
        if number is not None:
            signal.signal(number, signal.SIG_DFL)
