"""Turn torch's free-form compile and CUDA-graph messages into bounded label values.

Pure functions over strings, tested on messages captured from torch 2.13.
Each classifier returns one value of a fixed tuple; anything unrecognised is
`other`, and the full text goes to the structured log instead.
"""

from __future__ import annotations

import re
from pathlib import PurePath
from typing import Final, NamedTuple

RECOMPILE_REASONS: Final = (
    "tensor_size",
    "dtype",
    "stride",
    "device",
    "requires_grad",
    "python_value",
    "global_or_module_attribute",
    "grad_mode",
    "other",
)
CUDAGRAPH_SKIP_REASONS: Final = (
    "cpu_device",
    "mutated_inputs",
    "multiple_devices",
    "dynamic_shapes",
    "incompatible_op",
    "non_tensor_inputs",
    "other",
)
RERECORD_REASONS: Final = (
    "static_input_changed",
    "managed_index_mismatch",
    "dead_tensors",
    "new_dynamic_shape",
    "other",
)

# "0/1: tensor 'x' size mismatch at index 0. expected 2, actual 3"
_COMPILE_ID_PREFIX: Final = re.compile(r"^\s*\[?\d+/\d+\]?:\s*")
_TENSOR_CHECKS: Final = (
    (re.compile(r"\b(size|rank|dim(ension)?s?) mismatch"), "tensor_size"),
    (re.compile(r"\bdtype mismatch"), "dtype"),
    (re.compile(r"\bstride mismatch"), "stride"),
    (re.compile(r"\bdevice mismatch|\bdevice index mismatch"), "device"),
    (re.compile(r"\brequires_grad mismatch"), "requires_grad"),
)
# A tensor moved to another device fails its dispatch-key check first:
# "dispatch key set mismatch. expected DispatchKeySet(CPU, ...), actual DispatchKeySet(CUDA, ...)".
# The first key names the backend; an inference or sparse tensor on the same device differs only later.
_DISPATCH_KEYS: Final = re.compile(
    r"dispatch key set mismatch\. expected DispatchKeySet\((\w+).*?actual DispatchKeySet\((\w+)"
)
_LAYOUT_PREFIX: Final = re.compile(r"^(SparseCsr|Sparse|Quantized|NestedTensor)")
# Dynamic shapes guard sizes and strides symbolically: "2 <= x.size()[0]", "2 <= x.size()[0] <= 8".
_SYMBOLIC_CHECKS: Final = (
    (re.compile(r"\.size\(\)|\.numel\(\)"), "tensor_size"),
    (re.compile(r"\.stride\(\)"), "stride"),
)
# "GLOBAL_STATE changed: grad_mode autocast(cpu)_enabled " lists every global flag that changed; only
# grad mode has a class of its own (autocast, deterministic algorithms, default dtype are `other`).
_GLOBAL_STATE: Final = "GLOBAL_STATE changed:"
# Reasons that are sentences about the cache, not a failed guard expression.
_NOT_GUARDS: Final = (
    "BACKEND_MATCH failure",
    "Unexpected recompilation",
    "Duplicate tensors found",
    "Unable to find recompilation reasons",
    "Cache line invalidated",
)
_VALUE: Final = re.compile(
    r"==|!=|<=|>=|<|>|\bis\b|___check_obj_id|___check_type_id|___dict_contains|isinstance\(|hasattr\(|len\("
)
# A tensor that became something else: "expected type of 'self._modules['lin']._parameters['bias']' to be a
# tensor type, ' but found <class 'NoneType'>". The quoted source decides between attribute and value.
_NOT_A_TENSOR: Final = re.compile(r"^expected type of '(.*)' to be a tensor type")
# Quoted keys and reprs ("type=<class 'torch.nn.ReLU'>") hold dots that are no attribute access.
_LITERALS: Final = re.compile(r"'[^']*'|\"[^\"]*\"|<[A-Za-z][^<>]*>")
_OPERATORS: Final = re.compile(r"==|!=|<=|>=|<|>|\bis not\b|\bis\b|\bnot in\b|\bin\b")
# The expected side of a comparison: a number, None/True/False, or a torch constant (torch.float64).
_CONSTANT: Final = re.compile(r"^(-?[\d.]|None$|True$|False$|torch\.)")
# A global (G['name']) or an attribute of an object: self.training, self._modules['lin'].training, c.__dict__.
_ATTRIBUTE: Final = re.compile(r"\bG\[|[\w\])]\.[A-Za-z_]")
# How Dynamo reaches into a function or bound method it was passed: its code, closure cells, defaults,
# and the object a method is bound to ("fn.__closure__[0].cell_contents == 2", "fn.__defaults__[0] == 2",
# "___check_obj_id(fn.__code__, ...)"). These are no attributes of the user's: a function argument that
# changed is a value; an attribute after them ("fn.__self__.k") or a global before them stays an attribute.
_FUNCTION_PARTS: Final = re.compile(
    r"\.(__code__|__closure__|cell_contents|__defaults__|__kwdefaults__|__func__|__self__)\b"
)
# An attribute lookup that raised: "getattr failed on source o" (hasattr(o, "v") held, o.v is gone now).
_GETATTR_FAILED: Final = "getattr failed on source"


def reason_text(reason: str) -> str:
    """The first line of a recompile reason, without the `frame/compile` id prefix."""
    first = reason.strip().split("\n", 1)[0]
    return _COMPILE_ID_PREFIX.sub("", first, count=1).strip()


def classify_recompile(reason: str) -> str:
    """Map Dynamo's first failed guard to one of `RECOMPILE_REASONS`."""
    text = reason_text(reason)
    if text.startswith("tensor "):
        return _tensor_check(text)
    if text.startswith(_GLOBAL_STATE):
        return "grad_mode" if "grad_mode" in text[len(_GLOBAL_STATE) :].split() else "other"
    if text.startswith(_NOT_GUARDS):
        return "other"
    if text.startswith(_GETATTR_FAILED):
        return "global_or_module_attribute"
    not_a_tensor = _NOT_A_TENSOR.match(text)
    if not_a_tensor is not None:
        return "global_or_module_attribute" if _is_attribute_guard(not_a_tensor[1]) else "python_value"
    # Torch appends the user's source line as "  # " comment ("n == 1   # x*n  # f.py:3").
    expression = text.split("  # ", 1)[0].strip()
    for pattern, label in _SYMBOLIC_CHECKS:
        if pattern.search(expression):
            return label
    if _is_attribute_guard(expression):
        return "global_or_module_attribute"
    if _VALUE.search(expression):
        return "python_value"
    for pattern, label in _TENSOR_CHECKS:  # tensor checks phrased differently
        if pattern.search(text):
            return label
    return "other"


def _tensor_check(text: str) -> str:
    keys = _DISPATCH_KEYS.search(text)
    if keys is not None:
        expected, actual = (_LAYOUT_PREFIX.sub("", key) for key in keys.groups())
        return "device" if expected != actual else "other"
    for pattern, label in _TENSOR_CHECKS:
        if pattern.search(text):
            return label
    return "other"


def _is_attribute_guard(expression: str) -> bool:
    """Whether a guarded source (not the constant it is compared with) is a global or an attribute."""
    source = _FUNCTION_PARTS.sub("", _LITERALS.sub("", expression))
    operands = (operand.strip() for operand in _OPERATORS.split(source))
    return any(_ATTRIBUTE.search(operand) for operand in operands if operand and not _CONSTANT.match(operand))


def is_recompile_limit(
    fail_type: str | None,
    fail_reason: str | None,
    markers: tuple[str, ...],
    fail_types: tuple[str, ...],
    errors: tuple[str, ...],
) -> bool:
    """Whether a failed frame hit the recompile limit: one of the limit's own `errors`, or a marker in its message."""
    if fail_type in errors:
        return True
    if not fail_type or not fail_reason or fail_type not in fail_types:
        return False
    head = fail_reason.split("\n", 1)[0].lower()
    return any(marker.lower() in head for marker in markers)


def short_path(filename: str) -> str:
    """The last two path components: enough to find a file, short enough for a legend."""
    parts = PurePath(filename).parts
    return "/".join(parts[-2:]) if len(parts) > 1 else filename


def function_label(name: str | None, filename: str | None, line: int | None) -> str:
    """`name (file:line)`, the function label of recompile series."""
    return f"{name or '?'} ({short_path(filename or '?')}:{line if line is not None else '?'})"


class GraphBreak(NamedTuple):
    kind: str
    filename: str
    line: int
    reason: str


_GRAPH_BREAK: Final = re.compile(
    r"in user code at (?P<file>.+?):(?P<line>\d+)\s*\nGraph Break Reason: (?P<reason>.*)", re.DOTALL
)
# Dynamo wraps the graph-break text in a context line ("Encountered graph break when attempting to trace
# CALL: ...:", "Failed to handle graph break gracefully. Skipping the function and falling back to eager.
# Graph break encountered:", "Encountered graph break that we cannot resume from. ...") and a blank line.
_WRAPPER: Final = re.compile(r"^(Encountered|Failed to handle) .*graph break.*:$")


def parse_graph_break(message: str) -> GraphBreak | None:
    """Split a `graph_breaks` log message into kind (Dynamo's gb_type line), file, line, reason."""
    match = _GRAPH_BREAK.search(message)
    if match is None:
        return None
    reason = match["reason"].split("\n\nUser code traceback:", 1)[0].strip()
    lines = [line.strip() for line in reason.split("\n") if line.strip()]
    kind = lines[0] if lines else "unknown"
    # The real graph-break type (the key of counters["graph_break"]) is the line after a wrapper.
    if _WRAPPER.match(kind) and len(lines) > 1:
        kind = lines[1]
    return GraphBreak(kind, match["file"], int(match["line"]), reason)


def _status_line(message: str) -> str:
    """The reason part of a CUDA-graph message, lower-cased: the user's stack trace after it
    ("Found from", "input stack trace") may contain any word."""
    text = message.split("\n", 1)[0].lower()
    return text.split("found from", 1)[0]


def classify_cudagraph_skip(message: str) -> str:
    """Map a CUDA-graph skip message (`log_cudagraph_skip_and_bump_counter`) to one of `CUDAGRAPH_SKIP_REASONS`."""
    text = _status_line(message)
    if "cpu device" in text:
        return "cpu_device"
    if "mutated inputs" in text or "mutation" in text:
        return "mutated_inputs"
    if "multiple devices" in text:
        return "multiple_devices"
    if any(word in text for word in ("dynamic shape", "dynamic_shape", "symbolic shape", "symint", "unbacked")):
        return "dynamic_shapes"
    if "non-tensor" in text or "non tensor" in text or "non_tensor" in text:
        return "non_tensor_inputs"
    # Lowering reasons torch 2.13 gives: an op, index_put_ with boolean indices, torch.cond/while_loop.
    if any(
        words in text
        for words in (
            "incompatible op",
            "unsupported op",
            "cudagraph-unsafe",
            "not compatible with cuda graphs",
            "control flow operator",
        )
    ):
        return "incompatible_op"
    return "other"


def classify_rerecord(reason: str) -> str:
    """Map a tree manager re-record reason (CheckInvariantStatus text) to `RERECORD_REASONS`."""
    text = _status_line(reason)
    if "static input" in text:
        return "static_input_changed"
    if "managed" in text:
        return "managed_index_mismatch"
    if "dead" in text:
        return "dead_tensors"
    return "other"
