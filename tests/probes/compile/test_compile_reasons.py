"""Classifiers and the log tap, on messages captured from torch 2.13 (no compiling, but for one real recompile)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest

from tests.support import local_agent, series
from torchpulse.probes.compile.logtap import LogTap
from torchpulse.probes.compile.reasons import (
    classify_cudagraph_skip,
    classify_recompile,
    classify_rerecord,
    function_label,
    parse_graph_break,
)

RECOMPILE_REASONS = [
    ("0/0: tensor 'x' size mismatch at index 0. expected 2, actual 3", "tensor_size"),
    ("7/0: tensor 'x' rank mismatch. expected 2, actual 3", "tensor_size"),
    ("1/0: tensor 'x' dtype mismatch. expected Float, actual Double", "dtype"),
    ("1/0: tensor 'x' stride mismatch at index 0. expected 3, actual 1", "stride"),
    ("3/0: tensor 'x' device mismatch. expected cpu, actual cuda:0", "device"),
    ("0/0: tensor 'x' requires_grad mismatch. expected requires_grad=0", "requires_grad"),
    ("5/0: n == 1                                # x*n  # mp/t.py:3 in <lambda>\nUser stack trace:", "python_value"),
    ("2/0: GLOBAL_STATE changed: grad_mode ", "grad_mode"),
    ("4/0: G['o'].v == 1                         # x*o.v  # mp/t.py:27 in <lambda>", "global_or_module_attribute"),
    ("4/0: L['self']._modules['lin'].training == True", "global_or_module_attribute"),
    ("9/0: something torch will invent later", "other"),
    # Dynamic shapes: symbolic size guards (automatic dynamic's 0/1 specialization, mark_dynamic ranges).
    (
        "0/1: 2 <= x.size()[0]  # def f(x): return x*2  # mp/t.py:9 in f (user code shown is first use of this "
        "value--the guard itself is not due user code but due to 0/1 specialization in the framework; to avoid "
        "specialization try torch._dynamo.decorators.mark_unbacked(tensor, dim))",
        "tensor_size",
    ),
    ("0/0: 2 <= x.size()[0] <= 8  # def md(x): return x*2  # mp/t.py:24 in md", "tensor_size"),
    ("0/0: 4 <= x.size()[0]  # if x.shape[0] > 3: return x*2  # mp/t.py:20 in br", "tensor_size"),
    # Global state other than grad mode is not grad mode.
    ("0/0: GLOBAL_STATE changed: autocast(cpu)_enabled ", "other"),
    ("0/0: GLOBAL_STATE changed: deterministic_algorithms ", "other"),
    ("0/0: GLOBAL_STATE changed: grad_mode autocast(cpu)_enabled ", "grad_mode"),
    # Another device fails the dispatch-key check first (captured: cpu -> meta); an inference tensor does not.
    (
        "0/0: tensor 'x' dispatch key set mismatch. expected DispatchKeySet(CPU, BackendSelect, ADInplaceOrView, "
        "AutogradCPU), actual DispatchKeySet(Meta, BackendSelect, ADInplaceOrView, AutogradMeta)",
        "device",
    ),
    (
        "0/0: tensor 'x' dispatch key set mismatch. expected DispatchKeySet(CPU, BackendSelect, ADInplaceOrView, "
        "AutogradCPU), actual DispatchKeySet(CUDA, BackendSelect, ADInplaceOrView, AutogradCUDA)",
        "device",
    ),
    (
        "0/0: tensor 'x' dispatch key set mismatch. expected DispatchKeySet(CPU, BackendSelect, ADInplaceOrView, "
        "AutogradCPU), actual DispatchKeySet(CPU, BackendSelect, ADInplaceOrView)",
        "other",
    ),
    # Attributes of the compiled module itself are module attributes, like those of its submodules.
    (
        "0/0: self.training == True                                    # def forward(self, x): return "
        "torch.nn.functional.dropout(x, self.p, self.training)  # mp/t.py:16 in forward",
        "global_or_module_attribute",
    ),
    (
        "0/0: self.p == 0.5                                            # return F.dropout(x, self.p)  # mp/t.py:54",
        "global_or_module_attribute",
    ),
    (
        "0/0: ___check_type_id(self._modules['act'], 93882633422352), type=<class 'torch.nn.modules.activation.ReLU'>"
        "  # x = self.act(self.lin(x))  # mp/t.py:52 in forward",
        "global_or_module_attribute",
    ),
    (
        "0/0: expected type of 's._modules['lin']._parameters['bias']' to be a tensor type, ' but found <class "
        "'NoneType'>",
        "global_or_module_attribute",
    ),
    # ...but the constant a value is compared with, or the type in a repr, is not an attribute of anything.
    (
        "0/0: d == torch.float64                                       # def dt(x, d): return x.to(d)  # mp/t.py:19",
        "python_value",
    ),
    (
        "0/0: ___check_obj_id(fn, 140362271447680), type=<class 'builtin_function_or_method'>  # def ff(x, fn): "
        "return fn(x)  # mp/t.py:21 in ff",
        "python_value",
    ),
    # Sentences about the cache are no guard.
    (
        "0/0: BACKEND_MATCH failure: torch.compile detected different backend callables. Cached backend: eager. New "
        "backend: eager. If this is unexpected, wrap your backend in functools.partial",
        "other",
    ),
    ("0/0: Cache line invalidated because G['model'] got deallocated", "other"),
]


@pytest.mark.parametrize(("reason", "expected"), RECOMPILE_REASONS)
def test_recompile_reasons_are_classified(reason: str, expected: str) -> None:
    """Each Dynamo guard-failure text maps to its fixed reason class."""
    assert expected == classify_recompile(reason)


def test_graph_break_message_is_split_into_kind_and_location() -> None:
    """Dynamo's context lines ('attempting to trace', 'Skipping the function') give way to its graph-break type."""
    message = (
        "Graph break in user code at /tmp/job/train.py:41\n"
        "Graph Break Reason: Encountered graph break when attempting to trace CALL: a function call:\n\n"
        "Call to `torch._dynamo.graph_break()`\n  Explanation: User-inserted graph break.\n\n"
        "User code traceback:\n  File ..."
    )
    parsed = parse_graph_break(message)
    assert parsed is not None
    assert ("Call to `torch._dynamo.graph_break()`", "/tmp/job/train.py", 41) == parsed[:3]
    skipped = (
        "Graph break in user code at /tmp/job/train.py:10\n"
        "Graph Break Reason: Failed to handle graph break gracefully. Skipping the function and falling back to "
        "eager. Graph break encountered:\n\nCall to `torch._dynamo.graph_break()`\n  Explanation: User-inserted "
        "graph break. Message: None\n\nUser code traceback:\n  File ..."
    )
    assert ("Call to `torch._dynamo.graph_break()`", "/tmp/job/train.py", 10) == parse_graph_break(skipped)[:3]  # type: ignore[index]
    duplicate = (
        "Graph break (user stack suppressed due to duplicate graph break) in user code at "
        "/tmp/a.py:7\nGraph Break Reason: Failed to trace builtin operator\n  Explanation: x"
    )
    assert ("Failed to trace builtin operator", "/tmp/a.py", 7) == parse_graph_break(duplicate)[:3]  # type: ignore[index]


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("skipping cudagraphs due to cpu device (arg0_1). Found from : \n File", "cpu_device"),
        ("skipping cudagraphs due to mutated inputs (2 instances). Found from", "mutated_inputs"),
        (
            "skipping cudagraphs due to multiple devices: device(type='cuda', index=0), device(type='cuda', index=1)",
            "multiple_devices",
        ),
        (
            "skipping cudagraphs due to graph with symbolic shapes inputs and config.triton.cudagraph_skip_dynamic_graphs",  # noqa: E501
            "dynamic_shapes",
        ),
        (
            "skipping cudagraphs due to disabling cudagraphs due to incompatible op aten._local_scalar_dense",
            "incompatible_op",
        ),
        ("skipping cudagraph due to function 0 exceeding max re-recording limit (=50)", "other"),
        # The reason is in the first line; the user's stack trace after it may contain any word.
        (
            "skipping cudagraphs due to disabling cudagraphs due to incompatible op aten.nonzero.default Found from "
            '  File "/src/mutation_utils.py", line 3, in cpu_device_to_symint\n    y = x.nonzero()\n',
            "incompatible_op",
        ),
        (
            'skipping cudagraphs due to mutated inputs (1 instances). Found from : \n   File "/src/m.py", line 9, in f\n'  # noqa: E501
            "    x.add_(1)  # still on the cpu device here\n",
            "mutated_inputs",
        ),
        ("input storage mutation (1 instances). Found from:\n File x.py", "mutated_inputs"),
        (
            "skipping cudagraphs due to index_put_ fallback with boolean indexing is not compatible with CUDA graphs",
            "incompatible_op",
        ),
        ("skipping cudagraphs due to control flow operator: torch.cond. Found from : \n File x.py", "incompatible_op"),
        ("disabling cudagraphs due to override_cudagraphs annotation", "other"),
    ],
)
def test_cudagraph_skip_messages_are_classified(message: str, expected: str) -> None:
    """Skip messages map to the fixed skip reasons."""
    assert expected == classify_cudagraph_skip(message)


def test_rerecord_reasons_are_classified() -> None:
    """CheckInvariantStatus texts map to re-record reasons."""
    assert "static_input_changed" == classify_rerecord("static input data pointer changed.\ninput name: x")
    assert "managed_index_mismatch" == classify_rerecord("cudagraph managed tensor data pointer changed.")
    assert "dead_tensors" == classify_rerecord("expected dead indices before graph are live")
    # Only the first line is the status; input names and stack traces follow.
    assert "managed_index_mismatch" == classify_rerecord(
        "cudagraph managed tensor data pointer changed.\ninput name: static_input_ids. data pointer changed "
        'from 1 to 2. input stack trace: File "m.py", line 4, in forward\n    x = x + buf  # the static input buffer'
    )


def test_function_label_uses_a_short_path() -> None:
    """Function labels are `name (dir/file:line)`."""
    assert "f (job/train.py:12)" == function_label("f", "/home/u/job/train.py", 12)


def _capture(logger: logging.Logger) -> list[str]:
    lines: list[str] = []

    class ListHandler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger.addHandler(ListHandler())
    return lines


def test_log_tap_sees_debug_records_that_nobody_prints() -> None:
    """A tap lowers the level, refuses the records the logger would not have passed, and restores it."""
    parent = logging.getLogger("tp_tap_test")
    parent.setLevel(logging.WARNING)
    printed = _capture(parent)
    child = logging.getLogger("tp_tap_test.child")
    seen: list[str] = []
    tap = LogTap(child.name, logging.DEBUG, lambda r: seen.append(r.getMessage()))
    child.debug("hidden")
    child.warning("shown")
    assert ["hidden", "shown"] == seen
    assert ["shown"] == printed
    parent.setLevel(logging.DEBUG)  # the user turns debug on later: they see it again
    child.debug("now shown")
    assert ["shown", "now shown"] == printed
    tap.remove()
    assert logging.NOTSET == child.level
    assert [] == child.filters


def test_log_tap_adopts_a_level_set_after_it() -> None:
    """When someone else sets the logger's level later, refresh() takes theirs as the baseline."""
    logger = logging.getLogger("tp_tap_test2")
    printed = _capture(logger)
    seen: list[str] = []
    tap = LogTap(logger.name, logging.DEBUG, lambda r: seen.append(r.getMessage()))
    logger.setLevel(logging.ERROR)
    tap.refresh()
    logger.debug("d")
    logger.warning("w")
    logger.error("e")
    assert (["d", "w", "e"], ["e"]) == (seen, printed)
    tap.remove()
    assert logging.ERROR == logger.level


def test_log_tap_adopts_a_level_set_after_it_equal_to_its_own() -> None:
    """A level set later that equals the tap's own (set_logs(graph_breaks=True) sets DEBUG) is theirs: records pass.

    (They were refused: by its value alone the level still looked like the tap's.)
    """
    parent = logging.getLogger("tp_tap_test3")
    parent.setLevel(logging.WARNING)
    printed = _capture(parent)
    child = logging.getLogger("tp_tap_test3.child")
    tap = LogTap(child.name, logging.DEBUG, lambda r: None)
    child.setLevel(logging.NOTSET)  # what set_logs does first...
    child.setLevel(logging.DEBUG)  # ...then it enables the artifact
    child.debug("asked for")
    tap.remove()
    assert (["asked for"], logging.DEBUG) == (printed, child.level)
    assert "setLevel" not in vars(child)


def test_log_tap_follows_a_logging_configuration_that_enables_or_disables_its_logger() -> None:
    """A tapped logger disabled by a configuration is read but silent; enabled again, it prints; the tap's removal
    restores only its own change.
    """
    logger = logging.getLogger("tp_tap_disabled")
    printed: list[str] = []

    class ListHandler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            printed.append(record.getMessage())

    logger.addHandler(ListHandler())
    seen: list[str] = []
    logger.disabled = True  # what dictConfig does to a logger it does not name
    tap = LogTap(logger.name, logging.INFO, lambda r: seen.append(r.getMessage()))
    logger.warning("disabled")
    logger.disabled = False  # a later dictConfig that names it (or disable_existing_loggers=False)
    logger.warning("enabled")
    logger.disabled = True  # disabled again: refresh() at the next compile takes over once more
    tap.refresh()
    logger.warning("disabled again")
    tap.remove()
    assert (["disabled", "enabled", "disabled again"], ["enabled"], True) == (seen, printed, logger.disabled)


# Dynamo reaches into a function argument through its code, closure and defaults: a changed function is a value.
FUNCTION_ARGUMENTS = [
    # f(x, fn) called with another function: its code object differs.
    (
        "2/0: ___check_obj_id(fn.__code__, 139966470836128), type=<class 'code'>  # def f(x, fn): return fn(x) * 2  "
        '# mp/h12/scen.py:53 in f\nUser stack trace:\n  File "/tmp/h12/scen.py", line 53, in f',
        "python_value",
    ),
    # ...with a closure that captured another value.
    (
        "37/0: fn.__closure__[0].cell_contents == 2                     # def inner(x): return x * k  "
        '# mp/h12/scen.py:352 in inner (HINT: guard on "k")\nUser stack trace:',
        "python_value",
    ),
    # ...with a function whose default argument changed.
    (
        "6/0: fn.__defaults__[0] == 2                                  # def g(x, k=2): return x * k  "
        "# mp/h12/scen2.py:89 in g\nUser stack trace:",
        "python_value",
    ),
    # An attribute of the object a method is bound to, or a global function swapped, stays an attribute.
    (
        "7/0: fn.__self__.k == 2                                       # def m(s, x): return x * s.k  "
        "# mp/h12/scen2.py:98 in m\nUser stack trace:",
        "global_or_module_attribute",
    ),
    (
        "3/0: ___check_obj_id(G['GF'].__code__, 139966470836336), type=<class 'code'>  # def f(x): return GF(x) * 2  "
        "# mp/h12/scen.py:63 in f",
        "global_or_module_attribute",
    ),
]


@pytest.mark.parametrize(("reason", "expected"), FUNCTION_ARGUMENTS)
def test_function_argument_internals_are_values_not_attributes(reason: str, expected: str) -> None:
    """Dynamo's own __code__, __closure__, cell_contents and __defaults__ accesses make no attribute guard."""
    assert expected == classify_recompile(reason)


@pytest.mark.parametrize("reason", ["5/0: getattr failed on source o", "0/0: getattr failed on source o.v"])
def test_an_attribute_that_disappeared_is_an_attribute_recompile(reason: str) -> None:
    """A guarded attribute lookup that now raises (hasattr(o, 'v') held before) is an attribute recompile."""
    assert "global_or_module_attribute" == classify_recompile(reason)


# Captured texts the classifier already sorts as a user would expect; pinned so that fixes keep them.
CAPTURED = [
    (
        "0/0: ___check_type_id(act, 94656212493776), type=<class 'torch.nn.modules.activation.ReLU'>  # def f(x, act): "
        "return act(x) + 1  # mp/h12/scen.py:38 in f (HINT: type ReLU)",
        "python_value",
    ),
    (
        "2/0: ___check_type_id(self._modules['act'], 94807219366160), type=<class 'torch.nn.modules.activation.ReLU'>  "
        "# return self.act(self.lin(x)) * self.k  # mp/h12/scen2.py:26 in forward (HINT: type ReLU)",
        "global_or_module_attribute",
    ),
    (
        '4/0: ___dict_contains(\'a\', d)                                 # if "a" in d: return x + d["a"]  '
        "# mp/h12/scen.py:70 in f",
        "python_value",
    ),
    (
        "6/0: len(l) == 3                                              # for v in l: x = x + v  # mp/h12/scen.py:85 in f",  # noqa: E501
        "python_value",
    ),
    (
        "9/0: cfg['a']['b'] == 2                                       # def f(x, cfg): return x * cfg[\"a\"][\"b\"]  "
        "# mp/h12/scen2.py:114 in f",
        "python_value",
    ),
    (
        "57/0: d == device(type='cpu')                                  # def f(x, d): return x.to(d)  "
        "# mp/h12/scen.py:504",
        "python_value",
    ),
    (
        "55/0: ___check_obj_id(e, 139965830801808), type=<class '__main__.enum_value.<locals>.E'>  # def f(x, e): "
        "return x + 1 if e == E.A else x - 1  # mp/h12/scen.py:492 in f",
        "python_value",
    ),
    ("1/0: KeyError on s.k", "global_or_module_attribute"),
    (
        "9/2: tensor 'fn._parameters['weight']' requires_grad mismatch. expected requires_grad=1. Guard failed on a "
        "parameter, consider using torch._dynamo.config.force_parameter_static_shapes = False to allow dynamism on "
        "parameters.",
        "requires_grad",
    ),
    ("13/0: tensor '___from_numpy(a)' dtype mismatch. expected Float, actual Double", "dtype"),
    (
        "22/0: y.size()[0] == x.size()[0]  # duck sizing added this equality because these variables had the same size 3 "  # noqa: E501
        "(to avoid this specialization, set torch.fx.experimental._config.use_duck_shape = False)",
        "tensor_size",
    ),
    (
        "5/0: (x.size()[0] % 2) == 0  # if x.shape[0] % 2 == 0: return x * 2  # mp/h12/scen4.py:40 in f "
        "(_dynamo/variables/tensor.py:2606 in evaluate_expr)",
        "tensor_size",
    ),
    (
        "6/0: 5 <= n  # if n > 4: return x * n  # mp/h12/scen4.py:48 in f (_dynamo/variables/tensor.py:2606 in "
        "evaluate_expr)",
        "python_value",
    ),
    ("13/0: GLOBAL_STATE changed: default_dtype ", "other"),
    ("23/0: GLOBAL_STATE changed: allow_tf32 ", "other"),
    ("14/0: GLOBAL_STATE changed: grad_mode ", "grad_mode"),  # entering torch.inference_mode()
    ("42/0: ___check_torch_function_mode_stack()", "other"),
    ('54/0: Duplicate tensors found: ["x", "y"]', "other"),
    (
        "24/0: tensor 'x' dispatch key set mismatch. expected DispatchKeySet(CPU, BackendSelect, ADInplaceOrView, "
        "AutogradCPU), actual DispatchKeySet(CPU, BackendSelect, FuncTorchDynamicLayerBackMode, ADInplaceOrView, "
        "AutogradCPU, FuncTorchBatched, FuncTorchDynamicLayerFrontMode)",
        "other",
    ),
]


@pytest.mark.parametrize(("reason", "expected"), CAPTURED)
def test_captured_guard_failures_keep_their_class(reason: str, expected: str) -> None:
    """Guard failures captured from real recompiles map to the class a user would look under."""
    assert expected == classify_recompile(reason)


def _scaled_by(k: int) -> Callable[[Any], Any]:
    def scale(x: Any) -> Any:
        return x * k

    return scale


def apply_fn(x: Any, fn: Callable[[Any], Any]) -> Any:
    return fn(x) + 1


def test_a_closure_with_another_captured_value_recompiles_as_a_python_value() -> None:
    """A real recompile: the compiled function is passed a closure over 3 instead of 2 (one compile, one recompile)."""
    import torch

    agent: Any = local_agent(("compile",))
    try:
        compiled = torch.compile(apply_fn, backend="eager", dynamic=False)
        compiled(torch.ones(2), _scaled_by(2))
        compiled(torch.ones(2), _scaled_by(3))
        agent.drain()
        code = apply_fn.__code__
        label = function_label(code.co_name, code.co_filename, code.co_firstlineno)
        assert {(label, "python_value"): 1.0} == series(agent, "recompiles_total", label)
    finally:
        agent.shutdown()
