"""The C reader of `.metadata` and the C rule kernels, each against its Python reference.

The C reader must return exactly what the Python path builds, or decline (None);
a kernel may answer True only where its rule reports nothing.
"""

from __future__ import annotations

import os
import pickle
import re
import time
from pathlib import Path, PosixPath

import pytest
import torch
from ckpt_corrupt import CORRUPTIONS, corrupt_copy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from torchpulse.checkpoints import metaparse
from torchpulse.checkpoints.metaparse import Extracted
from torchpulse.checkpoints.model import Checkpoint, Chunk, FileInfo, Format, Level, StorageEntry, TensorEntry
from torchpulse.checkpoints.reader import extract_standins, gc_paused
from torchpulse.checkpoints.rules import commit, kernels
from torchpulse.checkpoints.unpickler import load_metadata
from torchpulse.checkpoints.validate import validate

_RANK_METADATA = re.compile(r"^(\.metadata|__\d+\.metadata)$")


def reference(data: bytes) -> Extracted | Exception:
    try:
        return extract_standins(load_metadata(data))
    except Exception as exc:
        return exc


def agrees(data: bytes) -> Extracted | None:
    """The C reader's answer, checked against the Python path's: equal (repr: types too), or a decline."""
    fast = metaparse.parse(data)
    if fast is not None:
        expected = reference(data)
        assert not isinstance(expected, Exception), f"C accepted what Python refuses: {expected!r}"
        assert repr(expected) == repr(fast)
    return fast


def metadata_files(*roots: Path) -> list[Path]:
    return sorted(p for root in roots for p in root.rglob("*") if _RANK_METADATA.match(p.name) and p.is_file())


def test_every_real_checkpoint_takes_the_fast_path_with_the_same_model(
    single_root: Path, dist2_root: Path, dist4_root: Path
) -> None:
    """Single-process, flat, zstd, 2- and 4-rank FSDP2, DDP, per-rank metadata: accepted, and equal."""
    files = metadata_files(single_root, dist2_root, dist4_root)
    assert len(files) >= 8
    declined = [str(f) for f in files if agrees(f.read_bytes()) is None]
    assert [] == declined


def _chunks(draw: st.DrawFn, ndim: int) -> list[ChunkStorageMetadata]:
    ints = st.integers(0, 1 << 40)
    n = draw(st.integers(0, 4))
    return [
        ChunkStorageMetadata(
            torch.Size(draw(st.lists(ints, min_size=ndim, max_size=ndim))),
            torch.Size(draw(st.lists(ints, min_size=ndim, max_size=ndim))),
        )
        for _ in range(n)
    ]


@st.composite
def metadata(draw: st.DrawFn) -> Metadata:
    """A DCP Metadata of real torch classes, with the variety DCP writes (and a little more)."""
    names = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=12)
    sdm: dict[str, object] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for key in draw(st.lists(names, max_size=5, unique=True)):
        if draw(st.booleans()):
            sdm[key] = BytesStorageMetadata()
            storage[MetadataIndex(key)] = _StorageInfo("__0_0.distcp", draw(st.integers(0, 99)), 3)
            continue
        ndim = draw(st.integers(0, 3))
        dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.float8_e4m3fn]))
        chunks = _chunks(draw, ndim)
        size = torch.Size(draw(st.lists(st.integers(0, 1 << 40), min_size=ndim, max_size=ndim)))
        sdm[key] = TensorStorageMetadata(TensorProperties(dtype=dtype), size, chunks)
        for i, chunk in enumerate(chunks):
            transforms = draw(st.sampled_from([None, [], ["zstd"], ("a", "b")]))
            info = _StorageInfo(
                f"__{i}_0.distcp", draw(st.integers(0, 1 << 50)), draw(st.integers(0, 1 << 50)), transforms
            )
            storage[MetadataIndex(key, chunk.offsets, i)] = info
    planner = {key: tuple(key.split(".")) + draw(st.sampled_from([(), (0,), ("x", 1)])) for key in sdm}
    meta = draw(
        st.sampled_from(
            [
                None,
                StorageMeta(checkpoint_id=PosixPath("/ckpt/step-1"), save_id="s"),
                StorageMeta(checkpoint_id="/ckpt", modules=["a"]),
            ]
        )
    )
    version = draw(st.sampled_from(["1.0.0", "1.1.0", None, "2.0"]))
    return Metadata(
        sdm,
        planner_data=draw(st.sampled_from([planner, None, {}])),
        storage_data=storage,
        storage_meta=meta,
        version=version,
    )


@settings(max_examples=200, deadline=None)
@given(metadata(), st.integers(2, 5))
def test_generated_metadata_in_every_protocol_is_read_fast_and_the_same(md: Metadata, protocol: int) -> None:
    """What DCP's classes pickle to (protocols 2 to 5: GLOBAL or STACK_GLOBAL, BINPUT or MEMOIZE, frames)."""
    assert agrees(pickle.dumps(md, protocol=protocol)) is not None


@pytest.fixture(scope="module")
def real_metadata(single_root: Path) -> bytes:
    return (single_root / "single" / ".metadata").read_bytes()


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=300, deadline=None)
@given(st.data())
def test_mutated_real_metadata_is_read_the_same_or_declined(real_metadata: bytes, data: st.DataObject) -> None:
    """Flipped, cut or inserted bytes: the C reader agrees with Python or leaves it to Python."""
    raw = bytearray(real_metadata)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw) - 1))
        edit = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        if edit == "flip":
            raw[at] = data.draw(st.integers(0, 255))
        elif edit == "cut":
            del raw[at:]
            if not raw:
                raw = bytearray(b"\x80")
        else:
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=3))
    agrees(bytes(raw))


@given(st.binary(max_size=200))
def test_arbitrary_bytes_are_read_the_same_or_declined(data: bytes) -> None:
    agrees(data)


# --- hand-made pickles for the semantics the Python stand-ins have -------------------------

_DCP = b"torch.distributed.checkpoint.metadata"


def _global(module: bytes, name: bytes) -> bytes:
    return b"c" + module + b"\n" + name + b"\n"


def _str(s: bytes) -> bytes:
    return b"\x8c" + bytes([len(s)]) + s


EMPTY_METADATA = b"\x80\x04" + _global(_DCP, b"Metadata") + b")\x81"


def test_a_state_dict_changed_after_build_is_not_seen_by_either() -> None:
    """BUILD is dict.update on the Metadata stand-in: a later SETITEM on the state dict does not reach it."""
    data = EMPTY_METADATA + b"}q\x00b" + b"h\x00" + _str(b"version") + _str(b"9.9") + b"s0."
    fast = agrees(data)
    assert fast is not None and fast.version is None


def test_a_key_given_twice_is_left_to_python() -> None:
    """{"a": bytes, "a": bytes}: Python's dict keeps one; the C reader declines instead of guessing."""
    item = _global(_DCP, b"BytesStorageMetadata") + b")\x81"
    state = b"}(" + _str(b"state_dict_metadata") + b"}(" + _str(b"a") + item + _str(b"a") + item + b"uu"
    data = EMPTY_METADATA + state + b"b."
    assert metaparse.parse(data) is None
    assert isinstance(reference(data), Extracted)


def test_a_refused_global_is_declined_and_python_refuses_it() -> None:
    data = b"\x80\x04" + _global(b"os", b"system") + _str(b"true") + b"\x85R."
    assert metaparse.parse(data) is None
    assert isinstance(reference(data), Exception)


def test_a_chunk_list_shared_by_many_tensors_is_declined_quickly() -> None:
    """20 000 chunks listed once and named by 2 000 tensors: 40 million chunks to build; the C reader stops early.

    The Python path builds them all (slowly: that is where the C reader leaves it); the C
    reader bounds its work by the pickle's length instead of running out of memory first.
    """
    chunk = (
        _global(_DCP, b"ChunkStorageMetadata")
        + b")\x81}("
        + _str(b"offsets")
        + b"K\x00\x85"
        + _str(b"sizes")
        + b"K\x01\x85ub"
    )
    chunks = b"(" + chunk * 20_000 + b"l\x94" + b"0"
    props = _global(_DCP, b"TensorProperties") + b")\x81" + _global(b"torch", b"float32") + b"\x85b"
    tensor = (
        _global(_DCP, b"TensorStorageMetadata")
        + b")\x81}("
        + _str(b"properties")
        + props
        + _str(b"size")
        + b"M\x20\x4e\x85"
        + _str(b"chunks")
        + b"h\x00ub"
    )
    items = b"".join(_str(str(i).encode()) + tensor for i in range(2_000))
    data = b"\x80\x04" + chunks + EMPTY_METADATA[2:] + b"}(" + _str(b"state_dict_metadata") + b"}(" + items + b"uub."
    started = time.monotonic()
    with gc_paused():  # as the reader calls it
        assert metaparse.parse(data) is None
    # About 0.1 s (0.5 million chunks built before it stops); the unbounded 40 million, a minute and 4 GB.
    assert time.monotonic() - started < 10


# --- the rule kernels -----------------------------------------------------------------------


def _without_c(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metaparse, "_metaparse", None)
    monkeypatch.setattr(kernels, "_kernels", None)


@pytest.mark.parametrize(("rule", "name", "corruption"), CORRUPTIONS, ids=[c[1] for c in CORRUPTIONS])
def test_findings_are_the_same_without_the_c_parts(
    single_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rule: str, name: str, corruption: object
) -> None:
    """Every corruption's metadata-level findings, with the C reader and kernels and with the Python paths."""
    broken = corrupt_copy(single_root / "single", tmp_path / name, corruption)  # type: ignore[arg-type]
    with_c = validate(broken, Level.METADATA)
    _without_c(monkeypatch)
    without = validate(broken, Level.METADATA)
    assert (with_c.status, with_c.findings) == (without.status, without.findings)


def test_kernels_accept_the_real_checkpoints(single_root: Path, dist2_root: Path, dist4_root: Path) -> None:
    """On pristine checkpoints every kernel answers True: the Python rules never run there."""
    from torchpulse.checkpoints.reader import read_checkpoint

    dirs = sorted({f.parent for f in metadata_files(single_root, dist2_root, dist4_root)})
    for d in dirs:
        ckpt = read_checkpoint(d).checkpoint
        assert ckpt is not None
        sizes = {name: f.size for name, f in ckpt.files.items()}
        tensors = [(t.key, t.chunks) for t in ckpt.tensors.values()]
        assert kernels.items_within(ckpt.storage, sizes), d
        assert kernels.items_disjoint(ckpt.storage), d
        if len(ckpt.metadata_files) == 1:  # per-rank metadata stores replicated items once per rank
            assert kernels.storage_matches(ckpt.storage, tensors, list(ckpt.bytes_keys)), d
        assert all(kernels.tiling_holds(t.chunks, t.size) for t in ckpt.tensors.values() if t.size), d


def test_the_synthetic_million_chunk_layout_is_accepted(tmp_path: Path) -> None:
    """The benchmark's MoE layout in small: every kernel says True and validation is valid."""
    from bench.checkpoint import synthetic_metadata

    md, end = synthetic_metadata(8192, 4096)
    (tmp_path / "__0_0.distcp").write_bytes(b"")
    os.truncate(tmp_path / "__0_0.distcp", end)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md))
    assert agrees((tmp_path / ".metadata").read_bytes()) is not None
    assert "valid" == validate(tmp_path, Level.METADATA).status.value


# --- the rule kernels against the rules without them, on generated layouts ------------------

_small = st.integers(-2, 6)
_offsets = st.one_of(st.none(), st.tuples(_small), st.tuples(_small, _small))


@st.composite
def checkpoints(draw: st.DrawFn) -> Checkpoint:
    """Small layouts where everything can go wrong: shared offsets, negative spans, missing files."""
    keys = draw(st.lists(st.sampled_from(["a", "b", "c", "d"]), unique=True, max_size=4))
    tensors = {}
    for key in keys[:3]:
        chunks = draw(st.lists(st.builds(Chunk, st.tuples(_small, _small), st.tuples(_small, _small)), max_size=4))
        tensors[key] = TensorEntry(key, "float32", (4, 4), tuple(chunks))
    bytes_keys = frozenset(keys[2:])
    storage = tuple(
        StorageEntry(key, offsets, path, offset, length)
        for key, offsets, path, offset, length in draw(
            st.lists(
                st.tuples(
                    st.sampled_from(["a", "b", "c", "d"]),
                    _offsets,
                    st.sampled_from(["f0", "f1", "gone"]),
                    st.integers(-3, 40),
                    st.integers(-3, 20),
                ),
                max_size=10,
            )
        )
    )
    if draw(st.booleans()):  # the common shape: one entry per chunk, laid out in order
        storage = tuple(
            StorageEntry(t.key, c.offsets, "f0", 8 * i, 8) for t in tensors.values() for i, c in enumerate(t.chunks)
        ) + tuple(StorageEntry(k, None, "f1", 0, 1) for k in bytes_keys)
    files = {"f0": FileInfo("f0", draw(st.integers(0, 64)), 1), "f1": FileInfo("f1", draw(st.integers(0, 64)), 1)}
    names = draw(st.sampled_from([[".metadata"], ["__0.metadata", "__1.metadata"]]))
    metadata = tuple(FileInfo(n, 1, 2) for n in names)
    return Checkpoint(
        path="/x",
        format=Format.TORCH_SAVE,
        metadata_files=metadata,
        version="1.0.0",
        tensors=tensors,
        bytes_keys=bytes_keys,
        storage=storage,
        key_paths={},
        files=files,
    )


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ckpt=checkpoints())
def test_kernel_rules_report_what_the_python_rules_report(ckpt: Checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """TP-CKPT-006, -007, -009 and -010 with the kernels give the same findings as without them."""
    from torchpulse.checkpoints.rules.tiling import all_tilings

    rules = [
        commit.items_past_eof,
        commit.overlapping_items,
        commit.chunks_without_storage,
        lambda c: all_tilings(list(c.tensors.values())),
    ]
    with_kernels = [rule(ckpt) for rule in rules]
    with monkeypatch.context() as m:
        m.setattr(kernels, "_kernels", None)
        assert with_kernels == [rule(ckpt) for rule in rules]
