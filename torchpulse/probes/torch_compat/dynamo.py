"""Dynamo's private surfaces: its loggers and message markers, compilation metrics, compile callbacks,
counters, and keeping Dynamo out of the probes' own hooks.

Verified against torch 2.13, and on 2.10.0, 2.14.1 and 2.15.0 (2.4.1 and 2.8.0 for the notes that name
them); the notes say where behaviour changed.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, ParamSpec, TypeVar

import torch

from torchpulse.probes.torch_compat.features import register

P = ParamSpec("P")
R = TypeVar("R")

# `record_compilation_metrics` ends with `log_compilation_event(metrics)`, which
# logs the CompilationMetrics object at INFO here (record.args[0]).
METRICS_LOGGER: Final = "torch._utils_internal"
# `InstructionTranslatorBase.log_graph_break` logs "Graph break in user code at
# FILE:LINE\nGraph Break Reason: ..." at DEBUG, and only builds the message
# when the logger is enabled for DEBUG.
GRAPH_BREAK_LOGGER: Final = "torch._dynamo.symbolic_convert.__graph_breaks"
# Before that message, `log_graph_break` adds (gb_type, location) to `graph_break_dup_warning_checker`, but
# only when the logger is enabled for DEBUG: a later break at the same place then prints without its user stack
# ("user stack suppressed due to duplicate graph break"). The prefix tells the full message from that one.
GRAPH_BREAK_FULL_PREFIX: Final = "Graph break in user code"
# The job's own import of Dynamo is the signal to finish installing the compile
# and CUDA-graph probes; the agent never imports it first. On torch 2.13 a
# `torch._dynamo` imported before `init_process_group` makes DDP over gloo hang
# at exit now and then (the Reducer drops the last process-group reference with
# the GIL held while a gloo worker waits for it); vanilla jobs import it later.
DYNAMO: Final = "torch._dynamo"
# A limit hit fails the frame with Unsupported ("Dynamo recompile limit exceeded"; older torch: "cache_size_limit
# reached") and the function runs eagerly from then on. Under `fullgraph=True` or `fail_on_recompile_limit_hit`
# it raises one of RECOMPILE_LIMIT_ERRORS into the job instead, whose 2.13 message ("Hard failure due to
# fullgraph=True") names no limit; FailOnCacheLimitHit is the older name of that error. Torch 2.8-2.10 (checked
# on both) fail the frame with RecompileLimitExceeded ("recompile_limit reached") and still carry the last
# recompile reason: read as a reason, a limit hit counted as a `tensor_size` recompile.
RECOMPILE_LIMIT_MARKERS: Final = ("recompile limit exceeded", "cache_size_limit", "recompile_limit")
RECOMPILE_LIMIT_FAIL_TYPES: Final = ("Unsupported",)
RECOMPILE_LIMIT_ERRORS: Final = ("FailOnRecompileLimitHit", "FailOnCacheLimitHit", "RecompileLimitExceeded")
# Trigger names of `torch._dynamo.callback.CallbackTrigger` (2.8+).
TRIGGER_CUDAGRAPH_RECORDING: Final = "CUDAGRAPH_RECORDING"


def _metrics_logged() -> bool:
    import torch._dynamo.config
    import torch._dynamo.utils

    # Both the class and the log call must exist; the flag is checked per use.
    return hasattr(torch._dynamo.utils, "CompilationMetrics") and hasattr(torch._dynamo.utils, "log_compilation_event")


def _metrics_recompile_reasons() -> bool:
    # CompilationMetrics gained `recompile_reason` and `is_forward` (lazy backward compiles) in
    # ~2.6; before, a record says neither why its frame recompiled nor which graph it was.
    from torch._dynamo.utils import CompilationMetrics

    fields = getattr(CompilationMetrics, "__dataclass_fields__", {})
    return "recompile_reason" in fields and "is_forward" in fields


def _callback_handler() -> bool:
    from torch._dynamo.callback import callback_handler as handler

    return callable(getattr(handler, "register_start_callback", None)) and callable(
        getattr(handler, "remove_start_callback", None)
    )


def _callback_args() -> bool:
    # Before ~2.8 callbacks took no arguments; from then on CallbackArgs.
    from torch._dynamo.callback import CallbackArgs, CallbackTrigger

    return (
        hasattr(CallbackTrigger, TRIGGER_CUDAGRAPH_RECORDING)
        and "compile_id" in inspect.signature(CallbackArgs).parameters
    )


def _counters() -> bool:
    from torch._dynamo.utils import counters

    return isinstance(counters, dict)


def _static_address_type() -> bool:
    from torch._dynamo.utils import get_static_address_type

    return callable(get_static_address_type)


# Files whose frames `disable_tracing` puts between a hook's caller and the hook.
_TORCH_DIR = Path(torch.__file__).resolve().parent
TRACING_WRAPPER_PATHS: Final = (str(_TORCH_DIR / "_dynamo"), str(_TORCH_DIR / "_compile.py"))


def disable_tracing(fn: Callable[P, R]) -> Callable[P, R]:
    """Keep Dynamo out of `fn` (a hook): a graph break and an eager call, never baked in.

    `torch._disable_dynamo` imports Dynamo at the first call instead of now,
    so wrapping a hook at attach does not import it (see `DYNAMO`).
    """
    lazy = getattr(torch, "_disable_dynamo", None)
    if callable(lazy) and DYNAMO not in sys.modules:  # once loaded, skip the lazy layer's extra call
        function = fn
        if not isinstance(fn, types.FunctionType):
            # It caches the disabled version on the function: a bound method takes no attributes.
            method = fn

            @functools.wraps(method)
            def plain(*args: P.args, **kwargs: P.kwargs) -> R:
                return method(*args, **kwargs)

            function = plain
        return lazy(function)  # type: ignore[no-any-return]
    return torch.compiler.disable(fn)  # type: ignore[no-untyped-call,no-any-return,unused-ignore]


def skip_tracing(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Keep Dynamo from tracing `fn` without an eager-mode wrapper; else fall back to disable()."""
    try:
        from torch._dynamo.decorators import skip
    except ImportError:
        return torch.compiler.disable(fn)  # type: ignore[no-untyped-call,no-any-return,unused-ignore]
    return skip(fn)


def metrics_logging_enabled() -> bool:
    """False when `torch._dynamo.config.log_compilation_metrics` is off (no records reach us)."""
    import torch._dynamo.config

    return bool(getattr(torch._dynamo.config, "log_compilation_metrics", True))


def compilation_metrics_of(args: object) -> Any | None:
    """The CompilationMetrics object of a `torch._utils_internal` log record, if it is one."""
    from torch._dynamo.utils import CompilationMetrics

    if isinstance(args, tuple) and len(args) == 1 and isinstance(args[0], CompilationMetrics):
        return args[0]
    return None


def dynamo_frame_callback_getter() -> Callable[[], object]:
    """Dynamo's frame callback on this thread (None outside compiled code); where torch has no
    such accessor, a stand-in that always answers "maybe inside" (the caller then stays safe)."""
    eval_frame = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    getter = getattr(eval_frame, "get_eval_frame_callback", None)
    return getter if callable(getter) else object


def forget_graph_break_dedup() -> None:
    """Undo the duplicate-checker entry `log_graph_break` added just before its full message.

    Called from inside that logging call when only a tap enabled the logger: without the tap
    Dynamo would not have added it, and a graph-break log the job turns on later would print
    this break's user stack. The entry is the checker's newest (compiles are serialised);
    under `config.verbose` the checker re-logs duplicates in full anyway, and its `add` may
    only have moved an older entry, which must stay.
    """
    import torch._dynamo.config
    from torch._dynamo.utils import graph_break_dup_warning_checker as checker

    entries = getattr(checker, "set", None)
    if not torch._dynamo.config.verbose and isinstance(entries, OrderedDict) and entries:
        entries.popitem(last=True)


def compilation_metrics_history() -> list[Any]:
    """The last CompilationMetrics Dynamo keeps (a bounded deque): what was compiled before a probe attached."""
    utils = sys.modules.get("torch._dynamo.utils")  # not imported: nothing was compiled, and attach stays light
    history = getattr(utils, "get_compilation_metrics", None)
    return list(history()) if callable(history) else []


def callback_handler() -> Any:
    # The same object as `torch._dynamo.callback_handler`; reset() clears its lists, never replaces it.
    from torch._dynamo.callback import callback_handler as handler

    return handler


def callback_trigger_name(args: object) -> str | None:
    """The trigger name of a compile callback's argument (None before CallbackArgs existed)."""
    trigger = getattr(args, "callback_trigger", None)
    return getattr(trigger, "name", None)


def dynamo_counter(group: str, key: str) -> int:
    """A value of `torch._dynamo.utils.counters` without creating missing keys."""
    from torch._dynamo.utils import counters

    section = counters.get(group)
    return int(section.get(key, 0)) if section is not None else 0


register("compilation_metrics_log", _metrics_logged)
register("compilation_metrics_recompile_reason", _metrics_recompile_reasons)
register("compile_callbacks", _callback_handler)
register("compile_callback_args", _callback_args)
register("dynamo_counters", _counters)
register("static_address_type", _static_address_type)
