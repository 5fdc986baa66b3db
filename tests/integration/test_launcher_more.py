"""`torchpulse run` around the commands jobs really run: other interpreters, shells, pipelines, scripts."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.integration.test_launcher import _working_python
from tests.support import REPO


def _run(*cmd: str, env: dict[str, str] | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torchpulse", "run", "--", *cmd],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


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
