"""Counters whose labels are known in advance exist at 0 before their first event.

Prometheus' rate() and increase() cannot see the increment that created a series, so a counter
first exported at 1 hides its first event from the alert rules. Real probes, real training steps,
the real store; the daemon's side is in tests/integration/test_pipeline.py.
"""

from __future__ import annotations

import math
import subprocess
import sys
from typing import Any

import pytest
import torch

from tests.support import REPO, local_agent, series
from torchpulse.probes.agent.agent import DROP_REASONS
from torchpulse.probes.autograd.probe import PASS_KINDS
from torchpulse.probes.compile.reasons import CUDAGRAPH_SKIP_REASONS, RERECORD_REASONS


def _first_batch(agent: Any) -> dict[tuple[str, tuple[str, ...]], float]:
    """What the sender would send now, as (family, labels) -> value."""
    agent.drain()
    samples, _ = agent.store.take_changes()
    return {(s.family, s.labels): s.value for s in samples}


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, nan: bool = False) -> None:
    optimizer.zero_grad()
    loss = model(torch.ones(2, 4)).sum()
    (loss * math.nan if nan else loss).backward()
    if not nan:
        optimizer.step()


def test_a_training_job_exports_its_counters_at_zero_then_counts_exactly() -> None:
    """Before any pass: every pass kind, the non-finite passes, the drop reasons and each probe's errors at 0,
    and nothing of an optimizer not seen yet; after 3 clean steps and a NaN pass: exact counts, the zeros kept."""
    agent: Any = local_agent(("optimizer", "autograd"))
    try:
        before = _first_batch(agent)
        assert not agent.reports()  # zeros alone must not make a process that never trains connect
        expected: dict[tuple[str, tuple[str, ...]], float] = {
            **{("backward_passes_total", (kind,)): 0.0 for kind in PASS_KINDS},
            ("grad_nonfinite_passes_total", ()): 0.0,
            ("autograd_sampled_passes_total", ()): 0.0,
            **{("agent_events_dropped_total", (reason,)): 0.0 for reason in DROP_REASONS},
            ("agent_probe_errors_total", ("optimizer",)): 0.0,
            ("agent_probe_errors_total", ("autograd",)): 0.0,
        }
        assert expected == {key: value for key, value in before.items() if key[0].endswith("_total")}
        model = torch.nn.Linear(4, 3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            _step(model, optimizer)
        _step(model, optimizer, nan=True)
        _step(model, optimizer)  # the non-finite check of a pass is read back at a later pass
        agent.drain()
        assert (
            {("backward",): 5.0, ("grad",): 0.0, ("compiled_autograd",): 0.0, ("reentrant",): 0.0},
            1.0,
            (4.0, 0.0),
        ) == (
            series(agent, "backward_passes_total"),
            agent.store.value("grad_nonfinite_passes_total"),
            (
                agent.store.value("optimizer_steps_total", ("SGD#0",)),
                agent.store.value("optimizer_step_errors_total", ("SGD#0",)),
            ),
        )
    finally:
        agent.shutdown()


def test_an_optimizer_s_counters_start_at_zero_when_it_is_first_seen() -> None:
    """The optimizer label is known at its first step: its error counter is 0 from then on, and a step
    that raises later counts 1 on it."""

    class Flaky(torch.optim.SGD):
        explode = False

        def step(self, closure: Any = None) -> Any:
            if self.explode:
                raise RuntimeError("boom")
            return super().step(closure)

    agent: Any = local_agent(("optimizer",))
    try:
        optimizer = Flaky([torch.zeros(2, requires_grad=True)], lr=0.1)
        optimizer.step()
        agent.drain()
        assert (1.0, 0.0) == (
            agent.store.value("optimizer_steps_total", ("Flaky#0",)),
            agent.store.value("optimizer_step_errors_total", ("Flaky#0",)),
        )
        optimizer.explode = True
        with pytest.raises(RuntimeError):
            optimizer.step()
        optimizer.explode = False
        optimizer.step()  # the pre-hook of the next step sees that the previous one never finished
        agent.drain()
        assert (2.0, 1.0) == (
            agent.store.value("optimizer_steps_total", ("Flaky#0",)),
            agent.store.value("optimizer_step_errors_total", ("Flaky#0",)),
        )
    finally:
        agent.shutdown()


def test_a_disabled_check_or_sampling_exports_no_zero_and_switching_sampling_on_does() -> None:
    """No zero pretends to watch what is switched off; `set_sample_every` on starts the count at 0."""
    agent: Any = local_agent(("autograd",), options={"autograd_nonfinite": "0", "autograd_sample_every": "0"})
    try:
        model = torch.nn.Linear(4, 1)
        model(torch.ones(1, 4)).sum().backward()
        agent.drain()
        assert (None, None) == (
            agent.store.value("grad_nonfinite_passes_total"),
            agent.store.value("autograd_sampled_passes_total"),
        )
        agent.probes["autograd"].set_sample_every(2)
        model(torch.ones(1, 4)).sum().backward()  # applies the setting; its countdown is still running
        agent.drain()
        assert 0.0 == agent.store.value("autograd_sampled_passes_total")
    finally:
        agent.shutdown()


def test_reinstall_and_resend_keep_running_totals() -> None:
    """A probe disabled and enabled again, and a reconnect's resend of everything, never send a 0 over a count."""
    agent: Any = local_agent(("optimizer", "autograd"))
    try:
        model = torch.nn.Linear(4, 3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        _step(model, optimizer, nan=True)
        _step(model, optimizer)
        _first_batch(agent)
        for probe in agent.probes.values():
            probe.uninstall()
            probe.install()
        _step(model, optimizer)
        agent.store.mark_all_dirty()  # what the sender does after a reconnect
        batch = _first_batch(agent)
        assert (3.0, 1.0, 2.0, 0.0) == (
            batch[("backward_passes_total", ("backward",))],
            batch[("grad_nonfinite_passes_total", ())],
            batch[("optimizer_steps_total", ("SGD#0",))],
            batch[("optimizer_step_errors_total", ("SGD#0",))],
        )
    finally:
        agent.shutdown()


LATE_DYNAMO_JOB = """
import sys, torch
from torchpulse.probes.torch_compat import cudagraph_trees as trees_compat
if sys.argv[1] == "cuda":
    trees_compat.cuda_present = lambda: True  # as in a CUDA process: the tree-manager log is tapped
from tests.support import local_agent
agent = local_agent(("compile", "cudagraphs"))
def series(prefix):
    agent.drain()
    return sorted((s.family, s.labels, s.value) for s in agent.store.snapshot()[0] if s.family.startswith(prefix))
print(series("compile_"), series("cudagraph_"))
import torch._dynamo
print(series("compile_"), series("cudagraph_"))
import torch._inductor.cudagraph_trees
print(len(series("cudagraph_")), sorted({n for n, _, v in series("cudagraph_") if v == 0}))
compiled = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
compiled(torch.randn(3))
torch._dynamo.reset()
compiled = torch.compile(lambda x: x * 3, backend="eager", dynamic=False)
compiled(torch.randn(3))
print(series("compile_"))
agent.shutdown()
"""


def _late_dynamo_job(device: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", LATE_DYNAMO_JOB, device], cwd=REPO, capture_output=True, text=True, timeout=240
    )
    assert 0 == out.returncode, out.stderr[-3000:]
    return out.stdout.strip().splitlines()


@pytest.mark.process
def test_compile_zeros_wait_for_dynamo_and_cudagraph_zeros_for_the_tree_module_on_cuda() -> None:
    """Before the job imports Dynamo no compile counter exists; then frames ok/failed are 0, and a compile,
    torch._dynamo.reset() and another compile count 2. CUDA-graph counters appear once Inductor's tree
    module is loaded in a CUDA process, every fixed reason at 0."""
    nothing = "[] []"
    frames_at_zero = "[('compile_frames_total', ('failed',), 0.0), ('compile_frames_total', ('ok',), 0.0)] []"
    counted = "[('compile_frames_total', ('failed',), 0.0), ('compile_frames_total', ('ok',), 2.0)]"
    cudagraph_families = sorted(
        [
            "cudagraph_skips_total",
            "cudagraph_rerecords_total",
            "cudagraph_recordings_total",
            "cudagraph_warmups_total",
            "cudagraph_rerecord_limit_hits_total",
            "cudagraph_dynamic_shape_warnings_total",
            "cudagraph_nonstatic_input_copies_total",
        ]
    )
    cuda_zeros = f"{len(CUDAGRAPH_SKIP_REASONS) + len(RERECORD_REASONS) + 5} {cudagraph_families}"
    assert [nothing, frames_at_zero, cuda_zeros, counted] == _late_dynamo_job("cuda")
    # A CPU-only process records no CUDA graph: its skips are counted from their first one.
    assert [nothing, frames_at_zero, "0 []", counted] == _late_dynamo_job("cpu")
