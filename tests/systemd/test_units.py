"""The unit files, sysusers/tmpfiles snippets and sample config, checked by systemd's own tools."""

from __future__ import annotations

import re
import shutil
import stat
import subprocess
import tomllib
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

UNITS = Path(__file__).resolve().parents[2] / "systemd"
SERVICE = UNITS / "torchpulse.service"
SOCKET = UNITS / "torchpulse.socket"
INSTALLED_BINARY = "/usr/local/bin/torchpulse"
MAX_EXPOSURE = 2.5

Directives = dict[tuple[str, str], list[str]]


def _directives(path: Path) -> Directives:
    """Parse a unit file into (section, key) -> values; keys may repeat."""
    parsed: Directives = defaultdict(list)
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        parsed[(section, key.strip())].append(value.strip())
    return parsed


def _installable_copy(tmp_path: Path) -> Path:
    """Copy both units into tmp_path with ExecStart pointing at a binary that exists here."""
    binary = tmp_path / "bin" / "torchpulse"
    binary.parent.mkdir()
    binary.write_text("#!/bin/sh\nexit 0\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    units = tmp_path / "units"
    units.mkdir()
    service = SERVICE.read_text()
    assert INSTALLED_BINARY in service
    (units / SERVICE.name).write_text(service.replace(INSTALLED_BINARY, str(binary)))
    shutil.copy(SOCKET, units / SOCKET.name)
    return units


@pytest.mark.process
def test_systemd_analyze_verify_is_silent(tmp_path: Path, require_tool: Callable[[str], str]) -> None:
    """systemd-analyze verify accepts both units without a single warning."""
    analyze = require_tool("systemd-analyze")
    units = _installable_copy(tmp_path)

    result = subprocess.run(
        [analyze, "verify", str(units / SERVICE.name), str(units / SOCKET.name)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


@pytest.mark.process
def test_security_exposure_is_at_most_2_5(tmp_path: Path, require_tool: Callable[[str], str]) -> None:
    """systemd-analyze security rates the service's exposure at or below 2.5."""
    analyze = require_tool("systemd-analyze")
    units = _installable_copy(tmp_path)

    result = subprocess.run(
        [analyze, "security", "--offline=yes", "--no-pager", str(units / SERVICE.name)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

    match = re.search(r"Overall exposure level for torchpulse\.service: ([0-9.]+)", result.stdout)
    assert match is not None, result.stdout + result.stderr
    exposure = float(match.group(1))
    print(f"systemd-analyze security exposure: {exposure}")
    assert exposure <= MAX_EXPOSURE, result.stdout


@pytest.mark.process
def test_sysusers_and_tmpfiles_create_what_the_units_expect(tmp_path: Path, require_tool: Callable[[str], str]) -> None:
    """sysusers creates the user and both groups; tmpfiles creates /run/torchpulse owned by it."""
    sysusers = require_tool("systemd-sysusers")
    tmpfiles = require_tool("systemd-tmpfiles")
    (tmp_path / "etc").mkdir()

    for tool, snippet in ((sysusers, "torchpulse.sysusers"), (tmpfiles, "torchpulse.tmpfiles")):
        command = [tool, f"--root={tmp_path}", *(["--create"] if tool == tmpfiles else [])]
        subprocess.run([*command, str(UNITS / snippet)], check=True, capture_output=True, timeout=60)

    users = {line.split(":")[0]: line.split(":") for line in (tmp_path / "etc/passwd").read_text().splitlines()}
    groups = {line.split(":")[0]: line.split(":") for line in (tmp_path / "etc/group").read_text().splitlines()}
    assert {"torchpulse", "torchpulse-users"} <= groups.keys()
    runtime = (tmp_path / "run/torchpulse").stat()
    assert (int(users["torchpulse"][2]), int(groups["torchpulse"][2])) == (
        runtime.st_uid,
        runtime.st_gid,
    )
    assert stat.S_IMODE(runtime.st_mode) == 0o755


def test_service_declares_the_required_behaviour() -> None:
    """Notify type, watchdog, restart, reload, identity, directories and limits are all set."""
    unit = _directives(SERVICE)
    expected = {
        "Type": ["notify"],
        "NotifyAccess": ["main"],
        "ExecStart": [f"{INSTALLED_BINARY} daemon --config /etc/torchpulse/torchpulse.toml"],
        "ExecReload": ["/bin/kill -HUP $MAINPID"],
        "Restart": ["on-failure"],
        "User": ["torchpulse"],
        "Group": ["torchpulse"],
        "RuntimeDirectory": ["torchpulse"],
        "RuntimeDirectoryPreserve": ["yes"],
        "StateDirectory": ["torchpulse"],
        "ConfigurationDirectory": ["torchpulse"],
        "ProtectSystem": ["strict"],
        "ProtectHome": ["read-only"],
        "PrivateTmp": ["yes"],
        "NoNewPrivileges": ["yes"],
        "CapabilityBoundingSet": [""],
        "RestrictAddressFamilies": ["AF_UNIX AF_INET AF_INET6"],
    }
    actual = {key: unit[("Service", key)] for key in expected}
    assert expected == actual
    assert "@system-service" in unit[("Service", "SystemCallFilter")]
    for limit in ("WatchdogSec", "MemoryMax", "CPUQuota"):
        assert unit[("Service", limit)], f"{limit} is not set"
    # Idle I/O class belongs to the validation worker only (see the comment in the unit).
    assert ("Service", "IOSchedulingClass") not in unit
    assert unit[("Unit", "Requires")] == ["torchpulse.socket"]


def test_socket_is_group_restricted_and_named() -> None:
    """The agent socket is 0660 for torchpulse-users and named 'agent' in LISTEN_FDNAMES."""
    unit = _directives(SOCKET)
    expected = {
        "ListenStream": ["/run/torchpulse/agent.sock"],
        "SocketMode": ["0660"],
        "SocketGroup": ["torchpulse-users"],
        "FileDescriptorName": ["agent"],
        "Service": ["torchpulse.service"],
    }
    assert expected == {key: unit[("Socket", key)] for key in expected}


EXPECTED_CONFIG: dict[str, dict[str, Any]] = {
    "daemon": {
        "socket": "/run/torchpulse/agent.sock",
        "listen": "127.0.0.1:10187",
        "state_dir": "/var/lib/torchpulse",
        "log_format": "auto",
        "log_level": "info",
        "control_group": "",
        "textfile": "",
        "textfile_interval_seconds": 15,
    },
    "runs": {
        "grace_period_seconds": 300,
        "lost_grace_period_seconds": 3600,
        "series_limit_per_run": 5000,
        "max_runs": 1000,
        "max_ranks_per_run": 1024,
    },
    "checkpoints": {
        "roots": [],
        "level": "data",
        "observer": "auto",
        "poll_interval_seconds": 5,
        "incomplete_after_seconds": 1800,
        "max_concurrent_validations": 1,
        "validation_timeout_seconds": 600,
        "validation_memory_limit_bytes": 4294967296,
    },
}


def test_sample_config_lists_exactly_the_daemon_keys_with_defaults() -> None:
    """The sample config parses and holds exactly the documented keys and defaults."""
    assert tomllib.loads((UNITS / "torchpulse.toml").read_text()) == EXPECTED_CONFIG


def test_sample_config_covers_every_key_the_daemon_reads() -> None:
    """A key added to the config classes must appear in the sample (set, or in a comment for rare ones)."""
    import dataclasses

    from torchpulse.daemon.checkpoints.config import CheckpointsConfig
    from torchpulse.daemon.config import DaemonSection, RunsSection

    text = (UNITS / "torchpulse.toml").read_text()
    sample = tomllib.loads(text)
    for section, cls in (("daemon", DaemonSection), ("runs", RunsSection)):
        assert {f.name for f in dataclasses.fields(cls)} == set(sample[section]), section
    commented = set(re.findall(r"^# ([a-z_]+) = ", text, re.MULTILINE))
    assert {f.name for f in dataclasses.fields(CheckpointsConfig)} == set(sample["checkpoints"]) | commented


def test_every_sample_config_key_is_documented() -> None:
    """Each key is preceded by a comment line that explains it."""
    lines = (UNITS / "torchpulse.toml").read_text().splitlines()
    undocumented = [
        line.split("=")[0].strip()
        for index, line in enumerate(lines)
        if re.match(r"^[a-z_]+ =", line) and not lines[index - 1].startswith("#")
    ]
    assert undocumented == []


@pytest.mark.parametrize(
    ("config_key", "unit", "directive", "prefix"),
    [
        ("socket", SOCKET, ("Socket", "ListenStream"), ""),
        ("state_dir", SERVICE, ("Service", "StateDirectory"), "/var/lib/"),
    ],
)
def test_sample_config_agrees_with_the_units(
    config_key: str, unit: Path, directive: tuple[str, str], prefix: str
) -> None:
    """Paths in the sample config are the ones the units create."""
    config = tomllib.loads((UNITS / "torchpulse.toml").read_text())
    assert [config["daemon"][config_key]] == [prefix + value for value in _directives(unit)[directive]]


def test_sample_config_loads_with_the_daemon_loader() -> None:
    """The daemon's own config loader accepts the sample (skipped until it imports)."""
    config_module = pytest.importorskip("torchpulse.daemon.config")

    config = config_module.load(UNITS / "torchpulse.toml")

    assert str(config.daemon.socket) == EXPECTED_CONFIG["daemon"]["socket"]
