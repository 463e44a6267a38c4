"""Clipping numerics: hand-checkable values, float64 references, NaN never in the statistics, sync-free on meta."""

from __future__ import annotations

import io
import math
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_numerics import PercentileState, ZScoreState, percentile_threshold, zscore_threshold

from lightning_overflow.numerics import _float64, grad_norm_report
from lightning_overflow.numerics.agc import (
    agc_,
    agc_coefficients,
    agc_coefficients_and_norms,
    smallest_coefficient,
    unitwise_norms,
)
from lightning_overflow.numerics.clipping import (
    FP32_TINY,
    HostPercentile,
    HostZScore,
    clip_coefficient,
    clip_grad_norm_,
    host_clip_coefficient,
    scale_grads_,
)

NAN, INF = float("nan"), float("inf")


def norm64(tensors: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(torch.sum(t.double() ** 2)) for t in tensors))


# ---- fixed ----------------------------------------------------------------------------------------------------------
def test_fixed_clip_by_hand() -> None:
    grads = [torch.tensor([7.0, 24.0])]
    total, coef = clip_grad_norm_(grads, max_norm=5.0)
    assert total.item() == 25.0 and coef.item() == pytest.approx(0.2, abs=0)
    torch.testing.assert_close(grads[0], torch.tensor([1.4, 4.8]))


def test_fixed_clip_over_several_tensors() -> None:
    grads = [torch.tensor([3.0, 4.0]), torch.tensor([[12.0]])]  # norm 13
    total, coef = clip_grad_norm_(grads, max_norm=6.5)
    assert total.item() == 13.0 and coef.item() == 0.5
    assert torch.equal(grads[0], torch.tensor([1.5, 2.0])) and torch.equal(grads[1], torch.tensor([[6.0]]))


def test_fixed_clip_below_the_threshold_leaves_the_gradients_bit_identical() -> None:
    original = torch.randn(50, dtype=torch.float32)
    grads = [original.clone()]
    _, coef = clip_grad_norm_(grads, max_norm=1e6)
    assert coef.item() == 1.0 and torch.equal(grads[0], original)


def test_finite_gradients_whose_fp32_norm_overflows_are_scaled_to_max_norm_not_zeroed() -> None:
    big = [torch.full((10,), 1e20), torch.tensor([3.0, -4.0])]
    reference = [torch.nn.Parameter(torch.zeros_like(t)) for t in big]
    for p, g in zip(reference, big):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(reference, 5.0)  # torch's own, for contrast
    assert all(torch.count_nonzero(p.grad) == 0 for p in reference)  # it zeroes the whole step, silently

    exact = grad_norm_report(big).total
    assert exact == pytest.approx(norm64(big), rel=1e-12) and exact > 3e20
    total, coef = clip_grad_norm_(big, 5.0, total=exact)
    assert total.item() == exact and coef.item() == pytest.approx(5.0 / exact, rel=1e-15)
    assert norm64(big) == pytest.approx(5.0, rel=1e-6)
    torch.testing.assert_close(big[0], torch.full((10,), 5.0 / math.sqrt(10)))


@pytest.mark.parametrize("bad", [NAN, INF])
def test_non_finite_gradients_are_left_as_they_are(bad: float) -> None:
    grads = [torch.tensor([7.0, 24.0, bad])]
    total, coef = clip_grad_norm_(grads, max_norm=5.0)
    assert not math.isfinite(total.item()) and coef.item() == 1.0
    assert grads[0][:2].tolist() == [7.0, 24.0]  # not zeroed
    assert (torch.isnan(grads[0][2]) if math.isnan(bad) else torch.isinf(grads[0][2]))  # NaN stays NaN, inf stays inf


def test_coefficient_edge_cases() -> None:
    assert clip_coefficient(0.0, 0.0).item() == 1.0  # no 0/0
    assert clip_coefficient(10.0, INF).item() == 1.0
    assert clip_coefficient(INF, 1.0).item() == 1.0 and clip_coefficient(NAN, 1.0).item() == 1.0
    assert clip_coefficient(1e39, 1.0).item() == FP32_TINY  # would flush to zero in FP32: clamped instead
    torch.set_flush_denormal(True)
    try:
        grads = [torch.full((4,), 3e38)]
        scale_grads_(grads, clip_coefficient(1e40, 1.0))
        assert bool((grads[0] > 0).all())
    finally:
        torch.set_flush_denormal(False)


def test_scale_grads_handles_devices_and_dtypes() -> None:
    grads = [torch.tensor([2.0], dtype=torch.float16), torch.tensor([2.0], dtype=torch.bfloat16), torch.tensor([2.0])]
    scale_grads_(grads, torch.tensor(0.5, dtype=torch.float64))
    assert [g.item() for g in grads] == [1.0, 1.0, 1.0]
    assert [g.dtype for g in grads] == [torch.float16, torch.bfloat16, torch.float32]


def test_max_norm_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"^'max_norm' must be in \(0, inf\] \(got 0\)$"):
        clip_grad_norm_([torch.ones(2)], 0.0)


finite_values = st.floats(min_value=-(2.0**100), max_value=2.0**100, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=150, deadline=None)
@given(
    values=st.lists(st.lists(finite_values, min_size=1, max_size=20), min_size=1, max_size=3),
    max_norm=st.floats(min_value=1e-6, max_value=1e6),
)
def test_clipping_never_increases_the_norm(values: list[list[float]], max_norm: float) -> None:
    grads = [torch.tensor(v, dtype=torch.float32) for v in values]
    before = norm64(grads)
    elementwise_before = [g.abs().clone() for g in grads]
    _, coef = clip_grad_norm_(grads, max_norm, total=grad_norm_report(grads).total)
    after = norm64(grads)
    assert 0.0 <= coef.item() <= 1.0
    assert after <= before
    assert all(bool((g.abs() <= b).all()) for g, b in zip(grads, elementwise_before))
    assert after <= max_norm * (1 + 1e-5) or after == before


# ---- percentile (AutoClip) ------------------------------------------------------------------------------------------
def run_percentile(norms: list[float], percentile: float, window: int) -> tuple[list[float], PercentileState]:
    state = PercentileState.empty(window)
    thresholds = []
    for norm in norms:
        threshold, state = percentile_threshold(state, torch.tensor(norm, dtype=torch.float64), percentile)
        thresholds.append(threshold.item())
    return thresholds, state


def test_percentile_by_hand() -> None:
    thresholds, state = run_percentile([1.0, 2.0, 3.0, 4.0], percentile=50.0, window=10)
    assert thresholds == [1.0, 1.5, 2.0, 2.5]  # this step's norm is in the history (as in the paper)
    thresholds, _ = run_percentile([1.0, 2.0, 3.0, 4.0], percentile=50.0, window=3)
    assert thresholds[-1] == 3.0  # the window holds 2, 3, 4
    assert int(state.count) == 4


@pytest.mark.parametrize(("percentile", "window"), [(10.0, 1000), (10.0, 7), (90.0, 16), (0.0, 5), (100.0, 5)])
def test_percentile_matches_numpy(percentile: float, window: int) -> None:
    norms = (np.random.default_rng(0).lognormal(size=60) * 3).tolist()
    thresholds, _ = run_percentile(norms, percentile, window)
    expected = [np.percentile(norms[max(0, i + 1 - window) : i + 1], percentile) for i in range(len(norms))]
    assert thresholds == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("bad", [NAN, INF, -INF, 1e39])
def test_percentile_history_never_takes_a_non_finite_norm(bad: float) -> None:
    norms = [1.0, 2.0, 3.0, bad, 4.0, 5.0]
    thresholds, state = run_percentile(norms, 50.0, window=4)
    clean, clean_state = run_percentile(norms[:3] + norms[4:], 50.0, window=4)
    assert int(state.count) == 5 and not torch.isnan(state.history).any()
    assert thresholds[3] == clean[2]  # the bad step sees the history without itself
    assert thresholds[4:] == clean[3:]
    assert torch.equal(state.history, clean_state.history)


def test_percentile_threshold_is_infinite_before_any_norm() -> None:
    threshold, state = percentile_threshold(PercentileState.empty(3), torch.tensor(NAN))
    assert threshold.item() == INF and int(state.count) == 0


def test_percentile_state_round_trips_and_resizes() -> None:
    _, state = run_percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50.0, window=3)
    saved = state.to_dict()
    assert saved == {"window": 3, "history": [3.0, 4.0, 5.0], "count": 5}
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    loaded = PercentileState.from_dict(torch.load(buffer, weights_only=True))
    assert torch.equal(loaded.history, state.history) and torch.equal(loaded.count, state.count)
    # Same thresholds afterwards as the original state.
    a, _ = percentile_threshold(state, torch.tensor(0.5), 50.0)
    b, _ = percentile_threshold(loaded, torch.tensor(0.5), 50.0)
    assert a.item() == b.item() == 4.0  # 0.5 replaced the oldest norm, 3: median of 0.5, 4, 5
    smaller = PercentileState.from_dict(saved, window=2)
    assert smaller.to_dict()["history"] == [4.0, 5.0]
    larger = PercentileState.from_dict(saved, window=5)
    assert larger.to_dict() == {"window": 5, "history": [3.0, 4.0, 5.0], "count": 3}


def test_percentile_argument_is_checked() -> None:
    with pytest.raises(ValueError, match=r"^'percentile' must be in \[0, 100\] \(got 101\)$"):
        percentile_threshold(PercentileState.empty(2), 1.0, 101)
    with pytest.raises(ValueError, match=r"^'window' must be >= 1 \(got 0\)$"):
        PercentileState.empty(0)


# ---- z-score (ZClip) ------------------------------------------------------------------------------------------------
def zclip_reference(
    norms: list[float], alpha: float = 0.97, z_thresh: float = 2.5, warmup: int = 25, guard: bool = True
) -> tuple[list[float], float, float]:
    """ZClip written out in float64 Python from the paper: returns (coefficient per step, mean, var).

    ``guard=False`` is the published algorithm as is, which lets a NaN norm into the EMA.
    """
    eps = 1e-6
    buffer: list[float] = []
    mean = var = math.nan
    coefs = []
    for g in norms:
        if guard and not math.isfinite(g):
            coefs.append(1.0)
            continue
        if len(buffer) < warmup:
            buffer.append(g)
            coefs.append(1.0)
            if len(buffer) == warmup:
                mean = sum(buffer) / warmup
                var = sum((x - mean) ** 2 for x in buffer) / warmup
            continue
        std = math.sqrt(var)
        z = (g - mean) / (std + eps)
        clipped = g
        if z > z_thresh:
            clipped = mean + z_thresh**2 * std / z
        coefs.append(min(1.0, clipped / g))
        mean = alpha * mean + (1 - alpha) * clipped
        var = alpha * var + (1 - alpha) * (clipped - mean) ** 2
    return coefs, mean, var


def run_zscore(norms: list[float], **kwargs: float) -> tuple[list[float], list[float], ZScoreState]:
    state = ZScoreState.empty()
    thresholds, coefs = [], []
    for norm in norms:
        total = torch.tensor(norm, dtype=torch.float64)
        threshold, state = zscore_threshold(state, total, **kwargs)  # type: ignore[arg-type]
        thresholds.append(threshold.item())
        coefs.append(clip_coefficient(total, threshold).item())
    return thresholds, coefs, state


def spiky_norms(n: int = 120, seed: int = 0) -> list[float]:
    rng = np.random.default_rng(seed)
    norms = (1.0 + 0.1 * rng.standard_normal(n)).tolist()
    for i in (30, 31, 70, 100):
        norms[i] *= 20.0
    return norms


def test_zscore_by_hand() -> None:
    thresholds, coefs, state = run_zscore([1.0, 2.0, 3.0, 10.0], warmup_steps=3)
    assert thresholds[:3] == [INF, INF, INF]  # warm-up only builds the statistics
    std = math.sqrt(2 / 3)
    z = 8.0 / (std + 1e-6)
    target = 2.0 + 6.25 * std / z
    assert thresholds[3] == pytest.approx(target, rel=1e-14)
    assert coefs[3] == pytest.approx(target / 10.0, rel=1e-14)
    mean = 0.97 * 2.0 + 0.03 * target  # updated with the clipped norm, not with 10
    assert state.mean.item() == pytest.approx(mean, rel=1e-14)
    assert state.var.item() == pytest.approx(0.97 * (2 / 3) + 0.03 * (target - mean) ** 2, rel=1e-14)


def test_zscore_matches_the_float64_reference() -> None:
    norms = spiky_norms()
    _, coefs, state = run_zscore(norms)
    ref_coefs, ref_mean, ref_var = zclip_reference(norms)
    assert coefs == pytest.approx(ref_coefs, rel=1e-12)
    assert sum(c < 1 for c in coefs) >= 4  # the spikes were clipped
    assert state.mean.item() == pytest.approx(ref_mean, rel=1e-12)
    assert state.var.item() == pytest.approx(ref_var, rel=1e-12)


@pytest.mark.parametrize("bad", [NAN, INF, 1e39])
def test_zscore_statistics_stay_finite_after_a_nan(bad: float) -> None:
    norms = spiky_norms()
    norms[50] = bad
    thresholds, coefs, state = run_zscore(norms)
    assert math.isfinite(state.mean.item()) and math.isfinite(state.var.item())
    assert int(state.count) == len(norms) - 1
    assert all(math.isfinite(t) for t in thresholds[25:])
    clean = norms[:50] + norms[51:]
    _, clean_coefs, clean_state = run_zscore(clean)
    assert coefs[51:] == clean_coefs[50:]  # as if the bad step never happened
    assert state.mean.item() == clean_state.mean.item()
    # The published algorithm, without the guard, ends with a NaN mean after a NaN norm, for good.
    _, naive_mean, _ = zclip_reference(norms, guard=False)
    assert math.isnan(naive_mean) == math.isnan(bad)


def test_zscore_nan_during_warmup_does_not_count() -> None:
    _, _, state = run_zscore([1.0, NAN, 2.0, 3.0], warmup_steps=3)
    assert int(state.count) == 3 and state.mean.item() == 2.0


def test_a_spike_does_not_inflate_the_variance() -> None:
    norms = spiky_norms()[:40]
    norms[30] = 1000.0
    _, _, state = run_zscore(norms)
    raw_var = state.var.item()
    # Had the spike entered unclipped, the variance would be about 0.03 * 1000**2 = 3e4; the next spike of 20x
    # would then pass unnoticed. With the clipped value it stays small and the next spike is caught.
    assert raw_var < 1.0
    threshold, _ = zscore_threshold(state, torch.tensor(20.0, dtype=torch.float64))
    assert threshold.item() < 5.0


def test_zscore_state_round_trips() -> None:
    _, _, state = run_zscore(spiky_norms()[:30])
    buffer = io.BytesIO()
    torch.save(state.to_dict(), buffer)
    buffer.seek(0)
    loaded = ZScoreState.from_dict(torch.load(buffer, weights_only=True))
    for name in ("mean", "var", "count"):
        assert torch.equal(getattr(loaded, name), getattr(state, name))


@settings(max_examples=100, deadline=None)
@given(
    norms=st.lists(
        st.one_of(st.floats(min_value=0.0, max_value=1e40), st.sampled_from([NAN, INF])), min_size=1, max_size=60
    )
)
def test_adaptive_statistics_are_always_finite_and_coefficients_in_unit_interval(norms: list[float]) -> None:
    _, z_coefs, z_state = run_zscore(norms, warmup_steps=3)
    p_thresholds, _ = run_percentile(norms, 10.0, window=8)
    p_coefs = [clip_coefficient(n, t).item() for n, t in zip(norms, p_thresholds)]
    assert all(0.0 <= c <= 1.0 for c in z_coefs + p_coefs)
    assert math.isfinite(z_state.mean.item()) and math.isfinite(z_state.var.item())
    assert all(t >= 0 for t in p_thresholds)


# ---- AGC ------------------------------------------------------------------------------------------------------------
def param(weight: list, grad: list) -> torch.nn.Parameter:  # type: ignore[type-arg]
    p = torch.nn.Parameter(torch.tensor(weight))
    p.grad = torch.tensor(grad)
    return p


def test_agc_by_hand() -> None:
    w = param([[3.0, 4.0], [0.0, 1.0]], [[70.0, 240.0], [0.001, 0.0]])  # row norms: W 5, 1; G 250, 0.001
    smallest = agc_([w], clipping=0.2)
    assert smallest.item() == pytest.approx(1.0 / 250.0)
    torch.testing.assert_close(w.grad, torch.tensor([[0.28, 0.96], [0.001, 0.0]]))  # second row untouched


def test_agc_weight_norm_floor_lets_zero_weights_move() -> None:
    w = param([[0.0, 0.0]], [[3.0, 4.0]])
    agc_([w], clipping=0.01, eps=1e-3)
    assert norm64([w.grad]) == pytest.approx(0.01 * 1e-3, rel=1e-6)  # clipped to clipping * eps, not to 0


def test_agc_units_match_a_float64_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    conv = torch.nn.Parameter(torch.randn(4, 3, 2, 2, generator=gen))
    conv.grad = torch.randn(4, 3, 2, 2, generator=gen) * torch.tensor([0.001, 0.1, 10.0, 100.0]).view(4, 1, 1, 1)
    bias = torch.nn.Parameter(torch.randn(4, generator=gen))
    bias.grad = torch.randn(4, generator=gen)
    expected = []
    for p in (conv, bias):
        w, g = p.detach().double(), p.grad.double()
        dims = tuple(range(1, w.dim())) if w.dim() > 1 else None
        wn = (w**2).sum(dim=dims, keepdim=True).sqrt() if dims else (w**2).sum().sqrt()
        gn = (g**2).sum(dim=dims, keepdim=True).sqrt() if dims else (g**2).sum().sqrt()
        limit = 0.05 * wn.clamp(min=1e-3)
        expected.append(torch.where(gn > limit, g * limit / gn, g))
    agc_([conv, bias], clipping=0.05)
    torch.testing.assert_close(conv.grad.double(), expected[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(bias.grad.double(), expected[1], rtol=1e-5, atol=0)
    assert unitwise_norms([conv], exact=False)[0].shape == (4, 1, 1, 1)


def test_agc_leaves_non_finite_units_alone_and_exact_mode_handles_overflow() -> None:
    w = param([[1.0, 1.0], [1.0, 1.0]], [[NAN, 1.0], [100.0, 0.0]])
    agc_([w], clipping=0.1)
    assert torch.isnan(w.grad[0, 0]) and w.grad[0, 1].item() == 1.0  # a NaN unit keeps coefficient 1
    assert w.grad[1, 0].item() == pytest.approx(0.1 * math.sqrt(2))
    big = param([[1.0, 1.0]], [[1e20, 1e20]])
    assert agc_coefficients([big])[0].item() == 1.0  # FP32 unit norm overflowed: left alone, not zeroed
    agc_([big], clipping=0.1, exact=True)
    assert norm64([big.grad]) == pytest.approx(0.1 * math.sqrt(2), rel=1e-6)


# ---- sync-free -------------------------------------------------------------------------------------------------------
def test_every_clipping_function_runs_on_meta_tensors() -> None:
    """Any .item(), bool(tensor) or data-dependent branch raises on the meta device: this proves them sync-free."""
    meta = torch.device("meta")
    grads = [torch.empty(3, 4, device=meta), torch.empty(4, device=meta, dtype=torch.bfloat16)]
    total = torch.empty((), dtype=torch.float64, device=meta)
    clip_grad_norm_(grads, 1.0)
    clip_grad_norm_(grads, 1.0, total=total)
    scale_grads_(grads, clip_coefficient(total, torch.empty((), device=meta)))
    p_state = PercentileState.empty(16, device=meta)
    z_state = ZScoreState.empty(device=meta)
    for _ in range(2):
        threshold, p_state = percentile_threshold(p_state, total)
        threshold, z_state = zscore_threshold(z_state, total)
        scale_grads_(grads, clip_coefficient(total, threshold))
    assert threshold.device.type == "meta" and p_state.history.device.type == "meta"
    w = torch.nn.Parameter(torch.empty(3, 4, device=meta))
    w.grad = torch.empty(3, 4, device=meta)
    assert agc_([w]).device.type == "meta"
    assert agc_([w], exact=True).device.type == "meta"
    coefs, norms = agc_coefficients_and_norms([w], clipping=0.01, eps=1e-3, exact=False)
    assert coefs[0].device.type == norms[0].device.type == "meta"


# ---- devices ---------------------------------------------------------------------------------------------------------
class CopyLog(torch.Tensor):
    """A tensor that records the keyword arguments of every ``.to`` called on it."""

    calls: ClassVar[list[dict[str, object]]] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.Tensor.to:
            cls.calls.append(dict(kwargs))
        return super().__torch_function__(func, types, args, kwargs)


def test_the_coefficient_is_never_copied_into_host_memory_asynchronously() -> None:
    """An asynchronous copy from an accelerator into host memory may still be in flight when the CPU reads it."""
    CopyLog.calls = []
    coef = torch.tensor(0.5, dtype=torch.float64).as_subclass(CopyLog)
    grads = [torch.tensor([2.0, 4.0], dtype=torch.float16), torch.tensor([6.0])]
    scale_grads_(grads, coef)
    assert [g.tolist() for g in grads] == [[1.0, 2.0], [3.0]]
    into_host = [c for c in CopyLog.calls if torch.device(c["device"]).type == "cpu"]  # type: ignore[arg-type]
    assert len(into_host) == 2 and not any(c.get("non_blocking") for c in into_host)


def test_the_smallest_coefficient_lies_on_the_accelerator_among_the_coefficients() -> None:
    """No copy into host memory: a meta tensor stands for the accelerator (copying out of it raises)."""
    coefs = [torch.tensor([0.5, 1.0]), torch.empty(2, device="meta")]
    assert smallest_coefficient(coefs).device.type == "meta"
    assert smallest_coefficient([torch.tensor([0.5, 1.0]), torch.tensor([0.25])]).item() == 0.25


# ---- float64 ---------------------------------------------------------------------------------------------------------
def test_agc_keeps_float64_parameters_in_float64() -> None:
    w = torch.nn.Parameter(torch.tensor([[3.0, 4.0], [0.0, 1.0]], dtype=torch.float64))
    w.grad = torch.tensor([[70.0, 240.0], [0.001, 0.0]], dtype=torch.float64)
    smallest = agc_([w], clipping=0.2)
    assert smallest.item() == pytest.approx(1.0 / 250.0, rel=1e-7)
    assert w.grad.dtype == torch.float64
    torch.testing.assert_close(w.grad, torch.tensor([[0.28, 0.96], [0.001, 0.0]], dtype=torch.float64), rtol=1e-15,
                               atol=0)
    # float64 gradients beyond the FP32 range need no exact mode: their unit norms are float64 already
    big = torch.nn.Parameter(torch.ones(1, 2, dtype=torch.float64))
    big.grad = torch.full((1, 2), 1e30, dtype=torch.float64)  # FP32 squares would overflow: 1e60
    agc_([big], clipping=0.1)
    assert norm64([big.grad]) == pytest.approx(0.1 * math.sqrt(2), rel=1e-12)


# ---- AGC's norms after clipping -------------------------------------------------------------------------------------
@pytest.mark.parametrize("exact", [False, True])
def test_agc_norms_are_the_norms_the_gradients_have_after_clipping(exact: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    conv = torch.nn.Parameter(torch.randn(4, 3, 2, generator=gen))
    conv.grad = torch.randn(4, 3, 2, generator=gen) * torch.tensor([0.001, 0.1, 10.0, 100.0]).view(4, 1, 1)
    bias = torch.nn.Parameter(torch.zeros(4))
    bias.grad = torch.tensor([3.0, 0.0, 0.0, 4.0])  # weights 0: the floor eps applies, clipped to 0.05 * 1e-3
    coefs, norms = agc_coefficients_and_norms([conv, bias], clipping=0.05, eps=1e-3, exact=exact)
    assert [c.dtype for c in coefs] == [torch.float32, torch.float32]
    assert [n.dtype for n in norms] == [torch.float64 if exact else torch.float32] * 2
    for c, expected in zip(coefs, agc_coefficients([conv, bias], clipping=0.05, exact=exact)):
        assert torch.equal(c, expected)
    agc_([conv, bias], clipping=0.05, exact=exact)
    assert norms[0].item() == pytest.approx(norm64([conv.grad]), rel=1e-6)
    assert norms[1].item() == pytest.approx(0.05 * 1e-3, rel=1e-6) == pytest.approx(norm64([bias.grad]), rel=1e-6)


# ---- argument checks -------------------------------------------------------------------------------------------------
def _zscore(**kwargs: object) -> None:
    zscore_threshold(ZScoreState.empty(), 1.0, **kwargs)  # type: ignore[arg-type]


def _agc(**kwargs: object) -> None:
    w = torch.nn.Parameter(torch.ones(2))
    w.grad = torch.ones(2)
    agc_([w], **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("call", "kwargs", "error", "message"),
    [
        (_zscore, {"alpha": 1.0}, ValueError, "'alpha' must be in (0, 1) (got 1)"),
        (lambda **_: zscore_threshold(PercentileState.empty(2), 1.0), {}, TypeError,  # type: ignore[arg-type]
         ("'state' must be a ZScoreState (got PercentileState(history=tensor([nan, nan], dtype=torch.float64), "
          "count=tensor(0)))")),
        (lambda **_: percentile_threshold(None, 1.0), {}, TypeError, "'state' must be a PercentileState (got None)"),  # type: ignore[arg-type]
        (lambda **_: clip_grad_norm_([torch.ones(2)], math.nan), {}, ValueError, "'max_norm' must be in (0, inf] (got nan)"),
        (_zscore, {"alpha": NAN}, ValueError, "'alpha' must be in (0, 1) (got nan)"),
        (_zscore, {"alpha": "0.9"}, TypeError, "'alpha' must be a number (got '0.9')"),
        (_zscore, {"z_threshold": 0}, ValueError, "'z_threshold' must be in (0, inf) (got 0)"),
        (_zscore, {"z_threshold": INF}, ValueError, "'z_threshold' must be in (0, inf) (got inf)"),
        (_zscore, {"warmup_steps": 1}, ValueError, "'warmup_steps' must be >= 2 (got 1)"),
        (_zscore, {"warmup_steps": 2.0}, TypeError, "'warmup_steps' must be an int (got 2.0)"),
        (_zscore, {"eps": -1e-6}, ValueError, "'eps' must be in [0, inf) (got -1e-06)"),
        (_agc, {"clipping": 0.0}, ValueError, "'clipping' must be in (0, inf) (got 0)"),
        (_agc, {"clipping": None}, TypeError, "'clipping' must be a number (got None)"),
        (_agc, {"eps": 0.0}, ValueError, "'eps' must be in (0, inf) (got 0)"),
        (_agc, {"eps": True}, TypeError, "'eps' must be a number (got True)"),
        (_agc, {"exact": 1}, TypeError, "'exact' must be a bool (got 1)"),
    ],
)
def test_arguments_are_checked(call: object, kwargs: dict[str, object], error: type, message: str) -> None:
    with pytest.raises(error) as info:
        call(**kwargs)  # type: ignore[operator]
    assert str(info.value) == message


def test_agc_checks_its_arguments_even_without_gradients() -> None:
    with pytest.raises(ValueError, match=r"^'clipping' must be in \(0, inf\) \(got -1\)$"):
        agc_([torch.nn.Parameter(torch.ones(2))], clipping=-1.0)
    with pytest.raises(ValueError, match=r"^'eps' must be in \(0, inf\) \(got 0\)$"):
        agc_coefficients([], eps=0.0)


def test_percentile_window_and_max_norm_types_are_checked() -> None:
    with pytest.raises(TypeError, match=r"^'percentile' must be a number \(got '10'\)$"):
        percentile_threshold(PercentileState.empty(2), 1.0, "10")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^'window' must be an int \(got 2.5\)$"):
        PercentileState.empty(2.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^'max_norm' must be a number \(got '1'\)$"):
        clip_grad_norm_([torch.ones(2)], "1")  # type: ignore[arg-type]


# ---- host forms: the same values from Python floats -----------------------------------------------------------------
def same(a: float, b: float) -> bool:
    """Bit for bit, NaN included."""
    return a == b or (math.isnan(a) and math.isnan(b))


FP32_MAX = float(torch.finfo(torch.float32).max)

norm_series = st.lists(
    st.one_of(
        st.floats(min_value=0.5, max_value=2.0),  # the healthy level
        st.floats(min_value=0.0, max_value=1e6),  # spikes
        st.floats(min_value=-10.0, max_value=10.0),  # not norms, but numbers the functions accept
        st.sampled_from([NAN, INF, -INF, 1e39, 0.0, FP32_MAX]),
    ),
    min_size=1,
    max_size=80,
)

ZCLIP = {"alpha": 0.97, "z_threshold": 2.5}  # the paper's, as zscore_threshold's defaults

zscore_settings = {
    "alpha": st.floats(min_value=0.01, max_value=0.99),
    "z_threshold": st.floats(min_value=0.1, max_value=10.0),
    "warmup_steps": st.integers(min_value=2, max_value=30),
    "eps": st.sampled_from([0.0, 1e-6, 1e-3]),
}


@settings(max_examples=150, deadline=None)
@given(norms=norm_series, **zscore_settings)
def test_host_zscore_is_bit_identical_to_the_tensor_form(
    norms: list[float], alpha: float, z_threshold: float, warmup_steps: int, eps: float
) -> None:
    kwargs = {"alpha": alpha, "z_threshold": z_threshold, "warmup_steps": warmup_steps, "eps": eps}
    state, host = ZScoreState.empty(), HostZScore(**kwargs)  # type: ignore[arg-type]
    for norm in norms:
        total = torch.tensor(norm, dtype=torch.float64)
        threshold, state = zscore_threshold(state, total, **kwargs)  # type: ignore[arg-type]
        assert same(host.threshold(norm), threshold.item())  # a query changes nothing ...
        host_threshold = host.observe(norm)  # ... and the update sees the same threshold
        assert same(host_threshold, threshold.item())
        assert (host.mean, host.var, host.count) == (state.mean.item(), state.var.item(), int(state.count))
        assert same(host_clip_coefficient(norm, host_threshold), clip_coefficient(total, threshold).item())
    assert host.to_dict() == state.to_dict()


@settings(max_examples=150, deadline=None)
@given(norms=norm_series, **zscore_settings)
def test_host_zscore_update_and_inliers_agree_with_the_tensor_form(
    norms: list[float], alpha: float, z_threshold: float, warmup_steps: int, eps: float
) -> None:
    """``update`` takes an inlier in without a root: the same statistics as the tensor form; and an inlier's threshold,
    whatever it is, is never below the norm (no clip)."""
    kwargs = {"alpha": alpha, "z_threshold": z_threshold, "warmup_steps": warmup_steps, "eps": eps}
    state, host = ZScoreState.empty(), HostZScore(**kwargs)  # type: ignore[arg-type]
    for norm in norms:
        threshold, state = zscore_threshold(state, torch.tensor(norm, dtype=torch.float64), **kwargs)  # type: ignore[arg-type]
        if host.inlier(norm):
            assert threshold.item() >= norm and host_clip_coefficient(norm, threshold.item()) == 1.0
        host.update(norm)
        assert (host.mean, host.var, host.count) == (state.mean.item(), state.var.item(), int(state.count))


def test_host_zscore_inliers_are_told_from_outliers_without_a_root() -> None:
    host = HostZScore(**ZCLIP, warmup_steps=2)
    for norm in (1.0, 3.0):
        host.update(norm)  # mean 2, standard deviation 1
    assert not host.inlier(2.5 * 1.0 + 2.0 + 1e-3) and host.inlier(2.0)
    assert not HostZScore(**ZCLIP, warmup_steps=2).inlier(1.0)  # in the warm-up: no statistics yet


@settings(max_examples=150, deadline=None)
@given(
    norms=norm_series,
    window=st.integers(min_value=1, max_value=40),
    percentile=st.one_of(st.floats(min_value=0.0, max_value=100.0), st.sampled_from([0.0, 10.0, 50.0, 100.0])),
)
def test_host_percentile_is_bit_identical_to_the_tensor_form(
    norms: list[float], window: int, percentile: float
) -> None:
    state, host = PercentileState.empty(window), HostPercentile(window, percentile)
    for norm in norms:
        total = torch.tensor(norm, dtype=torch.float64)
        threshold, state = percentile_threshold(state, total, percentile)
        assert host.threshold(norm) == threshold.item()
        assert host.observe(norm) == threshold.item()
        assert host.to_dict() == state.to_dict()
        assert host_clip_coefficient(norm, threshold.item()) == clip_coefficient(total, threshold).item()


@settings(max_examples=100, deadline=None)
@given(
    values=st.lists(st.floats(min_value=-1e30, max_value=1e30).filter(lambda v: abs(v) > 1e-300 or v == 0),
                    min_size=1, max_size=60),
    percentile=st.floats(min_value=0.0, max_value=100.0),
)
def test_host_percentile_equals_torch_nanquantile_on_its_window(values: list[float], percentile: float) -> None:
    host = HostPercentile(window=len(values), percentile=percentile)
    for v in values:
        host.update(v)
    expected = torch.nanquantile(torch.tensor(values, dtype=torch.float64), percentile / 100.0).item()
    assert host.threshold(NAN) == expected  # a rejected norm: the window alone
    assert sorted(host.history) == sorted(values)


def test_host_percentile_by_hand_and_over_a_full_window() -> None:
    host = HostPercentile(window=3, percentile=50.0)
    assert host.threshold(NAN) == INF  # nothing seen yet
    assert [host.observe(n) for n in (1.0, 2.0, 3.0, 4.0)] == [1.0, 1.5, 2.0, 3.0]  # the window holds 2, 3, 4
    assert host.history == [2.0, 3.0, 4.0] and host.count == 4
    assert host.threshold(0.5) == 3.0 and host.history == [2.0, 3.0, 4.0]  # 0.5 would replace 2: median of 0.5, 3, 4
    for bad in (NAN, INF, -INF, 1e39):
        assert host.observe(bad) == 3.0 and host.count == 4  # the window alone, nothing taken in


@pytest.mark.parametrize(("saved_window", "window"), [(3, 3), (3, 2), (3, 5), (8, 3)])
def test_host_and_tensor_percentile_states_load_each_other(saved_window: int, window: int) -> None:
    _, state = run_percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50.0, window=saved_window)
    host = HostPercentile(window, 50.0)
    host.load_state_dict(state.to_dict())
    reference = PercentileState.from_dict(state.to_dict(), window=window)
    assert host.to_dict() == reference.to_dict()
    for norm in (0.5, 7.0, 2.5, 9.0, 1.0, 4.0):  # and the same thresholds from there on
        threshold, reference = percentile_threshold(reference, norm, 50.0)
        assert host.observe(norm) == threshold.item()
    assert PercentileState.from_dict(host.to_dict()).to_dict() == host.to_dict()


def test_host_percentile_refuses_a_state_it_could_not_have_written() -> None:
    host = HostPercentile(window=4, percentile=10.0)
    with pytest.raises(ValueError, match=r"^'count' must be >= 3, the length of 'history' \(got 2\)$"):
        host.load_state_dict({"window": 4, "history": [1.0, 2.0, 3.0], "count": 2})
    with pytest.raises(ValueError, match=r"^'history' must hold finite norms within the FP32 range \(got nan\)$"):
        host.load_state_dict({"window": 4, "history": [1.0, NAN], "count": 2})


def test_host_zscore_state_round_trips_through_torch_load_and_the_tensor_form() -> None:
    host = HostZScore(**ZCLIP, warmup_steps=5)
    for norm in spiky_norms()[:40]:
        host.update(norm)
    buffer = io.BytesIO()
    torch.save(host.to_dict(), buffer)
    buffer.seek(0)
    loaded = HostZScore(**ZCLIP, warmup_steps=5)
    loaded.load_state_dict(torch.load(buffer, weights_only=True))
    state = ZScoreState.from_dict(host.to_dict())
    for norm in (1.0, 30.0, 0.9):
        threshold, state = zscore_threshold(state, norm, warmup_steps=5)
        assert loaded.observe(norm) == host.observe(norm) == threshold.item()


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: HostZScore(1.0, 2.5, 9), ValueError, "'alpha' must be in (0, 1) (got 1)"),
        (lambda: HostZScore(**ZCLIP, warmup_steps=1), ValueError, "'warmup_steps' must be >= 2 (got 1)"),
        (lambda: HostZScore(**ZCLIP, warmup_steps=25, eps=-1.0), ValueError, "'eps' must be in [0, inf) (got -1)"),
        (lambda: HostPercentile(window=0, percentile=10.0), ValueError, "'window' must be >= 1 (got 0)"),
        (lambda: HostPercentile(window=1000, percentile=101), ValueError, "'percentile' must be in [0, 100] (got 101)"),
        (lambda: HostPercentile(window=1000, percentile="10"), TypeError, "'percentile' must be a number (got '10')"),
    ],
)
def test_host_forms_check_their_arguments(call: Any, error: type, message: str) -> None:
    with pytest.raises(error) as info:
        call()
    assert str(info.value) == message


def test_host_clip_coefficient_edge_cases_match_the_tensor_form() -> None:
    cases = [(0.0, 0.0), (10.0, INF), (INF, 1.0), (NAN, 1.0), (1e39, 1.0), (25.0, 5.0), (0.0, -1.0), (-0.0, -1.0),
             (2.0, -1.0), (5.0, NAN), (3.0, -INF)]
    for total, threshold in cases:
        expected = clip_coefficient(total, threshold).item()
        assert same(host_clip_coefficient(total, threshold), expected), (total, threshold)


# ---- the float64 arithmetic behind the host forms -------------------------------------------------------------------
def nearest(exact: Fraction) -> float:
    """The float64 nearest to ``exact``: beyond the largest float by half a unit or more, infinity."""
    if abs(exact) >= 2**1024 - 2**970:
        return INF if exact > 0 else -INF
    return float(exact)


doubles = st.floats(allow_nan=False, allow_infinity=False, min_value=-1e300, max_value=1e300)


@settings(max_examples=300, deadline=None)
@given(a=doubles, b=doubles, c=doubles)
def test_fma_rounds_once(a: float, b: float, c: float) -> None:
    assert _float64.fma(a, b, c) == nearest(Fraction(a) * Fraction(b) + Fraction(c))


def test_fma_of_tiny_and_huge_factors_is_exact() -> None:
    for a, b, c in [(1e-200, 1e-150, 1e-310), (3e-160, 7e-160, -2e-319), (1e300, 1e-300, 0.1), (2.0**1000, 3.0, -1.0),
                    (1.3407807830046643e154, 1.3407807830046643e154, 0.0)]:  # a * b rounds to inf, a * b + 0 not
        assert _float64.fma(a, b, c) == nearest(Fraction(a) * Fraction(b) + Fraction(c))
    assert _float64.fma(1e300, 1e300, -INF) == -INF and math.isnan(_float64.fma(INF, 0.0, 1.0))
    assert _float64.fma(1e300, 1e300, 0.0) == INF


def test_fma_of_a_product_that_underflows_to_zero_is_exact() -> None:
    tiny = 5e-324  # the smallest subnormal: half of it rounds to 0, so the product alone says nothing
    for a, b, c in [(-0.5, tiny, tiny), (0.5, tiny, tiny), (0.25, -tiny, 2 * tiny), (1e-300, 1e-300, tiny)]:
        assert _float64.fma(a, b, c) == nearest(Fraction(a) * Fraction(b) + Fraction(c))
    start, end, weight = (torch.tensor(v, dtype=torch.float64) for v in (0.0, tiny, 0.5))
    assert _float64.lerp(0.0, tiny, 0.5) == torch.lerp(start, end, weight).item() == 0.0  # the tie rounds to even


@settings(max_examples=200, deadline=None)
@given(start=doubles, end=doubles, weight=st.floats(min_value=0.0, max_value=1.0))
def test_lerp_rounds_as_torch_does(start: float, end: float, weight: float) -> None:
    t = [torch.tensor(v, dtype=torch.float64) for v in (start, end, weight)]
    assert same(_float64.lerp(start, end, weight), torch.lerp(*t).item())


@settings(max_examples=200, deadline=None)
@given(x=st.one_of(st.floats(min_value=0.0, max_value=1e300), st.sampled_from([-1.0, -0.0, NAN, INF])))
def test_sqrt_rounds_as_torch_does(x: float) -> None:
    expected = torch.tensor(x, dtype=torch.float64).sqrt().item()
    assert same(_float64.sqrt(x), expected)
    assert all(same(root, expected) for root in _float64.sqrt_each([x, x]))


def test_the_bracket_of_a_root_holds_the_kernels_root() -> None:
    gen = torch.Generator().manual_seed(5)
    xs = torch.exp(torch.rand(20000, dtype=torch.float64, generator=gen) * 1290.0 - 600.0)
    for x, kernel in zip(xs.tolist(), xs.sqrt().tolist()):
        low, high = _float64.sqrt_bracket(x)  # type: ignore[misc]
        assert low < kernel < high
    assert _float64.sqrt_bracket(0.0) == (0.0, 0.0)
    assert _float64.sqrt_bracket(5e-324) is None and _float64.sqrt_bracket(1e308) is None
    assert _float64.sqrt_bracket(NAN) is None and _float64.sqrt_bracket(INF) is None


def check_sqrt_host_path() -> bool:
    """torch's CPU sqrt (MKL's vdSqrt) is off by one unit near midpoints between floats: those roots come from the
    kernel. Where :func:`_float64._kernel_agrees` finds the kernel correctly rounded near floats, most other roots are
    settled on the host; where it does not (MKL on AVX-512), none is. Either way every root equals the kernel's, bit
    for bit. Returns the check's verdict."""
    gen = torch.Generator().manual_seed(3)
    xs = torch.exp(torch.rand(20000, dtype=torch.float64, generator=gen) * 200.0 - 100.0)
    kernel = xs.sqrt().tolist()
    xs_host = xs.tolist()
    off = [i for i, (x, k) in enumerate(zip(xs_host, kernel)) if math.sqrt(x) != k]
    assert len(off) < 1000  # 159 with MKL on AVX-512, 281 on AVX2: one unit away, and never settled on the host
    assert all(kernel[i] in (math.nextafter(math.sqrt(xs_host[i]), 0.0), math.nextafter(math.sqrt(xs_host[i]), INF))
               for i in off)
    assert all(_float64._settled_sqrt(xs_host[i]) is None for i in off)
    settled = {i: root for i, x in enumerate(xs_host) if (root := _float64._settled_sqrt(x)) is not None}
    if _float64._kernel_agrees():
        assert len(settled) > 0.75 * len(xs_host)
    else:
        assert settled == {}
    assert all(root == kernel[i] for i, root in settled.items())  # the host never returns a root the kernel would not
    assert [_float64.sqrt_each([x])[0] for x in xs_host] == kernel
    assert _float64.sqrt_each(xs_host[:64]) == kernel[:64]
    return _float64._kernel_agrees()


def test_sqrt_settles_on_the_host_only_roots_the_kernel_rounds_correctly() -> None:
    check_sqrt_host_path()


def test_sqrt_host_path_with_mkl_held_to_avx2() -> None:
    """The same in a process whose MKL may not use AVX-512 (its vdSqrt differs there): on an AVX-512 machine, the host
    path that the check turns off above is on, and checked, here."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); "
            "import test_clipping_numerics as t; print(t.check_sqrt_host_path())")
    env = {**os.environ, "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    command = [sys.executable, "-c", code, str(Path(__file__).parent)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] in ("True", "False")


def test_division_and_maximum_follow_ieee_as_torch_does() -> None:
    t = lambda v: torch.tensor(v, dtype=torch.float64)
    for a, b in [(1.0, 0.0), (-1.0, 0.0), (1.0, -0.0), (0.0, 0.0), (NAN, 0.0), (INF, 0.0), (3.0, 2.0), (1e308, 1e-10)]:
        assert same(_float64.div(a, b), (t(a) / t(b)).item()), (a, b)
    for a, b in [(1.0, NAN), (NAN, 1.0), (2.0, 1.0), (1.0, 2.0), (-INF, 0.0)]:
        assert same(_float64.maximum(a, b), torch.maximum(t(a), t(b)).item()), (a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_agc_on_all_units_at_once_equals_parameter_by_parameter_bit_for_bit(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_overflow.numerics import agc

    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 32), (64,), (8, 4, 3, 3), (1,), (5, 7), ()]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * 0.5).to(dtype)
    params[0].grad[3] = float("nan")  # type: ignore[index]
    params[2].grad[1, 0, 0, 0] = float("inf")  # type: ignore[index]
    params[4].grad.mul_(1e3)  # type: ignore[union-attr]  # clipped
    assert agc._batchable(params, exact=False)
    together = agc_coefficients_and_norms(params, clipping=0.01, eps=1e-3, exact=False)
    monkeypatch.setattr(agc, "_batchable", lambda *_: False)
    one_by_one = agc_coefficients_and_norms(params, clipping=0.01, eps=1e-3, exact=False)
    for batched, single in zip((*together[0], *together[1]), (*one_by_one[0], *one_by_one[1])):
        assert batched.shape == single.shape and batched.dtype == single.dtype
        torch.testing.assert_close(batched, single, rtol=0, atol=0, equal_nan=True)
    assert smallest_coefficient(together[0]).item() < 1.0
