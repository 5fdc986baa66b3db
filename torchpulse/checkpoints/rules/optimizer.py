"""Optimizer-state rules, for both key layouts DCP writes.

Nested (`get_state_dict` default): `<opt>.state.<fqn>.<name>` with planner path
(opt, "state", fqn, name) and `<opt>.param_groups.<i>.params` lists.
Flat (`flatten_optimizer_state_dict=True`): path (opt, "state.<fqn>.<name>"),
no params list.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torchpulse.checkpoints.model import Checkpoint, Finding, StoredBytes, StoredTensor
from torchpulse.checkpoints.rules import error, info, warning

# State that must be >= 0 (second moments); anything negative means corruption.
NON_NEGATIVE_STATE = frozenset({"exp_avg_sq", "max_exp_avg_sq", "sum", "square_avg"})


@dataclass(frozen=True, slots=True)
class StateKey:
    optimizer: str
    param: str
    name: str


@dataclass(frozen=True, slots=True)
class OptimizerLayout:
    state: Mapping[str, StateKey]  # flat checkpoint key -> parsed state key
    params_lists: Mapping[str, str]  # flat key of a params list -> optimizer prefix
    # Model parameter name (as optimizer state names it) -> flat tensor key.
    params: Mapping[str, str]

    @property
    def optimizers(self) -> set[str]:
        return {s.optimizer for s in self.state.values()}


def _parse_state_path(path: tuple[str, ...]) -> StateKey | None:
    if len(path) == 4 and path[1] == "state":
        return StateKey(path[0], path[2], path[3])
    if len(path) == 2 and path[1].startswith("state."):
        fqn, _, name = path[1][len("state.") :].rpartition(".")
        return StateKey(path[0], fqn, name) if fqn else None
    return None


def _paths(ckpt: Checkpoint) -> dict[str, tuple[str, ...]]:
    keys = [*ckpt.tensors, *ckpt.bytes_keys]
    paths: dict[str, tuple[str, ...]] = {}
    for key in keys:
        path = ckpt.key_paths.get(key)
        if path is None:
            # No planner_data: assume a one-level prefix and dotted names below it.
            head, _, rest = key.partition(".")
            if rest.startswith("state."):
                path = (head, rest)
            elif rest.startswith("param_groups.") and rest.endswith(".params"):
                path = (head, "param_groups", rest.split(".")[1], "params")
            else:
                path = (head, rest) if rest else (key,)
        paths[key] = path
    return paths


def parse_layout(ckpt: Checkpoint) -> OptimizerLayout:
    """Split the checkpoint's keys into optimizer state, params lists and model params."""
    state: dict[str, StateKey] = {}
    params_lists: dict[str, str] = {}
    others: dict[str, tuple[str, ...]] = {}
    for key, path in _paths(ckpt).items():
        parsed = _parse_state_path(path)
        if parsed is not None:
            state[key] = parsed
        elif len(path) == 4 and path[1] == "param_groups" and path[3] == "params":
            params_lists[key] = path[0]
        else:
            others[key] = path
    optimizers = {s.optimizer for s in state.values()} | set(params_lists.values())
    params: dict[str, str] = {}
    for key, path in others.items():
        if key in ckpt.tensors and path[0] not in optimizers:
            params[".".join(path[1:]) if len(path) > 1 else path[0]] = key
    return OptimizerLayout(state, params_lists, params)


def no_optimizer(layout: OptimizerLayout) -> list[Finding]:
    """TP-CKPT-017: say so instead of passing silently when there is nothing to check."""
    if layout.state:
        return []
    return [info("TP-CKPT-017", "", "no optimizer state found: optimizer rules not applied")]


def state_shapes(ckpt: Checkpoint, layout: OptimizerLayout) -> list[Finding]:
    """TP-CKPT-013: each non-scalar state tensor has its parameter's shape."""
    out: list[Finding] = []
    for key, sk in sorted(layout.state.items()):
        tensor = ckpt.tensors.get(key)
        param_key = layout.params.get(sk.param)
        if tensor is None or param_key is None or math.prod(tensor.size) <= 1:
            continue
        param_size = ckpt.tensors[param_key].size
        if tensor.size != param_size:
            out.append(
                error(
                    "TP-CKPT-013",
                    key,
                    f"shape {list(tensor.size)} but parameter {param_key} has {list(param_size)}",
                )
            )
    return out


def state_presence(layout: OptimizerLayout) -> list[Finding]:
    """TP-CKPT-014: a state entry present for some parameters is present for all of them."""
    names: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for sk in layout.state.values():
        names[sk.optimizer][sk.param].add(sk.name)
    out: list[Finding] = []
    for opt, per_param in sorted(names.items()):
        union = set().union(*per_param.values())
        for param, have in sorted(per_param.items()):
            for missing in sorted(union - have):
                out.append(
                    error(
                        "TP-CKPT-014",
                        f"{opt}.state.{param}",
                        f"no {missing!r} although other parameters have it",
                    )
                )
    return out


def mixed_precision(ckpt: Checkpoint, layout: OptimizerLayout) -> list[Finding]:
    """TP-CKPT-018: state tensors of one optimizer in several dtypes (often intended)."""
    dtypes: dict[str, Counter[str]] = defaultdict(Counter)
    for key, sk in layout.state.items():
        tensor = ckpt.tensors.get(key)
        if tensor is not None and sk.name != "step":
            dtypes[sk.optimizer][tensor.dtype] += 1
    return [
        warning(
            "TP-CKPT-018",
            opt,
            "state in several dtypes: " + ", ".join(f"{n} {d}" for d, n in sorted(c.items())),
        )
        for opt, c in sorted(dtypes.items())
        if len(c) > 1
    ]


def params_lists(layout: OptimizerLayout, items: Mapping[str, StoredBytes]) -> list[Finding]:
    """TP-CKPT-015: the params lists name every stateful parameter exactly once."""
    stateful: dict[str, set[str]] = defaultdict(set)
    for sk in layout.state.values():
        stateful[sk.optimizer].add(sk.param)
    listed: dict[str, Counter[str]] = defaultdict(Counter)
    readable: dict[str, bool] = defaultdict(lambda: True)
    for key, opt in layout.params_lists.items():
        item = items.get(key)
        value = item.value if item is not None and item.verifiable else None
        if not isinstance(value, list | tuple) or not all(isinstance(v, str | int) for v in value):
            readable[opt] = False
            continue
        listed[opt].update(str(v) for v in value)
    out: list[Finding] = []
    for opt in sorted(set(layout.params_lists.values())):
        if not readable[opt]:
            continue
        counts = listed[opt]
        for param, n in sorted(counts.items()):
            if n > 1:
                out.append(error("TP-CKPT-015", f"{opt}.param_groups", f"{param} listed {n} times"))
        for param in sorted(stateful[opt] - set(counts)):
            out.append(
                error(
                    "TP-CKPT-015",
                    f"{opt}.param_groups",
                    f"{param} has state but is in no param group: load drops or misassigns it",
                )
            )
    return out


def step_consistency(
    layout: OptimizerLayout,
    tensors: Sequence[StoredTensor],
    items: Mapping[str, StoredBytes],
) -> list[Finding]:
    """TP-CKPT-016: every parameter of one optimizer took the same number of steps."""
    # Keyed by the value itself (1 == 1.0 share a key): float() of a hostile 10**400 raises.
    steps: dict[str, dict[int | float, list[str]]] = defaultdict(lambda: defaultdict(list))
    scalars = {t.key: t.scalar for t in tensors if t.scalar is not None}
    for key, sk in layout.state.items():
        if sk.name != "step":
            continue
        value: object = None
        if key in scalars:
            value = scalars[key]
        elif key in items and items[key].verifiable:
            value = items[key].value
        if isinstance(value, int | float) and not isinstance(value, bool):
            steps[sk.optimizer][value].append(sk.param)
    out: list[Finding] = []
    for opt, by_value in sorted(steps.items()):
        if len(by_value) > 1:
            summary = "; ".join(f"{_number(v)} for {len(p)} ({', '.join(sorted(p)[:3])})"
                                for v, p in sorted(by_value.items()))
            out.append(error("TP-CKPT-016", opt, f"step differs across parameters: {summary}"))
    return out


def _number(value: int | float) -> str:
    try:
        return f"{value:g}"
    except OverflowError:  # an int too large for a float: its first digits are enough
        digits = str(value) if isinstance(value, int) and value.bit_length() < 4096 else "a huge integer"
        return digits[:24] + ("..." if len(digits) > 24 else "")


def state_values(layout: OptimizerLayout, tensors: Sequence[StoredTensor]) -> list[Finding]:
    """TP-CKPT-021/022: no NaN/Inf in optimizer state; second moments are non-negative."""
    nonfinite: Counter[str] = Counter()
    negative: Counter[str] = Counter()
    for stored in tensors:
        sk = layout.state.get(stored.key)
        if sk is None:
            continue
        nonfinite[stored.key] += stored.nonfinite
        if sk.name in NON_NEGATIVE_STATE:
            negative[stored.key] += stored.negative
    out = [error("TP-CKPT-021", key, f"{n} NaN/Inf values") for key, n in sorted(nonfinite.items()) if n]
    out += [
        error("TP-CKPT-022", key, f"{n} negative values in a second moment") for key, n in sorted(negative.items()) if n
    ]
    return out
