"""Hostile `.metadata` files are refused with a finding and nothing runs."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
from torch.distributed.checkpoint.metadata import Metadata

from torchpulse.checkpoints.model import Level, Status
from torchpulse.checkpoints.unpickler import UnsafePickleError, load_metadata
from torchpulse.checkpoints.validate import validate


class _Call:
    """Pickles as a call of `func(*args)`: what an attacker puts in a pickle."""

    def __init__(self, func: object, *args: object) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return self.func, self.args


def _marker_command(marker: Path) -> str:
    return f"touch {marker}"


def os_system_global(marker: Path) -> bytes:
    return pickle.dumps(_Call(os.system, _marker_command(marker)))


def eval_inside_real_metadata(marker: Path) -> bytes:
    md = Metadata(state_dict_metadata={"w": _Call(eval, f"open({str(marker)!r}, 'w')")})
    return pickle.dumps(md)


def dotted_name_in_allowed_module(marker: Path) -> bytes:
    # STACK_GLOBAL of ("torch.distributed.checkpoint.metadata", "os.system"): plain
    # pickle resolves the dotted name to os.system through the module's globals.
    module, name = b"torch.distributed.checkpoint.metadata", b"os.system"
    cmd = _marker_command(marker).encode()
    return (
        b"\x80\x04\x8c" + bytes([len(module)]) + module
        + b"\x8c" + bytes([len(name)]) + name + b"\x93"
        + b"\x8c" + bytes([len(cmd)]) + cmd + b"\x85R."
    )  # fmt: skip


def persistent_id_pickle(marker: Path) -> bytes:
    return b"\x80\x04\x8c\x03abc\x94Q."


HOSTILE = [os_system_global, eval_inside_real_metadata, dotted_name_in_allowed_module,
           persistent_id_pickle]  # fmt: skip


@pytest.mark.parametrize("make", HOSTILE, ids=[f.__name__ for f in HOSTILE])
def test_hostile_pickle_is_refused_without_side_effect(tmp_path: Path, make: object) -> None:
    """The allow-list raises before calling anything; the marker file never appears."""
    marker = tmp_path / "pwned"
    with pytest.raises(UnsafePickleError):
        load_metadata(make(marker))  # type: ignore[operator]
    assert False is marker.exists()


@pytest.mark.parametrize("make", HOSTILE, ids=[f.__name__ for f in HOSTILE])
def test_hostile_metadata_in_a_checkpoint_is_invalid(single_root: Path, tmp_path: Path, make: object) -> None:
    """Validating a checkpoint with hostile metadata reports TP-CKPT-012 and runs nothing."""
    marker = tmp_path / "pwned"
    ckpt = tmp_path / "ckpt"
    shutil.copytree(single_root / "single", ckpt)
    (ckpt / ".metadata").write_bytes(make(marker))  # type: ignore[operator]
    result = validate(ckpt, Level.DATA)
    rules = [f.rule for f in result.findings]
    assert (Status.INVALID, ["TP-CKPT-012"], False) == (result.status, rules, marker.exists())


def test_dotted_name_payload_really_runs_under_plain_pickle(tmp_path: Path) -> None:
    """Control: the dotted-name payload is live, so refusing it above means something."""
    marker = tmp_path / "pwned"
    pickle.loads(dotted_name_in_allowed_module(marker))
    assert True is marker.exists()


def test_oversized_metadata_is_refused(single_root: Path, tmp_path: Path) -> None:
    """A metadata file over the size cap is not read at all."""
    from torchpulse.checkpoints.validate import Options

    ckpt = tmp_path / "ckpt"
    shutil.copytree(single_root / "single", ckpt)
    result = validate(ckpt, Level.METADATA, Options(metadata_size_cap=100))
    assert ["TP-CKPT-012"] == [f.rule for f in result.findings]
