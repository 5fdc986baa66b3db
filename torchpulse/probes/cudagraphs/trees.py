"""The CUDA-graph tree manager: what its log lines mean, and how many trees, nodes and pool bytes it holds.

Its lines are told apart by the frames they are logged from (see `torch_compat.TREES_RERECORD_REASON`);
its trees are read on the training thread, where the (thread-local) manager lives.
"""

from __future__ import annotations

import logging
import sys
from typing import Final, Literal, NamedTuple

from torchpulse.limits import MAX_SYMINT_IDS
from torchpulse.probes.agent.logs import get_logger
from torchpulse.probes.compile.reasons import classify_rerecord
from torchpulse.probes.torch_compat import cudagraph_trees as trees_compat
from torchpulse.probes.torch_compat import features

log = get_logger("torchpulse.probes")


class TreeEvent(NamedTuple):
    """One thing a line of the tree manager says: a warm-up, a recording, or a re-record and why."""

    kind: Literal["warmup", "recording", "rerecord"]
    reason: str = ""
    detail: str = ""


WARMUP: Final = TreeEvent("warmup")
RECORDING: Final = TreeEvent("recording")


def _rerecord(reason: str, detail: str) -> TreeEvent:
    return TreeEvent("rerecord", reason, detail)


def _warn_missing(name: str) -> None:
    feature = features.feature(name)
    log.warning("cudagraphs probe runs without a torch feature", feature=feature.name, reason=feature.reason)


class TreeLog:
    """Reads the lines of `torch_compat.CUDAGRAPH_TREES_LOGGER` (training thread, slow paths only)."""

    def __init__(self) -> None:
        self._frames_warned = False
        self._symint_ids: set[str] = set()

    def read(self, record: logging.LogRecord) -> list[TreeEvent]:
        msg = str(record.msg)
        args = record.args if isinstance(record.args, tuple) else ()
        events: list[TreeEvent] = []
        if trees_compat.TREES_WARMUP in msg:
            events.append(WARMUP)
        elif trees_compat.TREES_RERECORD in msg and len(args) >= 4:
            if self._frames() is None:
                # Without the frames: one line per recorded sibling that failed its checks, an over-count.
                events.append(_rerecord(classify_rerecord(str(args[3])), str(args[3])))
        elif trees_compat.TREES_SYMINT_RECORDING in msg and args:
            if self._is_new_shape(str(args[0])):
                events.append(_rerecord("new_dynamic_shape", msg % args))
        elif trees_compat.TREES_RECORDING in msg:
            frames = self._frames()
            if frames is not None:
                found, reason = trees_compat.caller_local(frames.run, trees_compat.TREES_RERECORD_REASON)
                if found and reason is not None:
                    events.append(_rerecord(classify_rerecord(str(reason)), str(reason)))
            events.append(RECORDING)
        return events

    def _is_new_shape(self, compile_id: str) -> bool:
        """Whether a symint recording re-records: the first shape of a compiled graph is its first recording."""
        frames = self._frames()
        if frames is not None:
            found, shapes = trees_compat.caller_local(frames.deferred, trees_compat.TREES_SHAPE_CACHE)
            if found:
                return bool(shapes)
        if compile_id in self._symint_ids:  # fallback: forward and backward share a compile id
            return True
        if len(self._symint_ids) < MAX_SYMINT_IDS:
            self._symint_ids.add(compile_id)
        return False

    def _frames(self) -> trees_compat.TreeFrames | None:
        frames = trees_compat.tree_frames()
        if frames is None and not self._frames_warned:
            self._frames_warned = True
            _warn_missing("cudagraph_tree_frames")
        return frames


class TreeCount(NamedTuple):
    """The tree managers of the calling thread, summed."""

    managers: int
    trees: int
    nodes: int
    pool_bytes: int | None


def count_trees() -> TreeCount | None:
    """The calling thread's trees now; None where this torch has no tree managers."""
    if trees_compat.CUDAGRAPH_TREES not in sys.modules:
        return _count([])  # nothing compiled with CUDA graphs here yet
    if not trees_compat.trees_loaded():
        return None
    return _count(list(trees_compat.tree_managers()))


def _count(managers: list[object]) -> TreeCount:
    trees = nodes = 0
    for manager in managers:
        t, n = trees_compat.count_tree_nodes(manager)
        trees, nodes = trees + t, nodes + n
    return TreeCount(len(managers), trees, nodes, trees_compat.pool_bytes(managers))


class TreeCensus:
    """Counts the trees again only when they may have changed: after a recording (`dirty`), or when the
    managers are others than last time (torch._dynamo.reset() drops them without a sign)."""

    def __init__(self) -> None:
        self.dirty = False  # set by whoever sees a recording
        self._seen: tuple[int, ...] = ()  # ids of the managers last read
        self._warned = False

    def poll(self) -> TreeCount | None:
        """The trees, if they may have changed since the previous poll; else None."""
        if trees_compat.CUDAGRAPH_TREES not in sys.modules or not self._usable():
            return None
        managers: list[object] = list(trees_compat.tree_managers())
        seen = tuple(id(manager) for manager in managers)
        if not (self.dirty or seen != self._seen):
            return None
        self.dirty, self._seen = False, seen
        return _count(managers)

    def _usable(self) -> bool:
        if trees_compat.trees_loaded():
            return True
        if not self._warned:
            self._warned = True
            _warn_missing("cudagraph_tree_managers")
        return False
