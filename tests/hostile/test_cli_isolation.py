"""`torchpulse check` validates in a forked child: a validator that crashes or is killed is exit 2 and one line.

Every case runs the real command in a child process under a timeout, since the
point is what happens when the validator's process dies.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

from tests.support import REPO, child_of, sigint_as_at_a_terminal
from torchpulse.checkpoints.model import Level
from torchpulse.checkpoints.validate import validate

DEEP_TUPLE_KEY = b"}" + b")" + b"\x85" * 300_000 + b"K\x01s"  # {((...(),)...): 1}, 300 000 deep


def _command(path: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "torchpulse", "check", str(path), *flags]


def _env() -> dict[str, str]:
    """No faulthandler: it would add its own dump of the crash to stderr."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}


def _check(path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_command(path, *flags), capture_output=True, text=True, timeout=120, cwd=REPO, env=_env())


def _with_deep_tuple_key(saved: Path, tmp_path: Path) -> Path:
    """Real metadata whose planner path for model.0.weight is a dict with a 300 000-deep tuple as its key."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    md = pickle.loads((saved / ".metadata").read_bytes())  # the test's own pristine file
    placeholder = "PLACEHOLDERX"
    md.planner_data["model.0.weight"] = ("model", placeholder)
    raw = pickle.dumps(md, protocol=2)  # no FRAME opcodes: the splice changes the length
    op = b"X" + struct.pack("<I", len(placeholder)) + placeholder.encode()
    assert 1 == raw.count(op)
    (ckpt / ".metadata").write_bytes(raw.replace(op, DEEP_TUPLE_KEY))
    return ckpt


def _timeless(result: dict[str, object]) -> dict[str, object]:
    """`result` without its duration, which differs from run to run."""
    stats = result["stats"]
    assert isinstance(stats, dict)
    return {**result, "stats": {k: v for k, v in stats.items() if k != "duration_seconds"}}


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.01)
    return False


def test_a_validator_crash_is_exit_2_and_one_line(saved_checkpoint: Path, tmp_path: Path) -> None:
    """Metadata that segfaults CPython 3.11 (hashing a 300 000-deep tuple key) reads "cannot tell", not exit 139."""
    ckpt = _with_deep_tuple_key(saved_checkpoint, tmp_path)
    proc = _check(ckpt, "--format", "json")
    expected = (
        f"torchpulse check: the validator crashed (SIGSEGV) while reading {ckpt}; "
        "the checkpoint is probably hostile or corrupt\n"
    )
    assert (2, "", expected) == (proc.returncode, proc.stdout, proc.stderr)


def test_a_pristine_checkpoint_prints_as_before(saved_checkpoint: Path) -> None:
    """Through the child, the JSON is the validator's result as `indent=2` JSON, and the text its summary."""
    as_json, text = _check(saved_checkpoint, "--format", "json"), _check(saved_checkpoint)
    printed = json.loads(as_json.stdout)
    stats = printed["stats"]
    summary = (
        rf"VALID: {re.escape(str(saved_checkpoint))} \(level data; no findings; "
        rf"{stats['tensors']} tensors, {stats['bytes']} bytes, \d+\.\d\d s\)\n"
    )
    assert (0, 0, "", "") == (as_json.returncode, text.returncode, as_json.stderr, text.stderr)
    in_process = validate(str(saved_checkpoint), Level.DATA).to_json()
    assert (json.dumps(printed, indent=2) + "\n", _timeless(in_process)) == (as_json.stdout, _timeless(printed))
    assert re.fullmatch(summary, text.stdout), text.stdout


def test_a_validator_killed_by_the_oom_killer_is_exit_2(saved_checkpoint: Path) -> None:
    """SIGKILL, as the out-of-memory killer sends it, to the validator alone: exit 2 and a message saying so."""
    cli = subprocess.Popen(
        _command(saved_checkpoint), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=_env()
    )
    try:
        os.kill(child_of(cli.pid), signal.SIGKILL)
        out, err = cli.communicate(timeout=60)
    finally:
        cli.kill()
        cli.wait()
    assert (2, "", True, 1) == (
        cli.returncode,
        out,
        "the validator was killed (SIGKILL" in err,
        len(err.splitlines()),
    ), err


def test_ctrl_c_in_the_cli_leaves_no_validator_running(saved_checkpoint: Path) -> None:
    """SIGINT to the CLI alone (the validator ignores it): the CLI kills its validator before it exits."""
    cli = subprocess.Popen(
        _command(saved_checkpoint),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=REPO,
        env=_env(),
        preexec_fn=sigint_as_at_a_terminal,
    )
    try:
        validator = child_of(cli.pid)
        cli.send_signal(signal.SIGINT)
        cli.wait(timeout=60)
    finally:
        cli.kill()
        cli.wait()
    assert _gone(validator)
