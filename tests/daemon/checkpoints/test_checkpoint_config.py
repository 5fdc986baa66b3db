"""The [checkpoints] section: defaults, per-root observers, and errors that name the key."""

from __future__ import annotations

import pytest

from torchpulse.daemon.checkpoints.config import CheckpointsConfig, RootConfig, parse
from torchpulse.daemon.config import ConfigError, from_mapping


def test_sample_config_keys_parse_to_the_documented_defaults() -> None:
    """The keys of systemd/torchpulse.toml parse to the dataclass defaults."""
    table = {
        "roots": [],
        "level": "data",
        "observer": "auto",
        "poll_interval_seconds": 5,
        "incomplete_after_seconds": 1800,
        "max_concurrent_validations": 1,
        "validation_timeout_seconds": 600,
        "validation_memory_limit_bytes": 4294967296,
    }
    assert CheckpointsConfig() == parse(table)


def test_a_root_may_override_the_observer() -> None:
    """A root given as a table carries its own observer; a plain string uses the section's."""
    config = parse({"roots": ["/a", {"path": "/b/", "observer": "polling"}]})
    assert (RootConfig("/a"), RootConfig("/b", "polling")) == config.roots


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"level": "full"}, "checkpoints.level: expected metadata, data or load"),
        ({"observer": "fanotify"}, "checkpoints.observer: expected auto, inotify or polling"),
        ({"roots": ["relative/dir"]}, "checkpoints.roots: 'relative/dir' is not an absolute path"),
        ({"roots": [{"path": "/a", "observer": "x"}]}, "checkpoints.roots: observer of '/a'"),
        ({"roots": [{"path": "/a", "watch": "x"}]}, "checkpoints.roots: unknown key 'watch'"),
        ({"roots": "/a"}, "checkpoints.roots: expected a list"),
        ({"max_concurrent_validations": 0}, "checkpoints.max_concurrent_validations: must be >= 1"),
        ({"max_concurrent_validations": 1.5}, "checkpoints.max_concurrent_validations: expected an integer"),
        ({"poll_interval_seconds": "5s"}, "checkpoints.poll_interval_seconds: expected a number"),
        ({"roots": ["/a", "/a/"]}, "checkpoints.roots: a root is listed twice"),
        ({"rootz": []}, "checkpoints.rootz: unknown key"),
        ({"debounce_seconds": float("nan")}, "checkpoints.debounce_seconds: expected a finite number, got nan"),
    ],
)
def test_bad_values_name_the_key(table: dict[str, object], message: str) -> None:
    """Each mistake raises one ConfigError naming the key."""
    with pytest.raises(ConfigError, match=message):
        parse(table)


def test_the_raw_table_comes_from_the_daemon_config() -> None:
    """Config.extra carries the [checkpoints] table untouched until parse."""
    config = from_mapping({"checkpoints": {"roots": ["/data/ckpt"]}})
    assert (RootConfig("/data/ckpt"),) == parse(config.extra["checkpoints"]).roots
