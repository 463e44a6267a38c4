"""The weight-growth test: weights that run away while the loss stands still are divergence; weights that grow
while the run learns (out of a small initialisation) are not. Hand-checkable series of host floats, and the norm the
detector reads in a fit."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import fit, tuned

from lightning_overflow import LossSpikeDetector
from lightning_overflow.numerics.growth import GrowthFinding, WeightGrowth
from lightning_overflow.testing import TinyRegressor


def _feed(growth: WeightGrowth, series: list[tuple[int, float, list[float]]], runaway_above: float = math.inf
          ) -> list[GrowthFinding]:  # fmt: skip
    """``(step, weight norm, the losses of the steps before it)`` in order; the findings. A loss above
    ``runaway_above`` is judged to run away (the detector's verdict)."""
    findings = []
    for step, norm, losses in series:
        for loss in losses:
            growth.add_loss(loss, runaway=loss > runaway_above)
        finding = growth.observe(step, norm)
        if finding is not None:
            findings.append(finding)
    return findings


def _growth(losses_per_sample: int = 2) -> WeightGrowth:
    return WeightGrowth(window=20, factor=2.0, progress=0.2, losses_per_sample=losses_per_sample, above_best=0.1)


def test_weights_that_double_while_the_loss_climbs_back_are_found_at_the_window_end() -> None:
    series = [(0, 4.0, [3.0, 3.0]), (10, 5.0, [1.0, 1.0]), (20, 8.0, [2.9, 3.1]), (30, 9.0, [3.0, 3.0])]
    assert _feed(_growth(), series) == [GrowthFinding(0, 20, 4.0, 8.0, 3.0, 3.0, 1.0)]


def test_weights_that_grow_out_of_a_small_init_while_the_loss_falls_are_no_finding() -> None:
    # 0.9 -> 2.45 in 20 steps (2.7x), the loss at its best at every sample: a saddle escape, not a divergence.
    series = [(0, 0.9, [3.0, 3.0]), (10, 1.4, [2.9, 2.9]), (20, 2.45, [2.5, 2.5]), (30, 3.0, [2.0, 2.0])]
    assert _feed(_growth(), series) == []


def test_a_loss_that_fell_by_the_progress_over_the_window_is_no_finding() -> None:
    # Above its best (1.0) at the end, but 40% below where the window started: the growth bought progress.
    series = [(0, 4.0, [5.0, 5.0]), (10, 5.0, [1.0, 1.0]), (20, 8.0, [3.0, 3.0])]
    assert _feed(_growth(), series) == []


def test_growth_below_the_factor_is_no_finding() -> None:
    series = [(0, 4.0, [3.0, 3.0]), (10, 5.0, [1.0, 1.0]), (20, 7.99, [3.0, 3.0])]
    assert _feed(_growth(), series) == []


def test_the_loss_must_stand_above_its_best_by_the_margin() -> None:
    series = [(0, 4.0, [3.0, 3.0]), (10, 5.0, [2.8, 2.8]), (20, 8.0, [3.0, 3.0])]  # 3.0 < 1.1 * 2.8
    assert _feed(_growth(), series) == []


def test_a_median_of_one_loss_is_no_level_the_run_reached() -> None:
    # Weights escaping a small initialisation; the fit's first loss (1.8) came from an easy batch, the next ones are
    # higher. That one loss is no best: the median of step 10 is the first, and growth at the best is learning. Once
    # the loss has fallen to a lower median (1.25 at step 20), standing above it is evidence (step 30).
    growth = _growth(losses_per_sample=4)
    series = [(0, 1.0, [1.8]), (10, 5.0, [3.8, 3.5, 4.7, 2.0]), (20, 6.0, [1.4, 1.1, 0.7, 1.4]),
              (30, 13.0, [3.0, 3.0, 3.0, 3.0])]  # fmt: skip
    assert _feed(growth, series) == [GrowthFinding(10, 30, 5.0, 13.0, 3.65, 3.0, 1.25)]
    # A run that overshoots from its first step looks the same while its loss stays at the first level it settled
    # at: nothing is found without a loss that ran away (here above 30); with one, the growth is found.
    overshoot = [(0, 6.7, [3.3]), (10, 32.0, [4.0, 5.0, 6.0, 5.0]), (20, 68.0, [5.0, 5.0, 5.2, 5.0])]
    assert _feed(_growth(losses_per_sample=4), overshoot) == []
    overshoot[1] = (10, 32.0, [4.0, 40.0, 6.0, 5.0])
    assert _feed(_growth(losses_per_sample=4), overshoot, runaway_above=30.0) == [
        GrowthFinding(0, 10, 6.7, 32.0, 3.3, 5.5, 5.5, at_best=True)
    ]


def _runaway(series: list[tuple[int, float, list[float]]], growth: WeightGrowth | None = None) -> list[GrowthFinding]:
    """Three losses a sample; a loss above 100 runs away."""
    return _feed(growth or _growth(3), series, runaway_above=100.0)


def test_a_loss_at_its_best_is_overshoot_once_a_loss_ran_away_within_the_window() -> None:
    # The median 3.0 stands within 10% of its best 2.8 (a run that never learned), the norm doubled, and a loss
    # between the samples of steps 0 and 20 ran away.
    series = [(0, 4.0, [3.0, 3.0, 3.0]), (10, 5.0, [2.8, 900.0, 2.8]), (20, 8.0, [3.0, 3.0, 3.0])]
    assert _runaway(series) == [GrowthFinding(0, 20, 4.0, 8.0, 3.0, 3.0, 2.8, at_best=True)]
    calm = [(0, 4.0, [3.0, 3.0, 3.0]), (10, 5.0, [2.8, 90.0, 2.8]), (20, 8.0, [3.0, 3.0, 3.0])]
    assert _runaway(calm) == []  # 90 stays within the detector's bound: growth at the loss's best


def test_a_loss_that_ran_away_before_the_window_began_does_not_count() -> None:
    # Before the sample of step 0 (the window's start), then before step 10's, which the window of step 30 starts at.
    assert _runaway([(0, 4.0, [3.0, 900.0, 3.0]), (10, 5.0, [2.8, 2.8, 2.8]), (20, 8.0, [3.0, 3.0, 3.0])]) == []
    series = [(0, 4.0, [3.0, 3.0, 3.0]), (10, 4.5, [2.8, 900.0, 2.8]), (20, 6.0, [3.0, 3.0, 3.0]),
              (30, 9.0, [3.0, 3.0, 3.0])]  # fmt: skip
    assert _runaway(series) == []  # 9.0 is 2x the norm of step 10, whose flag covers losses before it


def test_a_restart_forgets_a_loss_that_ran_away() -> None:
    growth = _growth(3)
    _runaway([(0, 4.0, [3.0, 3.0, 3.0])], growth)
    growth.add_loss(900.0, runaway=True)  # pending: it would mark the next sample
    growth.restart()
    assert not growth.ran_away and growth.samples == []


def test_after_a_finding_a_new_window_of_growth_is_needed() -> None:
    growth = _growth()
    series = [(0, 4.0, [3.0, 3.0]), (10, 5.0, [1.0, 1.0]), (20, 8.0, [3.0, 3.0]), (30, 16.0, [3.0, 3.0])]
    assert [f.step for f in _feed(growth, series)] == [20]
    # Measured from the samples before the finding, 24 at step 40 would be 3x the norm of step 20: found at 40.
    later = [(40, 24.0, [3.5, 3.5]), (50, 32.0, [4.0, 4.0])]  # samples at 30 (after the finding's restart), 40, 50
    assert [(f.since, f.step) for f in _feed(growth, later)] == [(30, 50)]


def test_growth_within_less_than_a_window_is_found_at_its_first_sample() -> None:
    # The norm doubles in the first 10 steps while the loss climbs: no need to wait for a whole window.
    series = [(0, 4.0, [3.0, 3.0]), (10, 8.0, [3.4, 3.6])]
    assert _feed(_growth(), series) == [GrowthFinding(0, 10, 4.0, 8.0, 3.0, 3.5, 3.0)]


def test_only_samples_at_most_a_window_back_are_compared() -> None:
    # 9.0 at step 30 is 2.25x the norm of step 0, but step 0 lies more than the window (20) back; from step 10 on,
    # the norm grew 1.8x.
    series = [(0, 4.0, [3.0, 3.0]), (10, 5.0, [1.0, 1.0]), (20, 6.0, [3.0, 3.0]), (30, 9.0, [3.0, 3.0])]
    assert _feed(_growth(), series) == []


def test_a_restart_forgets_the_samples_and_the_best() -> None:
    growth = _growth()
    _feed(growth, [(0, 4.0, [3.0, 3.0]), (10, 5.0, [1.0, 1.0])])
    growth.restart()
    assert growth.samples == [] and growth.losses == [] and growth.best == math.inf
    assert _feed(growth, [(20, 8.0, [3.0, 3.0]), (30, 9.0, [3.0, 3.0])]) == []


def test_non_finite_values_are_left_to_the_non_finite_detector() -> None:
    growth = _growth()
    growth.add_loss(math.nan)
    assert growth.losses == [] and growth.observe(0, 1.0) is None  # no finite loss yet: no sample
    growth.add_loss(1.0)
    assert growth.observe(0, math.inf) is None and growth.samples == []


def test_a_loss_at_zero_or_below_has_no_scale_and_no_test() -> None:
    series = [(0, 4.0, [-3.0, -3.0]), (10, 5.0, [-5.0, -5.0]), (20, 8.0, [-1.0, -1.0])]
    assert _feed(_growth(), series) == []


def test_the_state_round_trips_through_torch_load_weights_only(tmp_path: Path) -> None:
    growth = _growth()
    _feed(growth, [(0, 4.0, [3.0, 3.0]), (10, 5.0, [1.0, 1.0])])
    path = tmp_path / "growth.pt"
    torch.save(growth.state_dict(), path)
    again = _growth()
    again.load_state_dict(torch.load(path, weights_only=True))
    assert (again.samples, again.losses, again.best) == (growth.samples, growth.losses, growth.best)
    tail = [(20, 8.0, [3.0, 3.0])]
    assert _feed(again, tail) == _feed(growth, tail) == [GrowthFinding(0, 20, 4.0, 8.0, 3.0, 3.0, 1.0)]


def test_a_loss_that_ran_away_survives_the_state_round_trip_and_older_states_load() -> None:
    growth = _growth(3)
    _runaway([(0, 4.0, [3.0, 3.0, 3.0]), (10, 5.0, [2.8, 900.0, 2.8])], growth)
    growth.add_loss(950.0, runaway=True)  # since the last sample: pending
    again = _growth(3)
    again.load_state_dict(growth.state_dict())
    assert again.samples == [(0, 4.0, 3.0, False), (10, 5.0, 2.8, True)] and again.ran_away
    older = {"samples": [[0, 4.0, 3.0], [10, 5.0, 2.8]], "losses": [2.8, 2.8, 2.8], "best": 2.8, "size": 0}
    again.load_state_dict(older)  # saved before the flag existed: no loss ran away
    assert again.samples == [(0, 4.0, 3.0, False), (10, 5.0, 2.8, False)] and not again.ran_away


def test_parameters_added_to_the_optimizer_start_the_test_again() -> None:
    growth = _growth()
    _feed(growth, [(0, 4.0, [3.0, 3.0]), (10, 5.0, [1.0, 1.0])])
    growth.add_loss(3.0)
    assert growth.observe(20, 8.0, size=100) is None  # 2x, but over more parameters than before: no comparison
    assert [s[0] for s in growth.samples] == [20] and growth.size == 100


class SometimesUnused(TinyRegressor):
    """A head used on even steps only: on odd steps its weights get no gradient at all."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Parameter(torch.full((64,), 3.0))  # norm 24, far above the rest

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss + 1e-3 * self.head.square().mean() if self.trainer.global_step % 2 == 0 else loss


class WeightNorms(pl.Callback):
    """The norm of every parameter as each batch starts (before its step's update)."""

    def __init__(self) -> None:
        self.at: dict[int, float] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        self.at[trainer.global_step] = math.sqrt(sum(float(p.double().square().sum()) for p in pl_module.parameters()))


def test_the_weight_norm_covers_every_parameter_of_the_optimizer_with_a_gradient_or_not(tmp_path: Path) -> None:
    detector, weights = tuned(LossSpikeDetector(growth_every_n_steps=5), growth_window=10), WeightNorms()
    fit(SometimesUnused(), [detector, weights], max_steps=21, default_root_dir=str(tmp_path))
    samples = detector.state_dict()["growth"]["0"]["samples"]  # steps 10, 15, 20: odd and even alike
    assert [sample[0] for sample in samples] == [10, 15, 20]
    for step, norm, *_ in samples:
        assert norm == pytest.approx(weights.at[step], rel=1e-6)

