"""The in-process agent: bounded hot path, optimizer probe, self-disable, detach, fork."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import weakref
from typing import Any

import pytest
import torch

from tests.support import REPO, local_agent
from torchpulse.probes.agent.agent import Agent
from torchpulse.probes.optimizer import OptimizerProbe


def _train(optimizer: torch.optim.Optimizer, model: torch.nn.Module, steps: int) -> None:
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()


def _agent(**config: Any) -> Agent:
    agent = local_agent(("optimizer",), **config)
    assert isinstance(agent, Agent)
    return agent


def test_optimizer_probe_counts_steps_lr_and_state() -> None:
    """Steps, per-group learning rates and state bytes match the optimizer exactly."""
    agent = _agent()
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam([{"params": [model.weight]}, {"params": [model.bias], "lr": 0.5}], lr=0.1)
    try:
        _train(optimizer, model, 5)
        agent.drain()
        store = agent.store
        assert 5.0 == store.value("optimizer_steps_total", ("Adam#0",))
        assert (0.1, 0.5) == (
            store.value("optimizer_learning_rate", ("Adam#0", "0")),
            store.value("optimizer_learning_rate", ("Adam#0", "1")),
        )
        # exp_avg + exp_avg_sq in fp32 for 15 elements, plus two scalar fp32 step tensors.
        assert float(2 * 15 * 4 + 2 * 4) == store.value("optimizer_state_bytes", ("Adam#0",))
        assert (2.0, 15.0) == (
            store.value("optimizer_parameters", ("Adam#0",)),
            store.value("optimizer_parameter_elements", ("Adam#0",)),
        )
    finally:
        agent.shutdown()


def test_a_param_group_added_later_is_measured_at_the_next_step() -> None:
    """add_param_group (progressive unfreezing) changes the parameter gauges at once, also for an
    optimizer without state (plain SGD), whose state never grows to signal it."""
    agent = _agent()
    model = torch.nn.Linear(4, 3)
    head = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        _train(optimizer, model, 2)
        optimizer.add_param_group({"params": head.parameters(), "lr": 0.01})
        _train(optimizer, model, 1)
        agent.drain()
        assert (4.0, 15.0 + 8.0, 0.01) == (
            agent.store.value("optimizer_parameters", ("SGD#0",)),
            agent.store.value("optimizer_parameter_elements", ("SGD#0",)),
            agent.store.value("optimizer_learning_rate", ("SGD#0", "1")),
        )
    finally:
        agent.shutdown()


def test_a_step_that_raises_is_counted_as_an_error_not_a_step() -> None:
    """When step() raises, only the pre-hook runs: the next step counts one error, no bogus duration."""

    class Exploding(torch.optim.SGD):
        explode = True

        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            if self.explode:
                raise RuntimeError("boom")
            return super().step(closure)

    agent = _agent()
    model = torch.nn.Linear(4, 3)
    optimizer = Exploding(model.parameters(), lr=0.1)
    try:
        model(torch.ones(1, 4)).sum().backward()
        with pytest.raises(RuntimeError, match="boom"):
            optimizer.step()
        optimizer.explode = False
        optimizer.step()
        agent.drain()
        assert (1.0, 1.0) == (
            agent.store.value("optimizer_steps_total", ("Exploding#0",)),
            agent.store.value("optimizer_step_errors_total", ("Exploding#0",)),
        )
        # A step that raised last must not keep the optimizer (and its state) alive: OOM-retry loops
        # drop the optimizer and build a smaller one.
        optimizer.explode = True
        with pytest.raises(RuntimeError, match="boom"):
            optimizer.step()
        gone = weakref.ref(optimizer)
        del optimizer
        gc.collect()
        assert gone() is None
    finally:
        agent.shutdown()


def test_full_buffer_drops_and_counts_instead_of_blocking() -> None:
    """With a 3-record buffer and no sender, 5 steps keep 3 records and count 2 drops."""
    agent = _agent(buffer_capacity=3)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        agent.drain()  # the probe-enabled record
        _train(optimizer, model, 5)
        agent.drain()
        assert (3.0, 2.0) == (
            agent.store.value("optimizer_steps_total", ("SGD#0",)),
            agent.store.value("agent_events_dropped_total", ("buffer_full",)),
        )
    finally:
        agent.shutdown()


@pytest.mark.probe_errors
def test_a_probe_bug_disables_the_probe_once_and_never_reaches_the_job(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A hook that raises is logged once, counted, uninstalled; training continues."""
    agent = _agent()
    probe = agent.probes["optimizer"]
    assert isinstance(probe, OptimizerProbe)
    probe._before_step = lambda *a: 1 / 0  # type: ignore[method-assign]
    probe.uninstall()
    probe.install()
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(optimizer, model, 3)
    agent.drain()
    try:
        assert 1 == sum("probe failed" in r.getMessage() for r in caplog.records)
        assert 1.0 == agent.store.value("agent_probe_errors_total", ("optimizer",))
        assert (False, 0.0) == (probe.enabled, agent.store.value("agent_probe_enabled", ("optimizer",)))
        # The daemon's log gets it too, with the frame that raised: operators read the journal.
        [event] = [e for e in agent._events if e.event.startswith("probe failed")]
        assert ("error", "optimizer", "ZeroDivisionError: division by zero") == (
            event.level,
            event.fields["probe"],
            event.fields["error"],
        )
        assert "1 / 0" in str(event.fields["traceback"])
    finally:
        agent.shutdown()


def test_uninstall_removes_the_global_optimizer_hooks() -> None:
    """After shutdown no torchpulse hook is left in torch's global optimizer hook tables."""
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    before = (len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks))
    agent = _agent()
    # The probe's pre and post hooks, plus the agent's own step-boundary post-hook.
    assert (before[0] + 1, before[1] + 2) == (len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks))
    agent.shutdown()
    assert before == (len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks))


def test_install_twice_is_a_no_op_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """A second install returns the same handle and logs a warning."""
    agent = _agent()
    probe = agent.probes["optimizer"]
    try:
        assert probe._handle is probe.install()
        expected = "torchpulse: probe already installed; ignoring the second install (probe='optimizer')"
        assert [expected] == [r.getMessage() for r in caplog.records]
    finally:
        agent.shutdown()


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
    )


@pytest.mark.process
def test_forked_child_has_no_agent_and_parent_keeps_its_own(tmp_path: Any) -> None:
    """After fork the child's hooks are inert and attach() there makes a fresh agent."""
    result = _run(
        """
        import os, torch, torchpulse
        from torchpulse.probes.attach import current_agent
        parent = torchpulse.attach()
        pid = os.fork()
        if pid == 0:
            ok = current_agent() is None and not parent.enabled
            child = torchpulse.attach()
            ok = ok and child is not parent and child.pid == os.getpid()
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), current_agent() is parent)
        """,
        TORCHPULSE_SOCKET=str(tmp_path / "none.sock"),
    )
    assert "0 True" == result.stdout.strip(), result.stderr


@pytest.mark.process
def test_attach_twice_warns_and_detach_removes_every_hook(tmp_path: Any) -> None:
    """attach() twice returns the same agent with a warning; detach() leaves no hook behind."""
    result = _run(
        """
        import logging, torch, torchpulse
        from torch.optim.optimizer import _global_optimizer_pre_hooks as pre
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        n = len(pre)
        first = torchpulse.attach()
        second = torchpulse.attach()
        torchpulse.detach()
        print(first is second, len(pre) - n)
        """,
        TORCHPULSE_SOCKET=str(tmp_path / "none.sock"),
    )
    assert "True 0" == result.stdout.strip()
    assert "already attached" in result.stderr


def test_a_subclass_calling_super_step_counts_one_step() -> None:
    """Torch hooks both the subclass's and the parent's step(); that nesting is one step, not an error."""

    class Clipped(torch.optim.AdamW):
        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            return super().step(closure)

    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # make sure AdamW.step itself is hooked
    agent = _agent()
    model = torch.nn.Linear(4, 3)
    optimizer = Clipped(model.parameters(), lr=0.1)
    try:
        _train(optimizer, model, 3)
        agent.drain()
        assert (3.0, 0.0) == (
            agent.store.value("optimizer_steps_total", ("Clipped#0",)),
            agent.store.value("optimizer_step_errors_total", ("Clipped#0",)),
        )
    finally:
        agent.shutdown()


@pytest.mark.process
def test_attach_on_a_torch_older_than_supported_is_a_no_op_with_one_warning(tmp_path: Any) -> None:
    """On torch < 2.4 attach() installs nothing, returns None and says why in one line."""
    result = _run(
        """
        import torch, torchpulse
        from torch.optim.optimizer import _global_optimizer_pre_hooks as pre
        torch.__version__ = "2.3.1"
        print(torchpulse.attach(), len(pre))
        """,
        TORCHPULSE_SOCKET=str(tmp_path / "none.sock"),
    )
    assert "None 0" == result.stdout.strip()
    assert ["torchpulse: torch too old for torchpulse probes; not attaching (torch_version='2.3.1')"] == (
        result.stderr.splitlines()
    )


@pytest.mark.process
def test_the_sender_survives_descriptor_exhaustion_and_never_writes_into_reused_descriptors(tmp_path: Any) -> None:
    """EMFILE while connecting is a retry, not a dead agent thread; after detach, no byte reaches a file
    that took over the agent's old descriptor numbers."""
    result = _run(
        f"""
        import os, resource, time, torch, torchpulse
        agent = torchpulse.attach(probes=["optimizer"], flush_interval=0.02, backoff_initial=0.02,
                                  backoff_max=0.05)
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(1, 2)).sum().backward(); opt.step()
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        hog = []
        try:
            while True:
                hog.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        time.sleep(0.5)
        for fd in hog:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        alive = agent._sender.is_alive()
        torchpulse.detach()
        files = [open(os.path.join({str(tmp_path)!r}, f"f{{i}}"), "wb", buffering=0) for i in range(4)]
        agent.control._answer(type("C", (), {{"id": 1}})(), True, "late", {{}})  # wakes a stopped sender
        for f in files:
            f.close()
        print(alive, [os.path.getsize(f.name) for f in files])
        """,
        TORCHPULSE_SOCKET=str(tmp_path / "none.sock"),
    )
    assert "True [0, 0, 0, 0]" == result.stdout.strip(), result.stderr


@pytest.mark.process
def test_undecodable_bytes_in_argv_and_log_fields_still_reach_the_daemon(tmp_path: Any) -> None:
    """A surrogate-escaped argument (a Latin-1 file name) is sent as "?", not a dead agent thread."""
    from tests.support import start_daemon, wait_for
    from torchpulse.daemon.client import request_status

    daemon = start_daemon(tmp_path)
    try:
        script = textwrap.dedent("""
            import sys, torch, torchpulse
            agent = torchpulse.attach(probes=["optimizer"])
            agent.emit("info", "odd.field", path=sys.argv[1])
            model = torch.nn.Linear(2, 2)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            model(torch.randn(1, 2)).sum().backward(); opt.step()
            print(agent.flush(10), agent._sender.is_alive())
            torchpulse.detach()
            """)
        env = {**os.environ, "TORCHPULSE_SOCKET": str(daemon.socket_path), "TORCHPULSE_RUN": "latin"}
        result = subprocess.run(
            [sys.executable, "-c", script, b"/data/caf\xe9".decode("utf-8", "surrogateescape")],
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO,
            timeout=120,
            check=False,
        )
        assert "True True" == result.stdout.strip(), result.stderr
        wait_for(lambda: any(e.get("event") == "odd.field" for e in daemon.log_lines()))
        event = next(e for e in daemon.log_lines() if e.get("event") == "odd.field")
        assert "/data/caf?" == event["path"]
        assert any(r.run == "latin" for r in request_status(daemon.socket_path).runs)
    finally:
        daemon.stop()


@pytest.mark.probe_errors
def test_a_probe_failing_on_the_agent_thread_leaves_hook_tables_alone() -> None:
    """A record handler that raises on the agent's thread disables its probe without removing hooks
    there (the training thread may be iterating that table); detach removes them."""
    import threading

    from torch.optim.optimizer import _global_optimizer_post_hooks

    from torchpulse.probes.agent.threads import mark_agent_thread

    before = len(_global_optimizer_post_hooks)
    agent = _agent()
    probe = agent.probes["optimizer"]
    installed = len(_global_optimizer_post_hooks)

    def agent_thread() -> None:
        mark_agent_thread()
        probe.fail(RuntimeError("aggregation bug"))

    thread = threading.Thread(target=agent_thread)
    thread.start()
    thread.join()
    assert (False, installed) == (probe.enabled, len(_global_optimizer_post_hooks))
    agent.shutdown()
    assert before == len(_global_optimizer_post_hooks)


def test_optimizers_built_over_and_over_reuse_their_labels() -> None:
    """A search that builds one optimizer per trial keeps one label and no growing hook list; optimizers
    alive together still get distinct labels."""
    agent = _agent()
    model = torch.nn.Linear(4, 3)
    try:
        handles = len(agent.probes["optimizer"]._handles)
        for _ in range(50):
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            _train(optimizer, model, 1)
            del optimizer
            # The young generations, where the optimizer and its cycles are: a full collection of the test
            # process takes ~0.3 s, 50 of them most of this test's time.
            gc.collect(1)
        first, second = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
        _train(first, model, 1)
        _train(second, model, 1)
        agent.drain()
        assert (51.0, 1.0) == (
            agent.store.value("optimizer_steps_total", ("SGD#0",)),
            agent.store.value("optimizer_steps_total", ("SGD#1",)),
        )
        assert handles == len(agent.probes["optimizer"]._handles)
    finally:
        agent.shutdown()


def test_a_load_state_dict_after_disable_and_enable_is_measured_at_the_next_step() -> None:
    """`ctl disable optimizer` then `enable`: optimizers tracked before keep their load hook, so state loaded
    later (here amsgrad's third tensor per parameter, the same number of entries) shows at the next step,
    not at the next periodic rescan 100 steps on."""
    agent = _agent()
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    donor = torch.optim.Adam(model.parameters(), lr=0.1, amsgrad=True)
    try:
        _train(optimizer, model, 2)  # Adam#0
        _train(donor, model, 1)
        probe = agent.probes["optimizer"]
        probe.uninstall()
        probe.install()
        _train(optimizer, model, 2)
        optimizer.load_state_dict(donor.state_dict())
        _train(optimizer, model, 1)
        agent.drain()
        assert float(3 * 15 * 4 + 2 * 4) == agent.store.value("optimizer_state_bytes", ("Adam#0",))
    finally:
        agent.shutdown()
