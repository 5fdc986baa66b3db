"""Hostile items at the data level: broken zips, pickles that misuse allowed globals, bombs, and races.

Every case is a real checkpoint written by torch whose data file gets one
hand-made item appended (the metadata then points at it). Each must give a
finding (or, for the environment, "cannot tell"), never a traceback, a
crash, a hang or an allocation far beyond the item's size. Cases that could
crash or hang the process run through the CLI in a child under a timeout.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo

from tests.checkpoints.ckpt_corrupt import entry, load_md, save_md, settle
from tests.support import REPO
from tests.support.checkpoints import SAVE_SCRIPT
from torchpulse.checkpoints.data_reader import read_data
from torchpulse.checkpoints.model import Checkpoint, DataReport, Level, Status, ValidationResult
from torchpulse.checkpoints.reader import read_checkpoint
from torchpulse.checkpoints.validate import validate
from torchpulse.checkpoints.worker import Limits, validate_in_worker

DATA = "__0_0.distcp"
W, EXP_AVG, LR = "model.0.weight", "optim.state.0.weight.exp_avg", "optim.param_groups.0.lr"


def _copy(saved: Path, tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    settle(ckpt)
    return ckpt


def _with_item(saved: Path, tmp_path: Path, key: str, raw: bytes) -> Path:
    """A copy of `saved` whose item `key` is `raw`, appended to the data file (transforms kept)."""
    ckpt = _copy(saved, tmp_path)
    md = load_md(ckpt)
    index, info = entry(md, key)
    path = ckpt / info.relative_path
    offset = path.stat().st_size
    with open(path, "ab") as f:
        f.write(raw)
    md.storage_data[index] = _StorageInfo(info.relative_path, offset, len(raw), info.transform_descriptors)
    save_md(ckpt, md)
    return ckpt


def _zip(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, data in members:
            z.writestr(zipfile.ZipInfo(name), data)
    return buf.getvalue()


def _saved(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _members(raw: bytes) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(io.BytesIO(raw)) as z:
        return [(i.filename, z.read(i)) for i in z.infolist()]


def _findings(result: ValidationResult, key: str) -> list[tuple[str, str]]:
    return [(f.rule, f.message) for f in result.findings if f.subject == key]


def _cli(path: Path, timeout: float = 60) -> tuple[int, dict[str, object], str]:
    """`torchpulse check PATH --format json` in a child: a crash or a hang fails the test, not the run."""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "torchpulse", "check", str(path), "--format", "json"],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"torchpulse check hung on {path}")
    result = json.loads(proc.stdout) if proc.stdout.strip() else {}
    return proc.returncode, result, proc.stderr


def _cli_rules(result: dict[str, object], key: str) -> list[str]:
    findings = result.get("findings", [])
    assert isinstance(findings, list)
    return [f["rule"] for f in findings if f["subject"] == key]


# -- data.pkl of a tensor item: allowed globals called with the wrong things ----------------------------


def _s(text: str) -> bytes:
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


_PERSID = b"(" + _s("storage") + b"ctorch\nFloatStorage\n" + _s("0") + _s("cpu") + b"K\x20tQ"
_HOOKS = b"\x89ccollections\nOrderedDict\n)R"


def _rebuild(args: bytes) -> bytes:
    """`_rebuild_tensor_v2(<storage of 32 floats>, *args)`, as torch.save spells it."""
    return b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n(" + _PERSID + args + b"tR."


RECORDS = {
    "size_is_an_int": _rebuild(b"K\x00K\x08K\x01" + _HOOKS),
    "size_is_a_string": _rebuild(b"K\x00" + _s("ab") + b"K\x01\x85" + _HOOKS),
    "too_few_arguments": _rebuild(b""),
    "storage_type_called": b"\x80\x02ctorch\nFloatStorage\n)R.",
    "dtype_called": b"\x80\x02ctorch\nfloat32\n)R.",
    # Shape and dtype match the metadata; the values would lie past the storage (torch.load fails on both).
    "storage_offset_2_to_the_64": _rebuild(
        b"\x8a\x09" + (1 << 64).to_bytes(9, "little") + b"K\x08K\x04\x86K\x04K\x01\x86" + _HOOKS
    ),
    "view_past_its_storage": _rebuild(b"K\x00K\x08K\x04\x86K\x08K\x01\x86" + _HOOKS),
    "stride_of_another_rank": _rebuild(b"K\x00K\x08K\x04\x86K\x04\x85" + _HOOKS),
    "storage_key_is_a_list": _rebuild(b"K\x00K\x08K\x04\x86K\x04K\x01\x86" + _HOOKS).replace(_s("0"), b"]"),
    "hooks_with_arguments": _rebuild(b"K\x00K\x08K\x04\x86K\x04K\x01\x86\x89ccollections\nOrderedDict\n]\x85R"),
    "unhashable_dict_key": b"\x80\x02}]]s.",
    "build_on_a_list": b"\x80\x02]}b.",
    "bytes_claiming_a_terabyte": b"\x80\x05\x8e" + struct.pack("<Q", 1 << 40) + b"xx.",
}


@pytest.mark.parametrize("case", sorted(RECORDS))
def test_a_malformed_tensor_record_is_an_unreadable_item(saved_checkpoint: Path, tmp_path: Path, case: str) -> None:
    """Allowed globals given the wrong arguments, impossible BUILDs, a terabyte length: one finding, no traceback."""
    ckpt = _with_item(
        saved_checkpoint, tmp_path, W, _zip([("archive/data.pkl", RECORDS[case]), ("archive/data/0", bytes(128))])
    )
    result = validate(ckpt, Level.DATA)
    assert (Status.INVALID, ["TP-CKPT-024"]) == (result.status, [r for r, _ in _findings(result, W)])


@pytest.mark.parametrize("case", ["unhashable_dict_key", "build_on_a_list", "bytes_claiming_a_terabyte"])
def test_a_malformed_bytes_item_is_an_unreadable_item(saved_checkpoint: Path, tmp_path: Path, case: str) -> None:
    """The same broken pickles as a bytes item (plain unpickler): one finding, no traceback."""
    ckpt = _with_item(saved_checkpoint, tmp_path, LR, _zip([("archive/data.pkl", RECORDS[case])]))
    result = validate(ckpt, Level.DATA)
    assert (Status.INVALID, ["TP-CKPT-024"]) == (result.status, [r for r, _ in _findings(result, LR)])


@pytest.mark.parametrize("key", [W, LR])
def test_a_memo_index_far_past_the_pickle_is_refused_before_allocating(
    saved_checkpoint: Path, tmp_path: Path, key: str
) -> None:
    """Nine bytes that make the C unpickler zero a 1 GiB memo (and then unpickle None) are a finding."""
    pickled = b"\x80\x02Nr" + struct.pack("<I", 1 << 26) + b"."
    ckpt = _with_item(saved_checkpoint, tmp_path, key, _zip([("archive/data.pkl", pickled)]))
    result = validate(ckpt, Level.DATA)
    assert (Status.INVALID, ["TP-CKPT-024"]) == (result.status, [r for r, _ in _findings(result, key)])
    assert "memo" in _findings(result, key)[0][1]


def _deep_tuple_key(depth: int) -> bytes:
    """{((...(),)...): 1}: hashing the key recurses `depth` levels in C with no depth check."""
    return b"\x80\x02}" + b")" + b"\x85" * depth + b"K\x01s."


def _shared_tuple_key(levels: int) -> bytes:
    """{t: None} with t_(i+1) = (t_i, t_i): ~6 bytes a level, and hashing t visits 2**levels tuples."""
    pickled = b"\x80\x02)q\x00"
    for i in range(levels):
        pickled += b"h" + bytes([i]) + b"h" + bytes([i]) + b"\x86q" + bytes([i + 1])
    return pickled + b"}h" + bytes([levels]) + b"Ns."


def _shared_list_storage_key(levels: int) -> bytes:
    """A tensor record whose storage key is l_(i+1) = [l_i, l_i]: str() of it would be 2**levels long."""
    # Each level is memoized and popped, so only the last list is left for the storage key.
    shared = b"]q\x000" + b"".join(b"](h%ch%ceq%c0" % (i, i, i + 1) for i in range(levels)) + b"h%c" % levels
    return _rebuild(b"K\x00K\x08K\x04\x86K\x04K\x01\x86" + _HOOKS).replace(_s("0"), shared)


CRASH_OR_HANG = [
    (W, "deep_tuple_key", _deep_tuple_key(300_000)),
    (LR, "deep_tuple_key", _deep_tuple_key(300_000)),
    (W, "shared_tuple_key", _shared_tuple_key(60)),
    (LR, "shared_tuple_key", _shared_tuple_key(60)),
    (W, "shared_list_storage_key", _shared_list_storage_key(60)),
]


@pytest.mark.parametrize(("key", "case", "pickled"), CRASH_OR_HANG, ids=[f"{c}-{k}" for k, c, _ in CRASH_OR_HANG])
def test_pickles_that_crash_or_hang_the_unpickler_are_refused(
    saved_checkpoint: Path, tmp_path: Path, key: str, case: str, pickled: bytes
) -> None:
    """A 300 000-deep tuple key (a segfault in 3.11), a 370-byte key that takes 2**60 steps to hash, a storage
    key whose str() is 2**60 long: each is a finding (the CLI runs in a child under a timeout)."""
    ckpt = _with_item(
        saved_checkpoint, tmp_path, key, _zip([("archive/data.pkl", pickled), ("archive/data/0", bytes(128))])
    )
    code, result, stderr = _cli(ckpt)
    assert (1, "invalid", ["TP-CKPT-024"]) == (code, result.get("status"), _cli_rules(result, key)), stderr[-2000:]


def test_an_item_cannot_change_how_later_items_are_read(saved_checkpoint: Path, tmp_path: Path) -> None:
    """BUILD on an allowed global would set `HalfStorage.dtype = "float32"` for every later record in the process.

    Then a bias stored as float16 against float32 metadata (TP-CKPT-019) would pass unnoticed.
    """
    slot_state = b"(N}" + _s("dtype") + _s("float32") + b"st"
    ckpt = _with_item(
        saved_checkpoint,
        tmp_path,
        "model.0.bias",
        _zip(
            [("archive/data.pkl", b"\x80\x02ctorch\nHalfStorage\n" + slot_state + b"b."), ("archive/data/0", bytes(32))]
        ),
    )
    md = load_md(ckpt)
    _, info = entry(md, "model.0.bias")
    half = _saved(torch.zeros(5, dtype=torch.float16))
    with open(ckpt / DATA, "ab") as f:
        f.write(half)
    index, _ = entry(md, "model.2.bias")
    md.storage_data[index] = _StorageInfo(DATA, info.offset + info.length, len(half))
    save_md(ckpt, md)
    result = validate(ckpt, Level.DATA)
    assert (["TP-CKPT-024"], ["TP-CKPT-019"]) == (
        [r for r, _ in _findings(result, "model.0.bias")],
        [r for r, _ in _findings(result, "model.2.bias")],
    )


# -- the zip around the item ----------------------------------------------------------------------------


def _central(raw: bytes) -> tuple[int, list[int]]:
    """Offset of the end record and of each central directory entry of a (non-zip64) archive."""
    end = raw.rfind(b"PK\x05\x06")
    count, _, cd_offset = struct.unpack_from("<HII", raw, end + 10)
    at, entries = cd_offset, []
    for _ in range(count):
        entries.append(at)
        nlen, elen, clen = struct.unpack_from("<HHH", raw, at + 28)
        at += 46 + nlen + elen + clen
    return end, entries


def _add_zip64_extra(raw: bytes, field: int, extra: bytes) -> bytes:
    """Mark a 32-bit field (20 csize, 24 usize, 42 local offset) of the first central entry "in zip64 extra"."""
    out = bytearray(raw)
    end, (at, *_) = _central(raw)
    nlen, elen = struct.unpack_from("<HH", out, at + 28)
    struct.pack_into("<I", out, at + field, 0xFFFFFFFF)
    struct.pack_into("<H", out, at + 30, elen + len(extra))
    struct.pack_into("<I", out, end + 12, struct.unpack_from("<I", out, end + 12)[0] + len(extra))
    out[at + 46 + nlen : at + 46 + nlen] = extra
    return bytes(out)


def _zip64_locator_to(raw: bytes, where: int) -> bytes:
    """The end record defers to a zip64 end record at `where` (past anything a file can hold)."""
    end = raw.rfind(b"PK\x05\x06")
    patched = bytearray(raw)
    struct.pack_into("<I", patched, end + 16, 0xFFFFFFFF)
    return bytes(patched[:end]) + b"PK\x06\x07" + struct.pack("<IQI", 0, where, 1) + bytes(patched[end:])


def _duplicated(raw: bytes) -> bytes:
    """The real members, then a second `archive/data/0` (all NaN): which one a reader takes is up to it."""
    return _zip([*_members(raw), ("archive/data/0", b"\xff" * 128)])


ZIPS = {
    # A zip64 extra field too short for the fields the entry defers to it.
    "zip64_extra_too_short": lambda raw: _add_zip64_extra(_add_zip64_extra(raw, 24, b""), 20, b"\x01\x00\x00\x00"),
    "zip64_local_offset_2_to_the_64": lambda raw: _add_zip64_extra(
        raw, 42, b"\x01\x00\x08\x00" + struct.pack("<Q", (1 << 64) - 1)
    ),
    "zip64_end_record_at_2_to_the_64": lambda raw: _zip64_locator_to(raw, (1 << 64) - 1),
    "duplicated_member_name": _duplicated,
}


@pytest.mark.parametrize("case", sorted(ZIPS))
def test_a_lying_zip_structure_is_an_unreadable_item(saved_checkpoint: Path, tmp_path: Path, case: str) -> None:
    """Zip64 fields that are missing or point past 2**63, duplicated member names: one finding, no traceback."""
    raw = ZIPS[case](_saved(torch.zeros(8, 4)))
    ckpt = _with_item(saved_checkpoint, tmp_path, W, raw)
    result = validate(ckpt, Level.DATA)
    assert (Status.INVALID, ["TP-CKPT-024"]) == (result.status, [r for r, _ in _findings(result, W)])


def _nan_exp_avg() -> torch.Tensor:
    value = torch.zeros(8, 4)
    value[1, 2] = float("nan")
    return value


def test_values_are_checked_whatever_the_member_order(saved_checkpoint: Path, tmp_path: Path) -> None:
    """The storage stored before data.pkl (torch.load does not care) is still checked for NaN."""
    members = _members(_saved(_nan_exp_avg()))
    storage = next(m for m in members if m[0] == "archive/data/0")
    reordered = [storage, *(m for m in members if m is not storage)]
    ckpt = _with_item(saved_checkpoint, tmp_path, EXP_AVG, _zip(reordered))
    result = validate(ckpt, Level.DATA)
    assert ["TP-CKPT-021"] == [r for r, _ in _findings(result, EXP_AVG)]


def test_a_decoy_pickle_does_not_decide_what_is_checked(saved_checkpoint: Path, tmp_path: Path) -> None:
    """torch reads `<archive>/data.pkl`; a second data.pkl deeper in the zip must not steer the value check."""
    members = _members(_saved(_nan_exp_avg()))
    # Same dtype and shape, but its values start past the end of the storage: nothing left to check.
    decoy = _rebuild(b"M\x00\x10K\x08K\x04\x86K\x04K\x01\x86" + _HOOKS)
    at = next(i for i, m in enumerate(members) if m[0] == "archive/data/0")
    members.insert(at, ("archive/decoy/data.pkl", decoy))
    ckpt = _with_item(saved_checkpoint, tmp_path, EXP_AVG, _zip(members))
    result = validate(ckpt, Level.DATA)
    assert ["TP-CKPT-021"] == [r for r, _ in _findings(result, EXP_AVG)]


# -- zstd items -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def zstd_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("zstandard")
    out = tmp_path_factory.mktemp("hostile_zstd") / "zstd"
    subprocess.run([sys.executable, str(SAVE_SCRIPT), "zstd", str(out)], check=True, timeout=120)
    return out


def _zstd_rle_bomb(total: int, block: int = 128 << 10) -> bytes:
    """One zstd frame of RLE blocks (4 bytes each for 128 KiB of zeros): 256 KiB that inflate to 8 GiB."""
    frame = bytearray(b"\x28\xb5\x2f\xfd" + bytes([0x00, 7 << 3]))  # no content size; 128 KiB window
    blocks = total // block
    for i in range(blocks):
        frame += struct.pack("<I", block << 3 | 1 << 1 | (i == blocks - 1))[:3] + b"\0"
    return bytes(frame)


@pytest.mark.process
def test_a_zstd_bomb_is_a_finding_within_the_memory_limit(zstd_checkpoint: Path, tmp_path: Path) -> None:
    """256 KiB that inflate to 8 GiB, for a 128-byte tensor: refused once past the item's size, in a 3 GiB worker."""
    ckpt = _with_item(zstd_checkpoint, tmp_path, W, _zstd_rle_bomb(8 << 30))
    result = validate_in_worker(ckpt, Level.DATA, Limits(timeout_seconds=120, memory_bytes=3 << 30))
    assert (Status.INVALID, ["TP-CKPT-024"]) == (result.status, [r for r, _ in _findings(result, W)]), result


def test_a_corrupt_zstd_stream_is_a_finding(zstd_checkpoint: Path, tmp_path: Path) -> None:
    """Bytes that are not zstd at all: zstandard's own error becomes a finding."""
    ckpt = _with_item(zstd_checkpoint, tmp_path, W, b"garbage!" * 16)
    result = validate(ckpt, Level.DATA)
    assert (Status.INVALID, ["TP-CKPT-024"]) == (result.status, [r for r, _ in _findings(result, W)])


# -- the directory changing under the reader, and a reader without permission ---------------------------


def test_every_item_claiming_the_whole_file_reads_it_once(saved_checkpoint: Path, tmp_path: Path) -> None:
    """Overlapping items are TP-CKPT-007; reading each again would let a big .metadata read one file for hours."""
    ckpt = _copy(saved_checkpoint, tmp_path)
    md = load_md(ckpt)
    size = (ckpt / DATA).stat().st_size
    for index in list(md.storage_data):
        md.storage_data[index] = _StorageInfo(DATA, 0, size)
    save_md(ckpt, md)
    result = validate(ckpt, Level.DATA)
    assert (Status.INVALID, True) == (result.status, "TP-CKPT-007" in {f.rule for f in result.findings})
    assert int(result.stats["bytes_read"]) <= size


def _listed(saved: Path, tmp_path: Path) -> tuple[Path, Checkpoint]:
    ckpt = _copy(saved, tmp_path)
    outcome = read_checkpoint(ckpt)
    assert outcome.checkpoint is not None
    return ckpt, outcome.checkpoint


def test_a_data_file_swapped_for_a_fifo_after_the_listing_does_not_block(
    saved_checkpoint: Path, tmp_path: Path
) -> None:
    """Opening a FIFO without a writer blocks forever; it is reported as not a regular file instead."""
    ckpt, listed = _listed(saved_checkpoint, tmp_path)
    (ckpt / DATA).unlink()
    os.mkfifo(ckpt / DATA)
    outcome: dict[str, DataReport] = {}
    reader = threading.Thread(target=lambda: outcome.update(report=read_data(listed, frozenset())), daemon=True)
    reader.start()
    reader.join(30)
    if reader.is_alive():  # let the reader go before failing, so the test run does not hang on it
        os.close(os.open(ckpt / DATA, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(30)
        pytest.fail("the data reader blocked opening a FIFO")
    problems = outcome["report"].problems
    assert ({"unreadable"}, {"not a regular file"}) == ({p.kind for p in problems}, {p.detail for p in problems})


@pytest.mark.parametrize("change", ["deleted", "rewritten"])
def test_a_data_file_that_changes_after_the_listing_is_cannot_tell(
    saved_checkpoint: Path, tmp_path: Path, change: str
) -> None:
    """Deleted or rewritten between the listing and the read: the validator cannot tell, it does not say invalid."""
    ckpt, listed = _listed(saved_checkpoint, tmp_path)
    if change == "deleted":
        (ckpt / DATA).unlink()
    else:
        with open(ckpt / DATA, "ab") as f:
            f.write(b"appended by a save running now")
    with pytest.raises(OSError):
        read_data(listed, frozenset())


_WITHOUT_DAC_OVERRIDE = """
import ctypes, sys
class Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
class Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]
libc = ctypes.CDLL(None, use_errno=True)
header, data = Header(0x20080522, 0), (Data * 2)()
# root reads any file through CAP_DAC_OVERRIDE: drop every effective capability, keep the uid
if libc.capget(ctypes.byref(header), data) != 0 or libc.capset(ctypes.byref(header), data.__class__()) != 0:
    sys.exit(99)
from torchpulse.checkpoints.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_data_file_the_validator_may_not_read_is_cannot_tell(saved_checkpoint: Path, tmp_path: Path) -> None:
    """Mode 000 on the data file: exit 2 ("cannot tell"), never an invalid checkpoint (exit 1)."""
    ckpt = _copy(saved_checkpoint, tmp_path)
    (ckpt / DATA).chmod(0)
    argv = [str(ckpt), "--format", "json"]
    command = (
        [sys.executable, "-c", _WITHOUT_DAC_OVERRIDE, *argv]
        if os.geteuid() == 0
        else [sys.executable, "-m", "torchpulse", "check", *argv]
    )
    proc = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=REPO)
    if proc.returncode == 99:
        pytest.skip("cannot drop capabilities here")
    assert (2, "", True) == (proc.returncode, proc.stdout, "Permission denied" in proc.stderr), proc.stderr
