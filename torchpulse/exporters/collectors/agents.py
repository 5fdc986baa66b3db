"""agent_up and run_info: which ranks are connected and what each run is."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from torchpulse.daemon.runs import RunsView


class AgentsCollector:
    name = "agents"

    def __init__(self, registry: RunsView) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("torchpulse_agent_up", "1 while the rank's agent is connected.", labels=["run", "rank"])
        exited = GaugeMetricFamily(
            "torchpulse_agent_exited",
            "1 once the rank's agent said goodbye before disconnecting (its process exited normally or "
            "detached): agent_up 0 then means gone, not down.",
            labels=["run", "rank"],
        )
        info = GaugeMetricFamily(
            "torchpulse_run_info",
            "Facts about a run, from its first rank on this node (join on `run`, and on `instance` too where a run "
            "spans nodes: each node's daemon has one); always 1.",
            labels=["run", "torch_version", "world_size", "host", "agent_version", "command"],
        )
        series = GaugeMetricFamily("torchpulse_run_series", "Series the daemon holds for the run.", labels=["run"])
        rejected = GaugeMetricFamily(
            "torchpulse_run_series_rejected",
            "New series refused because the run hit its series limit, counted since the daemon began holding the "
            "run (it only grows: use increase()).",
            labels=["run"],
        )
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
