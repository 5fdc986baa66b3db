"""Validation state that survives daemon restarts, in SQLite under the state directory.

A checkpoint is identified by its directory and the `stat` key of its
metadata (inode, mtime, size): a restart skips what was validated before and
re-validates a checkpoint overwritten in place. Announced roots are kept too,
so checkpoints committed while the daemon was down are found at start.
Writes are tiny and rare (one row per validation), so they run on the loop.
Rows of deleted checkpoint directories are forgotten (`prunable`, `forget`),
so the file stays as large as what is on disk, whatever the job's retention.

Nothing here raises: a state directory that cannot be written, or a file that
cannot be opened, leaves the state in memory (`persistent` is False, and one
warning says what that loses and how to fix it); a corrupt file is set aside for
a fresh one, and a read that fails answers "nothing known" (the checkpoint is
validated again), each logged with why.
A file removed while the daemon runs (`rm -r` of the state directory) is
written again, whole, from the open connection at the next write.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

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
# How long a write waits for another process's write lock (sqlite's default: 5 s). Writes run on the
# loop: someone holding the lock (a `sqlite3` shell left in a transaction) must not stall the daemon.
BUSY_TIMEOUT_SECONDS: Final = 0.5
# Primary result codes of a damaged file ("database disk image is malformed", "file is not a database").
_CORRUPT_CODES: Final = frozenset({sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB})
MEMORY_ONLY: Final = "checkpoint validation state is kept in memory only and lost at a restart"
# What a restart then costs: the state's two jobs (module docstring).
LOST: Final = (
    "after a restart every checkpoint under the configured roots is validated again (their status series "
    "are empty until then), and the roots jobs announced are forgotten: a save made there while the daemon "
    "was down is found only once a job announces a save there again"
)


class _Corrupt(sqlite3.DatabaseError):
    """The integrity check at open found damage."""


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


def _record(row: Any) -> Record:
    """A row of the checkpoints table (its columns in order, findings encoded) as a Record."""
    path, root, key, status, level, validated_at, committed_at, size, duration, findings = row
    return Record(path, root, key, status, level, validated_at, committed_at, size, duration, _decode(findings))


def _is_corrupt(exc: sqlite3.Error) -> bool:
    return isinstance(exc, _Corrupt) or (getattr(exc, "sqlite_errorcode", 0) & 0xFF) in _CORRUPT_CODES


def _open(path: Path | str) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None, timeout=BUSY_TIMEOUT_SECONDS)
    try:
        db.executescript(SCHEMA)
        columns = {row[1] for row in db.execute("PRAGMA table_info(announced_roots)")}
        if "last_announced_at" not in columns:
            db.execute(_LAST_ANNOUNCED)
        db.execute("PRAGMA journal_mode=WAL")
        # Damage past the schema pages shows only when a query reaches it: the first one at start
        # (restoring the gauges) would fail the daemon's start, every later one a validation or a sweep.
        problems = [str(row[0]) for row in db.execute("PRAGMA quick_check(3)")]
        if problems != ["ok"]:
            raise _Corrupt("; ".join(problems)[:300])
    except BaseException:
        db.close()
        raise
    return db


def _not_writable(directory: Path) -> str | None:
    """Why the daemon cannot create files in `directory` (made if missing), or None when it can."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / ".writable"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


class StateStore:
    """A SQLite file, or memory only when the state directory is not writable."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / DB_NAME
        self._failed_reads: set[str] = set()
        # (st_dev, st_ino) of the file the connection has open, to notice it was removed.
        self._identity: tuple[int, int] | None = None
        self._restore_error: str | None = None  # why writing a removed file again failed, logged once
        # Whether results go to the file: False when memory only, or while a removed file cannot be written again.
        self.persistent = False
        # Validation still works without the file; it stays in memory until a restart, which must then
        # re-validate what it cannot remember.
        self._db = self._open_persistent(state_dir) or _open(":memory:")

    def _open_persistent(self, state_dir: Path) -> sqlite3.Connection | None:
        """The state file's connection, or None after one warning that says why not, what is lost, the fix."""
        problem = _not_writable(state_dir)
        if problem is not None:
            log.warning(
                f"state directory not writable; {MEMORY_ONLY}",
                state_dir=str(state_dir),
                error=problem,
                lost=LOST,
                fix="make state_dir writable by the daemon's user (under systemd: keep it under "
                "StateDirectory=, /var/lib/torchpulse, or add it to ReadWritePaths=) and restart the daemon",
            )
            return None
        try:
            db = self._open_file()
        except sqlite3.Error as exc:
            log.warning(
                f"checkpoint state file cannot be opened; {MEMORY_ONLY}",
                path=str(self.path),
                error=str(exc),
                lost=LOST,
                fix="move the file aside (a new one is started) or make it "
                "readable and writable by the daemon's user, and restart the daemon",
            )
            return None
        self._identity = self._identity_at_path()
        self.persistent = True
        return db

    def _open_file(self) -> sqlite3.Connection:
        try:
            return _open(self.path)
        except sqlite3.Error as exc:
            if not _is_corrupt(exc):
                raise
            aside = self.path.with_name(f"{DB_NAME}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}")
            try:
                self.path.rename(aside)
                for suffix in ("-wal", "-shm"):  # they belong to the damaged file
                    self.path.with_name(DB_NAME + suffix).unlink(missing_ok=True)
            except OSError as move_error:
                raise sqlite3.OperationalError(f"{exc}; cannot set the file aside: {move_error}") from exc
            # Kept for a post-mortem; the checkpoints it remembered are validated once more.
            log.warning(
                "checkpoint state file is corrupt; set aside, starting a new one",
                path=str(self.path),
                moved_to=str(aside),
                error=str(exc),
            )
            return _open(self.path)

    def close(self) -> None:
        self._db.close()

    def _identity_at_path(self) -> tuple[int, int] | None:
        try:
            st = self.path.stat()
        except OSError:  # removed, or its directory too
            return None
        return st.st_dev, st.st_ino

    def _follow_removal(self) -> None:
        """Before a write: when the file was removed, write it again from the connection, which still reads it.

        An unlinked SQLite file takes writes without an error: every result
        since would be lost at the next restart, which validates everything
        again, and nothing would say so. A file found replaced by another one
        is left alone (an operator restoring a copy?), with one warning: it is
        what the next start reads.
        """
        if self._identity is None:
            return  # memory only
        now = self._identity_at_path()
        if now == self._identity:
            return
        if now is not None:
            self._identity = now
            log.warning(
                "checkpoint state file was replaced while the daemon ran; results go on to the file it "
                "opened, the next start reads the new one",
                path=str(self.path),
            )
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fresh = _open(self.path)  # set up as at start; the backup then replaces every page
            try:
                self._db.backup(fresh)
            except BaseException:
                fresh.close()
                raise
        except (OSError, sqlite3.Error) as exc:
            self.persistent = False
            error = str(exc)
            if self._restore_error != error:
                self._restore_error = error
                log.error(
                    "checkpoint state file was removed and cannot be written again; results are kept in "
                    "memory until a restart",
                    path=str(self.path),
                    error=error,
                )
            return
        self._db.close()
        self._db = fresh
        self._identity = self._identity_at_path()
        self._restore_error = None
        self.persistent = True
        log.warning(
            "checkpoint state file was removed while the daemon ran; wrote it again with everything it held",
            path=str(self.path),
        )

    def _read(self, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
        """Rows of a query, or none when the file cannot answer (logged once per reason)."""
        try:
            return self._db.execute(sql, params).fetchall()
        except sqlite3.Error as exc:
            if str(exc) not in self._failed_reads:
                self._failed_reads.add(str(exc))
                log.warning(
                    "cannot read the checkpoint state; what it holds counts as unknown",
                    path=str(self.path),
                    error=str(exc),
                )
            return []

    def key_of(self, path: str) -> str | None:
        rows = self._read("SELECT key FROM checkpoints WHERE path = ?", (path,))
        return str(rows[0][0]) if rows else None

    def keys_under(self, root: str) -> dict[str, str]:
        """Path -> key of every record whose directory lies under `root`, in one query.

        A sweep compares every checkpoint of a root with its record, on the
        loop: one lookup per directory blocked it ~0.2 s at 8,200 checkpoints.
        The range on the primary key reads just those rows ('0' follows '/').
        """
        prefix = root.rstrip("/")
        rows = self._read("SELECT path, key FROM checkpoints WHERE path > ? AND path < ?", (prefix + "/", prefix + "0"))
        return {str(path): str(key) for path, key in rows}

    def save(self, record: Record) -> bool:
        """Whether the record was written (a full or read-only disk refuses it)."""
        self._follow_removal()
        try:
            self._db.execute(
                "INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    record.path,
                    record.root,
                    record.key,
                    record.status,
                    record.level,
                    record.validated_at,
                    record.committed_at,
                    record.bytes,
                    record.duration_seconds,
                    _encode(record.findings),
                ),
            )
        except sqlite3.Error as exc:
            log.warning("cannot persist a checkpoint result", path=record.path, error=str(exc))
            return False
        return True

    def latest_per_root(self) -> list[Record]:
        """The most recent record of each root."""
        rows = self._read(
            # SQLite takes the bare columns from the row holding the MAX.
            "SELECT path, root, key, status, level, validated_at, MAX(committed_at), bytes, duration_seconds, "
            "findings FROM checkpoints GROUP BY root"
        )
        return [_record(row) for row in rows]

    def newest_of_root(self, root: str, paths: set[str]) -> Record | None:
        """The record with the newest commit among those of `root` whose directory is in `paths`."""
        rows = self._read(
            "SELECT path, root, key, status, level, validated_at, committed_at, bytes, duration_seconds, findings "
            "FROM checkpoints WHERE root = ? ORDER BY committed_at DESC",
            (root,),
        )
        return next((_record(row) for row in rows if row[0] in paths), None)

    def last_valid_per_root(self) -> dict[str, float]:
        """Commit time of each root's newest valid checkpoint."""
        rows = self._read("SELECT root, MAX(committed_at) FROM checkpoints WHERE status = 'valid' GROUP BY root")
        return {str(root): float(ts) for root, ts in rows}

    def prunable(self, exported: set[str]) -> list[tuple[str, float]]:
        """(path, validated_at) of every row but the newest and newest valid one of each root in `exported`.

        Those two stay even when their directories are gone: they restore the
        last-status and last-valid series at start. A root no longer exported
        (an expired announced root, one dropped from the config) restores
        nothing, so its rows go with their directories: a node that runs a new
        job every hour must not keep two rows of each one forever.
        """
        labels = sorted(exported)
        marks = ", ".join("?" * len(labels))
        rows = self._read(
            "SELECT path, validated_at FROM checkpoints WHERE path NOT IN ("
            f" SELECT path FROM (SELECT path, MAX(committed_at) FROM checkpoints WHERE root IN ({marks}) GROUP BY root)"
            " UNION"
            " SELECT path FROM (SELECT path, MAX(committed_at) FROM checkpoints"
            f"  WHERE status = 'valid' AND root IN ({marks}) GROUP BY root))",
            (*labels, *labels),
        )
        return [(str(path), float(at)) for path, at in rows]

    def forget(self, rows: list[tuple[str, float]]) -> None:
        """Delete rows by (path, validated_at): a row re-validated since it was listed stays."""
        self._follow_removal()
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
        rows = self._read(
            "SELECT path, COALESCE(last_announced_at, added_at) AS last FROM announced_roots ORDER BY last DESC"
        )
        return {str(path): float(last) for path, last in rows}

    def touch_announced_root(self, path: str, now: float) -> None:
        """Record an announcement under `path` (adding the root if it is new)."""
        self._follow_removal()
        try:
            self._db.execute(
                "INSERT INTO announced_roots (path, added_at, last_announced_at) VALUES (?, ?, ?) "
                "ON CONFLICT(path) DO UPDATE SET last_announced_at = excluded.last_announced_at",
                (path, now, now),
            )
        except sqlite3.Error as exc:
            log.warning("cannot persist an announced root", path=path, error=str(exc))

    def remove_announced_root(self, path: str) -> None:
        self._follow_removal()
        try:
            self._db.execute("DELETE FROM announced_roots WHERE path = ?", (path,))
        except sqlite3.Error as exc:
            log.warning("cannot forget an announced root", path=path, error=str(exc))
