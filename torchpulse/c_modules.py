"""The package's optional C modules, each built at install time where a compiler is.

Every caller keeps a Python path that gives the same answers, so a module that
was not built (no compiler or no Python headers) only makes that caller slower.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def optional_module(name: str) -> ModuleType | None:
    """A C module of this package, or None where it was not built (no compiler at install time)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
