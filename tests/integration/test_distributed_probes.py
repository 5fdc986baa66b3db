"""The in-process probes on 2 real gloo ranks: DDP (no_sync, unused parameters, static graph), FSDP2, DCP saves."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support import run_inline_ranks

# One run of both ranks records every fact the tests below assert on (each run costs seconds).
RANK = r"""
import json, sys, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed as dist
from torch import nn
from tests.support import local_agent

rank, store, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
agent = local_agent(("autograd", "optimizer", "checkpoint"))
facts = {}


class Net(nn.Module):
    def __init__(self, unused=False):
        super().__init__()
        torch.manual_seed(0)
        # 5 output rows shard unevenly over 2 ranks (3 and 2).
        self.layers = nn.ModuleList([nn.Linear(4, 8), nn.Linear(8, 5)])
        self.unused = nn.Linear(4, 4) if unused else None

    def forward(self, x):
        return self.layers[1](torch.relu(self.layers[0](x)))


def batch(nan=False):
    x = torch.randn(3, 4)
    if nan:
        x[0, 0] = float("nan")
    return x


def record(phase):
    agent.drain()
    samples, histograms = agent.store.snapshot()
    values = {f"{s.family}|{','.join(s.labels)}": s.value for s in samples}
    values.update({f"{h.family}|{','.join(h.labels)}": sum(h.bucket_counts) for h in histograms})
    events = [[e.event, dict(e.fields)] for e in agent.take_events(1000)]
    facts[phase] = {"values": values, "events": events, "passes": agent.probes["autograd"]._schedule.passes}


record("start")
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

mesh = init_device_mesh("cpu", (2,))

# FSDP2 gradient accumulation: a micro-step without gradient sync (FSDP2's no_sync) keeps
# this rank's unsharded gradient; rank 1's holds a NaN before any reduce-scatter.
model = Net()
for layer in model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(2):
    model.set_requires_gradient_sync(False)
    model(batch(nan=step == 1 and rank == 1)).sum().backward()
    record(f"fsdp_no_sync_micro_{step}")
    model.set_requires_gradient_sync(True)
    model(batch()).sum().backward()
    opt.step()
    opt.zero_grad()
record("fsdp_no_sync")
del model, opt

from torch.nn.parallel import DistributedDataParallel as DDP

# Gradient accumulation: one no_sync micro-step, then one that all-reduces. Rank 1's
# no_sync micro-step of the second step sees a NaN only it has; the all-reduce spreads it.
ddp = DDP(Net())
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
for step in range(2):
    with ddp.no_sync():
        ddp(batch(nan=step == 1 and rank == 1)).sum().backward()
    ddp(batch()).sum().backward()
    opt.step()
    opt.zero_grad()
record("ddp_no_sync")
del ddp, opt

for name, options in (("ddp_unused", {"find_unused_parameters": True}), ("ddp_static", {"static_graph": True})):
    ddp = DDP(Net(unused=name == "ddp_unused"), **options)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(2):
        ddp(batch()).sum().backward()
        opt.step()
        opt.zero_grad()
    record(name)
    del ddp, opt

for reshard in (True, False):
    model = Net()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        model(batch(nan=step == 2 and rank == 1)).sum().backward()
        opt.step()
        opt.zero_grad()
    local = sum(t._local_tensor.numel() for t in model.parameters())
    facts[f"fsdp_{reshard}_local_elements"] = local
    record(f"fsdp_{reshard}")
    del model, opt

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

model = Net()
fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(batch()).sum().backward()
opt.step()
model_state, optim_state = get_state_dict(model, opt)
dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=f"{out}/step-1")
record("dcp_save")

agent.shutdown()
dist.barrier()
dist.destroy_process_group()
print(json.dumps(facts))
"""


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What each of the 2 ranks recorded, phase by phase."""
    tmp = tmp_path_factory.mktemp("distributed")
    results = run_inline_ranks(RANK, tmp, timeout=180)
    assert [0, 0] == [code for _, _, code in results], [err[-3000:] for _, err, _ in results]
    return [json.loads(out.strip().splitlines()[-1]) for out, _, _ in results]


# Phases in the order the ranks ran them: counters are totals since the process started.
PHASES = ("start", "fsdp_no_sync", "ddp_no_sync", "ddp_unused", "ddp_static", "fsdp_True", "fsdp_False", "dcp_save")


def _delta(facts: dict[str, Any], phase: str, key: str) -> float:
    """How much a counter grew during `phase` (an optimizer label is reused once its optimizer died)."""
    before = PHASES[PHASES.index(phase) - 1]
    return float(facts[phase]["values"].get(key, 0.0)) - float(facts[before]["values"].get(key, 0.0))


def _nonfinite(facts: dict[str, Any], phase: str, before: str | None = None) -> list[tuple[int, list[str]]]:
    """(pass index within the phase, sorted parameter names) of each non-finite event of a phase."""
    start = facts[before or PHASES[PHASES.index(phase) - 1]]["passes"]
    return [
        (fields["pass_index"] - start, sorted(fields["names"].split(",")))
        for event, fields in facts[phase]["events"]
        if event == "autograd.nonfinite_gradients"
    ]


def _value(facts: dict[str, Any], phase: str, key: str) -> float | None:
    value = facts[phase]["values"].get(key)
    return None if value is None else float(value)


PASSES, SGD, ADAMW = "backward_passes_total|backward", "optimizer_steps_total|SGD#0", "optimizer_steps_total|AdamW#0"
NAMES = ["layers.0.weight", "layers.1.weight"]


def test_fsdp2_nan_in_a_micro_step_without_gradient_sync_is_seen_on_its_rank(ranks: list[dict[str, Any]]) -> None:
    """set_requires_gradient_sync(False): the unsharded gradient stays on the rank (its parameter's storage is
    freed by the reshard): rank 1's NaN is reported after that very pass, named, and on rank 1 only."""
    # Passes since the first micro-step: the sync pass of step 0 (0), the no-sync pass of step 1 (1).
    micro = [_nonfinite(f, "fsdp_no_sync_micro_1", "fsdp_no_sync_micro_0") for f in ranks]
    assert [[], [(1, NAMES)]] == micro


def test_fsdp2_passes_are_counted_under_gradient_accumulation(ranks: list[dict[str, Any]]) -> None:
    """Two steps of a no-sync and a sync micro-step are 4 passes and 2 optimizer steps per rank."""
    assert [(4.0, 2.0)] * 2 == [(_delta(f, "fsdp_no_sync", PASSES), _delta(f, "fsdp_no_sync", ADAMW)) for f in ranks]


def test_ddp_no_sync_passes_are_counted_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    """Two steps of two micro-steps (one under no_sync) are 4 backward passes and 2 optimizer steps per rank."""
    assert [(4.0, 2.0)] * 2 == [(_delta(f, "ddp_no_sync", PASSES), _delta(f, "ddp_no_sync", SGD)) for f in ranks]


def test_ddp_nan_on_one_rank_is_seen_there_first_then_on_both_after_the_all_reduce(ranks: list[dict[str, Any]]) -> None:
    """Rank 1's local NaN shows after its no_sync pass on rank 1 only; the all-reduce of the next pass spreads it
    to rank 0; the parameters are named as in the model, without DDP's `module.` prefix."""
    assert [[(3, NAMES)], [(2, NAMES), (3, NAMES)]] == [_nonfinite(f, "ddp_no_sync") for f in ranks]


def test_ddp_with_unused_parameters_or_a_static_graph_is_counted_without_probe_errors(
    ranks: list[dict[str, Any]],
) -> None:
    """find_unused_parameters=True and static_graph=True: 2 passes and 2 steps each, every probe still enabled."""
    counts = [
        (_delta(f, phase, PASSES), _delta(f, phase, SGD)) for f in ranks for phase in ("ddp_unused", "ddp_static")
    ]
    assert [(2.0, 2.0)] * 4 == counts
    errors = [
        key
        for f in ranks
        for key, value in f["dcp_save"]["values"].items()
        if key.startswith("agent_probe_errors_total") and value
    ]
    assert [] == errors


@pytest.mark.parametrize("reshard", [True, False])
def test_fsdp2_passes_steps_and_local_optimizer_state(ranks: list[dict[str, Any]], reshard: bool) -> None:
    """fully_shard with reshard_after_forward True or False: 3 passes and 3 steps per rank, and AdamW's state bytes
    are this rank's shard (exp_avg and exp_avg_sq in float32, plus a 4-byte step per parameter)."""
    phase = f"fsdp_{reshard}"
    # 5 rows over 2 ranks: 3 and 2, so the ranks hold different shards.
    assert [47, 38] == [f[f"{phase}_local_elements"] for f in ranks]
    expected = [(3.0, 3.0, 8.0 * elements + 4 * 4) for elements in (47, 38)]
    assert expected == [
        (_delta(f, phase, PASSES), _delta(f, phase, ADAMW), _value(f, phase, "optimizer_state_bytes|AdamW#0"))
        for f in ranks
    ]


@pytest.mark.parametrize("reshard", [True, False])
def test_fsdp2_nonfinite_shards_are_found_and_named(ranks: list[dict[str, Any]], reshard: bool) -> None:
    """A NaN on rank 1 reaches both ranks' gradient shards through the reduce-scatter; the local shards are read
    without a collective and named by the module tree, not by FSDP's wrappers."""
    assert [[(2, NAMES)]] * 2 == [_nonfinite(f, f"fsdp_{reshard}") for f in ranks]


def test_dcp_save_of_fsdp2_state_is_timed_on_both_ranks_and_validated_once(ranks: list[dict[str, Any]]) -> None:
    """Both ranks time the save; only rank 0 (which writes `.metadata`) asks the daemon to validate it."""
    saved = [
        [
            (Path(fields["path"]).name, fields["api"], fields["validate"])
            for event, fields in f["dcp_save"]["events"]
            if event == "checkpoint saved"
        ]
        for f in ranks
    ]
    assert [[("step-1", "save", True)], [("step-1", "save", False)]] == saved
    assert [1.0, 1.0] == [_value(f, "dcp_save", "checkpoint_save_duration_seconds|save") for f in ranks]
