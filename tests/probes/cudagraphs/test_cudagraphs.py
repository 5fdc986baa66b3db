"""CUDA-graph probe paths that run without a GPU: torch's own skip logging, tree-manager log lines
replayed from stand-ins of torch's frames, tree gauges, the readiness mirror of Dynamo and the readiness of
every kind of CPU optimizer, labels across a re-install, and `reduce-overhead` skips across
`torch._dynamo.reset()`."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch._dynamo
import torch._inductor.cudagraph_trees as cudagraph_trees
from torch._inductor.cudagraph_trees import CUDAGraphNode, CUDAWarmupNode, StorageWeakRefWrapper
from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter

from tests.support import local_agent, series
from torchpulse.probes.torch_compat import cudagraph_trees as trees_compat
from torchpulse.probes.torch_compat import dynamo as dynamo_compat
from torchpulse.probes.torch_compat import features
from torchpulse.protocol import Command

TREES_LOG = logging.getLogger(trees_compat.CUDAGRAPH_TREES_LOGGER)
STATIC_INPUT_CHANGED = "static input data pointer changed.\ninput name: primals_1. data pointer changed from 1 to 2."


def _counted(agent: Any, family: str) -> dict[tuple[str, ...], float]:
    """The series of a counter family that counted something (the others wait at 0)."""
    return {labels: value for labels, value in series(agent, family).items() if value}


def _poll(agent: Any) -> None:
    """One optimizer step (the probe's poll point), then the sender's work."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1).step()
    agent.drain()


@pytest.fixture
def agent(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The optimizer and cudagraphs probes as in a CUDA process (the tree-manager log is tapped)."""
    monkeypatch.setattr(trees_compat, "cuda_present", lambda: True)
    probe_agent: Any = local_agent(("optimizer", "cudagraphs"), optimizer_state_every=1)
    yield probe_agent
    probe_agent.shutdown()


# -- stand-ins for the torch 2.13 functions that log a recording -----------------------------
def _run(failed_checks: list[str], records: bool) -> None:
    """Like `CUDAGraphTreeManager._run`: one line per recorded sibling that fails its checks, then
    a recording or (when a later sibling matched) a replay, which logs nothing."""
    unexpected_rerecord_reason = None  # read from this frame by the probe, as from torch's
    for reason in failed_checks:
        unexpected_rerecord_reason = reason  # noqa: F841
        TREES_LOG.debug("[%s] Re-recording function=%s, mode=%s, reason=%s", "0/0", "forward", "FORWARD", reason)
    if records:
        _record_function()


def _record_function() -> None:
    TREES_LOG.debug(
        "[%s] Recording function=%s, mode=%s, cuda_graph_id=%d, inputs: %s", "0/0", "forward", "FORWARD", 0, ""
    )


def _cudagraphify_impl() -> Callable[[int], None]:
    """Like `cudagraphify_impl`: one tree function per symint key, the first shape included."""
    fn_cache: dict[int, bool] = {}

    def deferred_cudagraphify(int_key: int) -> None:
        if int_key in fn_cache:
            return
        TREES_LOG.info("[%s] Recording cudagraph tree for symint key %s", "0/0", int_key)
        fn_cache[int_key] = True

    return deferred_cudagraphify


@pytest.fixture
def stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe looks for the stand-ins' frames where it looks for torch's."""
    frames = SimpleNamespace(run=_run.__code__, deferred=_cudagraphify_impl().__code__)
    monkeypatch.setattr(trees_compat, "tree_frames", lambda: frames, raising=False)


def test_this_torch_has_the_frames_the_probe_reads() -> None:
    """The stand-ins mirror torch 2.13: the re-record reason and the per-shape cache are locals there."""
    frames = trees_compat.tree_frames()
    assert frames is not None
    assert "unexpected_rerecord_reason" in frames.run.co_varnames
    assert "fn_cache" in frames.deferred.co_freevars
    assert frames.run is cudagraph_trees.CUDAGraphTreeManager._run.__code__


def test_a_rerecord_is_counted_once_per_recording_not_per_failed_sibling(agent: Any, stand_ins: None) -> None:
    """torch logs a Re-recording line for every sibling whose checks fail, also when a later one replays."""
    _run([], records=True)  # the first recording
    _run([STATIC_INPUT_CHANGED], records=True)  # a real re-record: a second sibling
    for _ in range(5):  # alternating inputs: the first sibling fails, the second replays
        _run([STATIC_INPUT_CHANGED], records=False)
    _run([STATIC_INPUT_CHANGED, "cudagraph managed tensor data pointer changed.\n"], records=True)
    agent.drain()
    assert {("static_input_changed",): 1.0, ("managed_index_mismatch",): 1.0} == _counted(
        agent, "cudagraph_rerecords_total"
    )


def test_a_new_shape_is_a_rerecord_per_compiled_graph(agent: Any, stand_ins: None) -> None:
    """Forward and backward share a compile id, and ids restart after torch._dynamo.reset(): only a
    second shape of the same graph is a new_dynamic_shape re-record."""
    forward, backward = _cudagraphify_impl(), _cudagraphify_impl()
    forward(4)
    backward(4)
    forward(6)
    backward(6)
    after_reset = _cudagraphify_impl()  # same compile id "0/0" again
    after_reset(8)
    agent.drain()
    assert {("new_dynamic_shape",): 2.0} == _counted(agent, "cudagraph_rerecords_total")


def test_without_the_frames_lines_are_counted_and_the_gap_logged_once(
    agent: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On a torch whose tree functions differ, each Re-recording line counts (an over-count on alternating
    inputs) and new shapes are told apart by compile id; the missing feature is logged once."""
    monkeypatch.setattr(trees_compat, "tree_frames", lambda: None, raising=False)
    monkeypatch.setattr(features, "FEATURES", {})
    monkeypatch.setattr(features, "_DETECTORS", {**features._DETECTORS, "cudagraph_tree_frames": lambda: False})
    _run([STATIC_INPUT_CHANGED], records=True)
    _run([STATIC_INPUT_CHANGED], records=False)
    forward = _cudagraphify_impl()
    forward(4)
    forward(6)
    agent.drain()
    assert {("static_input_changed",): 2.0, ("new_dynamic_shape",): 1.0} == _counted(agent, "cudagraph_rerecords_total")
    expected = (
        "torchpulse: cudagraphs probe runs without a torch feature "
        "(feature='cudagraph_tree_frames' reason='not present in this torch')"
    )
    assert [expected] == [r.getMessage() for r in caplog.records if "cudagraph_tree_frames" in r.getMessage()]


def test_skips_torch_logs_without_the_usual_prefix_keep_their_reason(agent: Any) -> None:
    """Input storage mutation and override annotations are logged by the same skip function without
    'skipping cudagraphs': they are CUDA graphs skipped for a reason, not CPU graphs."""
    log_cudagraph_skip_and_bump_counter("input storage mutation (1 instances). Found from:\n File x.py")
    log_cudagraph_skip_and_bump_counter("disabling cudagraphs due to override_cudagraphs annotation")
    _poll(agent)
    assert {("mutated_inputs",): 1.0, ("other",): 1.0} == _counted(agent, "cudagraph_skips_total")


@pytest.mark.parametrize(
    "message",
    [
        "skipping cudagraph due to function 0 exceeding max re-recording limit (=128) on cudagraph node 1 due to "
        "static input data pointer changed.",
        # torch 2.15, cudagraph_managed_input_rerecord_action="skip"
        "skipping cudagraph due to function 0 reaching the cudagraph-managed input re-recording threshold (=5) "
        "on cudagraph node 1 for input indices [0].",
    ],
)
def test_a_skip_that_ends_re_recording_is_a_limit_hit(agent: Any, message: str) -> None:
    """Both of torch's re-record limits make the function run without CUDA graphs: one skip and one limit hit."""
    log_cudagraph_skip_and_bump_counter(message)
    _poll(agent)
    assert {("other",): 1.0} == _counted(agent, "cudagraph_skips_total")
    assert 1.0 == agent.store.value("cudagraph_rerecord_limit_hits_total")


def _fake_manager(roots: int) -> Any:
    nodes = {0: [SimpleNamespace(children={}) for _ in range(roots)]}
    return SimpleNamespace(roots=nodes, cuda_graphs_thread_pool=None, current_node=None)


def test_tree_gauges_follow_a_reset_of_the_trees(agent: Any) -> None:
    """torch._dynamo.reset() drops the tree managers: the gauges go to zero instead of keeping old trees."""
    containers = cudagraph_trees.local.tree_manager_containers
    containers[0] = SimpleNamespace(tree_manager=_fake_manager(roots=2))
    try:
        probe = agent.probes["cudagraphs"]
        probe._trees.dirty = True  # as after a recording
        _poll(agent)
        assert (2.0, 2.0) == (agent.store.value("cudagraph_trees"), agent.store.value("cudagraph_nodes"))
        containers.clear()  # what reset_cudagraph_trees() does (Dynamo calls it only with CUDA)
        _poll(agent)
        assert (0.0, 0.0, 0.0) == (
            agent.store.value("cudagraph_trees"),
            agent.store.value("cudagraph_nodes"),
            agent.store.value("cudagraph_pool_bytes"),
        )
    finally:
        containers.clear()


class _CudaLike:
    """What the readiness mirror reads of a CUDA grad: its device and its storage address."""

    is_cuda = True

    def __init__(self, tensor: torch.Tensor, index: int = 0) -> None:
        self.device = SimpleNamespace(index=index)
        self._tensor = tensor

    def untyped_storage(self) -> torch.UntypedStorage:
        return self._tensor.untyped_storage()


def _recorded_node(outputs: list[torch.Tensor]) -> CUDAGraphNode:
    node = object.__new__(CUDAGraphNode)
    node.path_weakrefs = [[StorageWeakRefWrapper(t.untyped_storage()) for t in outputs], [None]]
    return node


def _warmup_node(outputs: list[torch.Tensor]) -> CUDAWarmupNode:
    node = object.__new__(CUDAWarmupNode)
    node.parent = None
    node.outputs_weakrefs = [StorageWeakRefWrapper(t.untyped_storage()) for t in outputs]
    return node


@pytest.mark.parametrize("make_node", [_recorded_node, _warmup_node])
def test_static_check_answers_like_the_tree_node_and_creates_no_tree_state(
    make_node: Callable[[list[torch.Tensor]], Any],
) -> None:
    """Grads that are outputs of the current graph path are static, others not, as torch's node says;
    asking about a device without a tree manager leaves torch's thread-local containers as they were."""
    outputs = [torch.zeros(3) for _ in range(4)]
    others = [torch.zeros(3) for _ in range(3)]
    node = make_node(outputs)
    containers = cudagraph_trees.local.tree_manager_containers
    containers[0] = SimpleNamespace(tree_manager=SimpleNamespace(current_node=node))
    try:
        grads = [_CudaLike(t) for t in outputs[1:] + others]
        expected = [node._is_cuda_graph_recorded_tensor(g) for g in grads]
        static = trees_compat.static_checker()
        assert [True] * 3 + [False] * 3 == expected
        assert expected == [static(g) for g in grads]  # type: ignore[arg-type]
        assert static(_CudaLike(others[0], index=1)) is False  # type: ignore[arg-type]
        assert [0] == list(containers)
    finally:
        containers.clear()


def _step_throwaway_optimizers(count: int) -> None:
    """A hyperparameter search's pattern: one optimizer per trial, stepped once, then collected."""
    param = torch.zeros(2, requires_grad=True)
    for _ in range(count):
        optimizer = torch.optim.SGD([param], lr=0.1)
        optimizer.step()
        del optimizer
    gc.collect()


def test_without_the_optimizer_probe_labels_of_collected_optimizers_are_reused() -> None:
    """Readiness series of optimizers built one per trial stay one series, as the optimizer probe's do."""
    agent: Any = local_agent(("cudagraphs",), optimizer_state_every=1)
    try:
        _step_throwaway_optimizers(20)
        agent.drain()
        assert {("SGD#0",): 0.0} == series(agent, "optimizer_nonstatic_grads")
    finally:
        agent.shutdown()


def test_optimizers_built_over_and_over_leave_no_countdowns(agent: Any) -> None:
    """A search building one optimizer per trial keeps no per-optimizer entry after the optimizer is gone."""
    probe = agent.probes["cudagraphs"]
    _step_throwaway_optimizers(30)
    agent.drain()
    assert len(probe._due_in) <= 1


def test_pool_bytes_sums_the_managers_pools_from_a_snapshot_without_traces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only segments of the managers' pools count, and the snapshot leaves out the allocator's trace ring."""
    calls: list[dict[str, object]] = []

    def memory_snapshot(mempool_id: object = None, include_traces: bool = True) -> list[dict[str, object]]:
        calls.append({"include_traces": include_traces})
        return [
            {"segment_pool_id": (1, 2), "total_size": 2 << 20},
            {"segment_pool_id": (0, 0), "total_size": 7},
            {"segment_pool_id": (1, 2), "total_size": 512},
            {"segment_pool_id": (3, 4), "total_size": 9},
        ]

    monkeypatch.setattr(torch.cuda, "memory_snapshot", memory_snapshot)
    managers = [SimpleNamespace(cuda_graphs_thread_pool=(1, 2))]
    assert ((2 << 20) + 512, [{"include_traces": False}]) == (trees_compat.pool_bytes(managers), calls)
    assert 0 == trees_compat.pool_bytes([])


class _ShardedLike(_CudaLike):
    """A CUDA DTensor grad (FSDP2): data_ptr() is 0 and its storage cannot be read; the shard is `_local_tensor`."""

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__(tensor)
        self._local_tensor = tensor

    def data_ptr(self) -> int:
        return 0

    def untyped_storage(self) -> torch.UntypedStorage:
        raise RuntimeError("Attempted to access the data pointer on an invalid python storage.")


def test_readiness_reads_sharded_grads_through_their_local_shard() -> None:
    """FSDP2 grads are DTensors: a moved shard counts as moved, and a graph output shard is static."""
    from torchpulse.probes.cudagraphs.readiness import measure_readiness

    outputs = [torch.zeros(3)]
    containers = cudagraph_trees.local.tree_manager_containers
    containers[0] = SimpleNamespace(tree_manager=SimpleNamespace(current_node=_recorded_node(outputs)))
    param = type("CudaParam", (), {"is_cuda": True})()
    param.grad = _ShardedLike(torch.zeros(3))
    optimizer: Any = SimpleNamespace(param_groups=[{"params": [param], "capturable": True}], state={})
    last: dict[int, int] = {}
    try:
        first = measure_readiness(optimizer, last, trees_compat.static_checker())
        param.grad = _ShardedLike(outputs[0])
        second = measure_readiness(optimizer, last, trees_compat.static_checker())
    finally:
        containers.clear()
    assert ((1, 0), (0, 1)) == (
        (first.nonstatic_grads, first.moving_grads),
        (second.nonstatic_grads, second.moving_grads),
    )


def test_a_disabled_and_enabled_probe_keeps_the_optimizer_label() -> None:
    """Without the optimizer probe, a re-install of the cudagraphs probe keeps a live optimizer's one series."""
    agent: Any = local_agent(("cudagraphs",), optimizer_state_every=1)
    optimizer = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)
    try:
        optimizer.step()
        for number, name in enumerate(("disable", "enable"), start=1):
            agent.control.receive(Command(number, name, {"probe": "cudagraphs"}))
            optimizer.step()
        optimizer.step()
        agent.drain()
        assert [True, True] == [result.ok for result in agent.control.results]
        assert {("SGD#0",): 0.0} == series(agent, "optimizer_nonstatic_grads")
    finally:
        agent.shutdown()


def test_cpu_optimizers_of_every_kind_have_nothing_to_fix() -> None:
    """SGD, Adam (foreach, fused), AdamW with a group added later, LBFGS, SparseAdam and an optimizer
    without grads, with grads replaced or kept: zero gauges, no capturable series, no hint."""
    agent: Any = local_agent(("optimizer", "cudagraphs"), optimizer_state_every=1)
    model = torch.nn.Linear(3, 2)
    embedding = torch.nn.Embedding(4, 2, sparse=True)
    extra = torch.nn.Parameter(torch.zeros(3))
    groups: list[dict[str, Any]] = [{"params": [model.weight]}, {"params": [model.bias], "lr": 0.01}]
    adamw = torch.optim.AdamW(groups)
    adamw.add_param_group({"params": [extra]})
    optimizers = [
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        torch.optim.Adam(model.parameters(), foreach=True),
        torch.optim.Adam(model.parameters(), fused=True),
        adamw,
        torch.optim.LBFGS(model.parameters()),
        torch.optim.SparseAdam(embedding.parameters()),
        torch.optim.Adam([torch.nn.Parameter(torch.ones(1))]),
    ]

    def loss() -> float:
        value = model(torch.ones(2, 3)).sum() + embedding(torch.tensor([1])).sum()
        value.backward()
        return float(value.detach())

    try:
        for step in range(3):
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=step % 2 == 0)
                optimizer.step(loss)  # every kind takes a closure; LBFGS needs one
        agent.drain()
        labels = [agent.probes["optimizer"]._tracked[optimizer].label for optimizer in optimizers]
        zeros = {(label,): 0.0 for label in labels}
        gauges = ("optimizer_nonstatic_grads", "optimizer_moving_grads", "optimizer_cpu_step_tensors")
        assert [zeros, zeros, zeros, {}] == [series(agent, family) for family in (*gauges, "optimizer_capturable")]
        assert [] == [event.event for event in agent._events if "CUDA graphs" in event.event]
    finally:
        agent.shutdown()


@pytest.mark.process
def test_reduce_overhead_on_cpu_is_one_skip_per_compile_also_after_dynamo_reset() -> None:
    """A forward and its lazily compiled backward are one cpu_device skip, as torch counts, again after a reset."""
    agent: Any = local_agent(("cudagraphs",), optimizer_state_every=1)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = dynamo_compat.dynamo_counter("inductor", "cudagraph_skips")
    try:
        for _ in range(2):
            compiled = torch.compile(model, mode="reduce-overhead")
            for _ in range(2):
                compiled(torch.ones(1, 2)).sum().backward()
                optimizer.step()
            torch._dynamo.reset()
        agent.drain()
        assert 2 == dynamo_compat.dynamo_counter("inductor", "cudagraph_skips") - before
        assert {("cpu_device",): 2.0} == {
            labels: value for labels, value in series(agent, "cudagraph_skips_total").items() if value
        }
    finally:
        agent.shutdown()


def test_an_optimizer_first_seen_while_the_optimizer_probe_is_off_gets_one_label_from_both() -> None:
    """Optimizer B steps first while the optimizer probe is disabled: both probes call it SGD#1 (the CUDA-graph
    probe's own numbering called it SGD#0, the label of optimizer A, so both wrote one series)."""
    agent: Any = local_agent(("optimizer", "cudagraphs"), optimizer_state_every=1)
    try:
        first = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
        _step(first)
        agent.probes["optimizer"].enabled = False
        second = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
        _step(second)
        agent.probes["optimizer"].enabled = True
        _step(second)
        agent.drain()
        steps = {labels[0] for labels in series(agent, "optimizer_steps_total")}
        readiness = sorted(labels[0] for labels in series(agent, "optimizer_nonstatic_grads"))
        assert ({"SGD#0", "SGD#1"}, ["SGD#0", "SGD#1"]) == (steps, readiness)
    finally:
        agent.shutdown()


def _step(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.ones_like(param)
    optimizer.step()
