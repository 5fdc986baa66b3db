"""run_info's command line: secrets passed as arguments never leave the process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from torchpulse.limits import SHOWN_COMMAND_CHARS
from torchpulse.probes.agent.command_line import is_sensitive, scrub, shown_command


@pytest.mark.parametrize(
    "name",
    [
        "--hf_token",
        "--hf-token",
        "--token",
        "--wandb-api-key",
        "--api_key",
        "--apikey",
        "--password",
        "--db-passwd",
        "--aws-secret-access-key",
        "--access-key",
        "--client-secret",
        "wandb.api_key",
        "logger.apiKey",
        "DB_PASSWORD",
        "HFToken",
        "--credentials",
        "--auth",
        "--private-key-file",
    ],
)
def test_secret_names(name: str) -> None:
    assert is_sensitive(name)


@pytest.mark.parametrize(
    "name",
    [
        "--max-tokens",
        "--tokenizer",
        "--key-dim",
        "--num-keys",
        "--lr",
        "--author",
        "--output-dir",
        "model.hidden_size",
        "--passes",
        "--authority",
        "--secretary",
    ],
)
def test_ordinary_names(name: str) -> None:
    assert not is_sensitive(name)


def test_values_of_secret_options_are_masked_in_every_form() -> None:
    argv = [
        "train.py",
        "--hf_token",
        "hf_abc",
        "--wandb-api-key=w123",
        "logger.api_key=k9",
        "--lr",
        "3e-4",
        "--index-url",
        "https://alice:s3cr3t@pypi.example.com/simple",
        "--token",
        "--verbose",
        "postgresql://bob:pw@db:5432/runs",
        "https://example.com/a@b",
    ]
    assert [
        "train.py",
        "--hf_token",
        "***",
        "--wandb-api-key=***",
        "logger.api_key=***",
        "--lr",
        "3e-4",
        "--index-url",
        "https://alice:***@pypi.example.com/simple",
        "--token",
        "--verbose",
        "postgresql://bob:***@db:5432/runs",
        "https://example.com/a@b",
    ] == scrub(argv)


def test_the_shown_command_is_quoted_and_bounded() -> None:
    assert "python train.py --token '***' --name 'my run'" == shown_command(
        ["python", "train.py", "--token", "t0k3n", "--name", "my run"]
    )
    assert SHOWN_COMMAND_CHARS == len(shown_command(["python", "x" * 1000]))


@pytest.mark.process
def test_the_identity_of_a_real_process_carries_the_scrubbed_command() -> None:
    code = (
        "import sys; from torchpulse.probes.agent.identity import current_identity; print(current_identity({}).command)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, "--hf_token", "hf_live_secret", "--steps", "3"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert "hf_live_secret" not in out
    assert out.strip().endswith("-c --hf_token '***' --steps 3")
