"""NaN-safe running statistics: exact against a float64 reference, poison-proof, spike-proof, sync-free."""

from __future__ import annotations

import io
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_numerics import RunningStats, spike_flags, spike_threshold, update_running_stats

from lightning_overflow.numerics.running_stats import HostRunningStats, ema_alpha


def reference(values: list[float], alpha: float) -> tuple[float, float, int]:
    """Plain-Python mean / variance: finite values only, weight max(alpha, 1/n)."""
    mean = var = 0.0
    n = 0
    for x in values:
        if not math.isfinite(x):
            continue
        n += 1
        w = max(alpha, 1.0 / n)
        delta = x - mean
        mean += w * delta
        var = (1 - w) * (var + w * delta * delta)
    return mean, var, n


def observe(stats: RunningStats, value: torch.Tensor, sigmas: float, ratio: float) -> torch.Tensor:
    """Test ``value`` for spikes, then take in the channels that are finite and not spikes."""
    flags = stats.spikes(value, sigmas, ratio)
    stats.update(value, include=~flags)
    return flags


def test_first_values_give_the_plain_mean_and_population_variance() -> None:
    stats = RunningStats(channels=1, window=1000, warmup=1)
    for x in (2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0):
        stats.update(torch.tensor([x]))
    assert stats.mean.tolist() == [5.0]
    assert stats.var.tolist() == [4.0]  # the textbook example: standard deviation 2
    assert stats.count.tolist() == [8.0]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.floats(min_value=-1e6, max_value=1e6),
            st.sampled_from([math.nan, math.inf, -math.inf]),
        ),
        min_size=1,
        max_size=60,
    ),
    st.integers(min_value=1, max_value=40),
)
def test_matches_a_float64_reference_and_ignores_every_nonfinite_value(values: list[float], window: int) -> None:
    stats = RunningStats(channels=1, window=window, warmup=1)
    for x in values:
        stats.update(torch.tensor([x], dtype=torch.float64))
    mean, var, n = reference(values, ema_alpha(window))
    assert stats.count.item() == n
    assert math.isfinite(stats.mean.item()) and math.isfinite(stats.var.item())
    assert stats.mean.item() == pytest.approx(mean, rel=1e-9, abs=1e-9)
    assert stats.var.item() == pytest.approx(var, rel=1e-7, abs=1e-6)


def test_a_nonfinite_value_leaves_the_statistics_bit_identical() -> None:
    stats = RunningStats(channels=2, window=8, warmup=1)
    for x in (1.0, 2.0, 3.0):
        stats.update(torch.tensor([x, 10 * x]))
    before = (stats.mean.clone(), stats.var.clone(), stats.count.clone())
    for poison in (math.nan, math.inf, -math.inf):
        stats.update(torch.tensor([poison, poison]))
    assert all(torch.equal(a, b) for a, b in zip(before, (stats.mean, stats.var, stats.count)))


def test_channels_are_independent_and_include_masks_one_of_them() -> None:
    stats = RunningStats(channels=2, window=8, warmup=1)
    stats.update(torch.tensor([1.0, math.nan]))
    stats.update(torch.tensor([3.0, 5.0]), include=torch.tensor([False, True]))
    assert stats.mean.tolist() == [1.0, 5.0]
    assert stats.count.tolist() == [1.0, 1.0]


def test_threshold_is_the_larger_of_the_z_score_and_the_ratio_margin() -> None:
    mean = torch.tensor([2.0, 2.0, -2.0], dtype=torch.float64)
    var = torch.tensor([0.25, 0.0001, 0.0001], dtype=torch.float64)
    # std 0.5 -> 6 sigma = 3 beats 0.5 * 2; std 0.01 -> the ratio margin 0.5 * |mean| = 1 wins, for a negative
    # mean too.
    assert spike_threshold(mean, var, sigmas=6.0, ratio=1.5).tolist() == [5.0, 3.0, -1.0]


def test_spike_flags_need_warmup_finiteness_and_a_strict_excess() -> None:
    one = torch.ones(4, dtype=torch.float64)
    value = torch.tensor([5.0, 5.5, math.inf, math.nan], dtype=torch.float64)
    warm = spike_flags(2 * one, 0.25 * one, 10 * one, value, 6.0, 1.5, warmup=10)
    cold = spike_flags(2 * one, 0.25 * one, 9 * one, value, 6.0, 1.5, warmup=10)
    assert warm.tolist() == [False, True, False, False]  # 5.0 is the threshold itself; inf/NaN are not spikes here
    assert cold.tolist() == [False] * 4


def test_a_spike_is_reported_and_does_not_enter_the_statistics() -> None:
    stats = RunningStats(channels=1, window=16, warmup=5)
    noise = [1.0, 1.1, 0.9, 1.05, 0.95, 1.0]
    for x in noise:
        assert not observe(stats, torch.tensor([x]), sigmas=6.0, ratio=1.2).item()
    before = (stats.mean.clone(), stats.var.clone(), stats.count.clone())
    assert observe(stats, torch.tensor([100.0]), sigmas=6.0, ratio=1.2).tolist() == [True]
    assert all(torch.equal(a, b) for a, b in zip(before, (stats.mean, stats.var, stats.count)))
    # the next spike is still a spike: the threshold did not rise
    assert observe(stats, torch.tensor([100.0]), sigmas=6.0, ratio=1.2).tolist() == [True]


def test_no_spike_during_warmup_even_for_a_huge_value() -> None:
    stats = RunningStats(channels=1, window=16, warmup=5)
    flags = [observe(stats, torch.tensor([x]), 6.0, 1.2).item() for x in (1.0, 1.0, 1.0, 1.0, 1e6)]
    assert flags == [False] * 5 and stats.count.item() == 5


def test_a_constant_series_never_spikes() -> None:
    stats = RunningStats(channels=2, window=128, warmup=3)
    flags = [observe(stats, torch.tensor([0.693, 0.0]), 6.0, 1.2).any().item() for _ in range(300)]
    assert not any(flags)
    assert stats.var.tolist() == [0.0, 0.0]


def test_sync_free_on_meta_tensors() -> None:
    """Any host read (.item(), bool(tensor), a data-dependent branch) raises on the meta device."""
    meta = torch.device("meta")
    mean, var, count = (torch.zeros(2, dtype=torch.float64, device=meta) for _ in range(3))
    value = torch.empty(2, device=meta)
    flags = spike_flags(mean, var, count, value, torch.tensor(6.0, device=meta), 1.2, warmup=2)
    m, v, n = update_running_stats(mean, var, count, value, 0.1, include=~flags)
    assert flags.device == meta and spike_threshold(m, v, 6.0, 1.2).device == meta
    assert m.device == v.device == n.device == meta


def test_float32_statistics_follow_their_dtype() -> None:
    zero = torch.zeros(1, dtype=torch.float32)
    m, v, n = update_running_stats(zero, zero, zero, torch.tensor([1.0], dtype=torch.float64), ema_alpha(4))
    assert m.dtype == v.dtype == n.dtype == torch.float32


SETTINGS = {"channels": 1, "window": 128, "warmup": 50}


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"channels": 0}, ValueError, "'channels' must be >= 1 (got 0)"),
        ({"channels": None}, TypeError, "'channels' must be an int (got None)"),
        ({"window": 0}, ValueError, "'window' must be >= 1 (got 0)"),
        ({"warmup": 0}, ValueError, "'warmup' must be >= 1 (got 0)"),
        ({"window": 2.5}, TypeError, "'window' must be an int (got 2.5)"),
        ({"warmup": True}, TypeError, "'warmup' must be an int (got True)"),
    ],
)
def test_arguments_are_checked(kwargs: dict[str, object], error: type[Exception], message: str) -> None:
    with pytest.raises(error) as info:
        RunningStats(**{**SETTINGS, **kwargs})  # type: ignore[arg-type]
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: ema_alpha(0), ValueError, "'window' must be >= 1 (got 0)"),
        (lambda: ema_alpha("128"), TypeError, "'window' must be an int (got '128')"),
        (lambda: update_running_stats(*_stats(), torch.ones(1), alpha=0.0), ValueError, "'alpha' must be in (0, 1] (got 0)"),
        (lambda: update_running_stats(*_stats(), torch.ones(1), alpha=None), TypeError, "'alpha' must be a number (got None)"),
        (lambda: spike_flags(*_stats(), torch.ones(1), 6.0, 1.5, warmup=-1), ValueError, "'warmup' must be >= 0 (got -1)"),
        (lambda: spike_flags(*_stats(), torch.ones(1), 6.0, 1.5, warmup=2.0), TypeError, "'warmup' must be an int (got 2.0)"),
    ],
)
def test_function_arguments_are_checked(call: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error) as info:
        call()
    assert str(info.value) == message


def _stats() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)


def test_ema_alpha_has_the_centre_of_mass_of_the_window() -> None:
    alpha = ema_alpha(127)
    assert alpha == 1 / 64
    assert (1 - alpha) / alpha == pytest.approx((127 - 1) / 2)


def test_the_cumulative_mean_holds_up_to_half_the_window_then_the_ema_takes_over() -> None:
    """window 7: alpha = 1/4, so the first 4 values get the plain mean and the 5th the weight 1/4, not 1/5."""
    stats = RunningStats(channels=1, window=7, warmup=1)
    for x in (1.0, 2.0, 3.0, 4.0):
        stats.update(torch.tensor([x]))
    assert stats.mean.tolist() == [2.5] and stats.var.tolist() == [1.25]
    stats.update(torch.tensor([10.0]))
    assert stats.mean.tolist() == [2.5 + 0.25 * 7.5]  # the cumulative mean would be 4.0


@pytest.mark.parametrize(
    ("alpha", "error", "message"),
    [
        (0.0, ValueError, "'alpha' must be in (0, 1] (got 0)"),
        (1.5, ValueError, "'alpha' must be in (0, 1] (got 1.5)"),
        (math.nan, ValueError, "'alpha' must be in (0, 1] (got nan)"),
        ("0.1", TypeError, "'alpha' must be a number (got '0.1')"),
        (None, TypeError, "'alpha' must be a number (got None)"),
    ],
)
def test_update_running_stats_checks_alpha(alpha: object, error: type[Exception], message: str) -> None:
    zero = torch.zeros(1, dtype=torch.float64)
    with pytest.raises(error) as info:
        update_running_stats(zero, zero, zero, torch.ones(1), alpha)  # type: ignore[arg-type]
    assert str(info.value) == message


# ---- the host form: the same statistics from Python floats ----------------------------------------------------------
def same(a: list[float], b: list[float]) -> bool:
    """Bit for bit, NaN included."""
    return all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b, strict=True))


series_value = st.one_of(
    st.floats(min_value=-5.0, max_value=5.0),
    st.floats(min_value=-1e12, max_value=1e12),
    st.sampled_from([0.0, math.nan, math.inf, -math.inf, 1e300]),
)


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(
        st.tuples(series_value, series_value, st.booleans(), st.sampled_from([None, 0, 1])), min_size=1, max_size=80
    ),
    window=st.integers(min_value=1, max_value=64),
    warmup=st.integers(min_value=1, max_value=20),
    sigmas=st.floats(min_value=0.1, max_value=10.0),
    ratios=st.tuples(st.floats(min_value=1.0, max_value=3.0), st.floats(min_value=1.0, max_value=3.0)),
)
def test_host_running_stats_are_bit_identical_to_the_tensor_form(
    steps: list[tuple[float, float, bool, int | None]], window: int, warmup: int, sigmas: float,
    ratios: tuple[float, float],
) -> None:
    """The sequence LossSpikeDetector runs: test, take in what is no spike (and learnable), now and then reset."""
    tensor, host = RunningStats(2, window, warmup), HostRunningStats(2, window, warmup)
    ratio_t = torch.tensor(ratios, dtype=torch.float64)
    for a, b, learnable, reset in steps:
        values = torch.tensor([a, b], dtype=torch.float64)
        flags = tensor.spikes(values, sigmas, ratio_t)
        assert host.spikes([a, b], sigmas, list(ratios)) == flags.tolist()
        expected = spike_threshold(tensor.mean, tensor.var, sigmas, ratio_t)
        assert same(host.threshold(sigmas, list(ratios)), expected.tolist())
        assert same(host.std, torch.sqrt(torch.clamp(tensor.var, min=0.0)).tolist())
        tensor.update(values, include=~flags & torch.tensor([True, learnable]))
        host.update([a, b], include=[not flags[0].item(), not flags[1].item() and learnable])
        if reset is not None:
            keep, stats = torch.tensor([reset != 0, reset != 1]), (tensor.mean, tensor.var, tensor.count)
            tensor.mean, tensor.var, tensor.count = (torch.where(keep, t, 0.0) for t in stats)  # zero where reset
            host.reset([reset == 0, reset == 1])
        assert_same_state(host.state_dict(), tensor.state_dict())
    host_flags = host.spikes([1.0, 1.0], sigmas, ratios[0])
    host.update([1.0, 1.0], include=[not f for f in host_flags])
    assert host_flags == observe(tensor, torch.ones(2), sigmas, ratios[0]).tolist()
    assert_same_state(host.state_dict(), tensor.state_dict())


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.floats(min_value=-1e6, max_value=1e6), min_size=3, max_size=30),
    sigmas=st.floats(min_value=0.1, max_value=10.0),
    ratio=st.floats(min_value=1.0, max_value=3.0),
)
def test_a_value_at_the_threshold_is_judged_with_the_root_rounded_as_torch_rounds_it(
    values: list[float], sigmas: float, ratio: float
) -> None:
    """Spikes are decided from a bracket of the root where they can be: values on and one unit either side of the
    exact threshold fall inside it, and get the verdict of the exact threshold (and of the tensor form)."""
    host, tensor = HostRunningStats(1, 16, 2), RunningStats(1, 16, 2)
    for value in values:
        host.update([value])
        tensor.update(torch.tensor([value], dtype=torch.float64))
    (threshold,) = host.threshold(sigmas, ratio)
    for value in (threshold, math.nextafter(threshold, math.inf), math.nextafter(threshold, -math.inf)):
        expected = tensor.spikes(torch.tensor([value], dtype=torch.float64), sigmas, ratio).tolist()
        assert host.spikes([value], sigmas, ratio) == expected == [value > threshold]


def assert_same_state(host: dict[str, list[float]], tensor: dict[str, list[float]]) -> None:
    # NaN included: a value of 1e300 squares past the float64 range, in both forms alike
    assert host.keys() == tensor.keys() and all(same(host[k], tensor[k]) for k in host)


def test_host_running_stats_by_hand() -> None:
    stats = HostRunningStats(channels=2, window=7, warmup=1)
    for x in (1.0, 2.0, 3.0, 4.0):
        stats.update([x, math.nan])
    assert stats.mean == [2.5, 0.0] and stats.var == [1.25, 0.0] and stats.count == [4.0, 0.0]
    stats.update([10.0, 5.0], include=[True, False])
    assert stats.mean == [2.5 + 0.25 * 7.5, 0.0]  # past half the window: the EMA weight 1/4, not 1/5
    assert stats.threshold(6.0, 1.5)[1] == 0.0 and stats.spikes([100.0, 1.0], 6.0, 1.5) == [True, False]
    stats.reset([True, False])
    assert stats.count == [0.0, 0.0] and stats.spikes([100.0, 1.0], 6.0, 1.5) == [False, False]


def test_host_running_stats_load_the_tensor_forms_state_through_torch_load() -> None:
    tensor = RunningStats(channels=2, window=16, warmup=2)
    for x in (1.0, 2.5, 4.0):
        tensor.update(torch.tensor([x, -x]))
    buffer = io.BytesIO()
    torch.save(tensor.state_dict(), buffer)
    buffer.seek(0)
    host = HostRunningStats(channels=2, window=16, warmup=2)
    host.load_state_dict(torch.load(buffer, weights_only=True))
    assert host.state_dict() == tensor.state_dict()
    with pytest.raises(ValueError, match=r"^'mean' must have 3 channels \(got 2\)$"):
        HostRunningStats(channels=3, window=16, warmup=2).load_state_dict(host.state_dict())


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"channels": 0}, ValueError, "'channels' must be >= 1 (got 0)"),
        ({"window": 0}, ValueError, "'window' must be >= 1 (got 0)"),
        ({"warmup": True}, TypeError, "'warmup' must be an int (got True)"),
    ],
)
def test_host_running_stats_check_their_arguments(
    kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as info:
        HostRunningStats(**{**SETTINGS, **kwargs})  # type: ignore[arg-type]
    assert str(info.value) == message
