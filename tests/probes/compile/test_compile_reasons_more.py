"""More recompile reasons, on guard-failure texts captured from real torch 2.13 recompiles (no compiling)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.support import local_agent
from torchpulse.probes.compile.reasons import classify_recompile, function_label

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
        assert {(label, "python_value"): 1.0} == {
            labels: value
            for (name, labels), value in agent.store._values.items()
            if name == "recompiles_total" and labels[0] == label
        }
    finally:
        agent.shutdown()
