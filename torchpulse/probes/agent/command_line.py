"""The job's command line as run_info shows it: secrets passed as arguments replaced by `***`.

`run_info{command=}` reaches everyone who can scrape the daemon (often the
whole network, not only local users who could read `ps`), Prometheus's
storage, and the daemon's log. Jobs pass tokens on the command line all the
time (`--hf_token ...`, `--wandb-api-key=...`, Hydra's `logger.api_key=...`,
`https://user:pass@host`), so the agent scrubs them before the command line
leaves the process, as process monitors do (Datadog's agent scrubs the same
words by default).
"""

from __future__ import annotations

import itertools
import re
import shlex
from collections.abc import Sequence
from typing import Final

from torchpulse.limits import SHOWN_COMMAND_CHARS

MASK: Final = "***"
# An option or key is sensitive when one of its words (split at - _ . and case changes) is one
# of these, or two adjacent words make one of the pairs: `--hf-token`, `api_key`, `wandb.apiKey`.
_SENSITIVE_WORDS: Final = frozenset(
    {
        "password",
        "passwd",
        "pwd",
        "passphrase",
        "secret",
        "secrets",
        "token",
        "credential",
        "credentials",
        "apikey",
        "auth",
        "cookie",
    }
)
_SENSITIVE_PAIRS: Final = frozenset(
    {("api", "key"), ("access", "key"), ("private", "key"), ("secret", "key"), ("client", "secret"), ("session", "key")}
)
_WORD: Final = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")
# user:password@ inside a URL (a database or a private package index); the user name stays.
_URL_PASSWORD: Final = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:)[^/\s@]+(?P<at>@)")


def is_sensitive(name: str) -> bool:
    """Whether an option or key name (`--hf_token`, `wandb.api_key`, `DB_PASSWORD`) names a secret."""
    words = [w.lower() for w in _WORD.findall(name)]
    return any(w in _SENSITIVE_WORDS for w in words) or any(p in _SENSITIVE_PAIRS for p in itertools.pairwise(words))


def scrub(argv: Sequence[str]) -> list[str]:
    """`argv` with the values of sensitive options, keys and URL passwords replaced by MASK."""
    scrubbed: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next and not arg.startswith("-"):
            scrubbed.append(MASK)
            hide_next = False
            continue
        hide_next = False
        name, equals, _value = arg.partition("=")
        if equals and is_sensitive(name):
            scrubbed.append(f"{name}={MASK}")  # --token=x, and key=value overrides (Hydra, env-style)
        elif arg.startswith("-") and is_sensitive(arg):
            scrubbed.append(arg)
            hide_next = True  # --token x: the value is the next argument
        else:
            scrubbed.append(_URL_PASSWORD.sub(rf"\g<head>{MASK}\g<at>", arg))
    return scrubbed


def shown_command(argv: Sequence[str]) -> str:
    """The scrubbed, shell-quoted command line, cut to SHOWN_COMMAND_CHARS."""
    return shlex.join(scrub(argv))[:SHOWN_COMMAND_CHARS]
