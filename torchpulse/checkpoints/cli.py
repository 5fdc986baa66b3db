"""`torchpulse check PATH [--level metadata|data|load] [--format text|json]`.

Exit status: 0 valid (warnings allowed), 1 invalid, 3 incomplete, 2 usage or I/O error, or the
validator crashed (cannot tell).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from collections import defaultdict
from pathlib import Path
from typing import Final

from torchpulse.checkpoints.isolated import CLEAR_LINE, ValidatorFailed, validate_isolated
from torchpulse.checkpoints.model import DATA_SUFFIXES, Level, Status, ValidationResult
from torchpulse.checkpoints.rules import RULES
from torchpulse.terminal import printable

EXIT_VALID, EXIT_INVALID, EXIT_ERROR, EXIT_INCOMPLETE = 0, 1, 2, 3
_EXIT = {
    Status.VALID: EXIT_VALID,
    Status.INVALID: EXIT_INVALID,
    Status.INCOMPLETE: EXIT_INCOMPLETE,
    Status.ERROR: EXIT_ERROR,
}
# Subdirectories looked into when PATH has no checkpoint files of its own (a root of thousands of saves).
MAX_SUBDIRS_EXAMINED: Final = 1000
# Checkpoint directories named in the message about such a PATH.
MAX_NAMED: Final = 3


def render_text(result: ValidationResult) -> str:
    """A summary line, then findings grouped by rule (every name escaped, see `printable`)."""
    # True numbers: past validate.MAX_FINDINGS_PER_RULE a rule's findings are counted, not listed.
    true_counts = result.finding_counts()
    counts: dict[str, int] = defaultdict(int)
    per_rule: dict[str, int] = defaultdict(int)
    for (rule, severity), n in true_counts.items():
        counts[severity] += n
        per_rule[rule] += n
    summary = ", ".join(_counted(n, s) for s, n in sorted(counts.items())) or "no findings"
    stats = result.stats
    lines = [
        f"{result.status.value.upper()}: {printable(result.path)} (level {result.level.value}; {summary}; "
        f"{stats.get('tensors', 0)} tensors, {stats.get('bytes', 0)} bytes, "
        f"{float(stats.get('duration_seconds', 0.0)):.2f} s)"
    ]
    by_rule: dict[str, list[str]] = defaultdict(list)
    for f in result.findings:
        subject = f"{printable(f.subject)}: " if f.subject else ""
        by_rule[f.rule].append(f"    {f.severity.value:<7} {subject}{printable(f.message)}")
    for rule in sorted(by_rule):
        lines.append(f"  {printable(rule)} {RULES.get(rule, '')} ({per_rule[rule]})")
        lines.extend(by_rule[rule])
    return "\n".join(lines)


def _counted(n: int, severity: str) -> str:
    """`2 errors`, `1 warning`, `3 info` (a mass noun)."""
    return f"{n} {severity}" if n == 1 or severity == "info" else f"{n} {severity}s"


def _is_checkpoint_file(name: str) -> bool:
    """A file only a checkpoint directory holds: metadata (committed, per rank or temporary) or data."""
    return name.endswith((".metadata", ".metadata.tmp", *DATA_SUFFIXES))


def _not_a_checkpoint(path: str) -> str | None:
    """Why `path`, which holds no checkpoint file of its own, is no checkpoint directory at all, or None.

    Read from one listing of `path`. A root of saves (`/ckpt` given instead of `/ckpt/step-4000`) and a
    directory of other files (`torch.save` output: `pytorch_model.bin`, `optimizer.pt`, Lightning's
    `.ckpt`) are usage errors, not saves that have not committed: the daemon does not count them
    incomplete either. An empty directory still is one (a save that has only made its directory).
    """
    try:
        entries = sorted(Path(path).iterdir())
    except OSError:
        return None
    if any(_is_checkpoint_file(e.name) for e in entries):
        return None
    inside: list[str] = []
    for entry in entries[:MAX_SUBDIRS_EXAMINED]:
        with contextlib.suppress(OSError):  # not a directory, or one it cannot list
            if any(_is_checkpoint_file(f.name) for f in entry.iterdir()):
                inside.append(entry.name)
    if inside:
        named = ", ".join(printable(n) for n in inside[:MAX_NAMED]) + (", ..." if len(inside) > MAX_NAMED else "")
        return f"not a checkpoint but a directory of checkpoints ({named}): check one of them"
    files = 0
    for entry in entries:
        with contextlib.suppress(OSError):
            files += entry.is_file()
    if files:
        return (
            f"not a DCP or safetensors checkpoint: {files} file{'s' if files != 1 else ''}, no .metadata, "
            ".distcp or .safetensors among them (torch.save files such as .pt, .bin or .ckpt are not checked)"
        )
    return None


def _interrupted() -> int:
    """Ctrl-C: one line, no traceback, then die of SIGINT as the shell expects (a loop over checkpoints stops)."""
    # The child's progress bar may still be on the line.
    print(f"{CLEAR_LINE if sys.stderr.isatty() else ''}torchpulse check: interrupted", file=sys.stderr)
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    if threading.current_thread() is threading.main_thread():  # signal.signal works there only
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return 128 + signal.SIGINT  # main() run off the main thread by another program: the shell's code for it


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchpulse check",
        description="Validate one distributed (DCP) or safetensors checkpoint directory.",
        epilog="exit status: 0 valid (warnings allowed), 1 invalid, 3 incomplete (not committed yet, or "
        "abandoned), 2 usage or I/O error, or the validator crashed (cannot tell)",
    )
    p.add_argument("path", help="checkpoint directory (one save, e.g. /ckpt/step-4000)")
    p.add_argument(
        "--level",
        choices=[lv.value for lv in Level],
        default=Level.DATA.value,
        help="metadata: .metadata and stat only; data (default): also read and check every item; "
        "load: also load the optimizer state resharded",
    )
    p.add_argument(
        "--format", choices=["text", "json"], default="text", help="text for people (default), json for programs"
    )
    return p


def main(argv: list[str]) -> int:
    """Validate one checkpoint directory in a child process (see `isolated`) and print the result."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return int(exc.code) if isinstance(exc.code, int) else EXIT_ERROR
    if not Path(args.path).is_dir():
        print(f"torchpulse check: {printable(args.path)}: not a directory", file=sys.stderr)
        return EXIT_ERROR
    try:
        result = validate_isolated(args.path, Level(args.level))
    except ValidatorFailed as exc:
        # A child killed mid-way leaves its progress bar on the line.
        print(f"{CLEAR_LINE if sys.stderr.isatty() else ''}torchpulse check: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return _interrupted()
    if result.status is Status.INCOMPLETE and (why := _not_a_checkpoint(args.path)):
        print(f"torchpulse check: {printable(args.path)}: {why}", file=sys.stderr)
        return EXIT_ERROR
    if args.format == "json":
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(render_text(result))
    return _EXIT[result.status]


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
