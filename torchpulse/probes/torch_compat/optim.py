"""torch.optim's private table of global optimizer-step post-hooks."""

from __future__ import annotations

from typing import Any


def global_optimizer_post_hooks() -> dict[int, Any] | None:
    """The table `register_optimizer_step_post_hook` appends to (handle id -> hook), or None.

    torch iterates it after every `optimizer.step()`: adding or removing an
    entry while a hook before the last one runs raises in the job.
    """
    import torch.optim.optimizer as optimizer_module

    table = getattr(optimizer_module, "_global_optimizer_post_hooks", None)
    return table if isinstance(table, dict) else None
