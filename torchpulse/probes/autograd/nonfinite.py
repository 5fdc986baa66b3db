"""Non-finite gradient detection with one fused reduction per device and no host sync.

After a pass that accumulated into `.grad`, the per-parameter L2 norms are
computed on the device by `torch._foreach_norm` (one launch per device and
dtype for all parameters; NaN/Inf in any element makes the norm non-finite). On CUDA
the result is copied to pinned host memory with `non_blocking=True` and an
event is recorded; `poll()` reads only checks whose event has completed, so the
training thread never waits for the device. On CPU the check runs on the training
thread and costs one read of every gradient.

Nothing compiled runs here: a crash inside the training process would cost the job,
and on the CPU `_foreach_norm` reads at close to memory speed already.

The converse needs care: squares of float32 values overflow above ~1.8e19, so a
finite gradient can have an infinite float32 norm. On CUDA the norms accumulate
in float64 (the reduction is bound by memory bandwidth, so this costs nothing
measurable); elsewhere results are on the host at once, and only an infinite
norm is computed again in float64 (on CPU a float64 reduction costs 1.6-3.7x).
"""

from __future__ import annotations

import math
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from torchpulse.probes.torch_compat.autograd_engine import dispatch_modes_aside

ParamRef = weakref.ReferenceType[torch.Tensor]


class CheckResult(NamedTuple):
    """A read-back check: which parameters were non-finite, and the global norm. A tuple: one is made
    every pass, where a frozen dataclass's field-by-field __init__ cost ~10 µs cold."""

    pass_index: int
    kind: str
    checked: int
    nonfinite: tuple[ParamRef, ...]
    norm: float


@dataclass
class _Pending:
    pass_index: int
    kind: str
    refs: list[ParamRef]
    norms: torch.Tensor | list[float]  # pinned host tensor on CUDA, else the values
    event: Any  # torch.cuda.Event or None when already on the host

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())

    def read(self) -> CheckResult:
        return _read(self)


class GradCheck:
    """Known parameters (weakly held) and the checks still in flight."""

    def __init__(self, max_pending: int) -> None:
        self._refs: list[ParamRef] = []
        # id -> the reference tracking it: a dead parameter's id is soon reused (a rebuilt model's
        # parameter often gets the very address), so an id alone would skip the new parameter.
        self._known: dict[int, ParamRef] = {}
        # Plain tensors that require grad are checked only once they outlive the pass that found them:
        # hand-written parameters do, while inputs that require grad (a gradient penalty's interpolates,
        # adversarial examples) die with their step, and would enter the norm on every pass that searches.
        self._found: list[ParamRef] = []  # found during the current pass
        self._waiting: list[ParamRef] = []  # found during an earlier pass: checked from now on if alive
        # Tracked tensors that died since the lists were last pruned (a weakref callback counts them),
        # so that a pass prunes only when there is something to prune.
        self._deaths = 0
        self._pending: deque[_Pending] = deque()
        self._max_pending = max_pending
        self.dropped = 0
        # Set when a tracked nn.Parameter dies: its model was dropped, most likely for a
        # rebuilt one whose parameters the next pass should look for (the caller resets it).
        self.lost = False

    @property
    def known(self) -> int:
        return len(self._refs)

    def track(self, param: torch.Tensor) -> None:
        """Remember a parameter seen as an AccumulateGrad variable (weakly: models come and go)."""
        key = id(param)
        known = self._known.get(key)
        if known is None or known() is not param:
            # Only a parameter's death starts a search: inputs that require grad die every step
            # and would make every pass a graph search.
            is_parameter = isinstance(param, torch.nn.Parameter)
            ref: ParamRef = weakref.ref(param, self._on_lost if is_parameter else self._on_death)
            (self._refs if is_parameter else self._found).append(ref)
            self._known[key] = ref

    def _on_death(self, _ref: ParamRef) -> None:
        self._deaths += 1

    def _on_lost(self, _ref: ParamRef) -> None:
        self._deaths += 1
        self.lost = True

    def _settle(self) -> None:
        """Admit what an earlier pass found and is still alive; forget the dead."""
        self._deaths = 0
        if self._waiting:
            self._refs.extend(self._waiting)
        self._waiting, self._found = self._found, []
        self._refs = [ref for ref in self._refs if ref() is not None]
        known: dict[int, ParamRef] = {}
        for ref in self._waiting + self._refs:
            tensor = ref()
            if tensor is not None:
                known[id(tensor)] = ref
        self._known = known

    def launch(self, pass_index: int, kind: str) -> None:
        """Queue the reduction of every known parameter's gradient, one launch per device and dtype."""
        if self._deaths or self._waiting or self._found:
            self._settle()
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[ParamRef], list[torch.Tensor]]] = {}
        for ref in self._refs:
            param = ref()
            if param is None:
                continue
            grad = param.grad
            if grad is None:
                continue
            readable = _readable(grad)
            if readable is not None:
                group_refs, grads = groups.setdefault((readable.device, readable.dtype), ([], []))
                group_refs.append(ref)
                grads.append(readable)
        if groups:
            # The job's dispatch modes (FlopCounterMode, DebugMode, a memory tracker) must record its ops only.
            with torch.no_grad(), dispatch_modes_aside():
                for (device, dtype), (group_refs, grads) in groups.items():
                    self._enqueue(_launch_group(pass_index, kind, device, dtype, group_refs, grads))

    def _enqueue(self, pending: _Pending) -> None:
        if len(self._pending) >= self._max_pending:
            self._pending.popleft()
            self.dropped += 1
        self._pending.append(pending)

    def poll(self) -> list[CheckResult]:
        """Checks whose results reached the host, oldest first; never waits."""
        results: list[CheckResult] = []
        pending = self._pending
        if not pending:
            return results
        try:
            with dispatch_modes_aside():
                while True:
                    first = pending[0]
                    if not first.ready():
                        break
                    results.append(pending.popleft().read())
        except IndexError:
            pass  # empty, or another thread's pass (two backward threads) took the last one
        return results

    def clear(self) -> None:
        """Forget every parameter and every check in flight."""
        self._refs = []
        self._known = {}
        self._found = []
        self._waiting = []
        self._deaths = 0
        self._pending.clear()
        self.lost = False


def _readable(grad: torch.Tensor) -> torch.Tensor | None:
    """The tensor `_foreach_norm` should reduce for this gradient, or None when it has nothing to read."""
    if grad.is_sparse:
        # nn.Embedding(sparse=True): the stored values, as GradScaler reads them
        # (coalescing would sync the device; duplicates count apart in the norm).
        grad = grad._values()
    if not (grad.is_floating_point() or grad.is_complex()):
        return None
    # DTensor (FSDP2/TP): reduce the local shard; a collective here
    # could deadlock ranks that disagree about when to check.
    grad = getattr(grad, "_local_tensor", grad)
    # FSDP frees unsharded storage between uses: a freed gradient has nothing to read. The
    # parameter's storage does not matter: an FSDP2 micro-step without gradient sync frees
    # the unsharded parameter but keeps its gradient, the only copy of this rank's NaN.
    if grad.untyped_storage().size() == 0:
        return None
    # Meta tensors have no data: a job that counts its FLOPs or plans memory on the meta device
    # runs real passes on them, and reading one back would switch the probe off for the whole job.
    if grad.is_meta:
        return None
    return grad


# Half-precision norms overflow (fp16 tops out at 65504), so those reduce in
# float32 (a narrowing `dtype=` is refused: float64 and complex reduce as they are).
_FULL_PRECISION = (torch.float32, torch.float64, torch.complex64, torch.complex128)


def _norms(device: torch.device, dtype: torch.dtype, grads: list[torch.Tensor]) -> torch.Tensor:
    if dtype.itemsize == 1 or dtype == torch.complex32:
        # float8 and complex32 have no norm kernel and refuse `dtype=`: widen them first
        # (a copy, only for these).
        dtype = torch.complex64 if dtype.is_complex else torch.float32
        grads = [grad.to(dtype) for grad in grads]
    if device.type == "cuda":
        wide = torch.complex128 if dtype.is_complex else torch.float64
        return torch.stack(torch._foreach_norm(grads, 2, dtype=wide))
    out = None if dtype in _FULL_PRECISION else torch.float32
    return torch.stack(torch._foreach_norm(grads, 2, dtype=out))


def _launch_group(
    pass_index: int,
    kind: str,
    device: torch.device,
    dtype: torch.dtype,
    refs: list[ParamRef],
    grads: list[torch.Tensor],
) -> _Pending:
    norms = _norms(device, dtype, grads)
    if device.type != "cuda":
        # CPU ops ran synchronously; other devices read back as on CPU.
        values: list[float] = norms.cpu().tolist()
        if math.inf in values:
            # Maybe finite elements whose squares overflowed: the gradients are still at hand.
            values = [
                _wide_norm(grad) if value == math.inf else value for grad, value in zip(grads, values, strict=True)
            ]
        return _Pending(pass_index, kind, refs, values, None)
    host = torch.empty(norms.shape, dtype=norms.dtype, pin_memory=True)
    host.copy_(norms, non_blocking=True)
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    # The norms and the copy ran on the grads' device: a bare record() would mark
    # the current device's stream, and on cuda:1 poll() could read the buffer early.
    event.record(torch.cuda.current_stream(device))
    return _Pending(pass_index, kind, refs, host, event)


def _wide_norm(grad: torch.Tensor) -> float:
    wide = torch.complex128 if grad.is_complex() else torch.float64
    return float(torch.linalg.vector_norm(grad.detach().to("cpu", wide)))


def _read(pending: _Pending) -> CheckResult:
    norms = pending.norms
    values: list[float] = norms if isinstance(norms, list) else norms.tolist()
    nonfinite = tuple(ref for ref, value in zip(pending.refs, values, strict=True) if not math.isfinite(value))
    # Squares are >= 0, so fsum sees no inf - inf: NaN stays NaN, Inf stays Inf.
    norm = math.sqrt(math.fsum(v * v for v in values))
    return CheckResult(pending.pass_index, pending.kind, len(values), nonfinite, norm)


def merge(results: list[CheckResult]) -> list[CheckResult]:
    """One result per pass when a pass spanned several devices."""
    if len(results) == 1:
        return results
    merged: dict[int, CheckResult] = {}
    for result in results:
        previous = merged.get(result.pass_index)
        if previous is None:
            merged[result.pass_index] = result
            continue
        norm = math.hypot(previous.norm, result.norm)
        merged[result.pass_index] = CheckResult(
            result.pass_index,
            result.kind,
            previous.checked + result.checked,
            previous.nonfinite + result.nonfinite,
            norm,
        )
    return list(merged.values())
