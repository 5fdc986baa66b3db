"""`pip install` builds every optional C module where it can; without them only the fallbacks would ever run."""

from __future__ import annotations

import shutil
import sysconfig

import pytest
import torch

from torchpulse.checkpoints import native
from torchpulse.checkpoints.rules import kernels
from torchpulse.probes import autograd_nodes, autograd_nonfinite


def test_the_c_modules_are_built_where_a_compiler_is() -> None:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler ({cc}): the Python paths run")
    assert native._metaparse is not None  # the .metadata reader
    assert kernels._kernels is not None  # the per-chunk rules' fast accepts
    assert autograd_nonfinite._gradscan is not None  # the non-finite scan of CPU gradients
    assert autograd_nodes._nodeclock is not None  # the node-timing hooks of sampled passes
    # ... which splits across torch's OpenMP team wherever torch has one.
    assert autograd_nonfinite._SCAN_ON_TEAM == torch.backends.openmp.is_available()
    assert autograd_nonfinite.scan_limits() is None or not torch.backends.openmp.is_available()
