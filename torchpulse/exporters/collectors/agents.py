"""agent_up and run_info: which ranks are connected and what each run is."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import Metric

from torchpulse.daemon.runs import RunsView
from torchpulse.exporters.collectors import gauge


class AgentsCollector:
    name = "agents"

    def __init__(self, registry: RunsView) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        up, exited, info = gauge("agent_up"), gauge("agent_exited"), gauge("run_info")
        series, rejected = gauge("run_series"), gauge("run_series_rejected")
        for run in self.registry.runs.values():
            for rank, state in run.ranks.items():
                up.add_metric([run.name, str(rank)], 1.0 if state.connected else 0.0)
                exited.add_metric([run.name, str(rank)], 1.0 if state.exited else 0.0)
            hello = run.info
            if hello is not None:
                info.add_metric(
                    [
                        run.name,
                        hello.torch_version,
                        str(hello.world_size),
                        hello.host,
                        hello.agent_version,
                        hello.command,
                    ],
                    1.0,
                )
            series.add_metric([run.name], float(run.series))
            rejected.add_metric([run.name], float(run.series_rejected))
        yield from (up, exited, info, series, rejected)
