"""Per-node timing of one autograd pass: walk the graph, hook every node, unhook.

Torch's own logging hooks (`_register_logging_hooks_on_whole_graph`) do the
same walk but format a string per node. Here the hooks only take timestamps
into slots indexed by the node's position in the walk; names and shapes are
turned into labels and text later, off the hot path. The hooks are Python
closures: nothing compiled runs inside the training process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node

from torchpulse.limits import MAX_GRAPH_DEPTH
from torchpulse.probes.torch_compat import autograd_engine as autograd_compat
from torchpulse.probes.torch_compat import dynamo as dynamo_compat

# (dtype, shape) of each grad_output, None for an undefined gradient; "?" for a size a
# strided nested tensor leaves irregular (it has no `shape`).
GradShape = tuple[torch.dtype, tuple[int | str, ...]] | None


# AccumulateGrad nodes have no sequence number: torch gives them UINT64_MAX, which JSON readers
# (doubles) cannot hold exactly. They are reported as -1.
NO_SEQUENCE_NR = -1


def sequence_nr(node: Any) -> int:
    value = int(node._sequence_nr())
    return NO_SEQUENCE_NR if value >= 1 << 63 else value


@dataclass(frozen=True)
class NodeTime:
    """One timed execution (detailed mode) or a node's slowest summary."""

    name: str
    sequence_nr: int
    seconds: float
    grad_outputs: tuple[GradShape, ...] = ()


@dataclass(frozen=True)
class PassTiming:
    """What a timed pass leaves behind: per-type totals and the slowest nodes."""

    totals: tuple[tuple[str, int, float], ...]  # (node type, calls, seconds)
    slowest: tuple[NodeTime, ...]
    executions: tuple[NodeTime, ...]  # detailed mode only, in execution order
    node_seconds: float


def node_type(node: Node) -> str:
    """`torch::autograd::AccumulateGrad` -> `AccumulateGrad`; Python nodes keep their class name."""
    return node.name().rpartition("::")[2]


def format_grad_outputs(shapes: Sequence[GradShape]) -> str:
    """Torch's logging notation: `[f32[8, 128, 256],None]`."""
    parts = ["None" if s is None else _format_one(*s) for s in shapes]
    return f"[{','.join(parts)}]"


def _format_one(dtype: torch.dtype, shape: tuple[int | str, ...]) -> str:
    return f"{autograd_compat.dtype_abbreviations().get(dtype, str(dtype))}[{', '.join(map(str, shape))}]"


def roots_of(outputs: Iterable[Any]) -> list[Node]:
    """The graph roots of a pass's outputs (tensors or GradientEdges)."""
    roots: list[Node] = []
    for output in outputs:
        if isinstance(output, GradientEdge):
            roots.append(output.node)
        elif isinstance(output, torch.Tensor) and output.grad_fn is not None:
            roots.append(output.grad_fn)
    return roots


# From torch 2.13 a node keeps the Python object a walk made for it (`next_functions`) for as long as it
# lives, and freeing a chain of such nodes recurses once per node: a fully walked chain ~45,000 deep
# overflows an 8 MiB stack and kills the job (torch's own DEBUG logging hooks do too). Nodes deeper than
# MAX_GRAPH_DEPTH are neither timed nor searched.
def iter_graph(
    roots: Iterable[Node], max_depth: int = MAX_GRAPH_DEPTH, on_cut: Callable[[], None] | None = None
) -> Iterator[Node]:
    """Every node reachable from `roots` in at most `max_depth` levels, breadth first, each once.

    The children of the last level are not even looked at (see MAX_GRAPH_DEPTH); `on_cut` is
    called once when some were left out.
    """
    seen: set[Node] = set()
    level: list[Node] = []
    for root in roots:
        if root not in seen:
            seen.add(root)
            level.append(root)
    for depth in range(1, max_depth + 1):
        deeper: list[Node] = []
        last = depth == max_depth
        for node in level:
            yield node
            if last:
                if on_cut is not None and node.next_functions:
                    on_cut()
                    on_cut = None
                continue
            for child, _ in node.next_functions:
                if child is not None and child not in seen:
                    seen.add(child)
                    deeper.append(child)
        if not deeper:
            return
        level = deeper


def irregular_shape(tensor: torch.Tensor) -> tuple[int | str, ...]:
    """The sizes of a tensor without a `shape` (strided nested): "?" for an irregular one."""
    sizes: list[int | str] = []
    for dim in range(tensor.dim()):
        try:
            sizes.append(int(tensor.size(dim)))
        except RuntimeError:
            sizes.append("?")
    return tuple(sizes)


class PassTimer:
    """Pre- and post-hooks on every node of one pass; `finish()` removes them all.

    The hooks never return a value (so gradients are untouched) and never
    raise: an internal error is stored in `error`, which the probe reports.
    """

    def __init__(
        self,
        roots: Iterable[Node],
        *,
        detailed: bool,
        on_parameter: Callable[[torch.Tensor], None],
        on_cut: Callable[[], None] | None = None,
    ) -> None:
        self.detailed = detailed
        self._error: BaseException | None = None
        roots = list(roots)
        # Hooks see every graph task that runs a hooked node: another thread's pass through
        # shared parameters, a reentrant checkpoint's inner pass. Only this pass's own task is
        # timed: the one that runs a root first (no node runs before the roots in its own task).
        self._roots = len(set(roots))
        self._task: list[int | None] = [None]
        self._nodes: list[Node] = []
        self._handles: list[Any] = []
        self._starts: list[float] = []
        self._seconds: list[float] = []
        self._calls: list[int] = []
        self._shapes: list[tuple[GradShape, ...]] = []
        self._order: list[tuple[int, float]] = []
        try:
            for index, node in enumerate(iter_graph(roots, on_cut=on_cut)):
                self._nodes.append(node)
                self._starts.append(0.0)
                self._seconds.append(0.0)
                self._calls.append(0)
                self._shapes.append(())
                variable = getattr(node, "variable", None)  # AccumulateGrad: the parameter
                if isinstance(variable, torch.Tensor):
                    on_parameter(variable)
                self._handles.append(node.register_prehook(self._make_prehook(index)))
                self._handles.append(node.register_hook(self._make_posthook(index)))
        except BaseException:
            self.remove()
            raise

    @classmethod
    def keep_dynamo_out(cls) -> None:
        """Have Dynamo skip every timer's hook frames (under a compiled step the engine runs them
        with Dynamo on); skipping goes by code object, so one sample of each hook does it."""
        sample = cls((), detailed=True, on_parameter=lambda _param: None)
        dynamo_compat.skip_tracing(sample._make_prehook(0))
        dynamo_compat.skip_tracing(sample._make_posthook(0))

    @property
    def node_count(self) -> int:
        return len(self._nodes)

    @property
    def error(self) -> BaseException | None:
        """The first error a hook met (it raised nothing into the pass)."""
        return self._error

    def _make_prehook(self, index: int) -> Callable[[Sequence[torch.Tensor | None]], None]:
        starts, shapes, detailed, own = self._starts, self._shapes, self.detailed, self._task
        clock, task_id, root = time.perf_counter, autograd_compat.graph_task_id, index < self._roots

        def prehook(grad_outputs: Sequence[torch.Tensor | None]) -> None:
            try:
                task = task_id()
                if own[0] != task:
                    if own[0] is not None or not root:
                        return  # another pass running this node
                    own[0] = task
                if detailed:
                    # A loop, not a generator: its frame would be one more for Dynamo to meet.
                    described: list[GradShape] = []
                    for g in grad_outputs:
                        if g is None:
                            described.append(None)
                            continue
                        try:
                            shape: tuple[int | str, ...] = tuple(g.shape)
                        except RuntimeError:  # a strided nested tensor has no shape
                            shape = irregular_shape(g)
                        described.append((g.dtype, shape))
                    shapes[index] = tuple(described)
                starts[index] = clock()
            except Exception as exc:  # a hook that raises would fail the user's backward
                if self._error is None:
                    self._error = exc

        return prehook

    def _make_posthook(self, index: int) -> Callable[[Any, Any], None]:
        starts, seconds, calls, order, clock = (
            self._starts,
            self._seconds,
            self._calls,
            self._order,
            time.perf_counter,
        )
        own, task_id = self._task, autograd_compat.graph_task_id

        def posthook(_grad_inputs: Any, _grad_outputs: Any) -> None:
            try:
                if own[0] is None or task_id() != own[0]:
                    return
                elapsed = clock() - starts[index]
                seconds[index] += elapsed
                calls[index] += 1
                order.append((index, elapsed))
            except Exception as exc:
                if self._error is None:
                    self._error = exc

        return posthook

    def remove(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    def finish(self, slowest_kept: int) -> PassTiming:
        """Unhook every node and summarize; drops the references to the graph."""
        self.remove()
        calls, seconds = self._calls, self._seconds
        totals: dict[str, list[float]] = {}
        timed: list[NodeTime] = []
        executions: list[NodeTime] = []
        for index, node in enumerate(self._nodes):
            if not calls[index]:
                continue
            name = node_type(node)
            entry = totals.setdefault(name, [0, 0.0])
            entry[0] += calls[index]
            entry[1] += seconds[index]
            timed.append(NodeTime(name, sequence_nr(node), seconds[index]))
        if self.detailed:
            for index, elapsed in self._order:
                node = self._nodes[index]
                executions.append(NodeTime(node_type(node), sequence_nr(node), elapsed, self._shapes[index]))
        timed.sort(key=lambda t: t.seconds, reverse=True)
        self._nodes = []
        return PassTiming(
            totals=tuple((name, int(calls), seconds) for name, (calls, seconds) in totals.items()),
            slowest=tuple(timed[:slowest_kept]),
            executions=tuple(executions),
            node_seconds=sum(total for _, total in totals.values()),
        )
