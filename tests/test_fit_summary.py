"""The fit in plain words: the end-of-fit summary and ``python -m lightning_overflow journal``."""

from __future__ import annotations

import json
import logging
import math
import random
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger
from torch import Tensor

from lightning_overflow import LRBackoff, NonFiniteDetector, read_journal
from lightning_overflow.cli import main
from lightning_overflow.fit_summary import (
    ENDING_BLOCK,
    LossEnding,
    ending_words,
    left_alone,
    plain_lines,
    stalled_ending,
)
from lightning_overflow.testing import Fault, FaultInjector, TinyRegressor
from tests.conftest import fit, tuned

SUMMARY_LOGGER = "lightning_overflow"


class CorruptRow(TinyRegressor):
    """Eight unshuffled batches of eight an epoch; sample 19 (batch 2, row 3) holds a NaN feature."""

    def __init__(self) -> None:
        super().__init__(optimizer="sgd", lr=0.05)
        x, y = self.data.tensors
        x = x.clone()
        x[2 * 8 + 3, 1] = float("nan")
        self.data = torch.utils.data.TensorDataset(x, y)


class ScriptedLoss(TinyRegressor):
    """The loss is ``1`` for the first ``change`` steps and ``after`` from then on (times a weight whose gradient is
    0): a run that ends far above its best, with losses known exactly."""

    def __init__(self, after: float = 100.0, change: int = 40) -> None:
        super().__init__()
        self.after, self.change = after, change

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        value = 1.0 if self.trainer.global_step < self.change else self.after
        return value + 0.0 * self(batch[0]).sum()


def _summary(caplog: pytest.LogCaptureFixture) -> list[str]:
    records = [r.getMessage() for r in caplog.records if r.name == SUMMARY_LOGGER and "in this fit" in r.getMessage()]
    assert len(records) == 1
    return records[0].splitlines()


def test_a_data_fault_is_one_line_naming_the_batch_and_row(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    with caplog.at_level(logging.INFO, logger=SUMMARY_LOGGER):
        fit(CorruptRow(), [NonFiniteDetector()], max_epochs=3, max_steps=-1, default_root_dir=tmp_path)
    assert _summary(caplog) == [
        f"lightning_overflow: what happened in this fit (the details: python -m lightning_overflow journal {tmp_path / 'overflow_events.jsonl'}):",
        "  - 3 steps skipped: batch 2 of each epoch holds NaN in row 3 (epochs 0-2): a data fault; check the data",
    ]
    events = list(read_journal(tmp_path))
    assert [(e["step"], e["kind"]) for e in events] == [(s, k) for s in (2, 10, 18) for k in ("data_fault", "skip")]
    fault = events[0]["details"]
    assert (fault["batch"], fault["rows"], fault["data"], fault["data_ranks"]) == (2, [3], "batch 2 holds NaN in row 3",
                                                                                  [0])  # fmt: skip
    # The skip refers to its finding; the diagnosis is written once, beside the message that says it.
    assert events[1]["details"] == {"where": "loss", "finding": "data_fault", "ranks": [0], "optimizer": 0}
    assert "message" not in fault["diagnosis"] and "batch 2 holds NaN in row 3" in events[0]["message"]


QUIETED = """
import logging, sys, warnings
warnings.filterwarnings("ignore")
logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)  # as users (and pytorch-tabular) quiet Lightning
sys.path.insert(0, {tests!r})
from conftest import fit
from lightning_overflow import NonFiniteDetector
from lightning_overflow.testing import Fault, FaultInjector, TinyRegressor
fit(TinyRegressor(), [NonFiniteDetector(), FaultInjector(Fault(2, "nan_loss"))], max_steps=4, default_root_dir={root!r})
"""


def test_quieting_lightnings_logger_leaves_the_summary_said(tmp_path: Path) -> None:
    """The suite logged as a child of Lightning's logger: ``logging.getLogger("pytorch_lightning").setLevel(ERROR)``,
    the usual way to quiet Lightning (pytorch-tabular's ``suppress_lightning_logger``), took every line of the suite
    with it, though it skipped steps. Its own logger keeps them, on standard error, in a plain script."""
    import subprocess
    import sys

    tests = str(Path(__file__).resolve().parent)
    done = subprocess.run([sys.executable, "-c", QUIETED.format(tests=tests, root=str(tmp_path))],
                          capture_output=True, text=True, timeout=300, check=True)  # fmt: skip
    said = [line for line in done.stderr.splitlines() if line.startswith(("lightning_overflow", "  - "))]
    assert said == [
        f"lightning_overflow: what happened in this fit (the details: python -m lightning_overflow journal "
        f"{tmp_path / 'overflow_events.jsonl'}):",
        "  - 1 step skipped: the loss was inf/NaN at step 2 (not reproduced on replay: a hardware fault, a "
        "nondeterministic kernel or a race)",
    ]
    assert "GPU available" not in done.stderr and "GPU available" not in done.stdout  # Lightning's own stay quiet


def test_a_backoff_series_says_where_the_learning_rate_ended(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    faults = FaultInjector(*(Fault(step, "nan_loss") for step in (3, 6, 9)))
    callbacks = [
        tuned(NonFiniteDetector(), burst_count=1),
        LRBackoff(triggers=("nonfinite_burst",), cooldown=0, regrow_after=None, trial=None),
        faults,
    ]
    with caplog.at_level(logging.INFO, logger=SUMMARY_LOGGER):
        fit(TinyRegressor(optimizer="sgd", lr=0.1), callbacks, max_steps=12, default_root_dir=tmp_path)
    assert _summary(caplog)[1:] == [
        "  - 3 steps skipped: the loss was inf/NaN at steps 3, 6, 9 (not reproduced on replay: a hardware fault, a "
        "nondeterministic kernel or a race)",
        "  - learning rate backed off 3 times (steps 3, 6, 9); it ends at 0.125x its schedule (0.0125 at step 9): "
        "consider starting at 0.125x the learning rate",
    ]


ADVICE = ": look at the loss curve before using these weights; if the data did not change, try a lower learning rate"


@pytest.mark.parametrize(("after", "ratio"), [(100.0, "100x"), (10.0, "10x"), (1e6, "1e6x")])
def test_a_run_that_ends_far_above_its_best_is_flagged(caplog: pytest.LogCaptureFixture, tmp_path: Path, after: float,
                                                       ratio: str) -> None:  # fmt: skip
    with caplog.at_level(logging.INFO, logger=SUMMARY_LOGGER):
        fit(ScriptedLoss(after), [NonFiniteDetector()], max_steps=80, default_root_dir=tmp_path)
    level = f"{after:g}".replace("e+0", "e")
    assert _summary(caplog)[1:] == [
        f"  - the training loss ended {ratio} above its best (median {level} over steps 40-79, 1 over steps 0-39)"
        + ADVICE
    ]
    (event,) = read_journal(tmp_path)
    assert (event["step"], event["kind"]) == (80, "ending")
    assert event["details"] == {"last": after, "last_from": 40, "last_step": 79, "block": 40, "against": "best",
                                "best": 1.0, "best_from": 0, "best_step": 39, "ratio": after}  # fmt: skip


def test_a_run_the_suite_acted_on_that_ends_far_above_its_best_says_both(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    with caplog.at_level(logging.INFO, logger=SUMMARY_LOGGER):
        fit(ScriptedLoss(), [NonFiniteDetector(), FaultInjector(Fault(50, "nan_loss"))], max_steps=81,
            default_root_dir=tmp_path)  # fmt: skip
    # Step 50's loss was NaN: the last 40 finite losses span steps 40-80.
    assert _summary(caplog)[-1] == (
        "  - the training loss ended 100x above its best (median 100 over steps 40-80, 1 over steps 0-39), after what "
        "the suite did above" + ADVICE
    )


def test_a_run_that_went_wrong_before_it_had_a_best_is_measured_against_its_start(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    with caplog.at_level(logging.INFO, logger=SUMMARY_LOGGER):
        fit(ScriptedLoss(1e6, change=10), [NonFiniteDetector()], max_steps=120, default_root_dir=tmp_path)
    assert _summary(caplog)[1:] == [
        "  - the training loss ended 1e6x above where it started (median 1e6 over steps 80-119, 1 over its first 5 "
        "steps)" + ADVICE
    ]


class KillFirstLayer(pl.Callback):
    """At step ``at``, saturate the first layer: tanh of -1e4 is -1 exactly, and its derivative 0 exactly, so the layer
    passes no gradient back from then on (a dead layer, as a ReLU layer whose outputs are all 0)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        if trainer.global_step == self.at:
            with torch.no_grad():
                pl_module.net[0].bias.fill_(-1e4)


def test_a_network_that_died_says_so_with_its_silent_tensors(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    with caplog.at_level(logging.INFO, logger=SUMMARY_LOGGER):
        fit(TinyRegressor(), [NonFiniteDetector(), KillFirstLayer(10)], max_steps=60, default_root_dir=tmp_path)
    (event,) = read_journal(tmp_path)
    assert (event["step"], event["kind"]) == (60, "ending")
    assert event["details"] == {"silent_tensors": 2, "tensors": 4, "silent_steps": 50, "silent_from": 10,
                                "names": ["net.0.weight", "net.0.bias"], "block": 40}  # fmt: skip
    assert _summary(caplog)[1:] == [
        "  - the network died: 2 of its 4 parameter tensors got no gradient at all on each of the fit's last 50 steps "
        "(from step 10 on; they had one before), among them net.0.weight, net.0.bias: units whose outputs are 0 for "
        "every input (a dead ReLU layer) pass nothing back: it learns no more, and its weights are not worth keeping; "
        "try a lower learning rate, a smaller initialisation (std = gain / sqrt(fan_in)) or a normalisation layer "
        "between the layers"
    ]


def test_a_network_dead_for_fewer_than_a_block_of_steps_or_silent_from_its_start_is_not_called_dead() -> None:
    def ending(silent: list[tuple[int, int]]) -> LossEnding:
        tracked = LossEnding()
        for step, counts in enumerate(silent):
            tracked.add(step, 1.0, counts)
        return tracked

    assert ending([(0, 4)] * 10 + [(2, 4)] * 39).event_details() is None  # 39 silent steps: not yet a block
    assert ending([(0, 4)] * 10 + [(2, 4)] * 40).event_details() == {
        "silent_tensors": 2, "tensors": 4, "silent_steps": 40, "silent_from": 10, "names": [], "block": 40}
    assert ending([(3, 4)] * 100).event_details() is None  # frozen by design: its tensors never had a gradient
    assert ending([(0, 4)] * 10 + [(1, 4)] * 100).event_details() is None  # a quarter silent: alive
    assert ending([(0, 4)] * 10 + [(2, 4)] * 60 + [(0, 4)]).event_details() is None  # alive again at the end
    assert ending([(0, 4)] * 10 + [(4, 4)] * 60).event_details() is None  # no gradient anywhere: a hinge loss at 0


def test_a_run_that_stalled_above_half_its_start_and_tied_its_trial_says_it_learned_little() -> None:
    def trial(step: int, signal: str, kept: bool = False) -> dict[str, Any]:
        return {"step": step, "kind": "trial", "epoch": 0, "source": "x", "message": "", "details": {
            "signal": signal, "opened_at": step - 40, "kept": kept, "false_alarm": not kept, "extra_steps": 80}}

    stalled = _ended([2.0] * 5 + [1.5] * 95)  # the start 2, the last level 1.5: 0.75x
    tie = trial(100, "no_progress")
    facts = stalled_ending([tie], stalled)
    assert facts == {"against": "start", "stalled": True, "last": 1.5, "last_from": 60, "last_step": 99, "start": 2.0,
                     "start_steps": 5, "start_step": 4, "ratio": 0.75, "trial_step": 60, "block": 40}  # fmt: skip
    ending = {"step": 100, "kind": "ending", "epoch": 0, "source": "lightning_overflow", "message": "",
              "details": facts}  # fmt: skip
    assert plain_lines([tie, ending])[-1] == (
        "the training loss ended at 0.75x where it started (median 1.5 over steps 60-99, 2 over its first 5 steps), "
        "never below half of it, and a lower learning rate did no better (the trial of the stall at step 60): a rate "
        "too high is not why it stalled; if it should come down further, look at the model, its initialisation or "
        "the data, or try a higher learning rate (only lower ones were tried: at a rate far too low they tie as well)"
    )
    backoff = {"step": 20, "kind": "backoff", "epoch": 0, "source": "LRBackoff", "message": "", "details": {}}
    assert plain_lines([backoff, tie, ending])[-1].endswith(  # a run whose rate was backed off: not a rate too low
        "a rate too high is not why it stalled; if it should come down further, look at the model, its "
        "initialisation or the data"
    )
    assert stalled_ending([tie, trial(150, "loss_divergence", kept=True)], stalled) is None  # a remedy kept since
    assert stalled_ending([trial(100, "loss_trend")], stalled) is None  # no suspicion of a run that does not learn
    assert stalled_ending([tie], _ended([2.0] * 5 + [0.9] * 95)) is None  # below half its start: it learned
    # It learned, then went back up above its start (a harder task): its tied trial was a relapse's, and the run
    # did come below half its start (a block median of 0.9), which the words would deny.
    assert stalled_ending([tie], _ended([2.0] * 5 + [0.9] * 75 + [2.5] * 80)) is None


def test_a_stall_trial_the_fits_end_cut_short_is_no_evidence_against_a_lower_rate() -> None:
    """A trial of a stall that the fit's end cut short (16 of its 40 steps) found nothing better in the batches it
    had: the ending does not say that a lower rate did no better, and the trial's line says it was cut short."""
    def trial(steps: int) -> dict[str, Any]:
        return {"step": 100, "kind": "trial", "epoch": 0, "source": "x", "message": "", "details": {
            "signal": "no_progress", "opened_at": 84, "kept": False, "false_alarm": True, "extra_steps": 32,
            "steps": steps, "planned_steps": 40, "comparisons": []}}

    stalled = _ended([2.0] * 5 + [1.5] * 95)
    assert stalled_ending([trial(16)], stalled) is None
    assert stalled_ending([trial(40)], stalled) is not None
    assert plain_lines([trial(16)]) == [
        "1 suspicion tried against doing nothing on the same unseen batches (the loss stalled short of half its "
        "start): 1 cut short by the fit's end, nothing better found in the steps it had (the run went on untouched); "
        "the trials cost 32 extra steps of compute"
    ]


def test_a_follow_up_the_fits_end_cut_short_is_not_said_to_have_found_the_remedy_no_better() -> None:
    """A lower-rate follow-up cut at 4 of its 20 steps, both remedies ahead on the batches it had: the summary said
    it "kept the run as it was (the remedy was no better)"."""
    follow_up = {"step": 100, "kind": "trial", "epoch": 0, "source": "x", "message": "", "details": {
        "signal": "loss_divergence", "opened_at": 96, "kept": False, "false_alarm": False, "rung": 2, "extra_steps": 8,
        "steps": 4, "planned_steps": 20, "comparisons": []}}
    assert plain_lines([follow_up]) == [
        "1 lower-rate follow-up tried against doing nothing on the same unseen batches (the loss rose far above its "
        "best and stayed there): 1 kept the run as it was, cut short by the fit's end (too few steps to tell); the "
        "trials cost 8 extra steps of compute"
    ]


def test_a_healthy_run_says_nothing(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    with caplog.at_level(logging.INFO, logger=SUMMARY_LOGGER):
        fit(TinyRegressor(), [NonFiniteDetector()], max_steps=60, default_root_dir=tmp_path)
    assert not [r for r in caplog.records if r.name == SUMMARY_LOGGER]
    assert not (tmp_path / "overflow_events.jsonl").exists()


def _ended(losses: list[float]) -> LossEnding:
    ending = LossEnding()
    for step, loss in enumerate(losses):
        ending.add(step, loss)
    return ending


def test_loss_ending_needs_whole_stretches_and_a_positive_baseline() -> None:
    assert _ended([0.1] * 20 + [50.0] * 19).event_details() is None  # 39 losses: no stretch of 40 to compare yet
    assert _ended([0.1] * 40 + [5.0] * 40).event_details() == {
        "last": 5.0, "last_from": 40, "last_step": 79, "block": 40, "against": "best", "best": pytest.approx(0.1),
        "best_from": 0, "best_step": 39, "ratio": pytest.approx(50.0)}  # fmt: skip
    assert _ended([-1.0] * 40 + [3.0] * 40).event_details() is None  # a log-likelihood below 0: no ratio means anything
    assert _ended([0.0] * 80 + [0.05] * 40).event_details() is None  # a hinge at exactly 0 that rises a little


def test_loss_ending_tells_exactly_ten_times_and_not_less() -> None:
    assert _ended([2.0] * 40 + [20.0] * 40).event_details()["ratio"] == 10.0  # type: ignore[index]
    assert _ended([2.0] * 40 + [19.9] * 40).event_details() is None


def test_healthy_losses_never_end_far_above_their_best() -> None:
    noise = random.Random(0)
    falling = [3.0 * math.exp(-step / 60) + 0.05 for step in range(400)]
    # Heavy-tailed noise: a loss of 20x its level on one step in 25, and a factor of 0.2 to 5 on every step.
    noisy = [level * math.exp(noise.uniform(-1.6, 1.6)) * (20.0 if noise.random() < 0.04 else 1.0) for level in falling]
    assert _ended(noisy).event_details() is None
    spikes_at_the_end = falling[:380] + [falling[380] * 1e4 if step % 3 == 0 else falling[380] for step in range(20)]
    assert _ended(spikes_at_the_end).event_details() is None  # a third of the last 20 steps spike: medians hold
    rising = falling[:200] + [falling[199] * (1 + 4 * step / 200) for step in range(200)]  # 5x, for a good reason
    assert _ended(rising).event_details() is None
    slow_start = [3.0] * 150 + [3.0 * math.exp(-step / 30) + 0.05 for step in range(250)]  # flat, then it learns
    assert _ended(slow_start).event_details() is None
    for steps in (5, 39, 60):  # a short fit
        assert _ended(noisy[:steps]).event_details() is None


def test_a_fit_that_ends_on_inf_or_nan_losses_says_so() -> None:
    ending = _ended([1.0] * 100 + [math.nan] * 39)
    assert ending.event_details() is None  # 39 in a row: the detectors' lines tell those
    ending.add(139, math.inf)
    assert ending.event_details() == {"nonfinite_steps": 40, "nonfinite_from": 100, "last_finite_step": 99,
                                      "block": 40}  # fmt: skip
    assert ending_words(ending.event_details()) == (  # type: ignore[arg-type]
        "the training loss was inf/NaN on each of the fit's last 40 steps (from step 100 on)"
    )


def test_the_ending_line_is_made_from_the_event_facts() -> None:
    def ending(**details: Any) -> dict[str, Any]:
        return {"step": 400, "kind": "ending", "epoch": 0, "source": "lightning_overflow", "message": "as journaled",
                "details": details}  # fmt: skip

    start = ending(**_ended([3.0] * 5 + [3e5] * 395).event_details())  # type: ignore[arg-type]
    assert plain_lines([start]) == [
        "the training loss ended 1e5x above where it started (median 3e5 over steps 360-399, 3 over its first 5 "
        "steps)" + ADVICE
    ]
    assert plain_lines([ending(ratio=12.0)]) == ["as journaled" + ADVICE]  # facts missing: the message as journaled


def test_the_rate_of_a_backoff_that_a_rollback_followed_is_not_quoted() -> None:
    """A rollback at the backoff's step puts the schedule back to its snapshot's step: the rate the backoff set there
    is not the one the run went on with (chemprop's warm-up restarted at 5e-5, not 0.000414)."""

    def event(step: int, kind: str, **details: Any) -> dict[str, Any]:
        return {"step": step, "kind": kind, "epoch": 0, "source": "x", "message": "", "details": details}

    backoff = event(30, "backoff", optimizer=0, scale=0.5, lrs=[0.000414])
    rollback = event(30, "rollback", signal="nonfinite_state", snapshot_step=0, rollbacks=1, budget_left=2)
    assert plain_lines([backoff])[0] == (
        "learning rate backed off once (step 30); it ends at 0.5x its schedule (0.000414 at step 30): consider "
        "starting at 0.5x the learning rate"
    )
    assert plain_lines([backoff, rollback])[0] == (  # a journal of an older release: no rates on the rollback
        "learning rate backed off once (step 30); it ends at 0.5x its schedule: consider starting at 0.5x the "
        "learning rate"
    )
    rollback["details"]["lrs"] = [[5e-5]]  # the rates once the rollback was done
    assert plain_lines([backoff, rollback])[0] == (
        "learning rate backed off once (step 30); it ends at 0.5x its schedule (5e-05 at step 30): consider starting "
        "at 0.5x the learning rate"
    )


def test_suspicions_left_alone_at_the_floor_or_past_the_rollback_budget_are_said() -> None:
    def event(step: int, kind: str, source: str = "LossSpikeDetector", **details: Any) -> dict[str, Any]:
        return {"step": step, "kind": kind, "epoch": 0, "source": source, "message": f"{source}: {kind} at {step}",
                "details": details}  # fmt: skip

    backoff = event(100, "backoff", "LRBackoff", optimizer=0, scale=0.001, floor=0.001, lrs=[1e-5])
    floor = [backoff, event(150, "loss_divergence"), event(220, "loss_divergence"), event(300, "loss_trend")]
    assert plain_lines(floor) == [
        "learning rate backed off once (step 100); it ends at 0.001x its schedule (1e-05 at step 100), its floor "
        "(min_scale): no backoff went lower: consider starting at 0.001x the learning rate",
        "3 suspicions left alone at steps 150, 220, 300 (the loss rose far above its best and stayed there; the loss "
        "kept rising): the learning rate was already at its floor (0.001x its schedule), the lowest LRBackoff may set; "
        "try starting at a lower learning rate",
    ]
    message, facts = left_alone(floor)  # type: ignore[misc]
    assert facts == {"why": "lr_floor", "scale": 0.001, "floor": 0.001, "steps": [150, 220, 300],
                     "signals": ["loss_divergence", "loss_trend"]}  # fmt: skip
    journaled = event(400, "left_alone", "lightning_overflow", **facts)
    journaled["message"] = message
    assert plain_lines([*floor, journaled])[1] == message  # told once, from the journal's event
    rollback = event(120, "rollback", "Rollback", snapshot_step=100, reason="loss_divergence", budget_left=0)
    assert plain_lines([rollback, event(180, "weight_growth")])[1] == (
        "1 suspicion left alone at step 180 (the weights kept growing while the loss did not fall): Rollback had spent "
        "its budget (its last allowed rollback was at step 120); try a lower learning rate, or more rollbacks "
        "(Rollback(max_rollbacks=...))"
    )
    above_the_floor = dict(backoff, details={**backoff["details"], "scale": 0.01})
    assert left_alone([above_the_floor, event(150, "loss_divergence")]) is None
    # Not left alone for want of a remedy, yet nothing answered it (no trial, no trigger): the line says so.
    assert plain_lines([above_the_floor, event(150, "loss_divergence")])[1] == (
        "loss_divergence at 150; told only, nothing was done about it"
    )
    # One that came while a trial was under way waited for its verdict: the trial's line tells it.
    trial = event(60, "trial", "lightning_overflow", signal="loss_divergence", opened_at=40, kept=False,
                  false_alarm=True, extra_steps=20, comparisons=[])  # fmt: skip
    assert plain_lines([event(40, "loss_divergence"), event(50, "loss_trend"), trial, event(70, "loss_trend")]) == [
        "1 suspicion tried against doing nothing on the same unseen batches (the loss rose far above its best and "
        "stayed there): 1 false alarm (the run went on untouched); the trials cost 20 extra steps of compute",
        "loss_trend at 70; told only, nothing was done about it",
    ]


def test_plain_lines_group_shuffled_data_faults_and_tell_trials() -> None:
    def event(step: int, kind: str, epoch: int = 0, **details: Any) -> dict[str, Any]:
        return {
            "step": step,
            "kind": kind,
            "epoch": epoch,
            "source": "x",
            "message": f"{kind} {step}",
            "details": details,
        }

    events = [
        event(1, "data_fault", 0, batch=1, rows=[8], data="batch 1 holds 16 NaN in row 8"), event(1, "skip"),
        event(6, "data_fault", 1, batch=0, rows=[0], data="batch 0 holds 16 NaN in row 0"), event(6, "skip"),
        event(30, "weight_growth"),
        event(51, "trial", signal="weight_growth", opened_at=30, kept=True, kept_lr_factor=0.125, snapshot_step=0,
              false_alarm=False, extra_steps=40),
        event(71, "trial", signal="regrowth", opened_at=51, kept=False, false_alarm=False, extra_steps=20,
              comparisons=[]),
    ]  # fmt: skip
    assert plain_lines(events) == [
        "2 steps skipped: batches hold inf/NaN or values beyond 1e15 once an epoch in epochs 0-1, in a different batch "
        "each time (shuffled); the first, batch 1 of epoch 0 (step 1), holds 16 NaN in row 8: a data fault; check the "
        "data",
        "1 suspicion and 1 higher-rate test tried against doing nothing on the same unseen batches (the weights kept "
        "growing while the loss did not fall; a return towards the scheduled learning rate): 1 kept the remedy (step "
        "51: learning rate x0.125 from the snapshot of step 0), 1 kept the run as it was (the remedy was no better); "
        "the trials cost 60 extra steps of compute",
    ]


def test_a_data_fault_whose_step_went_ahead_is_not_counted_among_the_skipped() -> None:
    """A finite 1e30 in a batch is journaled by the headroom check while its loss stays finite; later batches holding
    it are skipped: the line counts and lists the skipped steps, and names the one that went ahead apart."""

    def event(step: int, kind: str, **details: Any) -> dict[str, Any]:
        return {"step": step, "kind": kind, "epoch": 0, "source": "x", "message": "", "details": details}

    data = "batch {} holds values up to 1e+30 in row 6"
    events = [event(0, "data_fault", batch=0, rows=[6], data=data.format(0))]
    for step in (2, 3):
        events += [event(step, "data_fault", batch=step, rows=[6], data=data.format(step)), event(step, "skip")]
    assert plain_lines(events) == [
        "2 steps skipped: batches hold inf/NaN or values beyond 1e15 at steps 2, 3; the first, batch 2 of epoch 0 "
        "(step 2), holds values up to 1e+30 in row 6; 1 more such batch went ahead (step 0: the loss stayed finite); "
        "a batch of such values whose loss stays finite is looked at only on the steps the headroom samples, so more "
        "may have gone ahead: a data fault; check the data"
    ]
    nan_rows = [event(2, "data_fault", batch=2, rows=[6], data="batch 2 holds NaN in row 6"), event(2, "skip")]
    assert plain_lines(nan_rows) == [  # NaN makes the loss NaN: no word of batches unseen
        "1 step skipped: batch 2 of epoch 0 (step 2) holds NaN in row 6: a data fault; check the data"
    ]


def test_steps_that_broke_before_their_loss_are_counted_in_their_line() -> None:
    """A step whose training_step raised on bad values (answered as an inf/NaN loss) says so in its line: how it broke,
    and on how many of the line's steps."""

    def event(step: int, kind: str, **details: Any) -> dict[str, Any]:
        return {"step": step, "kind": kind, "epoch": step // 4, "source": "x", "message": "", "details": details}

    data = "batch 3 holds NaN in row 2"
    faulted = {"faulted": "training_step raised ValueError"}
    every = [e for step in (3, 7, 11) for e in (event(step, "data_fault", batch=3, rows=[2], data=data, **faulted),
                                                event(step, "skip"))]  # fmt: skip
    assert plain_lines(every) == [
        "3 steps skipped: batch 3 of each epoch holds NaN in row 2 (epochs 0-2) (training_step raised ValueError on "
        "each, answered as inf/NaN losses): a data fault; check the data"
    ]
    losses = [event(step, "nonfinite", where="loss", **(faulted if step == 5 else {})) for step in (5, 6)]
    losses += [event(5, "skip"), event(6, "skip")]
    assert plain_lines(losses) == [
        "2 steps skipped: the loss was inf/NaN at steps 5, 6 (training_step raised ValueError on 1 of them, answered "
        "as inf/NaN losses)"
    ]
    assert plain_lines([event(5, "nonfinite", where="loss"), event(5, "skip")]) == [
        "1 step skipped: the loss was inf/NaN at step 5"  # nothing raised: the line as before
    ]


@pytest.mark.parametrize(
    ("module", "outside", "named"),
    [(None, "loss_fn", "loss_fn"), (None, "training_step", "training_step"), ("", "training_step", "the root module"),
     ("blocks.0.attn", "training_step", "blocks.0.attn")],
)
def test_the_summary_names_where_a_value_first_went_non_finite_as_the_diagnosis_does(
    module: str | None, outside: str, named: str
) -> None:
    """Outside every module: the code that computed the loss (a plain loop's ``loss_fn`` under ``Guard.train_step``,
    not ``training_step``); ``""``: the root module."""
    origin = {"direction": "forward", "op": "mul", "module": module, "outside": outside}
    details = {"where": "loss", "diagnosis": {"verdict": "persistent", "origin": origin}}
    found = {"step": 5, "kind": "nonfinite", "epoch": 0, "source": "x", "message": "", "details": details}
    skip = {"step": 5, "kind": "skip", "epoch": 0, "source": "x", "message": "", "details": {}}
    assert plain_lines([found, skip]) == [
        "1 step skipped: the loss was inf/NaN at step 5 (reproduced on replay: the data or the model; first in "
        f"{named} (mul, forward pass))"
    ]


def test_a_run_that_does_not_learn_and_ties_its_trial_is_not_called_a_false_alarm() -> None:
    def trial(step: int, signal: str) -> dict[str, Any]:
        return {"step": step, "kind": "trial", "epoch": 0, "source": "x", "message": "", "details": {
            "signal": signal, "opened_at": step - 40, "kept": False, "false_alarm": True, "extra_steps": 80,
            "comparisons": []}}  # fmt: skip

    assert plain_lines([trial(161, "no_progress"), trial(300, "loss_trend")]) == [
        "2 suspicions tried against doing nothing on the same unseen batches (the loss stalled short of half its "
        "start; the loss kept rising): 1 where a lower learning rate did no better (the run went on untouched), 1 "
        "false alarm (the run went on untouched); the trials cost 160 extra steps of compute"
    ]


def test_plain_lines_name_who_started_afresh_and_what_a_warning_only_detector_found() -> None:
    def event(step: int, kind: str, source: str, **details: Any) -> dict[str, Any]:
        return {"step": step, "kind": kind, "epoch": 0, "source": source, "message": "", "details": details}

    events = [
        event(3, "data_fault", "NonFiniteDetector", batch=3, rows=[1], data="batch 3 holds NaN in row 1"),
        event(40, "rebaseline", "LossSpikeDetector", what="loss"),
        event(41, "rebaseline", "AutoClip", what="grad_norm"),
        event(60, "clip", "AutoClip", mode="agc", grad_norm=5.0, threshold=0.01),
    ]
    assert plain_lines(events) == [
        "Batch 3 of epoch 0 (step 3) holds NaN in row 1 (the step went ahead): a data fault; check the data",
        "AutoClip started its gradient-norm statistics afresh once (step 41): the gradient norm moved to a new level "
        "and stayed there",
        "LossSpikeDetector started its loss statistics afresh once (step 40): the loss moved to a new level and "
        "stayed there",
        "1 step clipped by AutoClip at step 60 (the gradient norm an outlier)",
    ]


def test_the_journal_command_lists_a_recorded_run(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    fit(CorruptRow(), [NonFiniteDetector()], max_epochs=2, max_steps=-1, logger=CSVLogger(tmp_path, name="runs"))
    capsys.readouterr()
    assert main(["journal", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    events = list(read_journal(tmp_path))
    journal = tmp_path / "runs" / "version_0" / "overflow_events.jsonl"
    assert out == [
        f"{journal}:",
        f"fit {events[0]['run']}: 4 events, steps 2-10",
        "  in plain words:",
        "    - 2 steps skipped: batch 2 of each epoch holds NaN in row 3 (epochs 0-1): a data fault; check the data",
        "  events, grouped:",
        "    data_fault (NonFiniteDetector), 2 times, at steps 2, 10",
        f"      try: {events[0]['details']['diagnosis']['hint']}",
        f"      {events[0]['message']}",
        "      (the other 1 differ only in their numbers)",
        "    skip (NonFiniteDetector), 2 times, at steps 2, 10",
        "      skipped optimizer step 2: non-finite loss (a data fault)",
        "      (the other 1 differ only in their numbers)",
    ]
    assert main(["journal", str(tmp_path), "--json"]) == 0
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == events


def test_the_journal_command_refuses_a_folder_without_one(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["journal", str(tmp_path)])
    assert caught.value.code == 2
    assert capsys.readouterr().err == (
        f"lightning-overflow journal: error: argument RUN_DIR: no journal (overflow_events.jsonl) at or under "
        f"'{tmp_path}'\n"
    )


def test_read_journal_takes_the_run_folder_and_names_several(tmp_path: Path) -> None:
    for version in (0, 1):
        fit(CorruptRow(), [NonFiniteDetector()], max_epochs=1, max_steps=-1, logger=CSVLogger(tmp_path, name="runs"))
    assert [e["kind"] for e in read_journal(tmp_path / "runs" / "version_1")] == ["data_fault", "skip"]
    with pytest.raises(ValueError, match=r"holds 2 journals \(.*version_0.*version_1.*\): pass the one to read"):
        list(read_journal(tmp_path))
    with pytest.raises(FileNotFoundError, match="no journal"):
        list(read_journal(tmp_path / "elsewhere"))


def test_clips_too_shallow_to_journal_one_by_one_are_still_told() -> None:
    clips = {"step": 200, "kind": "clips", "epoch": 0, "source": "AutoClip", "message": "",
             "details": {"clipped": 5, "steps": 200, "smallest_coef": 0.31, "mode": "zscore"}}  # fmt: skip
    assert plain_lines([clips]) == [
        "5 steps clipped by AutoClip (the gradient norm above its threshold; the deepest clip scaled the gradients by "
        "0.31)"
    ]
    deep = {"step": 60, "kind": "clip", "epoch": 0, "source": "AutoClip", "message": "",
            "details": {"mode": "zscore", "grad_norm": 50.0, "threshold": 5.0, "coef": 0.1, "not_journaled": 0}}  # fmt: skip
    assert plain_lines([deep, clips]) == [
        "5 steps clipped by AutoClip, the deepest at step 60 (the gradient norm an outlier, up to 10x its clip threshold)"
    ]


def test_the_learning_rate_line_ends_where_the_rate_ended() -> None:
    def change(step: int, kind: str, scale: float, lr: float) -> dict[str, Any]:
        return {"step": step, "kind": kind, "epoch": 0, "source": "LRBackoff", "message": "",
                "details": {"optimizer": 0, "scale": scale, "lrs": [lr], "reason": "nonfinite_persistent"}}  # fmt: skip

    # As journaled: a backoff after an undo (the summary used to take the undo, grouped last, for the ending).
    events = [change(3, "backoff", 0.5, 0.2), change(12, "backoff", 0.25, 0.1), change(13, "undo", 1.0, 0.4),
              change(16, "backoff", 0.5, 0.2)]  # fmt: skip
    assert plain_lines(events) == [
        "learning rate backed off 3 times (steps 3, 12, 16), taken back once; it ends at 0.5x its schedule (0.2 at "
        "step 16): consider starting at 0.5x the learning rate"
    ]


class OwnBackward(TinyRegressor):
    """Manual optimization whose backward is its own (``loss.backward()``, as a Pyro plan's SVI step runs it): no
    loss passes through ``on_before_backward``."""

    def __init__(self) -> None:
        super().__init__(optimizer="sgd")
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        x, y = batch
        torch.nn.functional.mse_loss(self(x), y).backward()
        optimizer.step()


def test_a_fit_whose_losses_the_suite_never_sees_is_not_said_to_end_on_inf_nan(caplog: pytest.LogCaptureFixture,
                                                                               tmp_path: Path) -> None:  # fmt: skip
    """No loss seen is no inf/NaN loss: the healthy fit says nothing (it read 'the training loss was inf/NaN on each
    of the fit's last 75 steps' on scvi-tools' AmortizedLDA)."""
    with caplog.at_level(logging.INFO, logger=SUMMARY_LOGGER):
        fit(OwnBackward(), [NonFiniteDetector()], max_steps=80, default_root_dir=tmp_path)
    assert not [r for r in caplog.records if r.name == SUMMARY_LOGGER]
    assert not (tmp_path / "overflow_events.jsonl").exists()  # nothing journaled


# ---- a start out of scale --------------------------------------------------------------------------------------------
def _started(norms: list[float], first_step: int = 0, losses: list[float] | None = None) -> LossEnding:
    ending = LossEnding()
    for i, norm in enumerate(norms):
        ending.add(first_step + i, 1.0 if losses is None else losses[i], norm=norm)
    return ending


def test_a_first_gradient_norm_100x_the_next_ones_is_an_ending_fact_and_less_is_none() -> None:
    after = [1.0, 2.0, 3.0] * 8  # median 2.0 over 24 steps
    assert _started([200.0, *after]).start_out_of_scale() == {
        "start_norm": 200.0, "typical_norm": 2.0, "norm_steps": 24, "scale_ratio": 100.0}  # fmt: skip
    assert _started([200.0, *after]).event_details() is None  # told only where no other ending is
    assert _started([199.0, *after]).start_out_of_scale() is None
    assert _started([1e4, *after[:9]]).start_out_of_scale() is None  # too few steps after it to know a normal one
    assert _started([1e4, *after], first_step=100).start_out_of_scale() is None  # a resumed fit: no start of its own
    assert _started([1e4, math.inf, *after]).start_out_of_scale()["norm_steps"] == 23  # an overflow not counted
    solved = [10.0] + [0.99] * 24  # the loss came down with the gradients: a problem solved in its first step
    assert _started([200.0, *after], losses=solved).start_out_of_scale() is None
    assert _started([200.0, *after], losses=[10.0] + [1.0] * 24).start_out_of_scale() is not None  # a tenth kept
    assert ending_words(_started([200.0, *after]).start_out_of_scale()) == (
        "the fit's first step had a gradient norm of 200, 100x the median of the 24 steps after it (2): the model "
        "was drawn out of scale (a recurrent matrix, or layers, drawn too large), or its first updates grew the "
        "weights of normalised layers, whose gradients shrink as they grow (a learning rate too high)"
    )


def test_a_closure_evaluated_several_times_a_step_gives_the_start_one_norm_a_step() -> None:
    """LBFGS evaluates its closure up to ``max_iter`` times a step: only each step's first evaluation counts, so the
    first norm is not measured against the norms the line search reaches within the same step."""
    ending = LossEnding()
    for step in range(25):
        for evaluation in range(20):
            ending.add(step, 1.0, norm=(400.0 if step == 0 else 2.0) / (evaluation + 1) ** 3)
    assert len(ending.start_norms) == 25
    assert ending.start_out_of_scale()["scale_ratio"] == 200.0


def test_a_loss_far_above_its_best_is_told_before_a_start_out_of_scale() -> None:
    ending = _started([1e4] + [1.0] * 24)
    for step in range(25, 25 + 3 * ENDING_BLOCK):
        ending.add(step, 1.0 if step < 25 + 2 * ENDING_BLOCK else 50.0)
    assert ending.event_details()["against"] == "best"


def test_nan_in_an_earlier_micro_batch_says_nothing_of_batches_of_huge_values_unseen() -> None:
    def event(step: int, kind: str, **details: Any) -> dict[str, Any]:
        return {"step": step, "kind": kind, "epoch": 0, "source": "x", "message": "", "details": details}

    data = "batch 20 holds inf/NaN or values beyond 1e15 (a micro-batch accumulated into the step before its last)"
    events = [event(10, "data_fault", batch=20, rows=[], data=data), event(10, "skip")]
    assert plain_lines(events) == [
        "1 step skipped: batch 20 of epoch 0 (step 10) holds inf/NaN or values beyond 1e15 (a micro-batch accumulated "
        "into the step before its last): a data fault; check the data"
    ]
