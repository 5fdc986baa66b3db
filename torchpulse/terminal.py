"""Text that came from outside (agents, checkpoints) made safe to print on a terminal."""

from __future__ import annotations


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
