"""Load level: prove the optimizer state loads resharded with torch's own seed API.

Runs `load_sharded_optimizer_state_dict` on a single-process gloo group. The
metadata handed to torch is rebuilt from the safely parsed view, so torch's
plain-`pickle` `read_metadata` never sees the file.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

from torchpulse.checkpoints.model import Checkpoint, Finding, Format
from torchpulse.checkpoints.reader import open_regular_fd
from torchpulse.checkpoints.rules import error
from torchpulse.checkpoints.rules.optimizer import parse_layout


def to_torch_metadata(ckpt: Checkpoint) -> Any:
    """Build real `torch.distributed.checkpoint.metadata.Metadata` from the parsed view."""
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

    state: dict[str, Any] = {
        t.key: TensorStorageMetadata(
            TensorProperties(dtype=getattr(torch, t.dtype)),
            torch.Size(t.size),
            [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in t.chunks],
        )
        for t in ckpt.tensors.values()
    }
    state.update({k: BytesStorageMetadata() for k in ckpt.bytes_keys})
    storage = {
        MetadataIndex(s.key, s.chunk_offsets): _StorageInfo(
            s.relative_path, s.offset, s.length, list(s.transforms) or None
        )
        for s in ckpt.storage
    }
    # Metadata has a `version` field from torch ~2.9 (2.8 has none, 2.10 has it): passed where it exists.
    has_version = "version" in getattr(Metadata, "__dataclass_fields__", {})
    version: dict[str, Any] = {"version": ckpt.version} if has_version else {}
    return Metadata(
        state_dict_metadata=state,
        planner_data=dict(ckpt.key_paths),
        storage_data=storage,
        **version,
    )


def drop_from_page_cache(ckpt: Checkpoint) -> None:
    """Evict the data files torch just read, as the data level does: validation must not push out the job's pages."""
    for name in sorted({s.relative_path for s in ckpt.storage}):
        # O_NOFOLLOW and a regular-file check: a name swapped for a symlink or FIFO is skipped.
        with contextlib.suppress(OSError):
            opened = open_regular_fd(Path(ckpt.path) / name)
            if opened is None:
                continue
            try:
                os.posix_fadvise(opened[0], 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(opened[0])


def load_findings(ckpt: Checkpoint, drop_cache: bool = False) -> list[Finding]:
    """TP-CKPT-026: each optimizer's state loads through the resharding path."""
    layout = parse_layout(ckpt)
    if not layout.state or ckpt.format is not Format.TORCH_SAVE:
        return []
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict

    metadata = to_torch_metadata(ckpt)

    class _SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return metadata

    model_state = {
        key: torch.empty(ckpt.tensors[key].size, dtype=getattr(torch, ckpt.tensors[key].dtype), device="meta")
        for key in layout.params.values()
    }
    out: list[Finding] = []
    owns_group = not dist.is_initialized()
    # A FileStore in a private directory: no TCP port that could collide with the job's rendezvous.
    store_dir = tempfile.TemporaryDirectory(prefix="torchpulse-load-") if owns_group else None
    if store_dir is not None:
        store = dist.FileStore(str(Path(store_dir.name) / "store"), 1)  # type: ignore[attr-defined]
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        for opt in sorted(layout.optimizers):
            if not ckpt.key_paths:
                out.append(error("TP-CKPT-026", opt, "no planner_data: torch cannot map keys"))
                continue
            try:
                with warnings.catch_warnings():
                    # The seed API is deprecated upstream and says so on every call.
                    warnings.simplefilter("ignore")
                    load_sharded_optimizer_state_dict(model_state, opt, _SafeReader(ckpt.path))
            except Exception as exc:  # torch's failure is the finding
                out.append(error("TP-CKPT-026", opt, f"{type(exc).__name__}: {exc}"[:500]))
    finally:
        if store_dir is not None:
            dist.destroy_process_group()
            store_dir.cleanup()
        if drop_cache:
            drop_from_page_cache(ckpt)
    return out
