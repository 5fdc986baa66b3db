"""Every version-dependent fact the compile and CUDA-graph probes rely on, in one place (and the
autograd probe's two: its own graph task, and the job's dispatch modes set aside).

The probes read torch's private surfaces (loggers, counters, callbacks, the
CUDA-graph tree manager). Each is detected at run time and recorded in
`FEATURES` with the reason it is missing, so a probe degrades one feature at
a time with a logged reason instead of failing on an unexpected torch.
Verified against torch 2.13, and on 2.10.0, 2.14.1 and 2.15.0 (2.4.1 and 2.8.0 for the notes that name
them); the notes say where behaviour changed.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import sys
import types
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, NamedTuple

import torch

# -- logger names (artifact loggers are "<module>.__<artifact>") ---------------
# `record_compilation_metrics` ends with `log_compilation_event(metrics)`, which
# logs the CompilationMetrics object at INFO here (record.args[0]).
METRICS_LOGGER: Final = "torch._utils_internal"
# `InstructionTranslatorBase.log_graph_break` logs "Graph break in user code at
# FILE:LINE\nGraph Break Reason: ..." at DEBUG, and only builds the message
# when the logger is enabled for DEBUG.
GRAPH_BREAK_LOGGER: Final = "torch._dynamo.symbolic_convert.__graph_breaks"
# Before that message, `log_graph_break` adds (gb_type, location) to `graph_break_dup_warning_checker`, but
# only when the logger is enabled for DEBUG: a later break at the same place then prints without its user stack
# ("user stack suppressed due to duplicate graph break"). The prefix tells the full message from that one.
GRAPH_BREAK_FULL_PREFIX: Final = "Graph break in user code"
# `log_cudagraph_skip_and_bump_counter` and the dynamic-shape warn limit log
# here at WARNING. The artifact does not propagate, so without handlers Python's
# `lastResort` prints them: a tap must be a filter, never a handler.
CUDAGRAPHS_LOGGER: Final = "torch._inductor.cudagraph_utils.__cudagraphs"
# Older torch (2.4) logged the skips to the module's `perf_hints` artifact instead. Tapping a name no
# module logs to costs nothing: its WARNING level is already the default, so the tap changes no level.
CUDAGRAPH_SKIP_LOGGERS: Final = (CUDAGRAPHS_LOGGER, "torch._inductor.cudagraph_utils.__perf_hints")
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
# A limit hit fails the frame with Unsupported ("Dynamo recompile limit exceeded"; older torch: "cache_size_limit
# reached") and the function runs eagerly from then on. Under `fullgraph=True` or `fail_on_recompile_limit_hit`
# it raises one of RECOMPILE_LIMIT_ERRORS into the job instead, whose 2.13 message ("Hard failure due to
# fullgraph=True") names no limit; FailOnCacheLimitHit is the older name of that error. Torch 2.8-2.10 (checked
# on both) fail the frame with RecompileLimitExceeded ("recompile_limit reached") and still carry the last
# recompile reason: read as a reason, a limit hit counted as a `tensor_size` recompile.
RECOMPILE_LIMIT_MARKERS: Final = ("recompile limit exceeded", "cache_size_limit", "recompile_limit")
RECOMPILE_LIMIT_FAIL_TYPES: Final = ("Unsupported",)
RECOMPILE_LIMIT_ERRORS: Final = ("FailOnRecompileLimitHit", "FailOnCacheLimitHit", "RecompileLimitExceeded")
CUDAGRAPH_SKIP_PREFIX: Final = "skipping cudagraph"
# Every skip is logged (WARNING, CUDAGRAPHS_LOGGER) by this function, which then bumps the counter; not
# every message starts with the prefix ("input storage mutation ...", "disabling cudagraphs due to
# override_cudagraphs annotation").
CUDAGRAPH_SKIP_FUNCTION: Final = "log_cudagraph_skip_and_bump_counter"
# A skip that ends re-recording: "... exceeding max re-recording limit (=128) ...", and from 2.15, with
# `cudagraph_managed_input_rerecord_action="skip"`, "... reaching the cudagraph-managed input re-recording
# threshold (=5) ...".
CUDAGRAPH_RERECORD_LIMIT_MARKERS: Final = ("re-recording limit", "re-recording threshold")
CUDAGRAPH_DYNAMIC_SHAPE_WARNING: Final = "CUDAGraph supports dynamic shapes by recording a new graph"
TREES_RECORDING: Final = "Recording function="
TREES_WARMUP: Final = "Running warmup function="
TREES_RERECORD: Final = "Re-recording function="
TREES_SYMINT_RECORDING: Final = "Recording cudagraph tree for symint key"
# Trigger names of `torch._dynamo.callback.CallbackTrigger` (2.8+).
TRIGGER_CUDAGRAPH_RECORDING: Final = "CUDAGRAPH_RECORDING"
# What the tree manager's lines do not say, its frames do (read inside those logging calls, on slow
# paths only). `CUDAGraphTreeManager._run` logs "Re-recording" for *each* recorded sibling whose checks
# fail, also when a later sibling then matches and replays; it re-records only when it goes on to
# `record_function` ("Recording function="), and then its local `unexpected_rerecord_reason` holds the
# last failure (None on a first recording). `cudagraphify_impl`'s `deferred_cudagraphify` logs "symint
# key" for every new shape of one compiled graph, the first included; its `fn_cache` holds the shapes
# recorded before. Compile ids cannot tell: forward and backward (and DDPOptimizer's pieces) share one,
# and ids restart after `torch._dynamo.reset()`.
TREES_RERECORD_REASON: Final = "unexpected_rerecord_reason"
TREES_SHAPE_CACHE: Final = "fn_cache"
_MAX_LOG_DEPTH: Final = 32  # frames between torch's logging call and our sink: about a dozen


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
    return hasattr(torch._dynamo.utils, "CompilationMetrics") and hasattr(torch._dynamo.utils, "log_compilation_event")


def _metrics_recompile_reasons() -> bool:
    # CompilationMetrics gained `recompile_reason` and `is_forward` (lazy backward compiles) in
    # ~2.6; before, a record says neither why its frame recompiled nor which graph it was.
    from torch._dynamo.utils import CompilationMetrics

    fields = getattr(CompilationMetrics, "__dataclass_fields__", {})
    return "recompile_reason" in fields and "is_forward" in fields


def _callback_handler() -> bool:
    from torch._dynamo.callback import callback_handler as handler

    return callable(getattr(handler, "register_start_callback", None)) and callable(
        getattr(handler, "remove_start_callback", None)
    )


def _callback_args() -> bool:
    # Before ~2.8 callbacks took no arguments; from then on CallbackArgs.
    from torch._dynamo.callback import CallbackArgs, CallbackTrigger

    return (
        hasattr(CallbackTrigger, TRIGGER_CUDAGRAPH_RECORDING)
        and "compile_id" in inspect.signature(CallbackArgs).parameters
    )


def _counters() -> bool:
    from torch._dynamo.utils import counters

    return isinstance(counters, dict)


def _tree_managers() -> bool:
    module = sys.modules.get(CUDAGRAPH_TREES)
    if module is None:  # `trees_loaded` asks only once the job imported it
        raise ImportError(f"{CUDAGRAPH_TREES} is not imported by the job")
    return hasattr(module, "local") and hasattr(module, "get_manager")


def _tree_frames_present() -> bool:
    if CUDAGRAPH_TREES not in sys.modules:  # asked only once the job imported it
        raise ImportError(f"{CUDAGRAPH_TREES} is not imported by the job")
    return tree_frames() is not None


def _static_address_type() -> bool:
    from torch._dynamo.utils import get_static_address_type

    return callable(get_static_address_type)


def _memory_snapshot() -> bool:
    return callable(getattr(torch.cuda, "memory_snapshot", None))


def _dispatch_modes_aside() -> bool:
    from torch.utils._python_dispatch import _disable_current_modes

    return callable(getattr(torch._C, "_len_torch_dispatch_stack", None)) and callable(_disable_current_modes)


_DETECTORS: Final[dict[str, Callable[[], object]]] = {
    "compilation_metrics_log": _metrics_logged,
    "compilation_metrics_recompile_reason": _metrics_recompile_reasons,
    "compile_callbacks": _callback_handler,
    "compile_callback_args": _callback_args,
    "dynamo_counters": _counters,
    "cudagraph_tree_managers": _tree_managers,
    "cudagraph_tree_frames": _tree_frames_present,
    "static_address_type": _static_address_type,
    "cuda_memory_snapshot": _memory_snapshot,
    "dispatch_modes_aside": _dispatch_modes_aside,
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


def compilation_metrics_of(args: object) -> Any | None:
    """The CompilationMetrics object of a `torch._utils_internal` log record, if it is one."""
    from torch._dynamo.utils import CompilationMetrics

    if isinstance(args, tuple) and len(args) == 1 and isinstance(args[0], CompilationMetrics):
        return args[0]
    return None


def dynamo_frame_callback_getter() -> Callable[[], object]:
    """Dynamo's frame callback on this thread (None outside compiled code); where torch has no
    such accessor, a stand-in that always answers "maybe inside" (the caller then stays safe)."""
    eval_frame = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    getter = getattr(eval_frame, "get_eval_frame_callback", None)
    return getter if callable(getter) else object


def forget_graph_break_dedup() -> None:
    """Undo the duplicate-checker entry `log_graph_break` added just before its full message.

    Called from inside that logging call when only a tap enabled the logger: without the tap
    Dynamo would not have added it, and a graph-break log the job turns on later would print
    this break's user stack. The entry is the checker's newest (compiles are serialised);
    under `config.verbose` the checker re-logs duplicates in full anyway, and its `add` may
    only have moved an older entry, which must stay.
    """
    import torch._dynamo.config
    from torch._dynamo.utils import graph_break_dup_warning_checker as checker

    entries = getattr(checker, "set", None)
    if not torch._dynamo.config.verbose and isinstance(entries, OrderedDict) and entries:
        entries.popitem(last=True)


def compilation_metrics_history() -> list[Any]:
    """The last CompilationMetrics Dynamo keeps (a bounded deque): what was compiled before a probe attached."""
    utils = sys.modules.get("torch._dynamo.utils")  # not imported: nothing was compiled, and attach stays light
    history = getattr(utils, "get_compilation_metrics", None)
    return list(history()) if callable(history) else []


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


def cudagraph_policy_set() -> bool:
    """A custom inductor `cudagraph_policy` may also skip graphs without a message."""
    import torch._inductor.config

    return getattr(torch._inductor.config, "cudagraph_policy", None) is not None


def tree_containers() -> dict[int, Any]:
    """The calling thread's tree-manager containers by device index (the manager is thread-local).

    Read without creating anything: torch's `get_manager(i, False)` adds a container for device i,
    and thread-local state to a thread that has none.
    """
    module = sys.modules.get(CUDAGRAPH_TREES)
    containers = getattr(getattr(module, "local", None), "tree_manager_containers", None)
    return dict(containers) if isinstance(containers, dict) else {}


def tree_managers() -> Iterator[Any]:
    """CUDA-graph tree managers of the calling thread."""
    for container in tree_containers().values():
        manager = getattr(container, "tree_manager", None)
        if manager is not None:
            yield manager


class TreeFrames(NamedTuple):
    run: types.CodeType  # CUDAGraphTreeManager._run
    deferred: types.CodeType  # cudagraphify_impl.<locals>.deferred_cudagraphify


def tree_frames() -> TreeFrames | None:
    """The code of the tree-manager frames whose locals the CUDA-graph probe reads (see
    `TREES_RERECORD_REASON`), None when the module is not loaded or this torch has other ones."""
    return _find_tree_frames() if CUDAGRAPH_TREES in sys.modules else None


@functools.cache
def _find_tree_frames() -> TreeFrames | None:
    module = sys.modules[CUDAGRAPH_TREES]
    try:
        run = module.CUDAGraphTreeManager._run.__code__
        nested = module.cudagraphify_impl.__code__.co_consts
    except AttributeError:
        return None
    deferred = next((c for c in nested if isinstance(c, types.CodeType) and c.co_name == "deferred_cudagraphify"), None)
    if deferred is None or TREES_RERECORD_REASON not in run.co_varnames + run.co_cellvars:
        return None
    if TREES_SHAPE_CACHE not in deferred.co_freevars:
        return None
    return TreeFrames(run, deferred)


def caller_local(code: types.CodeType, name: str) -> tuple[bool, Any]:
    """(found, value of local `name`) of the nearest calling frame that runs `code`."""
    frame: types.FrameType | None = sys._getframe(1)
    for _ in range(_MAX_LOG_DEPTH):
        if frame is None:
            break
        if frame.f_code is code:
            return True, frame.f_locals.get(name)
        frame = frame.f_back
    return False, None


def cuda_present() -> bool:
    """Whether this process can use CUDA at all (device count only: no context is created)."""
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # a broken driver install means "no CUDA", not a probe failure
        return False


def static_checker() -> Callable[[torch.Tensor], bool]:
    """Dynamo's `_is_static_for_cudagraphs`, for many tensors at one moment.

    A grad is static when marked with `mark_static_address` or when it is an output of the graph
    path of its device's tree manager. Torch's node compares a tensor with every output of the path;
    here the outputs' addresses are collected once per device, so a check of P grads against O
    outputs costs P + O instead of P * O (1,000 x 1,000 took 0.16 s of the training thread).
    """
    from torch._dynamo.utils import get_static_address_type

    containers = tree_containers() if trees_loaded() else {}
    recorded: dict[int, Callable[[torch.Tensor], bool]] = {}

    def is_static(tensor: torch.Tensor) -> bool:
        if not tensor.is_cuda:
            return True  # Dynamo does not copy (or warn about) non-CUDA tensors.
        if get_static_address_type(tensor) is not None:
            return True
        index = tensor.device.index
        check = recorded.get(index)
        if check is None:
            check = recorded[index] = _recorded_check(containers.get(index))
        return check(tensor)

    return is_static


def _recorded_check(container: Any) -> Callable[[torch.Tensor], bool]:
    node = getattr(getattr(container, "tree_manager", None), "current_node", None)
    if node is None:  # no manager (Dynamo: static only if marked), or one between runs
        return lambda _tensor: False
    addresses = _recorded_addresses(node)
    if addresses is None:
        checker = getattr(node, "_is_cuda_graph_recorded_tensor", None)
        if not callable(checker):
            return lambda _tensor: False
        return lambda tensor: bool(checker(getattr(tensor, "_local_tensor", tensor)))
    # A DTensor has no storage of its own: the graph would see its local shard.
    return lambda tensor: getattr(tensor, "_local_tensor", tensor).untyped_storage().data_ptr() in addresses


def _recorded_addresses(node: Any) -> set[int] | None:
    """The storage addresses `node._is_cuda_graph_recorded_tensor` compares with (None: unknown node)."""
    refs: Iterable[Any]
    paths = getattr(node, "path_weakrefs", None)
    if isinstance(paths, list):
        # CUDAGraphNode: every output of the path, live or not (graph pool memory is never released).
        refs = (ref for outputs in paths for ref in outputs)
    elif callable(getattr(node, "path_live_weakrefs", None)):
        refs = node.path_live_weakrefs()  # CUDAWarmupNode: the live outputs of the path
    else:
        return None
    return {ref.data_ptr() for ref in refs if ref is not None}


def pool_bytes(managers: list[Any]) -> int | None:
    """Bytes reserved in the CUDA-graph private pools of `managers` (None when unknown)."""
    if not managers:
        return 0  # no manager, no pool (after torch._dynamo.reset(), say)
    if not has("cuda_memory_snapshot"):
        return None
    pools = {tuple(p) for m in managers if (p := getattr(m, "cuda_graphs_thread_pool", None)) is not None}
    if not pools:
        return None
    snapshot = torch.cuda.memory_snapshot
    # By default the snapshot also copies the allocator's trace ring, which a job recording its memory
    # history (to debug an OOM) fills with up to 100,000 entries carrying stacks.
    cheap = {"include_traces": False} if "include_traces" in inspect.signature(snapshot).parameters else {}
    total = 0
    for segment in snapshot(**cheap):  # type: ignore[no-untyped-call]
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
