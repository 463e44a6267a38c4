"""LossSpikeDetector: spikes found at the exact step, none on healthy noisy runs, statistics never poisoned."""

from __future__ import annotations

import csv
import io
import math
import random
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import assert_bit_identical, make_trainer, tuned, weights
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger
from reference_numerics import RunningStats
from torch.utils.data import DataLoader, TensorDataset

from lightning_overflow import NonFiniteDetector, default_callbacks
from lightning_overflow.callbacks.loss_spike_detector import DivergenceEvidence, LossSpikeDetector
from lightning_overflow.events import read_journal
from lightning_overflow.health import Signal, board_for
from lightning_overflow.numerics.trend import loss_scatter
from lightning_overflow.testing import Fault, FaultInjector, TinyGAN, TinyRegressor


class SignalLog(pl.Callback):
    """Keeps every signal raised during the fit (put it after the detectors)."""

    def __init__(self) -> None:
        self.signals: list[Signal] = []
        self.loss_means: dict[int, float] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        record = board_for(trainer).current
        if record is not None and record.step == trainer.global_step:
            self.loss_means[record.step] = record.loss_mean

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        self.signals.extend(board_for(trainer).signals)


def _journal(trainer: pl.Trainer, kind: str) -> list[dict[str, Any]]:
    path = board_for(trainer).journal.path
    assert path is not None
    return [e for e in read_journal(path) if e["kind"] == kind] if path.exists() else []


def _fit(tmp_path: Path, callbacks: list[Any], model: pl.LightningModule | None = None, **kwargs: Any) -> pl.Trainer:
    trainer = make_trainer(callbacks, default_root_dir=str(tmp_path), **kwargs)
    trainer.fit(model or TinyRegressor())
    return trainer


def test_500_healthy_noisy_steps_give_no_spike_at_the_default_thresholds(tmp_path: Path) -> None:
    detector = LossSpikeDetector()
    signals = SignalLog()
    model = TinyRegressor(dropout=0.3, batch_size=4, n_samples=256)
    trainer = _fit(tmp_path, [detector, signals], model, max_steps=500)
    stats = detector._stats[0]
    assert stats.count == [500.0, 500.0]  # every step tested and taken in: nothing skipped or excluded
    spread = [s / m for s, m in zip(stats.std, stats.mean)]
    assert min(spread) > 0.3, "the run must be noisy for this test to mean anything"
    assert detector.spikes == 0 and _journal(trainer, "spike") == []
    assert signals.signals == []  # nor a suspicion of divergence, a trend, growth or a run that does not learn


def test_a_loss_spike_is_found_at_its_exact_step_and_journaled(tmp_path: Path) -> None:
    detector = LossSpikeDetector(warmup=10)
    signals = SignalLog()
    trainer = _fit(
        tmp_path,
        [detector, FaultInjector(Fault(step=30, kind="loss_spike", factor=1e3)), signals],
        max_steps=40,
    )
    loss_spikes = [s for s in signals.signals if s.kind == "loss_spike"]
    assert [(s.step, s.optimizer_index, s.source) for s in loss_spikes] == [(30, 0, "LossSpikeDetector")]
    assert detector.loss_spikes == 1
    (event,) = [e for e in _journal(trainer, "spike") if e["details"]["what"] == "loss"]
    details = event["details"]
    assert event["step"] == 30 and event["source"] == "LossSpikeDetector"
    assert details["value"] == signals.loss_means[30]
    assert details["value"] > 100 * details["reference"] and details["threshold"] < details["value"]
    assert "the training loss was" in event["message"] and "at step 30 (epoch 3), a spike" in event["message"]
    # the spike did not enter the statistics: 40 steps, 39 taken in
    assert detector._stats[0].count[0] == 39.0


def test_a_gradient_norm_spike_is_its_own_signal(tmp_path: Path) -> None:
    detector = LossSpikeDetector(warmup=10)
    signals = SignalLog()
    _fit(tmp_path, [detector, FaultInjector(Fault(step=30, kind="loss_spike", factor=1e3)), signals], max_steps=32)
    assert ("grad_spike", 30) in [(s.kind, s.step) for s in signals.signals]
    assert detector.grad_spikes >= 1 and detector.spikes == detector.loss_spikes + detector.grad_spikes


def test_check_grad_norm_false_tests_only_the_loss(tmp_path: Path) -> None:
    detector = LossSpikeDetector(warmup=10, check_grad_norm=False)
    signals = SignalLog()
    _fit(tmp_path, [detector, FaultInjector(Fault(step=30, kind="loss_spike")), signals], max_steps=32)
    assert [s.kind for s in signals.signals] == ["loss_spike"]
    assert detector._stats[0].count[1] == 0.0


def test_no_spike_during_warmup(tmp_path: Path) -> None:
    detector = LossSpikeDetector(warmup=10)
    signals = SignalLog()
    _fit(tmp_path, [detector, FaultInjector(Fault(step=5, kind="loss_spike", factor=1e3)), signals], max_steps=12)
    assert detector.spikes == 0 and signals.signals == []


def test_a_nonfinite_loss_never_enters_the_statistics(tmp_path: Path) -> None:
    detector = LossSpikeDetector(warmup=5)
    signals = SignalLog()
    faults = FaultInjector(Fault(step=12, kind="nan_loss"), Fault(step=13, kind="inf_loss"))
    _fit(tmp_path, [NonFiniteDetector(), detector, faults, signals], max_steps=20)
    assert math.isnan(signals.loss_means[12]) and math.isnan(signals.loss_means[13])  # not 0: no finite loss
    assert detector._stats[0].count == [18.0, 18.0]
    assert all(math.isfinite(v) for v in detector._stats[0].mean + detector._stats[0].var)
    assert detector.spikes == 0 and {s.kind for s in signals.signals} == {"nonfinite"}


class HugeTarget(TinyRegressor):
    """Eight unshuffled batches an epoch; sample 3 x 8 + 2 (batch 3) has a target of 1e30: that batch's loss
    overflows to inf, its gradients stay finite (norms near 1e30)."""

    def __init__(self) -> None:
        super().__init__()
        x, y = self.data.tensors
        y = y.clone()
        y[3 * self.batch_size + 2] = 1e30
        self.data = TensorDataset(x, y)


def test_a_skipped_steps_values_are_neither_tested_nor_learned(tmp_path: Path) -> None:
    """The steps the detector skips (3, 11, 19: the batch holding the 1e30 target) never happened: their finite
    gradient norms of 1e30 are no spike of the run's and never enter the gradient's statistics."""
    detector = LossSpikeDetector(warmup=2)
    signals = SignalLog()
    _fit(tmp_path, [NonFiniteDetector(), detector, signals], HugeTarget(), max_steps=24)
    skipped = sorted(s.step for s in signals.signals if s.kind == "nonfinite")
    assert skipped == [3, 11, 19]
    stats = detector._stats[0]
    assert stats.count == [21.0, 21.0]
    assert stats.mean[1] < 100.0  # the healthy steps' norms alone
    assert detector.spikes == 0


class OnesModel(pl.LightningModule):
    """100 weights and the loss ``sum(w)``: every gradient is exactly ``ones(100)``, of norm 10 (lr 0: w stays 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(100))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.w.sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.zeros(4, 1)), batch_size=1)


@pytest.mark.parametrize(("spike_at", "warmup", "spikes"), [(3, 10, 0), (12, 5, 1)])
def test_a_gradient_norm_beyond_fp32_never_enters_the_statistics(
    tmp_path: Path, spike_at: int, warmup: int, spikes: int
) -> None:
    """Gradients of 1e38 are finite, their norm 1e39 is not an FP32 number: an overflow, kept out of the statistics
    during the warm-up as after it (where it is still a spike)."""
    detector = LossSpikeDetector(warmup=warmup)  # GRAD_RATIO 2
    signals = SignalLog()
    overflow = FaultInjector(Fault(step=spike_at, kind="loss_spike", factor=1e38))
    _fit(tmp_path, [detector, overflow, signals], OnesModel(), max_steps=16)
    stats = detector._stats[0]
    assert stats.count == [16.0, 15.0]  # the loss (0 * 1e38 = 0) is taken in; the norm is not
    assert stats.mean[1] == 10.0 and stats.var[1] == 0.0
    assert [(s.kind, s.step) for s in signals.signals] == [("grad_spike", spike_at)] * spikes


def test_only_a_rising_spike_signals_again_and_every_spike_is_counted(tmp_path: Path) -> None:
    detector = LossSpikeDetector(warmup=10, check_grad_norm=False)
    signals = SignalLog()
    faults = FaultInjector(
        Fault(step=30, kind="loss_spike", factor=1e3),
        Fault(step=31, kind="loss_spike", factor=1e2),  # still a spike, but falling back: recovering
        Fault(step=32, kind="loss_spike", factor=1e5),  # rising again: diverging
    )
    trainer = _fit(tmp_path, [detector, faults, signals], max_steps=36)
    assert [s.step for s in signals.signals if s.kind == "loss_spike"] == [30, 32]
    # Three steps in a row above the threshold: the loss is diverging, not one bad batch.
    assert [(s.step, s.kind) for s in signals.signals if s.kind != "loss_spike"] == [(32, "loss_divergence")]
    spikes = _journal(trainer, "spike")
    assert [(e["step"], e["details"]["rising"]) for e in spikes] == [(30, True), (31, False), (32, True)]
    assert detector.spikes == 3


def test_a_lasting_level_shift_rebaselines_the_statistics(tmp_path: Path) -> None:
    detector = tuned(LossSpikeDetector(warmup=10, check_grad_norm=False), rebaseline_after=4)
    shift = FaultInjector(*(Fault(step=s, kind="loss_spike", factor=100.0) for s in range(30, 50)))
    trainer = _fit(tmp_path, [detector, shift], TinyRegressor(batch_size=64), max_steps=50)  # full batch: smooth
    assert [e["step"] for e in _journal(trainer, "spike")] == [30, 31, 32, 33]
    (event,) = _journal(trainer, "rebaseline")
    assert event["step"] == 33 and event["details"]["what"] == "loss"
    assert "stayed above its threshold for 4 consecutive steps" in event["message"]
    assert detector._stats[0].count[0] == 16.0  # steps 34..49, at the new level


def test_each_optimizer_has_its_own_statistics(tmp_path: Path) -> None:
    """TinyGAN steps the discriminator at even global steps and the generator at odd ones."""
    detector = LossSpikeDetector(warmup=10, check_grad_norm=False)
    signals = SignalLog()
    _fit(tmp_path, [detector, FaultInjector(Fault(step=41, kind="loss_spike")), signals], TinyGAN(), max_steps=50)
    assert [(s.kind, s.step, s.optimizer_index) for s in signals.signals] == [("loss_spike", 41, 1)]
    assert "the training loss of optimizer 1 was" in signals.signals[0].reason
    assert sorted(detector._stats) == [0, 1]


def test_spikes_are_logged_as_a_counter(tmp_path: Path) -> None:
    logger = CSVLogger(str(tmp_path))
    detector = LossSpikeDetector(warmup=10)
    faults = FaultInjector(Fault(step=30, kind="loss_spike", factor=1e3))
    make_trainer([detector, faults], logger=logger, log_every_n_steps=1, max_steps=32).fit(TinyRegressor())
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("overflow/spikes")]
    by_step = {int(r["step"]): float(r["overflow/spikes"]) for r in rows}
    assert by_step[29] == 0.0 and by_step[30] == detector.spikes and by_step[31] == detector.spikes


def test_a_healthy_run_is_bit_identical_with_and_without_the_detector(tmp_path: Path) -> None:
    pl.seed_everything(0)
    plain = TinyRegressor()
    make_trainer(max_steps=30, default_root_dir=str(tmp_path)).fit(plain)
    pl.seed_everything(0)
    watched = TinyRegressor()
    _fit(tmp_path, [LossSpikeDetector(warmup=5)], watched, max_steps=30)
    assert_bit_identical(weights(plain), weights(watched))


def test_state_round_trips_through_torch_load_weights_only(tmp_path: Path) -> None:
    detector = LossSpikeDetector(warmup=10)
    _fit(tmp_path, [detector, FaultInjector(Fault(step=12, kind="loss_spike"))], max_steps=16)
    buffer = io.BytesIO()
    torch.save(detector.state_dict(), buffer)
    buffer.seek(0)
    restored = LossSpikeDetector(warmup=10)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert restored.state_dict() == detector.state_dict()
    assert restored.spikes == detector.spikes >= 1
    assert restored._stats[0].mean == detector._stats[0].mean


def test_a_new_fit_starts_from_fresh_statistics(tmp_path: Path) -> None:
    detector = LossSpikeDetector(warmup=10)
    _fit(tmp_path, [detector, FaultInjector(Fault(step=12, kind="loss_spike"))], max_steps=16)
    assert detector.spikes >= 1
    _fit(tmp_path, [detector], max_steps=8)
    assert detector.spikes == 0 and detector._stats[0].count == [8.0, 8.0]


class RecordSpy(pl.Callback):
    """``(loss mean, total norm, grads finite, beyond FP32)`` of every optimizer step's record, as the suite read it."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, float, bool, bool]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        r = board_for(trainer).current
        assert r is not None
        self.steps.append((r.loss_mean, r.total_norm, r.grads_finite, r.grads_beyond_fp32))


def test_the_statistics_are_bit_identical_to_the_tensor_running_stats(tmp_path: Path) -> None:
    """The detector's host statistics against the documented tensor class, fed the values the suite read."""
    detector, spy = tuned(LossSpikeDetector(warmup=8), min_rise=0.0), RecordSpy()  # min_rise 0: no floor above the threshold
    faults = FaultInjector(Fault(step=14, kind="loss_spike", factor=50.0), Fault(step=18, kind="nan_loss"),
                           Fault(step=22, kind="loss_spike", factor=1e25))  # a spike, NaN, gradients beyond FP32 norms
    _fit(tmp_path, [NonFiniteDetector(), detector, spy, faults], max_steps=30)
    reference = RunningStats(2, detector.window, detector.warmup)
    ratios = torch.tensor([detector.loss_ratio, detector.grad_ratio], dtype=torch.float64)
    spikes = 0
    for loss, norm, finite, beyond in spy.steps:
        values = torch.tensor([loss, norm if finite else math.nan], dtype=torch.float64)
        flags = reference.spikes(values, detector.sigmas, ratios)
        reference.update(values, include=~flags & torch.tensor([True, not beyond]))
        spikes += int(flags.sum())
    assert len(spy.steps) == 30 and spikes == detector.spikes >= 2
    assert detector.state_dict()["stats"]["0"] == reference.state_dict()


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_resume_continues_exactly_as_the_uninterrupted_run(tmp_path: Path) -> None:
    def run(max_steps: int, ckpt_path: Path | None = None, **kwargs: Any) -> LossSpikeDetector:
        pl.seed_everything(0, verbose=False)
        detector = LossSpikeDetector(warmup=4)
        faults = FaultInjector(Fault(step=5, kind="loss_spike", factor=30.0), Fault(step=13, kind="loss_spike"))
        make_trainer([detector, faults, *kwargs.pop("extra", [])], default_root_dir=str(tmp_path),
                     max_steps=max_steps, **kwargs).fit(TinyRegressor(), ckpt_path=ckpt_path)
        return detector

    straight = run(20)  # the checkpoint at the end of the first epoch (8 batches): the data resume where they were
    saver = ModelCheckpoint(dirpath=tmp_path, filename="half", every_n_train_steps=8, save_top_k=-1)
    run(8, extra=[saver], enable_checkpointing=True)
    saved = torch.load(tmp_path / "half.ckpt", weights_only=True)["callbacks"][straight.state_key]
    assert saved["stats"]["0"]["count"] == [7.0, 7.0]  # the spike at step 5 stayed out of both statistics
    resumed = run(20, ckpt_path=tmp_path / "half.ckpt")
    assert resumed.state_dict() == straight.state_dict() and straight.loss_spikes == 2


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"window": 1}, ValueError, "'window' must be >= 2 (got 1)"),
        ({"warmup": 0}, ValueError, "'warmup' must be >= 1 (got 0)"),
        ({"sigmas": 0}, ValueError, "'sigmas' must be in (0, inf) (got 0)"),
        ({"check_grad_norm": 1}, TypeError, "'check_grad_norm' must be a bool (got 1)"),
        ({"growth_every_n_steps": 0}, ValueError, "'growth_every_n_steps' must be >= 1 (got 0)"),
        ({"growth_every_n_steps": 60}, ValueError, "'growth_every_n_steps' must be at most the growth test's window, "
                                                    "50 steps: the test compares two weight samples within it (got 60)"),
    ],
)
def test_arguments_are_checked(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error) as info:
        LossSpikeDetector(**kwargs)
    assert str(info.value) == message


def test_state_key_names_the_identifying_arguments() -> None:
    assert LossSpikeDetector().state_key == "LossSpikeDetector{'window': 128, 'sigmas': 6.0}"
    assert LossSpikeDetector(sigmas=4.0).state_key != LossSpikeDetector().state_key


# ---- the level test --------------------------------------------------------------------------------------------
LEVEL = {"anchor_steps": 8, "runaway_factor": 100.0, "confirm_steps": 3, "trend_window": None,
         "trend_probability": 0.999, "trend_margin": 0.5, "level_window": 4, "level_factor": 2.0,
         "min_rise": 0.1}  # fmt: skip


def _first_finding(losses: list[float], **overrides: Any) -> tuple[int, tuple[str, str]] | None:
    evidence = DivergenceEvidence()
    for i, loss in enumerate(losses):
        finding = evidence.observe(loss, spike=False, **{**LEVEL, **overrides})
        if finding is not None:
            return i, finding
    return None


def test_a_loss_that_went_down_and_settles_back_up_is_divergence() -> None:
    # Anchor 4; the level falls to 1 (best); at 3.0 the bound is 2 * min(1, 4) = 2. The level, an EMA of span 4
    # (alpha 0.4), is 3 - 2 * 0.6**k after k steps at 3.0: above 2 from k = 2, for the third consecutive step at
    # k = 4 (3 - 2 * 0.1296 = 2.7408).
    losses = [4.0] * 8 + [1.0] * 40 + [3.0] * 10
    index, (kind, reason) = _first_finding(losses)
    assert (index, kind) == (48 + 3, "loss_divergence")
    assert reason.startswith(
        "rose far above its best level and stayed there: its level over about 4 healthy steps is 2.741, above 2 (")
    assert "(2 times the lower of its best level 1 and its starting level 4, and at least 0.1x its starting level)" \
           in reason


def test_each_finding_names_the_losses_it_rests_on_so_the_rollback_goes_back_before_them() -> None:
    def span(losses: list[float], **overrides: Any) -> tuple[int, str, int]:
        evidence = DivergenceEvidence()
        for i, loss in enumerate(losses):
            finding = evidence.observe(loss, spike=False, **{**LEVEL, **overrides})
            if finding is not None:
                return i, finding[0], evidence.span
        raise AssertionError("no finding")

    # The level: its 3 confirming steps and the window of 4 it averages (losses 45-51; the rise began at 48).
    assert span([4.0] * 8 + [1.0] * 40 + [3.0] * 10) == (51, "loss_divergence", 7)
    # A streak of losses beyond 100x the anchor: the streak itself (losses 8-10).
    assert span([4.0] * 8 + [500.0] * 3) == (10, "loss_divergence", 3)
    # The trend: its window of 10 losses.
    rising = [4.0] * 8 + [1.0] * 12 + [2.0 + 0.1 * i for i in range(10)]  # windows of losses 0-9, 10-19, 20-29
    assert span(rising, level_window=None, trend_window=10) == (29, "loss_trend", 10)


def test_a_trend_must_rise_min_rise_times_the_anchor_above_the_best_window() -> None:
    # Anchor 1; the best window sits at 1e-6 (a hinge loss at 0); the next window climbs steadily (P(slope > 0) = 1).
    trend = {"trend_window": 10, "level_window": None}
    creeping = [1.0] * 8 + [1e-6] * 12 + [1e-6 + 1e-5 * i for i in range(10)]  # mean 4.6e-5: 46x its best
    assert _first_finding(creeping, **trend, min_rise=0.1) is None
    index, (kind, reason) = _first_finding(creeping, **trend, min_rise=0.0)  # relative margin alone: a trend
    assert (index, kind) == (29, "loss_trend")
    climbing = [1.0] * 8 + [1e-6] * 12 + [0.02 + 0.02 * i for i in range(10)]  # mean 0.11: beyond 0.1 x anchor
    index, (kind, reason) = _first_finding(climbing, **trend, min_rise=0.1)
    assert (index, kind) == (29, "loss_trend")
    assert reason.endswith("above the best window mean 1e-06 by more than 0.5x it and 0.1x its starting level 1")


def test_a_rise_to_less_than_twice_the_best_is_no_divergence() -> None:
    assert _first_finding([4.0] * 8 + [1.0] * 40 + [1.9] * 200) is None  # a harder task, new data


def test_a_rise_past_twice_the_best_is_divergence_however_far_the_start() -> None:
    # Half the progress from 4 down to 1 is not given back at 2.4, which SGD at twice its stable rate swings back
    # to: 2.4 - 1.4 * 0.6**k is above 2 from k = 3, the third time at k = 5.
    index, (kind, _) = _first_finding([4.0] * 8 + [1.0] * 40 + [2.4] * 200)
    assert (index, kind) == (48 + 4, "loss_divergence")


def test_a_run_that_never_went_below_its_anchor_diverges_at_twice_it() -> None:
    assert _first_finding([4.0] * 8 + [7.9] * 200) is None
    index, (kind, _) = _first_finding([4.0] * 8 + [8.5] * 20)
    # Level and best 4 over the eight first losses, then 8.5 - 4.5 * 0.6**k: above 8 from k = 5, the third time
    # at k = 7 (the loss of index 8 is k = 1).
    assert (index, kind) == (8 + 6, "loss_divergence")


def test_the_level_starts_again_after_a_signal_and_a_restore_and_keeps_its_best() -> None:
    evidence = DivergenceEvidence()
    losses = [4.0] * 8 + [1.0] * 40 + [3.0] * 4
    findings = [evidence.observe(loss, spike=False, **LEVEL) for loss in losses]
    assert [i for i, f in enumerate(findings) if f] == [51]
    assert evidence.level_count == 0 and evidence.best_level == pytest.approx(1.0, abs=1e-6)
    # Right after the signal the level is the mean of a new window (3.0 after 4 steps, above 2), and needs 3
    # consecutive steps above the bound again: the 4th, 5th and 6th loss.
    assert [evidence.observe(3.0, spike=False, **LEVEL) for _ in range(5)] == [None] * 5
    assert evidence.observe(3.0, spike=False, **LEVEL) is not None
    evidence.level_count, evidence.level_streak = 5, 2
    evidence.after_restore()
    assert (evidence.level_count, evidence.level_streak) == (0, 0)
    assert evidence.best_level == pytest.approx(1.0, abs=1e-6)
    assert DivergenceEvidence.from_state(evidence.state_dict(), 2).state_dict() == evidence.state_dict()


def test_one_outlier_that_the_spike_test_let_through_settles_no_level() -> None:
    # Best level 1, bound 2. One loss of 100 lifts the level (alpha 0.4) to 40.6, and it stays above the bound
    # for 8 steps; the confirming steps' own losses are 1: no divergence. Before, the third step fired.
    assert _first_finding([4.0] * 8 + [1.0] * 40 + [100.0] + [1.0] * 30) is None
    # Two of the three confirming losses above the bound: a level that settled there.
    index, (kind, _) = _first_finding([4.0] * 8 + [1.0] * 40 + [100.0, 100.0] + [1.0] * 30)
    assert (index, kind) == (48 + 2, "loss_divergence")


def _learned() -> DivergenceEvidence:
    """First losses 4 (anchor and first loss 4), best level 1: the bound is 2."""
    evidence = DivergenceEvidence()
    for loss in [4.0] * 8 + [1.0] * 40:
        assert evidence.observe(loss, spike=False, **LEVEL) is None
    return evidence


def test_a_restored_state_above_the_bound_is_judged_against_the_first_loss_until_it_trained_back() -> None:
    """The fit's first snapshot sits at the first losses, above the bound of a run that had learned: restored
    there, the run first trains back down; a rise after that is judged as any."""
    evidence = _learned()
    evidence.after_restore()
    assert not evidence.level_armed
    # Back at the first loss (level 4 > 2) for 30 steps: before, the test fired on the third step of the level.
    assert [evidence.observe(4.0, spike=False, **LEVEL) for _ in range(30)] == [None] * 30
    # Training back down: the level 4 - 3 * (1 - 0.6**k) is within 2 from k = 3; the test is armed from there.
    for _ in range(2):
        assert evidence.observe(1.0, spike=False, **LEVEL) is None and not evidence.level_armed
    assert evidence.observe(1.0, spike=False, **LEVEL) is None and evidence.level_armed
    for _ in range(20):
        assert evidence.observe(1.0, spike=False, **LEVEL) is None
    # A settled rise to 3 fires as on a run never restored: the third step above 2, at k = 4.
    findings = [evidence.observe(3.0, spike=False, **LEVEL) for _ in range(4)]
    assert [f is not None for f in findings] == [False] * 3 + [True]
    restored = DivergenceEvidence.from_state(evidence.state_dict(), 2)
    assert restored.state_dict() == evidence.state_dict() and restored.level_armed


def test_a_restored_state_above_the_first_loss_is_judged_at_once() -> None:
    """A snapshot taken as the divergence began: above the first loss, it is no state on its way down."""
    evidence = _learned()
    evidence.after_restore()
    # The level is the mean of the first 4 losses (6), above max(2.5, 4), for the third time at the 6th loss.
    findings = [evidence.observe(6.0, spike=False, **LEVEL) for _ in range(6)]
    assert [f is not None for f in findings] == [False] * 5 + [True] and not evidence.level_armed
    assert "its level over about 4 healthy steps is 6, above 4 " in findings[5][1]


def test_a_streak_is_judged_by_its_least_loss() -> None:
    evidence = DivergenceEvidence()
    for loss in [1.0] * 8:
        evidence.observe(loss, spike=False, **LEVEL)
    findings = [evidence.observe(loss, spike=True, **LEVEL) for loss in (14.6, 5.7, 9.6)]
    assert findings[:2] == [None, None] and findings[2][0] == "loss_divergence"
    assert evidence.judged == 5.7  # what the diverged state gave on each of the batches, however they scatter


# ---- the level test through the losses' scatter -------------------------------------------------------------------
NOISY = {**LEVEL, "level_window": 20}  # the default window


def _scattered(n: int, seed: int) -> list[float]:
    """Losses of mean 1 that scatter as a squared error of a batch of 4 does (a gamma of shape 2, standard deviation
    0.71): steady, and healthy."""
    rng = random.Random(seed)
    return [rng.gammavariate(2.0, 0.5) for _ in range(n)]


@pytest.mark.parametrize("seed", range(4))
def test_losses_that_scatter_about_a_steady_mean_never_stand_far_above_their_best(seed: int) -> None:
    losses = _scattered(5000, seed)
    assert _first_finding(losses, **NOISY, level_sigmas=3.0) is None
    # Without the allowance, the least of a noisy average and a first loss that fell low by chance call it divergence.
    assert _first_finding(losses, **NOISY, level_sigmas=0.0) is not None


def test_a_loss_that_settles_back_up_through_its_scatter_is_still_divergence() -> None:
    rng = random.Random(0)
    losses = [4.0 + rng.gauss(0.0, 0.2) for _ in range(8)] + [1.0 + rng.gauss(0.0, 0.2) for _ in range(300)]
    losses += [3.0 + rng.gauss(0.0, 0.6) for _ in range(40)]  # up from 1 to 3, scattering as much relative to it
    index, (kind, reason) = _first_finding(losses, **NOISY, level_sigmas=3.0)
    plain, _ = _first_finding(losses, **NOISY, level_sigmas=0.0)
    # The allowance (3 standard errors of the scatter at the best) costs six steps, not the finding.
    assert kind == "loss_divergence" and (plain, index) == (308 + 7, 308 + 13)
    assert "once their usual scatter is allowed for), above " in reason


def test_the_scatter_follows_the_noise_not_a_trend_or_an_outlier() -> None:
    noise = [0.1 * (-1) ** i for i in range(41)]
    flat = loss_scatter([1.0 + e for e in noise])
    assert flat == pytest.approx(0.2 / 0.6745 / math.sqrt(2.0))  # |differences| of 0.2 throughout
    assert loss_scatter([1.0 + 0.01 * i + e for i, e in enumerate(noise)]) == pytest.approx(flat, rel=0.06)
    assert loss_scatter([1.0 + e + (100.0 if i == 20 else 0.0) for i, e in enumerate(noise)]) == flat
    assert loss_scatter([2.0]) == 0.0


def test_a_healthy_run_whose_losses_scatter_widely_trains_as_without_the_suite(tmp_path: Path) -> None:
    """Batches of 2 of targets that no input predicts: the loss never moves from its mean and scatters as much."""
    def model() -> TinyRegressor:
        torch.manual_seed(0)
        regressor = TinyRegressor(batch_size=2, n_samples=1200, lr=1e-3)
        x, _ = regressor.data.tensors
        regressor.data = TensorDataset(x, torch.randn(len(x), 1, generator=torch.Generator().manual_seed(1)))
        return regressor

    bare = model()
    make_trainer([], max_steps=600).fit(bare)
    protected = model()
    trainer = make_trainer(default_callbacks(clip=None), max_steps=600, default_root_dir=str(tmp_path))
    trainer.fit(protected)
    assert _journal(trainer, "loss_divergence") == [] and _journal(trainer, "rollback") == []
    assert_bit_identical(weights(bare), weights(protected))


def test_the_anchor_never_sits_above_the_first_loss() -> None:
    evidence = DivergenceEvidence()
    for loss in [4.0, 25.0, 300.0, 26.0, 16.0, 39.0, 15.0, 3.7]:  # a loss that climbs from its first steps on
        evidence.observe(loss, spike=False, **LEVEL)
    assert evidence.anchor == 4.0  # the median, 25, would anchor the climb


def test_a_loss_without_a_scale_or_below_zero_has_no_level_test() -> None:
    assert _first_finding([0.0] * 8 + [1e-6] * 100) is None  # anchor 0: a threshold of 0 would call any rise one
    assert _first_finding([1.0] * 8 + [-3.0] * 40 + [0.5] * 100) is None  # a loss that went negative


def test_without_a_level_window_there_is_no_level_test() -> None:
    assert _first_finding([4.0] * 8 + [1.0] * 40 + [3.0] * 50, level_window=None) is None


def test_with_several_optimizers_the_level_test_is_off(tmp_path: Path) -> None:
    detector = tuned(LossSpikeDetector(warmup=5), level_window=2)
    fit_gan = make_trainer([detector], default_root_dir=str(tmp_path), max_steps=40)
    fit_gan.fit(TinyGAN())
    assert all(e.level_count == 0 for e in detector._evidence.values())


# ---- a run that does not learn --------------------------------------------------------------------------------------
def _findings(losses: list[float], evidence: DivergenceEvidence | None = None) -> list[tuple[int, str, int]]:
    """Every finding of the level tests and the progress clock, as ``(index, kind, span)``."""
    evidence = evidence or DivergenceEvidence()
    found = []
    for i, loss in enumerate(losses):
        finding = evidence.observe(loss, spike=False, **LEVEL, no_progress=True)
        if finding is not None:
            found.append((i, finding[0], evidence.span))
    return found


def test_a_loss_that_never_leaves_its_start_level_is_suspected_of_not_learning_at_the_exact_step() -> None:
    # The level of a window of 4 is first judged at the 4th loss (index 3): the last low, 4. Every loss after it is
    # one more step without a new low by 0.05 x 4: the 50th, index 53, is the finding; the clock then starts again.
    # Each finding rests on every state since the last low and the window before it: the trial goes back before them.
    assert _findings([4.0] * 110) == [(53, "no_progress", 54), (103, "no_progress", 104)]
    evidence = DivergenceEvidence()
    for loss in [4.0] * 53:
        evidence.observe(loss, spike=False, **LEVEL, no_progress=True)
    kind, reason = evidence.observe(4.0, spike=False, **LEVEL, no_progress=True)
    assert kind == "no_progress" and reason == (
        "has stalled short of half its starting level: its level over about 4 healthy steps is 4, 1x its starting "
        "level 4, with no new low 5% of that start (0.2) below the last low (4, so below 3.8) in 50 healthy steps"
    )


def test_a_loss_that_stalls_above_half_its_start_is_suspected_50_steps_after_its_last_progress() -> None:
    # The level (alpha 0.4) falls from 4 toward 2.5 as 4 - 1.5 * (1 - 0.6**k) at the k-th loss of 2.5: 3.4, 3.04,
    # 2.824, 2.694, 2.617. Each is a new low by 0.2 (0.05 x 4) below the last one but 2.694 (k = 4, index 23); the last,
    # at index 24. Then it creeps toward 2.5, never 0.2 lower, and stays above 2 (half the start): 50 steps later.
    assert _findings([4.0] * 20 + [2.5] * 100) == [(74, "no_progress", 54)]


def test_a_slow_starter_that_learns_is_never_suspected_nor_a_run_that_learned_while_below_its_start() -> None:
    # Flat for 45 steps (the clock reaches 41 of 50), then down 0.1 a step to 1: never suspected, and once the level
    # came down to half its start the clock has stopped, through 300 more steps at 1.
    slow_start = [4.0] * 45 + [4.0 - 0.1 * (k + 1) for k in range(30)] + [1.0] * 300
    assert _findings(slow_start) == []
    # Learned, then a harder task (new data) at 3, 0.75 x the start: the level test suspects that (and again after
    # each signal); never a run that does not learn.
    shifted = _findings([4.0] * 8 + [1.0] * 40 + [3.0] * 300)
    assert shifted[0] == (51, "loss_divergence", 7) and {kind for _, kind, _ in shifted} == {"loss_divergence"}


def test_a_run_that_learned_and_came_back_to_its_start_is_suspected_50_steps_after_the_relapse() -> None:
    # Learned (the level of the losses of 1 comes down to half the start of 4), then the losses jump to 4.5. The level
    # (alpha 0.4, from about 1) passes the start at the 4th loss of 4.5, index 51: what was learned is lost and the
    # clock runs again. The level falls no more, so the 50th step without a new low is index 100, resting on the 50
    # states since the relapse and the window before it. The level test is left out here (a factor of 100): it is
    # the other way a relapse is caught, where the losses scatter little.
    relapse = [4.0] * 8 + [1.0] * 40 + [4.5] * 100
    evidence = DivergenceEvidence()
    found = []
    for i, loss in enumerate(relapse):
        finding = evidence.observe(loss, spike=False, **{**LEVEL, "level_factor": 100.0}, no_progress=True)
        if finding is not None:
            found.append((i, finding[0], evidence.span))
    assert found == [(100, "no_progress", 54)]
    evidence = DivergenceEvidence()
    for loss in relapse[:100]:
        evidence.observe(loss, spike=False, **{**LEVEL, "level_factor": 100.0}, no_progress=True)
    kind, reason = evidence.observe(relapse[100], spike=False, **{**LEVEL, "level_factor": 100.0}, no_progress=True)
    # It had learned at a level of 1.648 (4 - 3 x (1 - 0.6**k), the first at or below 2); its last low on its way
    # down was 2.08, the last new low by 0.2 before it.
    assert kind == "no_progress" and reason == (
        "came back up to its starting level after it had come down to 1.648, and has stalled: its level over about 4 "
        "healthy steps is 4.5, 1.12x its starting level 4, with no new low 5% of that start (0.2) below the last low "
        "on its way down (2.08, so below 1.88) in 50 healthy steps"
    )
    # Short of its start (3.9 of 4) the run that learned is never suspected of not learning.
    evidence = DivergenceEvidence()
    for loss in [4.0] * 8 + [1.0] * 40 + [3.9] * 100:
        finding = evidence.observe(loss, spike=False, **{**LEVEL, "level_factor": 100.0}, no_progress=True)
        assert finding is None


def test_the_progress_clock_outlives_a_false_alarm_and_round_trips_its_state() -> None:
    evidence = DivergenceEvidence()
    assert _findings([4.0] * 60, evidence) == [(53, "no_progress", 54)]
    # A false alarm relearns the run's level from its next losses, but not where it started: the clock goes on
    # against the first anchor, from 0.
    fresh = evidence.relearned()
    assert (fresh.start, fresh.anchor, fresh.progress.since, fresh.progress.mark) == (4.0, 0.0, 0, 4.0)
    restored = DivergenceEvidence.from_state(fresh.state_dict(), 2)
    assert restored.state_dict() == fresh.state_dict()
    # A state of this version written before the clock existed starts it afresh.
    older = {k: v for k, v in evidence.state_dict().items() if k not in ("start", "progress")}
    assert DivergenceEvidence.from_state(older, 2).progress.mark == math.inf
    # A restored state's progress counts from where it stands: the low of the state undone is forgotten, the start
    # is not. Its level is judged again from its 4th loss (index 3), and 50 steps without progress later, at 53:
    fresh.after_restore()
    assert (fresh.start, fresh.progress.mark, fresh.progress.stalled) == (4.0, math.inf, 0)
    assert _findings([3.9] * 60, fresh) == [(53, "no_progress", 54)]
