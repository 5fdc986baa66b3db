"""Families the daemon's own collectors export: which ranks are connected, what each run is, the daemon's health.

No agent may send these (they are not in `CATALOG`); the collectors in `torchpulse/exporters/` take their
names, help and labels from here.
"""

from __future__ import annotations

from typing import Final

from torchpulse.catalog.family import Family, Section

FAMILIES: Final[tuple[Family, ...]] = (
    # Runs and ranks (the agents collector).
    Family(
        "agent_up",
        "gauge",
        "1 while the rank's agent is connected.",
        ("run", "rank"),
        doc="TorchpulseAgentDown fires on 0 without `torchpulse_agent_exited` 1.",
        source="daemon",
    ),
    Family(
        "agent_exited",
        "gauge",
        "1 once the rank's agent said goodbye before disconnecting (its process exited normally or "
        "detached): agent_up 0 then means gone, not down.",
        ("run", "rank"),
        doc="Not after an uncaught exception or a failing `sys.exit()`: such a process sends its last values but "
        "no goodbye. Forgotten with its run, after `runs.grace_period_seconds`.",
        source="daemon",
    ),
    Family(
        "run_info",
        "gauge",
        "Facts about a run, from its first rank on this node (join on `run`, and on `instance` too where a run "
        "spans nodes: each node's daemon has one); always 1.",
        ("run", "torch_version", "world_size", "host", "agent_version", "command"),
        doc="`command` is the first 256 characters of the command line, with the values of secret-looking "
        "arguments (`--hf_token X`, `--api-key=X`, `wandb.api_key=X`, a URL's `user:password@`) replaced by "
        "`***` before they leave the process.",
        source="daemon",
    ),
    Family("run_series", "gauge", "Series the daemon holds for the run.", ("run",), source="daemon"),
    Family(
        "run_series_rejected",
        "gauge",
        "New series refused because the run hit its series limit, counted since the daemon began holding the "
        "run (it only grows: use increase()).",
        ("run",),
        doc="The limit is `runs.series_limit_per_run`; other runs are unaffected.",
        source="daemon",
    ),
    # The daemon's health (the daemon collector).
    Family(
        "build_info",
        "gauge",
        "torchpulse version; always 1.",
        ("version", "protocol_version"),
        source="daemon",
    ),
    Family("daemon_start_time_seconds", "gauge", "Unix time the daemon started.", source="daemon"),
    Family("daemon_connections", "gauge", "Open agent connections.", source="daemon"),
    Family("daemon_runs", "gauge", "Runs with at least one connected rank.", source="daemon"),
    Family(
        "daemon_events_received_total",
        "counter",
        "Series updates and log events received from agents.",
        source="daemon",
    ),
    Family(
        "daemon_frames_rejected_total",
        "counter",
        "Frames refused (the connection is closed), by reason.",
        ("reason",),
        doc="Malformed, truncated, oversized, unknown or mismatched frames, timeouts, and hellos refused as "
        "`rank_taken` (another live process holds the run's rank) or `run_owned` (another user's run).",
        source="daemon",
    ),
    Family(
        "daemon_series_rejected_total",
        "counter",
        "Series updates refused, by reason: unknown_family, bad_shape, bad_buckets, "
        "bad_value (a counter that is NaN, Inf or negative), label_too_long, "
        "run_series_limit.",
        ("reason",),
        doc="An agent of another torchpulse version whose histogram buckets split the daemon's is summed into "
        "them exactly; any other layout is `bad_buckets`, and the daemon's log names the family and why.",
        source="daemon",
    ),
    # From the checkpoint collector: the validation state is all the daemon keeps in its state directory.
    Family(
        "daemon_state_persistent",
        "gauge",
        "1 when checkpoint validation state is written to the state directory, 0 when it "
        "is kept in memory only and lost at a restart.",
        doc="TorchpulseStateNotPersistent fires after 10 minutes at 0 ([operations.md](operations.md)).",
        source="daemon",
    ),
    # The scrape's supervisor, one series per collector.
    Family(
        "scrape_collector_duration_seconds",
        "gauge",
        "Time a collector took in this scrape.",
        ("collector",),
        source="daemon",
    ),
    Family(
        "scrape_collector_success",
        "gauge",
        "1 if the collector succeeded in this scrape.",
        ("collector",),
        doc="A failing collector contributes nothing but never fails the scrape.",
        source="daemon",
    ),
)

SECTION: Final = Section(
    "The daemon itself",
    FAMILIES,
    """\
`run` and `rank` of these families are the daemon's, as for the agents' families. A run that ended
with every rank saying goodbye stays exported for `runs.grace_period_seconds`, one that lost a rank
for `runs.lost_grace_period_seconds`, so that TorchpulseAgentDown keeps firing after a crash instead of
resolving as if the job had recovered.""",
)
