"""The C scan of CPU gradients (`_gradscan`) against torch's `isfinite`, and the check's use of it.

The default check (no global norm wanted) scans dense CPU gradients by their
exponent bits instead of reducing them with `torch._foreach_norm`: it must call
exactly the same gradients non-finite, for every format, length and position,
and refuse raw spans it cannot read whole.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.probes.autograd_support import autograd_agent, span_reader
from torchpulse.probes import autograd_nonfinite
from torchpulse.probes.autograd_nonfinite import _SCAN_FORMATS, GradCheck

scan = None if autograd_nonfinite._gradscan is None else autograd_nonfinite._gradscan.nonfinite
needs_scan = pytest.mark.skipif(scan is None, reason="_gradscan not built (no C compiler): torch reads instead")
# As in _gradscan_scan.c: a span is read as STREAMS parts in lockstep, BLOCK elements of each at a time
# (a NaN ends the scan at its block's end), and the last n % STREAMS elements after them. Scans of
# at least PARALLEL_MIN_BYTES per thread split across torch's OpenMP team.
STREAMS, BLOCK, PARALLEL_MIN_BYTES = 4, 4096, 256 * 1024
needs_team = pytest.mark.skipif(not autograd_nonfinite._SCAN_ON_TEAM, reason="no OpenMP team to split across")


def scanned(tensor: torch.Tensor) -> bool:
    """The scanner's answer for one dense tensor: does it hold a NaN or an Inf?"""
    assert scan is not None and tensor.is_contiguous()
    found = scan(_SCAN_FORMATS[tensor.dtype][0], [tensor.data_ptr()], [tensor.nbytes])
    assert found in ([], [0])
    return found == [0]


def nonfinite(tensor: torch.Tensor) -> bool:
    return not bool(torch.isfinite(tensor).all())


@needs_scan
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_16_bit_pattern_is_judged_as_isfinite_judges_it(dtype: torch.dtype) -> None:
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    assert scan is not None
    base = patterns.data_ptr()
    found = set(scan(_SCAN_FORMATS[dtype][0], [base + 2 * i for i in range(len(patterns))], [2] * len(patterns)))
    expected = set(torch.nonzero(~torch.isfinite(patterns)).flatten().tolist())
    assert len(expected) == 2 * (2 ** (7 if dtype == torch.bfloat16 else 10))  # both signs, every mantissa
    assert expected == found


@needs_scan
@settings(max_examples=300, deadline=None)
@given(bits=st.integers(0, 2**32 - 1))
def test_float32_bit_patterns(bits: int) -> None:
    value = torch.tensor([bits], dtype=torch.int64).to(torch.uint32).view(torch.float32)
    assert scanned(value) == nonfinite(value)


@needs_scan
@settings(max_examples=300, deadline=None)
@given(bits=st.integers(0, 2**64 - 1))
def test_float64_bit_patterns(bits: int) -> None:
    value = torch.tensor([bits - 2**63], dtype=torch.int64).view(torch.float64)
    assert scanned(value) == nonfinite(value)


def _finite_extremes(dtype: torch.dtype) -> list[float]:
    info = torch.finfo(dtype)
    return [info.max, -info.max, info.tiny, info.smallest_normal / 4, -0.0, 0.0]


@needs_scan
@settings(max_examples=200, deadline=None)
@given(dtype=st.sampled_from(list(_SCAN_FORMATS)),
       length=st.one_of(st.integers(1, 70), st.sampled_from(
           [STREAMS * BLOCK - 1, STREAMS * BLOCK, STREAMS * BLOCK + 3, 9 * BLOCK + 5, 3 * STREAMS * BLOCK + 2])),
       where=st.floats(0, 1), bad=st.sampled_from([math.nan, math.inf, -math.inf, None]),
       imaginary=st.booleans())
def test_one_bad_element_anywhere_is_found_and_finite_extremes_are_not(
        dtype: torch.dtype, length: int, where: float, bad: float | None, imaginary: bool) -> None:
    real = dtype.to_real()
    values = torch.randn(length, dtype=torch.float64).to(real)
    extremes = _finite_extremes(real)
    values[: len(extremes)] = torch.tensor(extremes[:length], dtype=real)
    if dtype.is_complex:
        pair = torch.stack([values, values.flip(0)], dim=-1)
        if bad is not None:
            pair[min(int(where * length), length - 1), int(imaginary)] = bad
        tensor = torch.view_as_complex(pair)
        expected = nonfinite(torch.view_as_real(tensor))
    else:
        if bad is not None:
            values[min(int(where * length), length - 1)] = bad
        tensor = values
        expected = nonfinite(tensor)
    assert expected == (bad is not None)
    assert scanned(tensor) == expected


@needs_scan
def test_only_the_spans_holding_a_bad_element_are_named_and_empty_spans_are_clean() -> None:
    tensors = [torch.zeros(5 * STREAMS * BLOCK + 3) for _ in range(5)] + [torch.zeros(0)]
    tensors[1][-1] = math.nan  # in the tail after the streams
    tensors[3][STREAMS * BLOCK] = -math.inf  # in the second block of the first stream
    tensors[4][(STREAMS - 1) * 5 * BLOCK + BLOCK - 1] = math.inf  # at the end of the last stream's first block
    assert scan is not None
    assert [1, 3, 4] == scan(2, [t.data_ptr() for t in tensors], [t.nbytes for t in tensors])
    assert [] == scan(2, [0], [0])


@needs_team
@settings(max_examples=60, deadline=None)
@given(threads=st.integers(2, 5), cuts=st.lists(st.integers(0, 700_000), min_size=1, max_size=6),
       marks=st.lists(st.integers(0, 2**31), max_size=3), edge=st.sampled_from([None, -1, 0]))
def test_a_scan_split_across_threads_names_what_one_thread_names(
        threads: int, cuts: list[int], marks: list[int], edge: int | None) -> None:
    """Each thread scans an equal share of the spans laid end to end: shares start and end inside
    spans, and a bad element on either side of a share's edge, or in the last thread's remainder,
    is found and put on its own span."""
    assert scan is not None and autograd_nonfinite._gradscan is not None
    total = max(threads * PARALLEL_MIN_BYTES // 4 + 7, max(cuts) + 1)
    buffer = torch.zeros(total)
    edges = sorted({0, total, *cuts})
    spans = [buffer[a:b] for a, b in itertools.pairwise(edges)]
    share = total // threads
    places = [m % total for m in marks]
    if edge is not None:  # the last element before every share's edge, or the first after it
        places += [share * k + edge for k in range(1, threads)] + ([total - 1] if edge else [])
    buffer[places] = math.nan
    expected = sorted({i for i, (a, b) in enumerate(itertools.pairwise(edges))
                       if any(a <= p < b for p in places)})
    addresses, lengths = [t.data_ptr() for t in spans], [t.nbytes for t in spans]
    assert expected == scan(2, addresses, lengths, threads)
    assert threads == autograd_nonfinite._gradscan.last_threads()  # the team ran it, not one thread
    assert expected == scan(2, addresses, lengths, 1)
    assert 1 == autograd_nonfinite._gradscan.last_threads()


@needs_team
def test_small_scans_stay_on_the_calling_thread_and_a_failed_lookup_keeps_the_team() -> None:
    gradscan = autograd_nonfinite._gradscan
    assert gradscan is not None
    small, large = torch.zeros(2 * PARALLEL_MIN_BYTES // 4 - 1), torch.zeros(2 * PARALLEL_MIN_BYTES // 4)
    assert [] == gradscan.nonfinite(2, [small.data_ptr()], [small.nbytes], 2)
    assert 1 == gradscan.last_threads()  # waking the team would cost more than the split saves
    # A library that is not loaded, or one without an OpenMP runtime: refused, and nothing changes.
    assert gradscan.use_openmp("/nonexistent/libgomp.so.1") is False
    assert gradscan.use_openmp(gradscan.__file__) is False
    assert [] == gradscan.nonfinite(2, [large.data_ptr()], [large.nbytes], 2)
    assert 2 == gradscan.last_threads()


@needs_team
def test_the_check_scans_on_as_many_threads_as_torch_uses() -> None:
    gradscan = autograd_nonfinite._gradscan
    assert gradscan is not None
    param = torch.nn.Parameter(torch.zeros(1 << 20))
    param.grad = torch.zeros(1 << 20)
    check = GradCheck(max_pending=4, norms=False)
    check.track(param)
    saved = torch.get_num_threads()
    try:
        for index, threads in enumerate((2, 1, 3)):
            torch.set_num_threads(threads)
            check.launch(index, "backward")
            assert threads == gradscan.last_threads()
            assert f"(last scan: {threads} threads)" in check.cpu_reader
    finally:
        torch.set_num_threads(saved)
    assert [1, 1, 1] == [r.checked for r in check.poll()]


@needs_scan
@pytest.mark.parametrize(("call", "message"), [
    (lambda s, p: s(2, [p], [6]), "whole"),  # a length that is not whole float32s
    (lambda s, p: s(2, [0], [4]), "whole"),  # no address at all
    (lambda s, p: s(2, [p], [-4]), "whole"),
    (lambda s, p: s(9, [p], [4]), "unknown format"),
    (lambda s, p: s(2, [p, p], [4]), "differ in length"),
])
def test_spans_it_cannot_read_whole_are_refused(call: Callable[[Any, int], object], message: str) -> None:
    buffer = torch.zeros(4)
    with pytest.raises(ValueError, match=message):
        call(scan, buffer.data_ptr())
    with pytest.raises(TypeError):
        scan(2, (buffer.data_ptr(),), [4])  # type: ignore[misc]


@needs_scan
@pytest.mark.parametrize("offset", [1, 2, 3])
def test_gradients_at_any_byte_address_are_scanned(offset: int) -> None:
    """`torch.frombuffer` makes float tensors at odd addresses; the scan reads them as they are."""
    memory = bytearray(4 * 40)
    tensor = torch.frombuffer(memory, dtype=torch.float32, offset=offset, count=39)
    assert tensor.data_ptr() % 4 == offset % 4
    assert not scanned(tensor)
    tensor[37] = math.nan
    assert scanned(tensor)


def _mixed_parameters() -> list[torch.nn.Parameter]:
    """Gradients of every shape the check meets on a CPU, half of them holding a NaN or an Inf."""
    grads = [
        torch.ones(64, 32),
        torch.ones(64, 32).t(),  # not contiguous: read through torch
        torch.ones(3, dtype=torch.bfloat16),
        torch.ones(3, dtype=torch.float16),
        torch.ones(3, dtype=torch.float64),
        torch.ones(3, dtype=torch.complex64),
        torch.ones(3).to(torch.float8_e5m2),  # no scan format: read through torch
        # Its values are read, through torch.
        torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.ones(2), (4,), check_invariants=True),
        torch.ones(2, 8, 3, 3).to(memory_format=torch.channels_last),
    ]
    params = []
    for index, grad in enumerate(grads):
        param = torch.nn.Parameter(torch.zeros(grad.shape, dtype=grad.dtype))
        if index % 2:
            values = grad._values() if grad.is_sparse else grad
            values = torch.view_as_real(values) if values.is_complex() else values
            values[(-1,) * values.dim()] = math.nan if index % 4 == 1 else math.inf
        param.grad = grad
        params.append(param)
    return params


def _check(params: list[torch.nn.Parameter], *, norms: bool) -> autograd_nonfinite.CheckResult:
    check = GradCheck(max_pending=64, norms=norms)
    for param in params:
        check.track(param)
    check.launch(0, "backward")
    [result] = autograd_nonfinite.merge(check.poll())
    return result


@pytest.mark.parametrize("way", ["shim", "bindings"])
def test_the_scan_and_the_norms_call_the_same_gradients_nonfinite(way: str) -> None:
    params = _mixed_parameters()
    with span_reader(way):
        by_norms, by_scan = _check(params, norms=True), _check(params, norms=False)
    expected = {id(p) for i, p in enumerate(params) if i % 2}
    assert expected == {id(ref()) for ref in by_norms.nonfinite} == {id(ref()) for ref in by_scan.nonfinite}
    assert len(params) == by_norms.checked == by_scan.checked
    assert math.isfinite(by_norms.norm) is False and math.isnan(by_scan.norm)  # no norm without the option


@pytest.mark.parametrize("way", ["shim", "bindings"])
def test_views_of_freed_or_shrunk_storage_are_not_read(way: str) -> None:
    """FSDP frees storage under views of it: a view whose storage no longer holds it has nothing to read
    (and reading its address would read freed memory)."""
    freed, shrunk = torch.nn.Parameter(torch.zeros(1024)), torch.nn.Parameter(torch.zeros(1024))
    first, second = torch.full((4, 1024), math.nan), torch.full((4, 1024), math.nan)
    freed.grad, shrunk.grad = first[2], second[3]
    first.untyped_storage().resize_(0)
    second.untyped_storage().resize_(16)
    check = GradCheck(max_pending=4, norms=False)
    check.track(freed)
    check.track(shrunk)
    with span_reader(way):
        check.launch(0, "backward")
    assert [] == check.poll()  # nothing was read, so nothing was checked


def test_the_default_check_scans_cpu_gradients_and_the_norm_option_reduces_them(monkeypatch: Any) -> None:
    """The scan is what runs by default (a regression to `_foreach_norm` would cost a third more)."""
    calls: list[int] = []
    original = torch._foreach_norm

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_norm", counted)
    model = torch.nn.Linear(8, 8)
    for grad_norm, expected_calls in (("0", 0 if scan is not None else 1), ("1", 1)):
        calls.clear()
        with autograd_agent(grad_norm=grad_norm) as agent:
            model(torch.ones(2, 8)).sum().backward()
            model.zero_grad(set_to_none=True)
            agent.drain()
            assert 0 == agent.store.value("grad_nonfinite_passes_total", ())
        assert expected_calls == len(calls)


def test_dead_parameters_are_pruned_once_they_die_and_not_before() -> None:
    check = GradCheck(max_pending=4, norms=False)
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    for param in params:
        param.grad = torch.zeros(2)
        check.track(param)
    del param
    kept = check._refs
    check.launch(0, "backward")
    assert check._refs is kept  # nothing died: the list is not rebuilt
    dead = weakref.ref(params.pop())
    assert dead() is None and check.lost
    check.launch(1, "backward")
    assert 2 == check.known and 2 == len(check._known)
    assert [3, 2] == [r.checked for r in autograd_nonfinite.merge(check.poll())]


@needs_scan
def test_torch_shim_tells_the_scan_where_tensors_lie_on_this_torch() -> None:
    """torch 2.13 has the shim and it agrees with the bindings: the fast way is the one in use."""
    assert autograd_nonfinite._gradscan is not None
    assert autograd_nonfinite._gradscan.torch_shim_enabled(), autograd_nonfinite._SHIM_MISSING
    assert autograd_nonfinite.scan_limits() is None


@st.composite
def _tensors(draw: st.DrawFn) -> torch.Tensor:
    """A view of a CPU tensor: any dtype the scan reads or not, sliced, stepped, transposed or expanded."""
    dtype = draw(st.sampled_from([d for d in _SCAN_FORMATS if d != torch.complex32] + [torch.int64, torch.bool]))
    shape = draw(st.lists(st.integers(0, 5), min_size=1, max_size=3))
    tensor = torch.zeros(shape, dtype=dtype)
    for dim, size in enumerate(shape):
        start = draw(st.integers(0, size))
        tensor = tensor.narrow(dim, start, draw(st.integers(0, size - start)))
        if draw(st.booleans()) and tensor.shape[dim] > 1:
            tensor = tensor[(slice(None),) * dim + (slice(None, None, 2),)]
    if tensor.dim() > 1 and draw(st.booleans()):
        tensor = tensor.transpose(0, -1)
    if draw(st.booleans()):
        tensor = tensor.unsqueeze(0).expand(2, *tensor.shape)
    return tensor


@needs_scan
@settings(max_examples=300, deadline=None)
@given(_tensors())
def test_the_shim_and_the_bindings_give_the_same_span_for_any_view(tensor: torch.Tensor) -> None:
    module = autograd_nonfinite._gradscan
    assert module is not None
    with span_reader("shim"):
        by_shim = module.dense_span(tensor)
    with span_reader("bindings"):
        by_bindings = module.dense_span(tensor)
    assert by_shim == by_bindings
    if by_shim is not None:  # only what is contiguous and of a scan dtype
        assert tensor.is_contiguous() and tensor.dtype in _SCAN_FORMATS
        # Held: whole in its storage (an empty view may start past the end of an empty storage).
        held = tensor.storage_offset() * tensor.element_size() + tensor.nbytes <= tensor.untyped_storage().nbytes()
        address = tensor.data_ptr() if held else 0
        assert (_SCAN_FORMATS[tensor.dtype][0], address, tensor.nbytes, held) == by_shim
    else:
        assert not tensor.is_contiguous() or tensor.dtype not in _SCAN_FORMATS


@needs_scan
def test_a_shim_that_disagrees_or_is_missing_leaves_the_bindings_in_use(monkeypatch: Any) -> None:
    module = autograd_nonfinite._gradscan
    assert module is not None

    class Lying:
        """The real module, but its spans through the shim are one byte short."""

        def __getattr__(self, name: str) -> Any:
            return getattr(module, name)

        def dense_span(self, tensor: torch.Tensor) -> Any:
            span = module.dense_span(tensor)
            return span if span is None or not module.torch_shim_enabled() else (*span[:2], span[2] - 1, span[3])

    try:
        monkeypatch.setattr(autograd_nonfinite, "_gradscan", Lying())
        assert "disagrees" in (autograd_nonfinite._use_torch_shim() or "")
        assert not module.torch_shim_enabled()
        monkeypatch.setattr(torch._C, "__file__", "/nonexistent/_C.so")
        assert "not found" in (autograd_nonfinite._use_torch_shim() or "")
        assert not module.torch_shim_enabled()
    finally:
        monkeypatch.undo()
        assert autograd_nonfinite._use_torch_shim() is None and module.torch_shim_enabled()
