"""Orchestration: run the rules of a level over one checkpoint directory."""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Final

from torchpulse.bounds import cut
from torchpulse.checkpoints.data_reader import Progress, read_data
from torchpulse.checkpoints.model import (
    Checkpoint,
    DataReport,
    Finding,
    Level,
    Severity,
    Status,
    ValidationResult,
)
from torchpulse.checkpoints.reader import gc_paused, read_checkpoint
from torchpulse.checkpoints.rules import INCOMPLETE_RULES, commit, data, optimizer, tiling
from torchpulse.checkpoints.unpickler import DEFAULT_METADATA_SIZE_CAP

# A hostile or badly broken checkpoint can have millions of findings (one per chunk).
# Listed, they would overflow the daemon's 16 MiB cap on a worker's result (a "worker
# failed" instead of "invalid") and print millions of lines; past these caps they are
# counted (ValidationResult.counts) and summarised, one finding per rule and severity.
MAX_FINDINGS_PER_RULE: Final = 1000
# A subject or message longer than this is cut: a tensor key can be megabytes long.
MAX_FINDING_TEXT: Final = 1000
# All listed findings together, as JSON: a bound on the result's size however long or
# non-ASCII (escaped, six bytes a character) their text, well inside the daemon's 16 MiB.
MAX_LISTED_JSON_BYTES: Final = 4 << 20


@dataclass(frozen=True, slots=True)
class Options:
    metadata_size_cap: int = DEFAULT_METADATA_SIZE_CAP
    # Evict read files from the page cache (the daemon wants this; a benchmark does not).
    drop_cache: bool = False
    progress: Progress | None = None

    def __post_init__(self) -> None:
        if self.metadata_size_cap <= 0:
            raise ValueError("metadata_size_cap must be positive")


def status_of(findings: Sequence[Finding]) -> Status:
    """Incomplete beats invalid: an uncommitted save is not (yet) a broken one."""
    if any(f.rule in INCOMPLETE_RULES for f in findings):
        return Status.INCOMPLETE
    if any(f.severity is Severity.ERROR for f in findings):
        return Status.INVALID
    return Status.VALID


def _shortened(finding: Finding) -> Finding:
    if len(finding.subject) <= MAX_FINDING_TEXT and len(finding.message) <= MAX_FINDING_TEXT:
        return finding
    return replace(
        finding, subject=cut(finding.subject, MAX_FINDING_TEXT), message=cut(finding.message, MAX_FINDING_TEXT)
    )


def capped(findings: Sequence[Finding]) -> tuple[list[Finding], dict[tuple[str, str], int]]:
    """The findings to list (in order, then one summary per capped rule and severity), and the true counts."""
    counts = Counter((f.rule, f.severity.value) for f in findings)
    # Only the first of each rule are even looked at: past the byte budget the rest of
    # a million would otherwise each be encoded, to be left out all the same.
    seen: Counter[tuple[str, str]] = Counter()
    listed: Counter[tuple[str, str]] = Counter()
    budget = MAX_LISTED_JSON_BYTES
    kept: list[Finding] = []
    for finding in findings:
        key = (finding.rule, finding.severity.value)
        if seen[key] >= MAX_FINDINGS_PER_RULE:
            continue
        seen[key] += 1
        finding = _shortened(finding)
        size = len(json.dumps(finding.to_json()))
        if size <= budget:
            budget -= size
            listed[key] += 1
            kept.append(finding)
    for (rule, severity), n in counts.items():
        if omitted := n - listed[(rule, severity)]:
            message = f"... and {omitted:,} more findings of this rule omitted"
            kept.append(Finding(rule, Severity(severity), "", message))
    return kept, dict(counts)


def metadata_findings(ckpt: Checkpoint) -> list[Finding]:
    """Every rule that needs only the metadata and `stat` (no tensor bytes)."""
    layout = optimizer.parse_layout(ckpt)
    return [
        *commit.stale_metadata(ckpt),
        *commit.missing_files(ckpt),
        *commit.items_past_eof(ckpt),
        *commit.overlapping_items(ckpt),
        *commit.unreferenced_files(ckpt),
        *commit.chunks_without_storage(ckpt),
        *commit.unknown_version(ckpt),
        *tiling.all_tilings(list(ckpt.tensors.values())),
        *optimizer.no_optimizer(layout),
        *optimizer.state_shapes(ckpt, layout),
        *optimizer.state_presence(layout),
        *optimizer.mixed_precision(ckpt, layout),
    ]


def data_findings(ckpt: Checkpoint, report: DataReport) -> list[Finding]:
    """Rules over what reading every item found."""
    layout = optimizer.parse_layout(ckpt)
    items = {b.key: b for b in report.bytes_items}
    # Optimizers whose param groups only the bytes items tell (several params lists, the
    # flat layout): TP-CKPT-014 is decided here, the others' at the metadata level.
    known = optimizer.param_groups(layout, {})
    groups = optimizer.param_groups(layout, items)
    return [
        *data.item_problems(report.problems),
        *data.stored_matches_metadata(ckpt, report.tensors),
        *data.unverifiable_bytes(report.bytes_items),
        *data.sharded_bytes(report.bytes_items),
        *optimizer.state_presence(layout, {opt: g for opt, g in groups.items() if opt not in known}),
        *optimizer.params_lists(layout, items),
        *optimizer.step_consistency(layout, report.tensors, items, groups),
        *optimizer.state_values(layout, report.tensors),
    ]


def validate(
    path: str | os.PathLike[str], level: Level = Level.DATA, options: Options | None = None
) -> ValidationResult:
    """Validate one checkpoint directory in this process (OSError means "cannot tell")."""
    options = options or Options()
    started = time.monotonic()
    with gc_paused():
        outcome = read_checkpoint(path, options.metadata_size_cap)
    findings = commit.commit_state(outcome.listing.files)
    stats: dict[str, float | int | str] = {
        "files": len(outcome.listing.files),
        "bytes": sum(f.size for f in outcome.listing.files.values()),
    }
    ckpt = outcome.checkpoint
    if outcome.metadata_error is not None:
        for name, reason in sorted(outcome.errors.items()):
            findings += commit.metadata_unreadable(name, reason)
    elif ckpt is not None:
        stats.update(
            format=ckpt.format.value,
            metadata_files=len(ckpt.metadata_files),
            tensors=len(ckpt.tensors),
            chunks=len(ckpt.storage),
            referenced_bytes=ckpt.referenced_bytes,
        )
        with gc_paused():
            findings += metadata_findings(ckpt)
        if level in (Level.DATA, Level.LOAD):
            layout = optimizer.parse_layout(ckpt)
            report = read_data(
                ckpt,
                frozenset(layout.state),
                drop_cache=options.drop_cache,
                progress=options.progress,
            )
            stats["bytes_read"] = report.bytes_read
            findings += data_findings(ckpt, report)
        if level is Level.LOAD and status_of(findings) is Status.VALID:
            from torchpulse.checkpoints.load_check import load_findings

            findings += load_findings(ckpt, drop_cache=options.drop_cache)
    stats["duration_seconds"] = round(time.monotonic() - started, 6)
    # The verdict is taken over every finding, before any is left unlisted.
    status = status_of(findings)
    listed, counts = capped(findings)
    return ValidationResult(
        path=str(path),
        status=status,
        level=level,
        findings=tuple(listed),
        stats=stats,
        counts=counts,
    )
