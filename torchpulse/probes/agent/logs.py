"""Logging inside the training process.

The agent never configures logging globally: structlog renders our events
into plain stdlib records on the ``torchpulse`` logger, so the user's logging
setup decides where they go, and an unconfigured process shows warnings only.
"""

from __future__ import annotations

import logging

import structlog

_renderer = structlog.processors.KeyValueRenderer(key_order=["event"], drop_missing=True)


def _render(_logger: object, _method: str, event_dict: structlog.typing.EventDict) -> str:
    event = str(event_dict.pop("event", ""))
    rest = _renderer(_logger, _method, event_dict) if event_dict else ""
    return f"torchpulse: {event}" + (f" ({rest})" if rest else "")


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    """A structlog logger that writes through the stdlib logger `name`."""
    logger: structlog.stdlib.BoundLogger = structlog.wrap_logger(
        logging.getLogger(name),
        processors=[_render],
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    return logger
