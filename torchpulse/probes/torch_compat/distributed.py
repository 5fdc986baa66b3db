"""FSDP2's private parameter state (`fully_shard`)."""

from __future__ import annotations

import torch


def fsdp2_parameter_pairs(module: object) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(sharded, unsharded) parameters that `fully_shard` manages on `module`; [] for any other module.

    FSDP2 registers whichever of the two is current on the module, so a module tree names only
    that one; the unsharded parameter exists from the first all-gather on. Read from the
    FSDPState's parameter groups (`_fsdp_param_groups` in torch 2.13, one `_fsdp_param_group` before).
    """
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        return []
    try:
        state = get_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = [] if group is None else [group]
        pairs = []
        for group in groups:
            for fsdp_param in getattr(group, "fsdp_params", ()):
                sharded = getattr(fsdp_param, "sharded_param", None)
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if isinstance(sharded, torch.Tensor) and isinstance(unsharded, torch.Tensor):
                    pairs.append((sharded, unsharded))
        return pairs
    except Exception:  # another torch's internals: names fall back to the module tree alone
        return []
