"""docs/metrics.md and dashboards/metrics.txt, rendered from the catalog (`torchpulse.catalog.SECTIONS`).

The label values listed are read from the modules that produce them, so a new reason or status shows up
in the docs at the next `make docs`.
"""

from __future__ import annotations

from collections.abc import Sequence

from torchpulse.catalog import EXPORTED, SECTIONS, Family, Section
from torchpulse.docgen.markdown import HEADER, anchor, cell, code_list

METRICS_MD = "docs/metrics.md"
CONTRACT_TXT = "dashboards/metrics.txt"


def label_values() -> dict[tuple[str, str], str]:
    """(family, label) -> the values the code gives that label, as Markdown; only labels with a fixed set."""
    # Imported here: these modules import torch, which neither the daemon nor the contract needs.
    from torchpulse.checkpoints.model import Severity
    from torchpulse.checkpoints.rules import RULES
    from torchpulse.daemon.checkpoints.config import LEVELS
    from torchpulse.daemon.checkpoints.stats import STATUSES
    from torchpulse.exporters.collectors.agents import AgentsCollector
    from torchpulse.exporters.collectors.checkpoints import CheckpointCollector
    from torchpulse.exporters.collectors.daemon import FRAME_REJECT_REASONS, SERIES_REJECT_REASONS, DaemonCollector
    from torchpulse.exporters.collectors.series import AgentSeriesCollector
    from torchpulse.probes.agent.agent import DROP_REASONS
    from torchpulse.probes.agent.config import DEFAULT_PROBES
    from torchpulse.probes.autograd.probe import PASS_KINDS
    from torchpulse.probes.checkpoint import APIS
    from torchpulse.probes.compile.probe import FRAME_STATUSES
    from torchpulse.probes.compile.reasons import CUDAGRAPH_SKIP_REASONS, RECOMPILE_REASONS, RERECORD_REASONS

    rules = sorted(RULES)
    collectors = (DaemonCollector.name, AgentsCollector.name, AgentSeriesCollector.name, CheckpointCollector.name)
    values: dict[tuple[str, str], str] = {
        ("agent_events_dropped_total", "reason"): code_list(DROP_REASONS),
        ("compile_frames_total", "status"): code_list(FRAME_STATUSES),
        ("recompiles_total", "reason"): code_list(RECOMPILE_REASONS),
        ("cudagraph_skips_total", "reason"): code_list(CUDAGRAPH_SKIP_REASONS),
        ("cudagraph_rerecords_total", "reason"): code_list(RERECORD_REASONS),
        ("checkpoint_findings", "rule"): f"`{rules[0]}` to `{rules[-1]}` (`torchpulse check`'s rules)",
        ("checkpoint_findings", "severity"): code_list(s.value for s in Severity),
        ("checkpoint_validation_duration_seconds", "level"): code_list(LEVELS),
        ("daemon_frames_rejected_total", "reason"): code_list(FRAME_REJECT_REASONS),
        ("daemon_series_rejected_total", "reason"): code_list(SERIES_REJECT_REASONS),
    }
    for name in ("agent_probe_errors_total", "agent_probe_enabled"):
        values[name, "probe"] = code_list(DEFAULT_PROBES)
    for name in ("backward_passes_total", "backward_duration_seconds"):
        values[name, "kind"] = code_list(PASS_KINDS)
    for name in ("checkpoint_save_duration_seconds", "checkpoint_save_failures_total"):
        values[name, "api"] = code_list(APIS)
    for name in ("checkpoint_validations_total", "checkpoint_last_status"):
        values[name, "status"] = code_list(STATUSES)
    for name in ("scrape_collector_duration_seconds", "scrape_collector_success"):
        values[name, "collector"] = code_list(collectors)
    unknown = sorted(f"{n}.{label}" for n, label in values if n not in EXPORTED or label not in EXPORTED[n].labels)
    if unknown:
        raise ValueError(f"label values listed for labels the catalog does not have: {', '.join(unknown)}")
    return values


def _row(family: Family) -> str:
    meaning = f"{family.help} {family.doc}".strip()
    cells = (
        f"`{family.exposed_name}`",
        family.kind,
        ", ".join(family.exposed_labels) or "—",
        family.unit or "—",
        meaning,
    )
    return "| " + " | ".join(cell(c) for c in cells) + " |"


def _section(section: Section, values: dict[tuple[str, str], str]) -> list[str]:
    lines = [
        f"## {section.title}",
        "",
        "| metric | type | labels | unit | meaning |",
        "|---|---|---|---|---|",
        *(_row(family) for family in section.families),
        "",
    ]
    listed = [
        f"- `{label}` of `{family.exposed_name}`: {values[family.name, label]}"
        for family in section.families
        for label in family.labels
        if (family.name, label) in values
    ]
    if listed:
        lines += ["Label values:", "", *listed, ""]
    if section.notes:
        lines += [section.notes, ""]
    return lines


def conventions() -> str:
    """What every family shares: names, `run` and `rank`, bounded labels, and the limits that protect Prometheus."""
    from torchpulse.daemon.config import RunsSection
    from torchpulse.limits import MAX_LABEL_CHARS, MAX_RENDER_REUSE_SECONDS

    runs = RunsSection()
    return f"""\
All names start with `torchpulse_` and follow Prometheus' conventions: base units named by the suffix
(the unit column), counters ending in `_total`, durations as histograms. Series of a training process
carry `run` and `rank`, added by the daemon from the agent's connection (their counters start again at 0
when the rank's process restarts, as Prometheus counters do; `rate()` and `increase()` take that in).
Run facts are in `torchpulse_run_info{{...}} 1`: join on `run`. The labels `job` and `instance` are never
used: they are Prometheus'.

Free-form text (recompile reasons, graph-break messages, node names, file paths) never becomes a label:
it is classified into a fixed set (the label values below) or bounded to the first K values each process
sees (the rest is `other`), and the full text goes to the daemon's structured log. A label value longer
than {MAX_LABEL_CHARS} characters is refused. The daemon accepts only the agent families listed here
(`torchpulse/catalog/`) and holds at most `runs.series_limit_per_run` series per run ({runs.series_limit_per_run}
by default), counting what it refuses in `torchpulse_run_series_rejected` (other runs are unaffected), at
most `runs.max_runs` runs ({runs.max_runs}) and `runs.max_ranks_per_run` ranks of a run
({runs.max_ranks_per_run}): past those a hello is refused (ended runs and disconnected ranks make room
first) and the agent retries with backoff while the job trains on. A run whose ranks all said goodbye stays
exported for `runs.grace_period_seconds` ({runs.grace_period_seconds:g} s), one that lost a rank for
`runs.lost_grace_period_seconds` ({runs.lost_grace_period_seconds:g} s), unless a new run needs its place
(the oldest ended run goes first, cleanly ended ones before crashed ones). Scrapes that arrive within the
time the last render took (at most {MAX_RENDER_REUSE_SECONDS:g} s) get that render.

The tables: *labels* as /metrics shows them; *unit* as the name's suffix says it (— for counts and 0/1
flags); *meaning* the exposition's HELP text, then what it does not say. dashboards/metrics.txt, which
the dashboard and alert tests read, is generated from the same catalog."""


def render_metrics_md() -> str:
    """docs/metrics.md: the conventions, then one table per catalog section, its label values and notes."""
    values = label_values()
    lines = [
        "# Metrics",
        "",
        HEADER.format(source="the metric catalog, `torchpulse/catalog/`"),
        "",
        conventions(),
        "",
        " · ".join(f"[{s.title}](#{anchor(s.title)})" for s in SECTIONS),
        "",
    ]
    for section in SECTIONS:
        lines += _section(section, values)
    return "\n".join(lines).rstrip("\n") + "\n"


def _contract_line(family: Family) -> str:
    # Labels start in column 66 even after a name longer than the usual column (the file is read by eye too).
    head = f"{family.exposed_name:<54} {family.contract_kind}"
    return f"{head:<65} {','.join(family.exposed_labels)}".rstrip()


def render_contract(sections: Sequence[Section] = SECTIONS) -> str:
    """dashboards/metrics.txt: `name type labels` per family, what tests/dashboards/ reads."""
    lines = [
        "# The metric contract that the Grafana dashboard and the Prometheus rules may use.",
        "# Generated by `make docs` from torchpulse/catalog/ (a new family goes there): do not edit.",
        "# One family per line: name, type (counter | gauge | histogram | info), labels.",
        "# A histogram's _bucket, _sum and _count series are implied. `run` and `rank`",
        "# come from the daemon; `job` and `instance` belong to Prometheus and never",
        "# appear here. tests/dashboards/ reads this file.",
    ]
    for section in sections:
        lines += ["", f"# {section.title}.", *(_contract_line(family) for family in section.families)]
    return "\n".join(lines) + "\n"
