"""Validation state that survives daemon restarts, in SQLite under the state directory.

A checkpoint is identified by its directory and the `stat` key of its
metadata (inode, mtime, size): a restart skips what was validated before and
re-validates a checkpoint overwritten in place. Announced roots are kept too,
so checkpoints committed while the daemon was down are found at start.
Writes are tiny and rare (one row per validation), so they run on the loop.
Rows of deleted checkpoint directories are forgotten (`prunable`, `forget`),
so the file stays as large as what is on disk, whatever the job's retention.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import structlog

log = structlog.get_logger("torchpulse.daemon.checkpoints")
DB_NAME: Final = "checkpoints.sqlite3"
SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS checkpoints (
    path TEXT PRIMARY KEY,
    root TEXT NOT NULL,
    key TEXT NOT NULL,
    status TEXT NOT NULL,
    level TEXT NOT NULL,
    validated_at REAL NOT NULL,
    committed_at REAL NOT NULL,
    bytes INTEGER NOT NULL,
    duration_seconds REAL NOT NULL,
    findings TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS checkpoints_root ON checkpoints (root, committed_at);
CREATE TABLE IF NOT EXISTS announced_roots (path TEXT PRIMARY KEY, added_at REAL NOT NULL);
"""
# Added after the first release: databases written before it get the column at open.
_LAST_ANNOUNCED: Final = "ALTER TABLE announced_roots ADD COLUMN last_announced_at REAL"
# (rule, severity) -> count of findings, as stored in the `findings` column.
FindingCounts = dict[tuple[str, str], int]


@dataclass(frozen=True, slots=True)
class Record:
    """The outcome of validating one checkpoint directory."""

    path: str
    root: str
    key: str
    status: str
    level: str
    validated_at: float
    # mtime of the metadata (of the newest data file for an incomplete save):
    # "latest" means newest committed, whatever order validations ran in.
    committed_at: float
    bytes: int
    duration_seconds: float
    findings: FindingCounts


def _encode(findings: FindingCounts) -> str:
    return json.dumps([[rule, severity, n] for (rule, severity), n in sorted(findings.items())])


def _decode(text: str) -> FindingCounts:
    try:
        return {(str(rule), str(severity)): int(n) for rule, severity, n in json.loads(text)}
    except (ValueError, TypeError):
        return {}


class StateStore:
    """A SQLite file, or memory only when the state directory is not writable."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / DB_NAME
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None)
            self._db.executescript(SCHEMA)
            self._migrate()
            self._db.execute("PRAGMA journal_mode=WAL")
            self.persistent = True
        except sqlite3.Error as exc:
            # Validation still works; a restart re-validates what it cannot remember.
            log.warning("checkpoint state not persistent; using memory", path=str(self.path), error=str(exc))
            self._db = sqlite3.connect(":memory:", isolation_level=None)
            self._db.executescript(SCHEMA)
            self._migrate()
            self.persistent = False

    def _migrate(self) -> None:
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(announced_roots)")}
        if "last_announced_at" not in columns:
            self._db.execute(_LAST_ANNOUNCED)

    def close(self) -> None:
        self._db.close()

    def key_of(self, path: str) -> str | None:
        row = self._db.execute("SELECT key FROM checkpoints WHERE path = ?", (path,)).fetchone()
        return str(row[0]) if row else None

    def save(self, record: Record) -> bool:
        """Whether the record was written (a full or read-only disk refuses it)."""
        try:
            self._db.execute(
                "INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (record.path, record.root, record.key, record.status, record.level, record.validated_at,
                 record.committed_at, record.bytes, record.duration_seconds, _encode(record.findings)),
            )
        except sqlite3.Error as exc:
            log.warning("cannot persist a checkpoint result", path=record.path, error=str(exc))
            return False
        return True

    def latest_per_root(self) -> list[Record]:
        """The most recent record of each root."""
        rows = self._db.execute(
            # SQLite takes the bare columns from the row holding the MAX.
            "SELECT path, root, key, status, level, validated_at, MAX(committed_at), bytes, duration_seconds, "
            "findings FROM checkpoints GROUP BY root"
        ).fetchall()
        return [Record(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], _decode(r[9])) for r in rows]

    def last_valid_per_root(self) -> dict[str, float]:
        """Commit time of each root's newest valid checkpoint."""
        rows = self._db.execute(
            "SELECT root, MAX(committed_at) FROM checkpoints WHERE status = 'valid' GROUP BY root"
        ).fetchall()
        return {str(root): float(ts) for root, ts in rows}

    def prunable(self) -> list[tuple[str, float]]:
        """(path, validated_at) of every row but each root's newest and newest valid one.

        Those two stay even when their directories are gone: they restore the
        last-status and last-valid series at start.
        """
        rows = self._db.execute(
            "SELECT path, validated_at FROM checkpoints WHERE path NOT IN ("
            " SELECT path FROM (SELECT path, MAX(committed_at) FROM checkpoints GROUP BY root)"
            " UNION"
            " SELECT path FROM (SELECT path, MAX(committed_at) FROM checkpoints WHERE status = 'valid' GROUP BY root))"
        ).fetchall()
        return [(str(path), float(at)) for path, at in rows]

    def forget(self, rows: list[tuple[str, float]]) -> None:
        """Delete rows by (path, validated_at): a row re-validated since it was listed stays."""
        try:
            self._db.execute("BEGIN")  # one transaction: autocommit would sync once per row
            try:
                self._db.executemany("DELETE FROM checkpoints WHERE path = ? AND validated_at = ?", rows)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
        except sqlite3.Error as exc:
            log.warning("cannot forget checkpoint records", rows=len(rows), error=str(exc))

    def announced_roots(self) -> dict[str, float]:
        """Announced root -> when it was last announced (wall clock), most recent first."""
        rows = self._db.execute(
            "SELECT path, COALESCE(last_announced_at, added_at) AS last FROM announced_roots ORDER BY last DESC"
        ).fetchall()
        return {str(path): float(last) for path, last in rows}

    def touch_announced_root(self, path: str, now: float) -> None:
        """Record an announcement under `path` (adding the root if it is new)."""
        try:
            self._db.execute(
                "INSERT INTO announced_roots (path, added_at, last_announced_at) VALUES (?, ?, ?) "
                "ON CONFLICT(path) DO UPDATE SET last_announced_at = excluded.last_announced_at",
                (path, now, now),
            )
        except sqlite3.Error as exc:
            log.warning("cannot persist an announced root", path=path, error=str(exc))

    def remove_announced_root(self, path: str) -> None:
        try:
            self._db.execute("DELETE FROM announced_roots WHERE path = ?", (path,))
        except sqlite3.Error as exc:
            log.warning("cannot forget an announced root", path=path, error=str(exc))
