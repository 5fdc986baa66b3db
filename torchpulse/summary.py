"""Read a /metrics exposition back into a per-rank summary (demo and tests)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from torchpulse.terminal import columns, fit, printable


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile over cumulative (upper bound, count) pairs."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] == 0:
        return math.nan
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return buckets[-1][0]


@dataclass
class RankSummary:
    run: str
    rank: str
    up: bool = False
    exited: bool = False
    steps: float = 0.0
    step_buckets: list[tuple[float, float]] = field(default_factory=list)
    learning_rates: dict[str, float] = field(default_factory=dict)
    state_bytes: float = 0.0
    dropped: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)
    checkpoint_saves: float = 0.0
    # Failed checkpoint saves by "api error".
    save_failures: dict[str, float] = field(default_factory=dict)
    # Sampled autograd passes: seconds and calls by node type.
    node_seconds: dict[str, float] = field(default_factory=dict)
    node_calls: dict[str, float] = field(default_factory=dict)

    @property
    def p50(self) -> float:
        return histogram_quantile(0.5, self.step_buckets)

    @property
    def p99(self) -> float:
        return histogram_quantile(0.99, self.step_buckets)


def summarize(exposition: str) -> list[RankSummary]:
    ranks: dict[tuple[str, str], RankSummary] = {}
    buckets: dict[tuple[str, str], dict[float, float]] = defaultdict(dict)

    def of(labels: dict[str, str]) -> RankSummary:
        key = (labels["run"], labels["rank"])
        if key not in ranks:
            ranks[key] = RankSummary(*key)
        return ranks[key]

    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            labels = sample.labels
            if "run" not in labels or "rank" not in labels:
                continue
            name = sample.name
            if name == "torchpulse_agent_up":
                of(labels).up = sample.value == 1.0
            elif name == "torchpulse_agent_exited":
                of(labels).exited = sample.value == 1.0
            elif name == "torchpulse_optimizer_steps_total":
                of(labels).steps += sample.value
            elif name == "torchpulse_optimizer_step_duration_seconds_bucket":
                # Through of(): a rank may have buckets and nothing else (its steps_total refused by
                # the series limit, the agents collector failing this scrape).
                row = of(labels)
                row_buckets = buckets[(row.run, row.rank)]
                le = float(labels["le"])
                row_buckets[le] = row_buckets.get(le, 0.0) + sample.value
            elif name == "torchpulse_optimizer_learning_rate":
                of(labels).learning_rates[f"{labels['optimizer']}/{labels['param_group']}"] = sample.value
            elif name == "torchpulse_optimizer_state_bytes":
                of(labels).state_bytes += sample.value
            elif name == "torchpulse_agent_events_dropped_total":
                of(labels).dropped += sample.value
            elif name == "torchpulse_checkpoint_save_duration_seconds_count":
                of(labels).checkpoint_saves += sample.value
            elif name == "torchpulse_checkpoint_save_failures_total":
                failures = of(labels).save_failures
                failure = f"{labels.get('api', '?')} {labels.get('error', '?')}"
                failures[failure] = failures.get(failure, 0.0) + sample.value
            elif name == "torchpulse_autograd_node_seconds_total":
                of(labels).node_seconds[labels.get("node", "?")] = sample.value
            elif name == "torchpulse_autograd_node_calls_total":
                of(labels).node_calls[labels.get("node", "?")] = sample.value
            elif name.endswith("_total") or family.type == "gauge":
                extra = of(labels).extra
                extra[name] = extra.get(name, 0.0) + sample.value
    for key, pairs in buckets.items():
        ranks[key].step_buckets = sorted(pairs.items())
    return sorted(ranks.values(), key=lambda r: (r.run, int(r.rank) if r.rank.isdigit() else 0))


def _seconds(value: float) -> str:
    if math.isnan(value):
        return "-"
    return f"{value * 1000:.2f} ms" if value < 1 else f"{value:.2f} s"


def _bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def _count(row: RankSummary, name: str) -> str:
    value = row.extra.get(name)
    return "-" if value is None else f"{value:.0f}"


def format_table(rows: list[RankSummary]) -> str:
    header = ("run", "rank", "up", "steps", "step p50", "step p99", "learning rate", "state size", "dropped")
    body = [
        (
            r.run,
            r.rank,
            "yes" if r.up else "exited" if r.exited else "no",
            f"{r.steps:.0f}",
            _seconds(r.p50),
            _seconds(r.p99),
            ", ".join(f"{v:.3g}" for v in r.learning_rates.values()) or "-",
            _bytes(r.state_bytes),
            f"{r.dropped:.0f}",
        )
        for r in rows
    ]
    return _table(header, body)


def format_probe_table(rows: list[RankSummary]) -> str:
    """What the autograd and compile probes saw, per rank."""
    header = (
        "run",
        "rank",
        "backward passes",
        "non-finite passes",
        "recompiles",
        "graph breaks",
        "compiled frames",
        "cudagraph skips",
    )
    body = [
        (
            r.run,
            r.rank,
            _count(r, "torchpulse_backward_passes_total"),
            _count(r, "torchpulse_grad_nonfinite_passes_total"),
            _count(r, "torchpulse_recompiles_total"),
            _count(r, "torchpulse_graph_breaks_total"),
            _count(r, "torchpulse_compile_frames_total"),
            _count(r, "torchpulse_cudagraph_skips_total"),
        )
        for r in rows
    ]
    return _table(header, body)


def format_node_times(rows: list[RankSummary], top: int = 3) -> str:
    """Per rank: how many passes were timed node by node, and the `top` node types by time."""
    header = ("run", "rank", "sampled passes", f"slowest {top} node types (time, calls)")
    body = []
    for r in rows:
        if "torchpulse_autograd_sampled_passes_total" not in r.extra:
            continue
        by_time = sorted(r.node_seconds.items(), key=lambda item: item[1], reverse=True)[:top]
        slowest = ", ".join(f"{node} {_seconds(value)} x{r.node_calls.get(node, 0):.0f}" for node, value in by_time)
        body.append((r.run, r.rank, _count(r, "torchpulse_autograd_sampled_passes_total"), slowest or "-"))
    return _table(header, body) if body else "no sampled passes"


def format_checkpoint_saves(rows: list[RankSummary]) -> str:
    """What the checkpoint probe counted, per rank: saves that returned and saves that raised."""
    header = ("run", "rank", "saves", "failed saves", "failures by api and error")
    body = [
        (
            r.run,
            r.rank,
            f"{r.checkpoint_saves:.0f}",
            f"{sum(r.save_failures.values()):.0f}",
            ", ".join(f"{key} x{count:.0f}" for key, count in sorted(r.save_failures.items())) or "-",
        )
        for r in rows
        if r.checkpoint_saves or r.save_failures
    ]
    return _table(header, body) if body else "no checkpoint saves"


def format_checkpoints(exposition: str) -> str:
    """One line per checkpoint root: current status, findings, bytes."""
    status: dict[str, str] = {}
    findings: dict[str, list[str]] = {}
    size: dict[str, float] = {}
    validations: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            root = sample.labels.get("root")
            if root is None:
                continue
            if sample.name == "torchpulse_checkpoint_last_status" and sample.value == 1.0:
                status[root] = sample.labels["status"]
            elif sample.name == "torchpulse_checkpoint_findings" and sample.value > 0:
                findings.setdefault(root, []).append(
                    f"{sample.labels['rule']} {sample.labels['severity']} x{sample.value:.0f}"
                )
            elif sample.name == "torchpulse_checkpoint_bytes":
                size[root] = sample.value
            elif sample.name == "torchpulse_checkpoint_validations_total":
                validations[root] = validations.get(root, 0.0) + sample.value
    header = ("root", "latest status", "validations", "size", "findings")
    body = [
        (
            root,
            status.get(root, "-"),
            f"{validations.get(root, 0):.0f}",
            _bytes(size.get(root, 0.0)),
            "; ".join(findings.get(root, [])) or "none",
        )
        for root in sorted(set(status) | set(validations))
    ]
    return _table(header, body) if body else "no checkpoint roots"


def _table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """Aligned columns; run, rank and root labels come from agents and checkpoint paths: escaped."""
    rows = [[printable(str(cell)) for cell in row] for row in (header, *body)]
    widths = [max(columns(cell) for cell in column) for column in zip(*rows, strict=True)]
    lines = ["  ".join(fit(cell, w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
