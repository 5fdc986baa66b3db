"""Every version-dependent fact the compile and CUDA-graph probes rely on, in one place.

The probes read torch's private surfaces (loggers, counters, callbacks, the
CUDA-graph tree manager). Each is detected at run time and recorded in
`FEATURES` with the reason it is missing, so a probe degrades one feature at
a time with a logged reason instead of failing on an unexpected torch.
Verified against torch 2.13; earlier notes say where behaviour changed.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

# -- logger names (artifact loggers are "<module>.__<artifact>") ---------------
# `record_compilation_metrics` ends with `log_compilation_event(metrics)`, which
# logs the CompilationMetrics object at INFO here (record.args[0]).
METRICS_LOGGER: Final = "torch._utils_internal"
# `InstructionTranslatorBase.log_graph_break` logs "Graph break in user code at
# FILE:LINE\nGraph Break Reason: ..." at DEBUG, and only builds the message
# when the logger is enabled for DEBUG.
GRAPH_BREAK_LOGGER: Final = "torch._dynamo.symbolic_convert.__graph_breaks"
# `log_cudagraph_skip_and_bump_counter` and the dynamic-shape warn limit log
# here at WARNING. The artifact does not propagate, so without handlers Python's
# `lastResort` prints them: a tap must be a filter, never a handler.
CUDAGRAPHS_LOGGER: Final = "torch._inductor.cudagraph_utils.__cudagraphs"
# The tree manager logs recordings, warm-ups and re-record reasons at DEBUG
# (only on those slow paths, never on replay), symint recordings at INFO, to
# its `cudagraphs` artifact logger. Not to the module logger above it: a
# parent's filters never see propagated records, and lowering the parent's
# level lets the artifact's DEBUG lines through to torch's stderr handler.
CUDAGRAPH_TREES_LOGGER: Final = "torch._inductor.cudagraph_trees.__cudagraphs"

# The job's own import of Dynamo is the signal to finish installing the compile
# and CUDA-graph probes; the agent never imports it first. On torch 2.13 a
# `torch._dynamo` imported before `init_process_group` makes DDP over gloo hang
# at exit now and then (the Reducer drops the last process-group reference with
# the GIL held while a gloo worker waits for it); vanilla jobs import it later.
DYNAMO: Final = "torch._dynamo"
# Only an Inductor compile with CUDA graphs imports the tree module, and only
# then can a tree manager exist. Importing it to look costs ~0.8 s and ~180
# Inductor modules in every job (at its first optimizer step): never do.
CUDAGRAPH_TREES: Final = "torch._inductor.cudagraph_trees"

# -- message markers -----------------------------------------------------------
RECOMPILE_LIMIT_MARKERS: Final = ("recompile limit exceeded", "cache_size_limit", "recompile_limit")
RECOMPILE_LIMIT_FAIL_TYPES: Final = ("Unsupported", "FailOnRecompileLimitHit")
CUDAGRAPH_SKIP_PREFIX: Final = "skipping cudagraph"
CUDAGRAPH_RERECORD_LIMIT_MARKER: Final = "re-recording limit"
CUDAGRAPH_DYNAMIC_SHAPE_WARNING: Final = "CUDAGraph supports dynamic shapes by recording a new graph"
TREES_RECORDING: Final = "Recording function="
TREES_WARMUP: Final = "Running warmup function="
TREES_RERECORD: Final = "Re-recording function="
TREES_SYMINT_RECORDING: Final = "Recording cudagraph tree for symint key"
# Trigger names of `torch._dynamo.callback.CallbackTrigger` (2.8+).
TRIGGER_CUDAGRAPH_RECORDING: Final = "CUDAGRAPH_RECORDING"


@dataclass(frozen=True)
class Feature:
    name: str
    available: bool
    reason: str = ""


def _check(name: str, probe: Callable[[], object]) -> Feature:
    try:
        result = probe()
    except Exception as exc:  # any import or attribute drift means "not here"
        return Feature(name, False, f"{type(exc).__name__}: {exc}")
    if result is False:
        return Feature(name, False, "not present in this torch")
    return Feature(name, True)


def _metrics_logged() -> bool:
    import torch._dynamo.config
    import torch._dynamo.utils

    # Both the class and the log call must exist; the flag is checked per use.
    return hasattr(torch._dynamo.utils, "CompilationMetrics") and hasattr(
        torch._dynamo.utils, "log_compilation_event"
    )


def _callback_handler() -> bool:
    from torch._dynamo.callback import callback_handler as handler

    return callable(getattr(handler, "register_start_callback", None)) and callable(
        getattr(handler, "remove_start_callback", None)
    )


def _callback_args() -> bool:
    # Before ~2.8 callbacks took no arguments; from then on CallbackArgs.
    from torch._dynamo.callback import CallbackArgs, CallbackTrigger

    return hasattr(CallbackTrigger, TRIGGER_CUDAGRAPH_RECORDING) and "compile_id" in inspect.signature(
        CallbackArgs
    ).parameters


def _counters() -> bool:
    from torch._dynamo.utils import counters

    return isinstance(counters, dict)


def _tree_managers() -> bool:
    module = sys.modules.get(CUDAGRAPH_TREES)
    if module is None:  # `trees_loaded` asks only once the job imported it
        raise ImportError(f"{CUDAGRAPH_TREES} is not imported by the job")
    return hasattr(module, "local") and hasattr(module, "get_manager")


def _static_address_type() -> bool:
    from torch._dynamo.utils import get_static_address_type

    return callable(get_static_address_type)


def _memory_snapshot() -> bool:
    return callable(getattr(torch.cuda, "memory_snapshot", None))


_DETECTORS: Final[dict[str, Callable[[], object]]] = {
    "compilation_metrics_log": _metrics_logged,
    "compile_callbacks": _callback_handler,
    "compile_callback_args": _callback_args,
    "dynamo_counters": _counters,
    "cudagraph_tree_managers": _tree_managers,
    "static_address_type": _static_address_type,
    "cuda_memory_snapshot": _memory_snapshot,
}
FEATURES: dict[str, Feature] = {}


def feature(name: str) -> Feature:
    """One row of the feature-detection table, detected at the first question, then kept."""
    found = FEATURES.get(name)
    if found is None:
        found = FEATURES[name] = _check(name, _DETECTORS[name])
    return found


def has(name: str) -> bool:
    return feature(name).available


def missing(*names: str) -> list[Feature]:
    return [feature(name) for name in names if not feature(name).available]


def trees_loaded() -> bool:
    """Whether CUDA-graph trees can exist here: the job imported their module, and it has managers."""
    return CUDAGRAPH_TREES in sys.modules and has("cudagraph_tree_managers")


# Files whose frames `disable_tracing` puts between a hook's caller and the hook.
_TORCH_DIR = Path(torch.__file__).resolve().parent
TRACING_WRAPPER_PATHS: Final = (str(_TORCH_DIR / "_dynamo"), str(_TORCH_DIR / "_compile.py"))


# -- accessors (call only when the matching feature is available) -------------
def disable_tracing(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Keep Dynamo out of `fn` (a hook): a graph break and an eager call, never baked in.

    `torch._disable_dynamo` imports Dynamo at the first call instead of now,
    so wrapping a hook at attach does not import it (see `DYNAMO`).
    """
    lazy = getattr(torch, "_disable_dynamo", None)
    if callable(lazy) and DYNAMO not in sys.modules:  # once loaded, skip the lazy layer's extra call
        if not isinstance(fn, types.FunctionType):
            # It caches the disabled version on the function: a bound method takes no attributes.
            method = fn

            @functools.wraps(method)
            def fn(*args: Any, **kwargs: Any) -> Any:
                return method(*args, **kwargs)

        return lazy(fn)  # type: ignore[no-any-return]
    return torch.compiler.disable(fn)  # type: ignore[no-untyped-call,no-any-return,unused-ignore]


def skip_tracing(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Keep Dynamo from tracing `fn` without an eager-mode wrapper; else fall back to disable()."""
    try:
        from torch._dynamo.decorators import skip
    except ImportError:
        return torch.compiler.disable(fn)  # type: ignore[no-untyped-call,no-any-return,unused-ignore]
    return skip(fn)


def metrics_logging_enabled() -> bool:
    """False when `torch._dynamo.config.log_compilation_metrics` is off (no records reach us)."""
    import torch._dynamo.config

    return bool(getattr(torch._dynamo.config, "log_compilation_metrics", True))


def compilation_metrics_of(args: object) -> Any | None:
    """The CompilationMetrics object of a `torch._utils_internal` log record, if it is one."""
    from torch._dynamo.utils import CompilationMetrics

    if isinstance(args, tuple) and len(args) == 1 and isinstance(args[0], CompilationMetrics):
        return args[0]
    return None


def callback_handler() -> Any:
    # The same object as `torch._dynamo.callback_handler`; reset() clears its lists, never replaces it.
    from torch._dynamo.callback import callback_handler as handler

    return handler


def callback_trigger_name(args: object) -> str | None:
    """The trigger name of a compile callback's argument (None before CallbackArgs existed)."""
    trigger = getattr(args, "callback_trigger", None)
    return getattr(trigger, "name", None)


def dynamo_counter(group: str, key: str) -> int:
    """A value of `torch._dynamo.utils.counters` without creating missing keys."""
    from torch._dynamo.utils import counters

    section = counters.get(group)
    return int(section.get(key, 0)) if section is not None else 0


def cudagraph_policy_set() -> bool:
    """A custom inductor `cudagraph_policy` may also skip graphs without a message."""
    import torch._inductor.config

    return getattr(torch._inductor.config, "cudagraph_policy", None) is not None


def tree_managers() -> Iterator[Any]:
    """CUDA-graph tree managers of the calling thread (the manager is thread-local)."""
    from torch._inductor import cudagraph_trees

    containers = getattr(cudagraph_trees.local, "tree_manager_containers", None) or {}
    for container in list(containers.values()):
        manager = getattr(container, "tree_manager", None)
        if manager is not None:
            yield manager


def cuda_present() -> bool:
    """Whether this process can use CUDA at all (device count only: no context is created)."""
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # a broken driver install means "no CUDA", not a probe failure
        return False


def is_static_for_cudagraphs(tensor: torch.Tensor) -> bool:
    """Mirror of Dynamo's `_is_static_for_cudagraphs` that tolerates a manager between runs."""
    if not tensor.is_cuda:
        return True  # Dynamo does not copy (or warn about) non-CUDA tensors.
    from torch._dynamo.utils import get_static_address_type

    if get_static_address_type(tensor) is not None:
        return True
    if not trees_loaded():
        return False
    from torch._inductor.cudagraph_trees import get_manager

    manager = get_manager(tensor.device.index, False)
    node = getattr(manager, "current_node", None) if manager is not None else None
    checker = getattr(node, "_is_cuda_graph_recorded_tensor", None)
    return bool(checker(tensor)) if checker is not None else False


def pool_bytes(managers: list[Any]) -> int | None:
    """Bytes reserved in the CUDA-graph private pools of `managers` (None when unknown)."""
    if not managers or not has("cuda_memory_snapshot"):
        return None
    pools = {tuple(p) for m in managers if (p := getattr(m, "cuda_graphs_thread_pool", None)) is not None}
    if not pools:
        return None
    total = 0
    for segment in torch.cuda.memory_snapshot():  # type: ignore[no-untyped-call]
        if tuple(segment.get("segment_pool_id", ())) in pools:
            total += int(segment.get("total_size", 0))
    return total


def count_tree_nodes(manager: Any) -> tuple[int, int]:
    """(trees, nodes) of one tree manager: roots are trees, every recorded graph a node."""
    roots = getattr(manager, "roots", None) or {}
    pending = [node for nodes in roots.values() for node in nodes]
    trees = len(pending)
    nodes = 0
    while pending:
        node = pending.pop()
        nodes += 1
        for children in getattr(node, "children", {}).values():
            pending.extend(children)
    return trees, nodes


def global_optimizer_post_hooks() -> dict[int, Any] | None:
    """The table `register_optimizer_step_post_hook` appends to (handle id -> hook), or None.

    torch iterates it after every `optimizer.step()`: adding or removing an
    entry while a hook before the last one runs raises in the job.
    """
    import torch.optim.optimizer as optimizer_module

    table = getattr(optimizer_module, "_global_optimizer_post_hooks", None)
    return table if isinstance(table, dict) else None
