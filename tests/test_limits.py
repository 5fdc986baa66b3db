"""`torchpulse/limits.py` is the one list of bounds: each says why in one line, and no module keeps its own."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from torchpulse import limits

PACKAGE = Path(limits.__file__).parent
BOUND_NAME = re.compile(r"^(MAX|MIN)_[A-Z0-9_]+$|^[A-Z0-9_]+_TIMEOUT$")
# Named like bounds but not ones this project chose, each with why it stays where it is.
ELSEWHERE = {
    "paths.MAX_SOCKET_PATH_BYTES": "the kernel's sun_path size, not a bound of ours",
    "probes.attach.MIN_TORCH": "the oldest torch supported, a version fact",
    "daemon.control.MAX_STEP": "the largest step a float counter holds exactly, a fact of doubles",
    "daemon.control.MIN_TRACE_LEAD_STEPS": "how far ahead a synchronised trace is planned, not a bound",
    "daemon.control.MAX_REPORTED_RATE": "a step rate above this is an agent's clock gone wrong, not a bound",
    "daemon.checkpoints.sweeps.MAX_SWEEP_INTERVAL": "the sweep's cadence",
    "daemon.checkpoints.watcher.INOTIFY_TIMEOUT": "how often the inotify thread looks up from its read",
    "daemon.checkpoints.watcher.JOIN_TIMEOUT": "how long a stopping watcher waits for its threads",
}
# The checkpoint validator (`torchpulse.checkpoints`) is a tool of its own, run by the daemon's worker and by
# `torchpulse-ckpt`; its bounds are documented with its rules.
OWN_BOUNDS = ("checkpoints.",)


def _module_constants() -> dict[str, int]:
    found: dict[str, int] = {}
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        if module == "limits" or module.startswith(OWN_BOUNDS):
            continue
        for node in ast.parse(path.read_text()).body:
            targets = [node.target] if isinstance(node, ast.AnnAssign) else getattr(node, "targets", [])
            for target in targets:
                if isinstance(target, ast.Name) and BOUND_NAME.match(target.id):
                    found[f"{module}.{target.id}"] = node.lineno
    return found


def test_no_module_keeps_a_bound_of_its_own() -> None:
    assert {} == {name: line for name, line in _module_constants().items() if name not in ELSEWHERE}
    assert [] == sorted(set(ELSEWHERE) - set(_module_constants())), "gone: take it out of ELSEWHERE"


def test_each_bound_says_why_in_one_line() -> None:
    body = ast.parse(Path(limits.__file__).read_text()).body
    bounds = [
        (i, node.target.id)
        for i, node in enumerate(body)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    ]
    assert len(bounds) > 40
    for i, name in bounds:
        why = body[i + 1] if i + 1 < len(body) else None
        assert isinstance(why, ast.Expr) and isinstance(why.value, ast.Constant), f"{name} says no why"
        text = why.value.value
        assert isinstance(text, str) and text.strip() and "\n" not in text, f"{name}: one line of why"
