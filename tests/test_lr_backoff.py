"""LRBackoff: the backoff sticks under every scheduler, counts a burst once, stops at its floor, grows back,
survives resume and rollback, and happens at the same step on every rank."""

from __future__ import annotations

import copy
import csv
import io
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import assert_bit_identical, fit, make_trainer, weights
from ddp_utils import run_ddp
from pytorch_lightning.callbacks import LearningRateMonitor
from pytorch_lightning.loggers import CSVLogger
from test_trials import Suspect
from torch.optim import lr_scheduler as sched

from lightning_overflow import DivergenceError, NonFiniteDetector, Rollback, TrialConfig, default_callbacks
from lightning_overflow.callbacks.loss_spike_detector import LossSpikeDetector
from lightning_overflow.callbacks.lr_backoff import DEFAULT_TRIGGERS, LRBackoff
from lightning_overflow.events import read_journal
from lightning_overflow.health import board_for
from lightning_overflow.testing import Fault, FaultInjector, TinyGAN, TinyRegressor

STEPS = 40
SPIKE_AT = 20


# The mechanics below are driven by single spikes and bursts, which the default ladder deliberately ignores.
SPIKES_AND_BURSTS = ("nonfinite_burst", "nonfinite_state", "scaler_collapse", "loss_spike", "grad_spike")


def backoff_on_spikes(**kwargs: Any) -> LRBackoff:
    """LRBackoff acting at once on spikes and bursts, its regrowth blind: the mechanics of the rate itself (trials of
    a suspicion or of a regrowth are tested in test_trials.py)."""
    return LRBackoff(triggers=SPIKES_AND_BURSTS, **{"trial": None, **kwargs})


class LRRecorder(pl.Callback):
    """The learning rate of every optimizer at the start of each batch (the rate that batch trains with)."""

    def __init__(self) -> None:
        self.lrs: list[list[float]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        self.lrs.append([float(o.param_groups[0]["lr"]) for o in trainer.optimizers])


class FlatMetricRegressor(TinyRegressor):
    """Logs a constant for ReduceLROnPlateau to monitor: its reductions then fall on fixed steps in every run."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.log("flat", 1.0)
        return super().training_step(batch, batch_idx)


def _plateau(o: torch.optim.Optimizer) -> dict[str, Any]:
    scheduler = sched.ReduceLROnPlateau(o, factor=0.5, patience=7, min_lr=1e-3)  # reduces at 8, 16, 24, 32
    return {"scheduler": scheduler, "interval": "step", "monitor": "flat"}


def _restarts(o: torch.optim.Optimizer) -> Any:
    return sched.CosineAnnealingWarmRestarts(o, T_0=7, T_mult=2, eta_min=1e-4)


SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any] | None] = {
    "none": None,
    "LambdaLR": lambda o: sched.LambdaLR(o, lambda s: 1.0 / (1.0 + 0.05 * s)),
    "StepLR": lambda o: sched.StepLR(o, step_size=7, gamma=0.7),
    "MultiStepLR": lambda o: sched.MultiStepLR(o, milestones=[10, 25, 35], gamma=0.5),
    "ExponentialLR": lambda o: sched.ExponentialLR(o, gamma=0.98),
    "LinearLR": lambda o: sched.LinearLR(o, start_factor=0.1, total_iters=30),
    "CosineAnnealingLR": lambda o: sched.CosineAnnealingLR(o, T_max=25, eta_min=1e-4),  # runs past T_max
    "CosineAnnealingWarmRestarts": _restarts,
    "OneCycleLR": lambda o: sched.OneCycleLR(o, max_lr=0.02, total_steps=STEPS + 1),
    "CyclicLR": lambda o: sched.CyclicLR(o, 1e-3, 0.02, step_size_up=6, mode="triangular2", cycle_momentum=False),
    "SequentialLR": lambda o: sched.SequentialLR(
        o, [sched.LinearLR(o, 0.1, total_iters=10), sched.CosineAnnealingLR(o, T_max=20)], milestones=[30]
    ),
    "ChainedScheduler": lambda o: sched.ChainedScheduler([sched.ExponentialLR(o, 0.99), _restarts(o)], optimizer=o),
    "ReduceLROnPlateau": _plateau,
}


def _spike_run(tmp_path: Path, name: str, backoff: LRBackoff | None) -> LRRecorder:
    recorder = LRRecorder()
    callbacks: list[Any] = [
        LossSpikeDetector(warmup=10),
        FaultInjector(Fault(step=SPIKE_AT, kind="loss_spike", factor=1e3)),
        recorder,
    ]
    if backoff is not None:
        callbacks.insert(0, backoff)
    model = FlatMetricRegressor(scheduler=SCHEDULERS[name])
    make_trainer(callbacks, max_steps=STEPS, default_root_dir=str(tmp_path)).fit(model)
    return recorder


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_after_a_backoff_every_later_lr_is_factor_times_the_unprotected_runs(tmp_path: Path, name: str) -> None:
    backoff = backoff_on_spikes(factor=0.5, cooldown=STEPS, regrow_after=None)
    reference = _spike_run(tmp_path, name, None).lrs
    backed_off = _spike_run(tmp_path, name, backoff).lrs
    assert [(h["step"], h["action"]) for h in backoff.history] == [(SPIKE_AT, "backoff")]
    assert backed_off[: SPIKE_AT + 1] == reference[: SPIKE_AT + 1]
    for step in range(SPIKE_AT + 1, STEPS):
        assert backed_off[step][0] == pytest.approx(0.5 * reference[step][0], rel=1e-6, abs=0.0), f"step {step}"
    if name != "none":  # the schedule moves after the backoff: the scale had to survive it
        assert len({lr[0] for lr in reference[SPIKE_AT + 1 :]}) > 1


def test_an_isolated_nonfinite_step_does_not_back_off(tmp_path: Path) -> None:
    def run(backoff: LRBackoff | None) -> LRRecorder:
        recorder = LRRecorder()
        callbacks = [NonFiniteDetector(), FaultInjector(Fault(step=20, kind="nan_loss")), recorder]
        model = TinyRegressor(scheduler=SCHEDULERS["LambdaLR"])
        make_trainer(callbacks + ([backoff] if backoff else []), max_steps=40, default_root_dir=str(tmp_path)).fit(
            model
        )
        return recorder

    backoff = backoff_on_spikes()
    assert run(backoff).lrs == run(None).lrs
    assert backoff.scales == [1.0] and backoff.history == []


def test_a_burst_of_nonfinite_steps_backs_off_once(tmp_path: Path) -> None:
    burst = [Fault(step=s, kind="nan_loss") for s in (20, 21, 22, 23, 24)]

    def run(backoff: LRBackoff | None) -> LRRecorder:
        recorder = LRRecorder()
        callbacks = [NonFiniteDetector(), FaultInjector(*burst), recorder] + ([backoff] if backoff else [])
        model = TinyRegressor(scheduler=SCHEDULERS["ExponentialLR"])
        make_trainer(callbacks, max_steps=40, default_root_dir=str(tmp_path)).fit(model)
        return recorder

    backoff = backoff_on_spikes()
    reference, backed_off = run(None).lrs, run(backoff).lrs
    # bursts are signalled at steps 22, 23 and 24 (3 within 50 steps): one burst, one backoff
    assert [(h["step"], h["action"], h["kinds"]) for h in backoff.history] == [(22, "backoff", "nonfinite_burst")]
    assert backed_off[:23] == reference[:23]
    assert all(b[0] == pytest.approx(0.5 * r[0], rel=1e-6) for b, r in zip(backed_off[23:], reference[23:]))
    (event,) = [e for e in read_journal(tmp_path / "overflow_events.jsonl") if e["kind"] == "backoff"]
    rate = event["details"]["lrs"][0]  # the number in the journal, to 4 digits in the message
    assert rate != float(f"{rate:.4g}") and f"(was 1 x; group LRs [{rate:.4g}])" in event["message"]


@pytest.mark.parametrize(("second", "expected"), [(25, [0.5]), (31, [0.5, 0.25])])
def test_cooldown_counts_one_burst_once(tmp_path: Path, second: int, expected: list[float]) -> None:
    backoff = backoff_on_spikes(cooldown=10, regrow_after=None)
    faults = FaultInjector(Fault(SPIKE_AT, "loss_spike"), Fault(second, "loss_spike"))
    make_trainer(
        [backoff, LossSpikeDetector(warmup=10, check_grad_norm=False), faults],
        max_steps=35,
        default_root_dir=str(tmp_path),
    ).fit(TinyRegressor())
    assert [h["scale"] for h in backoff.history] == expected
    assert backoff.scales == [expected[-1]]


def test_reaching_min_scale_with_divergence_continuing_raises_with_the_history(tmp_path: Path) -> None:
    backoff = backoff_on_spikes(min_scale=0.25, cooldown=0)
    faults = FaultInjector(*(Fault(s, "loss_spike") for s in (20, 22, 24)))
    trainer = make_trainer(
        [LossSpikeDetector(warmup=10, check_grad_norm=False), backoff, faults],
        max_steps=30,
        default_root_dir=str(tmp_path),
    )
    with pytest.raises(DivergenceError) as info:
        trainer.fit(TinyRegressor())
    error = info.value
    assert error.step == 24
    assert [(h["step"], h["action"], h["kinds"], h["scale"]) for h in error.history] == [
        (20, "backoff", "loss_spike", 0.5),
        (22, "backoff", "loss_spike", 0.25),
        (24, "abort", "loss_spike", 0.25),
    ]
    message = str(error)
    assert message.startswith(
        "LRBackoff: loss_spike at step 24 on rank 0 (every rank stops together) while the learning rate of optimizer "
        "0 was already"
    )
    assert "at its floor (0.25 x its schedule; min_scale=0.25)" in message
    assert "Backoffs so far: step 20 (loss_spike) -> 0.5; step 22 (loss_spike) -> 0.25." in message
    assert "HINT: lower the configured learning rate" in message
    assert "LossSpikeDetector: the training loss was" in message  # the cause, as the detector said it
    journal = [e["kind"] for e in read_journal(tmp_path / "overflow_events.jsonl")]
    assert journal.count("backoff") == 2 and journal.count("abort") == 1


def test_regrowth_returns_exactly_to_the_configured_schedule(tmp_path: Path) -> None:
    def run(backoff: LRBackoff | None) -> LRRecorder:
        recorder = LRRecorder()
        callbacks: list[Any] = [
            LossSpikeDetector(warmup=10, check_grad_norm=False),
            FaultInjector(Fault(SPIKE_AT, "loss_spike")),
            recorder,
        ]
        model = TinyRegressor(scheduler=SCHEDULERS["CyclicLR"])
        make_trainer(callbacks + ([backoff] if backoff else []), max_steps=45, default_root_dir=str(tmp_path)).fit(
            model
        )
        return recorder

    backoff = backoff_on_spikes(regrow_after=10)
    reference, backed_off = run(None).lrs, run(backoff).lrs
    assert [(h["step"], h["action"], h["scale"]) for h in backoff.history] == [
        (20, "backoff", 0.5),
        (31, "regrowth", 1.0),
    ]
    for step in range(21, 31):
        assert backed_off[step][0] == pytest.approx(0.5 * reference[step][0], rel=1e-6)
    assert backed_off[31:] == reference[31:]  # 0.5 then 2.0: exactly the configured schedule again, never above
    assert backoff.scales == [1.0]


@pytest.mark.parametrize(("second", "window"), [(33, 20), (43, 10)])
def test_the_growth_window_lengthens_after_a_backoff_soon_after_a_regrowth(
    tmp_path: Path, second: int, window: int
) -> None:
    backoff = backoff_on_spikes(regrow_after=10)  # the window doubles (WINDOW_GROWTH)
    faults = FaultInjector(Fault(SPIKE_AT, "loss_spike"), Fault(second, "loss_spike"))
    make_trainer(
        [LossSpikeDetector(warmup=10, check_grad_norm=False), backoff, faults],
        max_steps=56,
        default_root_dir=str(tmp_path),
    ).fit(TinyRegressor())
    regrown = second + 1 + window
    assert [(h["step"], h["action"]) for h in backoff.history] == [
        (20, "backoff"),
        (31, "regrowth"),
        (second, "backoff"),
        (regrown, "regrowth"),
    ]
    assert backoff.state_dict()["windows"] == [window]
    events = [e for e in read_journal(tmp_path / "overflow_events.jsonl") if e["kind"] == "regrowth"]
    assert [e["step"] for e in events] == [31, regrown]
    assert f"{window} stable steps up to step {regrown}" in events[1]["message"]


def test_gan_optimizers_back_off_on_their_own(tmp_path: Path) -> None:
    """TinyGAN steps the discriminator (optimizer 0) at even global steps and the generator at odd ones: the
    generator's spike backs off the generator's rate only."""
    scales = [1.0, 0.5]
    backoff = backoff_on_spikes(regrow_after=None)
    recorder = LRRecorder()
    faults = FaultInjector(Fault(step=41, kind="loss_spike"))
    callbacks = [LossSpikeDetector(warmup=10, check_grad_norm=False), backoff, faults, recorder]
    make_trainer(callbacks, max_steps=50, default_root_dir=str(tmp_path)).fit(TinyGAN(lr_g=2e-3, lr_d=1e-3))
    assert backoff.scales == scales
    assert recorder.lrs[-1] == [1e-3 * scales[0], 2e-3 * scales[1]]
    assert backoff._counters() == {"overflow/lr_scale_opt0": scales[0], "overflow/lr_scale_opt1": scales[1]}
    assert {h["step"] for h in backoff.history} == {41}


def test_lr_monitor_and_the_lr_scale_key_show_the_backoff(tmp_path: Path) -> None:
    logger = CSVLogger(str(tmp_path))
    callbacks = [
        backoff_on_spikes(regrow_after=None),
        LossSpikeDetector(warmup=10),
        FaultInjector(Fault(SPIKE_AT, "loss_spike")),
        LearningRateMonitor(logging_interval="step"),
    ]
    make_trainer(callbacks, logger=logger, log_every_n_steps=1, max_steps=25).fit(TinyRegressor())
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    lr = {int(r["step"]): float(r["lr-Adam"]) for r in rows if r.get("lr-Adam")}
    scale = {int(r["step"]): float(r["overflow/lr_scale"]) for r in rows if r.get("overflow/lr_scale")}
    assert lr[SPIKE_AT] == 0.01 and lr[SPIKE_AT + 1] == 0.005 and lr[24] == 0.005
    assert scale[SPIKE_AT - 1] == 1.0 and scale[SPIKE_AT] == 0.5 and scale[24] == 0.5
    (event,) = [e for e in read_journal(Path(logger.log_dir) / "overflow_events.jsonl") if e["kind"] == "backoff"]
    assert event["step"] == SPIKE_AT and event["details"]["scale"] == 0.5 and event["details"]["lrs"] == [0.005]
    assert event["message"].startswith("LRBackoff: loss_spike, grad_spike at step 20: the learning rate of optimizer 0")


def test_a_resumed_run_continues_with_the_same_scale_and_nothing_applied_twice(tmp_path: Path) -> None:
    def callbacks(recorder: LRRecorder, backoff: LRBackoff) -> list[Any]:
        faults = FaultInjector(Fault(SPIKE_AT, "loss_spike"))
        return [LossSpikeDetector(warmup=10), backoff, faults, recorder]

    def model() -> TinyRegressor:
        return TinyRegressor(scheduler=SCHEDULERS["LambdaLR"])

    whole = LRRecorder()
    make_trainer(callbacks(whole, backoff_on_spikes()), max_steps=48, default_root_dir=str(tmp_path / "a")).fit(model())

    first = backoff_on_spikes()
    trainer = make_trainer(callbacks(LRRecorder(), first), max_steps=32, default_root_dir=str(tmp_path / "b"))
    trainer.fit(model())
    ckpt = tmp_path / "b" / "stop.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=True)
    assert saved["callbacks"][first.state_key]["scales"] == [0.5]

    resumed, tail = backoff_on_spikes(), LRRecorder()
    make_trainer(callbacks(tail, resumed), max_steps=48, default_root_dir=str(tmp_path / "b")).fit(
        model(), ckpt_path=str(ckpt)
    )
    assert resumed.scales == [0.5] and resumed.history == first.history
    assert tail.lrs == whole.lrs[32:]


class FakeRollback(pl.Callback):
    """Does what Rollback does to the optimizer and scheduler: snapshot them (with the suite's extras) after batch
    ``snapshot_at``, restore them on a loss spike, then tell the suite."""

    def __init__(self, snapshot_at: int) -> None:
        self.snapshot_at = snapshot_at
        self.snapshot: tuple[Any, Any, Any] | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        board = board_for(trainer)
        optimizer, scheduler = trainer.optimizers[0], trainer.lr_scheduler_configs[0].scheduler
        if trainer.global_step == self.snapshot_at + 1:
            self.snapshot = copy.deepcopy(
                (optimizer.state_dict(), scheduler.state_dict(), board.snapshot_extras(trainer))
            )
        if self.snapshot is not None and any(s.kind == "loss_spike" for s in board.signals):
            state, scheduler_state, extras = copy.deepcopy(self.snapshot)
            optimizer.load_state_dict(state)
            scheduler.load_state_dict(scheduler_state)
            board.after_restore(trainer, extras)


@pytest.mark.parametrize("backoff_first", [True, False])
def test_a_rollback_never_undoes_a_backoff_in_either_order(tmp_path: Path, backoff_first: bool) -> None:
    def run(callbacks: list[Any]) -> LRRecorder:
        recorder = LRRecorder()
        spike = [LossSpikeDetector(warmup=10, check_grad_norm=False), FaultInjector(Fault(SPIKE_AT, "loss_spike"))]
        model = TinyRegressor(scheduler=SCHEDULERS["LambdaLR"])
        make_trainer([*spike, *callbacks, recorder], max_steps=30, default_root_dir=str(tmp_path)).fit(model)
        return recorder

    reference = run([]).lrs
    backoff, rollback = backoff_on_spikes(regrow_after=None), FakeRollback(snapshot_at=10)
    rolled_back = run([backoff, rollback] if backoff_first else [rollback, backoff]).lrs
    assert backoff.scales == [0.5]
    assert rolled_back[: SPIKE_AT + 1] == reference[: SPIKE_AT + 1]
    # the schedule went back to where it stood after step 10, and goes on from there at half the rate
    for step in range(SPIKE_AT + 1, 30):
        assert rolled_back[step][0] == pytest.approx(0.5 * reference[step - 10][0], rel=1e-6), f"step {step}"


def test_a_restore_ends_the_cooldown_so_a_new_divergence_backs_off_further(tmp_path: Path) -> None:
    backoff = backoff_on_spikes(cooldown=10, regrow_after=None)
    faults = FaultInjector(Fault(SPIKE_AT, "loss_spike"), Fault(SPIKE_AT + 5, "loss_spike"))  # within the cooldown
    make_trainer(
        [LossSpikeDetector(warmup=10, check_grad_norm=False), backoff, FakeRollback(snapshot_at=10), faults],
        max_steps=30,
        default_root_dir=str(tmp_path),
    ).fit(TinyRegressor(scheduler=SCHEDULERS["LambdaLR"]))
    # Without the restore the second spike is part of the first one's burst (test_cooldown_counts_one_burst_once).
    assert [(h["step"], h["scale"]) for h in backoff.history] == [(SPIKE_AT, 0.5), (SPIKE_AT + 5, 0.25)]
    assert backoff.scales == [0.25]


def test_after_restore_without_extras_assumes_the_configured_schedule(tmp_path: Path) -> None:
    backoff = backoff_on_spikes(regrow_after=None)
    trainer = make_trainer(
        [LossSpikeDetector(warmup=10, check_grad_norm=False), backoff, FaultInjector(Fault(SPIKE_AT, "loss_spike"))],
        max_steps=22,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(TinyRegressor())
    optimizer = trainer.optimizers[0]
    optimizer.param_groups[0]["lr"] = 0.01  # as a restored state from before the backoff would hold
    backoff._after_restore(trainer, {})
    assert optimizer.param_groups[0]["lr"] == 0.005
    assert backoff._snapshot_extra() == {"scales": [0.5]}


def test_a_healthy_run_is_bit_identical_with_and_without_the_suite(tmp_path: Path) -> None:
    pl.seed_everything(0)
    plain = TinyRegressor(scheduler=SCHEDULERS["OneCycleLR"])
    make_trainer(max_steps=STEPS, default_root_dir=str(tmp_path)).fit(plain)
    pl.seed_everything(0)
    guarded = TinyRegressor(scheduler=SCHEDULERS["OneCycleLR"])
    backoff = backoff_on_spikes()
    suite = [NonFiniteDetector(), LossSpikeDetector(warmup=10), backoff]
    make_trainer(suite, max_steps=STEPS, default_root_dir=str(tmp_path)).fit(guarded)
    assert_bit_identical(weights(plain), weights(guarded))
    assert backoff.history == [] and backoff.scales == [1.0]


class ConstantLossRegressor(TinyRegressor):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        return 0.0 * self(x).sum() + 0.693  # a constant loss, zero gradients


def test_a_constant_loss_run_never_backs_off(tmp_path: Path) -> None:
    detector, backoff = LossSpikeDetector(), backoff_on_spikes()
    make_trainer([NonFiniteDetector(), detector, backoff], max_steps=80, default_root_dir=str(tmp_path)).fit(
        ConstantLossRegressor()
    )
    assert list(detector._stats[0].count) == [80.0, 80.0]  # tested from step 50 on, after the warm-up
    assert detector.spikes == 0 and backoff.history == [] and backoff.scales == [1.0]


def test_state_round_trips_through_torch_load_weights_only(tmp_path: Path) -> None:
    backoff = backoff_on_spikes(regrow_after=50)
    make_trainer(
        [LossSpikeDetector(warmup=10), backoff, FaultInjector(Fault(SPIKE_AT, "loss_spike"))],
        max_steps=25,
        default_root_dir=str(tmp_path),
    ).fit(TinyRegressor())
    buffer = io.BytesIO()
    torch.save(backoff.state_dict(), buffer)
    buffer.seek(0)
    restored = backoff_on_spikes(regrow_after=50)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert restored.state_dict() == backoff.state_dict()
    assert restored.state_dict() == {
        "scales": [0.5],
        "cooldown_until": [30],
        "stable_since": [21],
        "windows": [50],
        "last_regrowth": [-1],
        "history": backoff.history,
        "trial": None,  # no trial under way (and none carried once the fit's board is released)
        "version": 2,
    }


@pytest.mark.ddp
@pytest.mark.timeout(180)
def test_a_spike_on_rank_0_only_backs_off_both_ranks_at_the_same_step(tmp_path: Path) -> None:
    callbacks = [
        LossSpikeDetector(warmup=10),
        backoff_on_spikes(regrow_after=None),
        FaultInjector(Fault(step=SPIKE_AT, kind="loss_spike", rank=0)),
    ]
    reports = run_ddp(TinyRegressor(), callbacks, tmp_path, max_steps=30)
    assert [r["error"] for r in reports] == [None, None]
    assert reports[0]["lrs"] == reports[1]["lrs"] == [0.01] * (SPIKE_AT + 1) + [0.005] * (30 - SPIKE_AT - 1)
    assert reports[0]["states"] == reports[1]["states"]
    assert reports[0]["digest"] == reports[1]["digest"]
    backoffs = [e for e in read_journal(tmp_path / "overflow_events.jsonl") if e["kind"] == "backoff"]
    assert [e["step"] for e in backoffs] == [SPIKE_AT]  # rank 0 writes the journal, once


@pytest.mark.slow
def test_a_run_10x_above_its_stable_lr_completes_near_the_stable_runs_loss(tmp_path: Path) -> None:
    """SGD at 0.2 where 0.02 trains (with a 100-step warm-up): diverges to NaN unprotected; with the suite at its
    defaults the LR is backed off as the loss takes off, and the run ends close to the stable run."""

    def run(lr: float, callbacks: list[Any]) -> float:
        pl.seed_everything(0)
        model = TinyRegressor(optimizer="sgd", lr=lr, scheduler=lambda o: sched.LinearLR(o, 0.05, total_iters=100))
        make_trainer(callbacks, max_steps=400, default_root_dir=str(tmp_path)).fit(model)
        x, y = model.data.tensors
        with torch.no_grad():
            return torch.nn.functional.mse_loss(model(x), y).item()

    stable = run(0.02, [])
    assert math.isnan(run(0.2, []))
    backoff = backoff_on_spikes()
    protected = run(0.2, [NonFiniteDetector(), LossSpikeDetector(), backoff])
    assert backoff.history and all(h["action"] == "backoff" for h in backoff.history)
    assert protected < 1.5 * stable, (protected, stable)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"factor": 1.5}, ValueError, "'factor' must be in (0, 1) (got 1.5)"),
        ({"factor": 0}, ValueError, "'factor' must be in (0, 1) (got 0)"),
        ({"cooldown": -1}, ValueError, "'cooldown' must be >= 0 (got -1)"),
        ({"min_scale": 0.0}, ValueError, "'min_scale' must be in (0, 1] (got 0)"),
        ({"regrow_after": 0}, ValueError, "'regrow_after' must be >= 1 (got 0)"),
        (
            {"triggers": ("loss_spike", "typo")},
            ValueError,
            (
                "'triggers' must be one of 'nonfinite', 'nonfinite_burst', 'nonfinite_persistent', 'nonfinite_state', "
                "'scaler_collapse', 'loss_spike', 'grad_spike', 'loss_divergence', 'loss_trend', "
                "'no_progress', 'weight_growth', "
                "'replica_mismatch' (got 'typo')"
            ),
        ),
    ],
)
def test_arguments_are_checked(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error) as info:
        LRBackoff(**kwargs)
    assert str(info.value) == message


def test_default_triggers_leave_out_the_isolated_nonfinite_step() -> None:
    assert LRBackoff().triggers == DEFAULT_TRIGGERS
    assert "nonfinite" not in DEFAULT_TRIGGERS
    assert LRBackoff(triggers=["nonfinite", "nonfinite"]).triggers == ("nonfinite",)
    assert LRBackoff().state_key == "LRBackoff{'factor': 0.5, 'per_optimizer': True}"


# ---- rates written by the module's own code --------------------------------------------------------------------
WARMUP_LR = 0.05


def warmup_rate(step: int) -> float:
    return min(1.0, (step + 1) / 500.0) * WARMUP_LR


class PostStepWarmup(TinyRegressor):
    """Lightning's documented manual warm-up: the rate written into the param groups after each optimizer step."""

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        optimizer.step(closure=optimizer_closure)
        for group in optimizer.param_groups:
            group["lr"] = warmup_rate(self.trainer.global_step)


class PreStepWarmup(TinyRegressor):
    """The same rate written before the step, from the module's own hook."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        for group in self.trainer.optimizers[0].param_groups:
            group["lr"] = warmup_rate(self.trainer.global_step)


class UpdateLR(pl.Callback):
    """The rate each optimizer step updates with (read after the suite's hook, where the update reads it)."""

    def __init__(self) -> None:
        self.lrs: dict[int, float] = {}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.lrs[trainer.global_step] = float(optimizer.param_groups[0]["lr"])


@pytest.mark.parametrize("model_class", [PostStepWarmup, PreStepWarmup])
def test_a_rate_the_module_writes_itself_is_held_at_factor_times_it(model_class: type, tmp_path: Path) -> None:
    burst = FaultInjector(*(Fault(step=s, kind="nan_loss") for s in (20, 21, 22)))
    seen = UpdateLR()
    backoff = backoff_on_spikes()
    model = model_class(lr=WARMUP_LR)
    make_trainer([NonFiniteDetector(), burst, backoff, seen], max_steps=40, default_root_dir=str(tmp_path)).fit(model)
    assert [(h["step"], h["action"]) for h in backoff.history] == [(22, "backoff")]
    # The rate each step updates with: the module's own up to the backoff, then exactly factor times it.
    written = {step: warmup_rate(step - 1 if model_class is PostStepWarmup else step) for step in seen.lrs}
    assert all(seen.lrs[s] == written[s] for s in range(1, 23))
    assert all(seen.lrs[s] == 0.5 * written[s] for s in range(23, 40))
    [told] = [e for e in read_journal(tmp_path) if e["kind"] == "lr_rewritten"]
    # The backoff scaled the rate written after step 22 itself; the next one written is met at the step it trains.
    first = 24 if model_class is PostStepWarmup else 23
    assert (told["step"], told["details"]["scale"], told["details"]["groups"]) == (first, 0.5, [0])
    assert "by code outside its schedulers" in told["message"]


@pytest.mark.parametrize("model_class", [PostStepWarmup, PreStepWarmup])
def test_a_resumed_run_holds_the_rate_its_module_writes_from_the_first_step(model_class: type, tmp_path: Path) -> None:
    """What the suite left in each param group, and at which scale, is in the checkpoint's optimizer state: the first
    rate the module writes after the resume is held at the backoff's scale, as in the uninterrupted run (without it,
    that step trained at twice the rate)."""

    def fit_to(steps: int, root: str, ckpt: Path | None = None) -> tuple[pl.Trainer, UpdateLR]:
        burst = FaultInjector(*(Fault(step=s, kind="nan_loss") for s in (20, 21, 22)))
        seen = UpdateLR()
        trainer = make_trainer([NonFiniteDetector(), burst, backoff_on_spikes(), seen], max_steps=steps,
                               default_root_dir=str(tmp_path / root))  # fmt: skip
        trainer.fit(model_class(lr=WARMUP_LR), ckpt_path=None if ckpt is None else str(ckpt))
        return trainer, seen

    _, whole = fit_to(40, "a")
    first, _ = fit_to(30, "b")
    ckpt = tmp_path / "b" / "stop.ckpt"
    first.save_checkpoint(ckpt)
    _, resumed = fit_to(40, "b", ckpt)
    assert resumed.lrs == {s: whole.lrs[s] for s in range(30, 40)}
    assert resumed.lrs[30] == 0.5 * warmup_rate(29 if model_class is PostStepWarmup else 30)


@pytest.mark.parametrize("model_class", [PostStepWarmup, PreStepWarmup])
def test_a_second_backoff_moves_a_rate_the_module_wrote_from_the_scale_it_was_written_under(model_class: type) -> None:
    """The second backoff (0.5 -> 0.25) is made at the batch's end, after a module that writes its rate after the
    step wrote the next one: that rate takes the scale it was written under first, then the new one (it used to get
    only the ratio, 0.5, and trained one step at twice the rate)."""
    burst = FaultInjector(*(Fault(step=s, kind="nan_loss") for s in (20, 21, 22, 40, 41, 42)))
    seen, backoff = UpdateLR(), backoff_on_spikes()
    make_trainer([NonFiniteDetector(), burst, backoff, seen], max_steps=50).fit(model_class(lr=WARMUP_LR))
    assert [(h["step"], h["scale"]) for h in backoff.history] == [(22, 0.5), (40, 0.25)]  # the second burst's first
    written = {step: warmup_rate(step - 1 if model_class is PostStepWarmup else step) for step in seen.lrs}
    assert all(seen.lrs[s] == 0.5 * written[s] for s in range(23, 41))
    assert all(seen.lrs[s] == 0.25 * written[s] for s in range(41, 50))


def test_a_rate_the_module_wrote_before_a_snapshot_is_held_at_the_backoffs_scale_after_the_restore() -> None:
    """A module that writes its rate after the step has written the next one when the batch ends, where the snapshot
    is taken: the snapshot holds that rate as written, at the backoff's scale still to apply. Restored, the first step
    trains at the scale of every other step (it used to train once at the snapshot's scale instead)."""
    faults = FaultInjector(*(Fault(step=s, kind="nan_loss") for s in (20, 21, 22)), Fault(step=38, kind="nan_weight"))
    seen, backoff = UpdateLR(), backoff_on_spikes()
    rollback = Rollback(every_n_steps=10, triggers=("nonfinite_state",), trial=None)
    make_trainer([NonFiniteDetector(), faults, backoff, rollback, seen], max_steps=45).fit(
        PostStepWarmup(lr=WARMUP_LR)
    )
    assert [(h["step"], h["snapshot_step"]) for h in rollback.history] == [(39, 33)]
    assert [(h["step"], h["scale"]) for h in backoff.history] == [(22, 0.5), (38, 0.25)]
    # The snapshot of step 33 holds the rate written after step 32's update: the restored state trains with it.
    assert seen.lrs[39] == 0.25 * warmup_rate(32)
    assert all(seen.lrs[s] == 0.25 * warmup_rate(s - 1) for s in range(40, 45))


class GroupAddedAt30(TinyRegressor):
    """Writes its rate into every param group before each step, and adds a group at step 30 (as
    ``BackboneFinetuning`` does with ``add_param_group``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.head2 = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self(x) + 0 * self.head2(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.net.parameters(), lr=self.lr)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.trainer.optimizers[0]
        if self.trainer.global_step == 30:
            optimizer.add_param_group({"params": list(self.head2.parameters())})
        for group in optimizer.param_groups:
            group["lr"] = warmup_rate(self.trainer.global_step)


def test_a_param_group_added_after_a_backoff_is_held_from_the_next_rate_it_is_given() -> None:
    ratios: dict[int, list[float]] = {}

    class Ratios(pl.Callback):
        def on_before_optimizer_step(self, trainer: pl.Trainer, *_: Any) -> None:
            rate = warmup_rate(trainer.global_step)
            ratios[trainer.global_step] = [g["lr"] / rate for g in trainer.optimizers[0].param_groups]

    burst = FaultInjector(*(Fault(step=s, kind="nan_loss") for s in (20, 21, 22)))
    make_trainer([NonFiniteDetector(), burst, backoff_on_spikes(), Ratios()], max_steps=40).fit(
        GroupAddedAt30(lr=WARMUP_LR)
    )
    assert ratios[29] == [0.5] and ratios[30] == [0.5, 1.0]  # the new group's first rate, as it was added
    assert all(ratios[s] == [0.5, 0.5] for s in range(31, 40))


def test_a_resume_whose_backoff_state_is_not_loaded_does_not_keep_the_old_scale(tmp_path: Path) -> None:
    """Another factor is another LRBackoff (its state key): its state is not loaded, it starts at scale 1, and the
    optimizer state it resumes with must not go on halving the module's rate unseen (the logs say scale 1)."""
    burst = FaultInjector(*(Fault(step=s, kind="nan_loss") for s in (20, 21, 22)))
    first = make_trainer([NonFiniteDetector(), burst, backoff_on_spikes()], max_steps=30,
                         default_root_dir=str(tmp_path))  # fmt: skip
    first.fit(PreStepWarmup(lr=WARMUP_LR))
    first.save_checkpoint(tmp_path / "a.ckpt")
    seen, other = UpdateLR(), backoff_on_spikes(factor=0.7)
    make_trainer([NonFiniteDetector(), other, seen], max_steps=40, default_root_dir=str(tmp_path)).fit(
        PreStepWarmup(lr=WARMUP_LR), ckpt_path=str(tmp_path / "a.ckpt")
    )
    assert other.scales == [1.0]
    assert all(seen.lrs[s] == warmup_rate(s) for s in range(30, 40))


class SabotagedWarmup(TinyRegressor):
    """At step 30 the first layer's weights are multiplied by 30 (the loss stays high); the module writes its own
    rate, 0.01, into the param groups before every step."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.trainer.global_step == 30:
            with torch.no_grad():
                self.net[0].weight.mul_(30.0)
        for group in self.trainer.optimizers[0].param_groups:
            group["lr"] = 0.01


def test_a_remedy_a_trial_keeps_is_held_at_its_rate_where_the_module_writes_its_own() -> None:
    """The sabotaged state, suspected at step 31, is tried; the remedy kept (the snapshot of step 30 at half the
    rate) trains at half the rate the module writes from then on, exactly as the run that backed off at once, without
    a trial (it used to train at the module's full rate for good: the backoff was lost)."""
    finals, seen = [], []
    for trial in (TrialConfig(remedies=1), None):
        torch.manual_seed(0)
        model, used = SabotagedWarmup(), UpdateLR()
        suite = [Suspect(31), LRBackoff(trial=trial), Rollback(every_n_steps=10, trial=trial), used]
        fit(model, suite, max_steps=80)
        finals.append(weights(model))
        seen.append(used.lrs)
        assert [(h["step"], h["snapshot_step"]) for h in suite[2].history] == ([(52, 30)] if trial else [(32, 30)])
    assert all(seen[0][s] == seen[1][s] == 0.005 for s in range(52, 80))
    assert_bit_identical(finals[0], finals[1])


def test_a_frozen_trial_trains_its_remedy_at_the_remedys_scale_of_the_rate_the_module_writes() -> None:
    """In ``"frozen"`` mode the loop trains the remedy: from the trial's first step, at half the rate the module
    writes (it used to train at the module's full rate, so the trial compared the snapshot at the same rate)."""
    torch.manual_seed(0)
    used = UpdateLR()
    trial = TrialConfig(remedies=1, mode="frozen")
    fit(SabotagedWarmup(), [Suspect(31), LRBackoff(trial=trial), Rollback(every_n_steps=10, trial=trial), used],
        max_steps=60)  # fmt: skip
    assert all(used.lrs[s] == 0.01 for s in range(32))
    assert all(used.lrs[s] == 0.005 for s in range(32, 52))  # the remedy, trained live during the trial
    assert all(used.lrs[s] == 0.0025 for s in range(52, 60))  # kept; the next rung trains a lower rate live


def test_a_scheduled_rate_is_not_taken_for_one_the_module_wrote(tmp_path: Path) -> None:
    burst = FaultInjector(*(Fault(step=s, kind="nan_loss") for s in (20, 21, 22)))
    model = TinyRegressor(scheduler=SCHEDULERS["ExponentialLR"])
    callbacks = [NonFiniteDetector(), burst, backoff_on_spikes()]
    make_trainer(callbacks, max_steps=40, default_root_dir=str(tmp_path)).fit(model)
    events = list(read_journal(tmp_path))
    assert [e["kind"] for e in events if e["kind"] in ("backoff", "lr_rewritten")] == ["backoff"]


def test_a_healthy_run_that_writes_its_own_rate_is_bit_identical_with_the_suite() -> None:
    bare, guarded = PostStepWarmup(lr=WARMUP_LR), PostStepWarmup(lr=WARMUP_LR)
    guarded.load_state_dict(bare.state_dict())
    make_trainer([], max_steps=30).fit(bare)
    make_trainer(default_callbacks(), max_steps=30).fit(guarded)
    assert_bit_identical(weights(bare), weights(guarded))


def test_a_plain_loop_that_sets_its_rate_each_step_is_held_at_factor_times_it(tmp_path: Path) -> None:
    """nanoGPT's and litgpt's loops write the rate into the param groups before every step."""
    from lightning_overflow import Guard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=WARMUP_LR)
    x, y = torch.randn(40, 8, 4), torch.randn(40, 8, 1)
    used: dict[int, float] = {}
    with Guard(model, optimizer, callbacks=[NonFiniteDetector(), backoff_on_spikes()],
               default_root_dir=tmp_path) as guard:  # fmt: skip
        def note(opt: torch.optim.Optimizer, *_: Any) -> None:
            used[guard.global_step] = opt.param_groups[0]["lr"]

        optimizer.register_step_pre_hook(note)
        for step in range(40):
            for group in optimizer.param_groups:
                group["lr"] = warmup_rate(step)
            loss = torch.nn.functional.mse_loss(model(x[step]), y[step]) * (math.nan if step in (20, 21, 22) else 1.0)
            loss.backward()
            guard.step(loss)
    assert sorted(used) == [s for s in range(40) if s not in (20, 21, 22)]  # the skipped steps updated nothing
    assert all(used[s] == warmup_rate(s) for s in range(20))
    assert all(used[s] == 0.5 * warmup_rate(s) for s in range(23, 40))
    assert [e.kind for e in guard.events if e.kind in ("backoff", "lr_rewritten")] == ["backoff", "lr_rewritten"]


def test_a_plain_loop_resumed_after_a_backoff_holds_the_rate_it_writes_from_the_first_step(tmp_path: Path) -> None:
    """litgpt's loop resumed from its own checkpoint (model, optimizer, the guard's state): the rate it writes at the
    first step after the resume trains at the backoff's scale, as in the uninterrupted run."""
    from lightning_overflow import Guard

    x, y = torch.randn(40, 8, 4, generator=torch.Generator().manual_seed(1)), torch.zeros(40, 8, 1)

    def train(steps: range, state: dict[str, Any] | None = None) -> tuple[dict[int, float], dict[str, Any]]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=WARMUP_LR)
        if state is not None:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        used: dict[int, float] = {}
        with Guard(model, optimizer, callbacks=[NonFiniteDetector(), backoff_on_spikes()], default_root_dir=tmp_path,
                   state=None if state is None else state["guard"]) as guard:  # fmt: skip
            def note(opt: torch.optim.Optimizer, *_: Any) -> None:
                used[guard.global_step] = opt.param_groups[0]["lr"]

            optimizer.register_step_pre_hook(note)
            for step in steps:
                for group in optimizer.param_groups:
                    group["lr"] = warmup_rate(step)
                scale = math.nan if step in (20, 21, 22) else 1.0
                loss = torch.nn.functional.mse_loss(model(x[step]), y[step]) * scale
                loss.backward()
                guard.step(loss)
            saved = {"model": copy.deepcopy(model.state_dict()), "optimizer": copy.deepcopy(optimizer.state_dict()),
                     "guard": copy.deepcopy(guard.state_dict())}  # fmt: skip
        return used, saved

    whole, _ = train(range(40))
    _, saved = train(range(30))
    resumed, _ = train(range(30, 40), saved)
    assert resumed == {s: whole[s] for s in range(30, 40)} and resumed[30] == 0.5 * warmup_rate(30)


