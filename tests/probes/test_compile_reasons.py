"""Classifiers and the log tap, on messages captured from torch 2.13 (no compiling)."""

from __future__ import annotations

import logging

import pytest

from torchpulse.probes.compile_logtap import LogTap
from torchpulse.probes.compile_reasons import (
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
]


@pytest.mark.parametrize(("reason", "expected"), RECOMPILE_REASONS)
def test_recompile_reasons_are_classified(reason: str, expected: str) -> None:
    """Each Dynamo guard-failure text maps to its fixed reason class."""
    assert expected == classify_recompile(reason)


def test_graph_break_message_is_split_into_kind_and_location() -> None:
    """The generic 'attempting to trace' line is skipped in favour of Dynamo's graph-break type."""
    message = (
        "Graph break in user code at /tmp/job/train.py:41\n"
        "Graph Break Reason: Encountered graph break when attempting to trace CALL: a function call:\n\n"
        "Call to `torch._dynamo.graph_break()`\n  Explanation: User-inserted graph break.\n\n"
        "User code traceback:\n  File ..."
    )
    parsed = parse_graph_break(message)
    assert parsed is not None
    assert ("Call to `torch._dynamo.graph_break()`", "/tmp/job/train.py", 41) == parsed[:3]
    duplicate = ("Graph break (user stack suppressed due to duplicate graph break) in user code at "
                 "/tmp/a.py:7\nGraph Break Reason: Failed to trace builtin operator\n  Explanation: x")
    assert ("Failed to trace builtin operator", "/tmp/a.py", 7) == parse_graph_break(duplicate)[:3]  # type: ignore[index]


@pytest.mark.parametrize(("message", "expected"), [
    ("skipping cudagraphs due to cpu device (arg0_1). Found from : \n File", "cpu_device"),
    ("skipping cudagraphs due to mutated inputs (2 instances). Found from", "mutated_inputs"),
    ("skipping cudagraphs due to multiple devices: device(type='cuda', index=0), device(type='cuda', index=1)",
     "multiple_devices"),
    ("skipping cudagraphs due to graph with symbolic shapes inputs and config.triton.cudagraph_skip_dynamic_graphs",
     "dynamic_shapes"),
    ("skipping cudagraphs due to disabling cudagraphs due to incompatible op aten._local_scalar_dense",
     "incompatible_op"),
    ("skipping cudagraph due to function 0 exceeding max re-recording limit (=50)", "other"),
    # The reason is in the first line; the user's stack trace after it may contain any word.
    ("skipping cudagraphs due to disabling cudagraphs due to incompatible op aten.nonzero.default Found from "
     '  File "/src/mutation_utils.py", line 3, in cpu_device_to_symint\n    y = x.nonzero()\n', "incompatible_op"),
    ('skipping cudagraphs due to mutated inputs (1 instances). Found from : \n   File "/src/m.py", line 9, in f\n'
     "    x.add_(1)  # still on the cpu device here\n", "mutated_inputs"),
    ("input storage mutation (1 instances). Found from:\n File x.py", "mutated_inputs"),
    ("skipping cudagraphs due to index_put_ fallback with boolean indexing is not compatible with CUDA graphs",
     "incompatible_op"),
    ("skipping cudagraphs due to control flow operator: torch.cond. Found from : \n File x.py", "incompatible_op"),
    ("disabling cudagraphs due to override_cudagraphs annotation", "other"),
])
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
        'from 1 to 2. input stack trace: File "m.py", line 4, in forward\n    x = x + buf  # the static input buffer')


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
