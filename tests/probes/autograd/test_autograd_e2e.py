"""End to end: a training job with the autograd probe, a real daemon, a scrape and its log."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support import DaemonProcess, run_job, select, wait_for

JOB = textwrap.dedent("""
    import math
    import torch
    import torchpulse

    torchpulse.attach(probes=("optimizer", "autograd"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 8)
    for step in range(5):
        hook = model[2].weight.register_hook(lambda g: g * math.inf) if step == 2 else None
        model(x).square().mean().backward()
        if hook is not None:
            hook.remove()
        else:
            optimizer.step()
        optimizer.zero_grad()
    inp = x.clone().requires_grad_()
    torch.autograd.grad(model(inp).sum(), inp)
    torchpulse.detach()
""")


@pytest.mark.slow
def test_job_passes_nodes_and_nonfinite_reach_the_daemon(daemon: DaemonProcess) -> None:
    """Counts by kind, node series and the non-finite pass are scraped; the name is in the log."""
    env = daemon.env(TORCHPULSE_RUN="autograd-e2e", TORCHPULSE_OPT_AUTOGRAD_SAMPLE_EVERY="1")
    subprocess.run([sys.executable, "-c", JOB], env=env, check=True, timeout=120)

    def scraped() -> bool:
        samples = daemon.scrape()
        return bool(select(samples, "torchpulse_grad_nonfinite_passes_total", run="autograd-e2e"))

    wait_for(scraped, timeout=30)
    samples = daemon.scrape()
    run = {"run": "autograd-e2e"}
    assert [5.0] == list(select(samples, "torchpulse_backward_passes_total", kind="backward", **run).values())
    assert [1.0] == list(select(samples, "torchpulse_backward_passes_total", kind="grad", **run).values())
    assert [6.0] == list(select(samples, "torchpulse_autograd_sampled_passes_total", **run).values())
    assert [1.0] == list(select(samples, "torchpulse_grad_nonfinite_passes_total", **run).values())
    # The passes after the skipped step were clean again.
    assert [0.0] == list(select(samples, "torchpulse_grad_nonfinite_parameters", **run).values())
    assert [20.0] == list(
        select(samples, "torchpulse_autograd_node_calls_total", node="AccumulateGrad", **run).values()
    )  # 4 params x 5
    assert select(samples, "torchpulse_backward_duration_seconds_count", kind="backward", **run)
    [event] = [line for line in daemon.log_lines() if line.get("event") == "autograd.nonfinite_gradients"]
    assert ("2.weight", 1, 2) == (event["names"], event["parameters"], event["pass_index"])


MAIN_RETURNS_AFTER_A_NAN = textwrap.dedent("""
    import math
    import torch

    def main():
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(10):
            x = torch.full((2, 4), math.nan) if step == 5 else torch.ones(2, 4)
            model(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            if step == 5:
                return  # the model is freed within one flush of its bad pass

    main()
""")


@pytest.mark.process
def test_a_main_that_returns_right_after_its_nan_step_still_has_the_parameters_named(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    """`torchpulse run -- python job.py`, a NaN input at step 5 of 10 inside `main()`, which then returns: the
    daemon's log line names the two weights the NaN reached (ReLU's gradient at NaN is 0, so the biases stay
    finite), not `names=` empty."""
    result = run_job(MAIN_RETURNS_AFTER_A_NAN, tmp_path, "main-returns", daemon.env())
    assert 0 == result.returncode, result.stderr

    def logged() -> list[dict[str, object]]:
        return [line for line in daemon.log_lines() if line.get("event") == "autograd.nonfinite_gradients"]

    wait_for(lambda: bool(logged()), timeout=30)
    [event] = logged()
    assert (2, ["0.weight", "2.weight"]) == (
        event["parameters"],
        sorted(str(event["names"]).split(",")),
    )
