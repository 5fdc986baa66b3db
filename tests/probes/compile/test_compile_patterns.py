"""The compile probe under torch.compile usage patterns: dynamic shapes, modules, graph breaks, failures, logging."""

from __future__ import annotations

import dataclasses
import inspect
import io
import json
import logging
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
import torch._dynamo.utils
from torch._dynamo.utils import counters
from torch._logging._internal import set_logs

from tests.support import REPO, local_agent, series
from torchpulse.probes.compile.probe import Compilation
from torchpulse.probes.compile.reasons import function_label
from torchpulse.probes.torch_compat import dynamo as dynamo_compat

HERE = __file__
# A C-level file: pytest's captured sys.stdout has a Python `write` that Dynamo would count as frames of its own.
PRINTED = io.StringIO()
# Two model files that define the same class and method names (line numbers equal too).
MODEL_SOURCE = """
import torch

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(x).relu()
"""


def _label(fn: Any) -> str:
    code = fn.__code__
    return function_label(code.co_name, code.co_filename, code.co_firstlineno)


def _marked_line(marker: str) -> int:
    with open(HERE) as source:
        return next(i for i, line in enumerate(source, 1) if line.rstrip().endswith(f"# {marker}"))


def _first_lines(group: str, before: dict[str, int]) -> Counter[str]:
    now: Counter[str] = Counter()
    for key, value in counters.get(group, {}).items():
        now[key.split("\n", 1)[0]] += value - before.get(key, 0)
    return +now


def automatic_fn(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def marked_fn(x: torch.Tensor) -> torch.Tensor:
    return x - 1


def print_fn(x: torch.Tensor) -> torch.Tensor:
    x = x + 1
    print("print_fn", file=PRINTED)  # PRINT-LINE
    return x * 2


def item_fn(x: torch.Tensor) -> torch.Tensor:
    x = x + 1
    scale = x.sum().item()  # ITEM-LINE
    return x * scale


def branch_fn(x: torch.Tensor) -> torch.Tensor:
    x = x + 1
    if x.sum() > 0:  # BRANCH-LINE
        return x * 2
    return x * 3


@torch.compiler.disable  # type: ignore[untyped-decorator,unused-ignore]
def _eager_only(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def disable_fn(x: torch.Tensor) -> torch.Tensor:
    x = x + 1
    x = _eager_only(x)  # DISABLE-LINE
    return x - 1


class Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.k = 2

    @torch.compile(backend="eager")  # type: ignore[misc,untyped-decorator,unused-ignore]
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.k


@dataclasses.dataclass
class Patterns:
    agent: Any
    model_files: list[Path]
    graph_breaks: Counter[str]  # first lines of torch's graph_break and unimplemented keys
    frames: Counter[str]


@pytest.fixture(scope="module")
def patterns(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Patterns]:
    """One agent sees the module's compiles: eager backend, tiny graphs, each compiled once."""
    import importlib.util

    agent: Any = local_agent(("compile",))
    before = {group: dict(counters.get(group, {})) for group in ("frames", "graph_break", "unimplemented")}
    compiled = torch.compile(automatic_fn, backend="eager")
    for n in (2, 3, 4, 5):  # 2 -> 3 recompiles once to a dynamic graph, then never again
        compiled(torch.randn(n))
    compiled = torch.compile(marked_fn, backend="eager")
    x = torch.randn(3)
    torch._dynamo.mark_dynamic(x, 0)
    compiled(x)
    compiled(torch.randn(5))  # within the marked range: no recompile
    compiled(torch.randn(5, 2))  # another rank
    model_files = []
    for name in ("team_a", "team_b"):
        path = tmp_path_factory.mktemp(name) / "model.py"
        path.write_text(MODEL_SOURCE)
        spec = importlib.util.spec_from_file_location(f"tp_patterns_{name}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        model = module.Net()
        model.compile(backend="eager")  # in place
        model(torch.randn(2, 3))
        with torch.no_grad():  # a grad-mode recompile (a size change may already be dynamic for the second)
            model(torch.randn(2, 3))
        model_files.append(path)
    scaled = Scaled()
    scaled(torch.randn(2))
    scaled.k = 3
    scaled(torch.randn(2))
    for fn in (print_fn, item_fn, branch_fn, disable_fn):
        torch.compile(fn, backend="eager")(torch.ones(3))
    agent.drain()
    graph_breaks = _first_lines("graph_break", before["graph_break"]) + _first_lines(
        "unimplemented", before["unimplemented"]
    )
    yield Patterns(agent, model_files, graph_breaks, _first_lines("frames", before["frames"]))
    agent.shutdown()


def test_automatic_and_marked_dynamic_shapes_recompile_once_with_the_size_reason(patterns: Patterns) -> None:
    """Automatic dynamic recompiles once (size), a marked dimension never, another rank once (size)."""
    assert {(_label(automatic_fn), "tensor_size"): 1.0, (_label(marked_fn), "tensor_size"): 1.0} == {
        labels: value
        for labels, value in series(patterns.agent, "recompiles_total").items()
        if labels[0] in (_label(automatic_fn), _label(marked_fn))
    }


def test_same_method_name_in_two_files_gets_two_labels(patterns: Patterns) -> None:
    """model.compile() of two models whose forward has the same name and line: labels differ by file."""
    expected = {(f"forward ({path.parent.name}/model.py:9)", "grad_mode"): 1.0 for path in patterns.model_files}
    recompiles = series(patterns.agent, "recompiles_total")
    assert expected == {labels: value for labels, value in recompiles.items() if labels[0].endswith("model.py:9)")}


def test_compiled_method_attribute_change_is_a_module_attribute_recompile(patterns: Patterns) -> None:
    """@torch.compile on forward: a changed self.k recompiles under forward (this file:line)."""
    label = _label(inspect.unwrap(Scaled.forward))
    assert label.startswith("forward (compile/test_compile_patterns.py:")
    assert {(label, "global_or_module_attribute"): 1.0} == {
        labels: value for labels, value in series(patterns.agent, "recompiles_total").items() if labels[0] == label
    }


def test_graph_breaks_have_dynamo_kind_and_user_line(patterns: Patterns) -> None:
    """print, .item(), data-dependent branching, a compiler.disable call: one break each, kind and line right."""
    where = "compile/test_compile_patterns.py"
    expected = {
        ("Failed to trace builtin operator", f"{where}:{_marked_line('PRINT-LINE')}"): 1.0,
        (
            "Unsupported Tensor.item() call with capture_scalar_outputs=False",
            f"{where}:{_marked_line('ITEM-LINE')}",
        ): 1.0,
        ("Data-dependent branching", f"{where}:{_marked_line('BRANCH-LINE')}"): 1.0,
        ("Skip calling `torch.compiler.disable()`d function", f"{where}:{_marked_line('DISABLE-LINE')}"): 1.0,
    }
    assert expected == series(patterns.agent, "graph_breaks_total")
    assert Counter({kind: int(value) for (kind, _), value in expected.items()}) == patterns.graph_breaks


def test_frames_match_torch_counters(patterns: Patterns) -> None:
    """Every frame of the patterns compiled, as Dynamo counted them."""
    assert {("ok",): float(patterns.frames["ok"]), ("failed",): 0.0} == series(patterns.agent, "compile_frames_total")
    assert patterns.frames["ok"] == patterns.frames["total"]


def graph_break_fn(x: torch.Tensor) -> torch.Tensor:
    x = x.sin()
    torch._dynamo.graph_break()
    return x.cos()


def test_graph_break_log_turned_on_later_prints_the_full_break(patterns: Patterns) -> None:
    """A break seen while graph-break logging is off is printed in full when it recurs after the job turns it on.

    (It printed "user stack suppressed due to duplicate graph break": Dynamo had deduplicated a message that only
    the probe's tap asked for.)
    """
    agent: Any = local_agent(("compile",))
    printed: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            printed.append(record.getMessage())

    logger = logging.getLogger(dynamo_compat.GRAPH_BREAK_LOGGER)
    capture = Capture()
    try:
        compiled = torch.compile(graph_break_fn, backend="eager", dynamic=False)
        compiled(torch.randn(2))
        set_logs(graph_breaks=True)
        logger.addHandler(capture)
        compiled(torch.randn(2, 2))  # a recompile, which breaks at the same line again
    finally:
        logger.removeHandler(capture)
        set_logs()
        agent.drain()
        agent.shutdown()
    assert 1 == len(printed)
    assert printed[0].startswith("Graph break in user code at "), printed[0][:120]
    assert 2.0 == sum(series(agent, "graph_breaks_total").values())


def _compilation(
    compile_id: str,
    name: str | None,
    line: int | None,
    recompile_reason: str | None = None,
    fail_type: str | None = None,
    fail_reason: str | None = None,
) -> Compilation:
    return Compilation(
        compile_id,
        name,
        None if name is None else "/job/train.py",
        line,
        True,
        recompile_reason,
        fail_type,
        fail_reason,
        None,
        None,
        None,
        None,
    )


def test_limit_hit_under_compiled_autograd_names_its_own_frame() -> None:
    """Compile ids of frames compiled during a compiled-autograd backward ("!0/7/2") name the frame after the "!0".

    (The "!0" was taken for the frame: the limit hit of frame 7 was labelled with frame 6, the backward graph
    compiled before it under the same compiled-autograd id.)
    """
    agent: Any = local_agent(("compile",))
    try:
        probe = agent.probes["compile"]
        limit = "Dynamo recompile limit exceeded\n  Explanation: Dynamo attempted to recompile the code object"
        for c in (
            _compilation("7/0", "hook_fn", 3),  # compiled in the forward
            _compilation("!0/7/1", "hook_fn", 3, "7/0: tensor 'x' size mismatch at index 0. expected 2, actual 3"),
            _compilation("!0/6/0", "forward", 1),  # compiled autograd's backward graph
            _compilation(
                "!0/7/2",
                None,
                None,
                "7/1: tensor 'x' size mismatch at index 0. expected 3, actual 4",
                "Unsupported",
                limit,
            ),
        ):
            probe._on_compilation(c)
    finally:
        agent.shutdown()
    assert {("hook_fn (job/train.py:3)",): 1.0} == series(agent, "recompile_limit_hits_total")
    assert {("hook_fn (job/train.py:3)", "tensor_size"): 1.0} == series(agent, "recompiles_total")


def test_a_compiled_optimizer_step_keeps_its_math_compiled_and_is_timed() -> None:
    """`torch.compile(opt.step)`: the agent's step hooks are torch.compiler.disable'd, so Dynamo runs torch's
    step wrapper eagerly (the README says so); the optimizer's own step must still compile, every step be
    counted and timed, and the parameters move exactly as without the agent."""
    torch.manual_seed(0)
    reference, probed = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    probed.load_state_dict(reference.state_dict())
    batches = [torch.randn(2, 3) for _ in range(3)]

    def train(model: torch.nn.Module, compiled: bool) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        step = torch.compile(opt.step, backend="eager") if compiled else opt.step
        for batch in batches:
            model(batch).sum().backward()  # type: ignore[no-untyped-call]
            step()
            opt.zero_grad()

    train(reference, compiled=False)
    earlier = {id(m) for m in dynamo_compat.compilation_metrics_history()}
    agent = local_agent(("optimizer", "compile"))
    try:
        train(probed, compiled=True)
        agent.drain()
        names = {
            (m.co_name, m.fail_type is None)
            for m in dynamo_compat.compilation_metrics_history()
            if id(m) not in earlier
        }
        steps = series(agent, "optimizer_steps_total")
    finally:
        agent.shutdown()
    assert ("step", True) in names  # SGD.step itself compiled
    assert [3.0] == list(steps.values())
    for want, got in zip(reference.parameters(), probed.parameters(), strict=True):
        torch.testing.assert_close(got, want)


# The job configures logging the way `dictConfig` does by default (disable_existing_loggers=True) after it has
# imported torch and Dynamo: every torch logger that exists is disabled, also those the probe reads.
DICT_CONFIG_JOB = r"""
import io, json, logging.config
import torch, torch._dynamo
from torch._dynamo.utils import counters
from tests.support import local_agent
from torchpulse.probes.torch_compat import dynamo as dynamo_compat
agent = local_agent(("compile",))
printed = io.StringIO()
logging.config.dictConfig({"version": 1, "handlers": {"out": {"class": "logging.StreamHandler", "stream": printed}},
                           "root": {"handlers": ["out"], "level": "DEBUG"}})

def f(x):
    x = x + 1
    torch._dynamo.graph_break()
    return x * 2

compiled = torch.compile(f, backend="eager", dynamic=False)
compiled(torch.randn(3))
compiled(torch.randn(4))  # f and its resume function recompile
agent.drain()
samples, _ = agent.store.snapshot()
series = {name: sum(s.value for s in samples if s.family == name)
          for name in ("compile_frames_total", "recompiles_total", "graph_breaks_total")}
agent.shutdown()
taps = (dynamo_compat.METRICS_LOGGER, dynamo_compat.GRAPH_BREAK_LOGGER)
disabled = [logging.getLogger(name).disabled for name in taps]
print(json.dumps({"probe": series, "torch": [counters["frames"]["ok"], sum(counters["graph_break"].values())],
                  "printed": printed.getvalue(), "disabled": disabled}))
"""


@pytest.mark.process
def test_loggers_disabled_by_dict_config_still_feed_the_probe_and_stay_silent() -> None:
    """A job's dictConfig disables torch's loggers: compiles are still counted, nothing is printed, the flag comes back.

    (The probe saw nothing: a disabled logger drops records before its filters, and no metric moved.)
    """
    out = subprocess.run([sys.executable, "-c", DICT_CONFIG_JOB], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert 0 == out.returncode, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert {
        "probe": {"compile_frames_total": 4.0, "recompiles_total": 2.0, "graph_breaks_total": 2.0},
        "torch": [4, 2],
        "printed": "",
        "disabled": [True, True],
    } == result
