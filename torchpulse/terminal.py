"""Text that came from outside (agents, checkpoints) made safe to print on a terminal."""

from __future__ import annotations

import unicodedata


def printable(text: str) -> str:
    """`text` with every non-printable character escaped (`\\x1b`, `\\u202e`, `\\udcff`).

    Run and host names come from agents; paths, keys and zip member names from
    checkpoints. Raw, an escape sequence would drive the reader's terminal
    (retitle, clear, hide lines), a right-to-left override would reorder the
    line, and a name that is not UTF-8 (a lone surrogate) would make print() raise.
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def columns(text: str) -> int:
    """How many terminal columns `text` takes: two for a wide (CJK, emoji) character, none for a combining one."""
    if text.isascii():
        return len(text)
    return sum(_char_columns(c) for c in text)


def _char_columns(char: str) -> int:
    if unicodedata.combining(char) or unicodedata.category(char) in ("Mn", "Me", "Cf"):
        return 0
    return 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1


def fit(text: str, width: int) -> str:
    """`printable(text)` cut to at most `width` columns and padded with spaces to exactly `width`."""
    text = printable(text)
    used = 0
    for end, char in enumerate(text):
        used += _char_columns(char)
        if used > width:
            used -= _char_columns(char)
            text = text[:end]
            break
    return text + " " * (width - used)
