"""docs/configuration.md, rendered from the config code: the daemon's config sections (their dataclasses'
fields and defaults), the command line's parsers (flags, defaults, help) and the TORCHPULSE_* variables.

What the code does not say in words (what a key is for) is in the tables below, one entry per key,
variable or probe option; rendering fails when the code has an entry these tables lack or the other way
round, so that a new key cannot go undocumented.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final

from torchpulse.docgen.markdown import HEADER, cell, code_list

CONFIGURATION_MD = "docs/configuration.md"

# What each config key is for. Defaults, types and allowed values come from the code.
KEYS: Final[Mapping[str, str]] = {
    "daemon.socket": "Unix socket that agents, `torchpulse status` and `ctl` connect to; at most 107 bytes (the "
    "kernel's `sun_path`). Under socket activation the socket systemd passes wins.",
    "daemon.listen": "`HOST:PORT` of the HTTP listener serving `/metrics`. `0.0.0.0:10187` (or one interface's "
    "address) when Prometheus scrapes from another host; an IPv6 host in brackets (`[::1]:10187`); a port "
    "without a host (`:10187`) is refused as ambiguous.",
    "daemon.state_dir": "Where the daemon keeps its checkpoint validation state (SQLite) across restarts. "
    "Unwritable: one warning, state in memory only, `torchpulse_daemon_state_persistent 0`.",
    "daemon.log_format": "Log format on stderr: `auto` is JSON unless stderr is a terminal.",
    "daemon.log_level": "Minimum log level.",
    "daemon.control_group": "Unix group whose members may send `torchpulse ctl` commands to every user's jobs. "
    "Empty: root, the daemon's user, and each job's own user for their runs.",
    "daemon.textfile": "A `.prom` file for node_exporter's textfile collector: the same metrics as `/metrics`, "
    "rewritten atomically and removed when the daemon stops. Empty: none. Use it or the scrape, never both.",
    "daemon.textfile_interval_seconds": "Seconds between rewrites of the textfile (checked once a second).",
    "runs.grace_period_seconds": "Seconds a run whose ranks all said goodbye stays exported, so that Prometheus "
    "scrapes its final values.",
    "runs.lost_grace_period_seconds": "Seconds a run that lost a rank (no goodbye: a crash, a kill) stays "
    "exported, so that TorchpulseAgentDown keeps firing; a restart under the same run name brings it back.",
    "runs.series_limit_per_run": "Most series one run may hold; further ones are refused and counted "
    "(`torchpulse_run_series_rejected`).",
    "runs.max_runs": "Most runs held at once, ended ones included; a new run's hello past it is refused (the "
    "agent retries) unless an ended run can make room.",
    "runs.max_ranks_per_run": "Most ranks of one run on this node, the same way.",
    "checkpoints.roots": "Directories watched for new DCP checkpoints: paths, or tables `{ path = ..., observer = "
    "... }` that override `observer` for one root. Besides these, the parent directory of every save a job "
    "announces is watched. Empty: only announced checkpoints are validated.",
    "checkpoints.level": "How deep each new checkpoint is validated (`torchpulse check --level`): `metadata` "
    "reads `.metadata` and file sizes, `data` also every item (CRC32, dtypes, NaN/Inf), `load` also loads the "
    "optimizer state resharded.",
    "checkpoints.observer": "How new checkpoints are noticed: `inotify`, `polling` (network file systems), or "
    "`auto`: polling on NFS, CIFS, Lustre, GPFS, Ceph and the like (from the mount table), inotify elsewhere.",
    "checkpoints.poll_interval_seconds": "Seconds between scans when polling.",
    "checkpoints.incomplete_after_seconds": "A directory with data files and no `.metadata`, its newest file this "
    "old, is incomplete (an interrupted save); roots are swept every min(60, this / 4) seconds.",
    "checkpoints.max_concurrent_validations": "Validation workers at once, each a process at idle I/O priority.",
    "checkpoints.validation_timeout_seconds": "A validation worker running longer is killed (`error`, TP-CKPT-000).",
    "checkpoints.validation_memory_limit_bytes": "Address-space limit of one validation worker.",
    "checkpoints.max_announced_roots": "Directories announced by jobs that become watched roots; checkpoints of "
    'further ones are validated under `root="other"`.',
    "checkpoints.announced_root_ttl_seconds": "An announced root with no announcement for this long is no longer "
    "watched, and its series go.",
    "checkpoints.debounce_seconds": "Quiet time after `.metadata` appears before validating, so one commit makes "
    "one validation.",
}

# Variables the package reads. `default` says what happens when the variable is unset.
VARIABLES: Final[Mapping[str, tuple[str, str]]] = {
    "TORCHPULSE_SOCKET": (
        "the user's own daemon's socket if one listens, else the service's `/run/torchpulse/agent.sock` if it "
        "exists, else the user's default (`daemon.socket`)",
        "The daemon's socket, for agents, `torchpulse run`, `status` and `ctl`.",
    ),
    "TORCHPULSE_RUN": (
        "`TORCHELASTIC_RUN_ID`, else `SLURM_JOB_ID`, else the name `torchpulse run` generated for all its "
        "processes, else one generated per process",
        "The `run` label (`torchpulse run --run-name` sets it).",
    ),
    "TORCHPULSE_PROBES": ("`{probes}`", "Comma-separated probes to install (`torchpulse run --probes` sets it)."),
    "TORCHPULSE_FLUSH_INTERVAL": ("`{flush_interval:g}`", "Seconds between the agent's batches to the daemon."),
    "TORCHPULSE_STALL_SECONDS": (
        "`{stall_seconds:g}`",
        "A rank is stalled (`torchpulse_agent_stalled 1`) after this many seconds without a step of its main "
        "optimizer, or 10x the p99 of its recent step intervals if that is longer.",
    ),
    "TORCHPULSE_FIRST_STEP_STALL_SECONDS": (
        "`{first_step_stall_seconds:g}`",
        "The same before the rank's first step (start-up, compiling, loading a checkpoint).",
    ),
    "TORCHPULSE_PROBE_ERRORS": (
        "`{probe_errors}`",
        "What a probe's own bug does: `disable` logs it once, counts it and switches that probe off while the "
        "job trains on; `fatal` ends the process with the traceback (the test suite's jobs use it).",
    ),
    "TORCHPULSE_OPT_<NAME>": ("see below", "A probe option (`attach(options=...)` takes `name` instead)."),
    "TORCHPULSE_RUN_FALLBACK": (
        "unset",
        "Set by `torchpulse run`: the generated run name its processes share when nothing else names the run.",
    ),
    "TORCHPULSE_BOOTSTRAP": (
        "unset",
        "Set to `1` by `torchpulse run`: the `sitecustomize` bootstrap attaches the agent.",
    ),
}

# Probe options, `TORCHPULSE_OPT_<NAME>`. Defaults come from the probes' code.
OPTIONS: Final[Mapping[str, str]] = {
    "autograd_sample_every": "Time the nodes of one pass in N (0: off); `ctl sample` changes it live.",
    "autograd_top_nodes": "Node types with a `node` label of their own; the rest count as `other`.",
    "autograd_slowest_kept": "Slowest nodes of the last sampled pass kept for `ctl status`.",
    "autograd_nonfinite": "Check gradients for NaN/Inf after every accumulating pass.",
    "autograd_grad_norm": "Export `torchpulse_grad_norm`.",
    "autograd_log_passes": "Log every autograd node of the first N passes (as `ctl autograd-log`).",
    "autograd_max_pending_checks": "Non-finite checks whose device result is not read yet; past it the oldest is "
    "dropped, not waited for.",
    "autograd_max_names_logged": "Parameter names in one `autograd.nonfinite_gradients` log event.",
    "compile_top_k": "Values of `function` and `location` each process keeps; the rest count as `other`.",
    "cudagraph_readiness_every": "Optimizer steps between CUDA-graph readiness checks.",
}

# Arguments the command line's parsers give no help text, keyed "command argument".
ARGUMENTS: Final[Mapping[str, str]] = {}

# Read by the test suite only (tests/conftest.py), not by the package.
TEST_VARIABLES: Final[Mapping[str, str]] = {
    "TORCHPULSE_TEST_TIER": "`fast` (set by `make test-fast`): a test that starts a process fails.",
}


def _toml(value: object) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return str(value)


def _type_name(hint: object) -> str:
    if hint is Path:
        return "path"
    if typing.get_origin(hint) is tuple:
        return "list"
    names = {str: "string", float: "number", int: "integer", bool: "boolean"}
    return names[hint] if isinstance(hint, type) and hint in names else str(hint)


def _defaults() -> dict[str, str]:
    """Defaults that depend on who runs the daemon, said for every user instead of for the one rendering this."""
    from torchpulse.paths import default_socket_path, default_state_dir

    xdg_runtime = default_socket_path({"XDG_RUNTIME_DIR": "$XDG_RUNTIME_DIR"}, uid=1000)
    # Any uid but 0 makes the same path with its number in it.
    tmp = str(default_socket_path({}, uid=12345)).replace("12345", "$UID")
    xdg_state = default_state_dir({"XDG_STATE_HOME": "$XDG_STATE_HOME"}, uid=1000)
    return {
        "daemon.socket": f"`{default_socket_path({}, uid=0)}` as root, else `{xdg_runtime}` (`{tmp}` without "
        "`XDG_RUNTIME_DIR`)",
        "daemon.state_dir": f"`{default_state_dir({}, uid=0)}` as root, else `{xdg_state}` "
        "(`~/.local/state/torchpulse` without `XDG_STATE_HOME`)",
    }


def _choices() -> dict[str, tuple[str, ...]]:
    from torchpulse.daemon.checkpoints.config import LEVELS, OBSERVERS
    from torchpulse.daemon.log_settings import LOG_FORMATS, LOG_LEVELS

    return {
        "daemon.log_format": LOG_FORMATS,
        "daemon.log_level": LOG_LEVELS,
        "checkpoints.level": LEVELS,
        "checkpoints.observer": OBSERVERS,
    }


def _sections() -> list[tuple[str, type[Any]]]:
    from torchpulse.daemon.checkpoints.config import CheckpointsConfig
    from torchpulse.daemon.config import DaemonSection, RunsSection

    return [("daemon", DaemonSection), ("runs", RunsSection), ("checkpoints", CheckpointsConfig)]


def config_keys() -> list[str]:
    """Every `section.key` the config file takes."""
    return [f"{name}.{f.name}" for name, cls in _sections() for f in dataclasses.fields(cls)]


def _check_covered(kind: str, documented: Mapping[str, object], actual: list[str]) -> None:
    missing, extra = sorted(set(actual) - set(documented)), sorted(set(documented) - set(actual))
    if missing or extra:
        raise ValueError(f"{kind}: undocumented {missing}, documented but gone {extra} (torchpulse/docgen/)")


def _config_tables() -> Iterator[str]:
    defaults, choices = _defaults(), _choices()
    _check_covered("config keys", KEYS, config_keys())
    for name, cls in _sections():
        hints = typing.get_type_hints(cls)
        yield f"### `[{name}]`"
        yield ""
        yield "| key | type | default | meaning |"
        yield "|---|---|---|---|"
        embedded = cls()  # the defaults, as the daemon starts without a file
        for f in dataclasses.fields(cls):
            key = f"{name}.{f.name}"
            default = defaults[key] if key in defaults else f"`{_toml(getattr(embedded, f.name))}`"
            meaning = KEYS[key]
            if key in choices:
                meaning += f" One of {code_list(choices[key])}."
            yield f"| `{f.name}` | {_type_name(hints[f.name])} | {cell(default)} | {cell(meaning)} |"
        yield ""


def _flag_default(action: argparse.Action) -> str:
    if isinstance(action, argparse._StoreTrueAction):
        return "off"
    if action.default is None or action.default == argparse.SUPPRESS:
        return "—"
    return f"`{action.default}`"


def _flag_name(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`" if action.nargs != argparse.REMAINDER else "`-- COMMAND...`"
    name = ", ".join(action.option_strings)
    takes_value = action.nargs != 0 and not isinstance(action, argparse._StoreTrueAction | argparse._VersionAction)
    if takes_value:
        name += " " + (action.metavar if isinstance(action.metavar, str) else action.dest.upper())
    return f"`{name}`"


def _argument_key(command: str, action: argparse.Action) -> str:
    return f"{command} {action.option_strings[0] if action.option_strings else action.dest}"


def _flag_help(command: str, action: argparse.Action, used: set[str]) -> str:
    from torchpulse import limits

    key = _argument_key(command, action)
    if key in ARGUMENTS:
        if action.help:
            raise ValueError(f"{key}: the parser has its help now; drop it from ARGUMENTS (torchpulse/docgen/)")
        used.add(key)
    text = action.help or ARGUMENTS.get(key, "").format(**vars(limits))
    if not text:
        raise ValueError(f"{key}: no help in the parser and none in ARGUMENTS (torchpulse/docgen/)")
    if action.choices is not None:
        text = f"{text} (one of {code_list(str(c) for c in action.choices)})"
    if action.required and action.option_strings:
        text = f"required; {text}"
    return text


def _arguments(parser: argparse.ArgumentParser, skip: frozenset[str] = frozenset()) -> list[argparse.Action]:
    return [
        a
        for a in parser._actions
        if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction) and a.dest not in skip
    ]


def _flag_table(command: str, actions: list[argparse.Action], used: set[str]) -> Iterator[str]:
    yield "| argument | default | meaning |"
    yield "|---|---|---|"
    for action in actions:
        cells = (_flag_name(action), _flag_default(action), _flag_help(command, action, used))
        yield "| " + " | ".join(cell(c) for c in cells) + " |"
    yield ""


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _command_tables() -> Iterator[str]:
    from torchpulse import cli
    from torchpulse.checkpoints import cli as check_cli

    top, used = cli._parser(), set[str]()
    yield "### `torchpulse`"
    yield ""
    yield from _flag_table("", _arguments(top), used)
    for name, parser in _subcommands(top).items():
        if name == "check":  # a placeholder: `torchpulse check` has its own parser
            parser = check_cli._parser()
        actions = _subcommands(parser)
        yield f"### `torchpulse {name}`"
        yield ""
        summary = _help_of(top, name)
        if parser.epilog:  # `torchpulse check` says its exit statuses there
            summary += f"; {parser.epilog}"
        yield f"{summary[0].upper()}{summary[1:]}."
        yield ""
        if not actions:
            yield from _flag_table(name, _arguments(parser), used)
            continue
        # Arguments every action takes are listed once (ctl's --run, --rank, --socket, --timeout).
        common = frozenset.intersection(*(frozenset(a.dest for a in _arguments(p)) for p in actions.values()))
        first = next(iter(actions.values()))
        yield f"Every `torchpulse {name}` action takes:"
        yield ""
        yield from _flag_table(name, [a for a in _arguments(first) if a.dest in common], used)
        for action_name, action_parser in actions.items():
            own = _arguments(action_parser, skip=common)
            yield f"- `torchpulse {name} {action_name}`: {_help_of(parser, action_name)}" + ("" if own else ".")
            if own:
                yield ""
                table = _flag_table(f"{name} {action_name}", own, used)
                yield from ("  " + line if line else "" for line in table)
        yield ""
    _check_covered("arguments without help", ARGUMENTS, sorted(used))


def _help_of(parser: argparse.ArgumentParser, name: str) -> str:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                if choice.dest == name:
                    return choice.help or ""
    return ""


def _variable_tables() -> Iterator[str]:
    from torchpulse.probes.agent.config import DEFAULT_PROBES, AgentConfig

    values = {f.name: f.default for f in dataclasses.fields(AgentConfig)}
    values["probes"] = ",".join(DEFAULT_PROBES)
    yield "| variable | when unset | meaning |"
    yield "|---|---|---|"
    for name, (default, meaning) in VARIABLES.items():
        yield f"| `{name}` | {cell(default.format(**values))} | {cell(meaning)} |"
    yield ""
    yield "### Probe options (`TORCHPULSE_OPT_<NAME>`)"
    yield ""
    yield (
        "A value that cannot be used is one line on stderr naming its variable; the probe it configures stays "
        "off and the job trains on. Booleans take `1`/`0`, `true`/`false`, `yes`/`no`, `on`/`off`."
    )
    yield ""
    yield "| variable | default | meaning |"
    yield "|---|---|---|"
    defaults = probe_option_defaults()
    _check_covered("probe options", OPTIONS, list(defaults))
    for option, default in defaults.items():
        yield f"| `TORCHPULSE_OPT_{option.upper()}` | `{default}` | {cell(OPTIONS[option])} |"
    yield ""
    yield "### The test suite"
    yield ""
    yield "| variable | meaning |"
    yield "|---|---|"
    for name, meaning in TEST_VARIABLES.items():
        yield f"| `{name}` | {cell(meaning)} |"
    yield ""


def probe_option_defaults() -> dict[str, str]:
    """Every probe option and its default, as its probe reads it."""
    from torchpulse.probes.agent.config import AgentConfig
    from torchpulse.probes.autograd.config import AutogradConfig

    # Imported here: the compile probe imports torch.
    from torchpulse.probes.compile.probe import DEFAULT_TOP_K

    def text(value: object) -> str:
        return ("1" if value else "0") if isinstance(value, bool) else str(value)

    agent = {f.name: f.default for f in dataclasses.fields(AgentConfig)}
    options = {f"autograd_{f.name}": text(f.default) for f in dataclasses.fields(AutogradConfig)}
    options["compile_top_k"] = text(DEFAULT_TOP_K)
    # The CUDA-graph probe checks readiness as often as the optimizer probe reads state sizes.
    options["cudagraph_readiness_every"] = text(agent["optimizer_state_every"])
    return options


def render_configuration_md() -> str:
    """docs/configuration.md: config file keys, command-line arguments, environment variables."""
    parts: list[Callable[[], Iterator[str]]] = [_config_tables, _command_tables, _variable_tables]
    config, commands, variables = (list(part()) for part in parts)
    lines = [
        "# Configuration",
        "",
        HEADER.format(
            source="the config code (`torchpulse/daemon/config.py`, `torchpulse/daemon/checkpoints/config.py`, "
            "`torchpulse/cli.py`, the agent's and probes' settings) and the descriptions in "
            "`torchpulse/docgen/configuration.py`"
        ),
        "",
        "The daemon takes its settings from embedded defaults, then a TOML file (`torchpulse daemon --config "
        "FILE`; `systemd/torchpulse.toml` is a commented example), then its flags, which win. A bad file is one "
        "error naming the file and key (exit status 2). SIGHUP (`systemctl reload torchpulse`) reads the file "
        "again and applies every key but `socket`, `listen` and `state_dir`, which need a restart (the reload "
        "names them in a warning); a reload that fails keeps the running config. Agents, inside the training "
        "processes, take theirs from the environment (or `torchpulse.attach(...)` arguments).",
        "",
        "## The config file",
        "",
        *config,
        "## The command line",
        "",
        *commands,
        "## Environment variables",
        "",
        *variables,
    ]
    return "\n".join(lines).rstrip("\n") + "\n"
