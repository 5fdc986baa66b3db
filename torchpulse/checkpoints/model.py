"""Typed, immutable view of one checkpoint directory and of validation results.

Everything here is plain data: the reader builds it, the rules consume it, the
worker serialises it. Nothing imports torch.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Final, NamedTuple

# Files a DCP save writes data to: torch.save zips, or safetensors (HuggingFaceStorageWriter).
DATA_SUFFIXES: Final = (".distcp", ".safetensors")


class Severity(enum.Enum):
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"


class Status(enum.Enum):
    VALID = "valid"
    INVALID = "invalid"
    INCOMPLETE = "incomplete"
    # The validator itself failed (I/O error, worker killed or timed out):
    # nothing is known about the checkpoint.
    ERROR = "error"


class Level(enum.Enum):
    METADATA = "metadata"
    DATA = "data"
    LOAD = "load"


@dataclass(frozen=True, slots=True)
class Finding:
    rule: str
    severity: Severity
    subject: str
    message: str

    def to_json(self) -> dict[str, str]:
        return {
            "rule": self.rule,
            "severity": self.severity.value,
            "subject": self.subject,
            "message": self.message,
        }


class Chunk(NamedTuple):
    """One saved piece of a tensor: a hyper-rectangle of the global tensor."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TensorEntry:
    key: str
    dtype: str
    size: tuple[int, ...]
    chunks: tuple[Chunk, ...]


class StorageEntry(NamedTuple):
    """Where one chunk (or one bytes item) lives on disk (a tuple: there may be millions)."""

    key: str
    # None for bytes items, the chunk's offsets for tensors.
    chunk_offsets: tuple[int, ...] | None
    relative_path: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()


_path_of, _length_of = itemgetter(2), itemgetter(4)  # StorageEntry fields, in C over a million entries


@dataclass(frozen=True, slots=True)
class FileInfo:
    name: str
    size: int
    mtime_ns: int


class Format(enum.Enum):
    TORCH_SAVE = "torch_save"
    # Hugging Face layout written by HuggingFaceStorageWriter: JSON headers, no pickle.
    SAFETENSORS = "safetensors"


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """The parsed metadata of one checkpoint plus what `stat` says about its files."""

    path: str
    format: Format
    # Name of the metadata file(s) actually used (".metadata", "__0.metadata", ...).
    metadata_files: tuple[FileInfo, ...]
    version: str | None
    tensors: Mapping[str, TensorEntry]
    bytes_keys: frozenset[str]
    storage: tuple[StorageEntry, ...]
    # Flat key -> path in the nested state dict (DCP planner_data), when present.
    key_paths: Mapping[str, tuple[str, ...]]
    files: Mapping[str, FileInfo]
    # Dotfiles and temporaries seen in the directory (".metadata.tmp", ...).
    temp_files: Mapping[str, FileInfo] = field(default_factory=dict)
    # The files some item lies in: three rules need them, and the set costs ~40 ms per million entries.
    referenced_paths: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "referenced_paths", frozenset(map(_path_of, self.storage)))

    @property
    def metadata_mtime_ns(self) -> int:
        return max((f.mtime_ns for f in self.metadata_files), default=0)

    @property
    def referenced_bytes(self) -> int:
        return sum(map(_length_of, self.storage))


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """What a data read found for one stored tensor chunk."""

    key: str
    chunk_offsets: tuple[int, ...]
    dtype: str
    shape: tuple[int, ...]
    nonfinite: int = 0
    negative: int = 0
    # The value of one-element tensors, used for `step` consistency.
    scalar: float | None = None


@dataclass(frozen=True, slots=True)
class StoredBytes:
    """A bytes item decoded safely; `verifiable` is False when it needed globals."""

    key: str
    verifiable: bool
    value: object = None
    reason: str = ""
    # Rank-local tensors pickled inside (a DTensor with Shard placements, a ShardedTensor): "" when none.
    sharded: str = ""


@dataclass(frozen=True, slots=True)
class ItemProblem:
    """A data-level read problem: CRC mismatch or an unreadable item."""

    kind: str  # "crc" | "unreadable"
    key: str
    relative_path: str
    detail: str


@dataclass(frozen=True, slots=True)
class DataReport:
    tensors: tuple[StoredTensor, ...]
    bytes_items: tuple[StoredBytes, ...]
    problems: tuple[ItemProblem, ...]
    bytes_read: int


@dataclass(frozen=True, slots=True)
class ValidationResult:
    path: str
    status: Status
    level: Level
    findings: tuple[Finding, ...]
    stats: Mapping[str, float | int | str]
    # The true number of findings per (rule, severity value), listed or not: validate lists
    # at most MAX_FINDINGS_PER_RULE of a rule. None: `findings` lists them all.
    counts: Mapping[tuple[str, str], int] | None = None

    def finding_counts(self) -> dict[tuple[str, str], int]:
        """How many findings of each (rule, severity value) the checkpoint has, listed or not."""
        if self.counts is not None:
            return dict(self.counts)
        return dict(Counter((f.rule, f.severity.value) for f in self.findings))

    def to_json(self) -> dict[str, object]:
        return {
            "path": self.path,
            "status": self.status.value,
            "level": self.level.value,
            "findings": [f.to_json() for f in self.findings],
            "finding_counts": [
                {"rule": rule, "severity": severity, "count": n}
                for (rule, severity), n in sorted(self.finding_counts().items())
            ],
            "stats": dict(self.stats),
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, object]) -> ValidationResult:
        raw_findings = obj.get("findings", [])
        assert isinstance(raw_findings, list)
        stats = obj.get("stats", {})
        assert isinstance(stats, dict)
        raw_counts = obj.get("finding_counts")
        counts: dict[tuple[str, str], int] | None = None
        if raw_counts is not None:
            assert isinstance(raw_counts, list)
            counts = {(str(c["rule"]), Severity(str(c["severity"])).value): int(c["count"]) for c in raw_counts}
        return cls(
            path=str(obj["path"]),
            status=Status(str(obj["status"])),
            level=Level(str(obj["level"])),
            findings=tuple(
                Finding(
                    rule=str(f["rule"]),
                    severity=Severity(str(f["severity"])),
                    subject=str(f["subject"]),
                    message=str(f["message"]),
                )
                for f in raw_findings
            ),
            stats=stats,
            counts=counts,
        )
