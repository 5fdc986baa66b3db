"""The training jobs of `bench/gpu_check.py`, run under `torchpulse run`; each writes what torch itself counted.

`train`: one process, a small model whose body is compiled (on CUDA with `mode="reduce-overhead"`, so
CUDA-graph trees record and replay it; on CPU with the default mode) and whose head runs eagerly:

1. steady steps at one batch size;
2. two new batch sizes: a recompile that marks the batch dynamic, then a new shape of that graph (on CUDA:
   new recordings, then a re-recording for the new dynamic shape);
3. a function compiled with `mode="reduce-overhead"` that mutates its input (on CUDA: skips CUDA graphs, reason
   mutated_inputs; on CPU every such graph skips them, reason cpu_device);
4. one with a CPU op in it, compiled without Inductor's graph partition, which would run the op outside the
   graphs instead of skipping them (on CUDA: skips CUDA graphs, reason cpu_device);
5. steps under `torch.cuda.set_sync_debug_mode("error")` (CUDA only: any device-to-host sync raises), one
   of which makes the head's bias gradient NaN; that step skips the optimizers, as GradScaler would;
6. steady steps again, so the last readiness check sees the usual state.

Two optimizers: Adam over the compiled body (`capturable=True` on CUDA: its `step` stays on the device) and
AdamW over the eager head (`capturable=False`: `step` on the CPU; its grads are not CUDA-graph outputs, so
not static, and the previous step's grads are kept alive while new ones are made, so they move).

`ranks`: one rank of a 2-rank DistributedDataParallel job over gloo (on CUDA both ranks share device 0,
which NCCL refuses), a few steps, then a DCP save of the model and optimizer state.

The jobs know nothing about torchpulse: what they write is torch's own state (Dynamo's counters, the CUDA-graph
tree managers, `_is_static_for_cudagraphs`, `torch.isfinite`), for the check to compare /metrics with.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

BATCHES = (16, 24, 32)  # the first size, a recompile with the batch made dynamic, a new shape of that graph
STEADY_STEPS = 4
SHAPE_STEPS = 3
SYNC_CHECKED_STEPS = 6
NAN_STEP = 3  # of the sync-checked steps, 1-based
FINAL_STEPS = 3
# What the job trains, alive until the interpreter exits, as a training script's module-level model is: the
# agent names a non-finite parameter when it next sends (every 250 ms, and at exit), from the live modules.
KEPT: list[object] = []


class Net(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU())
        self.head = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))  # type: ignore[no-any-return]


def _skips() -> int:
    """Inductor's own count of graphs that were to use CUDA graphs and do not."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def _inductor_counter(name: str) -> int:
    from torch._dynamo.utils import counters

    return int(counters["inductor"][name])


def _tree_managers() -> list[Any]:
    """The training thread's CUDA-graph tree managers, from torch's own thread-local containers."""
    module = sys.modules.get("torch._inductor.cudagraph_trees")
    containers = getattr(getattr(module, "local", None), "tree_manager_containers", None) or {}
    return [c.tree_manager for c in containers.values() if getattr(c, "tree_manager", None) is not None]


def tree_state() -> dict[str, int]:
    """What the tree managers hold: trees (roots), nodes (recorded graphs), siblings recorded again for the same
    function under the same parent (re-recordings), functions warmed up, and pool bytes."""
    trees = nodes = again = warmed = pool = 0
    managers = _tree_managers()
    for manager in managers:
        warmed += len(manager.warmed_up_functions)
        for siblings in manager.roots.values():
            trees += len(siblings)
            nodes += sum(1 + root.num_descendants() for root in siblings)
            again += max(len(siblings) - 1, 0)
        pending = [node for siblings in manager.roots.values() for node in siblings]
        while pending:
            node = pending.pop()
            for children in node.children.values():
                again += max(len(children) - 1, 0)
                pending.extend(children)
    if managers:
        from torch._inductor.cudagraph_trees import get_cudagraph_segments

        pool = sum(
            int(segment["total_size"])
            for manager in managers
            for segment in get_cudagraph_segments(manager.cuda_graphs_thread_pool)
        )
    return {"managers": len(managers), "trees": trees, "nodes": nodes, "again": again, "warmed": warmed, "pool": pool}


def shape_rerecords() -> int:
    """Recordings of a compiled graph for a shape after its first, from the shape caches of Inductor's
    `cudagraphify_impl` (one per compiled graph, forward and backward apart)."""
    if "torch._inductor.cudagraph_trees" not in sys.modules:
        return 0
    total = 0
    for obj in gc.get_objects():
        # type(), not isinstance(): a dead weak proxy raises on any attribute, __class__ included.
        if not (type(obj) is types.FunctionType and obj.__code__.co_name == "deferred_cudagraphify"):
            continue
        names = obj.__code__.co_freevars
        if "fn_cache" in names and obj.__closure__ is not None:
            cache = obj.__closure__[names.index("fn_cache")].cell_contents
            total += max(len(cache) - 1, 0)
    return total


def _static_checker() -> tuple[Callable[[torch.Tensor], bool], list[str]]:
    """Dynamo's own judge of a static grad, and notes where it could not judge."""
    notes: list[str] = []
    try:
        from torch._dynamo.variables.optimizer import _is_static_for_cudagraphs
    except ImportError as exc:
        notes.append(f"no _is_static_for_cudagraphs on this torch: {exc}")
        return (lambda _grad: True), notes

    def is_static(grad: torch.Tensor) -> bool:
        try:
            return bool(_is_static_for_cudagraphs(grad))
        except AssertionError:  # a manager between runs has no current node: Dynamo would copy the grad
            notes.append("a tree manager had no current node: counted as not static")
            return False

    return is_static, notes


class Readiness:
    """What each optimizer looked like right after its last step, as Dynamo's optimizer integration sees it."""

    def __init__(self, names: dict[torch.optim.Optimizer, str]) -> None:
        self.names = names
        self.is_static, self.notes = _static_checker()
        self.last_ptrs: dict[int, int] = {}
        self.steps: dict[str, int] = {}
        self.order: list[str] = []  # by first step: the probe labels optimizers in that order
        self.seen: dict[str, dict[str, Any]] = {}

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        name = self.names[optimizer]
        if name not in self.steps:
            self.order.append(name)
        self.steps[name] = self.steps.get(name, 0) + 1
        nonstatic = moving = cpu_steps = 0
        capturable: dict[str, float] = {}
        for index, group in enumerate(optimizer.param_groups):
            cuda_params = [p for p in group["params"] if p.is_cuda]
            if cuda_params and "capturable" in group:
                capturable[str(index)] = 1.0 if group["capturable"] else 0.0
            for param in cuda_params:
                if param.grad is not None:
                    nonstatic += not self.is_static(param.grad)
                    ptr = param.grad.data_ptr()
                    moving += self.last_ptrs.get(id(param), ptr) != ptr
                    self.last_ptrs[id(param)] = ptr
                step = optimizer.state.get(param, {}).get("step")
                cpu_steps += isinstance(step, torch.Tensor) and not step.is_cuda
        self.seen[name] = {
            "class": type(optimizer).__name__,
            "nonstatic_grads": nonstatic,
            "moving_grads": moving,
            "cpu_step_tensors": cpu_steps,
            "capturable": capturable,
        }


@contextmanager
def sync_errors(device: torch.device) -> Iterator[bool]:
    """Any device-to-host sync inside raises (CUDA only); yields whether that is so, after proving it."""
    if device.type != "cuda":
        yield False
        return
    probe = torch.zeros(1, device=device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        try:
            probe.item()
        except RuntimeError:
            pass
        else:
            raise AssertionError("set_sync_debug_mode('error') let .item() through: the sync check would prove nothing")
        yield True
    finally:
        torch.cuda.set_sync_debug_mode("default")


@contextmanager
def _without_graph_partition() -> Iterator[None]:
    import torch._inductor.config as inductor_config

    if not hasattr(inductor_config, "graph_partition"):
        yield
        return
    with inductor_config.patch(graph_partition=False):
        yield


def mutate(x: torch.Tensor) -> torch.Tensor:
    x.add_(1)
    return x * 2


def with_cpu_op(x: torch.Tensor) -> torch.Tensor:
    return (x.cpu() * 2).to(x.device) + x


def train(device: torch.device, out: Path) -> int:
    torch.manual_seed(0)
    cuda = device.type == "cuda"
    model = Net().to(device)
    KEPT.append(model)
    # On CPU, reduce-overhead would skip CUDA graphs on every graph: the default mode trains as CPU jobs do.
    body = torch.compile(model.body, mode="reduce-overhead") if cuda else torch.compile(model.body)
    graphed = torch.optim.Adam(model.body.parameters(), lr=1e-3, capturable=cuda)  # capturable needs CUDA
    eager = torch.optim.AdamW(model.head.parameters(), lr=1e-3)
    optimizers = [graphed, eager]
    readiness = Readiness({graphed: "graphed", eager: "eager"})
    skips_by_phase: dict[str, int] = {}
    record: dict[str, Any] = {"device": str(device), "torch": torch.__version__, "passes": 0}
    held: list[torch.Tensor | None] = []
    finite_flags: list[tuple[str, torch.Tensor]] = []

    def step(batch: int, nan: bool = False) -> None:
        nonlocal held
        held = [p.grad for p in model.head.parameters()]  # alive while the next grads are made: they move
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        x = torch.randn(batch, 32, device=device)
        loss = model.head(body(x)).square().mean()
        bias = model.head.bias
        # On the eager head: Dynamo never sees the hook. A Python float multiplies on the device, no sync.
        hook = bias.register_hook(lambda g: g * float("nan")) if nan else None  # type: ignore[no-untyped-call]
        loss.backward()
        record["passes"] += 1
        if hook is not None:
            hook.remove()
            # Read after the sync-checked steps: reading now would sync.
            finite_flags.extend((n, torch.isfinite(p.grad).all()) for n, p in model.named_parameters())  # type: ignore[arg-type]
            return  # a non-finite step does not step the optimizers
        for optimizer in optimizers:
            optimizer.step()
            readiness.after_step(optimizer)

    def phase(name: str, run: Callable[[], None]) -> None:
        before = _skips()
        run()
        skips_by_phase[name] = _skips() - before

    def steps(*batches: int) -> Callable[[], None]:
        def run() -> None:
            for batch in batches:
                step(batch)

        return run

    def calls(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(3):
                fn(torch.randn(4, device=device))

        return run

    phase("steady", steps(*[BATCHES[0]] * STEADY_STEPS))
    phase("new_shapes", steps(*[b for b in BATCHES[1:] for _ in range(SHAPE_STEPS)]))
    # On CPU too: there every graph compiled for CUDA graphs skips them, for want of a CUDA device.
    phase("mutated_input", calls(torch.compile(mutate, mode="reduce-overhead")))
    # Inductor's graph partition (on by default in 2.13) runs a CPU op outside the CUDA graphs instead of
    # skipping them; without it a graph with a CPU op skips them, which is what the probe is to count.
    with _without_graph_partition():
        phase("cpu_op", calls(torch.compile(with_cpu_op, mode="reduce-overhead")))
    # After the other graphs ran: warm-up, recording or replay again (whichever the trees need) before the
    # sync check, where only replays may run (a recording syncs by design).
    steps(*[BATCHES[-1]] * 3)()

    def sync_checked() -> None:
        with sync_errors(device) as checked:
            for index in range(1, SYNC_CHECKED_STEPS + 1):
                step(BATCHES[-1], nan=index == NAN_STEP)
        record["sync_checked_steps"] = SYNC_CHECKED_STEPS if checked else 0

    phase("sync_checked", sync_checked)
    phase("final", steps(*[BATCHES[-1]] * FINAL_STEPS))
    if cuda:
        torch.cuda.synchronize()
    record["nonfinite_parameters"] = sorted(name for name, flag in finite_flags if not bool(flag))
    record["nonfinite_passes"] = 1
    record["skips_by_phase"] = skips_by_phase
    record["skips"] = _skips()
    record["graph_partition"] = getattr(sys.modules.get("torch._inductor.config"), "graph_partition", None)
    record["nonstatic_input_copies"] = _inductor_counter("cudagraph_recorded_non_static_inputs")
    record["trees"] = tree_state()
    record["shape_rerecords"] = shape_rerecords()
    record["optimizer_steps"] = readiness.steps
    record["optimizer_order"] = readiness.order
    record["readiness"] = readiness.seen
    record["notes"] = sorted(set(readiness.notes))
    out.write_text(json.dumps(record, indent=1, sort_keys=True))
    return 0


def ranks(device: torch.device, out: Path, checkpoint: Path, steps: int) -> int:
    import torch.distributed as dist

    # Before anything imports Dynamo (see torchpulse/probes/torch_compat/dynamo.py, DYNAMO).
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        torch.manual_seed(0)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        model = nn.parallel.DistributedDataParallel(Net().to(device))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            model(torch.randn(8, 32, device=device)).square().mean().backward()
            optimizer.step()
        from torch.distributed.checkpoint import state_dict_saver
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(model, optimizer)
        on = {str(t.device) for t in model_state.values() if isinstance(t, torch.Tensor)}
        state_dict_saver.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(checkpoint))
        dist.barrier()
        record = {"rank": rank, "steps": steps, "state_devices": sorted(on), "checkpoint": str(checkpoint)}
        (out / f"rank{rank}.json").write_text(json.dumps(record, sort_keys=True))
    finally:
        dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("job", choices=("train", "ranks"))
    parser.add_argument("--device", choices=("cpu", "cuda"), required=True)
    parser.add_argument("--out", type=Path, required=True, help="train: a JSON file; ranks: a directory")
    parser.add_argument("--checkpoint", type=Path, help="ranks: the DCP checkpoint directory to save")
    parser.add_argument("--steps", type=int, default=4, help="ranks: training steps before the save")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    if args.job == "train":
        return train(device, args.out)
    if args.checkpoint is None:
        parser.error("ranks needs --checkpoint")
    args.out.mkdir(parents=True, exist_ok=True)
    return ranks(device, args.out, args.checkpoint, args.steps)


if __name__ == "__main__":
    raise SystemExit(main())
