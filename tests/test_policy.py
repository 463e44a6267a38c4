"""The policy of default_callbacks(), row by row: data faults cost nothing but the skip or the clip; certain faults of
the state back off and roll back at once; suspicions open trials. Faults at exact steps; the journal says what fired.
The trial mechanism itself is tested in test_trials.py."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import assert_bit_identical, fit, tuned, weights
from torch.utils.data import DataLoader, TensorDataset

from lightning_overflow import AutoClip, LossSpikeDetector, default_callbacks, read_journal
from lightning_overflow.policy import (
    CERTAIN_SIGNALS,
    DEFAULT_BACKOFF_TRIGGERS,
    DEFAULT_ROLLBACK_TRIGGERS,
    DIVERGENCE_SIGNALS,
    SUSPICION_SIGNALS,
    Verdict,
    decide_step,
)
from lightning_overflow.snapshot_store import snapshot_name
from lightning_overflow.testing import Fault, FaultInjector, TinyRegressor

BATCHES_PER_EPOCH = 8  # TinyRegressor: 64 samples, batch size 8, no shuffling


def _journal(root: Path) -> list[dict[str, Any]]:
    path = root / "overflow_events.jsonl"
    return list(read_journal(path)) if path.exists() else []  # no file: nothing happened


def _kinds(events: list[dict[str, Any]], *kinds: str) -> list[tuple[int, str]]:
    return [(e["step"], e["kind"]) for e in events if e["kind"] in kinds]


def test_a_corrupt_sample_in_every_short_epoch_is_only_skipped(tmp_path: Path) -> None:
    model = TinyRegressor()
    model.data.tensors[0][19, 2] = float("nan")  # sample 19: batch 2 of every 8-batch epoch
    suite = default_callbacks(snapshot_every_n_steps=4)
    trainer = fit(model, suite, max_steps=10 * BATCHES_PER_EPOCH, default_root_dir=str(tmp_path))
    events = _journal(tmp_path)
    corrupt_steps = [2 + BATCHES_PER_EPOCH * epoch for epoch in range(10)]
    assert [step for step, _ in _kinds(events, "skip")] == corrupt_steps
    assert _kinds(events, "backoff", "rollback", "abort") == []
    assert all(e["details"]["data_fault"] for e in events if e["kind"] == "nonfinite")
    assert trainer.optimizers[0].param_groups[0]["lr"] == model.lr
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_periodic_input_spikes_are_journaled_and_cost_nothing_else(tmp_path: Path) -> None:
    model = TinyRegressor()
    model.data.tensors[0][40:48] *= 100.0  # batch 5 of every epoch: inputs and targets far beyond the rest
    model.data.tensors[1][40:48] *= 100.0
    trainer = fit(model, default_callbacks(snapshot_every_n_steps=4), max_steps=25 * BATCHES_PER_EPOCH,
                  default_root_dir=str(tmp_path))
    events = _journal(tmp_path)
    clipped = [step for step, _ in _kinds(events, "clip")]  # journaled at most once every AutoClip.EVENT_GAP steps
    assert clipped and all(step % BATCHES_PER_EPOCH == 5 for step in clipped), "the clip cut the spikes, only them"
    assert _kinds(events, "backoff", "rollback", "abort", "loss_divergence") == []
    assert trainer.optimizers[0].param_groups[0]["lr"] == model.lr


def test_a_loss_that_stays_above_its_reference_opens_a_trial_from_before_the_streak(tmp_path: Path) -> None:
    suite = default_callbacks(snapshot_every_n_steps=4)
    suite[2] = LossSpikeDetector(warmup=10)
    faults = FaultInjector(*(Fault(step, "loss_spike", factor=1e3) for step in (30, 31, 32)))
    fit(TinyRegressor(), [*suite, faults], max_steps=60, default_root_dir=str(tmp_path))
    events = _journal(tmp_path)
    assert _kinds(events, "loss_divergence") == [(32, "loss_divergence")]
    (finding,) = [e for e in events if e["kind"] == "loss_divergence"]
    assert finding["details"]["since"] == 30  # the first of the streak's losses: the state before it is sound
    trial = next(e for e in events if e["kind"] == "trial")
    assert (trial["step"], trial["details"]["opened_at"], trial["details"]["snapshot_step"]) == (53, 32, 28)
    assert [(e["step"], e["kind"]) for e in events if e["kind"] in ("backoff", "rollback")][:2] in (
        [], [(53, "backoff"), (53, "rollback")]
    )  # whatever the verdict, nothing acts before it


def test_a_run_that_diverges_inside_the_warm_up_is_caught_by_the_anchor(tmp_path: Path) -> None:
    detector = LossSpikeDetector(warmup=50)  # statistics are silent for 50 steps
    faults = FaultInjector(*(Fault(step, "loss_spike", factor=1e4) for step in (12, 13, 14)))
    fit(TinyRegressor(), [detector, faults], max_steps=20, default_root_dir=str(tmp_path))
    events = _journal(tmp_path)
    assert _kinds(events, "spike") == []
    ((step, _),) = _kinds(events, "loss_divergence")
    assert step == 14
    (event,) = [e for e in events if e["kind"] == "loss_divergence"]
    assert "x its starting level" in event["message"]


def test_a_loss_that_sat_at_zero_and_rises_a_little_is_no_spike(tmp_path: Path) -> None:
    detector = LossSpikeDetector(warmup=10)
    zero = [Fault(step, "loss_spike", factor=0.0) for step in range(10, 60)]  # exactly 0: zero mean, zero spread
    little = [Fault(step, "loss_spike", factor=0.05) for step in range(60, 70)]
    fit(TinyRegressor(), [detector, FaultInjector(*zero, *little)], max_steps=70, default_root_dir=str(tmp_path))
    assert _kinds(_journal(tmp_path), "spike", "loss_divergence") == []


def test_default_triggers_are_the_evidence_of_divergence() -> None:
    assert set(DEFAULT_ROLLBACK_TRIGGERS) == {*DEFAULT_BACKOFF_TRIGGERS, "replica_mismatch"}
    assert not {"nonfinite", "nonfinite_burst", "loss_spike", "grad_spike"} & set(DEFAULT_BACKOFF_TRIGGERS)
    # Every divergence signal is either certain (acted on at once) or a suspicion (tried), never both.
    assert set(DIVERGENCE_SIGNALS) <= {*CERTAIN_SIGNALS, *SUSPICION_SIGNALS}
    assert not set(CERTAIN_SIGNALS) & set(SUSPICION_SIGNALS)


def test_a_skip_request_wins_over_every_clip() -> None:
    from lightning_overflow.policy import ClipPlan

    clip = ClipPlan([], 0.5, 1.0)
    action = decide_step([("clipper", Verdict(clip=clip)), ("detector", Verdict(skip="non-finite loss")),
                          ("rollback", Verdict(skip="after a rollback"))])
    assert action.skipped and action.skipped_by == "detector" and action.clips == []
    action = decide_step([("clipper", Verdict(clip=clip)), ("detector", None)])
    assert not action.skipped and action.clip_of("clipper") is clip


def test_a_rollback_returns_to_the_newest_snapshot_when_the_lr_was_backed_off_since() -> None:
    from lightning_overflow import LRBackoff, NonFiniteDetector, Rollback

    rollback = Rollback(every_n_steps=2, keep=2)
    faults = FaultInjector(Fault(5, "nan_weight"), Fault(6, "nan_weight"))
    trainer = fit(TinyRegressor(), [NonFiniteDetector(), LRBackoff(cooldown=0), rollback, faults], max_steps=10)
    assert [(h["step"], h["snapshot_step"]) for h in rollback.history] == [(6, 4), (7, 4)]
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.25 * 0.01


def test_without_new_settings_a_second_divergence_goes_further_back() -> None:
    from lightning_overflow import NonFiniteDetector, Rollback

    rollback = Rollback(every_n_steps=2, keep=2)
    faults = FaultInjector(Fault(5, "nan_weight"), Fault(6, "nan_weight"))
    fit(TinyRegressor(), [NonFiniteDetector(), rollback, faults], max_steps=10)
    assert [(h["step"], h["snapshot_step"]) for h in rollback.history] == [(6, 4), (7, 2)]


def test_retries_that_back_off_further_spend_no_rollback_budget(tmp_path: Path) -> None:
    suite = default_callbacks(snapshot_every_n_steps=2)  # max_rollbacks=3
    faults = FaultInjector(*(Fault(step, "nan_weight") for step in range(5, 10)))  # five divergences in a row
    trainer = fit(TinyRegressor(), [*suite, faults], max_steps=14, default_root_dir=str(tmp_path))
    events = _journal(tmp_path)
    assert [step for step, _ in _kinds(events, "backoff")] == [5, 6, 7, 8, 9]  # the restore ends each cooldown
    rollbacks = [e for e in events if e["kind"] == "rollback"]
    # The newest snapshot, then once more at the lower LR; diverging from it again, it holds the fault: further back.
    assert [(e["step"], e["details"]["snapshot_step"]) for e in rollbacks] == [(6, 4), (7, 4), (8, 2), (9, 2), (10, 2)]
    # Only the first spends the budget: each later one retries at a lower LR, which is progress.
    assert [e["details"]["counted"] for e in rollbacks] == [True, False, False, False, False]
    assert [e["details"]["budget_left"] for e in rollbacks] == [2, 2, 2, 2, 2]
    assert _kinds(events, "abort") == []
    # Each backoff applies the factor once.
    backoffs = [e["details"] for e in events if e["kind"] == "backoff"]
    assert [b["scale"] for b in backoffs] == [0.5**k for k in range(1, 6)]
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.01 * 0.5**5
    assert all(torch.isfinite(p).all() for p in trainer.lightning_module.parameters())


def test_the_rollbacks_that_spent_no_budget_are_kept_across_a_resume(tmp_path: Path) -> None:
    from lightning_overflow import Rollback

    suite = default_callbacks(snapshot_every_n_steps=2)
    faults = FaultInjector(*(Fault(step, "nan_weight") for step in range(5, 10)))
    fit(TinyRegressor(), [*suite, faults], max_steps=14, default_root_dir=str(tmp_path))
    rollback = suite[-1]
    torch.save(rollback.state_dict(), tmp_path / "rollback.pt")
    state = torch.load(tmp_path / "rollback.pt", weights_only=True)
    assert state["free"] == [1, 2, 3, 4]  # history entries 1-4 were retries at a lower LR
    resumed = Rollback(every_n_steps=2)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == rollback.state_dict()


def test_retries_with_nothing_changed_spend_the_budget_and_stop(tmp_path: Path) -> None:
    from lightning_overflow import NonFiniteDetector, Rollback
    from lightning_overflow.exceptions import DivergenceError

    rollback = Rollback(every_n_steps=2, max_rollbacks=3)
    faults = FaultInjector(*(Fault(step, "nan_weight") for step in range(5, 10)))
    try:
        fit(TinyRegressor(), [NonFiniteDetector(), rollback, faults], max_steps=14, default_root_dir=str(tmp_path))
    except DivergenceError as error:
        assert error.step == 9  # the fourth divergence, at step 8, seen at the end of its batch
    else:
        raise AssertionError("the fourth retry with nothing changed must stop the run")
    rollbacks = [e for e in _journal(tmp_path) if e["kind"] == "rollback"]
    assert [(e["step"], e["details"]["counted"]) for e in rollbacks] == [(6, True), (7, True), (8, True)]
    assert [e["details"]["budget_left"] for e in rollbacks] == [2, 1, 0]


def test_a_nan_weight_before_the_first_scheduled_snapshot_rolls_back_to_the_start_once(tmp_path: Path) -> None:
    """The only snapshot is the fit's first, whose loss is far above the level the run had reached: the restored
    state trains back down at the backed-off LR and is judged once it is back (before, the level test fired 22
    steps after each restore, and the run ended in DivergenceError at step 172)."""
    model = TinyRegressor()
    x, y = model.data.tensors
    first_loss = torch.nn.functional.mse_loss(model(x), y).item()
    faults = FaultInjector(Fault(40, "nan_weight", parameter="net.0.weight"))
    trainer = fit(model, [*default_callbacks(), faults], max_steps=200, default_root_dir=str(tmp_path))
    events = _journal(tmp_path)
    assert _kinds(events, "nonfinite", "loss_divergence", "backoff", "rollback", "abort") == [
        (40, "nonfinite"), (40, "backoff"), (41, "rollback")
    ]  # fmt: skip
    (rollback,) = [e for e in events if e["kind"] == "rollback"]
    assert rollback["details"]["snapshot_step"] == 0
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.5 * model.lr
    with torch.no_grad():
        assert torch.nn.functional.mse_loss(model(x), y).item() < 0.2 * first_loss  # it trained back down


class NewTask(TinyRegressor):
    """From step ``at`` on, the targets are another task's (``3 - 4y``): new data, a far higher loss, no fault."""

    def __init__(self, at: int = 60) -> None:
        super().__init__()
        self.at = at

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.trainer.global_step >= self.at:
            y = 3.0 - 4.0 * y
        return torch.nn.functional.mse_loss(self(x), y)


class WeightsAtBatchEnd(pl.Callback):
    """The weights at the end of every batch (after the suite acted)."""

    def __init__(self) -> None:
        self.at: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        self.at[trainer.global_step] = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


def test_a_new_task_is_suspected_tried_and_left_alone(tmp_path: Path) -> None:
    """The loss jumps at the new task and the level test suspects the state; the trial's remedies, the snapshot
    from before the switch at lower rates, do no better on the new data than the run as it is: the run ends
    bit-identical to the bare run, at its configured rate (the old ladder backed off, rolled back, and had to take
    the backoff back after a probe)."""
    torch.manual_seed(0)
    bare = NewTask(at=60)
    fit(bare, [], max_steps=120)
    torch.manual_seed(0)
    model = NewTask(at=60)
    trainer = fit(model, default_callbacks(clip=None, snapshot_every_n_steps=10), max_steps=120,
                  default_root_dir=str(tmp_path))  # fmt: skip
    events = _journal(tmp_path)
    trials = [e for e in events if e["kind"] == "trial"]
    assert trials and all(not e["details"]["kept"] and e["details"]["false_alarm"] for e in trials)
    assert trials[0]["details"]["signal"] == "loss_divergence" and trials[0]["details"]["snapshot_step"] == 60
    assert _kinds(events, "backoff", "rollback", "abort") == []
    assert_bit_identical(weights(model), weights(bare))
    assert trainer.optimizers[0].param_groups[0]["lr"] == model.lr


@pytest.mark.ddp
@pytest.mark.timeout(180)
def test_under_ddp_both_ranks_try_the_new_task_and_leave_it_alone_at_the_same_steps(tmp_path: Path) -> None:
    from ddp_utils import run_ddp

    reports = run_ddp(NewTask(at=30), default_callbacks(snapshot_every_n_steps=10), tmp_path, max_steps=60)
    assert [r["error"] for r in reports] == [None, None]
    assert reports[0]["digest"] == reports[1]["digest"] and reports[0]["states"] == reports[1]["states"]
    assert reports[0]["lrs"] == reports[1]["lrs"] and set(reports[0]["lrs"]) == {0.01}
    trials = [e for e in _journal(tmp_path) if e["kind"] == "trial"]
    assert trials and not any(e["details"]["kept"] for e in trials)


# ---- weights that run away -----------------------------------------------------------------------------------------
RUNAWAY = [Fault(step, "scale_weight", parameter="net.0.weight", factor=1.15) for step in range(60, 70)]  # 4.05x


def _growth_only(suite: list[Any]) -> list[Any]:
    """``suite`` with its loss-level test off: the loss climbs back past twice its best as the weights run away, and
    the level test finds that first (:func:`test_runaway_weights_whose_loss_climbs_back_are_found_by_the_level_first`);
    off, the weight-growth test is what answers the weights."""
    for callback in suite:
        if isinstance(callback, LossSpikeDetector):
            tuned(callback, level_window=None)
    return suite


def test_runaway_weights_whose_loss_climbs_back_are_found_by_the_level_first(tmp_path: Path) -> None:
    suite = default_callbacks(snapshot_every_n_steps=25)
    fit(TinyRegressor(), [*suite, FaultInjector(*RUNAWAY)], max_steps=70, default_root_dir=str(tmp_path))
    # Its trial, opened there, is cut short by the fit's end at step 70.
    assert _kinds(_journal(tmp_path), "weight_growth", "loss_divergence", "trial") == [
        (68, "loss_divergence"), (70, "trial")
    ]  # fmt: skip


def test_weights_that_run_away_while_the_loss_climbs_back_are_tried_from_before_the_growth(tmp_path: Path) -> None:
    """The first layer grows 1.15x a step over steps 60-69, its units saturate and the loss climbs back: at the
    weight sample of step 80 the norm stands 2x or more above the sample of step 30 with the loss above its best.
    The snapshots of steps 50 and 75 are kept: 75 holds the runaway weights, so the trial's remedies start from 50;
    they win, and 75 is dropped with the run they replace."""
    model, before, after = TinyRegressor(), WeightsAtBatchEnd(), WeightsAtBatchEnd()
    suite = _growth_only(default_callbacks(snapshot_every_n_steps=25))
    trainer = fit(model, [before, *suite, FaultInjector(*RUNAWAY), after], max_steps=120,
                  default_root_dir=str(tmp_path))  # fmt: skip
    events = _journal(tmp_path)
    assert _kinds(events, "weight_growth", "loss_divergence", "trial", "backoff", "rollback", "abort") == [
        (80, "weight_growth"), (101, "trial"), (101, "backoff"), (101, "rollback"), (120, "trial")
    ]  # fmt: skip
    (growth,) = [e for e in events if e["kind"] == "weight_growth"]
    details = growth["details"]
    assert details["since"] == 30 and details["weight_norm"] >= 2 * details["weight_norm_before"]
    assert details["loss"] >= 1.1 * details["best_loss"] and details["loss"] >= 0.8 * details["loss_before"]
    assert details["at_best"] is False
    assert re.match(r"LossSpikeDetector: the weight norm grew [\d.]+x in 50 steps \(from [\d.]+ at step 30 to "
                    r"[\d.]+ at step 80\) while the training loss did not fall", growth["message"])
    trial, ladder = [e for e in events if e["kind"] == "trial"]
    assert (trial["details"]["opened_at"], trial["details"]["snapshot_step"]) == (80, 50)
    assert trial["details"]["kept"] and trial["details"]["kept_lr_factor"] == 0.125
    (backoff,) = [e for e in events if e["kind"] == "backoff"]
    assert backoff["details"]["kinds"] == "weight_growth" and backoff["details"]["scale"] == 0.125
    (rollback,) = [e for e in events if e["kind"] == "rollback"]
    assert rollback["details"]["snapshot_step"] == 50
    assert suite[-1].snapshot_steps == [50]  # 75 held the runaway weights
    # The next rung (the kept remedy at lower rates against itself) ran until the fit ended, and changed nothing.
    assert (ladder["details"]["rung"], ladder["details"]["steps"], ladder["details"]["kept"]) == (2, 19, False)
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.125 * model.lr
    assert_bit_identical(after.at[81], before.at[81])  # opening the trial left the run as it was


def test_the_snapshot_taken_during_the_growth_is_dropped_from_disk_too(tmp_path: Path) -> None:
    """A resumed run must not find the runaway weights either: the file of step 75 goes with its memory copy."""
    suite = _growth_only(default_callbacks(snapshot_every_n_steps=25, dirpath=tmp_path / "snaps"))
    fit(TinyRegressor(), [*suite, FaultInjector(*RUNAWAY)], max_steps=110, default_root_dir=str(tmp_path))
    assert _kinds(_journal(tmp_path), "rollback") == [(101, "rollback")]
    assert sorted(p.name for p in (tmp_path / "snaps").glob("*.pt")) == [snapshot_name(50)]
    assert [entry["step"] for entry in suite[-1].state_dict()["disk"]] == [50]


def test_weights_that_grow_out_of_a_small_init_while_the_run_learns_change_nothing(tmp_path: Path) -> None:
    """Weights drawn 100x smaller grow about 9x in the first 50 steps, the loss at its best all along: no finding,
    and the run is bit-identical to the same run without the suite."""
    runs = []
    for suite in ([], default_callbacks(clip=None)):
        torch.manual_seed(0)
        model = TinyRegressor()
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.mul_(0.01)
        fit(model, suite, max_steps=200, default_root_dir=str(tmp_path / str(len(runs))))
        runs.append(weights(model))
    assert _journal(tmp_path / "1") == []
    assert_bit_identical(runs[0], runs[1])


def _norm(state: dict[str, torch.Tensor]) -> float:
    return float(torch.sqrt(sum((t.double() ** 2).sum() for t in state.values())))


class EasyFirstBatch(TinyRegressor):
    """The targets of the first batch halved: an easy batch, whose loss is the fit's first and its lowest for the next
    five steps."""

    def __init__(self) -> None:
        super().__init__()
        x, y = self.data.tensors
        y = y.clone()
        y[: self.batch_size] *= 0.5
        self.data = TensorDataset(x, y)


def test_a_first_batch_that_happened_to_be_easy_is_no_best_for_weights_that_grow_out_of_a_small_init(
    tmp_path: Path,
) -> None:
    """Weights drawn 100x smaller grow over 20x in their first 10 steps while the median loss of steps 1-10 stands
    1.6x above the fit's first one, an easy batch's: one loss is no level the run reached, so nothing fires and the
    run is bit-identical to the same run without the suite."""
    runs, growth = [], []
    for suite in ([], default_callbacks(clip=None)):
        torch.manual_seed(0)
        model, after = EasyFirstBatch(), WeightsAtBatchEnd()
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.mul_(0.01)
        initial = weights(model)
        fit(model, [*suite, after], max_steps=60, default_root_dir=str(tmp_path / str(len(runs))))
        runs.append(weights(model))
        growth.append(_norm(after.at[10]) / _norm(initial))
    assert growth[0] > 20.0  # between the test's samples of steps 0 and 10
    assert _journal(tmp_path / "1") == []
    assert_bit_identical(runs[0], runs[1])


class LossBurstAt(TinyRegressor):
    """One batch of all the data, a BatchNorm after the first layer (scaling that layer's weight changes no output)
    and, at step 5, a loss ``times`` the batch's whose gradients are the batch's own: single losses run away, nothing
    else does."""

    def __init__(self, times: float) -> None:
        super().__init__(lr=1e-4, batch_norm=True, batch_size=64)
        self.times = times

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss + (self.times - 1.0) * loss.detach() if self.global_step == 5 else loss


OVERSHOOT = [Fault(step, "scale_weight", parameter="net.0.weight", factor=1.2) for step in range(1, 11)]  # 6.2x


@pytest.mark.parametrize("times", [20.0, 5.0, 1.0])
def test_weights_that_run_away_while_the_loss_stays_at_its_first_level_count_once_a_loss_ran_away(
    tmp_path: Path, times: float
) -> None:
    """The first layer grows 6.2x over steps 1-10 while the loss median stays where it started, its best: a run that
    never learned. With one loss at step 5 beyond 10x the anchor (``growth_runaway_factor``) that is suspected as
    overshoot (the sample of step 10 against step 0's); with one at 5x, or none, growth at the loss's best is
    learning, and nothing fires. A BatchNorm follows the layer, so its scale changes no output: the trial's remedies
    (the fit's first state at lower rates) do no better than the run as it is, and the run goes on untouched."""
    runs = []
    for suite in ([], default_callbacks(clip=None)):
        torch.manual_seed(0)
        model = LossBurstAt(times)
        root = tmp_path / str(len(runs))
        trainer = fit(model, [*suite, FaultInjector(*OVERSHOOT)], max_steps=40, default_root_dir=str(root))
        runs.append(weights(model))
    events, lr = _journal(tmp_path / "1"), trainer.optimizers[0].param_groups[0]["lr"]
    assert_bit_identical(runs[0], runs[1])
    assert lr == 1e-4
    if times < 10.0:
        assert events == []
        return
    assert _kinds(events, "weight_growth", "loss_divergence", "trial", "backoff", "rollback", "abort") == [
        (10, "weight_growth"), (31, "trial")
    ]  # fmt: skip
    (growth,) = [e for e in events if e["kind"] == "weight_growth"]
    details = growth["details"]
    assert details["since"] == 0 and details["weight_norm"] >= 2 * details["weight_norm_before"]
    assert details["loss"] < 1.1 * details["best_loss"] and details["loss"] >= 0.8 * details["loss_before"]
    assert details["at_best"] is True
    assert re.search(r"did not fall \(median [\d.]+ then, [\d.]+ now\) and single losses ran beyond 10x its starting level "
                     r"[\d.]+: the updates overshoot", growth["message"])
    (trial,) = [e for e in events if e["kind"] == "trial"]
    assert (trial["details"]["snapshot_step"], trial["details"]["false_alarm"]) == (0, True)


@pytest.mark.parametrize("clipped", [True, False])
def test_a_loss_that_ran_away_on_a_batch_a_clip_neutralised_tells_of_the_batch(tmp_path: Path, clipped: bool) -> None:
    """The same growth at the loss's best, and at step 5 a loss 1000x with its gradients 1000x (a poison batch). A
    fixed clip at 10 scales that step by about 0.003: the clip neutralised the batch, whose loss then says nothing of
    the weights, and nothing fires. Unclipped, that loss counts as one that ran away, and the growth is suspected."""
    torch.manual_seed(0)
    suite = [*default_callbacks(clip=None), *([AutoClip(mode="fixed", max_norm=10.0)] if clipped else [])]
    faults = FaultInjector(*OVERSHOOT, Fault(5, "loss_spike", factor=1e3))
    fit(LossBurstAt(1.0), [*suite, faults], max_steps=20, default_root_dir=str(tmp_path))
    events = _journal(tmp_path)
    found = [(10, "weight_growth"), (20, "trial")]  # the fit ends inside the trial: judged on its 9 steps
    assert _kinds(events, "weight_growth", "loss_divergence", "trial") == ([] if clipped else found)
    clips = [e for e in events if e["kind"] == "clip"]
    assert [(e["step"], e["details"]["coef"] < 0.01) for e in clips] == ([(5, True)] if clipped else [])


@pytest.mark.ddp
@pytest.mark.timeout(180)
def test_under_ddp_both_ranks_find_the_runaway_weights_and_roll_back_together(tmp_path: Path) -> None:
    from ddp_utils import run_ddp

    suite = _growth_only(default_callbacks(snapshot_every_n_steps=25))
    reports = run_ddp(TinyRegressor(), [*suite, FaultInjector(*RUNAWAY)], tmp_path, max_steps=110)
    assert [r["error"] for r in reports] == [None, None]
    assert reports[0]["digest"] == reports[1]["digest"] and reports[0]["states"] == reports[1]["states"]
    assert reports[0]["lrs"] == reports[1]["lrs"] and reports[0]["lrs"][-1] < 0.01
    assert _kinds(_journal(tmp_path), "weight_growth", "trial", "backoff", "rollback")[:4] == [
        (80, "weight_growth"), (101, "trial"), (101, "backoff"), (101, "rollback")
    ]  # fmt: skip


# ---- a run that does not learn -------------------------------------------------------------------------------------
class Bouncing(pl.LightningModule):
    """Full-batch gradient descent on a quadratic whose curvatures are 1 and 9e-4 (inputs (+-1, 0) and (0, +-0.03),
    targets their sum), from weights 0. At the rate 2 = 2 / 1 the stiff weight flips between 0 and 2 for ever, exactly
    (its loss share, 0.5, never moves): the loss sits at its start, 0.50045, finite, no spike, no trend. At half that
    rate the stiff weight lands on its target in one step, and the loss falls to the flat weight's share, 4.5e-4.

    Args:
        lr: the SGD learning rate.
        until: from this step on the rate is halved (a run whose loss sits flat, then learns).
    """

    def __init__(self, lr: float = 2.0, until: int | None = None) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 1, bias=False)
        torch.nn.init.zeros_(self.linear.weight)
        self.lr, self.until = lr, until
        x = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 0.03], [0.0, -0.03]])
        self.data = TensorDataset(x, x.sum(1, keepdim=True))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.linear(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        if self.until is None:
            return optimizer
        until = self.until
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 if step < until else 0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=4)


def _trial_facts(events: list[dict[str, Any]]) -> list[tuple[int, int, int | None, bool, int]]:
    return [(e["step"], e["details"]["opened_at"], e["details"]["snapshot_step"], e["details"]["kept"],
             e["details"]["steps"]) for e in events if e["kind"] == "trial"]  # fmt: skip


def test_a_rate_at_which_the_loss_never_leaves_its_start_is_tried_from_the_start_and_the_lower_rate_kept(
    tmp_path: Path,
) -> None:
    """The level (over 20 healthy steps) is first judged at step 19; 50 steps without a new low later, at step 69,
    the run is suspected of not learning. Its trial, twice the usual 20 steps, starts from the fit's first snapshot at
    half and an eighth of the rate: both learn at once, the run does not, and the half rate is kept (a rollback to
    step 0 and a backoff, journaled as the trial's). The follow-up from there at lower rates still does no better."""
    model = Bouncing()
    trainer = fit(model, default_callbacks(clip=None), max_steps=140, default_root_dir=str(tmp_path))
    events = _journal(tmp_path)
    (suspicion,) = [e for e in events if e["kind"] == "no_progress"]
    assert (suspicion["step"], suspicion["details"]["since"]) == (69, 0)
    assert "has stalled short of half its starting level" in suspicion["message"]
    assert _trial_facts(events) == [(110, 69, 0, True, 40), (130, 110, None, False, 20)]
    kept = next(e for e in events if e["kind"] == "trial")
    assert kept["details"]["kept_lr_factor"] == 0.5 and kept["details"]["signal"] == "no_progress"
    assert _kinds(events, "backoff", "rollback") == [(110, "backoff"), (110, "rollback")]
    assert trainer.optimizers[0].param_groups[0]["lr"] == 1.0
    assert model.linear.weight[0, 0].item() == 1.0  # the stiff weight on its target


def test_a_run_no_rate_makes_learn_ties_its_trials_and_is_tried_again_only_twice_as_late(tmp_path: Path) -> None:
    """At the rate 0 no remedy can do better: each trial ties, and the run goes on as it was. The first suspicion
    (step 69) opens a trial of 40 steps, a false alarm at step 110: the detector relearns the level (judged again from
    step 129) and the same suspicion waits 2 x 40 steps, to step 190. The clock finds no progress again at 178
    (within the wait: dropped) and at 228, which opens the second trial; that one waits 4 x 40 after it."""
    fit(Bouncing(lr=0.0), default_callbacks(clip=None), max_steps=300, default_root_dir=str(tmp_path))
    events = _journal(tmp_path)
    assert [e["step"] for e in events if e["kind"] == "no_progress"] == [69, 178, 228]
    assert _trial_facts(events) == [(110, 69, 0, False, 40), (269, 228, 0, False, 40)]
    assert all(e["details"]["false_alarm"] for e in events if e["kind"] == "trial")
    assert _kinds(events, "backoff", "rollback") == []


def test_a_slow_starter_that_learns_before_the_clock_runs_out_is_never_suspected(tmp_path: Path) -> None:
    """Flat at its start for 60 steps (the rate 2), then the schedule halves the rate and it learns at once: 9 steps
    short of the suspicion; once learned, never again. The run ends bit-identical to the bare run."""
    bare = Bouncing(until=60)
    fit(bare, [], max_steps=200)
    model = Bouncing(until=60)
    fit(model, default_callbacks(clip=None), max_steps=200, default_root_dir=str(tmp_path))
    assert _journal(tmp_path) == []
    assert_bit_identical(weights(model), weights(bare))


@pytest.mark.ddp
@pytest.mark.timeout(180)
def test_under_ddp_both_ranks_suspect_the_run_that_does_not_learn_and_keep_the_lower_rate_together(
    tmp_path: Path,
) -> None:
    """Each rank holds two of the four inputs; the loss of the suspicion is the mean over both ranks, so both suspect
    the run at step 69 and keep the same remedy at step 110."""
    from ddp_utils import run_ddp

    reports = run_ddp(Bouncing(), default_callbacks(clip=None), tmp_path, max_steps=120)
    assert [r["error"] for r in reports] == [None, None]
    assert reports[0]["digest"] == reports[1]["digest"] and reports[0]["states"] == reports[1]["states"]
    assert reports[0]["lrs"] == reports[1]["lrs"] and reports[0]["lrs"][-1] == 1.0
    events = _journal(tmp_path)
    assert [e["step"] for e in events if e["kind"] == "no_progress"] == [69]
    assert _trial_facts(events)[0] == (110, 69, 0, True, 40)
