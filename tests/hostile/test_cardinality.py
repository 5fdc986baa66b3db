"""Cardinality: unbounded label values from a hostile or buggy job cannot blow up the series count.

Two layers hold the line. The agent folds free-form values (function names,
graph-break locations, autograd nodes) with `BoundedLabel`: the first K keep
their label, later ones count under `other`. The daemon does not fold: it
refuses each new series beyond `series_limit_per_run` and counts the refusal
in `torchpulse_daemon_series_rejected_total{reason="run_series_limit"}` and
`torchpulse_run_series_rejected{run}`; series already admitted keep updating.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.hostile.agents import RawAgent
from tests.support import DaemonProcess, local_agent, select, series, start_daemon, wait_for
from torchpulse.probes.agent.store import OTHER
from torchpulse.protocol import Sample

LIMIT = 50


@pytest.fixture
def small_budget_daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    """A real daemon whose per-run series budget is 50."""
    config = tmp_path / "torchpulse.toml"
    config.write_text(f"[runs]\nseries_limit_per_run = {LIMIT}\n")
    proc = start_daemon(tmp_path, extra_args=["--config", str(config)])
    try:
        yield proc
    finally:
        proc.stop()


def _one(samples: dict[Any, float]) -> float:
    assert 1 == len(samples), samples
    return next(iter(samples.values()))


def test_unbounded_function_names_stop_at_the_run_budget(small_budget_daemon: DaemonProcess) -> None:
    """A thousand distinct function names: fifty series are kept, 950 refusals counted, other runs unaffected."""
    daemon = small_budget_daemon
    hostile = RawAgent(daemon.socket_path, "hostile")
    for batch in range(20):
        hostile.send([Sample("recompiles_total", (f"fn_{batch}_{i}_{'x' * 40}", "guard"), 1.0) for i in range(50)])
    # An admitted series still updates after the budget is spent.
    hostile.send([Sample("recompiles_total", (f"fn_0_0_{'x' * 40}", "guard"), 99.0)])
    good = RawAgent(daemon.socket_path, "good")
    good.steps(5)
    wait_for(lambda: bool(select(daemon.scrape(), "torchpulse_optimizer_steps_total", run="good")))
    wait_for(lambda: 99.0 in select(daemon.scrape(), "torchpulse_recompiles_total", run="hostile").values())
    samples = daemon.scrape()
    hostile.close()
    good.close()
    recompiles = select(samples, "torchpulse_recompiles_total", run="hostile")
    figures = {
        "series held": _one(select(samples, "torchpulse_run_series", run="hostile")),
        "exposed": float(len(recompiles)),
        "run refusals": _one(select(samples, "torchpulse_run_series_rejected", run="hostile")),
        "daemon refusals": _one(select(samples, "torchpulse_daemon_series_rejected_total", reason="run_series_limit")),
        "folded into other": float(sum(1 for key in recompiles if dict(key)["function"] == OTHER)),
        "good run refusals": _one(select(samples, "torchpulse_run_series_rejected", run="good")),
    }
    assert {
        "series held": 50.0,
        "exposed": 50.0,
        "run refusals": 950.0,
        "daemon refusals": 950.0,
        "folded into other": 0.0,
        "good run refusals": 0.0,
    } == figures


def test_overlong_label_values_are_refused_per_series(small_budget_daemon: DaemonProcess) -> None:
    """A 10 000-character reason is refused as label_too_long; the short one beside it is kept."""
    daemon = small_budget_daemon
    agent = RawAgent(daemon.socket_path, "long-labels")
    agent.send([Sample("cudagraph_skips_total", ("r" * 10_000,), 1.0), Sample("cudagraph_skips_total", ("ok",), 2.0)])
    wait_for(lambda: bool(select(daemon.scrape(), "torchpulse_cudagraph_skips_total", run="long-labels")))
    samples = daemon.scrape()
    agent.close()
    assert ({(("rank", "0"), ("reason", "ok"), ("run", "long-labels")): 2.0}, 1.0) == (
        select(samples, "torchpulse_cudagraph_skips_total", run="long-labels"),
        _one(select(samples, "torchpulse_daemon_series_rejected_total", reason="label_too_long")),
    )


def test_agent_folds_unbounded_graph_break_locations_into_other() -> None:
    """Twelve compiled functions breaking at twelve locations with top-K 3: three named series plus `other`."""
    import torch
    import torch._dynamo

    agent: Any = local_agent(("compile",), options={"compile_top_k": "3"})
    try:
        for i in range(12):
            source = "def f(x):\n    x = x + 1\n    torch._dynamo.graph_break()\n    return x * 2\n"
            namespace: dict[str, Any] = {"torch": torch}
            exec(compile(source, f"/generated/hostile_{i}.py", "exec"), namespace)
            torch.compile(namespace["f"], backend="eager")(torch.randn(2))
        agent.drain()
        breaks = series(agent, "graph_breaks_total")
    finally:
        agent.shutdown()
        torch._dynamo.reset()
    locations = sorted({location for _, location in breaks})
    assert (4, True, 12.0) == (len(locations), OTHER in locations, sum(breaks.values()))
    assert 9.0 == sum(v for (_, location), v in breaks.items() if location == OTHER)
