"""Rules that need only the metadata and `stat`: commit state and file layout."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from itertools import groupby, repeat
from operator import add, itemgetter, le, ne, or_

from torchpulse.checkpoints.model import DATA_SUFFIXES, Checkpoint, FileInfo, Finding
from torchpulse.checkpoints.rules import error, kernels, warning

KNOWN_VERSIONS = frozenset({None, "1.0.0", "safetensors"})


def commit_state(files: Mapping[str, FileInfo]) -> list[Finding]:
    """TP-CKPT-001/002/003: is there a committed `.metadata`, and is a commit half done?"""
    has_metadata = ".metadata" in files or any(n.startswith("__") and n.endswith(".metadata") for n in files)
    has_hf = any(n.endswith(".safetensors") for n in files)
    tmp = sorted(n for n in files if n.endswith(".metadata.tmp"))
    if not has_metadata and not has_hf:
        if tmp:
            return [
                error(
                    "TP-CKPT-002",
                    tmp[0],
                    "only the temporary metadata exists: the save crashed between writing it and renaming it",
                )
            ]
        data = sum(1 for n in files if n.endswith(DATA_SUFFIXES))
        return [
            error(
                "TP-CKPT-001",
                ".metadata",
                f"no .metadata yet ({data} data files present): not committed",
            )
        ]
    findings: list[Finding] = []
    committed = files.get(".metadata")
    for name in tmp:
        if committed is not None and files[name].mtime_ns >= committed.mtime_ns:
            findings.append(
                error(
                    "TP-CKPT-003",
                    name,
                    "a newer temporary metadata sits beside .metadata: an overwrite in place crashed while committing",
                )
            )
        else:
            findings.append(warning("TP-CKPT-003", name, "stale temporary metadata left beside .metadata"))
    return findings


# Column getters of StorageEntry, run in C by `map` over a million entries; each rule
# below first checks its whole column at C speed and walks entries in Python only
# when that check says there is something to report.
_key, _chunk_offsets = itemgetter(0), itemgetter(1)
_path, _offset, _length = itemgetter(2), itemgetter(3), itemgetter(4)
_path_offset = itemgetter(2, 3)
_UNBOUNDED = 1 << 127  # "no size": an entry in a missing file is TP-CKPT-005's business


def stale_metadata(ckpt: Checkpoint) -> list[Finding]:
    """TP-CKPT-004: a file the metadata references changed after the metadata was written."""
    if not ckpt.metadata_files:
        # A safetensors layout without an index (a Hugging Face Trainer's `checkpoint-N/`): there is
        # no metadata to be older than its files, and time 0 would flag every one of them.
        return []
    committed_at = ckpt.metadata_mtime_ns
    referenced = ckpt.referenced_paths
    # Timestamps are all this rule has, and a copy that does not keep them (cp without -p,
    # rsync without -t, most object-store downloads) can order a pristine checkpoint's files
    # either way: the message names that cause too, so nobody throws away a good copy unasked.
    return [
        error(
            "TP-CKPT-004",
            name,
            f"modified {(ckpt.files[name].mtime_ns - committed_at) / 1e9:.3f} s after the metadata: the "
            "checkpoint was overwritten in place and the metadata describes the old contents (or it was "
            "copied without keeping timestamps: compare with the original, copy with cp -p or rsync -t)",
        )
        for name in sorted(referenced)
        if name in ckpt.files and ckpt.files[name].mtime_ns > committed_at
    ]


def missing_files(ckpt: Checkpoint) -> list[Finding]:
    """TP-CKPT-005: every file the storage entries name exists."""
    if ckpt.referenced_paths <= ckpt.files.keys():
        return []
    counts: dict[str, int] = defaultdict(int)
    for s in ckpt.storage:
        if s.relative_path not in ckpt.files:
            counts[s.relative_path] += 1
    return [error("TP-CKPT-005", name, f"referenced by {n} items but missing") for name, n in sorted(counts.items())]


def items_past_eof(ckpt: Checkpoint) -> list[Finding]:
    """TP-CKPT-006: every item lies inside its file."""
    sizes = {name: f.size for name, f in ckpt.files.items()}
    if kernels.items_within(ckpt.storage, sizes):
        return []
    offsets = list(map(_offset, ckpt.storage))
    lengths = list(map(_length, ckpt.storage))
    limits = map(sizes.get, map(_path, ckpt.storage), repeat(_UNBOUNDED))
    if not offsets or (min(offsets) >= 0 and min(lengths) >= 0 and all(map(le, map(add, offsets, lengths), limits))):
        return []
    return _items_past_eof_exact(ckpt)


def _items_past_eof_exact(ckpt: Checkpoint) -> list[Finding]:
    out: list[Finding] = []
    for s in ckpt.storage:
        f = ckpt.files.get(s.relative_path)
        if f is not None and (s.offset < 0 or s.length < 0 or s.offset + s.length > f.size):
            out.append(
                error(
                    "TP-CKPT-006",
                    s.key,
                    f"bytes [{s.offset}, {s.offset + s.length}) of {s.relative_path} but the file has {f.size} bytes",
                )
            )
    return out


def overlapping_items(ckpt: Checkpoint) -> list[Finding]:
    """TP-CKPT-007: no two items share bytes of one file (sort by offset, O(n log n))."""
    if kernels.items_disjoint(ckpt.storage):
        return []
    # Sorted by (file, offset), items are disjoint exactly when each one ends
    # before the next one of its file starts (then no earlier item reaches further).
    # Empty items stay in: one inside another fails this check, and the exact walk,
    # which skips them, then decides.
    spans = sorted(ckpt.storage, key=_path_offset)
    paths = list(map(_path, spans))
    starts = list(map(_offset, spans))
    ends = list(map(add, starts, map(_length, spans)))
    other_file = map(ne, paths, paths[1:])
    if all(map(or_, other_file, map(le, ends, starts[1:]))):
        return []
    return _overlapping_items_exact(ckpt)


def _overlapping_items_exact(ckpt: Checkpoint) -> list[Finding]:
    by_file: dict[str, list[tuple[int, int, str]]] = defaultdict(list)
    for s in ckpt.storage:
        if s.length > 0:
            by_file[s.relative_path].append((s.offset, s.offset + s.length, s.key))
    out: list[Finding] = []
    for name, file_spans in sorted(by_file.items()):
        file_spans.sort()
        # The first item overlaps nothing, whatever its offset (a negative one is TP-CKPT-006's).
        (_, reach_end, reach_key), *rest = file_spans
        for start, end, key in rest:
            if start < reach_end:
                out.append(error("TP-CKPT-007", key, f"bytes [{start}, {end}) of {name} overlap {reach_key}"))
            if end > reach_end:
                reach_end, reach_key = end, key
    return out


def unreferenced_files(ckpt: Checkpoint) -> list[Finding]:
    """TP-CKPT-008: a data file no item points at is debris, often from an older save.

    An empty one holds nothing: DCP's FileSystemWriter opens `__<rank>_0.distcp` on
    every rank, so a rank left with nothing to write (all of a replicated state
    deduplicated to rank 0, `full_state_dict` saves) leaves a 0-byte file no item names.
    """
    referenced = ckpt.referenced_paths
    return [
        warning("TP-CKPT-008", name, "data file not referenced by the metadata")
        for name, info in sorted(ckpt.files.items())
        if name not in referenced and info.size > 0
    ]


def chunks_without_storage(ckpt: Checkpoint) -> list[Finding]:
    """TP-CKPT-009: each chunk and bytes item has exactly one storage entry, and vice versa."""
    tensors = [(t.key, t.chunks) for t in ckpt.tensors.values()]
    if kernels.storage_matches(ckpt.storage, tensors, list(ckpt.bytes_keys)):
        return []
    # Per key, the set of stored chunk offsets against the set of the metadata's,
    # built in C (`groupby` over entries, which DCP writes grouped by key); the
    # exact per-item pass below runs only when it has something to report.
    stored: dict[str, set[tuple[int, ...] | None]] = {}
    for key, entries in groupby(ckpt.storage, _key):
        offsets = stored.get(key)
        if offsets is None:
            offsets = stored[key] = set()
        offsets.update(map(_chunk_offsets, entries))
    duplicated = len(ckpt.metadata_files) == 1 and sum(map(len, stored.values())) != len(ckpt.storage)
    expected_keys = len(ckpt.tensors) + len(ckpt.bytes_keys - ckpt.tensors.keys())
    matches = (
        not duplicated
        and len(stored) == expected_keys
        and all(stored.get(t.key) == set(map(_offsets_of, t.chunks)) for t in ckpt.tensors.values())
        and all(stored.get(key) == {None} for key in ckpt.bytes_keys if key not in ckpt.tensors)
    )
    return [] if matches else _chunks_without_storage_exact(ckpt)


_offsets_of = itemgetter(0)  # Chunk -> offsets


def _chunks_without_storage_exact(ckpt: Checkpoint) -> list[Finding]:
    entries: dict[tuple[str, tuple[int, ...] | None], int] = defaultdict(int)
    for s in ckpt.storage:
        entries[(s.key, s.chunk_offsets)] += 1
    out: list[Finding] = []
    expected: set[tuple[str, tuple[int, ...] | None]] = set()
    for t in ckpt.tensors.values():
        for c in t.chunks:
            expected.add((t.key, c.offsets))
            if (t.key, c.offsets) not in entries:
                out.append(
                    error(
                        "TP-CKPT-009",
                        t.key,
                        f"chunk at {list(c.offsets)} has no storage entry: its bytes cannot be found",
                    )
                )
    for key in sorted(ckpt.bytes_keys):
        expected.add((key, None))
        if (key, None) not in entries:
            out.append(error("TP-CKPT-009", key, "bytes item has no storage entry"))
    for (key, offsets), n in sorted(entries.items(), key=lambda kv: kv[0][0]):
        where = "" if offsets is None else f" at {list(offsets)}"
        if (key, offsets) not in expected:
            out.append(error("TP-CKPT-009", key, f"storage entry{where} matches no chunk"))
        elif n > 1 and len(ckpt.metadata_files) == 1:
            # With per-rank metadata every rank stores its own copy of replicated items.
            out.append(error("TP-CKPT-009", key, f"{n} storage entries for one chunk{where}"))
    return out


def unknown_version(ckpt: Checkpoint) -> list[Finding]:
    """TP-CKPT-011: a metadata version this validator was not written against."""
    if ckpt.version in KNOWN_VERSIONS:
        return []
    return [
        warning(
            "TP-CKPT-011",
            ".metadata",
            f"metadata version {ckpt.version!r} is not one of those this validator knows; rules may miss problems",
        )
    ]


def metadata_unreadable(name: str, reason: str) -> list[Finding]:
    """TP-CKPT-012: the metadata was refused by the allow-list or could not be parsed."""
    return [error("TP-CKPT-012", name, f"metadata not read ({reason}); nothing in it was executed")]
