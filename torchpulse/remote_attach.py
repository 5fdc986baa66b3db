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

SCRIPT = """\
import sys
if {parent!r} not in sys.path:
    sys.path.append({parent!r})
try:
    import torchpulse
    torchpulse.attach(socket={socket!r}{run})
except Exception as exc:
    sys.stderr.write(f"torchpulse: remote attach failed: {{exc!r}}\\n")
"""


def attach_pid(pid: int, socket: str | None = None, run_name: str | None = None) -> int:
    remote_exec = getattr(sys, "remote_exec", None)
    if remote_exec is None:
        print(f"torchpulse: attach needs Python >= 3.14 (sys.remote_exec); this is "
              f"{sys.version_info.major}.{sys.version_info.minor}. Start the job under "
              "`torchpulse run -- ...` or call torchpulse.attach() instead.", file=sys.stderr)
        return 2
    try:
        os.kill(pid, 0)
    except OSError as exc:
        print(f"torchpulse: no process {pid}: {exc.strerror}", file=sys.stderr)
        return 2
    script = SCRIPT.format(parent=str(PACKAGE_PARENT), socket=socket or str(agent_socket_path()),
                           run=f", run={run_name!r}" if run_name else "")
    # The target reads the file later, at its next safe point: it must outlive this command.
    fd, path = tempfile.mkstemp(prefix="torchpulse-attach-", suffix=".py")
    with os.fdopen(fd, "w") as handle:
        handle.write(script)
    Path(path).chmod(0o644)
    try:
        remote_exec(pid, path)
    except (OSError, RuntimeError) as exc:
        print(f"torchpulse: could not inject into {pid}: {exc}", file=sys.stderr)
        return 1
    print(f"torchpulse: agent injection scheduled in process {pid} (script {path}); it attaches at the "
          "process's next safe point and shows up in `torchpulse status` at its next optimizer step")
    return 0
