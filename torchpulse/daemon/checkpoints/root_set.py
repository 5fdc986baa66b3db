"""The roots wanted: configured ones, and those jobs announced saves under, each forgotten after a TTL.

An announced checkpoint whose directory falls under no root makes its parent a root (up to
`max_announced_roots`); past the cap, or saved directly under `/`, it is validated under the label
"other", which comes and goes like an announced root. Announced roots outlive a restart in the state store.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Final

import structlog

from torchpulse.daemon.checkpoints.config import CheckpointsConfig
from torchpulse.daemon.checkpoints.log_once import LogOnce
from torchpulse.daemon.checkpoints.paths import unusable_root
from torchpulse.daemon.checkpoints.state import StateStore
from torchpulse.daemon.checkpoints.stats import CheckpointStats

log = structlog.get_logger("torchpulse.daemon.checkpoints")
OTHER: Final = "other"


def label(root: str | None) -> str:
    """The `root` label of the series of checkpoints found under `root` (None: under no root)."""
    return OTHER if root is None else root


class RootSet:
    def __init__(
        self,
        config: Callable[[], CheckpointsConfig],
        store: StateStore,
        stats: CheckpointStats,
        clock: Callable[[], float],
        log_once: LogOnce,
    ) -> None:
        self._config = config
        self._store = store
        self._stats = stats
        self._clock = clock  # wall clock: announcement times outlive the process
        self._log_once = log_once
        self._announced: dict[str, float] = {}  # announced root -> last announcement
        # Last announcement of a save validated under root="other"; None: none within the TTL, and no "other"
        # series.
        self._other_announced: float | None = None

    def restore(self) -> None:
        """The announced roots and "other" as the state store left them, within today's cap."""
        restored_other = self._stats.roots.get(OTHER)
        if restored_other is not None:
            # Not stored as such: its last validation followed its last announcement by the validation's time.
            self._other_announced = restored_other.last_validation
            restored_other.last_announced = self._other_announced
        stored = self._stored_announced_roots()
        cap = self._config().max_announced_roots
        self._announced = dict(stored[:cap])
        self.forget(stored[cap:], "max_announced_roots was lowered")

    def _stored_announced_roots(self) -> list[tuple[str, float]]:
        """Announced roots from the state store, most recent first, forgetting any that cannot be a root.

        Versions before the check stored whatever agents sent (a NUL byte, `/`);
        one such row made every start fail.
        """
        kept: list[tuple[str, float]] = []
        for root, last in self._store.announced_roots().items():
            problem = unusable_root(root)
            if problem is None:
                kept.append((root, last))
                continue
            self._store.remove_announced_root(root)
            log.warning(
                "forgot a stored announced checkpoint root that cannot be watched", root=repr(root), reason=problem
            )
        return kept

    def apply_config(self) -> None:
        """A lowered max_announced_roots keeps the roots announced most recently, as a start would."""
        newest_first = sorted(self._announced.items(), key=lambda item: item[1], reverse=True)
        self.forget(newest_first[self._config().max_announced_roots :], "max_announced_roots was lowered")

    def wanted(self) -> dict[str, str]:
        """Root path -> configured observer (announced roots use the section's)."""
        config = self._config()
        roots = {root.path: root.observer if root.observer != "auto" else config.observer for root in config.roots}
        for path in self._announced:
            roots.setdefault(path, config.observer)
        return roots

    def exported_labels(self) -> set[str]:
        """Root labels whose series are exported now (and whose newest records the state store keeps)."""
        labels = {label(root) for root in self.wanted()}
        return labels | {OTHER} if self._other_announced is not None else labels

    def root_of(self, path: str) -> str | None:
        """The innermost wanted root `path` lies in, or None."""
        best: str | None = None
        for root in self.wanted():
            if (path == root or path.startswith(root.rstrip("/") + "/")) and (best is None or len(root) > len(best)):
                best = root
        return best

    def dropped(self, path: str, found_under: str | None) -> bool:
        """Whether `path` was found under a root that is no longer watched (SIGHUP removed it, or it expired).

        Its series were dropped with the root; a validation recorded under the
        old label, or under "other", would bring back a frozen status, and an
        alert on it, that nothing updates any more.
        """
        return found_under is not None and self.root_of(path) is None

    def expire(self) -> tuple[bool, bool]:
        """Forget announced roots (and "other") no job announced a save under for the TTL.

        Returns (an announced root expired, "other" expired): the caller syncs the watches or the series.
        """
        now = self._clock()
        ttl = self._config().announced_root_ttl_seconds
        expired = [(root, last) for root, last in self._announced.items() if now - last > ttl]
        self.forget(expired, "no save announced under it for the TTL")
        other_expired = self._other_announced is not None and now - self._other_announced > ttl
        if other_expired:
            # Otherwise its series, and NoValidCheckpointRecently on them, stay once the jobs past the cap ended.
            self._other_announced = None
            log.info('checkpoint root "other" expired: no save announced under it for the TTL', ttl_seconds=ttl)
        return bool(expired), other_expired

    def forget(self, roots: list[tuple[str, float]], reason: str) -> None:
        """Stop wanting these announced roots (the caller syncs the watches) and forget them for good."""
        config = self._config()
        for root, _ in roots:
            self._announced.pop(root, None)
            self._store.remove_announced_root(root)
            log.info(
                "announced checkpoint root no longer watched",
                root=root,
                reason=reason,
                ttl_seconds=config.announced_root_ttl_seconds,
                max_announced_roots=config.max_announced_roots,
            )

    def export_announced(self, root: str) -> None:
        """Export when a job last announced a save under `root`; nothing for a configured root.

        The alert on old checkpoints leaves an announced root alone once its jobs stopped
        saving (they ended), as it cannot for a configured one.
        """
        configured = any(r.path == root for r in self._config().roots)
        self._stats.root(label(root)).last_announced = None if configured else self._announced.get(root)

    def announced_under(self, path: str, run: str) -> bool:
        """A job announced a save at `path` (normalized, usable): returns whether the wanted roots changed.

        Under an announced root, that root lives on; under no root (the caller expired the announced roots
        first, which may make room), its parent becomes one while there is room.
        """
        root = self.root_of(path)
        if root in self._announced:
            self._touch(root)
            self.export_announced(root)
            return False
        if root is not None:
            return False
        changed = False
        parent = str(Path(path).parent)
        folded = f"folded {parent}"
        if parent == "/":
            # Refused as a root: watching / recursively walks the whole machine (network mounts included)
            # and, a prefix of every path, / would swallow every later announcement. The checkpoint is
            # still validated (under root="other"); a later save there is announced, and validated, again.
            self._log_once(
                f"top {path}",
                "checkpoint saved directly under /: validated, its parent not watched",
                run=run,
                path=path,
            )
        elif len(self._announced) < self._config().max_announced_roots:
            self._touch(parent)
            self._log_once.news_again(folded)  # folded again later (expired, slots full): news again
            changed = True
        else:
            # Warned once per directory through the bounded log-once set: one entry per folded directory
            # kept forever grew by one per job on a node that starts a new job every hour.
            self._log_once(
                folded,
                "too many announced checkpoint roots; this one is validated but not "
                'watched and its metrics use root="other"',
                root=parent,
                run=run,
                max_announced_roots=self._config().max_announced_roots,
            )
        if self.root_of(path) is None:
            self._other_announced = self._clock()
            self._stats.root(OTHER).last_announced = self._other_announced
        return changed

    def _touch(self, root: str) -> None:
        self._announced[root] = self._clock()
        self._store.touch_announced_root(root, self._announced[root])
