"""Families of checkpoint-save announcements from agents, and of the daemon's checkpoint validation per root."""

from __future__ import annotations

from typing import Final

from torchpulse.catalog.family import SAVE_BUCKETS, VALIDATION_BUCKETS, Family, Section

FAMILIES: Final[tuple[Family, ...]] = (
    Family(
        "checkpoint_save_duration_seconds",
        "histogram",
        "Wall time of torch.distributed.checkpoint save (api=save) or of an async save until its upload "
        "finished (api=async_save), on this rank.",
        ("api",),
        SAVE_BUCKETS,
    ),
    Family(
        "checkpoint_save_failures_total",
        "counter",
        "torch.distributed.checkpoint saves that raised on this rank (api=save, or api=async_save while "
        "staging or in its upload), by the class of what went wrong (error: for DCP's CheckpointException the first "
        "failing rank's exception, e.g. OSError; cut to 64 characters; the first 8 names per process, the rest "
        "other).",
        ("api", "error"),
    ),
)

# Exported by the daemon's checkpoint collector, one set of series per watched root.
VALIDATION_FAMILIES: Final[tuple[Family, ...]] = (
    Family(
        "checkpoint_validations_total",
        "counter",
        "Checkpoint validations finished, by outcome.",
        ("root", "status"),
        doc="Listed at 0 for every status of each root the daemon knows, so that `increase()` has a series.",
        source="daemon",
    ),
    Family(
        "checkpoint_last_validation_timestamp_seconds",
        "gauge",
        "Unix time the last validation under the root finished.",
        ("root",),
        source="daemon",
    ),
    Family(
        "checkpoint_last_status",
        "gauge",
        "1 for the status of the root's newest checkpoint, 0 for the others.",
        ("root", "status"),
        doc="`incomplete` for an abandoned save. When that checkpoint is deleted, the newest one left is the "
        "newest from the next sweep on (none left: no series).",
        source="daemon",
    ),
    Family(
        "checkpoint_last_valid_timestamp_seconds",
        "gauge",
        "Commit time (metadata mtime) of the root's newest valid checkpoint.",
        ("root",),
        source="daemon",
    ),
    Family(
        "checkpoint_findings",
        "gauge",
        "Findings of the root's newest checkpoint, by rule and severity.",
        ("root", "rule", "severity"),
        doc="The true number, also past the 1,000 findings of a rule that `torchpulse check` lists.",
        source="daemon",
    ),
    Family(
        "checkpoint_bytes",
        "gauge",
        "Bytes on disk of the root's newest checkpoint.",
        ("root",),
        source="daemon",
    ),
    Family(
        "checkpoint_incomplete",
        "gauge",
        "Saves under the root with data files but no metadata past the timeout.",
        ("root",),
        doc="The timeout is `checkpoints.incomplete_after_seconds`.",
        source="daemon",
    ),
    Family(
        "checkpoint_last_announced_timestamp_seconds",
        "gauge",
        "Unix time a job last announced a save under the root; only for roots "
        "watched because of announcements, not configured ones.",
        ("root",),
        doc='And for `root="other"`. NoValidCheckpointRecently leaves such a root alone 6 hours after its last '
        "save: its jobs ended.",
        source="daemon",
    ),
    Family(
        "checkpoint_root_readable",
        "gauge",
        "1 when the daemon can list the root, 0 when it cannot (missing, not a directory, "
        "permission denied): nothing under it is watched or validated then.",
        ("root",),
        source="daemon",
    ),
    Family(
        "checkpoint_validation_duration_seconds",
        "histogram",
        "Wall time of one checkpoint validation (worker start to result).",
        ("level",),
        VALIDATION_BUCKETS,
        source="daemon",
    ),
)

SECTION: Final = Section(
    "Checkpoints",
    FAMILIES + VALIDATION_FAMILIES,
    """\
Only distributed checkpoints (`torch.distributed.checkpoint`, DCP) are timed, counted and validated.
The default saves of the Hugging Face Trainer (`model.safetensors`, `optimizer.pt`), Lightning's
`ModelCheckpoint` (`.ckpt`) and `accelerate`'s `save_state` use `torch.save` or safetensors: they show
no `torchpulse_checkpoint_save_*` series (not even zeros), and the daemon logs a root's
safetensors-only directories once as `not a DCP checkpoint` instead of validating them. Their FSDP
sharded saves, and any `dcp.save` of your own, are DCP and covered.

A failed save is counted once per rank. DCP wraps what went wrong on any rank in a
`CheckpointException`, raised on every rank of the save, so `error` is the class of the first failing
rank's exception inside it (e.g. `NotADirectoryError`), the same on every rank; the daemon log's
`checkpoint save failed` warning carries the path, the class the job got, that cause and its message.
The job still gets the very same exception; KeyboardInterrupt and SystemExit are not counted. A
cancelled async upload is no failure: it is logged as `checkpoint save cancelled`, not counted.

The `root` families come from the daemon's watcher: one set per configured root, per directory a job
announced (at most `checkpoints.max_announced_roots`; checkpoints of further ones count under
`root="other"`), each gone once no save was announced under it for
`checkpoints.announced_root_ttl_seconds`. Each sweep (every `incomplete_after_seconds / 4`, at most a
minute) checks that the daemon's user can read every root (`r` and `x` on it, `x` on each directory
above). A root that cannot be read is not watched, and the daemon logs `checkpoint root cannot be read`
once, with the error and its user; when it can be read again the next sweep logs `checkpoint root can
be read again; watching it` and finds what was committed meanwhile. CheckpointRootUnreadable fires
when a configured root stays unreadable for 15 minutes; announced roots get the gauge but no alert.""",
)
