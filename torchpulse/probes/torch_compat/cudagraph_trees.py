"""Inductor's CUDA-graph trees: the loggers and markers of skips and recordings, the thread-local tree
managers, the frames whose locals say why a graph re-recorded, static addresses and pool memory.

Verified against torch 2.13, and on 2.10.0, 2.14.1 and 2.15.0 (2.4.1 for the notes that name it).
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Final, NamedTuple

import torch

from torchpulse.probes.torch_compat.features import has, register

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
# Only an Inductor compile with CUDA graphs imports the tree module, and only
# then can a tree manager exist. Importing it to look costs ~0.8 s and ~180
# Inductor modules in every job (at its first optimizer step): never do.
CUDAGRAPH_TREES: Final = "torch._inductor.cudagraph_trees"
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


def _tree_managers() -> bool:
    module = sys.modules.get(CUDAGRAPH_TREES)
    if module is None:  # `trees_loaded` asks only once the job imported it
        raise ImportError(f"{CUDAGRAPH_TREES} is not imported by the job")
    return hasattr(module, "local") and hasattr(module, "get_manager")


def _tree_frames_present() -> bool:
    if CUDAGRAPH_TREES not in sys.modules:  # asked only once the job imported it
        raise ImportError(f"{CUDAGRAPH_TREES} is not imported by the job")
    return tree_frames() is not None


def _memory_snapshot() -> bool:
    return callable(getattr(torch.cuda, "memory_snapshot", None))


def trees_loaded() -> bool:
    """Whether CUDA-graph trees can exist here: the job imported their module, and it has managers."""
    return CUDAGRAPH_TREES in sys.modules and has("cudagraph_tree_managers")


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


register("cudagraph_tree_managers", _tree_managers)
register("cudagraph_tree_frames", _tree_frames_present)
register("cuda_memory_snapshot", _memory_snapshot)
