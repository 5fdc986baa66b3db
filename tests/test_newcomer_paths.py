"""What a newcomer meets at the shell on the first day: the mistakes are answered in one clear line.

Real `python -m torchpulse` processes, no mocks: a daemon that is not there, `--version`, and
`torchpulse check` pointed at a directory that holds no checkpoint.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchpulse import __version__
from torchpulse.paths import agent_socket_path


def _torchpulse(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "TORCHPULSE_SOCKET"}
    return subprocess.run(
        [sys.executable, "-m", "torchpulse", *argv],
        capture_output=True,
        text=True,
        env={**base, **(env or {})},
        timeout=120,
        check=False,
    )


@pytest.mark.process
@pytest.mark.parametrize("command", [["status"], ["status", "--json"], ["ctl", "status", "--run", "x"]])
def test_no_daemon_at_the_socket_given_says_where_it_came_from(tmp_path: Path, command: list[str]) -> None:
    """`--socket` naming a path where nothing listens: status 1, one line naming the flag, nothing on stdout."""
    path = tmp_path / "agent.sock"
    proc = _torchpulse(*command, "--socket", str(path))
    assert (
        1,
        "",
        [
            f"torchpulse: no daemon at {path}: No such file or directory (the path given with "
            "--socket; is `torchpulse daemon --socket PATH` running?)"
        ],
    ) == (proc.returncode, proc.stdout, proc.stderr.splitlines())


@pytest.mark.process
def test_no_daemon_at_the_environments_socket_names_the_variable(tmp_path: Path) -> None:
    """TORCHPULSE_SOCKET naming a path where nothing listens: the line says the path came from it."""
    path = tmp_path / "agent.sock"
    proc = _torchpulse("status", env={"TORCHPULSE_SOCKET": str(path)})
    assert (
        1,
        "",
        [
            f"torchpulse: no daemon at {path}: No such file or directory (from TORCHPULSE_SOCKET; "
            "is a daemon listening there?)"
        ],
    ) == (proc.returncode, proc.stdout, proc.stderr.splitlines())


@pytest.mark.process
def test_no_daemon_at_the_default_socket_says_how_to_name_another(tmp_path: Path) -> None:
    """No setting and no daemon: the line tells how to start one or where to point the client."""
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    if agent_socket_path({**os.environ, **env}).exists():
        pytest.skip("a daemon's socket exists at the default path on this machine")
    proc = _torchpulse("status", env=env)
    lines = proc.stderr.splitlines()
    assert (1, "", 1, True, True) == (
        proc.returncode,
        proc.stdout,
        len(lines),
        lines[0].startswith("torchpulse: no daemon at "),
        lines[0].endswith(
            "(the default path; start `torchpulse daemon`, or name another daemon's socket "
            "with --socket PATH or TORCHPULSE_SOCKET)"
        ),
    )


@pytest.mark.process
def test_version() -> None:
    """`torchpulse --version` prints the version the daemon reports in `torchpulse status`."""
    proc = _torchpulse("--version")
    assert (0, f"torchpulse {__version__}\n", "") == (proc.returncode, proc.stdout, proc.stderr)


@pytest.mark.process
@pytest.mark.parametrize("fmt", ["text", "json"])
def test_check_on_a_directory_of_torch_save_files_is_a_usage_error(tmp_path: Path, fmt: str) -> None:
    """A Trainer-style directory (`pytorch_model.bin`, `optimizer.pt`) is no DCP save that has not committed:
    exit 2 with one line on stderr, not INCOMPLETE and exit 3."""
    ckpt = tmp_path / "checkpoint-500"
    ckpt.mkdir()
    for name in ("pytorch_model.bin", "optimizer.pt", "config.json"):
        (ckpt / name).write_bytes(b"not a DCP file")
    proc = _torchpulse("check", str(ckpt), "--format", fmt)
    assert (
        2,
        "",
        [
            f"torchpulse check: {ckpt}: not a DCP or safetensors checkpoint: 3 files, no .metadata, "
            ".distcp or .safetensors among them (torch.save files such as .pt, .bin or .ckpt are not "
            "checked)"
        ],
    ) == (proc.returncode, proc.stdout, proc.stderr.splitlines())


@pytest.mark.process
def test_check_still_calls_an_empty_directory_and_shards_without_metadata_incomplete(tmp_path: Path) -> None:
    """An empty directory (a save that made only its directory) and data files without `.metadata` exit 3."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "__0_0.distcp").write_bytes(b"x")
    (tmp_path / "shards" / "notes.txt").write_text("x")
    codes = [_torchpulse("check", str(tmp_path / name)) for name in ("empty", "shards")]
    assert [(3, True), (3, True)] == [(p.returncode, p.stdout.startswith("INCOMPLETE: ")) for p in codes]


@pytest.mark.process
@pytest.mark.parametrize(
    ("probes", "error"),
    [
        (
            "optimizer,optimzer",
            "unknown probe 'optimzer' in --probes (known: autograd, checkpoint, compile, cudagraphs, optimizer)",
        ),
        (" , ", "--probes names no probe (known: autograd, checkpoint, compile, cudagraphs, optimizer)"),
    ],
)
def test_run_refuses_a_probe_list_it_cannot_use_before_the_job_starts(tmp_path: Path, probes: str, error: str) -> None:
    """A misspelt probe would otherwise be skipped with one log line per rank after the job started, and an
    empty list would quietly mean every probe: exit 2, one line, and the command never runs."""
    marker = tmp_path / "ran"
    proc = _torchpulse("run", "--probes", probes, "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')")
    assert (2, "", [f"torchpulse run: {error}"], False) == (
        proc.returncode,
        proc.stdout,
        proc.stderr.splitlines(),
        marker.exists(),
    )


@pytest.mark.process
def test_run_accepts_a_spaced_probe_list(tmp_path: Path) -> None:
    """`--probes "optimizer, autograd"` is what the agent itself accepts: the job runs with exactly those."""
    code = "import os; print(os.environ['TORCHPULSE_PROBES'])"
    proc = _torchpulse(
        "run",
        "--socket",
        str(tmp_path / "none.sock"),
        "--probes",
        "optimizer, autograd",
        "--",
        sys.executable,
        "-c",
        code,
    )
    assert (0, "optimizer, autograd\n") == (proc.returncode, proc.stdout)
