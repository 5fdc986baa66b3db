"""`torchpulse run -- CMD` leaves the job as it was: exit status, imports, sitecustomize, socket, agent; around the
commands jobs really run: other interpreters, shells, pipelines, scripts."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support import REPO, DaemonProcess, select, wait_for
from torchpulse import cli
from torchpulse.launcher import BOOTSTRAP_DIR

TRAIN = textwrap.dedent("""
    import os, sys
    if len(sys.argv) > 1:
        os.chdir(sys.argv[1])
    import torch
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
    """)


def _run(
    *cmd: str, env: dict[str, str] | None = None, cwd: Path = REPO, options: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torchpulse", "run", *options, "--", *cmd],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _steps(daemon: DaemonProcess, run: str) -> list[float]:
    return list(select(daemon.scrape(), "torchpulse_optimizer_steps_total", run=run).values())


@pytest.mark.process
def test_exit_status_and_death_by_signal_are_the_commands_own() -> None:
    """exec, not a wrapper: the status is the command's, and a signal kills the process itself."""
    assert 7 == _run("sh", "-c", "exit 7").returncode
    assert -signal.SIGTERM == _run("sh", "-c", "kill -TERM $$").returncode


@pytest.mark.process
def test_the_command_starts_with_the_signal_dispositions_it_would_have_had() -> None:
    """Python ignores SIGPIPE and SIGXFSZ for itself; the exec'd job must not inherit that (`yes | head`)."""
    script = "yes | head -n 1; grep SigIgn /proc/self/status"
    direct = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=60)
    wrapped = _run("sh", "-c", script)
    assert (0, direct.stdout, "") == (wrapped.returncode, wrapped.stdout, wrapped.stderr)


@pytest.mark.process
def test_a_command_that_cannot_run_gets_the_shells_statuses(tmp_path: Path) -> None:
    """Not found is 127 and found but not executable is 126, each with one line on stderr."""
    missing = _run(str(tmp_path / "no-such-command"))
    not_executable = tmp_path / "data.txt"
    not_executable.write_text("x\n")
    denied = _run(str(not_executable))
    assert (127, 126) == (missing.returncode, denied.returncode)
    assert (["No such file or directory"], ["Permission denied"]) == (
        [line.rsplit(": ", 1)[1] for line in missing.stderr.splitlines()],
        [line.rsplit(": ", 1)[1] for line in denied.stderr.splitlines()],
    )


@pytest.mark.process
def test_run_without_a_command_prints_a_usage_that_names_every_option() -> None:
    """`torchpulse run` alone exits 2 with one usage line listing each of the subcommand's options."""
    run_parser = cli._parser()._subparsers._group_actions[0].choices["run"]
    options = {a.option_strings[-1] for a in run_parser._actions if a.option_strings and a.dest != "help"}
    result = _run()
    usage = result.stderr.splitlines()
    assert (2, 1) == (result.returncode, len(usage))
    assert set() == {option for option in options if f"[{option} " not in usage[0]}


@pytest.mark.process
@pytest.mark.parametrize("by_name", [False, True])
def test_a_script_without_a_shebang_runs_under_sh_as_with_env(tmp_path: Path, by_name: bool) -> None:
    """An executable script with no `#!` line (by path or found on PATH): env runs it with /bin/sh, so does run."""
    script = tmp_path / "train.sh"
    script.write_text('echo "args: $*"\nexit 3\n')
    script.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}{os.pathsep}{os.environ.get('PATH', os.defpath)}")
    command = script.name if by_name else str(script)
    direct = subprocess.run(["env", command, "a b", "c"], env=env, capture_output=True, text=True, timeout=60)
    wrapped = _run(command, "a b", "c", env=env)
    assert [(3, "args: a b c\n", "")] * 2 == [(r.returncode, r.stdout, r.stderr) for r in (direct, wrapped)]


@pytest.mark.process
@pytest.mark.parametrize("pythonpath", [":{repo}", "{repo}:"])
def test_an_empty_pythonpath_entry_still_means_the_working_directory(tmp_path: Path, pythonpath: str) -> None:
    """`PYTHONPATH=$PYTHONPATH:/lib` with PYTHONPATH unset puts the cwd on sys.path; the job keeps importing from it."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    (workdir / "local_helpers.py").write_text("VALUE = 42\n")
    script = tmp_path / "job.py"
    script.write_text("import local_helpers\nprint(local_helpers.VALUE)\n")
    env = dict(os.environ, PYTHONPATH=pythonpath.format(repo=REPO))
    direct = subprocess.run(
        [sys.executable, str(script)], cwd=workdir, env=env, capture_output=True, text=True, timeout=60
    )
    wrapped = _run(sys.executable, str(script), env=env, cwd=workdir)
    assert [(0, "42\n", "")] * 2 == [(r.returncode, r.stdout, r.stderr) for r in (direct, wrapped)]


def test_a_relative_socket_is_found_after_the_job_changes_directory(daemon: DaemonProcess, tmp_path: Path) -> None:
    """`--socket agent.sock` names the socket where `torchpulse run` started, not where the job moved to."""
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    result = _run(
        sys.executable,
        str(script),
        "/",
        env=daemon.env(),
        cwd=daemon.socket_path.parent,
        options=("--socket", daemon.socket_path.name, "--run-name", "moved"),
    )
    assert (0, "") == (result.returncode, result.stderr)
    wait_for(lambda: [3.0] == _steps(daemon, "moved"))


def test_a_sitecustomize_that_imports_torch_still_gets_the_agent(daemon: DaemonProcess, tmp_path: Path) -> None:
    """The user's sitecustomize imported torch before the bootstrap could wait for it: the agent attaches anyway."""
    site = tmp_path / "usersite"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import torch\n")
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    result = _run(
        sys.executable,
        str(script),
        env=daemon.env(PYTHONPATH=f"{site}{os.pathsep}{REPO}"),
        options=("--run-name", "site-torch"),
    )
    assert (0, "") == (result.returncode, result.stderr)
    wait_for(lambda: [3.0] == _steps(daemon, "site-torch"))


def test_a_job_that_looks_for_torch_before_importing_it_still_gets_the_agent(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    """`importlib.util.find_spec("torch")` (how transformers and accelerate check for torch) imports
    nothing: the agent still attaches at the import that follows."""
    script = tmp_path / "train.py"
    script.write_text("import importlib.util\nassert importlib.util.find_spec('torch') is not None\n" + TRAIN)
    result = _run(sys.executable, str(script), env=daemon.env(), options=("--run-name", "looked-first"))
    assert (0, "") == (result.returncode, result.stderr)
    wait_for(lambda: [3.0] == _steps(daemon, "looked-first"))


def _working_python(version: str) -> str | None:
    """A Python `version` interpreter that runs (on PATH, or one pyenv installed), or None."""
    pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    installed = sorted(str(p) for p in pyenv_root.glob(f"versions/{version}.*/bin/python{version}"))
    candidates = [shutil.which(f"python{version}"), *installed]
    for candidate in filter(None, candidates):
        if subprocess.run([candidate, "-c", "pass"], capture_output=True, timeout=60).returncode == 0:
            return candidate
    return None


@pytest.mark.process
def test_an_old_python3_the_job_runs_starts_silently_and_runs_the_users_sitecustomize(tmp_path: Path) -> None:
    """Python 3.6 (RHEL 8's /usr/bin/python3) cannot import torchpulse, but must not choke on the bootstrap."""
    python36 = _working_python("3.6")
    if python36 is None:
        pytest.skip("no working Python 3.6 interpreter")
    site = tmp_path / "usersite"
    site.mkdir()
    # Silent in `torchpulse run` itself, which the same PYTHONPATH applies to.
    (site / "sitecustomize.py").write_text(
        "import sys\nif sys.version_info < (3, 7):\n    sys.stderr.write('user sitecustomize\\n')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO)]))
    code = "import json; print(json.dumps({'ok': 1}))"
    direct = subprocess.run([python36, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    wrapped = _run(python36, "-c", code, env=env)
    assert [(0, '{"ok": 1}\n', "user sitecustomize\n")] * 2 == [
        (r.returncode, r.stdout, r.stderr) for r in (direct, wrapped)
    ]


@pytest.mark.process
def test_two_bootstraps_on_pythonpath_chain_once_to_the_users_sitecustomize(tmp_path: Path) -> None:
    """A second torchpulse install's bootstrap on PYTHONPATH (nested runs): no endless chain, the user's runs once."""
    other = tmp_path / "other-install" / "bootstrap"
    shutil.copytree(BOOTSTRAP_DIR, other, ignore=shutil.ignore_patterns("__pycache__"))
    site = tmp_path / "usersite"
    site.mkdir()
    # Silent in the `torchpulse run` process itself, which the same PYTHONPATH applies to.
    (site / "sitecustomize.py").write_text(
        "import os, sys\nif os.environ.get('TORCHPULSE_BOOTSTRAP'):\n    sys.stderr.write('user sitecustomize\\n')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(other), str(site), str(REPO)]))
    code = "import sys; print(sum(type(f).__name__ == '_AttachAfterTorch' for f in sys.meta_path))"
    result = _run(sys.executable, "-c", code, env=env)
    assert (0, "1\n", "user sitecustomize\n") == (result.returncode, result.stdout, result.stderr)


def test_the_children_that_get_no_agent_are_named_by_the_modules_torch_defines_them_in() -> None:
    """The bootstrap skips a multiprocessing child by its target's module: torch moving DataLoader's worker
    loop or DCP's saver process elsewhere would give those children an agent again."""
    import ast

    from torch.distributed.checkpoint._async_process_executor import _AsyncCheckpointProcess
    from torch.utils.data._utils.worker import _worker_loop

    source = (BOOTSTRAP_DIR / "sitecustomize.py").read_text()
    (skipped,) = [
        ast.literal_eval(node.value)
        for node in ast.parse(source).body
        if isinstance(node, ast.Assign)
        and [getattr(t, "id", None) for t in node.targets] == ["NON_TRAINING_TARGET_MODULES"]
    ]
    for target in (_worker_loop, _AsyncCheckpointProcess._checkpointing_subprocess):
        assert target.__module__ in skipped


@pytest.mark.process
@pytest.mark.parametrize("with_user_sitecustomize", [False, True])
def test_a_python2_process_the_job_runs_is_left_as_it_was(tmp_path: Path, with_user_sitecustomize: bool) -> None:
    """Python 2 (a tool's `/usr/bin/python` on CentOS 7) cannot parse Python 3 syntax in the bootstrap: it
    printed "'import sitecustomize' failed" and skipped the user's sitecustomize; now it runs as without."""
    python2 = _working_python("2.7")
    if python2 is None:
        pytest.skip("no working Python 2.7 interpreter")
    site = tmp_path / "usersite"
    site.mkdir()
    if with_user_sitecustomize:
        # Silent in `torchpulse run` itself, which the same PYTHONPATH applies to.
        (site / "sitecustomize.py").write_text(
            textwrap.dedent("""
            import sys
            if sys.version_info[0] == 2:
                sys.stderr.write("user sitecustomize\\n")
                sys.path.append("/added/by/user")
            """)
        )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO)]))
    code = "import sys; print([p for p in sys.path if p.startswith('/added')])"
    direct = subprocess.run([python2, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    wrapped = _run(python2, "-c", code, env=env)
    expected = (0, "['/added/by/user']\n", "user sitecustomize\n") if with_user_sitecustomize else (0, "[]\n", "")
    assert [expected] * 2 == [(r.returncode, r.stdout, r.stderr) for r in (direct, wrapped)]


REPORT = (
    "import os, sys, torch\nfrom torchpulse.probes.attach import current_agent\n"
    "print(sys.argv[1], current_agent() is not None, flush=True)\n"
)


@pytest.mark.process
def test_every_python_a_shell_pipeline_starts_gets_one_agent(tmp_path: Path) -> None:
    """`python -m`, a `#!/usr/bin/env python3` script run directly and `-c`, joined by a shell pipe: each
    process that imports torch has its agent, output and exit status pass through."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "report.py").write_text(REPORT)
    script = tmp_path / "report.py"
    script.write_text("#!/usr/bin/env python3\n" + REPORT)
    script.chmod(0o755)
    python_dir = Path(sys.executable).parent
    env = dict(
        os.environ,
        PATH=f"{python_dir}{os.pathsep}{os.environ.get('PATH', os.defpath)}",
        PYTHONPATH=str(REPO),
        TORCHPULSE_SOCKET=str(tmp_path / "no-daemon.sock"),
    )
    pipeline = (
        "{ python -m pkg.report module; ./report.py shebang; }"
        ' | python -c \'import sys; exec(open("report.py").read()); print(sys.stdin.read(), end="")\' piped;'
        " exit 3"
    )
    result = _run("sh", "-c", pipeline, env=env, cwd=tmp_path)
    assert (3, "piped True\nmodule True\nshebang True\n", "") == (result.returncode, result.stdout, result.stderr)
