"""Validation rules: pure functions over parsed inputs returning `Finding`s.

Each rule id is stable: dashboards, alerts and suppressions refer to it.
"""

from __future__ import annotations

from collections.abc import Mapping

from torchpulse.checkpoints.model import Finding, Severity

RULES: Mapping[str, str] = {
    "TP-CKPT-000": "the validator itself failed (I/O error, worker killed or timed out)",
    "TP-CKPT-001": "no .metadata: the save has not committed",
    "TP-CKPT-002": "only .metadata.tmp: the save crashed while committing",
    "TP-CKPT-003": ".metadata.tmp beside .metadata",
    "TP-CKPT-004": "a referenced file was modified after .metadata",
    "TP-CKPT-005": "a referenced file is missing",
    "TP-CKPT-006": "an item ends past the end of its file",
    "TP-CKPT-007": "items overlap inside a file",
    "TP-CKPT-008": "a data file is not referenced by the metadata",
    "TP-CKPT-009": "a chunk has no storage entry, or an entry no chunk",
    "TP-CKPT-010": "chunks do not tile the tensor exactly",
    "TP-CKPT-011": "unknown metadata version",
    "TP-CKPT-012": "metadata refused or unreadable",
    "TP-CKPT-013": "optimizer state shape differs from its parameter's",
    "TP-CKPT-014": "optimizer state missing for a parameter",
    "TP-CKPT-015": "param_groups params list misses or repeats a parameter",
    "TP-CKPT-016": "optimizer step values differ",
    "TP-CKPT-017": "no optimizer state in the checkpoint",
    "TP-CKPT-018": "mixed-precision optimizer state",
    "TP-CKPT-019": "stored dtype differs from the metadata",
    "TP-CKPT-020": "stored shape differs from the metadata",
    "TP-CKPT-021": "NaN or Inf in optimizer state",
    "TP-CKPT-022": "negative exp_avg_sq",
    "TP-CKPT-023": "CRC32 mismatch",
    "TP-CKPT-024": "unreadable item",
    "TP-CKPT-025": "bytes item not verifiable without executing it",
    "TP-CKPT-026": "optimizer state does not load resharded",
    "TP-CKPT-027": "bytes item holds sharded tensors (one rank's shards only)",
}

# Findings of these rules mean "not finished yet", not "broken".
INCOMPLETE_RULES = frozenset({"TP-CKPT-001", "TP-CKPT-002"})


def error(rule: str, subject: str, message: str) -> Finding:
    return Finding(rule, Severity.ERROR, subject, message)


def warning(rule: str, subject: str, message: str) -> Finding:
    return Finding(rule, Severity.WARNING, subject, message)


def info(rule: str, subject: str, message: str) -> Finding:
    return Finding(rule, Severity.INFO, subject, message)
