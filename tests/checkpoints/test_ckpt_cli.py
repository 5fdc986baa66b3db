"""The `torchpulse check` entry point and the worker process the daemon will use; `torchpulse check` as a user at a
shell meets it: pointed at a root of checkpoints, stopped with Ctrl-C."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from ckpt_corrupt import entry, load_md, save_md
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from tests.support import sigint_as_at_a_terminal
from torchpulse.checkpoints.cli import main
from torchpulse.checkpoints.model import Level, Status
from torchpulse.checkpoints.worker import Limits, validate_in_worker


def test_valid_checkpoint_json(single_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--format json prints the documented object and exits 0 for a valid checkpoint."""
    code = main([str(single_root / "single"), "--level", "metadata", "--format", "json"])
    out = json.loads(capsys.readouterr().out)
    expected = (0, "valid", "metadata", [], True)
    actual = (code, out["status"], out["level"], out["findings"], "duration_seconds" in out["stats"])
    assert expected == actual


def test_invalid_checkpoint_text(single_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An invalid checkpoint exits 1; the text output groups findings under their rule."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(single_root / "single", ckpt)
    (ckpt / "__0_0.distcp").unlink()
    code = main([str(ckpt), "--level", "metadata"])
    lines = capsys.readouterr().out.splitlines()
    assert (1, True, True) == (
        code,
        lines[0].startswith("INVALID:"),
        lines[1].startswith("  TP-CKPT-005"),
    )


def test_incomplete_and_usage_errors(tmp_path: Path) -> None:
    """No .metadata exits 3; a missing directory or a bad flag exits 2."""
    (tmp_path / "__0_0.distcp").write_bytes(b"x")
    codes = (
        main([str(tmp_path)]),
        main([str(tmp_path / "nope")]),
        main([str(tmp_path), "--level", "bogus"]),
    )
    assert (3, 2, 2) == codes


def test_module_entry_point(single_root: Path) -> None:
    """`python -m torchpulse.checkpoints.cli PATH` runs the check and exits 0."""
    proc = subprocess.run(
        [sys.executable, "-m", "torchpulse.checkpoints.cli", str(single_root / "flat")],
        capture_output=True,
        text=True,
    )
    assert (0, "VALID:") == (proc.returncode, proc.stdout[:6])


def test_worker_validates_in_a_child_process(single_root: Path) -> None:
    """The daemon's entry point returns the same result object, parsed from JSON."""
    result = validate_in_worker(single_root / "single", Level.DATA, Limits(drop_cache=True))
    assert (Status.VALID, Level.DATA) == (result.status, result.level)


def test_worker_timeout_is_an_error_result(single_root: Path) -> None:
    """A worker over its time limit is killed and reported as status error."""
    result = validate_in_worker(single_root / "single", Level.DATA, Limits(timeout_seconds=0.01))
    assert (Status.ERROR, ["TP-CKPT-000"]) == (result.status, [f.rule for f in result.findings])


def test_worker_memory_limit_is_an_error_result(single_root: Path) -> None:
    """A worker that cannot even import torch under its memory limit reports an error."""
    result = validate_in_worker(single_root / "single", Level.DATA, Limits(memory_bytes=64 << 20))
    assert Status.ERROR == result.status


def _run_cli(*argv: str) -> subprocess.CompletedProcess[bytes]:
    """The CLI in a child with a UTF-8 stdout, as on a terminal (capsys would hide encoding errors)."""
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    return subprocess.run(
        [sys.executable, "-m", "torchpulse", "check", *argv], capture_output=True, env=env, timeout=120
    )


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
    for process in Path("/proc").iterdir():
        if not process.name.isdigit():
            continue
        try:
            fields = (process / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(process.name))
    return found


def test_hostile_names_are_escaped_in_text_and_json(single_root: Path, tmp_path: Path) -> None:
    """File and key names carrying escape sequences or non-UTF-8 bytes neither reach the terminal raw nor crash it."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(single_root / "single", ckpt)
    evil = b"\x1b]0;owned\x07\x1b[2J\xe2\x80\xae\xff.distcp"  # title, clear screen, right-to-left override, not UTF-8
    shutil.copy(ckpt / "__0_0.distcp", os.fsencode(ckpt) + b"/" + evil)
    text, as_json = (
        _run_cli(str(ckpt), "--level", "metadata"),
        _run_cli(str(ckpt), "--level", "metadata", "--format", "json"),
    )
    subjects = [f["subject"] for f in json.loads(as_json.stdout)["findings"]]
    assert (0, 0, [os.fsdecode(evil)]) == (text.returncode, as_json.returncode, subjects), text.stderr
    raw = text.stdout + as_json.stdout
    assert (False, False, False) == (b"\x1b" in raw, b"\x07" in raw, "\u202e".encode() in raw)
    assert b"\\x1b]0;owned\\x07\\x1b[2J\\u202e\\udcff.distcp" in text.stdout


def test_a_validator_failure_is_exit_2_without_a_traceback(single_root: Path, tmp_path: Path) -> None:
    """Whatever goes wrong inside the validator reads "cannot tell" (2), never "invalid" (1) and a traceback.

    The trigger: a `step` saved as a bytes item holding a 2040-bit int (`float()` of it overflows in a rule).
    """
    ckpt = tmp_path / "ckpt"
    shutil.copytree(single_root / "single", ckpt)
    md = load_md(ckpt)
    key = "optim.state.0.weight.step"
    index, _ = entry(md, key)
    del md.storage_data[index]
    md.state_dict_metadata[key] = BytesStorageMetadata()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", b"\x80\x02\x8a\xff" + b"\xff" * 254 + b"\x7f.")
    data = ckpt / "__0_0.distcp"
    md.storage_data[MetadataIndex(key)] = _StorageInfo(data.name, data.stat().st_size, len(buf.getvalue()))
    with open(data, "ab") as f:
        f.write(buf.getvalue())
    save_md(ckpt, md)
    proc = _run_cli(str(ckpt), "--format", "json")
    assert b"Traceback" not in proc.stderr, proc.stderr[-2000:]
    if proc.returncode == 2:
        assert (b"", 1) == (proc.stdout, len(proc.stderr.splitlines()))
    else:  # once the rule copes with it: a finding, with the whole JSON result
        assert (1, "invalid") == (proc.returncode, json.loads(proc.stdout)["status"])


def test_text_summary_counts_findings_that_were_not_listed() -> None:
    """Past the per-rule cap the summary line and the rule's "(N)" give the true number, not the listed one."""
    from torchpulse.checkpoints.cli import render_text
    from torchpulse.checkpoints.model import Finding, Severity, ValidationResult
    from torchpulse.checkpoints.validate import MAX_FINDINGS_PER_RULE, capped

    findings = [
        Finding("TP-CKPT-007", Severity.ERROR, f"w.{i}", "chunk without a storage entry")
        for i in range(MAX_FINDINGS_PER_RULE + 250)
    ]
    listed, counts = capped(findings)
    result = ValidationResult("/ckpt", Status.INVALID, Level.METADATA, tuple(listed), {}, counts)
    lines = render_text(result).splitlines()
    total = MAX_FINDINGS_PER_RULE + 250
    assert (f"{total} errors;" in lines[0], lines[1].endswith(f"({total})"), lines[-1].strip()) == (
        True,
        True,
        "error   ... and 250 more findings of this rule omitted",
    )


def test_a_reader_that_leaves_early_gets_no_traceback(single_root: Path) -> None:
    """`torchpulse check DIR --format json | head -c 0`: no BrokenPipeError traceback, the shell's 141."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torchpulse",
                "check",
                str(single_root / "single"),
                "--level",
                "metadata",
                "--format",
                "json",
            ],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write)
    assert (141, "") == (proc.returncode, proc.stderr)


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
