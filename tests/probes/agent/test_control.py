"""Commands applied at the step boundary of the training thread."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.support import local_agent, wait_for
from torchpulse.probes.agent.agent import Agent
from torchpulse.protocol import Command, CommandResult, FieldValue


def _setup() -> tuple[Agent, torch.nn.Module, torch.optim.Optimizer]:
    agent = local_agent(("optimizer",))
    assert isinstance(agent, Agent)
    model = torch.nn.Linear(4, 3)
    return agent, model, torch.optim.SGD(model.parameters(), lr=0.1)


def _results(agent: Agent, count: int) -> list[CommandResult]:
    """The first `count` answers; a trace's comes from its writer thread a little after its last step."""
    wait_for(lambda: len(agent.control.results) >= count, timeout=30)
    return list(agent.control.results)


def _profiling() -> bool:
    return bool(torch._C._autograd._profiler_enabled())


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, n: int = 1) -> None:
    for _ in range(n):
        optimizer.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()


def test_disabling_the_optimizer_probe_from_its_own_hook_does_not_break_the_step() -> None:
    """A disable applied inside the post-hook leaves inert hooks, and detach removes them later."""
    from torch.optim.optimizer import _global_optimizer_post_hooks

    before = len(_global_optimizer_post_hooks)
    agent, model, optimizer = _setup()
    try:
        _step(model, optimizer)
        agent.control.receive(Command(1, "disable", {"probe": "optimizer"}))
        _step(model, optimizer, 3)
        agent.drain()
        assert [(1, True, {"probe": "optimizer", "changed": True})] == [
            (r.id, r.ok, r.data) for r in agent.control.results
        ]
        assert 2.0 == agent.store.value("optimizer_steps_total", ("SGD#0",))
    finally:
        agent.shutdown()
    assert before == len(_global_optimizer_post_hooks)


def test_reenabling_reuses_the_inert_hooks() -> None:
    """Enable after an in-hook disable resumes counting without registering hooks twice."""
    from torch.optim.optimizer import _global_optimizer_post_hooks

    agent, model, optimizer = _setup()
    try:
        registered = len(_global_optimizer_post_hooks)
        agent.control.receive(Command(1, "disable", {"probe": "optimizer"}))
        _step(model, optimizer)
        agent.probes["optimizer"].install()
        _step(model, optimizer, 2)
        agent.drain()
        assert registered == len(_global_optimizer_post_hooks)
        assert 3.0 == agent.store.value("optimizer_steps_total", ("SGD#0",))
    finally:
        agent.shutdown()


def test_trace_covers_exactly_the_requested_steps(tmp_path: Path) -> None:
    """A trace for steps 3..5 records exactly three optimizer steps and reports its path."""
    agent, model, optimizer = _setup()
    try:
        agent.control.receive(Command(7, "trace", {"steps": 3, "start_step": 3, "out": str(tmp_path)}))
        _step(model, optimizer, 8)
        [result] = _results(agent, 1)
        assert (True, 3, 5) == (result.ok, result.data["first_step"], result.data["last_step"])
        events = json.loads(Path(str(result.data["path"])).read_text())["traceEvents"]
        steps = [e for e in events if e.get("name", "").startswith("Optimizer.step#SGD.step")]
        assert 3 == len(steps)
    finally:
        agent.shutdown()


def test_trace_for_a_step_already_past_fails_clearly(tmp_path: Path) -> None:
    """Asking to start at a step the rank already finished is refused with the current step named.

    The command arrives after step 4 and applies at the next boundary, after step 5.
    """
    agent, model, optimizer = _setup()
    try:
        _step(model, optimizer, 4)
        agent.control.receive(Command(2, "trace", {"steps": 2, "start_step": 2, "out": str(tmp_path)}))
        _step(model, optimizer)
        [result] = list(agent.control.results)
        assert (
            False,
            "missed the start step 2: this rank already finished step 5; retry with a later "
            "--start-step, or without one",
        ) == (result.ok, result.message)
    finally:
        agent.shutdown()


def test_status_answers_at_once_and_unknown_commands_are_refused() -> None:
    """status needs no safe point; an unknown command gets a clear failure."""
    agent, model, optimizer = _setup()
    try:
        _step(model, optimizer, 2)
        agent.control.receive(Command(1, "status", {}))
        agent.control.receive(Command(2, "explode", {}))
        status, unknown = list(agent.control.results)
        assert (2, "optimizer") == (status.data["step"], status.data["probes"])
        assert (False, "unknown command 'explode'") == (unknown.ok, unknown.message)
    finally:
        agent.shutdown()


def test_status_shows_the_slowest_autograd_nodes_and_cudagraph_dump_answers() -> None:
    """With the autograd and cudagraphs probes on, status names slow node types and the dump reports trees."""
    agent = local_agent(("optimizer", "autograd", "cudagraphs"))
    assert isinstance(agent, Agent)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        _step(model, optimizer, 2)
        agent.control.receive(Command(1, "status", {}))
        agent.control.receive(Command(2, "cudagraph-dump", {}))
        _step(model, optimizer)
        status, dump = list(agent.control.results)
        assert re.search(r"AddmmBackward0#\d+ \d+\.\d\dms", str(status.data["autograd_slowest"]))
        assert (True, True, 0) == (dump.ok, dump.data["available"], dump.data["trees"])
    finally:
        agent.shutdown()


def test_commands_that_reinstall_hooks_never_raise_into_the_step() -> None:
    """disable, enable, disable (each re-registering hooks), also with a job's own global post-hook
    registered after attach: every step completes and every command is answered."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    agent, model, optimizer = _setup()
    seen: list[int] = []
    try:
        _step(model, optimizer)
        for n, name in enumerate(["disable", "enable", "disable", "enable"], start=1):
            agent.control.receive(Command(n, name, {"probe": "optimizer"}))
            _step(model, optimizer)
            if n == 2:
                user = register_optimizer_step_post_hook(lambda *_: seen.append(1))
        _step(model, optimizer, 2)
        assert [(n, True) for n in range(1, 5)] == [(r.id, r.ok) for r in agent.control.results]
        assert seen, "the job's own hook ran"
        user.remove()
    finally:
        agent.shutdown()


class _Lookahead(torch.optim.Optimizer):
    """The usual wrapper shape (timm, torch_optimizer, ZeroRedundancyOptimizer): step() steps another."""

    def __init__(self, base: torch.optim.Optimizer) -> None:
        self.base = base
        super().__init__(base.param_groups, {})

    def step(self, closure: object = None) -> None:  # type: ignore[override]
        self.base.step()


def test_a_wrapping_optimizer_counts_steps_and_an_idle_first_optimizer_is_replaced() -> None:
    """The outer optimizer of a wrapper is the main one; an optimizer that stepped first (an LR finder's)
    and then stopped is replaced once another steps twice without it; commands apply throughout."""
    agent, model, finder = _setup()
    try:
        _step(model, finder, 3)
        optimizer = _Lookahead(torch.optim.SGD(model.parameters(), lr=0.1))
        _step(model, optimizer, 2)  # the second step makes it the main optimizer
        agent.control.receive(Command(1, "status", {}))
        agent.control.receive(Command(2, "disable", {"probe": "optimizer"}))
        _step(model, optimizer, 5)
        assert 3 + 2 + 5 - 1 == agent.step  # the first step of the new optimizer is not a boundary
        assert [1, 2] == [r.id for r in agent.control.results]
        assert finder is not None
    finally:
        agent.shutdown()


KNOWN = "autograd, checkpoint, compile, cudagraphs, optimizer"


@pytest.mark.parametrize(
    ("name", "args", "message"),
    [
        ("trace", {"steps": 10**6, "out": "/tmp"}, "steps must be an integer from 1 to 100, got 1000000"),
        ("trace", {"steps": True, "out": "/tmp"}, "steps must be an integer from 1 to 100, got True"),
        ("trace", {"steps": 2, "out": "relative/dir"}, "out must be an absolute directory path, got 'relative/dir'"),
        ("trace", {"steps": 2, "out": "/tmp", "start_step": 2.5}, "start_step must be an integer, got 2.5"),
        ("sample", {"probe": "autograd", "rate": 1e-30}, "rate must be 0 (off) or a number from 1e-06 to 1, got 1e-30"),
        (
            "sample",
            {"probe": "autograd", "rate": math.nan},
            "rate must be 0 (off) or a number from 1e-06 to 1, got nan",
        ),
        ("sample", {"probe": "autograd", "rate": "0.1"}, "rate must be 0 (off) or a number from 1e-06 to 1, got '0.1'"),
        ("autograd-log", {"passes": 10**12}, "passes must be an integer from 1 to 100, got 1000000000000"),
        ("enable", {"probe": "nope"}, f"unknown probe 'nope' (known: {KNOWN})"),
        ("disable", {"probe": "nope"}, f"unknown probe 'nope' (known: {KNOWN})"),
    ],
)
def test_bad_arguments_are_refused_at_once_without_waiting_for_a_step(
    name: str, args: dict[str, FieldValue], message: str
) -> None:
    """A typo is answered when it arrives, by a job that is not stepping, and nothing is queued."""
    agent, _model, _optimizer = _setup()
    try:
        agent.control.receive(Command(1, name, args))
        assert [(1, False, message)] == [(r.id, r.ok, r.message) for r in agent.control.results]
        assert not agent.control.armed
    finally:
        agent.shutdown()


def test_a_trace_into_a_file_is_refused_before_anything_is_captured(tmp_path: Path) -> None:
    """--out naming a regular file fails on arrival, not after the job paid for the trace."""
    agent, _model, _optimizer = _setup()
    (tmp_path / "f").write_text("x")
    try:
        agent.control.receive(Command(1, "trace", {"steps": 2, "out": str(tmp_path / "f")}))
        assert [(False, f"{tmp_path / 'f'} is not a directory")] == [(r.ok, r.message) for r in agent.control.results]
    finally:
        agent.shutdown()


def test_a_flood_of_commands_is_bounded_and_the_rest_is_answered_busy() -> None:
    """Without a step boundary, at most 32 commands wait; the others are answered busy at once."""
    agent, model, optimizer = _setup()
    try:
        for n in range(100):
            agent.control.receive(Command(n, "enable", {"probe": "optimizer"}))
        busy = [r for r in agent.control.results if not r.ok]
        assert 100 - 32 == len(busy)
        assert "busy: 32 commands already wait for this rank's next step boundary" == busy[0].message
        _step(model, optimizer)
        assert 100 == len(agent.control.results)
    finally:
        agent.shutdown()


def test_detaching_during_a_trace_stops_the_profiler_and_answers_everything(tmp_path: Path) -> None:
    """The job detaches (or ends) mid-capture: the profiler stops instead of growing for ever, and the
    trace and a queued command are answered rather than left to time out."""
    agent, model, optimizer = _setup()
    try:
        agent.control.receive(Command(1, "trace", {"steps": 50, "start_step": 2, "out": str(tmp_path)}))
        _step(model, optimizer, 3)
        assert _profiling()
        agent.control.receive(Command(2, "disable", {"probe": "optimizer"}))
        agent.shutdown()
        assert not _profiling()
        assert [
            (1, False, "the agent detached before the trace of steps 2..51 was complete; nothing was written"),
            (2, False, "the agent detached before its next step boundary"),
        ] == [(r.id, r.ok, r.message) for r in agent.control.results]
    finally:
        trace = agent.control.traces._trace
        if trace is not None and trace.profiler is not None and _profiling():
            trace.profiler.stop()  # the unfixed agent left it running
        agent.shutdown()


def test_a_trace_torch_failed_to_write_is_reported_as_failed() -> None:
    """Kineto logs a failed write and returns as if it wrote: the answer must not claim a file."""
    agent, model, optimizer = _setup()
    try:
        # /proc passes the checks on arrival when run as root (access() says yes), then no file can be created.
        agent.control.receive(Command(1, "trace", {"steps": 2, "start_step": 2, "out": "/proc"}))
        _step(model, optimizer, 4)
        [result] = _results(agent, 1)
        assert not result.ok, result
        assert "path" not in result.data
    finally:
        agent.shutdown()


def test_a_predicted_trace_file_name_cannot_redirect_the_write(tmp_path: Path) -> None:
    """Symlinks planted in the trace directory under the names the job would use (kineto writes
    `<name>.tmp` following links) do not make it overwrite another file."""
    agent, model, optimizer = _setup()
    out, victim = tmp_path / "out", tmp_path / "victim"
    out.mkdir()
    victim.write_text("precious")
    ident = agent.identity
    safe_run = "".join(c if c.isalnum() or c in "-_." else "_" for c in ident.run)
    now = int(time.time())
    for second in range(now - 1, now + 60):
        stem = f"{safe_run}-rank{ident.rank}-steps2-3-{second}.json"
        (out / f"{stem}.tmp").symlink_to(victim)
        (out / stem).symlink_to(victim)
    try:
        agent.control.receive(Command(1, "trace", {"steps": 2, "start_step": 2, "out": str(out)}))
        _step(model, optimizer, 4)
        [result] = _results(agent, 1)
        assert "precious" == victim.read_text()
        assert result.ok, result
        assert json.loads(Path(str(result.data["path"])).read_text())["traceEvents"]
    finally:
        agent.shutdown()


def test_a_long_run_name_still_gets_its_trace_file() -> None:
    """A 300-character run name is cut in the file name instead of failing the trace with ENAMETOOLONG."""
    agent, model, optimizer = _setup()
    agent.identity = replace(agent.identity, run="r" * 300)
    with tempfile.TemporaryDirectory() as out:
        try:
            agent.control.receive(Command(1, "trace", {"steps": 2, "start_step": 2, "out": out}))
            _step(model, optimizer, 4)
            [result] = _results(agent, 1)
            assert (True, "trace written") == (result.ok, result.message), result
            assert Path(str(result.data["path"])).name.startswith("r" * 64 + "-rank")
        finally:
            agent.shutdown()


def test_writing_the_trace_file_does_not_hold_up_the_training_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An export that takes 2 s (a large model's trace) happens while the job goes on stepping."""
    original = torch.profiler.profile.export_chrome_trace

    def slow_export(self: torch.profiler.profile, path: str) -> None:
        time.sleep(2)
        original(self, path)

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", slow_export)
    agent, model, optimizer = _setup()
    try:
        agent.control.receive(Command(1, "trace", {"steps": 2, "start_step": 2, "out": str(tmp_path)}))
        started = time.monotonic()
        _step(model, optimizer, 5)
        assert time.monotonic() - started < 1.5
        assert True is agent.control.status()["tracing"], "still writing"
        [result] = _results(agent, 1)
        assert result.ok, result
    finally:
        agent.shutdown()


def test_a_trace_waiting_for_a_far_step_is_superseded_by_a_newer_request(tmp_path: Path) -> None:
    """A trace planned for a step that never comes (a client that gave up) does not block the next one."""
    agent, model, optimizer = _setup()
    try:
        agent.control.receive(Command(1, "trace", {"steps": 2, "start_step": 10**9, "out": str(tmp_path)}))
        _step(model, optimizer)
        agent.control.receive(Command(2, "trace", {"steps": 2, "start_step": 3, "out": str(tmp_path)}))
        _step(model, optimizer, 5)
        first, second = _results(agent, 2)
        assert (1, False, "superseded by a newer trace request before step 1000000000 came") == (
            first.id,
            first.ok,
            first.message,
        )
        assert (2, True) == (second.id, second.ok), second
    finally:
        agent.shutdown()


def test_a_status_that_fails_is_answered_and_never_raises_into_the_sender() -> None:
    """A probe whose status() raises gives a failed answer; receive() itself does not raise."""
    agent, _model, _optimizer = _setup()
    agent.probes["autograd"] = SimpleNamespace(enabled=True, status=lambda: 1 / 0)
    try:
        agent.control.receive(Command(1, "status", {}))
        assert [(1, False, "internal error: ZeroDivisionError('division by zero')")] == [
            (r.id, r.ok, r.message) for r in agent.control.results
        ]
    finally:
        del agent.probes["autograd"]
        agent.shutdown()


def test_sample_sets_the_autograd_period_and_rate_zero_switches_timing_off() -> None:
    """`sample autograd 0.25` times 1 pass in 4 from the next boundary; `sample autograd 0` times none."""
    agent = local_agent(("optimizer", "autograd"))
    assert isinstance(agent, Agent)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        _step(model, optimizer)
        agent.control.receive(Command(1, "sample", {"probe": "autograd", "rate": 0.25}))
        _step(model, optimizer, 9)
        agent.control.receive(Command(2, "sample", {"probe": "autograd", "rate": 0}))
        _step(model, optimizer)
        agent.drain()
        sampled = agent.store.value("autograd_sampled_passes_total", ())
        _step(model, optimizer, 20)
        agent.drain()
        assert ([(1, True, {"sample_every": 4}), (2, True, {"sample_every": 0})], sampled) == (
            [(r.id, r.ok, r.data) for r in agent.control.results],
            agent.store.value("autograd_sampled_passes_total", ()),
        )
    finally:
        agent.shutdown()


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 KiB tmpfs: smaller than a trace file, which torch then leaves half-written (root only)."""
    mount = tmp_path / "full"
    mount.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mount)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.process
def test_a_trace_on_a_full_disk_names_the_cause_and_frees_the_space(full_disk: Path) -> None:
    """Kineto only logs 'Failed to write to log file!' on the job's stderr: the answer names the cause, and
    by then the job no longer holds the partial file torch wrote (deleted, it kept the disk full)."""
    agent, model, optimizer = _setup()
    try:
        agent.control.receive(Command(1, "trace", {"steps": 5, "start_step": 2, "out": str(full_disk)}))
        _step(model, optimizer, 8)
        [result] = _results(agent, 1)
        assert not result.ok
        assert result.message.endswith(f": the file system of {full_disk} is full (0 bytes free)"), result.message
        space = os.statvfs(full_disk)
        assert space.f_blocks == space.f_bfree, "the job still holds the deleted partial trace file"
    finally:
        agent.shutdown()


def test_the_step_rate_of_a_rank_stuck_since_its_last_step_falls() -> None:
    """Steps 0.1 s apart: 10 per second while the rank steps on; stuck for 10 s since (a peer hung in a
    collective), the wait counts and the rate falls (it read 10 per second for as long as the rank hung)."""
    agent, _model, _optimizer = _setup()
    try:
        control = agent.control
        for ago in (0.05, 10.0):
            last = time.monotonic() - ago
            control.boundary._step_times.clear()
            control.boundary._step_times.extend(last - 0.1 * i for i in range(9, -1, -1))
            agent.control.receive(Command(1, "status", {}))
        stepping, stuck = (result.data["step_rate"] for result in control.results)
        assert (10.0, True) == (stepping, isinstance(stuck, float) and 0.8 < stuck < 0.9), stuck
    finally:
        agent.shutdown()
