"""atheris harness: the wire decoder, the frame reader, and what the daemon does with a decoded frame.

Run: `.venv/bin/python fuzz/fuzz_frames.py -max_total_time=60 [libFuzzer flags] [corpus dirs]`.

A crash is: anything but FrameError out of the decoder or reader, a run holding
more series than its budget, or a /metrics exposition that Prometheus's parser
rejects after hostile labels and run names went through the registry.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

with atheris.instrument_imports(include=["torchpulse"]):
    from torchpulse.daemon.registry import Registry
    from torchpulse.exporters.prometheus import build_exposition
    from torchpulse.framing import FrameReader
    from torchpulse.protocol import (
        Batch,
        CommandResult,
        CtlRequest,
        FrameError,
        Goodbye,
        Hello,
        HistogramSample,
        LogEvent,
        Sample,
        StatusRequest,
        decode_agent_frame,
        decode_daemon_frame,
        encode,
    )

import contextlib

from prometheus_client.parser import text_string_to_metric_families

from fuzz.common import run

SERIES_LIMIT = 64
HELLO = Hello("fuzz", 0, 0, 1, os.getpid(), "host", "2.13.0", "0.1.0", "fuzz", 0.0)


def _decode(body: bytes) -> object | None:
    try:
        return decode_agent_frame(body)
    except FrameError:
        return None


def test_one_input(data: bytes) -> None:
    with contextlib.suppress(FrameError):
        decode_daemon_frame(data)
    try:
        bodies = FrameReader().feed(data)
    except FrameError:
        bodies = []
    registry = Registry(series_limit_per_run=SERIES_LIMIT)
    run_state, rank = registry.connect(HELLO, None)
    for body in (data, *bodies):
        frame = _decode(body)
        if isinstance(frame, Hello):
            try:
                run_state, rank = registry.connect(frame, None)
            except FrameError:
                continue
        elif isinstance(frame, Batch):
            registry.apply(run_state, rank, frame)
    for state_run in registry.runs.values():
        held = sum(len(r.values) + len(r.histograms) for r in state_run.ranks.values())
        if held != state_run.series or held > SERIES_LIMIT:
            raise AssertionError(f"run {state_run.name!r} holds {held} series, counted {state_run.series}")
    text = build_exposition(registry).render().decode()
    list(text_string_to_metric_families(text))


def seeds() -> list[bytes]:
    now = time.time()
    batch = Batch(
        1,
        now,
        [
            Sample("optimizer_steps_total", ("AdamW#0",), 10.0),
            Sample("recompiles_total", ("f", "size_mismatch"), 2.0),
            Sample("grad_norm", (), float("nan")),
        ],
        [HistogramSample("optimizer_step_duration_seconds", ("AdamW#0",), (0,) * 18 + (1,), 0.1)],
        [LogEvent(now, "info", "recompile", {"detail": 'a "quoted"\nline', "n": 1})],
    )
    frames = [
        HELLO,
        batch,
        Goodbye("exit"),
        StatusRequest(),
        CommandResult(1, True, "ok", {}),
        CtlRequest("fuzz", [0], "sample", {"rate": 0.5}, 1.0),
    ]
    encoded = [encode(f) for f in frames]
    return [*encoded, *(e[8:] for e in encoded), encode(HELLO) + encode(batch)]


if __name__ == "__main__":
    run(test_one_input, seeds(), "frames")
