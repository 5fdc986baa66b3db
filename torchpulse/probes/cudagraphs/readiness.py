"""Optimizer readiness for CUDA graphs: what Dynamo's optimizer integration would find, and how to fix it."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.optim import Optimizer


class Readiness(NamedTuple):
    """What Dynamo's optimizer integration would find when compiling `optimizer.step`."""

    nonstatic_grads: int
    moving_grads: int
    capturable: tuple[tuple[int, bool], ...]  # (param group, capturable) for CUDA groups
    cpu_step_tensors: int


def measure_readiness(
    optimizer: Optimizer, last_ptrs: dict[int, int], is_static: Callable[[torch.Tensor], bool]
) -> Readiness:
    """Count the CUDA-graph hazards of one optimizer; `last_ptrs` maps param id -> grad address,
    `is_static` is `torch_compat.static_checker()`."""
    nonstatic = moving = cpu_steps = 0
    capturable: list[tuple[int, bool]] = []
    for index, group in enumerate(optimizer.param_groups):
        on_cuda = False
        for param in group["params"]:
            if not param.is_cuda:
                continue
            on_cuda = True
            grad = param.grad
            if grad is not None:
                if not is_static(grad):
                    nonstatic += 1
                # DTensor (FSDP2): data_ptr() of the wrapper is 0; the shard this rank holds moves.
                ptr = getattr(grad, "_local_tensor", grad).data_ptr()
                if last_ptrs.get(id(param), ptr) != ptr:
                    moving += 1
                last_ptrs[id(param)] = ptr
            step = optimizer.state.get(param, {}).get("step")
            if isinstance(step, torch.Tensor) and not step.is_cuda:
                cpu_steps += 1
        if on_cuda and "capturable" in group:
            capturable.append((index, bool(group["capturable"])))
    return Readiness(nonstatic, moving, tuple(capturable), cpu_steps)


def readiness_hint(r: Readiness) -> str | None:
    """One actionable sentence per optimizer, or None when nothing blocks CUDA graphs."""
    fixes: list[str] = []
    if any(not flag for _group, flag in r.capturable) or r.cpu_step_tensors:
        fixes.append("construct the optimizer with capturable=True (keeps `step` on the GPU)")
    if r.moving_grads:
        fixes.append("call zero_grad(set_to_none=False) so grads keep their addresses")
    if r.nonstatic_grads:
        fixes.append(
            f"mark the {r.nonstatic_grads} grads static with torch._dynamo.mark_static_address "
            "(else each is copied on every graph replay)"
        )
    return "; ".join(fixes) if fixes else None
