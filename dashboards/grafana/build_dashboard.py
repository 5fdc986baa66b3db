"""Generate torchpulse.json, the Grafana dashboard, from the rows of panels below.

The panels are built with Grafana's typed builders (grafana-foundation-sdk, a build-time dependency
only: the generated JSON is checked in). Run `python dashboards/grafana/build_dashboard.py` after
editing; tests/dashboards/test_dashboard.py fails when the JSON is out of date.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from itertools import count
from pathlib import Path
from string import ascii_uppercase
from typing import TypeAlias, TypedDict, TypeVar, Unpack

from grafana_foundation_sdk.builders import bargauge, prometheus, stat, table, timeseries
from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as model
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

OUTPUT = Path(__file__).with_name("torchpulse.json")
# The schema the panels are written against; the SDK's models stamp 36, which Grafana would migrate on load.
SCHEMA_VERSION = 39
DATASOURCE = model.DataSourceRef(type_val="prometheus", uid="${datasource}")
SEL = 'run=~"$run", rank=~"$rank"'
RUN = 'run=~"$run"'
RI = "$__rate_interval"
# Window for events minutes apart (checkpoint saves and their validations, typically every ~30 min).
RARE = "1h"

PanelBuilder: TypeAlias = timeseries.Panel | stat.Panel | table.Panel | bargauge.Panel
# The SDK's panel builders share their common methods but no base class that declares them.
AnyPanel = TypeVar("AnyPanel", timeseries.Panel, stat.Panel, table.Panel, bargauge.Panel)


class Look(TypedDict, total=False):
    """How a panel is sized and coloured: all optional, every panel kind takes them."""

    width: int
    height: int
    # Red from this value on, for every series of the panel.
    red_above: float
    # Red from a value on, for the series whose legend starts with the key.
    red_fields: dict[str, float]
    # Another unit than the panel's for the series of one query (refIds are A, B, ... in order).
    units: dict[str, str]


def query(expr: str, legend: str = "", *, instant: bool = False) -> prometheus.Dataquery:
    built = prometheus.Dataquery().datasource(DATASOURCE).expr(expr).legend_format(legend or "__auto")
    return built.instant() if instant else built


def table_query(expr: str) -> prometheus.Dataquery:
    """One table row per series, at the last scrape."""
    return query(expr, instant=True).format(PromQueryFormat.TABLE)


def _legend(prefix: str, by: str) -> str:
    return f"{prefix} {{{{{by.replace(', ', '}} {{')}}}}}"


def quantiles(metric: str, by: str, selector: str = SEL, window: str = RI) -> list[prometheus.Dataquery]:
    # `window` must hold at least one event: rare ones (checkpoints) need far more than $__rate_interval.
    growth = "rate" if window == RI else "increase"
    return [
        query(
            f"histogram_quantile({quantile}, sum by ({by}, le) ({growth}({metric}_bucket{{{selector}}}[{window}])))",
            _legend(f"p{int(quantile * 100)}", by),
        )
        for quantile in (0.5, 0.99)
    ]


def mean(metric: str, by: str, selector: str = SEL) -> prometheus.Dataquery:
    # Quantiles of classic buckets interpolate inside one bucket: steady 0.30 s and 0.45 s steps both
    # read p50 0.375 s (bucket 0.25-0.5 s). The mean comes from _sum and sees every change.
    return query(
        f"sum by ({by}) (rate({metric}_sum{{{selector}}}[{RI}]))"
        f" / sum by ({by}) (rate({metric}_count{{{selector}}}[{RI}]))",
        _legend("mean", by),
    )


def hide_columns(*names: str) -> model.DataTransformerConfig:
    return model.DataTransformerConfig(id_val="organize", options={"excludeByName": dict.fromkeys(names, True)})


def merge_queries() -> model.DataTransformerConfig:
    """One table row per label set, with a column per query."""
    return model.DataTransformerConfig(id_val="merge", options={})


def _green_then_red(red_from: float | None) -> dashboard_builders.ThresholdsConfig:
    steps = [model.Threshold(value=None, color="green")]
    if red_from is not None:
        steps.append(model.Threshold(value=red_from, color="red"))
    return dashboard_builders.ThresholdsConfig().mode(model.ThresholdsMode.ABSOLUTE).steps(steps)


def _panel(
    builder: AnyPanel, title: str, unit: str, description: str, queries: Sequence[prometheus.Dataquery], look: Look
) -> AnyPanel:
    """What every panel has: text, datasource, unit, size, colours and queries."""
    builder.title(title).description(description).datasource(DATASOURCE).unit(unit)
    builder.span(look.get("width", 8)).height(look.get("height", 8))
    builder.thresholds(_green_then_red(look.get("red_above")))
    for prefix, red_from in look.get("red_fields", {}).items():
        # By prefix: a legend such as "rejected {{reason}} {{instance}}" names each series.
        red = model.DynamicConfigValue(id_val="thresholds", value=_green_then_red(red_from).build())
        builder.override_by_regexp(f"^{prefix}", [red])
    for ref, other_unit in look.get("units", {}).items():
        builder.override_by_query(ref, [model.DynamicConfigValue(id_val="unit", value=other_unit)])
    for ref, target in zip(ascii_uppercase, queries, strict=False):
        builder.with_target(target.ref_id(ref))
    return builder


def timeseries_panel(
    title: str, unit: str, description: str, queries: Sequence[prometheus.Dataquery], **look: Unpack[Look]
) -> timeseries.Panel:
    built = _panel(timeseries.Panel(), title, unit, description, queries, look)
    # Grafana's own defaults, spelled out: with no option set the SDK writes `options: null`, and its defaults
    # would hide the legend and sort the tooltip.
    built.legend(
        common_builders.VizLegendOptions()
        .show_legend(True)
        .display_mode(common.LegendDisplayMode.LIST)
        .placement(common.LegendPlacement.BOTTOM)
    )
    built.tooltip(
        common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.SINGLE).sort(common.SortOrder.NONE)
    )
    if "red_above" in look or look.get("red_fields"):
        # A time series panel draws no threshold unless asked: without this, nothing ever turns red.
        built.thresholds_style(common_builders.GraphThresholdsStyleConfig().mode(common.GraphTresholdsStyleMode.LINE))
    return built


def stat_panel(
    title: str,
    unit: str,
    description: str,
    queries: Sequence[prometheus.Dataquery],
    *,
    color_mode: common.BigValueColorMode = common.BigValueColorMode.VALUE,
    **look: Unpack[Look],
) -> stat.Panel:
    built = _panel(stat.Panel(), title, unit, description, queries, look)
    return built.reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"])).color_mode(color_mode)


def table_panel(
    title: str,
    unit: str,
    description: str,
    queries: Sequence[prometheus.Dataquery],
    *,
    transformations: list[model.DataTransformerConfig],
    **look: Unpack[Look],
) -> table.Panel:
    built = _panel(table.Panel(), title, unit, description, queries, look).transformations(transformations)
    # Setting any table option makes the SDK write them all, at Grafana's defaults; with none set it writes
    # `options: null` where Grafana expects an object.
    return built.show_header(True)


def bargauge_panel(
    title: str, unit: str, description: str, queries: Sequence[prometheus.Dataquery], **look: Unpack[Look]
) -> bargauge.Panel:
    """A ranking: one horizontal bar per series."""
    built = _panel(bargauge.Panel(), title, unit, description, queries, look)
    return built.orientation(common.VizOrientation.HORIZONTAL).reduce_options(
        common_builders.ReduceDataOptions().calcs(["lastNotNull"])
    )


def overview() -> list[PanelBuilder]:
    return [
        stat_panel(
            "Agents connected",
            "none",
            "Ranks whose agent is connected to a daemon. Red when a rank of a selected run "
            "disconnected without saying goodbye: check that the job still runs (crash, hang, "
            "OOM kill) and the daemon on that node (`systemctl status torchpulse`). Ranks that "
            "exited normally or detached count as exited, not disconnected.",
            [
                query(f"sum(torchpulse_agent_up{{{SEL}}}) or vector(0)", "connected"),
                query(
                    f"count(torchpulse_agent_up{{{SEL}}} == 0 unless on (run, rank) "
                    f"torchpulse_agent_exited{{{SEL}}} == 1) or vector(0)",
                    "disconnected",
                ),
                query(f"count(torchpulse_agent_exited{{{SEL}}} == 1) or vector(0)", "exited"),
            ],
            width=6,
            height=5,
            red_fields={"disconnected": 1},
        ),
        stat_panel(
            "Runs",
            "none",
            "Runs the daemons currently export (ended runs stay for grace_period_seconds, an hour when a "
            "rank was lost). "
            "No run while a job trains: the job was not started with `torchpulse run`, or its "
            "agent cannot reach the socket (group torchpulse-users).",
            [query(f"count(count by (run) (torchpulse_run_info{{{RUN}}})) or vector(0)", "runs")],
            width=6,
            height=5,
        ),
        timeseries_panel(
            "Events dropped by agents",
            "eps",
            "Events an agent dropped instead of blocking training: the dashboard undercounts "
            "while this is above zero. Red: the daemon is slow or unreachable; check its CPU "
            "limit and frames rejected below.",
            [
                query(
                    f"sum by (run, rank) (rate(torchpulse_agent_events_dropped_total{{{SEL}}}[{RI}]))",
                    "{{run}} rank {{rank}}",
                )
            ],
            width=12,
            height=5,
            red_above=0.001,
        ),
        table_panel(
            "Runs: metadata",
            "none",
            "What each run is (from torchpulse_run_info). Use it to tell runs apart; a torch "
            "version mismatch between ranks of one run is a configuration error.",
            [table_query(f"max by (run, host, torch_version, world_size, command) (torchpulse_run_info{{{RUN}}})")],
            width=24,
            height=5,
            transformations=[hide_columns("Time", "Value")],
        ),
        timeseries_panel(
            "Daemon: events received and frames rejected",
            "eps",
            "Events the daemons ingest, and frames they refuse by reason. Red when frames are "
            "rejected: an agent speaks another protocol version (upgrade both) or a peer is "
            "not an agent; the daemon log names it.",
            [
                query(
                    f"sum by (instance) (rate(torchpulse_daemon_events_received_total[{RI}]))", "received {{instance}}"
                ),
                query(
                    f"sum by (instance, reason) (rate(torchpulse_daemon_frames_rejected_total[{RI}]))",
                    "rejected {{reason}} {{instance}}",
                ),
            ],
            width=12,
            height=7,
            red_fields={"rejected": 0.001},
        ),
        table_panel(
            "Daemon: collectors",
            "none",
            "Success (1) and duration of each collector at the last scrape, with the daemon "
            "version. Red: a collector fails on every scrape and its metrics are missing; "
            "`journalctl -u torchpulse` has the traceback.",
            [
                table_query("min by (instance, collector) (torchpulse_scrape_collector_success)"),
                table_query("max by (instance, collector) (torchpulse_scrape_collector_duration_seconds)"),
                table_query("max by (instance, version) (torchpulse_build_info)"),
            ],
            width=12,
            height=7,
            transformations=[merge_queries()],
        ),
        table_panel(
            "Blind spots: failed probes, refused series, stalled ranks, unreadable roots, lost state",
            "none",
            "What torchpulse cannot see right now. A probe that raised disabled itself "
            "(TorchpulseProbeFailed): its metrics stop for that rank. Series refused by the per-run "
            "series limit (TorchpulseSeriesRejected) are missing from every panel. A connected rank "
            "with no optimizer step for longer than its stall threshold may hang (TorchpulseRankStalled; "
            "`torchpulse ctl stacks` shows where it is). A checkpoint root the "
            "daemon cannot read has nothing under it validated (CheckpointRootUnreadable; the daemon "
            "log says why). A daemon whose state is in memory only validates everything again after a "
            "restart (TorchpulseStateNotPersistent).",
            [
                table_query(f"max by (run, rank, probe) (torchpulse_agent_probe_errors_total{{{SEL}}}) > 0"),
                table_query(f"max by (instance, run) (torchpulse_run_series_rejected{{{RUN}}}) > 0"),
                table_query(
                    f"max by (instance, run, rank) (torchpulse_agent_stalled{{{SEL}}}) == 1 "
                    f"and on (instance, run, rank) max by (instance, run, rank) (torchpulse_agent_up{{{SEL}}}) == 1"
                ),
                table_query("max by (instance, root) (torchpulse_checkpoint_root_readable) == 0"),
                table_query("max by (instance) (torchpulse_daemon_state_persistent) == 0"),
            ],
            width=24,
            height=5,
            transformations=[hide_columns("Time")],
        ),
    ]


def training() -> list[PanelBuilder]:
    return [
        timeseries_panel(
            "Optimizer steps per second",
            "ops",
            "optimizer.step() calls per second per rank. A rank slower than the others holds "
            "back the whole job: compare hosts, then look for recompiles or CUDA-graph "
            "re-recordings at the same time.",
            [
                query(
                    f"sum by (run, rank, optimizer) (rate(torchpulse_optimizer_steps_total{{{SEL}}}[{RI}]))",
                    "{{run}} rank {{rank}} {{optimizer}}",
                )
            ],
        ),
        timeseries_panel(
            "Optimizer step time mean / p50 / p99",
            "s",
            "Wall time of optimizer.step(): the mean (what OptimizerStepSlow watches) and quantiles "
            "from its histogram. The quantiles move in bucket steps and miss a slowdown inside one "
            "bucket (0.30 s and 0.45 s both read p50 0.375 s); the mean does not. When it or p99 runs "
            "away, look for host contention, CPU offload or memory pressure on that rank.",
            [
                mean("torchpulse_optimizer_step_duration_seconds", "run, rank"),
                *quantiles("torchpulse_optimizer_step_duration_seconds", "run, rank"),
            ],
        ),
        timeseries_panel(
            "Learning rate",
            "sci",
            "Learning rate that the last step of each param group used. A value of 0, NaN or a "
            "jump the schedule does not explain means a scheduler or resume bug.",
            [
                query(
                    f"torchpulse_optimizer_learning_rate{{{SEL}}}",
                    "{{run}} rank {{rank}} {{optimizer}} group {{param_group}}",
                )
            ],
        ),
        timeseries_panel(
            "Backward time mean / p50 / p99",
            "s",
            "Wall time of backward passes by kind: the mean, and quantiles that move in bucket steps "
            "only (a slowdown inside one bucket shows in the mean alone). A growing backward time "
            "with steady batch size points at a slow autograd node (see Autograd) or a graph break.",
            [
                mean("torchpulse_backward_duration_seconds", "run, kind"),
                *quantiles("torchpulse_backward_duration_seconds", "run, kind"),
            ],
        ),
        timeseries_panel(
            "Non-finite gradients",
            "short",
            "Backward passes with NaN/Inf gradients, and parameters affected in the last "
            "pass. Red: the model diverges (a rare blip under AMP's GradScaler is normal); "
            "check the loss, lower the learning rate, resume from a valid checkpoint.",
            [
                query(
                    f"sum by (run, rank) (increase(torchpulse_grad_nonfinite_passes_total{{{SEL}}}[{RI}]))",
                    "passes {{run}} rank {{rank}}",
                ),
                query(
                    f"max by (run, rank) (torchpulse_grad_nonfinite_parameters{{{SEL}}})",
                    "parameters {{run}} rank {{rank}}",
                ),
            ],
            red_above=1,
        ),
        timeseries_panel(
            "Gradient norm",
            "none",
            "Total gradient norm per rank. Spikes precede divergence; a norm that differs "
            "across ranks of one data-parallel run means gradients are not synchronized.",
            [query(f"torchpulse_grad_norm{{{SEL}}}", "{{run}} rank {{rank}}")],
        ),
        timeseries_panel(
            "Optimizer state",
            "bytes",
            "Bytes held in optimizer state tensors on each rank. Steady growth means state is "
            "created for new parameters every step; an unexpected jump after resume means "
            "the sharded state was loaded unsharded.",
            [query(f"sum by (run, rank) (torchpulse_optimizer_state_bytes{{{SEL}}})", "{{run}} rank {{rank}}")],
            width=12,
        ),
        timeseries_panel(
            "Parameters per optimizer",
            "short",
            "Parameter tensors each optimizer updates. Ranks of one run that disagree, or a "
            "count that changes mid-run, mean parameters were frozen or added by mistake.",
            [query(f"torchpulse_optimizer_parameters{{{SEL}}}", "{{run}} rank {{rank}} {{optimizer}}")],
            width=12,
        ),
    ]


def compilation() -> list[PanelBuilder]:
    return [
        timeseries_panel(
            "Recompiles by reason",
            "cpm",
            "torch.compile recompilations per minute by classified guard-failure reason, on the "
            "rank that recompiles most (the ranks of a data-parallel job recompile together). Red "
            "(RecompilationStorm): make the changing shape dynamic or turn the changing Python "
            "value into a tensor.",
            [
                query(
                    f"60 * max by (run, reason) (sum by (run, rank, reason) "
                    f"(rate(torchpulse_recompiles_total{{{SEL}}}[{RI}])))",
                    "{{run}} {{reason}}",
                )
            ],
            red_above=3,
        ),
        bargauge_panel(
            "Recompiles by function (top 10)",
            "short",
            "Functions recompiled most in the selected range. Fix the top one first; the "
            "reason panel says why it recompiles.",
            [
                query(
                    f"topk(10, sum by (function) (increase(torchpulse_recompiles_total{{{SEL}}}[$__range])))",
                    "{{function}}",
                    instant=True,
                )
            ],
        ),
        table_panel(
            "Graph breaks",
            "short",
            "Graph breaks by kind and source location. Each break runs the code around it "
            "eagerly; remove the cause at the location (data-dependent control flow, "
            "print, unsupported calls) or accept it knowingly.",
            [table_query(f"sum by (run, kind, location) (torchpulse_graph_breaks_total{{{SEL}}})")],
            transformations=[hide_columns("Time")],
        ),
        timeseries_panel(
            "Compile time by phase",
            "s",
            "Seconds spent compiling per phase in each interval, on the rank that compiled longest (the "
            "ranks of a data-parallel job compile side by side). Compilation after warm-up "
            "means recompiles: see the panels beside this one.",
            [
                query(
                    f"max by (run, phase) (sum by (run, rank, phase) "
                    f"(increase(torchpulse_compile_duration_seconds_sum{{{SEL}}}[{RI}])))",
                    "{{run}} {{phase}}",
                )
            ],
        ),
        timeseries_panel(
            "Compiled frames by status",
            "cpm",
            "Frames compiled per minute, ok and failed. Failed frames fall back to eager: "
            "the daemon log and TORCH_LOGS=dynamo name the error.",
            [
                query(
                    f"60 * sum by (run, status) (rate(torchpulse_compile_frames_total{{{SEL}}}[{RI}]))",
                    "{{run}} {{status}}",
                )
            ],
        ),
        table_panel(
            "Recompile limit hits",
            "short",
            "Functions that hit torch._dynamo's recompile limit and now run eagerly for the "
            "rest of the run. Red: fix the recompile reason for that function; raising the "
            "limit only hides it.",
            [table_query(f"sum by (run, function) (torchpulse_recompile_limit_hits_total{{{SEL}}}) > 0")],
            red_above=1,
            transformations=[hide_columns("Time")],
        ),
    ]


def cudagraphs() -> list[PanelBuilder]:
    return [
        table_panel(
            "CUDA-graph skips by reason",
            "short",
            "Graphs that run without CUDA graphs, by reason. Red: the reduce-overhead "
            "speed-up is lost; remove the cause (CPU tensors, mutated inputs, dynamic "
            "shapes, incompatible ops).",
            [table_query(f"sum by (run, reason) (torchpulse_cudagraph_skips_total{{{SEL}}}) > 0")],
            red_above=1,
            transformations=[hide_columns("Time")],
        ),
        timeseries_panel(
            "CUDA-graph recordings",
            "cpm",
            "CUDA-graph recordings per minute. Recording belongs to warm-up; "
            "recordings later on mean new shapes or re-recordings.",
            [
                query(
                    f"60 * sum by (run, rank) (rate(torchpulse_cudagraph_recordings_total{{{SEL}}}[{RI}]))",
                    "{{run}} rank {{rank}}",
                )
            ],
        ),
        timeseries_panel(
            "CUDA-graph recording time p99",
            "s",
            "Time spent recording a CUDA graph. Long recordings repeated often cost more than the graphs save.",
            [
                query(
                    f"histogram_quantile(0.99, sum by (run, le) "
                    f"(rate(torchpulse_cudagraph_recording_duration_seconds_bucket{{{SEL}}}[{RI}])))",
                    "p99 {{run}}",
                )
            ],
        ),
        timeseries_panel(
            "CUDA-graph re-recordings by reason",
            "cpm",
            "Re-recordings per minute by reason, on the rank that re-records most. Red "
            "(CudagraphRerecording): make the changing input static or mark the dimension dynamic.",
            [
                query(
                    f"60 * max by (run, reason) (sum by (run, rank, reason) "
                    f"(rate(torchpulse_cudagraph_rerecords_total{{{SEL}}}[{RI}])))",
                    "{{run}} {{reason}}",
                )
            ],
            red_above=0.2,
        ),
        timeseries_panel(
            "Non-static input copies and graph pool",
            "cps",
            "Copies of non-static inputs into graph buffers per second (each is a device "
            "copy per replay), next to the graph memory pool size. Keep inputs at stable "
            "addresses (static buffers, or torch.compiler.cudagraph_mark_step_begin).",
            [
                query(
                    f"sum by (run, rank) (rate(torchpulse_cudagraph_nonstatic_input_copies_total{{{SEL}}}[{RI}]))",
                    "copies {{run}} rank {{rank}}",
                ),
                query(
                    f"sum by (run, rank) (torchpulse_cudagraph_pool_bytes{{{SEL}}})", "pool bytes {{run}} rank {{rank}}"
                ),
            ],
            units={"B": "bytes"},
        ),
        table_panel(
            "Optimizer readiness for CUDA graphs",
            "short",
            "Per optimizer: gradients at non-static addresses, param groups with "
            "capturable=True, and step tensors on the CPU. A graph-captured optimizer needs "
            "capturable groups, static gradients and no CPU step tensors; fix the non-zero "
            "columns.",
            [
                table_query(f"sum by (run, rank, optimizer) (torchpulse_optimizer_nonstatic_grads{{{SEL}}})"),
                table_query(f"min by (run, rank, optimizer) (torchpulse_optimizer_capturable{{{SEL}}})"),
                table_query(f"sum by (run, rank, optimizer) (torchpulse_optimizer_cpu_step_tensors{{{SEL}}})"),
            ],
            transformations=[merge_queries()],
        ),
    ]


def checkpoints() -> list[PanelBuilder]:
    return [
        table_panel(
            "Checkpoint status per root",
            "none",
            "Status of the newest checkpoint in each watched root (valid, invalid, "
            "incomplete), its size, and whether every daemon can read the root (0: nothing under "
            "it is validated; the daemon log says why). Red rows: run `torchpulse check <dir>` and "
            "keep the last valid checkpoint until the save path is fixed.",
            [
                table_query("max by (root, status) (torchpulse_checkpoint_last_status == 1)"),
                table_query("max by (root) (torchpulse_checkpoint_bytes)"),
                table_query("max by (root) (torchpulse_checkpoint_incomplete)"),
                table_query("min by (root) (torchpulse_checkpoint_root_readable)"),
            ],
            width=12,
            units={"B": "bytes"},
            transformations=[merge_queries()],
        ),
        stat_panel(
            "Age of the last valid checkpoint",
            "s",
            "Time since each root last had a valid checkpoint. Red after 6 hours "
            "(NoValidCheckpointRecently): a crash now loses that much training; check that "
            "the job saves and why saves fail validation.",
            [query("time() - max by (root) (torchpulse_checkpoint_last_valid_timestamp_seconds > 0)", "{{root}}")],
            width=12,
            red_above=21600,
            color_mode=common.BigValueColorMode.BACKGROUND,
        ),
        table_panel(
            "Findings by rule",
            "short",
            "Validation findings of the newest checkpoint by rule id and severity. Each "
            "TP-CKPT rule names what is wrong; errors make a checkpoint invalid.",
            [table_query("max by (root, rule, severity) (torchpulse_checkpoint_findings) > 0")],
            transformations=[hide_columns("Time")],
        ),
        timeseries_panel(
            "Validation time p50 / p99 (last hour)",
            "s",
            "How long the validations of the hour before each point took, per level (checkpoints come "
            "minutes apart, so a shorter window would be empty between them; a gap: no validation in "
            "that hour). Close to validation_timeout_seconds means validations get killed: lower the "
            "level or raise the timeout.",
            quantiles("torchpulse_checkpoint_validation_duration_seconds", "level", selector="", window=RARE),
        ),
        timeseries_panel(
            "Checkpoint save time p99 (last hour)",
            "s",
            "p99 time the job spent saving the checkpoints of the hour before each point, per run "
            "(saves come minutes apart, so a shorter window would be empty between them; a gap: no "
            "save in that hour). Saves that grow longer slow training and risk incomplete "
            "checkpoints on preemption.",
            [
                query(
                    f"histogram_quantile(0.99, sum by (run, le) "
                    f"(increase(torchpulse_checkpoint_save_duration_seconds_bucket{{{RUN}}}[{RARE}])))",
                    "save p99 {{run}}",
                )
            ],
        ),
        timeseries_panel(
            "Validations by status",
            "cpm",
            "Validations per minute by result. Invalid or incomplete results deserve a look at the findings table.",
            [
                query(
                    f"60 * sum by (root, status) (rate(torchpulse_checkpoint_validations_total[{RI}]))",
                    "{{root}} {{status}}",
                )
            ],
            width=12,
            height=6,
        ),
        timeseries_panel(
            "Failed checkpoint saves",
            "short",
            "Checkpoint saves that raised since each rank started, summed over ranks (a failing DCP save "
            "raises on every rank of the save), by API and exception class. Any step up "
            "(CheckpointSaveFailed) is a lost checkpoint: the daemon log's `checkpoint save failed` events "
            "name the path and the first failing rank's error (full disk, permissions, a bad path).",
            [
                query(
                    f"sum by (run, api, error) (torchpulse_checkpoint_save_failures_total{{{RUN}}})",
                    "{{run}} {{api}} {{error}}",
                )
            ],
            width=12,
            height=6,
            red_above=1,
        ),
    ]


def autograd() -> list[PanelBuilder]:
    per_pass = (
        f"sum by (node) (increase(torchpulse_autograd_node_seconds_total{{{SEL}}}[$__range]))"
        " / ignoring (node) group_left "
        f"sum(increase(torchpulse_autograd_sampled_passes_total{{{SEL}}}[$__range]))"
    )
    return [
        bargauge_panel(
            "Top autograd node types by time per sampled pass",
            "s",
            "Seconds each backward node type takes per sampled backward pass, over the "
            "selected range. The top entries are where backward time goes: fuse, "
            "checkpoint or recompute them, or change dtype.",
            [query(f"topk(10, {per_pass})", "{{node}}", instant=True)],
            width=12,
            height=9,
        ),
        timeseries_panel(
            "Autograd node calls per second (top 10)",
            "cps",
            "Calls of the most frequent node types in the sampled passes (1 in 100 by default: the ranking "
            "holds, the rate is that much lower). Many tiny nodes mean launch overhead: "
            "torch.compile or fused kernels help.",
            [query(f"topk(10, sum by (node) (rate(torchpulse_autograd_node_calls_total{{{SEL}}}[{RI}])))", "{{node}}")],
            width=12,
            height=9,
        ),
    ]


ROWS: list[tuple[str, Callable[[], list[PanelBuilder]]]] = [
    ("Overview", overview),
    ("Training", training),
    ("Compilation", compilation),
    ("CUDA graphs", cudagraphs),
    ("Checkpoints", checkpoints),
    ("Autograd", autograd),
]


def _label_values(name: str, label: str, values_query: str) -> dashboard_builders.QueryVariable:
    """A multi-value variable over a label's values, "All" selected."""
    return (
        dashboard_builders.QueryVariable(name)
        .id(name)
        .label(label)
        .datasource(DATASOURCE)
        .query({"query": values_query, "refId": f"{name}-var"})
        .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .include_all(True)
        .multi(True)
        .all_value(".*")
        .current(model.VariableOption(selected=True, text=["All"], value=["$__all"]))
        .sort(model.VariableSort.NUMERICAL_ASC)
        .regex("")
    )


def variables() -> list[Builder[model.VariableModel]]:
    # Grafana keys each variable's state by its id (the name when there is none), and the SDK gives every
    # variable the same id: each gets its name.
    return [
        dashboard_builders.DatasourceVariable("datasource")
        .id("datasource")
        .label("Prometheus")
        .type("prometheus")
        .regex(""),
        _label_values("run", "Run", "label_values(torchpulse_run_info, run)"),
        _label_values("rank", "Rank", 'label_values(torchpulse_agent_up{run=~"$run"}, rank)'),
    ]


def dashboard() -> model.Dashboard:
    builder = (
        dashboard_builders.Dashboard("torchpulse")
        .uid("torchpulse")
        .description(
            "PyTorch training jobs seen by torchpulse: steps, compilation, CUDA graphs, gradients and checkpoints."
        )
        .tags(["torchpulse", "pytorch"])
        .editable()
        .tooltip(model.DashboardCursorSync.CROSSHAIR)
        .version(1)
        .time("now-1h", "now")
        .refresh("30s")
        .timezone("")
        .links([])
        .annotations([])
        .variables(variables())
    )
    # Rows stay expanded: their panels follow them at the top level (a row's own list is for collapsed rows).
    # The SDK lays panels out left to right and starts a new line once one is full; it wraps no panel that
    # does not fit, so the widths on each line of a row add up to 24 (test_dashboard.py checks the grid).
    ids = count(1)
    for title, panels in ROWS:
        builder.with_row(dashboard_builders.Row(title).id(next(ids)))
        for panel in panels():
            builder.with_panel(panel.id(next(ids)))
    built = builder.build()
    built.schema_version = SCHEMA_VERSION
    return built


def render() -> str:
    return json.dumps(dashboard(), cls=JSONEncoder, indent=2) + "\n"


if __name__ == "__main__":
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT}")
