"""Agents of another torchpulse version: histograms re-bucketed into the daemon's layout, or refused."""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import pytest
from structlog.testing import capture_logs

from tests.support import parse_exposition, select
from torchpulse.catalog import HISTOGRAM_BOUNDS
from torchpulse.daemon.histogram_layouts import Refused, bucket_map, plan_for, rebucket
from torchpulse.daemon.registry import Registry
from torchpulse.exporters.prometheus import build_exposition
from torchpulse.limits import MAX_HISTOGRAM_BOUNDS
from torchpulse.protocol import Batch, Hello, HistogramSample, decode_agent_frame, encode

COMPILE = "compile_duration_seconds"
OURS = HISTOGRAM_BOUNDS[COMPILE]
# compile_duration_seconds before its buckets went up to 3600 s (an agent of the previous version).
BEFORE_3600 = OURS[: OURS.index(900.0) + 1]


def _hello(bounds: dict[str, tuple[float, ...]]) -> Hello:
    return Hello("r", 0, 0, 1, 1, "h", "2.13.0", "0.0.9", "train.py", 0.0, bounds)


def test_a_finer_layout_maps_each_bucket_into_the_one_that_holds_it() -> None:
    assert (0, 0, 1, 1, 2) == bucket_map((0.5, 1.0, 1.5, 2.0), (1.0, 2.0))
    assert (0, 1, 2) == bucket_map((1.0, 2.0), (1.0, 2.0))


@pytest.mark.parametrize(
    ("agent", "why"),
    [
        ((1.5,), "straddles the daemon's bound 1"),  # (-inf, 1.5] holds counts on both sides of 1
        ((0.5, 1.0), "straddles the daemon's bound 2"),  # its +Inf bucket starts below our last bound
        ((2.0, 1.0), "strictly increasing"),
        ((1.0, math.nan, 2.0), "not finite"),
        (tuple(float(i) for i in range(MAX_HISTOGRAM_BOUNDS + 1)), f"at most {MAX_HISTOGRAM_BOUNDS}"),
    ],
)
def test_a_layout_that_cannot_be_summed_exactly_is_refused_with_its_reason(agent: tuple[float, ...], why: str) -> None:
    plan = bucket_map(agent, (1.0, 2.0))
    assert isinstance(plan, Refused) and why in plan.why


def test_rebucketing_keeps_every_count() -> None:
    assert (3, 7, 5) == rebucket((1, 2, 3, 4, 5), (0, 0, 1, 1, 2), 3)
    assert {} == plan_for({COMPILE: OURS, "not_a_family": (1.0,)})


def test_a_finer_agent_is_exported_in_the_daemons_buckets_with_every_count() -> None:
    finer = tuple(sorted((*OURS, 0.075, 7.5)))
    registry = Registry()
    with capture_logs() as logs:
        run, rank = registry.connect(_hello({COMPILE: finer}), None)
    counts = tuple(range(1, len(finer) + 2))
    registry.apply(run, rank, Batch(1, 0.0, [], [HistogramSample(COMPILE, ("inductor",), counts, 12.5)], []))
    stored, total = rank.histograms[(COMPILE, ("inductor",))]
    assert (len(OURS) + 1, sum(counts), 12.5) == (len(stored), sum(stored), total)
    samples = parse_exposition(build_exposition(registry).render().decode())
    cumulative = select(samples, "torchpulse_compile_duration_seconds_bucket", phase="inductor")
    # 0.075 splits (0.05, 0.1]: agent buckets 4 and 5 (counts 4 and 5) land in one, le="0.1".
    assert 1 + 2 + 3 + 4 + 5 == cumulative[next(k for k in cumulative if dict(k)["le"] == "0.1")]
    assert [["compile_duration_seconds"]] == [e["families"] for e in logs if "more finely" in e["event"]]


def test_an_agent_of_the_previous_compile_buckets_is_refused_and_says_why() -> None:
    """Its 16 counts ending at 900 s cannot be split at 1800 and 3600: refused, not mislabelled."""
    registry = Registry()
    with capture_logs() as logs:
        run, rank = registry.connect(_hello({COMPILE: BEFORE_3600}), None)
    registry.apply(
        run, rank, Batch(1, 0.0, [], [HistogramSample(COMPILE, ("inductor",), (1,) * (len(BEFORE_3600) + 1), 1.0)], [])
    )
    assert ({}, 1) == (rank.histograms, registry.series_rejected["bad_buckets"])
    (warning,) = [e for e in logs if e["log_level"] == "warning"]
    assert "straddles the daemon's bound 1800" in warning["families"][COMPILE]


def test_a_layout_of_the_same_length_is_refused_not_mislabelled() -> None:
    """Before the hello said how agents bucket, equal lengths passed as the daemon's own layout."""
    shifted = tuple(b * 1.5 for b in OURS)
    registry = Registry()
    run, rank = registry.connect(_hello({COMPILE: shifted}), None)
    registry.apply(
        run, rank, Batch(1, 0.0, [], [HistogramSample(COMPILE, ("dynamo",), (1,) * (len(OURS) + 1), 1.0)], [])
    )
    assert ({}, 1) == (rank.histograms, registry.series_rejected["bad_buckets"])


def test_agents_from_before_the_field_and_daemons_from_before_it_still_talk() -> None:
    """An old agent's hello decodes with no layouts (the daemon's own are assumed); an old daemon ignores them."""

    # Hello as it was: every field but the new one.
    fields = [(f.name, f.type) for f in msgspec.structs.fields(Hello) if f.name != "histogram_bounds"]
    OldHello = msgspec.defstruct("OldHello", fields, tag="hello", frozen=True)

    old = OldHello("r", 0, 0, 1, 1, "h", "2.13.0", "0.0.9", "train.py", 0.0)
    assert {} == decode_agent_frame(msgspec.msgpack.encode(old)).histogram_bounds
    new = encode(_hello({COMPILE: OURS}))
    assert old == msgspec.msgpack.decode(new[8:], type=OldHello)


def test_an_agent_says_how_it_buckets_each_histogram_and_its_daemon_keeps_them_as_they_are(tmp_path: Path) -> None:
    from torchpulse.probes.agent.agent import Agent
    from torchpulse.probes.agent.config import AgentConfig
    from torchpulse.probes.agent.identity import current_identity
    from torchpulse.probes.agent.sender import Sender
    from torchpulse.probes.families import FAMILY_TABLE

    agent = Agent(AgentConfig(socket_path=tmp_path / "agent.sock", probes=()), current_identity(), FAMILY_TABLE)
    hello = decode_agent_frame(encode(Sender(agent).link.hello())[8:])
    assert isinstance(hello, Hello)
    assert HISTOGRAM_BOUNDS == hello.histogram_bounds and len(HISTOGRAM_BOUNDS) >= 5
    assert {} == plan_for(hello.histogram_bounds)
