"""`torchpulse check` as a user at a shell meets it: pointed at a root of checkpoints, stopped with Ctrl-C."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import sigint_as_at_a_terminal
from torchpulse.checkpoints.cli import main


def _check(*argv: str, **popen: object) -> subprocess.Popen[bytes]:
    """`python -m torchpulse check ARGV` in a child with SIGINT at its default, as at a terminal."""
    proc: subprocess.Popen[bytes] = subprocess.Popen(  # type: ignore[call-overload]
        [sys.executable, "-m", "torchpulse", "check", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=sigint_as_at_a_terminal,
        **popen,
    )
    return proc


def _children(pid: int) -> list[int]:
    """Live child processes of `pid`, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def test_a_root_of_checkpoints_is_a_usage_error_not_an_incomplete_save(single_root: Path, tmp_path: Path) -> None:
    """`torchpulse check ROOT` on a directory of checkpoints exits 2 naming them, not 3 ("not committed")."""
    root = tmp_path / "ckpt"
    for step in ("step-1", "step-2"):
        shutil.copytree(single_root / "single", root / step)
    text, as_json = _check(str(root)), _check(str(root), "--format", "json")
    actual = [(p.wait(120), *p.communicate()) for p in (text, as_json)]
    line = (
        f"torchpulse check: {root}: not a checkpoint but a directory of checkpoints (step-1, step-2): "
        "check one of them\n"
    )
    assert [(2, b"", line.encode())] * 2 == actual


def test_a_directory_with_nothing_saved_beneath_it_is_still_incomplete(tmp_path: Path) -> None:
    """An empty directory, or one whose subdirectory holds no checkpoint file yet, exits 3 as before."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "started" / "step-1").mkdir(parents=True)
    (tmp_path / "started" / "step-1" / "notes.txt").write_text("x")
    assert (3, 3) == (main([str(tmp_path / "empty")]), main([str(tmp_path / "started")]))


def test_ctrl_c_mid_validation_stops_it_in_one_line_and_dies_of_sigint(single_root: Path) -> None:
    """Ctrl-C while the validator runs: "interrupted" and no traceback, death by SIGINT, no validator left."""
    proc = _check(str(single_root / "single"), "--level", "data", start_new_session=True)
    deadline = time.monotonic() + 60
    while not (validator := _children(proc.pid)):
        assert proc.poll() is None and time.monotonic() < deadline, "no validator child appeared"
        time.sleep(0.01)
    time.sleep(0.2)  # it is importing torch: about a second on this machine
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal does: the whole foreground group
    out, err = proc.communicate(timeout=60)
    assert (-signal.SIGINT, b"", b"torchpulse check: interrupted\n", False) == (
        proc.returncode,
        out,
        err,
        Path(f"/proc/{validator[0]}").exists(),
    )


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_metadata_file_given_for_its_directory_is_one_line_exit_2(
    single_root: Path, fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """PATH naming the `.metadata` file itself exits 2 with one line on stderr and nothing on stdout."""
    path = str(single_root / "single" / ".metadata")
    code = main([path, "--format", fmt])
    assert (2, "", f"torchpulse check: {path}: not a directory\n") == (code, *capsys.readouterr())
