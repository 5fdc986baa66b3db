"""`torchpulse attach PID`: inject the agent into a running Python >= 3.14 process.

Python 3.14 added `sys.remote_exec(pid, script)` (PEP 768): the target runs
the script at its next safe point in the main thread. It needs the same
Python minor version here and in the target, ptrace permission on the target
(same user and `kernel.yama.ptrace_scope` <= 1, or CAP_SYS_PTRACE), and
torchpulse importable from the target's interpreter.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from torchpulse.paths import agent_socket_path

PACKAGE_PARENT = Path(__file__).resolve().parent.parent

# Inside a function: the script may run in the target's __main__ namespace, and must not rebind its names.
SCRIPT = """\
def _torchpulse_remote_attach():
    import os, sys
    try:
        os.unlink({path!r})  # read already; nothing else needs it
    except OSError:
        pass
    if {parent!r} not in sys.path:
        sys.path.append({parent!r})
    try:
        import torchpulse
        torchpulse.attach(socket={socket!r}{run})
    except Exception as exc:
        sys.stderr.write(f"torchpulse: remote attach failed: {{exc!r}}\\n")
try:
    _torchpulse_remote_attach()
finally:
    del _torchpulse_remote_attach
"""


def write_script(socket: str | None, run_name: str | None) -> str:
    """The file the target runs: attaches the agent, and deletes itself first."""
    # The target reads the file later, at its next safe point: it must outlive this command.
    fd, path = tempfile.mkstemp(prefix="torchpulse-attach-", suffix=".py")
    # Absolute: the target resolves it from its own working directory.
    socket_path = str(Path(socket).absolute()) if socket else str(agent_socket_path())
    script = SCRIPT.format(
        path=path, parent=str(PACKAGE_PARENT), socket=socket_path, run=f", run={run_name!r}" if run_name else ""
    )
    with os.fdopen(fd, "w") as handle:
        handle.write(script)
    Path(path).chmod(0o644)
    return path


def attach_pid(pid: int, socket: str | None = None, run_name: str | None = None) -> int:
    remote_exec = getattr(sys, "remote_exec", None)
    if remote_exec is None:
        print(
            f"torchpulse: attach needs Python >= 3.14 (sys.remote_exec); this is "
            f"{sys.version_info.major}.{sys.version_info.minor}. Start the job under "
            "`torchpulse run -- ...` or call torchpulse.attach() instead.",
            file=sys.stderr,
        )
        return 2
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        print(f"torchpulse: no process {pid}", file=sys.stderr)
        return 2
    except PermissionError:
        print(f"torchpulse: process {pid} belongs to another user; run this as that user (or root)", file=sys.stderr)
        return 2
    path = write_script(socket, run_name)
    try:
        remote_exec(pid, path)
    except (OSError, RuntimeError) as exc:
        Path(path).unlink(missing_ok=True)
        print(f"torchpulse: could not inject into {pid}: {exc}", file=sys.stderr)
        return 1
    print(
        f"torchpulse: agent injection scheduled in process {pid} (script {path}); it attaches at the "
        "process's next safe point and shows up in `torchpulse status` at its next optimizer step"
    )
    return 0
