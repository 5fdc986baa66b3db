"""`pip install` builds the daemon's optional C modules where it can; without them only the fallbacks would ever run."""

from __future__ import annotations

import shutil
import sysconfig

import pytest

from torchpulse.checkpoints import metaparse
from torchpulse.checkpoints.rules import kernels


def test_the_c_modules_are_built_where_a_compiler_is() -> None:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler ({cc}): the Python paths run")
    assert metaparse._metaparse is not None  # the .metadata reader
    assert kernels._kernels is not None  # the per-chunk rules' fast accepts
