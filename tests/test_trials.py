"""Trials: a suspicion runs the remedies against the run as it is on the same batches, and only a measured win acts.

The suspicion is raised at an exact step by a test detector (:class:`Suspect`), so that each test controls what the
trial is about; the remedies are those of ``LRBackoff`` and ``Rollback`` (the last verified snapshot at lower rates).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import assert_bit_identical, fit, make_trainer, weights

from lightning_overflow import (
    AutoClip, LossSpikeDetector, LRBackoff, NonFiniteDetector, Rollback, TrialConfig, default_callbacks, read_journal,
    side_run,
)
from lightning_overflow.callbacks._base import DETECTOR, SuiteCallback
from lightning_overflow.health import StepHealth
from lightning_overflow.policy import StepAction
from lightning_overflow.testing import Fault, FaultInjector, TinyRegressor
from lightning_overflow.trial import Trial

BATCHES_PER_EPOCH = 8  # TinyRegressor: 64 samples, batch size 8, no shuffling


class Suspect(SuiteCallback):
    """A detector that suspects the state at exact steps (``kind``, onset ``onset`` or else the step itself)."""

    stage = DETECTOR

    def __init__(self, *steps: int, kind: str = "loss_divergence", onset: int | None = None) -> None:
        self.steps = set(steps)
        self.kind = kind
        self.onset = onset

    @property
    def state_key(self) -> str:
        return "Suspect"

    def _after_step(self, trainer: pl.Trainer, record: StepHealth, action: StepAction) -> None:
        if record.step in self.steps:
            onset = record.step if self.onset is None else self.onset
            self._signal(trainer, self.kind, f"suspected at step {record.step}", onset=onset)


class WeightsAtBatchEnd(pl.Callback):
    """The weights at the end of every batch (after the suite acted), by ``global_step``."""

    def __init__(self) -> None:
        self.at: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        self.at[trainer.global_step] = weights(pl_module)


def _journal(root: Path) -> list[dict[str, Any]]:
    path = root / "overflow_events.jsonl"
    return list(read_journal(path)) if path.exists() else []


def _trials(root: Path) -> list[dict[str, Any]]:
    return [e for e in _journal(root) if e["kind"] == "trial"]


def _lr(trainer: pl.Trainer) -> float:
    return float(trainer.optimizers[0].param_groups[0]["lr"])


# ---- the verdict ---------------------------------------------------------------------------------------------------
def test_a_tie_goes_to_the_incumbent() -> None:
    trial = Trial(kind="loss_divergence", step=10, config=TrialConfig(steps=4), lr_factors=[0.5])
    for loss in (1.0, 2.0, 3.0, 4.0):
        trial.add(loss, loss)
    verdict = trial.verdict()
    assert verdict.winner is None and verdict.comparisons[0].mean == 0.0
    assert verdict.reason.endswith("none beyond 2 standard errors and 0.02, so the run goes on as it was")


def test_a_remedy_wins_only_beyond_the_noise_and_the_least_gain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TrialConfig, "judged_share", 1.0)  # every pair judged
    config = TrialConfig(steps=6)
    noisy = Trial(kind="loss_trend", step=0, config=config, lr_factors=[0.5])
    for incumbent, remedy in [(2.0, 1.0), (1.0, 2.0), (2.0, 1.0), (1.0, 1.9), (2.0, 1.0), (1.0, 1.8)]:
        noisy.add(incumbent, remedy)
    assert noisy.verdict().winner is None  # better on half the batches, worse on the others: noise
    small = Trial(kind="loss_trend", step=0, config=config, lr_factors=[0.5])
    for i in range(6):
        small.add(1.0 + 0.01 * i, 0.99 + 0.01 * i)  # better every time, by half a percent: not worth it
    comparison = small.verdict().comparisons[0]
    assert comparison.better == 6 and comparison.mean < 0.02 and small.verdict().winner is None


def test_a_scheduled_trial_keeps_a_lower_rate_only_when_it_does_much_better() -> None:
    # The remedy's loss 10% lower on every judged batch: a relative gain of 0.1/1.9 = 0.0526. A suspicion's trial keeps
    # it (beyond 0.02); a scheduled one, which no suspicion opened, asks for 0.2 (SCHEDULED_MIN_GAIN).
    def verdict(kind: str, remedy_loss: float) -> Any:
        trial = Trial(kind=kind, step=100, config=TrialConfig(steps=4), lr_factors=[0.5])
        for _ in range(4):
            trial.add(1.0, remedy_loss)
        return trial.verdict()

    assert verdict("loss_divergence", 0.9).winner == 0
    scheduled = verdict("scheduled", 0.9)
    assert scheduled.winner is None and scheduled.comparisons[0].mean == pytest.approx(0.1 / 1.9)
    assert scheduled.reason.endswith("none beyond 2 standard errors and 0.2, so the run goes on as it was")
    assert verdict("scheduled", 0.6).winner == 0  # 0.4 / 1.6 = 0.25: a loss 40% lower


def test_the_remedy_that_does_best_is_kept_and_only_the_last_batches_are_judged() -> None:
    trial = Trial(kind="weight_growth", step=0, config=TrialConfig(steps=8), lr_factors=[0.5, 0.125])
    # Both remedies start far behind (their snapshot is older); only the last half of the batches are judged.
    for incumbent, half, eighth in [(1.0, 9.0, 9.0)] * 4 + [(4.0, 2.0, 1.0), (4.2, 2.1, 1.1), (3.9, 2.0, 0.9),
                                                            (4.1, 1.9, 1.0)]:  # fmt: skip
        trial.add(incumbent, half, eighth)
    verdict = trial.verdict()
    assert [c.pairs for c in verdict.comparisons] == [4, 4] and verdict.winner == 1
    assert all(c.wins for c in verdict.comparisons)


def test_a_non_finite_loss_counts_fully_against_its_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TrialConfig, "judged_share", 1.0)  # every pair judged
    trial = Trial(kind="loss_divergence", step=0, config=TrialConfig(steps=4), lr_factors=[0.5])
    for _ in range(4):
        trial.add(math.nan, 3.0)
    assert trial.verdict().winner == 0 and trial.verdict().comparisons[0].mean == 1.0
    both = Trial(kind="loss_divergence", step=0, config=TrialConfig(steps=4), lr_factors=[0.5])
    for _ in range(4):
        both.add(math.nan, math.nan)  # the batch itself is bad: no pair
    assert both.verdict().comparisons[0].pairs == 0 and both.verdict().winner is None


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"steps": 1}, ValueError, "'steps' must be >= 2 (got 1)"),
        ({"remedies": 0}, ValueError, "'remedies' must be >= 1 (got 0)"),
        ({"mode": "sideways"}, ValueError, "'mode' must be one of 'ab', 'frozen' (got 'sideways')"),
        ({"every_n_steps": 2.5}, TypeError, "'every_n_steps' must be an int or None (got 2.5)"),
    ],
)
def test_settings_are_checked_when_built(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error) as caught:
        TrialConfig(**kwargs)
    assert str(caught.value) == message


# ---- in a fit -------------------------------------------------------------------------------------------------------
def test_a_false_alarm_is_reverted_and_the_run_goes_on_bit_identical(tmp_path: Path) -> None:
    """A healthy run suspected at step 30: the remedies (the snapshot of step 20 at half and an eighth of the rate)
    lose to the run as it is, which trained on every batch: the run ends bit-identical to the run without the
    suite, at the configured rate, and the trial is journaled as a false alarm."""
    torch.manual_seed(0)
    bare = TinyRegressor(dropout=0.2)
    fit(bare, [], max_steps=80)
    torch.manual_seed(0)
    model = TinyRegressor(dropout=0.2)
    suite = [Suspect(30), LRBackoff(), Rollback(every_n_steps=10)]
    trainer = fit(model, suite, max_steps=80, default_root_dir=str(tmp_path))
    assert_bit_identical(weights(model), weights(bare))
    assert _lr(trainer) == model.lr
    (trial,) = _trials(tmp_path)
    assert trial["step"] == 51  # opened at the end of step 30's batch, 20 optimizer steps
    details = trial["details"]
    assert (details["signal"], details["opened_at"], details["snapshot_step"]) == ("loss_divergence", 30, 30)
    assert (details["lr_factors"], details["kept"], details["false_alarm"]) == ([0.5, 0.125], False, True)
    assert (details["steps"], details["extra_steps"], details["mode"]) == (20, 40, "ab")
    assert len(details["incumbent_losses"]) == 20 and [len(r) for r in details["remedy_losses"]] == [20, 20]
    assert [k for k in (e["kind"] for e in _journal(tmp_path)) if k in ("backoff", "rollback")] == []
    assert "; at step 51 it kept the run as it was: " in trial["message"]


class Sabotaged(TinyRegressor):
    """At step 30 the first layer's weights are multiplied by 30: its units saturate and the loss stays high."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.trainer.global_step == 30:
            with torch.no_grad():
                self.net[0].weight.mul_(30.0)


def test_a_true_divergence_keeps_the_remedy_exactly_as_an_immediate_rollback_would_have_trained() -> None:
    """The sabotaged state is suspected at step 31; the remedy (the snapshot of step 30, taken before the sabotage,
    at half the rate) wins its trial. The run that keeps it ends bit-identical to the same run that rolled back and
    backed off at once, at the end of step 31's batch, without a trial: the remedy trained on exactly those batches,
    at that rate."""
    finals, lrs = [], []
    for trial in (TrialConfig(remedies=1), None):
        torch.manual_seed(0)
        model = Sabotaged()
        suite = [Suspect(31), LRBackoff(trial=trial), Rollback(every_n_steps=10, trial=trial)]
        trainer = fit(model, suite, max_steps=80)
        finals.append(weights(model))
        lrs.append(_lr(trainer))
        assert [(h["step"], h["snapshot_step"]) for h in suite[-1].history] == ([(52, 30)] if trial else [(32, 30)])
    assert_bit_identical(finals[0], finals[1])
    assert lrs == [0.5 * 0.01, 0.5 * 0.01]


class SabotagedWithHooks(Sabotaged):
    """Sabotaged, with a module's own step hooks, as users write them: a warm-up written in ``optimizer_step``
    (Lightning's docs), a gradient edited in ``on_before_optimizer_step`` and its own clipping in
    ``configure_gradient_clipping``."""

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        for group in optimizer.param_groups:
            group["lr"] = self.lr * min(1.0, (self.trainer.global_step + 1) / 100)
        optimizer.step(closure=optimizer_closure)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.net[0].bias.grad.zero_()  # a bias the module keeps as it was

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
    ) -> None:
        self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")


class SabotagedSkippingSteps(Sabotaged):
    """Sabotaged, with an ``optimizer_step`` that runs the closure but makes no update on every fourth batch (as
    Lightning allows)."""

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        if batch_idx % 4 == 3:
            optimizer_closure()
            return
        optimizer.step(closure=optimizer_closure)


@pytest.mark.parametrize(
    ("model_class", "clipper", "fit_kwargs", "suspected", "rollbacks"),
    [(SabotagedWithHooks, [], {}, 31, ([(52, 30)], [(32, 30)])),
     (Sabotaged, [AutoClip(mode="fixed", max_norm=0.05, if_trainer_clips="defer")], {"gradient_clip_val": 1.0}, 31,
      ([(52, 30)], [(32, 30)])),
     (SabotagedSkippingSteps, [], {}, 32, ([(53, 30)], [(33, 30)]))],
    ids=["warm_up_gradient_edit_and_own_clipping", "a_clipper_that_defers_to_the_trainers", "steps_it_skips"],
)  # fmt: skip
def test_a_remedy_trains_through_the_modules_own_step_hooks_as_the_loop_does(
    model_class: type[Sabotaged], clipper: list[Any], fit_kwargs: dict[str, Any], suspected: int,
    rollbacks: tuple[list[tuple[int, int]], list[tuple[int, int]]],
) -> None:
    """The same as above, with the module's own hooks of a step: the remedy kept ends bit-identical to the run that
    rolled back and backed off at once. The remedies trained without those hooks (at the rate the trial captured,
    unclipped, the bias moving), were clipped by a clipper that leaves the loop to the Trainer's clipping, and a
    batch the module made no update on was scored as an inf/NaN loss: the trial compared a run the module would
    never have made with the run it made."""
    finals, biases = [], []
    for trial in (TrialConfig(remedies=1), None):
        torch.manual_seed(0)
        model = model_class()
        first_bias = model.net[0].bias.detach().clone()
        suite = [Suspect(suspected), *copy.deepcopy(clipper), LRBackoff(trial=trial),
                 Rollback(every_n_steps=10, trial=trial)]  # fmt: skip
        fit(model, suite, max_steps=80, **fit_kwargs)
        finals.append(weights(model))
        biases.append(torch.equal(model.net[0].bias, first_bias))
        assert [(h["step"], h["snapshot_step"]) for h in suite[-1].history] == rollbacks[0 if trial else 1]
    assert_bit_identical(finals[0], finals[1])
    assert biases == [model_class is SabotagedWithHooks] * 2


def test_a_kept_remedy_is_journaled_as_the_backoff_and_the_rollback_it_is(tmp_path: Path) -> None:
    model = Sabotaged()
    suite = [Suspect(31), LRBackoff(), Rollback(every_n_steps=10)]
    trainer = fit(model, suite, max_steps=80, default_root_dir=str(tmp_path))
    events = _journal(tmp_path)
    first, *ladder = [e for e in events if e["kind"] == "trial"]
    assert first["step"] == 52 and first["details"]["kept"] and first["details"]["false_alarm"] is False
    factor = first["details"]["kept_lr_factor"]
    assert factor in (0.5, 0.125)
    backoff = next(e for e in events if e["kind"] == "backoff")
    rollback = next(e for e in events if e["kind"] == "rollback")
    assert (backoff["step"], backoff["details"]["scale"], backoff["details"]["trial"]) == (52, factor, True)
    assert (rollback["step"], rollback["details"]["snapshot_step"]) == (52, 30)
    assert rollback["message"].startswith(
        "Rollback: a trial kept the remedy that started from the snapshot of step 30, at step 52, after "
        "loss_divergence at step 31"
    )
    # The next rung starts at once from the remedy kept: a lower rate against it, on the next batches.
    assert ladder and ladder[0]["details"]["rung"] == 2 and ladder[0]["details"]["opened_at"] == 52
    assert ladder[0]["details"]["snapshot_step"] is None
    kept = [e["details"]["kept_lr_factor"] for e in (first, *ladder) if e["details"]["kept"]]
    assert _lr(trainer) == pytest.approx(0.01 * math.prod(kept), rel=0, abs=1e-15)
    assert trainer.lightning_module is model and all(torch.isfinite(p).all() for p in model.parameters())


def test_the_frozen_mode_brings_the_incumbent_back_as_it_was_when_the_trial_opened(tmp_path: Path) -> None:
    """In ``"frozen"`` mode the loop trains the remedy and the incumbent is only scored: a false alarm brings the
    incumbent back exactly as it was at the trial's opening (it missed the trial's batches)."""
    torch.manual_seed(0)
    model, before, after = TinyRegressor(), WeightsAtBatchEnd(), WeightsAtBatchEnd()
    trial = TrialConfig(mode="frozen", steps=10)
    suite = [before, Suspect(30), LRBackoff(trial=trial), Rollback(every_n_steps=10, trial=trial), after]
    trainer = fit(model, suite, max_steps=60, default_root_dir=str(tmp_path))
    (event,) = _trials(tmp_path)
    assert (event["step"], event["details"]["kept"], event["details"]["lr_factors"]) == (41, False, [0.5])
    assert_bit_identical(after.at[41], before.at[31])  # as it was when the trial opened, before the suite acted
    assert _lr(trainer) == model.lr


def test_without_trials_a_suspicion_acts_at_once() -> None:
    model = TinyRegressor()
    suite = [Suspect(31), LRBackoff(trial=None), Rollback(every_n_steps=10, trial=None)]
    trainer = fit(model, suite, max_steps=40)
    assert [(h["step"], h["action"]) for h in suite[1].history] == [(31, "backoff")]
    assert [(h["step"], h["snapshot_step"]) for h in suite[2].history] == [(32, 30)]
    assert _lr(trainer) == 0.5 * model.lr


class ManualTiny(TinyRegressor):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return loss


def test_a_fit_whose_steps_cannot_be_repeated_acts_at_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Manual optimization steps inside ``training_step``: no second candidate can repeat it, so a suspicion is
    answered at once, as without trials, and the fit says so when it starts."""
    suite = [Suspect(21), LRBackoff(), Rollback(every_n_steps=10)]
    with caplog.at_level("INFO", logger="lightning_overflow"):
        trainer = fit(ManualTiny(), suite, max_steps=30, default_root_dir=str(tmp_path))
    assert (
        "lightning_overflow: no trials in this fit (manual optimization steps its optimizers inside training_step, "
        "which a candidate cannot re-run): a suspicion of divergence backs off and rolls back at once"
    ) in caplog.messages
    assert _trials(tmp_path) == []
    assert [(h["step"], h["snapshot_step"]) for h in suite[2].history] == [(22, 20)]
    assert _lr(trainer) == 0.5 * 0.01


def test_a_certain_fault_during_a_trial_hands_the_run_to_a_healthy_remedy(tmp_path: Path) -> None:
    """NaN weights at step 35, inside the trial opened at step 30: the remedies, which trained on the same batches
    from the snapshot of step 30, are finite: the better of them takes over at once, no further rollback needed."""
    model = TinyRegressor()
    suite = [NonFiniteDetector(), Suspect(30), LRBackoff(), Rollback(every_n_steps=10)]
    trainer = fit(model, [*suite, FaultInjector(Fault(35, "nan_weight"))], max_steps=60, default_root_dir=str(tmp_path))
    first = _trials(tmp_path)[0]
    assert first["step"] == 36 and first["details"]["kept"] and first["details"]["steps"] == 5
    assert "optimizer state (nonfinite_state) at step 35 ended the trial: the remedy at the learning rate x" in first["message"]
    assert first["message"].endswith("which trained on the same batches with finite losses, takes over.")
    assert [(h["step"], h["snapshot_step"]) for h in suite[-1].history] == [(36, 30)]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert _lr(trainer) < model.lr


def test_a_remedys_rise_is_its_loss_level_at_the_end_of_its_trial_over_that_at_the_start() -> None:
    trial = Trial(kind="loss_divergence", step=4, config=TrialConfig(steps=9), lr_factors=[0.5, 0.125])
    nan = math.nan
    for losses in [(9, 7, 7), (9, 8, 7), (9, 9, nan), (9, 20, 6), (9, 30, 5), (9, 40, 4), (9, 70, 3), (9, nan, 2),
                   (9, 90, 1)]:  # fmt: skip
        trial.add(*losses)
    assert trial.rise(0) == 80 / 8  # the medians of the finite losses: [70, 90] over [7, 8, 9]
    assert trial.rise(1) == 2 / 7  # [3, 2, 1] over [7, 7]
    short = Trial(kind="loss_divergence", step=4, config=TrialConfig(steps=9), lr_factors=[0.5])
    short.add(1.0, 1.0)
    short.add(1.0, 5.0)
    assert math.isnan(short.rise(0))  # no thirds in 2 losses


class _HighRate(pl.LightningModule):
    """A small tanh regression under SGD with momentum at about 30 times its stable rate: every lower rate up to
    x0.125 diverges too, only more slowly."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(256, 8, generator=gen)
        self.y = self.x @ torch.randn(8, 1, generator=gen) + 0.1 * torch.randn(256, 1, generator=gen)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1.5, momentum=0.9)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(self.x, self.y), batch_size=16)

    def mse(self) -> float:
        with torch.no_grad():
            return float(torch.nn.functional.mse_loss(self.net(self.x), self.y))


def test_a_remedy_that_diverged_too_is_followed_by_lower_rates_from_its_snapshot(tmp_path: Path) -> None:
    """The trial opened at step 4 keeps x0.125 from the fit's start, whose own loss rose over the trial: the next rung
    tries the lower rates from that snapshot again, not from the state the remedy damaged (the fit ended at an MSE of
    1.8e4 from there; its start is 7.1, gradient_clip_val=1.0 ends at 22.5)."""
    model = _HighRate()
    fit(model, default_callbacks(), max_steps=48, default_root_dir=str(tmp_path))
    first, second = _trials(tmp_path)[:2]
    assert (first["step"], first["details"]["kept_lr_factor"], first["details"]["snapshot_step"]) == (25, 0.125, 0)
    assert (second["details"]["rung"], second["details"]["snapshot_step"]) == (2, 0)
    assert ("(a follow-up: the trial before it kept a remedy whose loss rose over its trial) tried the snapshot of "
            "step 0 at the learning rate x0.5 and x0.125") in second["message"]  # fmt: skip
    assert model.mse() < 2.0


def test_a_restarted_follow_up_starts_from_the_kept_remedys_own_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The remedy the trial opened at step 31 kept started from the snapshot of step 30 and its loss rose (forced
    here): the follow-up starts from step 30 again, at lower rates. A rollback avoids the snapshot it last went to when
    nothing changed; that rule took the follow-up one snapshot further back, to step 20."""
    rise = Trial.rise
    monkeypatch.setattr(Trial, "rise", lambda trial, remedy: 3.0 if trial.rung == 1 else rise(trial, remedy))
    torch.manual_seed(0)
    fit(Sabotaged(), [Suspect(31), LRBackoff(), Rollback(every_n_steps=10)], max_steps=80,
        default_root_dir=str(tmp_path))  # fmt: skip
    first, second = _trials(tmp_path)[:2]
    assert (first["details"]["rung"], first["details"]["snapshot_step"], first["details"]["kept"]) == (1, 30, True)
    assert (second["details"]["rung"], second["details"]["snapshot_step"]) == (2, 30)


class _LiveRunOverflows(TinyRegressor):
    """A NaN loss at exact steps of the run's own training, never in a trial's candidate (whose state did not reach
    the overflow)."""

    def __init__(self, *steps: int) -> None:
        super().__init__()
        self.overflow_at = set(steps)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * math.nan if side_run() is None and self.trainer.global_step in self.overflow_at else loss


def test_a_run_that_was_inf_nan_where_a_remedy_was_finite_is_not_returned_when_the_fit_ends_mid_trial(
    tmp_path: Path,
) -> None:
    """A trial opened at step 30 (20 steps) is still under way when the fit ends at step 40; the live run's loss was
    NaN at steps 33 and 37 (skipped, so its state is the one that overflowed), the remedies' losses finite on those
    batches: the fit returns the remedy, not the state that overflowed."""
    model = _LiveRunOverflows(33, 37)
    suite = [NonFiniteDetector(diagnose=False), Suspect(30), LRBackoff(), Rollback(every_n_steps=10)]
    trainer = fit(model, suite, max_steps=40, default_root_dir=str(tmp_path))
    (trial,) = _trials(tmp_path)
    assert trial["step"] == 40 and trial["details"]["kept"] and trial["details"]["steps"] == 9
    assert "(the fit ended after 9 of 20 steps); but the run as it was had inf/NaN losses on 2 of its 9 trial " \
           "batches where the learning rate x" in trial["message"]
    assert trial["message"].endswith("had finite ones, and the fit ends here: that remedy takes over.")
    assert [(h["step"], h["snapshot_step"]) for h in suite[-1].history] == [(40, 30)]
    assert _lr(trainer) < model.lr


@pytest.mark.parametrize("ends", ["max_steps", "max_epochs"])
def test_the_checkpoints_of_the_last_step_hold_the_state_a_fit_that_ends_mid_trial_returns(
    tmp_path: Path, ends: str
) -> None:
    """As above, with checkpoints written at the fit's last step (every 5 steps and ``last.ckpt``; at each epoch's end):
    the verdict is taken at the last batch, before the checkpoint callbacks save it, so that they hold the remedy the
    fit returns, at its rate (they held the run that overflowed, at the full rate)."""
    model = _LiveRunOverflows(33, 37)
    suite = [NonFiniteDetector(diagnose=False), Suspect(30), LRBackoff(), Rollback(every_n_steps=10)]
    every = 5 if ends == "max_steps" else None
    saves = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=every)
    limit = {"max_steps": 40} if ends == "max_steps" else {"max_steps": -1, "max_epochs": 40 // BATCHES_PER_EPOCH}
    trainer = fit(model, [*suite, saves], **limit, enable_checkpointing=True, default_root_dir=str(tmp_path))
    assert trainer.global_step == 40 and _trials(tmp_path)[0]["details"]["kept"]
    assert [(h["step"], h["snapshot_step"]) for h in suite[-1].history] == [(40, 30)]
    for name in ("last.ckpt", "epoch=4-step=40.ckpt"):
        saved = torch.load(tmp_path / "ckpt" / name, weights_only=False)
        assert saved["global_step"] == 40
        assert_bit_identical(saved["state_dict"], weights(model))
        assert saved["optimizer_states"][0]["param_groups"][0]["lr"] == _lr(trainer) < model.lr


def test_a_fit_that_ends_mid_trial_with_finite_losses_keeps_the_run_as_it_was(tmp_path: Path) -> None:
    model = TinyRegressor()
    suite = [NonFiniteDetector(), Suspect(30), LRBackoff(), Rollback(every_n_steps=10)]
    trainer = fit(model, suite, max_steps=40, default_root_dir=str(tmp_path))
    (trial,) = _trials(tmp_path)
    assert trial["step"] == 40 and not trial["details"]["kept"] and "takes over" not in trial["message"]
    assert suite[-1].history == [] and _lr(trainer) == model.lr


class Hinge(pl.LightningModule):
    """A linear classifier under a hinge loss: separable batches give a loss of exactly 0 (no gradient), then from
    step 40 on harder, overlapping ones give about 0.1. A healthy run whose loss rises from 0."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(2, 1)
        gen = torch.Generator().manual_seed(1)
        y = torch.randint(0, 2, (64,), generator=gen).float() * 2 - 1
        self.easy = (torch.randn(64, 2, generator=gen) * 0.1 + y[:, None] * 3.0, y)
        self.hard = (torch.randn(64, 2, generator=gen) * 0.6 + y[:, None] * 0.7, y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = self.hard if self.trainer.global_step >= 40 else self.easy
        rows = slice(8 * (batch_idx % 8), 8 * (batch_idx % 8) + 8)
        return torch.relu(1.0 - y[rows] * self.linear(x[rows]).squeeze(1)).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.arange(64), batch_size=8)


def test_a_hinge_loss_rising_from_zero_is_left_alone_by_every_composition(tmp_path: Path) -> None:
    """Issue: ``[LossSpikeDetector(), LRBackoff(), Rollback()]`` backed off and rolled back on this healthy run.
    Whatever the suspicions, their trials revert: the run is bit-identical to the bare one."""
    bare = Hinge()
    fit(bare, [], max_steps=120)
    for index, suite in enumerate(([LossSpikeDetector(), LRBackoff(), Rollback()],
                                   [LossSpikeDetector(warmup=5), LRBackoff(), Rollback(every_n_steps=10)])):  # fmt: skip
        model = Hinge()
        fit(model, suite, max_steps=120, default_root_dir=str(tmp_path / str(index)))
        assert_bit_identical(weights(model), weights(bare))
        assert all(not e["details"]["kept"] for e in _trials(tmp_path / str(index)))


def _checkpoint_at_step_40(tmp_path: Path, suite: list[Any]) -> Path:
    """The checkpoint a ``Sabotaged`` fit with ``suite`` saves at step 40 (one every epoch). The fit goes on past it:
    at its last step a trial under way is judged before the checkpoint is written."""
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=BATCHES_PER_EPOCH,
                                               save_top_k=-1)  # fmt: skip
    torch.manual_seed(0)
    fit(Sabotaged(), [*suite, checkpoints], max_steps=41, default_root_dir=str(tmp_path / "first"),
        enable_checkpointing=True)  # fmt: skip
    (path,) = [p for p in (tmp_path / "ckpt").glob("*.ckpt") if "step=40" in p.name]
    return path


def test_a_checkpoint_saved_during_a_trial_resumes_it_exactly(tmp_path: Path) -> None:
    """A checkpoint at step 40, inside the trial opened at the end of step 35's batch (10 steps), holds the run as it
    is and the trial: the remedies' state and their scores so far. Resumed, the run reaches the same verdict at step
    46 and ends bit-identical to the uninterrupted one."""
    trial = TrialConfig(steps=10)

    def suite() -> list[Any]:
        return [Suspect(35), LRBackoff(trial=trial), Rollback(every_n_steps=10, trial=trial)]

    torch.manual_seed(0)
    whole = Sabotaged()
    fit(whole, suite(), max_steps=64, default_root_dir=str(tmp_path / "whole"))
    path = _checkpoint_at_step_40(tmp_path, suite())
    saved = torch.load(path, weights_only=True)
    state = next(v for k, v in saved["callbacks"].items() if k.startswith("Rollback"))
    assert state["trial"]["trial"]["step"] == 35 and len(state["trial"]["sides"]) == 2
    resumed = Sabotaged()
    make_trainer(suite(), max_steps=64, default_root_dir=str(tmp_path / "resumed")).fit(resumed, ckpt_path=str(path))
    assert_bit_identical(weights(resumed), weights(whole))
    whole_trials = [(e["step"], e["details"]["kept_lr_factor"]) for e in _trials(tmp_path / "whole")]
    resumed_trials = [(e["step"], e["details"]["kept_lr_factor"]) for e in _trials(tmp_path / "resumed")]
    assert resumed_trials == [t for t in whole_trials if t[0] > 40] and whole_trials[0][0] == 46


@pytest.mark.parametrize(("saved_mode", "resumed_with"), [("ab", None), ("ab", "frozen"), ("frozen", "ab")])
def test_a_trial_saved_in_a_checkpoint_is_withdrawn_where_the_resumed_fit_runs_none_or_another_mode(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, saved_mode: str, resumed_with: str | None
) -> None:
    """Resumed with trials off, the trial of the checkpoint went on training its candidates to the fit's end, then
    ``AssertionError``; resumed in the other mode, whose live and side states are the other way round, a kept run
    came back as the remedy's weights and rate, unsaid. The trial is withdrawn now, as said, and the run as it was
    goes on: with trials off, bit-identical to the same checkpoint resumed without the suite."""
    import logging

    saved = TrialConfig(steps=10, mode=saved_mode)  # type: ignore[arg-type]
    path = _checkpoint_at_step_40(tmp_path, [Suspect(35), LRBackoff(trial=saved), Rollback(every_n_steps=10,
                                                                                         trial=saved)])
    resumed_trial = None if resumed_with is None else TrialConfig(steps=10, mode=resumed_with)  # type: ignore[arg-type]
    resumed = Sabotaged()
    suite = [LRBackoff(trial=resumed_trial), Rollback(every_n_steps=10, trial=resumed_trial)]
    started: dict[str, torch.Tensor] = {}

    class Started(pl.Callback):  # after the suite's on_train_start
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            started.update(weights(pl_module))

    with caplog.at_level(logging.INFO, logger="lightning_overflow"):
        make_trainer([*suite, Started()], max_steps=64, default_root_dir=str(tmp_path / "resumed")).fit(
            resumed, ckpt_path=str(path))
    checkpoint = torch.load(path, weights_only=True)
    trial_state = next(v for k, v in checkpoint["callbacks"].items() if k.startswith("Rollback"))["trial"]
    # The run as it was: the live weights of an "ab" checkpoint, the incumbent held on the side of a frozen one.
    held = checkpoint["state_dict"] if saved_mode == "ab" else trial_state["sides"][0]["params"]
    assert_bit_identical(started, {name: held[name] for name in started})
    now = "runs no trials" if resumed_with is None else f"runs them in '{resumed_with}' mode"
    assert (f"lightning_overflow: the trial the checkpoint was saved in (opened at step 35, '{saved_mode}' mode) is "
            f"withdrawn: this fit {now}, so the run goes on as it was before it opened") in caplog.messages
    assert resumed.trainer.global_step == 64 and all(bool(torch.isfinite(w).all()) for w in weights(resumed).values())
    if saved_mode == "ab":  # its live state is the run as it was: nothing else happens from there
        bare = Sabotaged()
        make_trainer([], max_steps=64, default_root_dir=str(tmp_path / "bare")).fit(bare, ckpt_path=str(path))
        assert_bit_identical(weights(resumed), weights(bare))


def test_the_first_trial_of_a_run_that_does_not_learn_runs_twice_as_long_and_resumes_with_its_length(
    tmp_path: Path,
) -> None:
    """A suspicion that the run does not learn (step 35) opens a trial of twice the configured 10 steps: its remedy
    starts from further back and needs longer to show where it goes. Saved at step 40 and resumed, the trial keeps its
    length (its verdict at step 56 either way); the follow-up of a kept remedy runs the configured 10 steps."""
    trial = TrialConfig(steps=10)

    def suite() -> list[Any]:
        return [Suspect(35, kind="no_progress"), LRBackoff(trial=trial), Rollback(every_n_steps=10, trial=trial)]

    torch.manual_seed(0)
    whole = Sabotaged()
    fit(whole, suite(), max_steps=80, default_root_dir=str(tmp_path / "whole"))
    facts = [(e["step"], e["details"]["opened_at"], e["details"]["steps"], e["details"]["kept"])
             for e in _trials(tmp_path / "whole")]  # fmt: skip
    assert facts[:2] == [(56, 35, 20, True), (66, 56, 10, False)]
    path = _checkpoint_at_step_40(tmp_path, suite())
    resumed = Sabotaged()
    make_trainer(suite(), max_steps=80, default_root_dir=str(tmp_path / "resumed")).fit(resumed, ckpt_path=str(path))
    assert_bit_identical(weights(resumed), weights(whole))
    assert [(e["step"], e["details"]["steps"]) for e in _trials(tmp_path / "resumed")][:2] == [(56, 20), (66, 10)]

def test_a_run_that_stalls_again_after_a_restart_is_tried_from_where_it_stands(tmp_path: Path) -> None:
    """Both suspicions that the run does not learn date its last progress to step 30. The first (step 35) restarts
    from the snapshot of step 30 at a lower rate (kept at step 56; its follow-up ties at 66). The second (step 70)
    would go back to that snapshot or past it (a rollback would go to step 20): the run restarted from there and
    learned at the lower rate since, so its remedies are the lower rates from the current state, and no second
    rollback is made. A divergence dated the same would go back (``RESTART_ONCE`` names only the stall)."""
    trial = TrialConfig(steps=10, max_share=1.0)
    torch.manual_seed(0)
    suspect = Suspect(35, 70, kind="no_progress", onset=30)
    suite = [suspect, LRBackoff(trial=trial), Rollback(every_n_steps=10, trial=trial)]
    fit(Sabotaged(), suite, max_steps=100, default_root_dir=str(tmp_path))
    facts = [(e["step"], e["details"]["opened_at"], e["details"]["snapshot_step"], e["details"]["kept"])
             for e in _trials(tmp_path)]  # fmt: skip
    assert facts == [(56, 35, 30, True), (66, 56, None, False), (91, 70, None, False)]
    assert "(no_progress at step 70) tried the current state at the learning rate x0.5 and x0.125" in (
        _trials(tmp_path)[-1]["message"]
    )
    assert [(h["step"], h["snapshot_step"]) for h in suite[-1].history] == [(56, 30)]


@pytest.mark.ddp
@pytest.mark.timeout(180)
def test_under_ddp_both_ranks_run_the_same_trial_and_reach_the_same_verdict(tmp_path: Path) -> None:
    from ddp_utils import run_ddp

    reports = run_ddp(Sabotaged(), [Suspect(31), LRBackoff(), Rollback(every_n_steps=10)], tmp_path, max_steps=60)
    assert [r["error"] for r in reports] == [None, None]
    assert reports[0]["digest"] == reports[1]["digest"] and reports[0]["states"] == reports[1]["states"]
    assert reports[0]["lrs"] == reports[1]["lrs"] and reports[0]["lrs"][-1] < 0.01
    (first, *_) = _trials(tmp_path)
    assert (first["step"], first["details"]["kept"]) == (52, True)


class Seen:
    """An object of the user's own class: shared by the run and its side runs (the suite does not copy it)."""

    def __init__(self) -> None:
        self.losses: list[tuple[str | None, float]] = []
        self.closures: list[tuple[str | None, float, bool]] = []


class ClosureValues(Sabotaged):
    """Sabotaged; records each ``training_step`` loss, and what the closure its ``optimizer_step`` runs returns."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = Seen()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.seen.losses.append((side_run(), float(loss)))
        return loss

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        value = optimizer_closure()
        self.seen.closures.append((side_run(), float(value), value.requires_grad))
        optimizer.step()


def test_a_candidates_closure_returns_its_loss_as_lightnings_does() -> None:
    """Under accumulation (two batches a step) Lightning's closure returns the stepping batch's loss divided by two,
    detached; a candidate's returned it whole, with its graph."""
    model, trial = ClosureValues(), TrialConfig(remedies=1)
    fit(model, [Suspect(31), LRBackoff(trial=trial), Rollback(every_n_steps=10, trial=trial)], max_steps=60,
        accumulate_grad_batches=2)  # fmt: skip
    for kind in (None, "trial"):
        losses = [loss for side, loss in model.seen.losses if side == kind]
        closures = [(value, grad) for side, value, grad in model.seen.closures if side == kind]
        assert closures and closures == [(loss / 2, False) for loss in losses[1::2]]


class RankNaN(Sabotaged):
    """Sabotaged; at step 35 the loss of a trial's candidate is NaN on rank 1 alone (its share of the batch)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if side_run() == "trial" and self.trainer.global_rank == 1 and self.trainer.global_step == 35:
            loss = loss * float("nan")
        return loss


class RankNaNSkippedByTheModule(RankNaN):
    """RankNaN, whose ``optimizer_step`` makes no update on an inf/NaN loss (a common guard of a module's own)."""

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        loss = optimizer_closure()
        if loss is not None and torch.isfinite(loss):
            optimizer.step()


@pytest.mark.ddp
@pytest.mark.timeout(180)
@pytest.mark.parametrize("model_class", [RankNaN, RankNaNSkippedByTheModule], ids=["suite_skips", "module_skips"])
def test_under_ddp_a_candidates_loss_nonfinite_on_one_rank_is_skipped_on_every_rank(
    tmp_path: Path, model_class: type[RankNaN]
) -> None:
    """Rank 1's candidate made no backward pass at step 35, so it all-reduced fewer gradients than rank 0's (or
    none, where its module's ``optimizer_step`` made no update): the collectives no longer matched (gloo aborted the
    fit; NCCL would hang). Every rank now makes the same collectives, and skips that candidate's step alike, its
    schedule held on every rank (it went on where the module made no update, and the kept remedy's rates differed)."""
    from ddp_utils import run_ddp

    model = model_class(scheduler=lambda optimizer: torch.optim.lr_scheduler.ExponentialLR(optimizer, 0.97))
    reports = run_ddp(model, [Suspect(31), LRBackoff(), Rollback(every_n_steps=10)], tmp_path, max_steps=60)
    assert [r["error"] for r in reports] == [None, None] and reports[0]["lrs"] == reports[1]["lrs"]
    assert reports[0]["digest"] == reports[1]["digest"] and reports[0]["states"] == reports[1]["states"]
    (first, *_) = _trials(tmp_path)
    assert first["step"] == 52 and math.isnan(float(first["details"]["remedy_losses"][0][35 - 32]))


def test_a_backed_off_rate_that_held_is_grown_back_only_when_a_trial_finds_the_higher_one_better(tmp_path: Path) -> None:
    """After the remedy kept at step 52 (half the rate), 30 steps without a suspicion make the regrowth due: a trial
    of twice the rate against the rate that held opens at step 82. The higher rate does no better: the rate stays,
    and the next regrowth waits twice as long (``window_growth``)."""
    torch.manual_seed(0)
    suite = [Suspect(31), LRBackoff(regrow_after=30), Rollback(every_n_steps=10)]
    trainer = fit(Sabotaged(), suite, max_steps=150, default_root_dir=str(tmp_path))
    regrowth = [e["details"] for e in _trials(tmp_path) if e["details"]["signal"] == "regrowth"]
    assert [(d["opened_at"], d["lr_factors"], d["kept"], d["false_alarm"]) for d in regrowth] == [
        (82, [2.0], False, False)
    ]
    assert [h["action"] for h in suite[1].history] == ["backoff"]
    assert suite[1].state_dict()["windows"] == [60]
    assert _lr(trainer) == 0.5 * 0.01


def test_scheduled_trials_that_find_no_better_rate_wait_twice_as_long_each_time(tmp_path: Path) -> None:
    """Every 10 steps, a scheduled trial of 4 steps; a healthy run ties each. The first opens at step 10 and ends at
    14; the next may open 10 x 2 steps after that (34), the one after 10 x 4 steps after its end (78). The run ends
    bit-identical to the run without the suite."""
    torch.manual_seed(0)
    bare = TinyRegressor(dropout=0.2)
    fit(bare, [], max_steps=100)
    torch.manual_seed(0)
    model = TinyRegressor(dropout=0.2)
    config = TrialConfig(steps=4, every_n_steps=10)
    suite = [LRBackoff(trial=config), Rollback(every_n_steps=10, trial=config)]
    fit(model, suite, max_steps=100, default_root_dir=str(tmp_path))
    trials = [e["details"] for e in _trials(tmp_path)]
    assert [(d["signal"], d["opened_at"], d["kept"]) for d in trials] == [
        ("scheduled", 10, False), ("scheduled", 34, False), ("scheduled", 78, False)
    ]
    assert_bit_identical(weights(model), weights(bare))


def test_a_trial_a_certain_fault_ended_before_its_verdict_is_no_false_alarm() -> None:
    """The fault is answered at once (a rollback): the suspicion is not refuted, and its detector is not made less
    eager for it."""
    from lightning_overflow.trials import Remedy, TrialOutcome

    trial = Trial(kind="loss_divergence", step=30, config=TrialConfig())
    ended = TrialOutcome(trial, kept=False, remedy=Remedy(), step=35, verdict=None, why="nonfinite_state ended it")
    judged = TrialOutcome(trial, kept=False, remedy=Remedy(), step=50, verdict=trial.verdict(), why="no better")
    assert (ended.false_alarm, judged.false_alarm) == (False, True)


def test_a_second_fit_of_the_same_trainer_tries_its_suspicions_too(tmp_path: Path) -> None:
    torch.manual_seed(0)
    suite = [Suspect(30, 110), LRBackoff(), Rollback(every_n_steps=10)]
    trainer = make_trainer(suite, max_steps=80, default_root_dir=str(tmp_path))
    model = TinyRegressor(dropout=0.2)
    trainer.fit(model)
    trainer.fit_loop.epoch_loop.max_steps = 160
    trainer.fit(model)
    assert [(e["details"]["opened_at"], e["step"]) for e in _trials(tmp_path)] == [(30, 51), (110, 131)]


def test_without_trials_a_suspicion_that_persists_is_answered_then_paced() -> None:
    """A new task keeps the loss at a new level: suspected at every step from 31. Without a verdict the suspicion is
    answered at once, then waits ``steps x 2^n`` (40, then 80 steps) as a false alarm would: two backoffs in 120
    steps, not one every few steps down to the floor."""
    suite = [Suspect(*range(31, 121)), LRBackoff(trial=None), Rollback(every_n_steps=10, trial=None)]
    trainer = fit(TinyRegressor(), suite, max_steps=120)
    assert [(h["step"], h["action"]) for h in suite[1].history] == [(31, "backoff"), (71, "backoff")]
    assert [h["step"] for h in suite[2].history] == [32, 72]
    assert _lr(trainer) == 0.25 * 0.01


def test_a_suspicion_at_the_floor_is_left_alone_and_never_stops_the_run() -> None:
    """Only what is certain may stop a run: at its floor, LRBackoff answers a suspicion with nothing."""
    suite = [Suspect(31, 100), LRBackoff(min_scale=0.5, trial=None), Rollback(every_n_steps=10, trial=None)]
    trainer = fit(TinyRegressor(), suite, max_steps=110)
    assert [(h["step"], h["action"]) for h in suite[1].history] == [(31, "backoff")]
    assert trainer.global_step == 110 and _lr(trainer) == 0.5 * 0.01


def test_a_follow_up_opened_on_the_last_batch_is_withdrawn_unjournaled(tmp_path: Path) -> None:
    """The trial opened at step 31 keeps its remedy on the fit's last batch (step 52): the follow-up it opens there
    would have no step to be judged on, so it is neither run nor journaled."""
    torch.manual_seed(0)
    suite = [Suspect(31), LRBackoff(), Rollback(every_n_steps=10)]
    fit(Sabotaged(), suite, max_steps=52, default_root_dir=str(tmp_path))
    assert [(e["step"], e["details"]["rung"], e["details"]["steps"]) for e in _trials(tmp_path)] == [(52, 1, 20)]


class PlateauRegressor(TinyRegressor):
    """SGD under a ``ReduceLROnPlateau`` that halves the rate at every epoch's end (it watches ``val_loss`` for a rise
    with no patience, and the loss falls), recording in ``rates`` the rate of every step it takes, the candidates' too
    (outside the module: what a candidate's step writes into the module's attributes stays the candidate's)."""

    def __init__(self, rates: list[tuple[str | None, int, float]], interval: str = "epoch") -> None:
        super().__init__(optimizer="sgd")
        self.interval = interval
        self.record = lambda rate: rates.append((side_run(), self.trainer.global_step, rate))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        optimizer.register_step_pre_hook(lambda opt, *_: self.record(opt.param_groups[0]["lr"]))
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=0)
        every = 1 if self.interval == "epoch" else BATCHES_PER_EPOCH  # after each epoch's validation either way
        schedule = {"scheduler": plateau, "interval": self.interval, "frequency": every, "monitor": "val_loss"}
        return {"optimizer": optimizer, "lr_scheduler": schedule}


@pytest.mark.parametrize("interval", ["epoch", "step"])
def test_a_trials_candidates_step_a_plateau_schedule_on_the_runs_metric(tmp_path: Path, interval: str) -> None:
    """Lightning steps a ``ReduceLROnPlateau`` on the monitored metric after a batch or as an epoch ends, outside the
    batch's hooks. The trial opened at step 30 spans the cuts at steps 32, 40 and 48: its candidates never stepped
    theirs, so each ran at its snapshot's rate all along (8x the run's by the end) and a remedy kept came back at
    that rate, said to be half its schedule. Now each steps its own on the run's values: at every step of the trial
    a candidate's rate is the run's times its factor."""
    rates: list[tuple[str | None, int, float]] = []
    fit(PlateauRegressor(rates, interval), [Suspect(30), LRBackoff(), Rollback(every_n_steps=10)], max_epochs=7,
        max_steps=-1, limit_val_batches=1.0, default_root_dir=tmp_path)  # fmt: skip
    run = {step: rate for kind, step, rate in rates if kind is None}
    trial = [(step, rate) for kind, step, rate in rates if kind == "trial" and step <= 50]  # the first trial's
    assert [step for step, _ in trial] == [step for step in range(31, 51) for _ in range(2)]
    assert [rate for _, rate in trial] == [run[step] * factor for step in range(31, 51) for factor in (0.5, 0.125)]
    assert len({run[step] for step in range(31, 51)}) == 4  # the cuts at 32, 40 and 48 happened in the trial


class TrainingMetricPlateau(PlateauRegressor):
    """A ``ReduceLROnPlateau`` of ``interval="step"`` on a training metric logged ``on_step`` and ``on_epoch`` that
    improves every step (no cut), while its epoch means are each worse than the best step."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.log("m", -float(self.trainer.global_step), on_step=True, on_epoch=True)
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        optimizer = super().configure_optimizers()["optimizer"]
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.5, patience=0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": plateau, "interval": "step", "monitor": "m"}}


def test_a_trials_candidates_step_a_plateau_on_the_training_metric_the_step_saw(tmp_path: Path) -> None:
    """Lightning steps the plateau on the last batch's value, then the epoch's end puts the epoch's mean in its place
    in ``callback_metrics``: read at the next batch, the candidates stepped on means the run never saw and cut their
    rates at 32, 40 and 48 where the run cut none."""
    rates: list[tuple[str | None, int, float]] = []
    fit(TrainingMetricPlateau(rates, "step"), [Suspect(30), LRBackoff(), Rollback(every_n_steps=10)], max_epochs=7,
        max_steps=-1, default_root_dir=tmp_path)  # fmt: skip
    run = {step: rate for kind, step, rate in rates if kind is None}
    trial = [(step, rate) for kind, step, rate in rates if kind == "trial" and step <= 50]
    assert [step for step, _ in trial] == [step for step in range(31, 51) for _ in range(2)]
    assert {run[step] for step in range(31, 51)} == {0.01}
    assert [rate for _, rate in trial] == [0.01 * factor for _ in range(31, 51) for factor in (0.5, 0.125)]
