"""What every probe shares: install/uninstall, guarded hooks, self-disable on error."""

from __future__ import annotations

import functools
import os
import sys
import traceback
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, ClassVar, ParamSpec, Protocol, TypeVar, TypeVarTuple

from torchpulse.limits import MAX_TRACEBACK_CHARS
from torchpulse.probes.agent.after_import import AfterImport
from torchpulse.probes.agent.logs import get_logger
from torchpulse.probes.agent.threads import enter_hook, inside_hook, leave_hook, on_agent_thread
from torchpulse.probes.torch_compat.dynamo import disable_tracing
from torchpulse.protocol import FieldValue

if TYPE_CHECKING:
    from torchpulse.probes.agent.agent import Agent

log = get_logger("torchpulse.probes")
P = ParamSpec("P")
R = TypeVar("R")
Args = TypeVarTuple("Args")


class Removable(Protocol):
    def remove(self) -> None: ...


class _Detachable(Protocol):
    """A `weakref.finalize` of any callback, as `discard` sees it."""

    def detach(self) -> object: ...


class ProbeFactory(Protocol):
    """Makes probes by family name: the agent core's only view of the families (`probes/families.py`)."""

    @property
    def known(self) -> frozenset[str]: ...

    def make(self, name: str, agent: Agent) -> Probe | None: ...


class ProbeHandle:
    """Returned by `Probe.install()`; `remove()` uninstalls the probe."""

    def __init__(self, probe: Probe) -> None:
        self._probe = probe

    def remove(self) -> None:
        self._probe.uninstall()


class Probe:
    """Base class: subclasses implement `_install` and register handles with `_keep`."""

    name: ClassVar[str] = "probe"
    # The control commands this probe answers besides enable/disable (`ctl sample`, `ctl autograd-log`,
    # `ctl cudagraph-dump`): each overrides the matching method below.
    commands: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.enabled = False
        self._handles: list[Removable] = []
        self._handle: ProbeHandle | None = None
        # Finalizers on the job's objects (optimizers), per object: `discard` detaches them.
        self._finalizers: weakref.WeakKeyDictionary[object, list[_Detachable]] = weakref.WeakKeyDictionary()

    def install(self) -> ProbeHandle:
        if self._handle is not None:
            log.warning("probe already installed; ignoring the second install", probe=self.name)
            return self._handle
        if not self._handles:
            # Hooks left inert by an uninstall inside a hook are still registered.
            self._install()
        self.enabled = True
        self._handle = ProbeHandle(self)
        self.agent.record_quiet(self._set_enabled_gauge, 1.0)
        self.start_at_zero("agent_probe_errors_total", ((self.name,),))
        return self._handle

    def uninstall(self) -> None:
        """Disable at once; remove the hooks unless torch is iterating a hook table right now."""
        self.enabled = False
        if self._handle is not None:
            self._handle = None
            self._uninstalled()
            self.agent.record_quiet(self._set_enabled_gauge, 0.0)
        if inside_hook() or on_agent_thread():
            # Removing a hook while torch loops over its hook dict raises
            # "OrderedDict mutated during iteration" in the job, and from the
            # agent's thread the training thread may be looping over it right
            # now. The hooks stay registered but inert until an uninstall on the
            # training thread outside any hook (detach) or a re-install reuses them.
            return
        handles, self._handles = self._handles, []
        for handle in reversed(handles):
            handle.remove()

    def at_death(self, obj: object, callback: Callable[[*Args], object], *args: *Args) -> None:
        """Call `callback(*args)` when `obj` (an object of the job's) dies, unless this probe is discarded first."""
        self._finalizers.setdefault(obj, []).append(weakref.finalize(obj, callback, *args))

    def discard(self) -> None:
        """The agent is done with this probe (detach): detach its finalizers. Each holds what it calls, so a
        job that attaches and detaches again and again would otherwise keep every detached agent alive for as
        long as an optimizer it saw lives."""
        for finalizers in list(self._finalizers.values()):
            for finalizer in finalizers:
                finalizer.detach()
        self._finalizers.clear()

    def _install(self) -> None:
        raise NotImplementedError

    # -- what control commands ask of a probe that lists them in `commands` -------
    def status(self) -> dict[str, object]:
        """Plain values for `torchpulse status`."""
        return {}

    def set_sample_every(self, every: int) -> None:
        """`ctl sample`: time one pass in `every` (0: none)."""
        raise NotImplementedError

    def log_next_passes(self, passes: int) -> None:
        """`ctl autograd-log`: log every node of the next `passes` passes."""
        raise NotImplementedError

    def dump_state(self) -> dict[str, FieldValue]:
        """`ctl cudagraph-dump`: the probe's view of the job's state."""
        raise NotImplementedError

    def _uninstalled(self) -> None:
        """Hook for subclasses to drop per-install state."""

    def _keep(self, handle: Removable) -> None:
        self._handles.append(handle)

    def _install_after_import(self, module: str, install: Callable[[], None]) -> None:
        """Run `install` now if the job imported `module`, else right after it does.

        The deferred call runs inside the job's import statement: a failure
        there disables this probe and never reaches the import.
        """
        if module in sys.modules:
            install()
            return

        def deferred(_module: ModuleType) -> None:
            if not (self.enabled and self.agent.enabled):
                return
            try:
                install()
            except Exception as exc:  # probe bugs must never reach the job
                self.fail(exc)

        self._keep(AfterImport(module, deferred))

    def start_at_zero(self, name: str, label_sets: tuple[tuple[str, ...], ...] = ((),)) -> None:
        """Have counter series exported at 0 before their first event (see `MetricStore.start_at_zero`).

        Call once, when the probe can start counting them (install, or when a labelled object is
        first seen), never per step. Quiet: zeros alone must not make a process that never trains connect.
        """
        self.agent.record_quiet(self._store_zeros, name, label_sets)

    def _store_zeros(self, name: str, label_sets: tuple[tuple[str, ...], ...]) -> None:
        self.agent.store.start_at_zero(name, label_sets)

    def _set_enabled_gauge(self, value: float) -> None:
        self.agent.store.set("agent_probe_enabled", (self.name,), value)

    def fail(self, exc: BaseException) -> None:
        """A bug in this probe: log it once, count it, and switch the probe off."""
        if not self.enabled:
            return
        summary = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        log.warning("probe failed and disabled itself; training continues", probe=self.name, error=summary)
        # The daemon's log too, with where it failed: the operator sees the alert and the journal, not the
        # job's stderr. The traceback's end (the frames that raised) is kept within an event field's limit.
        self.agent.emit(
            "error",
            "probe failed and disabled itself; training continues",
            probe=self.name,
            error=summary,
            traceback="".join(traceback.format_exception(exc))[-MAX_TRACEBACK_CHARS:],
        )
        self.agent.record_quiet(self._count_error)
        try:
            self.uninstall()
        except Exception:  # a broken uninstall must not reach the job either
            self.enabled = False
        after_probe_error(self, exc)

    def _count_error(self) -> None:
        self.agent.store.inc("agent_probe_errors_total", (self.name,))

    def guard(self, hook: Callable[P, R], *, traceable: bool = True) -> Callable[P, R | None]:
        """Wrap a hook so it is skipped when disabled (None), never raises (None), and never breaks a graph.

        `traceable=False` for hooks no compiled code can call (the checkpoint probe's, around
        a save): they skip the Dynamo layer, which imports torch._dynamo (~0.7 s) at the first
        call, in the job's thread, and lets an import that raises (a deleted cwd) reach the job.
        """
        agent = self.agent

        @functools.wraps(hook)
        def guarded(*args: P.args, **kwargs: P.kwargs) -> R | None:
            if not (self.enabled and agent.enabled):
                return None
            enter_hook()
            try:
                return hook(*args, **kwargs)
            except Exception as exc:  # probe bugs must never reach the job
                self.fail(exc)
                return None
            finally:
                leave_hook()

        if not traceable:
            return guarded
        # Dynamo must not trace into our hooks: they would break graphs or be
        # baked into them.
        return disable_tracing(guarded)


# The exit status of a process that TORCHPULSE_PROBE_ERRORS=fatal ended (EX_SOFTWARE: an internal error).
PROBE_ERROR_EXIT_STATUS = 70


def after_probe_error(probe: Probe, exc: BaseException) -> None:
    """What a probe's bug does once the probe is off: nothing more, or, under TORCHPULSE_PROBE_ERRORS=fatal, the
    end of the process with the traceback on stderr (from any thread: a raise on the sender thread would end
    only that thread). Looked up at each call, so that the test suite can record errors in its own process."""
    if probe.agent.config.probe_errors != "fatal":
        return
    sys.stderr.write(
        f"torchpulse: probe {probe.name} failed; exiting as TORCHPULSE_PROBE_ERRORS=fatal asks\n"
        + "".join(traceback.format_exception(exc))
    )
    sys.stderr.flush()
    os._exit(PROBE_ERROR_EXIT_STATUS)
