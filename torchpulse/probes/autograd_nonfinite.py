"""Non-finite gradient detection with one fused reduction per device and no host sync.

After a pass that accumulated into `.grad`, the per-parameter L2 norms are
computed on the device by `torch._foreach_norm` (one launch per device and
dtype for all parameters; NaN/Inf in any element makes the norm non-finite). On CUDA
the result is copied to pinned host memory with `non_blocking=True` and an
event is recorded; `poll()` reads only checks whose event has completed, so the
training thread never waits for the device.

On CPU the check runs on the training thread and costs one read of every
gradient. Where the global norm is not wanted (`autograd_grad_norm` off, the
default), dense CPU gradients are scanned by the C module `_gradscan` instead: it
tests exponent bits at the speed memory delivers them, about a third faster than
`_foreach_norm`, which squares and adds every element. Where torch runs its kernels
on an OpenMP team of more than one thread, the scan splits across that team (one
core alone reads at a fraction of what memory delivers to several). Without that
module (no compiler at install time) `_foreach_norm` does it.

Better still, a CPU parameter's gradient is scanned by a C hook (`_gradscan.Hook`,
a post-accumulate-grad hook) the moment the engine has accumulated it, while much
of it is still in cache; the end of the pass then only confirms that the gradient
is the one scanned. Not where something may rewrite gradients after that hook:
torch.distributed (DDP all-reduces them in place at the end of the pass), compiled
autograd (it would trace the hook into its graph), or a job's own post-accumulate
hook registered after ours (ours is moved behind it for the next pass).

In the middle of a pass every call into torch's Python bindings is cold, so the C
module asks torch's stable C shim (`aoti_torch_*`, what AOTInductor's compiled models
call) where a tensor lies, once it has given the same answers as the bindings for a set
of sample tensors (`_use_torch_shim`); and the end of the pass is one C call
(`_gradscan.check`) over every parameter, with Python left only what it cannot read raw.

The converse needs care: squares of float32 values overflow above ~1.8e19, so a
finite gradient can have an infinite float32 norm. On CUDA the norms accumulate
in float64 (the reduction is bound by memory bandwidth, so this costs nothing
measurable); elsewhere results are on the host at once, and only an infinite
norm is computed again in float64 (on CPU a float64 reduction costs 1.6-3.7x).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from torchpulse.c_modules import optional_module
from torchpulse.probes import torch_features as tf

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

ParamRef = weakref.ReferenceType[torch.Tensor]


# dtype -> (the scanner's format code, bytes per element). Complex dtypes are scanned as their
# real and imaginary parts. float8 formats are left to torch: e4m3fn has no Inf and one NaN code.
_SCAN_FORMATS: dict[torch.dtype, tuple[int, int]] = {
    torch.float16: (0, 2), torch.bfloat16: (1, 2), torch.float32: (2, 4), torch.float64: (3, 8),
    torch.complex32: (0, 4), torch.complex64: (2, 8), torch.complex128: (3, 16),
}

# None where it was not built (no compiler at install time): `_foreach_norm` then reads CPU gradients too.
_gradscan = optional_module("torchpulse.probes._gradscan")
if _gradscan is not None:
    # What it may read raw: plain strided tensors of the dtypes above.
    _gradscan.configure(torch.Tensor, torch.strided, _SCAN_FORMATS)
Scanner = Callable[[int, list[int], list[int], int], list[int]]  # _gradscan.nonfinite
# Whether scans can run on torch's own OpenMP team, found through torch's extension module (torch
# builds for Linux and macOS use OpenMP; others run each scan on the training thread).
_TORCH_HAS_OPENMP = bool(torch.backends.openmp.is_available())  # type: ignore[no-untyped-call]
_SCAN_ON_TEAM: bool = (_gradscan is not None and _TORCH_HAS_OPENMP
                       and _gradscan.use_openmp(getattr(torch._C, "__file__", "")))


def _shim_samples() -> list[torch.Tensor]:
    """Tensors that take every branch of the C module's span check: each scan dtype, other dtypes,
    views (offset, transposed, channels-last), empty, sparse, meta, and a view of freed storage.
    On the CPU whatever the job's default device is (a CUDA one would make both ways answer None)."""
    cpu = torch.device("cpu")
    base = torch.arange(24, dtype=torch.float32, device=cpu).reshape(2, 3, 4)
    freed = torch.zeros(4, 4, device=cpu)[1:]
    freed.untyped_storage().resize_(0)
    samples = [base, base[1], base[:, 1:], base.transpose(0, 2), torch.empty(0, device=cpu),
               torch.zeros(3, dtype=torch.int32, device=cpu),
               torch.zeros(2, 3, 4, 5, device=cpu).to(memory_format=torch.channels_last),
               torch.eye(3, device=cpu).to_sparse(), torch.empty(4, device="meta"), freed,
               torch.nn.Parameter(torch.zeros(2, device=cpu))]
    # Not complex32: making one warns the job (once) that ComplexHalf is experimental.
    for dtype in _SCAN_FORMATS:
        if dtype != torch.complex32:
            samples += [torch.zeros(5, dtype=dtype, device=cpu), torch.zeros(6, dtype=dtype, device=cpu)[2:]]
    return samples


def _shim_codes() -> dict[int, tuple[int, int]]:
    """The scan formats by c10::ScalarType code, from the shim's own dtype constants."""
    assert _gradscan is not None
    return {_gradscan.shim_dtype(str(dtype).removeprefix("torch.")): spec for dtype, spec in _SCAN_FORMATS.items()}


def _use_torch_shim() -> str | None:
    """Read the facts about a tensor through torch's stable C shim where it gives the same spans as
    torch's Python bindings for every sample; else None, and the reason the bindings read them."""
    if _gradscan is None:
        return None
    if not _gradscan.find_torch_shim(getattr(torch._C, "__file__", "")):
        return "torch's C shim (aoti_torch_*) was not found through torch._C"
    try:
        samples = _shim_samples()
        by_bindings = [_gradscan.dense_span(tensor) for tensor in samples]
        _gradscan.use_torch_shim(_shim_codes())
        by_shim = [_gradscan.dense_span(tensor) for tensor in samples]
    except (RuntimeError, ValueError, TypeError) as exc:
        _gradscan.use_torch_shim(None)
        return f"torch's C shim failed on a sample tensor: {exc}"
    if by_shim != by_bindings:
        _gradscan.use_torch_shim(None)
        return "torch's C shim disagrees with torch's bindings about a sample tensor"
    return None


# Why torch's bindings give the C module its tensor facts, or None where torch's C shim does (or
# where there is no C module).
_SHIM_MISSING = _use_torch_shim()


# Whether this torch build has torch.distributed at all (a build fact: asked once, not every pass).
_DISTRIBUTED_BUILT = bool(torch.distributed.is_available())


def scan_threads() -> int:
    """Threads a scan may use: as many as torch's kernels, the job's setting, read each pass (it may change)."""
    return torch.get_num_threads() if _SCAN_ON_TEAM else 1


def scan_limits() -> str | None:
    """Why CPU gradients are read more slowly than this build could, or None where nothing is missing."""
    if _gradscan is None:
        return "the C module _gradscan was not built (no compiler at install time): torch._foreach_norm reads them"
    if not _TORCH_HAS_OPENMP:
        return "torch was built without OpenMP: the scan runs on the training thread alone"
    if not _SCAN_ON_TEAM:
        return "torch's OpenMP runtime was not found through torch._C: the scan runs on the training thread alone"
    if _SHIM_MISSING is not None:
        return f"{_SHIM_MISSING}: torch's Python bindings tell the scan where gradients lie (slower mid-pass)"
    return None


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


class _Scan:
    """Dense CPU gradients of one format, by address and length, for `_gradscan.nonfinite`."""

    __slots__ = ("addresses", "lengths", "refs")

    def __init__(self) -> None:
        self.refs: list[ParamRef] = []
        self.addresses: list[int] = []
        self.lengths: list[int] = []


class GradCheck:
    """Known parameters (weakly held) and the checks still in flight."""

    # Smallest gradient scanned by a hook during the pass: a hook's torch calls cost more in the
    # middle of a pass than the same checks after it, which only a big gradient read in cache repays.
    # The probe's time per pass on the benchmark model (bench/autograd_overhead.py, one thread):
    # 723-756 µs from 256 KiB, 748-752 from 512 KiB, 777-783 from 1 MiB, 825-827 without hooks.
    hook_min_bytes = 256 * 1024

    def __init__(self, max_pending: int, norms: bool = True) -> None:
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
        self._pending: deque[_Pending | CheckResult] = deque()  # a result: answered on the host already
        self._max_pending = max_pending
        # The CPU scan answers finite or not, without a norm: used only where no norm is wanted.
        self._scan: Scanner | None = None if norms or _gradscan is None else _gradscan.nonfinite
        # Scanning during the pass (see the module's docstring): one C hook per dtype, the parameters
        # hooked (id -> the reference tracked and the handle), and what the hooks found this pass.
        self._hooking = self._scan is not None
        self._hook_for: dict[torch.dtype, Any] = {}
        self._hooked: dict[int, tuple[ParamRef, RemovableHandle]] = {}
        self._hooks_stale = False  # parameters tracked since the hooks were last placed
        # What the hooks found this pass (`_gradscan.Answers`: get(param) -> (gradient, found) | None).
        self._answers: Any = _gradscan.Answers() if _gradscan is not None else {}
        self._armed_threads = 0  # scan_threads() as `arm` read it for this pass (0: not armed)
        self.dropped = 0
        # Set when a tracked nn.Parameter dies: its model was dropped, most likely for a
        # rebuilt one whose parameters the next pass should look for (the caller resets it).
        self.lost = False

    @property
    def known(self) -> int:
        return len(self._refs)

    @property
    def cpu_reader(self) -> str:
        """How CPU gradients are read, for `torchpulse status` (device gradients: `_foreach_norm`)."""
        if self._scan is None or _gradscan is None:
            return "foreach_norm"
        where = "during the pass" if self._hooked else "after the pass"
        if not _SCAN_ON_TEAM:
            return f"scan on the training thread, {where}"
        return f"scan on torch's OpenMP team (last scan: {_gradscan.last_threads()} threads), {where}"

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
            self._hooks_stale = self._hooking

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
            self._hooks_stale = self._hooking
        self._waiting, self._found = self._found, []
        self._refs = [ref for ref in self._refs if ref() is not None]
        known: dict[int, ParamRef] = {}
        for ref in self._waiting + self._refs:
            tensor = ref()
            if tensor is not None:
                known[id(tensor)] = ref
        self._known = known

    # -- scanning during the pass (training thread, between passes or at a pass's start) --------------
    def arm(self) -> None:
        """Let the hooks scan the gradients the pass about to run accumulates."""
        self._answers.clear()
        if not self._hooking:
            return
        if _DISTRIBUTED_BUILT and torch.distributed.is_initialized():
            self.stop_hooking()  # DDP and FSDP write gradients after they are accumulated
            return
        if self._hooks_stale:
            self._place_hooks()
        threads = self._armed_threads = scan_threads()
        for hook in self._hook_for.values():
            hook.threads = threads
            hook.armed = 1

    def disarm(self) -> None:
        """Between passes the hooks do nothing, and no gradient is held for them."""
        for hook in self._hook_for.values():
            hook.armed = 0
        self._armed_threads = 0
        self._answers.clear()

    def stop_hooking(self) -> None:
        """Read gradients after the pass from now on (compiled autograd, torch.distributed)."""
        self._hooking = False
        self.remove()

    def remove(self) -> None:
        """Remove every hook placed; not while torch runs those hooks (the caller makes sure: the
        probe's uninstall, through `_keep`, or a pass's start)."""
        self.disarm()
        hooked, self._hooked = self._hooked, {}
        for _ref, handle in hooked.values():
            handle.remove()
        self._hooks_stale = self._hooking

    def _place_hooks(self) -> None:
        self._hooks_stale = False
        hooked = self._hooked
        for key in [key for key, (ref, _handle) in hooked.items() if ref() is None]:
            del hooked[key]
        for ref in self._refs:
            param = ref()
            if param is None:
                continue
            placed = hooked.get(id(param))
            if placed is not None:
                if placed[0] is ref:
                    continue
                placed[1].remove()  # tracked anew (after a re-install): one hook per parameter
                del hooked[id(param)]
            hook = self._hook(param)
            if hook is None:
                continue
            # RuntimeError: it no longer requires grad; a gradient it has is read after the pass.
            with contextlib.suppress(RuntimeError):
                handle = param.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]
                hooked[id(param)] = (ref, handle)

    def _hook(self, param: torch.Tensor) -> Any:
        """The C hook for this parameter's dtype, or None where its gradient must be read after the pass."""
        spec = _SCAN_FORMATS.get(param.dtype)
        if (spec is None or _gradscan is None or not param.is_cpu or param.layout is not torch.strided
                or type(param) not in (torch.nn.Parameter, torch.Tensor) or param.nbytes < self.hook_min_bytes):
            return None
        hook = self._hook_for.get(param.dtype)
        if hook is None:
            hook = self._hook_for[param.dtype] = _gradscan.Hook(spec[0], spec[1], self._answers)
        return hook

    def _answered(self, param: torch.Tensor, grad: torch.Tensor) -> bool | None:
        """Whether a hook found this gradient non-finite during the pass; None where it did not scan it."""
        answer: tuple[torch.Tensor, bool] | None = self._answers.get(param)
        if answer is None or answer[0] is not grad:
            return None
        hooks: dict[int, Any] | None = param._post_accumulate_grad_hooks
        if hooks is not None and len(hooks) > 1:
            # The job's own hook ran after ours and may have changed the gradient: put ours last.
            # torch runs them in the order of the plain dict under its OrderedDict (PyDict_Values),
            # which OrderedDict.move_to_end leaves as it was: remove and insert again.
            placed = self._hooked.get(id(param))
            if placed is None:
                return None
            if next(reversed(dict.keys(hooks))) != placed[1].id:
                hooks[placed[1].id] = hooks.pop(placed[1].id)
                return None
        return answer[1]

    def launch(self, pass_index: int, kind: str) -> None:
        """Queue the check of every known parameter that has a gradient: scanned or reduced."""
        if self._deaths or self._waiting or self._found:
            self._settle()
        refs = self._refs
        checked, nonfinite = 0, []
        answers = self._answers
        if self._scan is not None and _gradscan is not None:
            # One C call answers what the hooks scanned and scans what it may read raw; per parameter,
            # the same loop in Python costs several times more (its objects are cold after the pass).
            checked, found, left = _gradscan.check(refs, answers, self._armed_threads or scan_threads())
            nonfinite = [refs[i] for i in found]
            refs = [refs[i] for i in left]
        scans: dict[int, _Scan] = {}
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[ParamRef], list[torch.Tensor]]] = {}
        for ref in refs:
            param = ref()
            if param is None:
                continue
            grad = param.grad
            if grad is None:
                continue
            if answers:
                answer = self._answered(param, grad)
                if answer is not None:
                    checked += 1
                    if answer:
                        nonfinite.append(ref)
                    continue
            span = _gradscan.dense_span(grad) if self._scan is not None and _gradscan is not None else None
            if span is not None:
                # (format, address, nbytes, held). Raw reads only of what the storage still holds: FSDP frees
                # the storage under views of it (see `_readable`), and the view keeps its old address.
                code, address, nbytes, held = span
                if held:
                    scan = scans.get(code)
                    if scan is None:
                        scan = scans[code] = _Scan()
                    scan.refs.append(ref)
                    scan.addresses.append(address)
                    scan.lengths.append(nbytes)
                continue
            readable = _readable(grad)
            if readable is not None:
                group_refs, grads = groups.setdefault((readable.device, readable.dtype), ([], []))
                group_refs.append(ref)
                grads.append(readable)
        answers.clear()  # the gradients it holds are the job's to free
        if scans and self._scan is not None:
            threads = scan_threads()
            for code, scan in scans.items():
                checked += len(scan.refs)
                nonfinite.extend(scan.refs[i] for i in self._scan(code, scan.addresses, scan.lengths, threads))
        if checked:  # answered on the host already: one result for the whole pass
            self._enqueue(CheckResult(pass_index, kind, checked, tuple(nonfinite), math.nan))
        if groups:
            # The job's dispatch modes (FlopCounterMode, DebugMode, a memory tracker) must record its ops only.
            with torch.no_grad(), tf.dispatch_modes_aside():
                for (device, dtype), (group_refs, grads) in groups.items():
                    self._enqueue(_launch_group(pass_index, kind, device, dtype, group_refs, grads))

    def _enqueue(self, pending: _Pending | CheckResult) -> None:
        if len(self._pending) >= self._max_pending:
            self._pending.popleft()
            self.dropped += 1
        self._pending.append(pending)

    def poll(self) -> list[CheckResult]:
        """Checks whose results reached the host, oldest first; never waits."""
        results: list[CheckResult] = []
        pending = self._pending
        try:
            # Scans answered on the host need no reading back (and on CPU they are all there is).
            while pending and type(pending[0]) is CheckResult:
                results.append(_taken(pending.popleft()))
            if pending:
                with tf.dispatch_modes_aside():
                    while True:
                        first = pending[0]
                        if isinstance(first, _Pending) and not first.ready():
                            break
                        results.append(_taken(pending.popleft()))
        except IndexError:
            pass  # empty, or another thread's pass (two backward threads) took the last one
        return results

    def clear(self) -> None:
        """Forget everything but the hooks placed: `remove` takes those out, where torch allows."""
        self.disarm()
        self._hooking = self._scan is not None
        self._refs = []
        self._known = {}
        self._found = []
        self._waiting = []
        self._deaths = 0
        self._pending.clear()
        self.lost = False


def _taken(pending: _Pending | CheckResult) -> CheckResult:
    return pending.read() if isinstance(pending, _Pending) else pending


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


def _launch_group(pass_index: int, kind: str, device: torch.device, dtype: torch.dtype,
                  refs: list[ParamRef], grads: list[torch.Tensor]) -> _Pending:
    norms = _norms(device, dtype, grads)
    if device.type != "cuda":
        # CPU ops ran synchronously; other devices read back as on CPU.
        values: list[float] = norms.cpu().tolist()
        if math.inf in values:
            # Maybe finite elements whose squares overflowed: the gradients are still at hand.
            values = [_wide_norm(grad) if value == math.inf else value
                      for grad, value in zip(grads, values, strict=True)]
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
    nonfinite = tuple(ref for ref, value in zip(pending.refs, values, strict=True)
                      if not math.isfinite(value))
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
            result.pass_index, result.kind, previous.checked + result.checked,
            previous.nonfinite + result.nonfinite, norm)
    return list(merged.values())
