"""atheris harness: the `.metadata` allow-list unpickler, the C reader, and the reader and rules behind them.

Run: `.venv/bin/python fuzz/fuzz_metadata.py -max_total_time=60 [libFuzzer flags] [corpus dirs]`.

A crash is: the unpickler doing anything an attacker wants (an audit event for
a process, exec, compile, import or open while it runs), raising MemoryError
or OSError (the reader would report "cannot tell" instead of "invalid"), the C
reader (`metaparse.parse`) disagreeing with the Python path it stands in for, the
reader raising instead of returning a finding, or a rule raising on metadata
the reader accepted. Known, reported bugs are counted
and printed once instead (see fuzz/common.py; FUZZ_STRICT=1 crashes on them).
"""

from __future__ import annotations

import encodings.raw_unicode_escape  # noqa: F401  (see below)
import io
import pickle
import pickletools  # noqa: F401
import resource
import sys
import tempfile
from pathlib import Path
from typing import Any

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

with atheris.instrument_imports(include=["torchpulse.checkpoints"]):
    from torchpulse.checkpoints import metaparse
    from torchpulse.checkpoints.reader import extract_standins, read_checkpoint
    from torchpulse.checkpoints.unpickler import load_metadata
    from torchpulse.checkpoints.validate import metadata_findings

from fuzz.common import known, run

# The reader imports pickletools on a MemoryError and CPython's unpickler imports the
# raw_unicode_escape codec at its first UNICODE opcode: both are imported above, so that an
# import while unpickling is only ever what the harness looks for.
_FORBIDDEN_EVENTS = (
    "os.system",
    "subprocess.Popen",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.fork",
    "exec",
    "compile",
    "import",
    "open",
    "ctypes.dlopen",
    "socket.connect",
    "shutil.rmtree",
    "os.remove",
)
_unpickling = False
_violations: list[str] = []


def _audit(event: str, _args: tuple[Any, ...]) -> None:
    if _unpickling and event.startswith(_FORBIDDEN_EVENTS):
        _violations.append(event)


sys.addaudithook(_audit)
DATA = "__0_0.distcp"
# One scratch checkpoint directory: the input becomes its `.metadata`, beside a 1 MiB data file.
CKPT = Path(tempfile.mkdtemp(prefix="torchpulse-fuzz-ckpt-"))
with open(CKPT / DATA, "wb") as _f:
    _f.truncate(1 << 20)


def test_one_input(data: bytes) -> None:
    global _unpickling
    _violations.clear()
    _unpickling = True
    try:
        fast = metaparse.parse(data)
        standins = load_metadata(data)
    except MemoryError as exc:
        # A length prefix (BINBYTES8) or memo index (LONG_BINPUT) larger than memory.
        known("B2 unpickler allocates from a prefix or memo index -> MemoryError -> status error, not invalid", exc)
        return
    except OSError:
        raise
    except Exception:
        assert fast is None, "the C reader accepted metadata the Python unpickler refuses"
        return  # a refusal: the reader reports TP-CKPT-012
    finally:
        _unpickling = False
        if _violations:
            raise AssertionError(f"the unpickler triggered {_violations}")
    # The C reader answers exactly what the Python path builds, or declines.
    try:
        reference = extract_standins(standins)
    except Exception:
        assert fast is None, "the C reader accepted metadata the Python reader fails on"
    else:
        assert fast is None or repr(fast) == repr(reference), "the C reader and the Python path disagree"
    # The reader (as validate() calls it) must turn accepted metadata into a checkpoint or a finding.
    (CKPT / ".metadata").write_bytes(data)
    try:
        outcome = read_checkpoint(CKPT)
    except MemoryError as exc:
        known("B2 unpickler allocates from a prefix or memo index -> MemoryError -> status error, not invalid", exc)
        return
    ckpt = outcome.checkpoint
    if ckpt is None:
        return
    try:
        metadata_findings(ckpt)
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        known("B3 reader passes unchecked element types (e.g. str chunk offsets) to the rules, which raise", exc)


def seeds() -> list[bytes]:
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    weight = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        torch.Size([5, 8]),
        [
            ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([3, 8])),
            ChunkStorageMetadata(torch.Size([3, 0]), torch.Size([2, 8])),
        ],
    )
    step = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32), torch.Size([]), [ChunkStorageMetadata(torch.Size([]), torch.Size([]))]
    )
    md = Metadata(
        state_dict_metadata={
            "model.w": weight,
            "optim.state.w.step": step,
            "optim.param_groups.0.lr": BytesStorageMetadata(),
        },
        planner_data={
            "model.w": ("model", "w"),
            "optim.state.w.step": ("optim", "state", "w", "step"),
            "optim.param_groups.0.lr": ("optim", "param_groups", 0, "lr"),
        },
        storage_data={
            MetadataIndex("model.w", torch.Size([0, 0])): _StorageInfo(DATA, 0, 700),
            MetadataIndex("model.w", torch.Size([3, 0])): _StorageInfo(DATA, 700, 600),
            MetadataIndex("optim.state.w.step", torch.Size([])): _StorageInfo(DATA, 1300, 500),
            MetadataIndex("optim.param_groups.0.lr"): _StorageInfo(DATA, 1800, 100),
        },
    )
    out = [pickle.dumps(md, protocol=p) for p in (2, 4, 5)]
    buf = io.BytesIO()
    pickle.Pickler(buf, protocol=4).dump(md)
    return [*out, buf.getvalue()[: len(out[1]) // 2]]


def _cap_address_space(headroom: int = 1 << 30) -> None:
    """Turn the unpickler's memory amplification (B2) into a MemoryError instead of an OOM kill."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[0])
    limit = pages * resource.getpagesize() + headroom
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))


if __name__ == "__main__":
    initial = seeds()
    _cap_address_space()
    run(test_one_input, initial, "metadata")
