"""Generate torchpulse.json, the Grafana dashboard, from the panel list below.

Run `python dashboards/grafana/build_dashboard.py` after editing; the test
tests/dashboards/test_dashboard.py fails when the JSON is out of date.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUTPUT = Path(__file__).with_name("torchpulse.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'run=~"$run", rank=~"$rank"'
RUN = 'run=~"$run"'
RI = "$__rate_interval"
# Window for events minutes apart (checkpoint saves and their validations, typically every ~30 min).
RARE = "1h"

Panel = dict[str, Any]


def q(expr: str, legend: str = "", *, instant: bool = False, table: bool = False) -> dict[str, Any]:
    target: dict[str, Any] = {"datasource": DS, "expr": expr, "legendFormat": legend or "__auto"}
    if instant:
        target["instant"] = True
        target["range"] = False
    if table:
        target["format"] = "table"
    return target


def panel(
    kind: str,
    title: str,
    unit: str,
    description: str,
    targets: list[dict[str, Any]],
    *,
    width: int = 8,
    height: int = 8,
    red_above: float | None = None,
    options: dict[str, Any] | None = None,
    transformations: list[dict[str, Any]] | None = None,
    red_fields: dict[str, float] | None = None,
    units: dict[str, str] | None = None,
) -> Panel:
    steps: list[dict[str, Any]] = [{"color": "green", "value": None}]
    if red_above is not None:
        steps.append({"color": "red", "value": red_above})
    defaults: dict[str, Any] = {"unit": unit, "thresholds": {"mode": "absolute", "steps": steps}}
    if kind == "timeseries" and (red_above is not None or red_fields):
        # A time series panel draws no threshold unless asked: without this, nothing ever turns red.
        defaults["custom"] = {"thresholdsStyle": {"mode": "line"}}
    built: Panel = {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DS,
        "gridPos": {"w": width, "h": height},
        "fieldConfig": {
            "defaults": defaults,
            "overrides": [
                {
                    # By prefix: a legend such as "rejected {{reason}} {{instance}}" names each series.
                    "matcher": {"id": "byRegexp", "options": f"^{field}"},
                    "properties": [
                        {
                            "id": "thresholds",
                            "value": {
                                "mode": "absolute",
                                "steps": [{"color": "green", "value": None}, {"color": "red", "value": limit}],
                            },
                        }
                    ],
                }
                for field, limit in (red_fields or {}).items()
            ]
            + [
                # A query whose series have another unit than the panel's (refIds are A, B, ... in order).
                {"matcher": {"id": "byFrameRefID", "options": ref}, "properties": [{"id": "unit", "value": u}]}
                for ref, u in (units or {}).items()
            ],
        },
        "options": options or {},
        "targets": targets,
    }
    if transformations:
        built["transformations"] = transformations
    return built


def _legend(prefix: str, by: str) -> str:
    return f"{prefix} {{{{{by.replace(', ', '}} {{')}}}}}"


def quantiles(metric: str, by: str, selector: str = SEL, window: str = RI) -> list[dict[str, Any]]:
    # `window` must hold at least one event: rare ones (checkpoints) need far more than $__rate_interval.
    growth = "rate" if window == RI else "increase"
    return [
        q(
            f"histogram_quantile({quantile}, sum by ({by}, le) ({growth}({metric}_bucket{{{selector}}}[{window}])))",
            _legend(f"p{int(quantile * 100)}", by),
        )
        for quantile in (0.5, 0.99)
    ]


def mean(metric: str, by: str, selector: str = SEL) -> dict[str, Any]:
    # Quantiles of classic buckets interpolate inside one bucket: steady 0.30 s and 0.45 s steps both
    # read p50 0.375 s (bucket 0.25-0.5 s). The mean comes from _sum and sees every change.
    return q(
        f"sum by ({by}) (rate({metric}_sum{{{selector}}}[{RI}]))"
        f" / sum by ({by}) (rate({metric}_count{{{selector}}}[{RI}]))",
        _legend("mean", by),
    )


def overview() -> list[Panel]:
    return [
        panel(
            "stat",
            "Agents connected",
            "none",
            "Ranks whose agent is connected to a daemon. Red when a rank of a selected run "
            "disconnected without saying goodbye: check that the job still runs (crash, hang, "
            "OOM kill) and the daemon on that node (`systemctl status torchpulse`). Ranks that "
            "exited normally or detached count as exited, not disconnected.",
            [
                q(f"sum(torchpulse_agent_up{{{SEL}}}) or vector(0)", "connected"),
                q(f"count(torchpulse_agent_up{{{SEL}}} == 0 unless on (run, rank) "
                  f"torchpulse_agent_exited{{{SEL}}} == 1) or vector(0)", "disconnected"),
                q(f"count(torchpulse_agent_exited{{{SEL}}} == 1) or vector(0)", "exited"),
            ],
            width=6,
            height=5,
            red_fields={"disconnected": 1},
            options={"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "value"},
        ),
        panel(
            "stat",
            "Runs",
            "none",
            "Runs the daemons currently export (ended runs stay for grace_period_seconds, an hour when a "
            "rank was lost). "
            "No run while a job trains: the job was not started with `torchpulse run`, or its "
            "agent cannot reach the socket (group torchpulse-users).",
            [q(f"count(count by (run) (torchpulse_run_info{{{RUN}}})) or vector(0)", "runs")],
            width=6,
            height=5,
            options={"reduceOptions": {"calcs": ["lastNotNull"]}},
        ),
        panel(
            "timeseries",
            "Events dropped by agents",
            "eps",
            "Events an agent dropped instead of blocking training: the dashboard undercounts "
            "while this is above zero. Red: the daemon is slow or unreachable; check its CPU "
            "limit and frames rejected below.",
            [
                q(
                    f"sum by (run, rank) (rate(torchpulse_agent_events_dropped_total{{{SEL}}}[{RI}]))",
                    "{{run}} rank {{rank}}",
                )
            ],
            width=12,
            height=5,
            red_above=0.001,
        ),
        panel(
            "table",
            "Runs: metadata",
            "none",
            "What each run is (from torchpulse_run_info). Use it to tell runs apart; a torch "
            "version mismatch between ranks of one run is a configuration error.",
            [
                q(
                    f"max by (run, host, torch_version, world_size, command) (torchpulse_run_info{{{RUN}}})",
                    instant=True,
                    table=True,
                )
            ],
            width=24,
            height=5,
            transformations=[{"id": "organize", "options": {"excludeByName": {"Time": True, "Value": True}}}],
        ),
        panel(
            "timeseries",
            "Daemon: events received and frames rejected",
            "eps",
            "Events the daemons ingest, and frames they refuse by reason. Red when frames are "
            "rejected: an agent speaks another protocol version (upgrade both) or a peer is "
            "not an agent; the daemon log names it.",
            [
                q(f"sum by (instance) (rate(torchpulse_daemon_events_received_total[{RI}]))", "received {{instance}}"),
                q(
                    f"sum by (instance, reason) (rate(torchpulse_daemon_frames_rejected_total[{RI}]))",
                    "rejected {{reason}} {{instance}}",
                ),
            ],
            width=12,
            height=7,
            red_fields={"rejected": 0.001},
        ),
        panel(
            "table",
            "Daemon: collectors",
            "none",
            "Success (1) and duration of each collector at the last scrape, with the daemon "
            "version. Red: a collector fails on every scrape and its metrics are missing; "
            "`journalctl -u torchpulse` has the traceback.",
            [
                q("min by (instance, collector) (torchpulse_scrape_collector_success)", instant=True, table=True),
                q(
                    "max by (instance, collector) (torchpulse_scrape_collector_duration_seconds)",
                    instant=True,
                    table=True,
                ),
                q("max by (instance, version) (torchpulse_build_info)", instant=True, table=True),
            ],
            width=12,
            height=7,
            transformations=[{"id": "merge", "options": {}}],
        ),
        panel(
            "table",
            "Blind spots: failed probes, refused series, stalled ranks, unreadable roots, lost state",
            "none",
            "What torchpulse cannot see right now. A probe that raised disabled itself "
            "(TorchpulseProbeFailed): its metrics stop for that rank. Series refused by the per-run "
            "series limit (TorchpulseSeriesRejected) are missing from every panel. A connected rank "
            "with no optimizer step in 10 minutes may hang (TrainingStalled). A checkpoint root the "
            "daemon cannot read has nothing under it validated (CheckpointRootUnreadable; the daemon "
            "log says why). A daemon whose state is in memory only validates everything again after a "
            "restart (TorchpulseStateNotPersistent).",
            [
                q(f"max by (run, rank, probe) (torchpulse_agent_probe_errors_total{{{SEL}}}) > 0",
                  instant=True, table=True),
                q(f"max by (instance, run) (torchpulse_run_series_rejected{{{RUN}}}) > 0", instant=True, table=True),
                q(
                    f"sum by (instance, run, rank) (increase(torchpulse_optimizer_steps_total{{{SEL}}}[10m])) == 0 "
                    f"and on (instance, run, rank) max by (instance, run, rank) (torchpulse_agent_up{{{SEL}}}) == 1 "
                    f"and on (instance, run, rank) max by (instance, run, rank) "
                    f"(torchpulse_agent_probe_enabled{{{SEL}, probe=\"optimizer\"}}) == 1",
                    instant=True,
                    table=True,
                ),
                q("max by (instance, root) (torchpulse_checkpoint_root_readable) == 0", instant=True, table=True),
                q("max by (instance) (torchpulse_daemon_state_persistent) == 0", instant=True, table=True),
            ],
            width=24,
            height=5,
            transformations=[{"id": "organize", "options": {"excludeByName": {"Time": True}}}],
        ),
    ]


def training() -> list[Panel]:
    return [
        panel(
            "timeseries",
            "Optimizer steps per second",
            "ops",
            "optimizer.step() calls per second per rank. A rank slower than the others holds "
            "back the whole job: compare hosts, then look for recompiles or CUDA-graph "
            "re-recordings at the same time.",
            [
                q(
                    f"sum by (run, rank, optimizer) (rate(torchpulse_optimizer_steps_total{{{SEL}}}[{RI}]))",
                    "{{run}} rank {{rank}} {{optimizer}}",
                )
            ],
        ),
        panel(
            "timeseries",
            "Optimizer step time mean / p50 / p99",
            "s",
            "Wall time of optimizer.step(): the mean (what OptimizerStepSlow watches) and quantiles "
            "from its histogram. The quantiles move in bucket steps and miss a slowdown inside one "
            "bucket (0.30 s and 0.45 s both read p50 0.375 s); the mean does not. When it or p99 runs "
            "away, look for host contention, CPU offload or memory pressure on that rank.",
            [mean("torchpulse_optimizer_step_duration_seconds", "run, rank"),
             *quantiles("torchpulse_optimizer_step_duration_seconds", "run, rank")],
        ),
        panel(
            "timeseries",
            "Learning rate",
            "sci",
            "Learning rate that the last step of each param group used. A value of 0, NaN or a "
            "jump the schedule does not explain means a scheduler or resume bug.",
            [
                q(
                    f"torchpulse_optimizer_learning_rate{{{SEL}}}",
                    "{{run}} rank {{rank}} {{optimizer}} group {{param_group}}",
                )
            ],
        ),
        panel(
            "timeseries",
            "Backward time mean / p50 / p99",
            "s",
            "Wall time of backward passes by kind: the mean, and quantiles that move in bucket steps "
            "only (a slowdown inside one bucket shows in the mean alone). A growing backward time "
            "with steady batch size points at a slow autograd node (see Autograd) or a graph break.",
            [mean("torchpulse_backward_duration_seconds", "run, kind"),
             *quantiles("torchpulse_backward_duration_seconds", "run, kind")],
        ),
        panel(
            "timeseries",
            "Non-finite gradients",
            "short",
            "Backward passes with NaN/Inf gradients, and parameters affected in the last "
            "pass. Red: the model diverges (a rare blip under AMP's GradScaler is normal); "
            "check the loss, lower the learning rate, resume from a valid checkpoint.",
            [
                q(
                    f"sum by (run, rank) (increase(torchpulse_grad_nonfinite_passes_total{{{SEL}}}[{RI}]))",
                    "passes {{run}} rank {{rank}}",
                ),
                q(
                    f"max by (run, rank) (torchpulse_grad_nonfinite_parameters{{{SEL}}})",
                    "parameters {{run}} rank {{rank}}",
                ),
            ],
            red_above=1,
        ),
        panel(
            "timeseries",
            "Gradient norm",
            "none",
            "Total gradient norm per rank. Spikes precede divergence; a norm that differs "
            "across ranks of one data-parallel run means gradients are not synchronized.",
            [q(f"torchpulse_grad_norm{{{SEL}}}", "{{run}} rank {{rank}}")],
        ),
        panel(
            "timeseries",
            "Optimizer state",
            "bytes",
            "Bytes held in optimizer state tensors on each rank. Steady growth means state is "
            "created for new parameters every step; an unexpected jump after resume means "
            "the sharded state was loaded unsharded.",
            [q(f"sum by (run, rank) (torchpulse_optimizer_state_bytes{{{SEL}}})", "{{run}} rank {{rank}}")],
            width=12,
        ),
        panel(
            "timeseries",
            "Parameters per optimizer",
            "short",
            "Parameter tensors each optimizer updates. Ranks of one run that disagree, or a "
            "count that changes mid-run, mean parameters were frozen or added by mistake.",
            [q(f"torchpulse_optimizer_parameters{{{SEL}}}", "{{run}} rank {{rank}} {{optimizer}}")],
            width=12,
        ),
    ]


def compilation() -> list[Panel]:
    return [
        panel(
            "timeseries",
            "Recompiles by reason",
            "cpm",
            "torch.compile recompilations per minute by classified guard-failure reason, on the "
            "rank that recompiles most (the ranks of a data-parallel job recompile together). Red "
            "(RecompilationStorm): make the changing shape dynamic or turn the changing Python "
            "value into a tensor.",
            [
                q(
                    f"60 * max by (run, reason) (sum by (run, rank, reason) "
                    f"(rate(torchpulse_recompiles_total{{{SEL}}}[{RI}])))",
                    "{{run}} {{reason}}",
                )
            ],
            red_above=3,
        ),
        panel(
            "bargauge",
            "Recompiles by function (top 10)",
            "short",
            "Functions recompiled most in the selected range. Fix the top one first; the "
            "reason panel says why it recompiles.",
            [
                q(
                    f"topk(10, sum by (function) (increase(torchpulse_recompiles_total{{{SEL}}}[$__range])))",
                    "{{function}}",
                    instant=True,
                )
            ],
            options={"orientation": "horizontal", "reduceOptions": {"calcs": ["lastNotNull"]}},
        ),
        panel(
            "table",
            "Graph breaks",
            "short",
            "Graph breaks by kind and source location. Each break runs the code around it "
            "eagerly; remove the cause at the location (data-dependent control flow, "
            "print, unsupported calls) or accept it knowingly.",
            [q(f"sum by (run, kind, location) (torchpulse_graph_breaks_total{{{SEL}}})", instant=True, table=True)],
            transformations=[{"id": "organize", "options": {"excludeByName": {"Time": True}}}],
        ),
        panel(
            "timeseries",
            "Compile time by phase",
            "s",
            "Seconds spent compiling per phase in each interval, on the rank that compiled longest (the "
            "ranks of a data-parallel job compile side by side). Compilation after warm-up "
            "means recompiles: see the panels beside this one.",
            [
                q(
                    f"max by (run, phase) (sum by (run, rank, phase) "
                    f"(increase(torchpulse_compile_duration_seconds_sum{{{SEL}}}[{RI}])))",
                    "{{run}} {{phase}}",
                )
            ],
        ),
        panel(
            "timeseries",
            "Compiled frames by status",
            "cpm",
            "Frames compiled per minute, ok and failed. Failed frames fall back to eager: "
            "the daemon log and TORCH_LOGS=dynamo name the error.",
            [
                q(
                    f"60 * sum by (run, status) (rate(torchpulse_compile_frames_total{{{SEL}}}[{RI}]))",
                    "{{run}} {{status}}",
                )
            ],
        ),
        panel(
            "table",
            "Recompile limit hits",
            "short",
            "Functions that hit torch._dynamo's recompile limit and now run eagerly for the "
            "rest of the run. Red: fix the recompile reason for that function; raising the "
            "limit only hides it.",
            [
                q(
                    f"sum by (run, function) (torchpulse_recompile_limit_hits_total{{{SEL}}}) > 0",
                    instant=True,
                    table=True,
                )
            ],
            red_above=1,
            transformations=[{"id": "organize", "options": {"excludeByName": {"Time": True}}}],
        ),
    ]


def cudagraphs() -> list[Panel]:
    return [
        panel(
            "table",
            "CUDA-graph skips by reason",
            "short",
            "Graphs that run without CUDA graphs, by reason. Red: the reduce-overhead "
            "speed-up is lost; remove the cause (CPU tensors, mutated inputs, dynamic "
            "shapes, incompatible ops).",
            [q(f"sum by (run, reason) (torchpulse_cudagraph_skips_total{{{SEL}}}) > 0", instant=True, table=True)],
            red_above=1,
            transformations=[{"id": "organize", "options": {"excludeByName": {"Time": True}}}],
        ),
        panel(
            "timeseries",
            "CUDA-graph recordings",
            "cpm",
            "CUDA-graph recordings per minute. Recording belongs to warm-up; "
            "recordings later on mean new shapes or re-recordings.",
            [
                q(
                    f"60 * sum by (run, rank) (rate(torchpulse_cudagraph_recordings_total{{{SEL}}}[{RI}]))",
                    "{{run}} rank {{rank}}",
                )
            ],
        ),
        panel(
            "timeseries",
            "CUDA-graph recording time p99",
            "s",
            "Time spent recording a CUDA graph. Long recordings repeated often cost more than the graphs save.",
            [
                q(
                    f"histogram_quantile(0.99, sum by (run, le) "
                    f"(rate(torchpulse_cudagraph_recording_duration_seconds_bucket{{{SEL}}}[{RI}])))",
                    "p99 {{run}}",
                )
            ],
        ),
        panel(
            "timeseries",
            "CUDA-graph re-recordings by reason",
            "cpm",
            "Re-recordings per minute by reason, on the rank that re-records most. Red "
            "(CudagraphRerecording): make the changing input static or mark the dimension dynamic.",
            [
                q(
                    f"60 * max by (run, reason) (sum by (run, rank, reason) "
                    f"(rate(torchpulse_cudagraph_rerecords_total{{{SEL}}}[{RI}])))",
                    "{{run}} {{reason}}",
                )
            ],
            red_above=0.2,
        ),
        panel(
            "timeseries",
            "Non-static input copies and graph pool",
            "cps",
            "Copies of non-static inputs into graph buffers per second (each is a device "
            "copy per replay), next to the graph memory pool size. Keep inputs at stable "
            "addresses (static buffers, or torch.compiler.cudagraph_mark_step_begin).",
            [
                q(
                    f"sum by (run, rank) (rate(torchpulse_cudagraph_nonstatic_input_copies_total{{{SEL}}}[{RI}]))",
                    "copies {{run}} rank {{rank}}",
                ),
                q(f"sum by (run, rank) (torchpulse_cudagraph_pool_bytes{{{SEL}}})", "pool bytes {{run}} rank {{rank}}"),
            ],
            units={"B": "bytes"},
        ),
        panel(
            "table",
            "Optimizer readiness for CUDA graphs",
            "short",
            "Per optimizer: gradients at non-static addresses, param groups with "
            "capturable=True, and step tensors on the CPU. A graph-captured optimizer needs "
            "capturable groups, static gradients and no CPU step tensors; fix the non-zero "
            "columns.",
            [
                q(
                    f"sum by (run, rank, optimizer) (torchpulse_optimizer_nonstatic_grads{{{SEL}}})",
                    instant=True,
                    table=True,
                ),
                q(
                    f"min by (run, rank, optimizer) (torchpulse_optimizer_capturable{{{SEL}}})",
                    instant=True,
                    table=True,
                ),
                q(
                    f"sum by (run, rank, optimizer) (torchpulse_optimizer_cpu_step_tensors{{{SEL}}})",
                    instant=True,
                    table=True,
                ),
            ],
            transformations=[{"id": "merge", "options": {}}],
        ),
    ]


def checkpoints() -> list[Panel]:
    return [
        panel(
            "table",
            "Checkpoint status per root",
            "none",
            "Status of the newest checkpoint in each watched root (valid, invalid, "
            "incomplete), its size, and whether every daemon can read the root (0: nothing under "
            "it is validated; the daemon log says why). Red rows: run `torchpulse check <dir>` and "
            "keep the last valid checkpoint until the save path is fixed.",
            [
                q("max by (root, status) (torchpulse_checkpoint_last_status == 1)", instant=True, table=True),
                q("max by (root) (torchpulse_checkpoint_bytes)", instant=True, table=True),
                q("max by (root) (torchpulse_checkpoint_incomplete)", instant=True, table=True),
                q("min by (root) (torchpulse_checkpoint_root_readable)", instant=True, table=True),
            ],
            width=12,
            units={"B": "bytes"},
            transformations=[{"id": "merge", "options": {}}],
        ),
        panel(
            "stat",
            "Age of the last valid checkpoint",
            "s",
            "Time since each root last had a valid checkpoint. Red after 6 hours "
            "(NoValidCheckpointRecently): a crash now loses that much training; check that "
            "the job saves and why saves fail validation.",
            [q("time() - max by (root) (torchpulse_checkpoint_last_valid_timestamp_seconds > 0)", "{{root}}")],
            width=12,
            red_above=21600,
            options={"reduceOptions": {"calcs": ["lastNotNull"]}, "colorMode": "background"},
        ),
        panel(
            "table",
            "Findings by rule",
            "short",
            "Validation findings of the newest checkpoint by rule id and severity. Each "
            "TP-CKPT rule names what is wrong; errors make a checkpoint invalid.",
            [q("max by (root, rule, severity) (torchpulse_checkpoint_findings) > 0", instant=True, table=True)],
            transformations=[{"id": "organize", "options": {"excludeByName": {"Time": True}}}],
        ),
        panel(
            "timeseries",
            "Validation time p50 / p99 (last hour)",
            "s",
            "How long the validations of the hour before each point took, per level (checkpoints come "
            "minutes apart, so a shorter window would be empty between them; a gap: no validation in "
            "that hour). Close to validation_timeout_seconds means validations get killed: lower the "
            "level or raise the timeout.",
            quantiles("torchpulse_checkpoint_validation_duration_seconds", "level", selector="", window=RARE),
        ),
        panel(
            "timeseries",
            "Checkpoint save time p99 (last hour)",
            "s",
            "p99 time the job spent saving the checkpoints of the hour before each point, per run "
            "(saves come minutes apart, so a shorter window would be empty between them; a gap: no "
            "save in that hour). Saves that grow longer slow training and risk incomplete "
            "checkpoints on preemption.",
            [
                q(
                    f"histogram_quantile(0.99, sum by (run, le) "
                    f"(increase(torchpulse_checkpoint_save_duration_seconds_bucket{{{RUN}}}[{RARE}])))",
                    "save p99 {{run}}",
                )
            ],
        ),
        panel(
            "timeseries",
            "Validations by status",
            "cpm",
            "Validations per minute by result. Invalid or incomplete results deserve a look at the findings table.",
            [
                q(
                    f"60 * sum by (root, status) (rate(torchpulse_checkpoint_validations_total[{RI}]))",
                    "{{root}} {{status}}",
                )
            ],
            width=12,
            height=6,
        ),
        panel(
            "timeseries",
            "Failed checkpoint saves",
            "short",
            "Checkpoint saves that raised since each rank started, summed over ranks (a failing DCP save "
            "raises on every rank of the save), by API and exception class. Any step up "
            "(CheckpointSaveFailed) is a lost checkpoint: the daemon log's `checkpoint save failed` events "
            "name the path and the first failing rank's error (full disk, permissions, a bad path).",
            [
                q(
                    f"sum by (run, api, error) (torchpulse_checkpoint_save_failures_total{{{RUN}}})",
                    "{{run}} {{api}} {{error}}",
                )
            ],
            width=12,
            height=6,
            red_above=1,
        ),
    ]


def autograd() -> list[Panel]:
    per_pass = (
        f"sum by (node) (increase(torchpulse_autograd_node_seconds_total{{{SEL}}}[$__range]))"
        " / ignoring (node) group_left "
        f"sum(increase(torchpulse_autograd_sampled_passes_total{{{SEL}}}[$__range]))"
    )
    return [
        panel(
            "bargauge",
            "Top autograd node types by time per sampled pass",
            "s",
            "Seconds each backward node type takes per sampled backward pass, over the "
            "selected range. The top entries are where backward time goes: fuse, "
            "checkpoint or recompute them, or change dtype.",
            [q(f"topk(10, {per_pass})", "{{node}}", instant=True)],
            width=12,
            height=9,
            options={"orientation": "horizontal", "reduceOptions": {"calcs": ["lastNotNull"]}},
        ),
        panel(
            "timeseries",
            "Autograd node calls per second (top 10)",
            "cps",
            "Calls of the most frequent node types in the sampled passes (1 in 100 by default: the ranking "
            "holds, the rate is that much lower). Many tiny nodes mean launch overhead: "
            "torch.compile or fused kernels help.",
            [q(f"topk(10, sum by (node) (rate(torchpulse_autograd_node_calls_total{{{SEL}}}[{RI}])))", "{{node}}")],
            width=12,
            height=9,
        ),
    ]


ROWS = [
    ("Overview", overview),
    ("Training", training),
    ("Compilation", compilation),
    ("CUDA graphs", cudagraphs),
    ("Checkpoints", checkpoints),
    ("Autograd", autograd),
]


def variables() -> list[dict[str, Any]]:
    def query_var(name: str, label: str, query: str) -> dict[str, Any]:
        return {
            "name": name,
            "label": label,
            "type": "query",
            "datasource": DS,
            "query": {"query": query, "refId": f"{name}-var"},
            "definition": query,
            "refresh": 2,
            "includeAll": True,
            "multi": True,
            "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "sort": 3,
            "regex": "",
            "hide": 0,
        }

    return [
        {
            "name": "datasource",
            "label": "Prometheus",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "hide": 0,
            "refresh": 1,
            "regex": "",
        },
        query_var("run", "Run", "label_values(torchpulse_run_info, run)"),
        query_var("rank", "Rank", 'label_values(torchpulse_agent_up{run=~"$run"}, rank)'),
    ]


def dashboard() -> dict[str, Any]:
    panels: list[Panel] = []
    next_id, y = 1, 0
    for title, build in ROWS:
        panels.append(
            {
                "type": "row",
                "title": title,
                "id": next_id,
                "collapsed": False,
                "gridPos": {"x": 0, "y": y, "w": 24, "h": 1},
                "panels": [],
            }
        )
        next_id, y, x, row_height = next_id + 1, y + 1, 0, 0
        for built in build():
            width, height = built["gridPos"]["w"], built["gridPos"]["h"]
            if x + width > 24:
                x, y, row_height = 0, y + row_height, 0
            built["gridPos"] = {"x": x, "y": y, "w": width, "h": height}
            built["id"] = next_id
            for ref, target in zip("ABCDEFGH", built["targets"], strict=False):
                target["refId"] = ref
            panels.append(built)
            next_id, x, row_height = next_id + 1, x + width, max(row_height, height)
        y += row_height
    return {
        "title": "torchpulse",
        "uid": "torchpulse",
        "description": "PyTorch training jobs seen by torchpulse: steps, compilation, CUDA graphs, "
        "gradients and checkpoints.",
        "tags": ["torchpulse", "pytorch"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "timezone": "",
        "links": [],
        "annotations": {"list": []},
        "templating": {"list": variables()},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT}")
