"""Optimizer-state rules, for both key layouts DCP writes.

Nested (`get_state_dict` default): `<opt>.state.<fqn>.<name>` with planner path
(opt, "state", fqn, name) and `<opt>.param_groups.<i>.params` lists.
Flat (`flatten_optimizer_state_dict=True`): path (opt, "state.<fqn>.<name>"),
no params list; each parameter's group options as (opt, "param_groups.<fqn>.<option>").

Parameters of different param groups may legitimately differ in state names
(per-group `amsgrad`, several optimizers merged by `get_state_dict`) and in
`step` (a group added later by `add_param_group`): those rules compare
parameters of one group only.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from torchpulse.checkpoints.model import Checkpoint, Finding, StoredBytes, StoredTensor
from torchpulse.checkpoints.rules import error, info, warning

# State that must be >= 0 (second moments); anything negative means corruption.
NON_NEGATIVE_STATE = frozenset({"exp_avg_sq", "max_exp_avg_sq", "sum", "square_avg"})
# torch.optim state that is not shaped like its parameter: LBFGS keeps vectors over all
# parameters of its one group on the first parameter.
_NOT_PARAM_SHAPED = frozenset({"d", "prev_flat_grad"})
# State names that stand in for one another: Adafactor keeps `variance` for a parameter
# of fewer than 2 dimensions and factors it into `row_var` and `col_var` for the others.
_ALTERNATIVES: Mapping[str, frozenset[str]] = {
    "variance": frozenset({"row_var", "col_var"}),
    "row_var": frozenset({"variance"}),
    "col_var": frozenset({"variance"}),
}


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
    # Flat layout: optimizer -> parameter -> option name -> key of that group option.
    group_options: Mapping[str, Mapping[str, Mapping[str, str]]] = field(default_factory=dict)

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
    group_options: dict[str, dict[str, dict[str, str]]] = defaultdict(lambda: defaultdict(dict))
    for key, path in _paths(ckpt).items():
        parsed = _parse_state_path(path)
        if parsed is not None:
            state[key] = parsed
        elif len(path) == 4 and path[1] == "param_groups" and path[3] == "params":
            params_lists[key] = path[0]
        else:
            if len(path) == 2 and path[1].startswith("param_groups."):
                fqn, _, option = path[1][len("param_groups.") :].rpartition(".")
                if fqn:
                    group_options[path[0]][fqn][option] = key
            others[key] = path
    optimizers = {s.optimizer for s in state.values()} | set(params_lists.values())
    params: dict[str, str] = {}
    for key, path in others.items():
        if key in ckpt.tensors and path[0] not in optimizers:
            params[".".join(path[1:]) if len(path) > 1 else path[0]] = key
    options = {opt: {p: dict(o) for p, o in per.items()} for opt, per in group_options.items() if opt in optimizers}
    return OptimizerLayout(state, params_lists, params, options)


_ONE_GROUP = ""


def param_groups(layout: OptimizerLayout, items: Mapping[str, StoredBytes]) -> dict[str, dict[str, Hashable]]:
    """Optimizer -> parameter -> its param group, for the optimizers whose groups are known.

    Without `items` (metadata level) only an optimizer with one params list, or
    with no sign of groups at all, is known; the data level reads the params
    lists (nested layout) or each parameter's group options (flat layout, where
    parameters with equal options share a group). A parameter in no list is left
    out (TP-CKPT-015 reports it).
    """
    stateful: dict[str, set[str]] = defaultdict(set)
    for sk in layout.state.values():
        stateful[sk.optimizer].add(sk.param)
    lists: dict[str, list[str]] = defaultdict(list)
    for key, opt in layout.params_lists.items():
        lists[opt].append(key)
    groups: dict[str, dict[str, Hashable]] = {}
    for opt in sorted(layout.optimizers):
        if len(lists[opt]) == 1:
            groups[opt] = dict.fromkeys(stateful[opt], lists[opt][0])
        elif lists[opt]:
            listed = {key: _readable_list(items.get(key)) for key in lists[opt]}
            if all(names is not None for names in listed.values()):
                groups[opt] = {name: key for key, names in sorted(listed.items()) for name in names or ()}
        elif opt in layout.group_options:
            signatures = {p: _options_signature(o, items) for p, o in layout.group_options[opt].items()}
            if all(sig is not None for sig in signatures.values()):
                groups[opt] = dict(signatures)
        else:
            groups[opt] = dict.fromkeys(stateful[opt], _ONE_GROUP)
    return groups


def _readable_list(item: StoredBytes | None) -> list[str] | None:
    value = item.value if item is not None and item.verifiable else None
    if not isinstance(value, list | tuple) or not all(isinstance(v, str | int) for v in value):
        return None
    return [str(v) for v in value]


def _options_signature(options: Mapping[str, str], items: Mapping[str, StoredBytes]) -> Hashable | None:
    """What a parameter's flat group options say, as a hashable value; None if one was not read."""
    values: list[tuple[str, Hashable]] = []
    for option, key in sorted(options.items()):
        item = items.get(key)
        if item is None:
            # A tensor-valued option (an `lr` tensor) is no bytes item: compared by name only.
            if not items:
                return None
            values.append((option, "<tensor>"))
        elif not item.verifiable:
            return None
        else:
            values.append((option, _option_value(item.value)))
    return tuple(values)


_SCALARS = (bool, int, float, str, type(None))


def _option_value(value: object) -> Hashable:
    """A group option (lr, betas, amsgrad) as a hashable value, in time linear in the item.

    Never `repr`: a hostile item of lists that share lists is tiny and prints 2**60 characters.
    """
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, list | tuple) and len(value) <= 16 and all(isinstance(v, _SCALARS) for v in value):
        return tuple(value)
    return f"<{type(value).__name__}>"


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
        expected = _expected_shape(sk.name, param_size)
        if expected is not None and tensor.size != expected:
            shaped = "" if expected == param_size else f" (expected {list(expected)})"
            out.append(
                error(
                    "TP-CKPT-013",
                    key,
                    f"shape {list(tensor.size)} but parameter {param_key} has {list(param_size)}{shaped}",
                )
            )
    return out


def _expected_shape(name: str, param_size: tuple[int, ...]) -> tuple[int, ...] | None:
    """The shape state `name` has for a parameter of `param_size`; None where it is not tied to it."""
    if name in _NOT_PARAM_SHAPED:
        return None
    # Adafactor's factored second moment, kept with keepdim: a column and a row of sums.
    if name == "row_var" and len(param_size) >= 2:
        return (*param_size[:-1], 1)
    if name == "col_var" and len(param_size) >= 2:
        return (*param_size[:-2], 1, param_size[-1])
    return param_size


def state_presence(
    layout: OptimizerLayout, groups: Mapping[str, Mapping[str, Hashable]] | None = None
) -> list[Finding]:
    """TP-CKPT-014: a state entry present for some parameters of a param group is present for all of them.

    Only the optimizers in `groups` (default: those known at metadata level) are checked.
    """
    if groups is None:
        groups = param_groups(layout, {})
    names: dict[tuple[str, Hashable], dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for sk in layout.state.values():
        group = groups.get(sk.optimizer, {})
        if sk.param in group:
            names[(sk.optimizer, group[sk.param])][sk.param].add(sk.name)
    out: list[Finding] = []
    for (opt, _), per_param in sorted(names.items(), key=lambda kv: (kv[0][0], sorted(kv[1]))):
        union = set().union(*per_param.values())
        for param, have in sorted(per_param.items()):
            for missing in sorted(n for n in union - have if not _ALTERNATIVES.get(n, frozenset()) & have):
                out.append(
                    error(
                        "TP-CKPT-014",
                        f"{opt}.state.{param}",
                        f"no {missing!r} although other parameters have it",
                    )
                )
    return out


def mixed_precision(ckpt: Checkpoint, layout: OptimizerLayout) -> list[Finding]:
    """TP-CKPT-018: state tensors of one optimizer in several dtypes (often intended).

    Several dtypes that the parameters themselves have are not reported: torch.optim
    keeps each parameter's state in that parameter's dtype, so a bf16 model with fp32
    norms (Hugging Face's `_keep_in_fp32_modules`) has bf16 and fp32 state by design.
    """
    dtypes: dict[str, Counter[str]] = defaultdict(Counter)
    unlike_param: set[str] = set()  # optimizers with state not in its parameter's (known) dtype
    for key, sk in layout.state.items():
        tensor = ckpt.tensors.get(key)
        if tensor is not None and sk.name != "step":
            dtypes[sk.optimizer][tensor.dtype] += 1
            param = ckpt.tensors.get(layout.params.get(sk.param, ""))
            if param is None or param.dtype != tensor.dtype:
                unlike_param.add(sk.optimizer)
    return [
        warning(
            "TP-CKPT-018",
            opt,
            "state in several dtypes: " + ", ".join(f"{n} {d}" for d, n in sorted(c.items())),
        )
        for opt, c in sorted(dtypes.items())
        if len(c) > 1 and opt in unlike_param
    ]


def params_lists(layout: OptimizerLayout, items: Mapping[str, StoredBytes]) -> list[Finding]:
    """TP-CKPT-015: the params lists name every stateful parameter exactly once."""
    stateful: dict[str, set[str]] = defaultdict(set)
    for sk in layout.state.values():
        stateful[sk.optimizer].add(sk.param)
    listed: dict[str, Counter[str]] = defaultdict(Counter)
    readable: dict[str, bool] = defaultdict(lambda: True)
    for key, opt in layout.params_lists.items():
        names = _readable_list(items.get(key))
        if names is None:
            readable[opt] = False
            continue
        listed[opt].update(names)
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
    groups: Mapping[str, Mapping[str, Hashable]] | None = None,
) -> list[Finding]:
    """TP-CKPT-016: every parameter of one param group took the same number of steps.

    A group added later (`add_param_group`) legitimately has fewer; a parameter whose
    group is unknown is compared with the optimizer's other such parameters. `groups`
    is `param_groups(layout, items)`, when the caller has it already.
    """
    if groups is None:
        groups = param_groups(layout, items)
    # Keyed by the value itself (1 == 1.0 share a key): float() of a hostile 10**400 raises.
    steps: dict[tuple[str, Hashable], dict[int | float, list[str]]] = defaultdict(lambda: defaultdict(list))
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
            group = groups.get(sk.optimizer, {}).get(sk.param, _ONE_GROUP)
            steps[(sk.optimizer, group)][value].append(sk.param)
    out: list[Finding] = []
    for (opt, _), by_value in sorted(steps.items(), key=lambda kv: (kv[0][0], sorted(map(sorted, kv[1].values())))):
        if len(by_value) > 1:
            summary = "; ".join(
                f"{_number(v)} for {len(p)} ({', '.join(sorted(p)[:3])})" for v, p in sorted(by_value.items())
            )
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
