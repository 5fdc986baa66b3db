"""`torchpulse check PATH [--level metadata|data|load] [--format text|json]`.

Exit status: 0 valid (warnings allowed), 1 invalid, 3 incomplete, 2 usage or I/O error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import TextIO

from torchpulse.checkpoints.model import Level, Status, ValidationResult
from torchpulse.checkpoints.rules import RULES
from torchpulse.terminal import printable

EXIT_VALID, EXIT_INVALID, EXIT_ERROR, EXIT_INCOMPLETE = 0, 1, 2, 3
_EXIT = {
    Status.VALID: EXIT_VALID,
    Status.INVALID: EXIT_INVALID,
    Status.INCOMPLETE: EXIT_INCOMPLETE,
    Status.ERROR: EXIT_ERROR,
}


class ProgressBar:
    """A one-line byte counter on stderr, drawn at most 10 times a second."""

    def __init__(self, total: int, stream: TextIO) -> None:
        self.total, self.done, self.stream, self.last = max(total, 1), 0, stream, 0.0

    def __call__(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= 0.1 or self.done >= self.total:
            self.last = now
            frac = min(self.done / self.total, 1.0)
            bar = "#" * int(frac * 30)
            self.stream.write(f"\r[{bar:<30}] {frac:6.1%} {self.done >> 20} MiB")
            self.stream.flush()

    def close(self) -> None:
        self.stream.write("\r" + " " * 60 + "\r")
        self.stream.flush()


def render_text(result: ValidationResult) -> str:
    """A summary line, then findings grouped by rule (every name escaped, see `printable`)."""
    counts: dict[str, int] = defaultdict(int)
    for f in result.findings:
        counts[f.severity.value] += 1
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no findings"
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
        lines.append(f"  {printable(rule)} {RULES.get(rule, '')} ({len(by_rule[rule])})")
        lines.extend(by_rule[rule])
    return "\n".join(lines)


def _listed_bytes(path: str) -> int:
    """Total size of the regular files in `path`, for the progress bar only (0 if they cannot be listed)."""
    total = 0
    with contextlib.suppress(OSError), os.scandir(path) as it:
        for e in it:
            with contextlib.suppress(OSError):
                if e.is_file(follow_symlinks=False):
                    total += e.stat(follow_symlinks=False).st_size
    return total


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torchpulse check", description=__doc__.splitlines()[0])
    p.add_argument("path", help="checkpoint directory")
    p.add_argument("--level", choices=[lv.value for lv in Level], default=Level.DATA.value)
    p.add_argument("--format", choices=["text", "json"], default="text")
    return p


def main(argv: list[str]) -> int:
    """Validate one checkpoint directory in this process and print the result."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return int(exc.code) if isinstance(exc.code, int) else EXIT_ERROR
    if not Path(args.path).is_dir():
        print(f"torchpulse check: {printable(args.path)}: not a directory", file=sys.stderr)
        return EXIT_ERROR
    from torchpulse.checkpoints.validate import Options, validate

    level = Level(args.level)
    bar: ProgressBar | None = None
    if level is not Level.METADATA and sys.stderr.isatty():
        bar = ProgressBar(_listed_bytes(args.path), sys.stderr)
    try:
        result = validate(args.path, level, Options(progress=bar))
    except (OSError, MemoryError) as exc:
        # The validator could not finish: nothing is known about the checkpoint ("cannot tell").
        print(f"torchpulse check: {printable(str(exc) or type(exc).__name__)}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as exc:
        # A bug of the validator, not a verdict on the checkpoint: a traceback and Python's exit
        # status 1 would read as "invalid".
        print(f"torchpulse check: internal error: {type(exc).__name__}: {printable(str(exc))[:500]}",
              file=sys.stderr)
        return EXIT_ERROR
    finally:
        if bar is not None:
            bar.close()
    if args.format == "json":
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(render_text(result))
    return _EXIT[result.status]


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
