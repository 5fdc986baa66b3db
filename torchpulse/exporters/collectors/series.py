"""Every series the agents sent, exposed under its catalog family with run and rank added.

This is the one collector whose size grows with the fleet (64 runs x 8 ranks
is tens of thousands of samples), so it renders text format 0.0.4 directly:
each series' `name{labels}` prefix is built once and cached per rank, and
a scrape only formats values. prometheus_client's generic path cost ~8 µs a
sample here, which put a 512-rank scrape at 600 ms.
"""

from __future__ import annotations

import math
import weakref
from collections import defaultdict
from itertools import accumulate

from prometheus_client.utils import floatToGoString

from torchpulse.catalog import CATALOG, Family
from torchpulse.daemon.runs import RankState, RunsView, SeriesKey

Prefix = str | tuple[str, ...]


def escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def format_value(value: float) -> str:
    if value != value or math.isinf(value):
        return "NaN" if value != value else ("+Inf" if value > 0 else "-Inf")
    return repr(value)


def _labels(family: Family, run: str, rank: int, values: tuple[str, ...]) -> str:
    pairs = [f'run="{escape(run)}"', f'rank="{rank}"']
    pairs += [f'{name}="{escape(v)}"' for name, v in zip(family.labels, values, strict=True)]
    return ",".join(pairs)


def _prefix(family: Family, run: str, rank: int, values: tuple[str, ...]) -> Prefix:
    labels = _labels(family, run, rank, values)
    if family.kind != "histogram":
        return f"{family.exposed_name}{{{labels}}} "
    bounds = [floatToGoString(b) for b in family.buckets] + ["+Inf"]  # type: ignore[no-untyped-call]
    name = family.exposed_name
    return (
        *(f'{name}_bucket{{{labels},le="{b}"}} ' for b in bounds),
        f"{name}_count{{{labels}}} ",
        f"{name}_sum{{{labels}}} ",
    )


def _header(family: Family) -> str:
    help_text = family.help.replace("\\", "\\\\").replace("\n", "\\n")
    return f"# HELP {family.exposed_name} {help_text}\n# TYPE {family.exposed_name} {family.kind}\n"


class AgentSeriesCollector:
    name = "agent_series"

    def __init__(self, registry: RunsView) -> None:
        self.registry = registry
        # Rendered prefixes per rank; a rank's go when the registry forgets it.
        self._prefixes: weakref.WeakKeyDictionary[RankState, dict[SeriesKey, Prefix]] = weakref.WeakKeyDictionary()

    def render(self) -> str:
        lines: dict[str, list[str]] = defaultdict(list)
        for run in self.registry.runs.values():
            for rank, state in run.ranks.items():
                cache = self._prefixes.get(state)
                if cache is None:
                    cache = self._prefixes[state] = {}
                self._render_rank(run.name, rank, state, cache, lines)
        return "".join(_header(CATALOG[name]) + "".join(body) for name, body in lines.items())

    @staticmethod
    def _render_rank(
        run: str, rank: int, state: RankState, cache: dict[SeriesKey, Prefix], lines: dict[str, list[str]]
    ) -> None:
        for key, value in state.values.items():
            prefix = cache.get(key)
            if prefix is None:
                prefix = cache[key] = _prefix(CATALOG[key[0]], run, rank, key[1])
            lines[key[0]].append(f"{prefix}{format_value(value)}\n")
        for key, (counts, total) in state.histograms.items():
            prefixes = cache.get(key)
            if prefixes is None:
                prefixes = cache[key] = _prefix(CATALOG[key[0]], run, rank, key[1])
            cumulative = list(accumulate(counts))
            out = lines[key[0]]
            out.extend(f"{p}{c}.0\n" for p, c in zip(prefixes, cumulative, strict=False))
            out.append(f"{prefixes[-2]}{cumulative[-1]}.0\n{prefixes[-1]}{format_value(total)}\n")
