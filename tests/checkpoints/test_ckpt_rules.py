"""Rules as pure functions over hand-built inputs: no disk, no torch."""

from __future__ import annotations

import json
import time
from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from torchpulse.checkpoints.model import (
    Checkpoint,
    Chunk,
    FileInfo,
    Finding,
    Format,
    Severity,
    Status,
    StorageEntry,
    StoredBytes,
    StoredTensor,
    TensorEntry,
)
from torchpulse.checkpoints.rules import commit, data, optimizer, tiling
from torchpulse.checkpoints.unpickler import sharded_tensors_in
from torchpulse.checkpoints.validate import (
    MAX_FINDING_TEXT,
    MAX_FINDINGS_PER_RULE,
    MAX_LISTED_JSON_BYTES,
    capped,
    metadata_findings,
    status_of,
)


def tensor(key: str, size: tuple[int, ...], *chunks: Chunk, dtype: str = "float32") -> TensorEntry:
    return TensorEntry(key, dtype, size, chunks or (Chunk((0,) * len(size), size),))


def checkpoint(
    tensors: list[TensorEntry],
    storage: list[StorageEntry] | None = None,
    files: dict[str, FileInfo] | None = None,
    bytes_keys: frozenset[str] = frozenset(),
    metadata_mtime: int = 100,
) -> Checkpoint:
    if storage is None:
        storage, at = [], 0
        for t in tensors:
            for c in t.chunks:
                storage.append(StorageEntry(t.key, c.offsets, "__0_0.distcp", at, 10))
                at += 10
        for k in sorted(bytes_keys):
            storage.append(StorageEntry(k, None, "__0_0.distcp", at, 10))
            at += 10
    if files is None:
        end = max((s.offset + s.length for s in storage), default=0)
        files = {"__0_0.distcp": FileInfo("__0_0.distcp", end, 50)}
    return Checkpoint(
        path="/ckpt",
        format=Format.TORCH_SAVE,
        metadata_files=(FileInfo(".metadata", 1, metadata_mtime),),
        version="1.0.0",
        tensors={t.key: t for t in tensors},
        bytes_keys=bytes_keys,
        storage=tuple(storage),
        key_paths={},
        files=files,
    )


def rules(findings: list[Finding]) -> list[str]:
    return sorted(f.rule for f in findings)


def test_row_sharded_tensor_tiles_exactly() -> None:
    """Two row shards covering a 4x2 tensor are a valid tiling."""
    t = tensor("w", (4, 2), Chunk((0, 0), (2, 2)), Chunk((2, 0), (2, 2)))
    assert [] == tiling.exact_tiling(t)


def test_zero_size_chunk_at_dim_end_is_legal() -> None:
    """Uneven FSDP2 writes an empty chunk at offset == dim; that is not an error."""
    t = tensor("w", (5, 2), Chunk((0, 0), (3, 2)), Chunk((3, 0), (2, 2)), Chunk((5, 0), (0, 2)))
    assert [] == tiling.exact_tiling(t)


def test_gap_is_reported() -> None:
    """A missing shard leaves elements unwritten."""
    t = tensor("w", (4, 2), Chunk((0, 0), (2, 2)))
    assert ["TP-CKPT-010"] == rules(tiling.exact_tiling(t))


def test_overlap_of_equal_volume_is_reported() -> None:
    """Volume equals numel, yet two chunks overlap: a gap hides elsewhere."""
    t = tensor("w", (4, 2), Chunk((0, 0), (2, 2)), Chunk((1, 0), (2, 2)))
    assert ["TP-CKPT-010", "TP-CKPT-010"] == rules(tiling.exact_tiling(t))


def test_out_of_bounds_chunk_is_reported() -> None:
    """A chunk reaching past the tensor's shape is an error."""
    t = tensor("w", (4,), Chunk((0,), (2,)), Chunk((2,), (3,)))
    assert ["TP-CKPT-010"] == rules(tiling.exact_tiling(t))


def test_grid_tiling_with_two_sharded_dims() -> None:
    """A 2x2 grid of chunks (FSDP x TP) tiles a 4x4 tensor."""
    grid = [Chunk((r, c), (2, 2)) for r in (0, 2) for c in (0, 2)]
    assert [] == tiling.exact_tiling(tensor("w", (4, 4), *grid))


def test_moe_layout_is_fast() -> None:
    """4,096 expert chunks of one tensor are checked in well under a second."""
    chunks = [Chunk((i * 2, 0), (2, 16)) for i in range(4096)]
    started = time.perf_counter()
    findings = tiling.exact_tiling(tensor("experts", (8192, 16), *chunks))
    assert ([], True) == (findings, time.perf_counter() - started < 1.0)


@given(st.lists(st.integers(min_value=1, max_value=7), min_size=1, max_size=30), st.data())
def test_random_partitions_tile_and_dropping_one_breaks_it(widths: list[int], data: st.DataObject) -> None:
    """Any partition of a 1-D range tiles it; without one piece it does not."""
    chunks, at = [], 0
    for w in widths:
        chunks.append(Chunk((at,), (w,)))
        at += w
    assert [] == tiling.exact_tiling(tensor("w", (at,), *chunks))
    drop = data.draw(st.integers(min_value=0, max_value=len(chunks) - 1))
    rest = chunks[:drop] + chunks[drop + 1 :]
    if rest:
        assert ["TP-CKPT-010"] == rules(tiling.exact_tiling(tensor("w", (at,), *rest)))


def test_commit_state_without_metadata_is_incomplete() -> None:
    """Data files but no .metadata: the save has not committed."""
    files = {"__0_0.distcp": FileInfo("__0_0.distcp", 10, 1)}
    findings = commit.commit_state(files)
    assert (["TP-CKPT-001"], Status.INCOMPLETE) == (rules(findings), status_of(findings))


def test_commit_state_only_tmp() -> None:
    """Only .metadata.tmp: the save crashed while committing."""
    files = {".metadata.tmp": FileInfo(".metadata.tmp", 10, 1)}
    assert ["TP-CKPT-002"] == rules(commit.commit_state(files))


def test_newer_tmp_beside_metadata_is_an_error() -> None:
    """A fresher .metadata.tmp than .metadata means an overwrite crashed mid-commit."""
    files = {
        ".metadata": FileInfo(".metadata", 10, 1),
        ".metadata.tmp": FileInfo(".metadata.tmp", 10, 2),
    }
    assert [Severity.ERROR] == [f.severity for f in commit.commit_state(files)]


def test_stale_metadata() -> None:
    """A data file newer than .metadata is reported."""
    ckpt = checkpoint([tensor("w", (2,))], metadata_mtime=10)
    assert ["TP-CKPT-004"] == rules(commit.stale_metadata(ckpt))


def test_stale_metadata_says_by_how_much_and_names_a_copy_without_timestamps_as_a_cause() -> None:
    """Timestamps are the rule's only evidence: `cp` without -p makes a pristine copy look overwritten."""
    ckpt = checkpoint([tensor("w", (2,))], metadata_mtime=10)
    newer = ckpt.files[ckpt.storage[0].relative_path].mtime_ns
    [finding] = commit.stale_metadata(ckpt)
    assert f"modified {(newer - 10) / 1e9:.3f} s after the metadata" in finding.message
    assert "copied without keeping timestamps" in finding.message and "cp -p" in finding.message


def test_stale_metadata_needs_a_metadata_file() -> None:
    """A safetensors layout without an index has no metadata: its files are not "modified after" it."""
    ckpt = replace(checkpoint([tensor("w", (2,))], metadata_mtime=10), metadata_files=())
    assert [] == commit.stale_metadata(ckpt)


def test_the_referenced_files_follow_the_storage_entries_through_replace() -> None:
    """Three rules read `referenced_paths`: a checkpoint rebuilt with other storage must not keep the old set."""
    ckpt = checkpoint([tensor("w", (2,))])
    assert {ckpt.storage[0].relative_path} == ckpt.referenced_paths
    moved = replace(ckpt, storage=(ckpt.storage[0]._replace(relative_path="gone.distcp"),))
    assert frozenset({"gone.distcp"}) == moved.referenced_paths
    assert ["TP-CKPT-005"] == rules(commit.missing_files(moved))
    assert ["TP-CKPT-008"] == rules(commit.unreferenced_files(moved))


def test_items_past_eof_and_overlapping() -> None:
    """Items must lie inside their file and must not share bytes."""
    storage = [
        StorageEntry("a", (0,), "f", 0, 10),
        StorageEntry("b", (0,), "f", 5, 10),
        StorageEntry("c", (0,), "f", 15, 10),
    ]
    ckpt = checkpoint(
        [tensor("a", (1,)), tensor("b", (1,)), tensor("c", (1,))],
        storage,
        {"f": FileInfo("f", 20, 50)},
    )
    expected = (["TP-CKPT-006"], ["TP-CKPT-007"])
    assert expected == (rules(commit.items_past_eof(ckpt)), rules(commit.overlapping_items(ckpt)))


def test_chunk_without_storage_entry() -> None:
    """A chunk whose bytes are not indexed anywhere is reported."""
    t = tensor("w", (4,), Chunk((0,), (2,)), Chunk((2,), (2,)))
    ckpt = checkpoint([t], [StorageEntry("w", (0,), "__0_0.distcp", 0, 10)])
    assert ["TP-CKPT-009"] == rules(commit.chunks_without_storage(ckpt))


def test_findings_past_the_cap_of_their_rule_are_counted_and_summarised() -> None:
    """1,500 errors of one rule list 1,000 and one summary of the same severity; a small rule is listed whole."""
    findings = [Finding("TP-CKPT-009", Severity.ERROR, "w", f"chunk at [{i}] has no storage") for i in range(1500)]
    findings += [Finding("TP-CKPT-003", Severity.WARNING, ".metadata.tmp", "stale")] * 3
    listed, counts = capped(findings)
    errors = [f for f in listed if f.rule == "TP-CKPT-009"]
    assert {("TP-CKPT-009", "error"): 1500, ("TP-CKPT-003", "warning"): 3} == counts
    assert (MAX_FINDINGS_PER_RULE + 1, findings[:MAX_FINDINGS_PER_RULE]) == (len(errors), errors[:-1])
    assert Finding("TP-CKPT-009", Severity.ERROR, "", "... and 500 more findings of this rule omitted") == errors[-1]
    assert (3, Status.INVALID) == (sum(f.rule == "TP-CKPT-003" for f in listed), status_of(listed))


def test_megabyte_keys_and_non_ascii_text_stay_inside_the_listed_bytes_budget() -> None:
    """Forty rules of 1,000 findings on a 10 MB non-ASCII key: text cut, JSON bounded, every finding counted."""
    key = "\u00e9" * 10_000_000
    findings = [Finding(f"TP-X-{r}", Severity.ERROR, key, "\u00e9" * 5000) for r in range(40) for _ in range(1000)]
    listed, counts = capped(findings)
    summaries = [f for f in listed if f.message.endswith("more findings of this rule omitted")]
    assert (40, {1000}) == (len(counts), set(counts.values()))
    assert MAX_FINDING_TEXT + 40 > max(max(len(f.subject), len(f.message)) for f in listed)
    assert len(json.dumps([f.to_json() for f in listed])) < MAX_LISTED_JSON_BYTES + (64 << 10)
    omitted = sum(int(f.message.split()[2].replace(",", "")) for f in summaries)
    assert 40_000 == len(listed) - len(summaries) + omitted


def optim_checkpoint(exp_avg_shape: tuple[int, ...] = (4, 2), with_bias_exp_avg: bool = True) -> Checkpoint:
    tensors = [
        tensor("model.w", (4, 2)),
        tensor("model.b", (4,)),
        tensor("optim.state.w.step", ()),
        tensor("optim.state.w.exp_avg", exp_avg_shape),
        tensor("optim.state.b.step", ()),
    ]
    if with_bias_exp_avg:
        tensors.append(tensor("optim.state.b.exp_avg", (4,)))
    return checkpoint(tensors, bytes_keys=frozenset({"optim.param_groups.0.params"}))


def test_layout_without_planner_data() -> None:
    """Keys alone are enough to find optimizer state, params lists and parameters."""
    layout = optimizer.parse_layout(optim_checkpoint())
    expected = ({"optim"}, {"optim.param_groups.0.params": "optim"}, {"w": "model.w", "b": "model.b"})
    assert expected == (layout.optimizers, dict(layout.params_lists), dict(layout.params))


def test_state_shape_and_presence() -> None:
    """A state tensor of the wrong shape and a parameter missing a state entry are errors."""
    ckpt = optim_checkpoint(exp_avg_shape=(2, 4), with_bias_exp_avg=False)
    layout = optimizer.parse_layout(ckpt)
    found = rules(optimizer.state_shapes(ckpt, layout) + optimizer.state_presence(layout))
    assert ["TP-CKPT-013", "TP-CKPT-014"] == found


def test_params_list_missing_and_duplicated() -> None:
    """Every stateful parameter appears exactly once across the params lists."""
    layout = optimizer.parse_layout(optim_checkpoint())
    item = StoredBytes("optim.param_groups.0.params", True, ["w", "w"])
    found = optimizer.params_lists(layout, {item.key: item})
    assert ["b has state but", "w listed 2 time"] == sorted(f.message[:15] for f in found)


def test_step_values_and_state_values() -> None:
    """Different steps, NaN and negative second moments are each reported once."""
    layout = optimizer.parse_layout(optim_checkpoint())
    stored = [
        StoredTensor("optim.state.w.step", (), "float32", (), scalar=3.0),
        StoredTensor("optim.state.b.step", (), "float32", (), scalar=4.0),
        StoredTensor("optim.state.w.exp_avg", (0, 0), "float32", (4, 2), nonfinite=2),
    ]
    found = optimizer.step_consistency(layout, stored, {}) + optimizer.state_values(layout, stored)
    assert ["TP-CKPT-016", "TP-CKPT-021"] == rules(found)


def test_a_step_too_large_for_a_float_is_reported_not_raised() -> None:
    """A hostile bytes item `step = 10**400`: float() of it raises OverflowError; the rule still reports."""
    layout = optimizer.parse_layout(optim_checkpoint())
    items = {
        "optim.state.w.step": StoredBytes("optim.state.w.step", True, 10**400),
        "optim.state.b.step": StoredBytes("optim.state.b.step", True, 3),
    }
    (found,) = optimizer.step_consistency(layout, [], items)
    assert found.rule == "TP-CKPT-016" and "3 for 1 (b)" in found.message and "1000000" in found.message


def test_no_optimizer_state_is_an_info_finding() -> None:
    """A model-only checkpoint says so instead of passing silently."""
    findings = metadata_findings(checkpoint([tensor("model.w", (2,))]))
    assert (["TP-CKPT-017"], Status.VALID) == (rules(findings), status_of(findings))


_EXTRA = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "c"]),
        st.integers(0, 2),
        st.sampled_from(["f", "g", "missing"]),
        st.integers(-2, 50),
        st.integers(-1, 12),
    ),
    max_size=4,
)


@given(st.sets(st.integers(0, 3), max_size=2), _EXTRA, st.sets(st.sampled_from(["a", "b", "c"])), st.booleans())
def test_layout_rules_fast_paths_agree_with_the_exact_walks(
    dropped: set[int], extra: list[tuple[str, int, str, int, int]], bytes_keys: set[str], per_rank: bool
) -> None:
    """The C-speed whole-column checks answer exactly what the per-item walks answer, on layouts
    made from a valid one by dropping, duplicating, moving and adding entries."""
    base = [("a", 0, "f", 0, 10), ("a", 1, "f", 10, 10), ("b", 0, "f", 20, 10), ("b", 1, "f", 30, 10)]
    raw = [entry for i, entry in enumerate(base) if i not in dropped] + extra
    storage = [StorageEntry(key, (o,), path, offset, length) for key, o, path, offset, length in raw]
    storage += [StorageEntry(key, None, "f", 50, 1) for key in sorted(bytes_keys)]
    tensors = [tensor(k, (4,), *(Chunk((o,), (1,)) for o in (0, 1))) for k in ("a", "b") if k not in bytes_keys]
    ckpt = checkpoint(
        tensors, storage, {"f": FileInfo("f", 60, 50), "g": FileInfo("g", 8, 50)}, bytes_keys=frozenset(bytes_keys)
    )
    if per_rank:
        ckpt = replace(ckpt, metadata_files=(FileInfo("__0.metadata", 1, 100), FileInfo("__1.metadata", 1, 100)))
    assert commit._items_past_eof_exact(ckpt) == commit.items_past_eof(ckpt)
    assert commit._overlapping_items_exact(ckpt) == commit.overlapping_items(ckpt)
    assert commit._chunks_without_storage_exact(ckpt) == commit.chunks_without_storage(ckpt)


def test_sharded_tensors_inside_a_bytes_item_are_named_from_its_globals() -> None:
    """A pickle naming DTensor with a Shard placement, or ShardedTensor, holds rank-local data; Replicate alone not."""

    def pickle_of(*globals_: str) -> bytes:  # protocol 2, as torch.save writes: GLOBAL opcodes, never executed
        return b"\x80\x02" + b"".join(b"c" + g.replace(" ", "\n").encode() + b"\n" for g in globals_) + b"."

    dtensor = "torch.distributed.tensor DTensor"
    assert ["DTensor with Shard placements", "", "ShardedTensor", ""] == [
        sharded_tensors_in(pickle_of(dtensor, "torch.distributed.tensor.placement_types Shard")),
        sharded_tensors_in(pickle_of(dtensor, "torch.distributed.tensor.placement_types Replicate")),
        sharded_tensors_in(pickle_of("torch.distributed._shard.sharded_tensor.api ShardedTensor")),
        sharded_tensors_in(pickle_of("torch._utils _rebuild_tensor_v2", "mylib.placement Shard")),
    ]


def test_a_bytes_item_with_sharded_tensors_is_an_error_not_an_unverifiable_item() -> None:
    """TP-CKPT-027 names the item holding one rank's shards; TP-CKPT-025 keeps the other unverifiable items."""
    items = [
        StoredBytes(
            "model",
            False,
            None,
            "refused global torch._utils._rebuild_wrapper_subclass",
            "DTensor with Shard placements",
        ),
        StoredBytes("ema", False, None, "refused global types.SimpleNamespace"),
        StoredBytes("epoch", True, 3),
    ]
    assert ([("TP-CKPT-027", "model", "error")], [("TP-CKPT-025", "ema", "info")]) == (
        [(f.rule, f.subject, f.severity.value) for f in data.sharded_bytes(items)],
        [(f.rule, f.subject, f.severity.value) for f in data.unverifiable_bytes(items)],
    )
