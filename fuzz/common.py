"""Shared plumbing of the atheris harnesses: seed corpus in a scratch directory, known bugs, run loop."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

# Known, reported bugs that a harness recognises and counts instead of crashing on, so
# that a short CI run stays green until they are fixed. FUZZ_STRICT=1 crashes on them too.
STRICT = os.environ.get("FUZZ_STRICT") == "1"
_seen_known: set[str] = set()


class KnownBug(Exception):
    """Raised by a harness's classifier for a failure already reported under `key`."""


def known(key: str, exc: BaseException) -> None:
    """Count a known bug (printed once); re-raise it when strict."""
    if STRICT:
        raise exc
    if key not in _seen_known:
        _seen_known.add(key)
        print(f"[fuzz] known bug {key} reproduced: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr, flush=True)


def run(test_one_input: Callable[[bytes], None], seeds: Iterable[bytes], name: str) -> None:
    """Write the seeds to a scratch corpus (the repository stays clean) and hand over to libFuzzer."""
    import atheris

    corpus = Path(tempfile.mkdtemp(prefix=f"torchpulse-fuzz-{name}-"))
    for i, seed in enumerate(seeds):
        (corpus / f"seed-{i:03d}").write_bytes(seed)
    # libFuzzer grows the first corpus directory it is given: a caller's own, else the scratch one.
    atheris.Setup([*sys.argv, str(corpus)], test_one_input)
    atheris.Fuzz()
