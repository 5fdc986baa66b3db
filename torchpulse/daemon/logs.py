"""structlog set-up for the daemon: JSON under systemd, readable on a terminal."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import Final

import structlog

from torchpulse import bounds
from torchpulse.limits import MAX_EVENT_CHARS, MAX_FIELDS, MAX_NAME_CHARS, MAX_TEXT_CHARS
from torchpulse.protocol import FieldValue
from torchpulse.terminal import printable

# sd-daemon(3) priority prefixes: journald reads "<4>" at the start of a stderr line as the entry's
# priority and strips it, so `journalctl -p warning` finds warnings and MESSAGE stays plain JSON.
JOURNAL_PRIORITIES: Final = {"debug": 7, "info": 6, "warning": 4, "error": 3, "critical": 2}


def configure(log_format: str = "auto", level: str = "info") -> None:
    use_json = log_format == "json" or (log_format == "auto" and not sys.stderr.isatty())
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if use_json else _escaped(structlog.dev.ConsoleRenderer(colors=False))
    )
    if use_json and stderr_is_journal():
        renderer = _with_journal_priority(renderer)
    timestamper = structlog.processors.TimeStamper(fmt="iso", utc=True)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            timestamper,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    _route_stdlib_logging(renderer, timestamper, level)


def _route_stdlib_logging(
    renderer: structlog.typing.Processor, timestamper: structlog.typing.Processor, level: str
) -> None:
    """Render the standard library's records (asyncio's "Unhandled exception in ...", warnings) like ours.

    Left to logging's last-resort handler they are plain text, multi-line tracebacks included, in
    the middle of the JSON lines. The daemon is its own process: its root logger is ours to set.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_log_level, structlog.stdlib.add_logger_name, timestamper],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers = [handler]  # replaced, not added to, at each reload
    root.setLevel(level.upper())
    logging.captureWarnings(True)


def stderr_is_journal() -> bool:
    """Whether stderr is the journal stream systemd connected (JOURNAL_STREAM names its device and inode).

    Compared, not just present: a process the daemon's environment reaches with stderr redirected
    (a test, `torchpulse daemon 2>file` from a unit's shell) writes to something else.
    """
    device, sep, inode = os.environ.get("JOURNAL_STREAM", "").partition(":")
    if not sep or not device.isdigit() or not inode.isdigit():
        return False
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError):
        return False
    return (st.st_dev, st.st_ino) == (int(device), int(inode))


def _with_journal_priority(renderer: structlog.typing.Processor) -> structlog.typing.Processor:
    def render(logger: object, method: str, event_dict: structlog.typing.EventDict) -> str:
        priority = JOURNAL_PRIORITIES.get(str(event_dict.get("level")), 6)
        rendered = renderer(logger, method, event_dict)
        return f"<{priority}>{rendered.decode() if isinstance(rendered, bytes) else rendered}"

    return render


class _Escaped:
    """A text the console renderer shows as its repr: quoted, every non-printable character escaped."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return repr(self.text)


def _escaped(renderer: structlog.typing.Processor) -> structlog.typing.Processor:
    """`renderer` (the console one) shown only printable text: no escape sequence reaches the terminal.

    The console renderer writes the event, the keys, a string value without a space or quote and
    the exception as they are; an agent's event name, field name or value could then clear the
    reader's screen, set the clipboard (OSC 52) or forge a line. A traceback keeps its line breaks.
    """

    def render(logger: object, method: str, event_dict: structlog.typing.EventDict) -> str:
        escaped: structlog.typing.EventDict = {}
        for key, value in event_dict.items():
            if key == "exception" and isinstance(value, str):
                value = "\n".join(printable(line) for line in value.split("\n"))
            elif key == "event" and isinstance(value, str):
                value = printable(value)
            elif isinstance(value, str) and not value.isprintable():
                value = _Escaped(value)
            escaped[printable(str(key))] = value
        rendered = renderer(logger, method, escaped)
        return rendered.decode() if isinstance(rendered, bytes) else str(rendered)

    return render


def cut(text: str, limit: int = MAX_TEXT_CHARS) -> str:
    """`text` cut for the log (`torchpulse.bounds.cut` with the log's default limit)."""
    return bounds.cut(text, limit)


def bounded_fields(fields: Mapping[str, FieldValue], budget: int = MAX_EVENT_CHARS) -> dict[str, FieldValue]:
    """A peer's fields fit for one log line: names and texts cut, at most MAX_FIELDS, `budget` characters."""
    bounded: dict[str, FieldValue] = {}
    left_out = 0
    for key, value in fields.items():
        if len(bounded) >= MAX_FIELDS or budget <= 0:
            left_out += 1
            continue
        name = cut(key, MAX_NAME_CHARS)
        if isinstance(value, str):
            value = cut(value, min(MAX_TEXT_CHARS, budget))
        budget -= len(name) + (len(value) if isinstance(value, str) else 24)
        bounded[name] = value
    if left_out:
        bounded["fields_left_out"] = left_out
    return bounded
