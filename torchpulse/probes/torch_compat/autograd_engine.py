"""The autograd engine's private surfaces: the running graph task, the dispatch-mode stack, and torch's
short dtype names."""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from torchpulse.probes.torch_compat.features import has, register


def _dispatch_modes_aside() -> bool:
    from torch.utils._python_dispatch import _disable_current_modes

    return callable(getattr(torch._C, "_len_torch_dispatch_stack", None)) and callable(_disable_current_modes)


# The autograd graph task running the calling hook (-1 outside the engine): hooks tell their own pass from
# another thread's or a reentrant checkpoint's by it. A constant where torch lacks it (no filtering then).
graph_task_id: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: 0)


def dispatch_modes_aside() -> AbstractContextManager[object]:
    """The job's Python dispatch modes (FlopCounterMode, DebugMode, a memory tracker) set aside, so that
    they record the job's ops only; without the feature, nothing is set aside (the modes then see ours)."""
    if not has("dispatch_modes_aside") or torch._C._len_torch_dispatch_stack() == 0:
        return contextlib.nullcontext()
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


@functools.cache
def dtype_abbreviations() -> dict[torch.dtype, str]:
    """Torch's short dtype names ("f32", "bf16") of its logging notation; {} where torch has none.

    `torch.utils._dtype_abbrs` since ~2.6; before, the same table was `torch.fx.graph.dtype_abbrs`.
    """
    for module_name in ("torch.utils._dtype_abbrs", "torch.fx.graph"):
        try:
            table = getattr(importlib.import_module(module_name), "dtype_abbrs", None)
        except ImportError:
            continue
        if isinstance(table, dict):
            return table
    return {}


register("dispatch_modes_aside", _dispatch_modes_aside)
