"""The compile probe under more torch.compile usage patterns, compared with what torch recorded in the same process."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from tests.support import REPO
from torchpulse.probes.compile.logtap import LogTap

# The job configures logging the way `dictConfig` does by default (disable_existing_loggers=True) after it has
# imported torch and Dynamo: every torch logger that exists is disabled, also those the probe reads.
DICT_CONFIG_JOB = r"""
import io, json, logging.config
import torch, torch._dynamo
from torch._dynamo.utils import counters
from tests.support import local_agent
from torchpulse.probes.torch_compat import dynamo as dynamo_compat
agent = local_agent(("compile",))
printed = io.StringIO()
logging.config.dictConfig({"version": 1, "handlers": {"out": {"class": "logging.StreamHandler", "stream": printed}},
                           "root": {"handlers": ["out"], "level": "DEBUG"}})

def f(x):
    x = x + 1
    torch._dynamo.graph_break()
    return x * 2

compiled = torch.compile(f, backend="eager", dynamic=False)
compiled(torch.randn(3))
compiled(torch.randn(4))  # f and its resume function recompile
agent.drain()
series = {name: sum(v for (n, _), v in agent.store._values.items() if n == name)
          for name in ("compile_frames_total", "recompiles_total", "graph_breaks_total")}
agent.shutdown()
taps = (dynamo_compat.METRICS_LOGGER, dynamo_compat.GRAPH_BREAK_LOGGER)
disabled = [logging.getLogger(name).disabled for name in taps]
print(json.dumps({"probe": series, "torch": [counters["frames"]["ok"], sum(counters["graph_break"].values())],
                  "printed": printed.getvalue(), "disabled": disabled}))
"""


@pytest.mark.process
def test_loggers_disabled_by_dict_config_still_feed_the_probe_and_stay_silent() -> None:
    """A job's dictConfig disables torch's loggers: compiles are still counted, nothing is printed, the flag comes back.

    (The probe saw nothing: a disabled logger drops records before its filters, and no metric moved.)
    """
    out = subprocess.run([sys.executable, "-c", DICT_CONFIG_JOB], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert 0 == out.returncode, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert {
        "probe": {"compile_frames_total": 4.0, "recompiles_total": 2.0, "graph_breaks_total": 2.0},
        "torch": [4, 2],
        "printed": "",
        "disabled": [True, True],
    } == result


def test_log_tap_follows_a_logging_configuration_that_enables_or_disables_its_logger() -> None:
    """A tapped logger disabled by a configuration is read but silent; enabled again, it prints; the tap's removal
    restores only its own change.
    """
    logger = logging.getLogger("tp_tap_disabled")
    printed: list[str] = []

    class ListHandler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            printed.append(record.getMessage())

    logger.addHandler(ListHandler())
    seen: list[str] = []
    logger.disabled = True  # what dictConfig does to a logger it does not name
    tap = LogTap(logger.name, logging.INFO, lambda r: seen.append(r.getMessage()))
    logger.warning("disabled")
    logger.disabled = False  # a later dictConfig that names it (or disable_existing_loggers=False)
    logger.warning("enabled")
    logger.disabled = True  # disabled again: refresh() at the next compile takes over once more
    tap.refresh()
    logger.warning("disabled again")
    tap.remove()
    assert (["disabled", "enabled", "disabled again"], ["enabled"], True) == (seen, printed, logger.disabled)
