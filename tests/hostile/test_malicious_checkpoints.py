"""Malicious checkpoints: code-execution pickles, huge and deeply nested metadata, symlinks, FIFOs, devices.

Each is refused or reported; nothing is executed (a payload would create a
marker file); nothing hangs (the CLI runs under a timeout, and a FIFO that a
validator opened would block it).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import stat
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpoints.ckpt_corrupt import load_md, replace_item, save_md
from tests.support import REPO
from torchpulse.checkpoints import unpickler
from torchpulse.checkpoints.model import Level, Status
from torchpulse.checkpoints.unpickler import UnsafePickleError, load_metadata, load_plain, load_tensor_record
from torchpulse.checkpoints.validate import Options, validate
from torchpulse.checkpoints.worker import Limits, validate_in_worker

DATA = "__0_0.distcp"
LOADERS = {"metadata": load_metadata, "tensor": load_tensor_record, "plain": load_plain}
TABLES = {"metadata": unpickler._METADATA_GLOBALS, "tensor": unpickler._TENSOR_GLOBALS, "plain": {}}
ALLOWED_MODULES = sorted({module for table in TABLES.values() for module, _ in table})
# Names an attacker reaches for, plain and dotted through the allowed module's own globals.
ATTACK_NAMES = (
    "system",
    "os.system",
    "eval",
    "exec",
    "__import__",
    "getattr",
    "__builtins__.eval",
    "sys.modules",
    "subprocess.getoutput",
    "load",
    "_load_global_deps",
    "_C._jit_set_profiling",
)


def _str(op: bytes, text: str) -> bytes:
    raw = text.encode()
    return op + struct.pack("<I", len(raw)) + raw


def stack_global_call(module: str, name: str, command: str) -> bytes:
    """STACK_GLOBAL module.name, then REDUCE with one string argument."""
    return b"\x80\x04" + _str(b"X", module) + _str(b"X", name) + b"\x93" + _str(b"X", command) + b"\x85R."


def global_call(module: str, name: str, command: str) -> bytes:
    """Protocol-0 GLOBAL then REDUCE: the oldest spelling of the same attack."""
    return f"c{module}\n{name}\n(V{command}\ntR.".encode()


def inst_call(module: str, name: str, command: str) -> bytes:
    """INST: instantiates module.name(command) without REDUCE."""
    return f"(V{command}\ni{module}\n{name}\n.".encode()


def _touch(marker: Path) -> str:
    return f"touch {marker}"


@pytest.mark.parametrize("loader", sorted(LOADERS))
@pytest.mark.parametrize("module", ALLOWED_MODULES)
def test_attacks_through_every_allowed_module_are_refused(tmp_path: Path, loader: str, module: str) -> None:
    """Every allowed module, every attacker's name, three opcodes: refused before anything runs."""
    marker = tmp_path / "pwned"
    outcomes = set()
    for name in ATTACK_NAMES:
        for build in (stack_global_call, global_call, inst_call):
            try:
                LOADERS[loader](build(module, name, _touch(marker)))
            except UnsafePickleError:
                outcomes.add("refused")
            else:
                outcomes.add(f"accepted {module}.{name}")
    assert ({"refused"}, False) == (outcomes, marker.exists())


@pytest.mark.parametrize("loader", ["metadata", "tensor"])
def test_every_allowed_global_called_with_a_payload_executes_nothing(tmp_path: Path, loader: str) -> None:
    """Each allow-listed callable, called through REDUCE with a shell command, runs no command."""
    marker = tmp_path / "pwned"
    for module, name in TABLES[loader]:
        for build in (stack_global_call, global_call):
            try:
                LOADERS[loader](build(module, name, _touch(marker)))
            except Exception as exc:  # a refusal or a type error: both fine, as long as nothing ran
                assert not isinstance(exc, MemoryError | OSError), (module, name, exc)
    assert False is marker.exists()


class _Call:
    """Pickles as `func(*args)`, as an attacker's object would."""

    def __init__(self, func: object, *args: object) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return self.func, self.args


def _copy(saved: Path, tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    return ckpt


@pytest.mark.parametrize("module", sorted({m for m, _ in unpickler._METADATA_GLOBALS}))
def test_hostile_metadata_through_each_allowed_module_is_invalid(
    saved_checkpoint: Path, tmp_path: Path, module: str
) -> None:
    """A checkpoint whose `.metadata` calls os.system through an allowed module is invalid (TP-CKPT-012)."""
    marker = tmp_path / "pwned"
    ckpt = _copy(saved_checkpoint, tmp_path)
    (ckpt / ".metadata").write_bytes(stack_global_call(module, "os.system", _touch(marker)))
    result = validate(ckpt, Level.DATA)
    assert (Status.INVALID, ["TP-CKPT-012"], False) == (
        result.status,
        [f.rule for f in result.findings],
        marker.exists(),
    )


@pytest.mark.parametrize("key", ["model.0.weight", "optim.param_groups.0.lr"])
def test_hostile_data_items_are_reported_not_executed(saved_checkpoint: Path, tmp_path: Path, key: str) -> None:
    """A tensor item and a bytes item whose data.pkl calls os.system are reported at the data level."""
    marker = tmp_path / "pwned"
    ckpt = _copy(saved_checkpoint, tmp_path)
    md = load_md(ckpt)
    replace_item(ckpt, md, key, _Call(os.system, _touch(marker)))
    save_md(ckpt, md)
    result = validate(ckpt, Level.DATA)
    about_key = [f for f in result.findings if f.subject == key]
    assert (True, False) == (bool(about_key), marker.exists())
    assert any("refused" in f.message for f in about_key), about_key


def test_metadata_over_the_size_cap_is_refused_unread(saved_checkpoint: Path, tmp_path: Path) -> None:
    """A `.metadata` larger than the cap is reported invalid without being unpickled."""
    ckpt = _copy(saved_checkpoint, tmp_path)
    size = (ckpt / ".metadata").stat().st_size
    result = validate(ckpt, Level.METADATA, Options(metadata_size_cap=size - 1))
    assert (Status.INVALID, ["TP-CKPT-012"]) == (result.status, [f.rule for f in result.findings])
    assert "cap" in result.findings[0].message


def test_metadata_claiming_a_huge_tensor_allocates_nothing(saved_checkpoint: Path, tmp_path: Path) -> None:
    """An item claiming 2**62 bytes past the end of its file is reported, and the data level reads none of it."""
    ckpt = _copy(saved_checkpoint, tmp_path)
    md = load_md(ckpt)
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from tests.checkpoints.ckpt_corrupt import entry

    index, info = entry(md, "model.0.weight")
    md.storage_data[index] = _StorageInfo(info.relative_path, info.offset, 2**62)
    save_md(ckpt, md)
    result = validate(ckpt, Level.DATA)
    assert Status.INVALID == result.status
    assert any(f.subject == "model.0.weight" for f in result.findings)
    assert int(result.stats["bytes_read"]) < (ckpt / DATA).stat().st_size


def test_a_unicode_length_prefix_larger_than_memory_is_an_invalid_metadata(
    saved_checkpoint: Path, tmp_path: Path
) -> None:
    """BINUNICODE8 claiming a terabyte is read before it is decoded: reported as truncated metadata."""
    ckpt = _copy(saved_checkpoint, tmp_path)
    (ckpt / ".metadata").write_bytes(b"\x80\x05\x8d" + struct.pack("<Q", 1 << 40) + b"xx.")
    result = validate(ckpt, Level.METADATA)
    assert (Status.INVALID, ["TP-CKPT-012"]) == (result.status, [f.rule for f in result.findings])


@pytest.mark.parametrize("opcode", [b"\x8e", b"\x96"])  # BINBYTES8, BYTEARRAY8
def test_a_length_prefix_larger_than_memory_is_an_invalid_metadata(
    saved_checkpoint: Path, tmp_path: Path, opcode: bytes
) -> None:
    """Fifteen bytes that claim a terabyte are reported as unreadable metadata, not as a validator failure."""
    ckpt = _copy(saved_checkpoint, tmp_path)
    (ckpt / ".metadata").write_bytes(b"\x80\x05" + opcode + struct.pack("<Q", 1 << 40) + b"xx.")
    result = validate(ckpt, Level.METADATA)
    assert (Status.INVALID, ["TP-CKPT-012"]) == (result.status, [f.rule for f in result.findings])


def test_a_memo_index_larger_than_memory_is_an_invalid_metadata(saved_checkpoint: Path, tmp_path: Path) -> None:
    """Nine bytes that ask for a 16 GB memo are reported as invalid metadata by the worker, within its limits."""
    ckpt = _copy(saved_checkpoint, tmp_path)
    (ckpt / ".metadata").write_bytes(b"\x80\x02Nr" + struct.pack("<I", 1 << 30) + b".")
    result = validate_in_worker(ckpt, Level.METADATA, Limits(timeout_seconds=60, memory_bytes=2 << 30))
    assert (Status.INVALID, ["TP-CKPT-012"]) == (result.status, [f.rule for f in result.findings])


def test_non_integer_chunk_offsets_are_a_finding(saved_checkpoint: Path, tmp_path: Path) -> None:
    """A chunk whose offset is the string "0" gives an invalid result, not a TypeError."""
    ckpt = _copy(saved_checkpoint, tmp_path)
    md = load_md(ckpt)
    md.state_dict_metadata["model.0.weight"].chunks[0].offsets = ("0", 0)  # type: ignore[union-attr]
    save_md(ckpt, md)
    result = validate(ckpt, Level.METADATA)
    assert Status.INVALID == result.status


def _metadata_with(saved: Path, replacement: bytes, where: str) -> bytes:
    """Real metadata whose state_dict entry or planner path for model.0.weight is `replacement` opcodes."""
    md = pickle.loads((saved / ".metadata").read_bytes())  # the test's own pristine file
    placeholder = "PLACEHOLDERX"
    if where == "entry":
        md.state_dict_metadata["model.0.weight"] = placeholder
    else:
        md.planner_data["model.0.weight"] = ("model", placeholder)
    raw = pickle.dumps(md, protocol=2)  # no FRAME opcodes: the splice may change the length
    op = b"X" + struct.pack("<I", len(placeholder)) + placeholder.encode()
    assert 1 == raw.count(op)
    return raw.replace(op, replacement)


def _nested_list(depth: int) -> bytes:
    return b"]" * depth + b"a" * (depth - 1)


def test_deep_nesting_inside_a_refused_pickle_is_refused(tmp_path: Path) -> None:
    """A 100 000-deep list wrapped around a forbidden call is refused, with no recursion error or crash."""
    marker = tmp_path / "pwned"
    payload = (
        b"\x80\x04"
        + _nested_list(100_000)
        + b"\x94"
        + stack_global_call("builtins", "eval", f"open({str(marker)!r}, 'w')")[2:]
    )
    with pytest.raises(UnsafePickleError):
        load_metadata(payload)
    assert False is marker.exists()


MALFORMED = {
    "entry_is_an_int": (b"K\x05", "entry"),
    "entry_is_a_list": (b"]", "entry"),
    "entry_nested_100k_deep": (_nested_list(100_000), "entry"),
    "planner_path_nested_100k_deep": (_nested_list(100_000), "planner"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_accepted_but_malformed_metadata_is_a_finding(saved_checkpoint: Path, tmp_path: Path, case: str) -> None:
    """Allowed opcodes in the wrong place (an int entry, a list, 100 000-deep nesting) give an invalid result."""
    ckpt = _copy(saved_checkpoint, tmp_path)
    replacement, where = MALFORMED[case]
    (ckpt / ".metadata").write_bytes(_metadata_with(saved_checkpoint, replacement, where))
    result = validate(ckpt, Level.METADATA)
    assert (Status.INVALID, True) == (result.status, "TP-CKPT-012" in {f.rule for f in result.findings})


# -- the file system: symlinks out of the directory, FIFOs, devices (through the CLI, under a timeout) ----------


def _check(path: Path) -> tuple[int, dict[str, object]]:
    """`torchpulse check PATH --format json`; a hang fails the test instead of blocking it."""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "torchpulse", "check", str(path), "--format", "json"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"torchpulse check hung on {path}")
    return proc.returncode, json.loads(proc.stdout) if proc.stdout.strip() else {"stderr": proc.stderr}


def _messages(result: dict[str, object]) -> str:
    return json.dumps(result.get("findings", []))


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def test_filesystem_tricks_are_reported_and_nothing_outside_is_read(saved_checkpoint: Path, tmp_path: Path) -> None:
    """Symlinks out of the directory, a traversal path and FIFOs: each reported, none opened, no hang."""
    outside = tmp_path / "outside"
    outside.mkdir()
    trap = _fifo(outside / "trap")  # opening it for reading would block the validator forever

    cases: dict[str, Path] = {}
    # 1. The data file is a symlink to a FIFO outside the checkpoint.
    ckpt = cases["data_symlink_out"] = tmp_path / "data_symlink_out"
    shutil.copytree(saved_checkpoint, ckpt)
    (ckpt / DATA).unlink()
    (ckpt / DATA).symlink_to(trap)
    # 2. `.metadata` is a symlink to a real metadata file outside the directory.
    ckpt = cases["metadata_symlink_out"] = tmp_path / "metadata_symlink_out"
    shutil.copytree(saved_checkpoint, ckpt)
    shutil.copy(ckpt / ".metadata", outside / "metadata")
    (ckpt / ".metadata").unlink()
    (ckpt / ".metadata").symlink_to(outside / "metadata")
    # 3. The metadata points an item at ../outside/trap.
    ckpt = cases["relative_path_traversal"] = tmp_path / "relative_path_traversal"
    shutil.copytree(saved_checkpoint, ckpt)
    md = load_md(ckpt)
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    for index, info in list(md.storage_data.items()):
        md.storage_data[index] = _StorageInfo(os.path.relpath(trap, ckpt), info.offset, info.length)
    save_md(ckpt, md)
    # 4. The data file itself is a FIFO; 5. `.metadata` is a FIFO.
    ckpt = cases["data_is_fifo"] = tmp_path / "data_is_fifo"
    shutil.copytree(saved_checkpoint, ckpt)
    (ckpt / DATA).unlink()
    _fifo(ckpt / DATA)
    ckpt = cases["metadata_is_fifo"] = tmp_path / "metadata_is_fifo"
    shutil.copytree(saved_checkpoint, ckpt)
    (ckpt / ".metadata").unlink()
    _fifo(ckpt / ".metadata")

    outcomes = {}
    for name, ckpt in cases.items():
        code, result = _check(ckpt)
        outcomes[name] = (code, result.get("status"), bool(result.get("findings")))
    expected = {
        "data_symlink_out": (1, "invalid", True),
        "metadata_symlink_out": (3, "incomplete", True),
        "relative_path_traversal": (1, "invalid", True),
        "data_is_fifo": (1, "invalid", True),
        "metadata_is_fifo": (3, "incomplete", True),
    }
    assert expected == outcomes
    assert stat.S_ISFIFO(trap.lstat().st_mode)


def test_a_device_as_data_file_is_reported_without_reading_it(saved_checkpoint: Path, tmp_path: Path) -> None:
    """A character device (/dev/zero's numbers) in place of the data file is not read: it is not a regular file."""
    ckpt = _copy(saved_checkpoint, tmp_path)
    (ckpt / DATA).unlink()
    try:
        os.mknod(ckpt / DATA, 0o600 | stat.S_IFCHR, os.makedev(1, 5))
    except PermissionError:
        pytest.skip("creating a device node needs CAP_MKNOD")
    code, result = _check(ckpt)
    assert (1, "invalid", True) == (code, result.get("status"), DATA in _messages(result))
