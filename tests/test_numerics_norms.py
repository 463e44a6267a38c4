"""Norms: exact against float64, overflow-safe, NaN/inf told apart from spurious overflow, sync-free."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_overflow.numerics import (
    FP32_MAX,
    grad_norm_report,
    refine_norms,
    tensor_norms,
    total_norm,
)
from lightning_overflow.numerics.norms import plain_cpu, plain_norms

INF = math.inf


def reference(tensors: list[torch.Tensor], norm_type: float = 2.0) -> float:
    if norm_type == INF:
        return max((t.double().abs().max().item() for t in tensors if t.numel()), default=0.0)
    return math.sqrt(sum(t.double().square().sum().item() for t in tensors))


def test_hand_checked_values() -> None:
    norms = tensor_norms([torch.tensor([3.0, 4.0]), torch.tensor([7.0, 24.0])])
    assert norms.tolist() == [5.0, 25.0]
    assert total_norm(norms).item() == math.sqrt(25 + 625)
    assert total_norm(norms).dtype == torch.float64
    assert tensor_norms([torch.tensor([3.0, -4.0])], INF).tolist() == [4.0]
    assert total_norm(torch.tensor([5.0, 25.0]), INF).item() == 25.0


def test_empty_inputs() -> None:
    assert tensor_norms([]).numel() == 0
    assert total_norm(torch.zeros(0)).item() == 0.0
    assert tensor_norms([torch.zeros(0)]).tolist() == [0.0]
    assert tensor_norms([torch.zeros(0)], INF).tolist() == [0.0]
    assert grad_norm_report([]).total == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("norm_type", [2.0, INF])
def test_matches_float64_reference_for_each_dtype(dtype: torch.dtype, norm_type: float) -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = [(torch.randn(n, generator=gen) * s).to(dtype) for n, s in [(7, 1.0), (1000, 1e-3), (33, 50.0)]]
    norms = tensor_norms(tensors, norm_type)
    assert norms.dtype == torch.float32
    for t, n in zip(tensors, norms.tolist()):
        assert n == pytest.approx(reference([t], norm_type), rel=1e-5)
    assert total_norm(norms, norm_type).item() == pytest.approx(reference(tensors, norm_type), rel=1e-5)


def test_half_values_whose_half_norm_overflows_are_accumulated_in_fp32() -> None:
    t = torch.full((100,), 60000.0, dtype=torch.float16)  # finite fp16; the fp16 norm would be inf
    assert torch.linalg.vector_norm(t).isinf()
    assert tensor_norms([t]).item() == pytest.approx(600000.0, rel=1e-6)


def test_mixed_dtypes_in_one_call() -> None:
    tensors = [torch.tensor([3.0, 4.0]), torch.tensor([6.0, 8.0], dtype=torch.float16), torch.tensor([0.0], dtype=torch.bfloat16)]
    assert tensor_norms(tensors).tolist() == [5.0, 10.0, 0.0]


@pytest.mark.parametrize("magnitude", [1e20, 1e30, 3e38])
def test_finite_gradients_whose_squares_overflow_give_the_true_norm(magnitude: float) -> None:
    grads = [torch.full((10,), magnitude), torch.tensor([7.0, 24.0])]
    fast = tensor_norms(grads)
    assert math.isinf(fast[0].item())  # the FP32 arithmetic overflows...
    report = grad_norm_report(grads)
    assert report.status == ("overflow", "finite")
    assert report.finite and report.overflow
    expected = reference(grads)
    assert report.total == pytest.approx(expected, rel=1e-5)  # ...the report does not
    assert report.per_tensor[0] == pytest.approx(magnitude * math.sqrt(10), rel=1e-5)
    assert report.beyond_fp32 == (expected > FP32_MAX)


def test_clip_grad_norm_reports_inf_where_we_report_the_true_norm() -> None:
    p = torch.nn.Parameter(torch.zeros(10))
    p.grad = torch.full((10,), 1e20)
    assert math.isinf(torch.nn.utils.clip_grad_norm_([p], max_norm=1.0).item())
    p.grad = torch.full((10,), 1e20)
    assert grad_norm_report([p.grad]).total == pytest.approx(1e20 * math.sqrt(10), rel=1e-6)


@pytest.mark.parametrize(("value", "status"), [(float("nan"), "nonfinite"), (INF, "nonfinite"), (-INF, "nonfinite")])
def test_inf_and_nan_are_reported_as_such(value: float, status: str) -> None:
    t = torch.ones(50)
    t[17] = value
    report = grad_norm_report([torch.ones(3), t])
    assert report.status == ("finite", status)
    assert not report.finite and not report.overflow
    assert not math.isfinite(report.total)


def test_refine_recomputes_only_the_given_entries() -> None:
    big, small = torch.full((4,), 1e25), torch.tensor([3.0, 4.0])
    fast = tensor_norms([big, small])
    exact = refine_norms([big, small], fast, [0])
    assert exact.dtype == torch.float64
    assert exact.tolist() == pytest.approx([reference([big]), 5.0], rel=1e-12)
    assert refine_norms([big, small], fast, []).tolist()[0] == INF


def test_bad_norm_type_is_rejected() -> None:
    with pytest.raises(ValueError) as info:
        tensor_norms([torch.ones(2)], 1)
    assert str(info.value) == "'norm_type' must be 2 or inf (got 1)"
    with pytest.raises(ValueError) as info:
        total_norm(torch.ones(2), -math.inf)  # the smallest magnitude is not a norm this package computes
    assert str(info.value) == "'norm_type' must be 2 or inf (got -inf)"
    with pytest.raises(TypeError) as info:
        refine_norms([torch.ones(2)], torch.ones(1), [0], None)  # type: ignore[arg-type]
    assert str(info.value) == "'norm_type' must be 2 or inf (got None)"
    assert tensor_norms([torch.tensor([3.0, -4.0])], "inf").tolist() == [4.0]


def test_hot_path_is_sync_free_on_meta_tensors() -> None:
    # Any .item(), bool(t), `if t > x` or boolean mask raises on the meta device.
    meta = torch.device("meta")
    tensors = [torch.empty(5, device=meta), torch.empty(3, 2, device=meta, dtype=torch.float16), torch.empty(0, device=meta)]
    for norm_type in (2.0, INF):
        norms = tensor_norms(tensors, norm_type)
        assert norms.device.type == "meta" and norms.shape == (3,)
        total = total_norm(norms, norm_type)
        assert total.device.type == "meta" and total.dtype == torch.float64
        assert refine_norms(tensors, norms, [0, 1], norm_type).device.type == "meta"


finite_floats = st.floats(min_value=-(2.0**120), max_value=2.0**120, allow_nan=False, allow_subnormal=False, width=32)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(finite_floats, min_size=0, max_size=40), min_size=1, max_size=5))
def test_report_equals_float64_reference_for_any_finite_values(values: list[list[float]]) -> None:
    tensors = [torch.tensor(v, dtype=torch.float32) for v in values]
    report = grad_norm_report(tensors)
    assert report.finite
    # Squares of values below ~1.1e-19 underflow FP32: such norms read as 0, harmless for clipping and finiteness.
    assert report.total == pytest.approx(reference(tensors), rel=1e-5, abs=2e-19)


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(min_value=1, max_value=300),
    data=st.data(),
    bad=st.sampled_from([float("nan"), INF, -INF]),
)
def test_a_single_nonfinite_value_anywhere_makes_the_norm_nonfinite(size: int, data: st.DataObject, bad: float) -> None:
    position = data.draw(st.integers(min_value=0, max_value=size - 1))
    t = torch.randn(size)
    t[position] = bad
    for norm_type in (2.0, INF):
        assert not math.isfinite(tensor_norms([t], norm_type).item())
    assert grad_norm_report([t]).status == ("nonfinite",)


@pytest.mark.parametrize("threads", [1, 2])
def test_one_cpu_thread_and_several_give_the_same_norms_to_fp32_accuracy(threads: int) -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        tensors = [torch.randn(n, generator=gen) * s for n, s in [(7, 1.0), (4096, 1e-3), (300, 50.0)]]
        norms = tensor_norms(tensors)
        bad = tensor_norms([torch.ones(3), torch.tensor([1.0, math.nan]), torch.tensor([math.inf])])
    finally:
        torch.set_num_threads(previous)
    assert norms.dtype == torch.float32
    assert norms.tolist() == pytest.approx([reference([t]) for t in tensors], rel=1e-6)
    assert bad[0].item() == pytest.approx(math.sqrt(3)) and math.isnan(bad[1].item()) and math.isinf(bad[2].item())


def test_the_plain_path_gives_the_norms_of_the_general_one_bit_for_bit() -> None:
    """A step's fp32 CPU gradients take :func:`plain_norms` (their kinds checked once): the same floats, NaN, inf and
    empty tensors included; any other kind is left to :func:`tensor_norms`."""
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randn(n, generator=gen) * s for n, s in [(7, 1.0), (4096, 1e-3), (300, 1e20), (0, 1.0)]]
    tensors += [torch.tensor([1.0, math.nan]), torch.tensor([-INF, 2.0]), torch.randn(3, 5, generator=gen).t()]
    assert plain_cpu(tensors)
    assert torch.equal(plain_norms(tensors).view(torch.int32), tensor_norms(tensors).view(torch.int32))
    assert plain_norms([]).tolist() == []
    assert not plain_cpu([torch.ones(2), torch.ones(2, dtype=torch.float64)])
    assert not plain_cpu([torch.ones(2, dtype=torch.complex64)])
    assert not plain_cpu([torch.ones(2).to_sparse()])
