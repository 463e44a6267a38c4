"""The plain-loop and Fabric entry (``Guard``): the Trainer callbacks' decisions, at the same steps, without a Trainer.

Every run here trains ``TinyRegressor``'s network and data; the plain loop and the Fabric loop use the module as a
plain ``nn.Module`` (its ``forward``), with the optimizer its ``configure_optimizers`` builds, so that the same fault
can be compared with a ``Trainer(callbacks=default_callbacks())`` fit of the same model step for step.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import assert_bit_identical, assert_optimizer_state_equal, make_trainer, optimizer_state, weights
from torch import nn
from torch.optim import lr_scheduler as sched

from lightning_overflow import (
    AutoClip,
    DivergenceError,
    Guard,
    LossSpikeDetector,
    LRBackoff,
    NonFiniteDetector,
    NonFiniteError,
    Rollback,
    TrialConfig,
    default_callbacks,
    read_journal,
)
from lightning_overflow.guard import StepOutcome
from lightning_overflow.health import board_for
from lightning_overflow.testing import Fault, FaultInjector, TinyRegressor

FAULT_STEP = 7


def warmup(optimizer: torch.optim.Optimizer) -> Any:
    return sched.LinearLR(optimizer, 0.05, total_iters=100)


@dataclass
class Run:
    model: TinyRegressor
    optimizer: torch.optim.Optimizer
    guard: Guard | None
    outcomes: list[StepOutcome] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)  # the rate each step trained with
    before: dict[int, dict[str, Any]] = field(default_factory=dict)  # the state at the start of each step
    after: dict[int, dict[str, Any]] = field(default_factory=dict)  # the state after each guard.step
    norms: list[float] = field(default_factory=list)  # the total gradient norm the suite judged at each guard.step

    def events(self) -> list[tuple[int, str]]:
        assert self.guard is not None
        return [(e.step, e.kind) for e in self.guard.events]


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": weights(model), "optimizer": optimizer_state(optimizer)}


def loop(
    steps: int,
    callbacks: list[Any] | None,
    tmp_path: Path,
    *,
    fault: str | None = None,
    at: int = FAULT_STEP,
    fabric: bool = False,
    batches: bool = False,
    keep: Callable[[int], bool] = lambda step: False,
    clip: tuple[float, str] | None = None,
    **model_kwargs: Any,
) -> Run:
    """Train ``TinyRegressor`` for ``steps`` optimizer steps in a plain loop (or a Fabric loop) with ``Guard`` (or
    bare, ``callbacks=None``), injecting ``fault`` at step ``at`` as ``FaultInjector`` does under the Trainer.
    ``batches``: the guard runs each step (``Guard(loss_fn=...)``, ``guard.train_step(batch)``). ``clip``: the loop's
    own clipping, ``(value, algorithm)``: the guard's ``gradient_clip_val``, or ``clip_grad_norm_`` /
    ``clip_grad_value_`` before a bare loop's ``optimizer.step()``."""
    pl.seed_everything(0, verbose=False)
    factory = model_kwargs.pop("scheduler", None)
    model = TinyRegressor(**model_kwargs)
    optimizer = model.configure_optimizers()
    scheduler = factory(optimizer) if factory is not None else None
    loader = model.train_dataloader()
    trained, stepper = model, optimizer
    if fabric:
        from lightning.fabric import Fabric

        runner = Fabric(accelerator="cpu", devices=1)
        trained, stepper = runner.setup(model, optimizer)
    fired = []

    def loss_fn(net: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        loss = nn.functional.mse_loss(net(batch[0]), batch[1])
        if fault == "nan_loss" and step == at and not fired:  # once, as FaultInjector fires it
            fired.append(step)
            loss = loss * float("nan")
        return loss

    guard = None
    if callbacks is not None:
        extra: dict[str, Any] = {}
        if batches:
            extra = {"loss_fn": loss_fn, "backward": runner.backward if fabric else None}
        if clip is not None:
            extra.update(gradient_clip_val=clip[0], gradient_clip_algorithm=clip[1])
        guard = Guard(trained, stepper, scheduler, callbacks, default_root_dir=tmp_path, **extra)
    run = Run(model, optimizer, guard)
    step = 0
    while step < steps:
        for x, y in loader:
            if keep(step):
                run.before[step] = _state(model, optimizer)
            if fault == "nan_weight" and step == at:
                with torch.no_grad():
                    next(model.parameters()).view(-1)[0] = float("nan")
            run.lrs.append(float(optimizer.param_groups[0]["lr"]))
            if guard is not None and batches:
                run.outcomes.append(guard.train_step((x, y)))
            else:
                loss = loss_fn(trained, (x, y))
                if fabric:
                    runner.backward(loss)
                else:
                    loss.backward()
                if guard is not None:
                    run.outcomes.append(guard.step(loss))
                    record = guard.board.current
                    run.norms.append(record.total_norm if record is not None else math.nan)
                else:
                    if clip is not None and clip[1] == "norm":
                        nn.utils.clip_grad_norm_(model.parameters(), clip[0])
                    elif clip is not None:
                        nn.utils.clip_grad_value_(model.parameters(), clip[0])
                    stepper.step()
                    if scheduler is not None:
                        scheduler.step()
                    stepper.zero_grad()
            step += 1
            if keep(step - 1):
                run.after[step - 1] = _state(model, optimizer)
            if step == steps:
                break
    if guard is not None:
        guard.close()
    return run


def trainer_events(steps: int, callbacks: list[Any], tmp_path: Path, fault: str | None = None, **model_kwargs: Any
                   ) -> list[tuple[int, str]]:  # fmt: skip
    """The same model under ``Trainer``, the fault injected by ``FaultInjector`` at the same step."""
    pl.seed_everything(0, verbose=False)
    extra = [FaultInjector(Fault(FAULT_STEP, fault))] if fault is not None else []
    trainer = make_trainer([*callbacks, *extra], max_steps=steps, default_root_dir=str(tmp_path / "trainer"))
    trainer.fit(TinyRegressor(**model_kwargs))
    return [(e.step, e.kind) for e in board_for(trainer).journal.events]


# ---- a non-finite loss: the step is a true no-op ---------------------------------------------------------------------
def test_a_nan_loss_at_step_k_skips_that_step_leaving_the_state_bit_identical(tmp_path: Path) -> None:
    run = loop(20, default_callbacks(), tmp_path, fault="nan_loss", batch_norm=True, scheduler=warmup,
               keep=lambda step: step == FAULT_STEP)  # fmt: skip
    outcome = run.outcomes[FAULT_STEP]
    assert outcome.skipped and not outcome.rolled_back and "loss" in outcome.skip_reason
    assert [o.step for o in run.outcomes if o.skipped] == [FAULT_STEP]
    before, after = run.before[FAULT_STEP], run.after[FAULT_STEP]
    assert_bit_identical(before["model"], after["model"])  # the BatchNorm statistics the forward moved included
    assert_optimizer_state_equal(before["optimizer"], after["optimizer"])
    assert run.lrs[FAULT_STEP + 1] == run.lrs[FAULT_STEP]  # the schedule did not move either
    assert run.guard is not None and run.guard.global_step == 20  # the run went on
    assert all(math.isfinite(v.float().sum()) for v in weights(run.model).values())
    assert (FAULT_STEP, "skip") in run.events()
    assert run.guard.journal_path == tmp_path / "overflow_events.jsonl"
    journaled = [(e["step"], e["kind"]) for e in read_journal(tmp_path / "overflow_events.jsonl")]
    assert (FAULT_STEP, "skip") in journaled


def test_the_fit_summary_tells_the_skip(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="lightning_overflow"):
        loop(12, default_callbacks(), tmp_path, fault="nan_loss")
    summary = [r.getMessage() for r in caplog.records if "what happened in this fit" in r.getMessage()]
    assert len(summary) == 1
    assert f"1 step skipped: the loss was inf/NaN at step {FAULT_STEP}" in summary[0]


# ---- a NaN weight: restored to the last verified snapshot ------------------------------------------------------------
def test_a_nan_weight_is_restored_to_the_last_verified_snapshot(tmp_path: Path) -> None:
    callbacks = default_callbacks(snapshot_every_n_steps=5)
    rollback = next(cb for cb in callbacks if isinstance(cb, Rollback))
    at = 13
    run = loop(20, callbacks, tmp_path, fault="nan_weight", at=at, keep=lambda step: True)
    assert [(o.step, o.restored_to) for o in run.outcomes if o.rolled_back] == [(at, 10)]
    assert {o.restored_to for o in run.outcomes if not o.rolled_back} == {None}
    target = rollback.history[0]["snapshot_step"]
    assert target == 10  # snapshots at 0, 5, 10: the last one verified finite before the fault
    restored = run.after[at]
    snapshot = run.before[target]  # the state at the start of step 10 is what the snapshot of step 10 holds
    assert_bit_identical(snapshot["model"], restored["model"])
    assert_optimizer_state_equal(snapshot["optimizer"], restored["optimizer"])
    assert all(math.isfinite(v.float().sum()) for v in weights(run.model).values())
    assert {(at, "nonfinite"), (at, "backoff")} <= set(run.events())


# ---- a learning rate too high: backed off ----------------------------------------------------------------------------
def diverging(**extra: Any) -> dict[str, Any]:
    """SGD at 0.2 where 0.02 trains, warmed up over 100 steps: the loss takes off near step 140 and ends NaN bare."""
    return {"optimizer": "sgd", "lr": 0.2, "scheduler": warmup, **extra}


def test_a_learning_rate_too_high_is_backed_off_by_factor_against_the_unprotected_run(tmp_path: Path) -> None:
    steps = 200
    bare = loop(steps, None, tmp_path, **diverging())
    x, y = bare.model.data.tensors
    with torch.no_grad():
        assert math.isnan(nn.functional.mse_loss(bare.model(x), y).item())
    guarded = loop(steps, default_callbacks(lr_factor=0.5), tmp_path, **diverging())
    backoffs = [o.step for o in guarded.outcomes if o.backed_off]
    assert backoffs, "the divergence was not answered"
    first = backoffs[0]
    later = backoffs[1] if len(backoffs) > 1 else steps - 1
    assert first > 100  # a real divergence after the warm-up, not an LR that overflows at once
    for step in range(first + 1, later + 1):
        assert guarded.lrs[step] == 0.5 * bare.lrs[step], step
    with torch.no_grad():
        final = nn.functional.mse_loss(guarded.model(x), y).item()
    assert math.isfinite(final) and final < 0.05


# ---- a healthy run: bit-identical ------------------------------------------------------------------------------------
def test_a_healthy_plain_loop_is_bit_identical_with_and_without_the_guard(tmp_path: Path) -> None:
    options: dict[str, Any] = {"batch_norm": True, "dropout": 0.1, "optimizer": "adamw", "scheduler": warmup}
    bare = loop(40, None, tmp_path, **options)
    guarded = loop(40, default_callbacks(), tmp_path, **options)
    assert_bit_identical(weights(bare.model), weights(guarded.model))
    assert_optimizer_state_equal(optimizer_state(bare.optimizer), optimizer_state(guarded.optimizer))
    assert bare.lrs == guarded.lrs
    assert guarded.guard is not None and guarded.guard.events == []
    assert not any(o.skipped or o.clipped or o.backed_off or o.rolled_back for o in guarded.outcomes)


# ---- the loop's own clipping -----------------------------------------------------------------------------------------
CLIPS = {"norm": 0.5, "value": 0.1}  # TinyRegressor's norms are 0.3 to 3.3 here: most steps are clipped


@pytest.mark.parametrize("algorithm", list(CLIPS))
def test_the_loops_own_clipping_is_that_of_a_bare_loop_and_autoclip_leaves_the_gradients_to_it(
    tmp_path: Path, algorithm: str, caplog: pytest.LogCaptureFixture
) -> None:
    clip = (CLIPS[algorithm], algorithm)
    options: dict[str, Any] = {"optimizer": "adamw", "scheduler": warmup}
    unclipped = loop(40, None, tmp_path, **options)
    bare = loop(40, None, tmp_path, clip=clip, **options)
    with caplog.at_level(logging.INFO, logger="lightning_overflow"):
        guarded = loop(40, default_callbacks(), tmp_path, clip=clip, **options)
    assert not torch.equal(weights(unclipped.model)["net.0.weight"], weights(bare.model)["net.0.weight"])
    assert_bit_identical(weights(bare.model), weights(guarded.model))
    assert_optimizer_state_equal(optimizer_state(bare.optimizer), optimizer_state(guarded.optimizer))
    assert guarded.guard is not None and guarded.guard.events == []
    assert not any(o.clipped for o in guarded.outcomes)  # AutoClip scaled nothing: the loop's clipping did
    # The suite judged the step's true gradients, before the clip: at step 0 those of the same model on its first batch.
    pl.seed_everything(0, verbose=False)
    fresh = TinyRegressor(optimizer="adamw")
    x, y = next(iter(fresh.train_dataloader()))
    nn.functional.mse_loss(fresh(x), y).backward()
    first = float(torch.nn.utils.get_total_norm([p.grad for p in fresh.parameters() if p.grad is not None]))
    assert first > 1.0 and guarded.norms[0] == pytest.approx(first, rel=1e-6)
    said = [r.getMessage() for r in caplog.records if "AutoClip leaves" in r.getMessage()]
    assert said == [
        f"lightning_overflow: AutoClip leaves this fit's gradients to Guard(gradient_clip_val={clip[0]}, "
        f"gradient_clip_algorithm='{algorithm}'), which clips every step: your clipping is kept (the rest of the "
        "suite acts as usual)"
    ]


@pytest.mark.parametrize("under", ["plain", "fabric"])
def test_the_loops_own_clipping_sums_the_norm_in_the_order_the_loops_own_clip_does(tmp_path: Path, under: str) -> None:
    """An optimizer whose groups list the parameters in another order than the model (weight decay on the matrices
    only, as nanoGPT's): the guard clips bit for bit as the loop's own clip, ``clip_grad_norm_(model.parameters())``
    in a plain loop (the model's order; it summed the total norm in the groups' order, and the weights differed after
    20 steps), ``fabric.clip_gradients`` under Fabric (the groups' order)."""
    from lightning.fabric import Fabric

    def run(guarded: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        fabric = Fabric(accelerator="cpu", devices=1)
        blocks = [nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU()) for _ in range(6)]
        model = nn.Sequential(*blocks, nn.Linear(64, 1))
        groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                  {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip
        net, optimizer = model, torch.optim.AdamW(groups, lr=1e-3)
        if under == "fabric":
            net, optimizer = fabric.setup(model, optimizer)
        guard = Guard(net, optimizer, gradient_clip_val=1.0, default_root_dir=tmp_path) if guarded else None
        data = torch.Generator().manual_seed(1)
        for _ in range(20):
            x, y = torch.randn(32, 64, generator=data), torch.randn(32, 1, generator=data) * 10
            loss = nn.functional.mse_loss(net(x), y)
            fabric.backward(loss) if under == "fabric" else loss.backward()
            if guard is not None:
                guard.step(loss)
                continue
            if under == "fabric":
                fabric.clip_gradients(net, optimizer, max_norm=1.0)
            else:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if guard is not None:
            guard.close()
        return weights(model)

    assert_bit_identical(run(False), run(True))


def test_a_nan_loss_is_skipped_under_the_loops_own_clipping(tmp_path: Path) -> None:
    """The guard judges the step before it clips: a NaN loss is skipped as without the clipping, and the state after
    the step is bit for bit the state before it."""
    run = loop(12, default_callbacks(), tmp_path, fault="nan_loss", clip=(0.5, "norm"),
               keep=lambda step: step == FAULT_STEP)  # fmt: skip
    assert [o.step for o in run.outcomes if o.skipped] == [FAULT_STEP]
    before, after = run.before[FAULT_STEP], run.after[FAULT_STEP]
    assert_bit_identical(before["model"], after["model"])
    assert_optimizer_state_equal(before["optimizer"], after["optimizer"])


def test_the_trainer_with_the_same_clipping_makes_the_same_decisions(tmp_path: Path) -> None:
    plain = loop(16, default_callbacks(), tmp_path / "plain", fault="nan_weight", clip=(0.5, "norm"))
    pl.seed_everything(0, verbose=False)
    trainer = make_trainer([*default_callbacks(), FaultInjector(Fault(FAULT_STEP, "nan_weight"))], max_steps=16,
                           default_root_dir=str(tmp_path / "trainer"), gradient_clip_val=0.5)  # fmt: skip
    model = TinyRegressor()
    trainer.fit(model)
    assert plain.events() and plain.events() == [(e.step, e.kind) for e in board_for(trainer).journal.events]
    assert_bit_identical(weights(plain.model), weights(model))  # the same clip, at the same place


def test_autoclip_that_refuses_double_clipping_names_the_guards_argument(tmp_path: Path) -> None:
    model = nn.Linear(2, 1)
    with pytest.raises(ValueError) as info:
        Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), callbacks=[AutoClip()], default_root_dir=tmp_path,
              gradient_clip_val=1.0)  # fmt: skip
    assert str(info.value).startswith(
        "AutoClip(mode='zscore') and Guard(gradient_clip_val=1.0) would both clip every step's gradients (double "
        "clipping: AutoClip first, then Guard's clip_grad_norm_, which zeroes finite gradients whose FP32 norm "
        "overflows). Remove gradient_clip_val from the Guard;"
    )


# ---- a ReduceLROnPlateau scheduler: stepped at the epoch's end on the value it watches -------------------------------
@dataclass
class PlateauRun:
    model: TinyRegressor
    guard: Guard | None
    lrs: list[float]  # the rate each step trained with
    states: dict[int, dict[str, Any]]  # the scheduler's state at the start of each step


def plateau_loop(epochs: int, callbacks: list[Any] | None, tmp_path: Path, nan_weight_at: int | None = None
                 ) -> PlateauRun:  # fmt: skip
    """``TinyRegressor`` (8 batches an epoch) under SGD with ``ReduceLROnPlateau`` on the epoch's mean training loss:
    ``guard.end_epoch(mean)``, or ``scheduler.step(mean)`` in a bare loop."""
    pl.seed_everything(0, verbose=False)
    model = TinyRegressor(optimizer="sgd", lr=0.05)
    optimizer = model.configure_optimizers()
    plateau = sched.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=0.05)
    guard = None
    if callbacks is not None:
        guard = Guard(model, optimizer, plateau, callbacks, scheduler_interval="epoch", default_root_dir=tmp_path)
    run = PlateauRun(model, guard, [], {})
    step = 0
    for _ in range(epochs):
        total = 0.0
        for x, y in model.train_dataloader():
            run.states[step] = copy.deepcopy(plateau.state_dict())
            if step == nan_weight_at:
                with torch.no_grad():
                    next(model.parameters()).view(-1)[0] = float("nan")
            run.lrs.append(float(optimizer.param_groups[0]["lr"]))
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            total += loss.item()
            if guard is not None:
                guard.step(loss)
            else:
                optimizer.step()
                optimizer.zero_grad()
            step += 1
        if guard is not None:
            guard.end_epoch(total / 8)
        else:
            plateau.step(total / 8)
    if guard is not None:
        guard.close()
    return run


def test_a_plateau_scheduler_steps_on_the_value_handed_to_end_epoch_as_in_a_bare_loop(tmp_path: Path) -> None:
    bare = plateau_loop(8, None, tmp_path)
    guarded = plateau_loop(8, default_callbacks(), tmp_path)
    assert bare.lrs[::8] == [0.05, 0.05, 0.05, 0.025, 0.0125, 0.0125, 0.0125, 0.0125]  # it reduced twice
    assert guarded.lrs == bare.lrs
    assert_bit_identical(weights(bare.model), weights(guarded.model))
    assert guarded.guard is not None and guarded.guard.events == []


def test_a_rollback_puts_the_plateau_scheduler_back_and_the_backoff_scales_its_rate(tmp_path: Path) -> None:
    """A snapshot at step 30, the epoch's end after step 31 (the scheduler steps), NaN weights at step 33: the
    scheduler is the snapshot's again, and the rate half of the snapshot's."""
    run = plateau_loop(6, default_callbacks(snapshot_every_n_steps=5), tmp_path, nan_weight_at=33)
    assert run.guard is not None
    assert [(e.step, e.kind) for e in run.guard.events] == [(33, "nonfinite"), (33, "backoff"), (34, "rollback")]
    assert run.states[33] != run.states[30]  # the epoch's end moved it
    restored, snapshot = run.states[35], run.states[30]
    for key in ("last_epoch", "best", "num_bad_epochs", "cooldown_counter"):
        assert restored[key] == snapshot[key], key
    assert run.lrs[34] == 0.5 * run.lrs[30]


def test_a_plateau_scheduler_needs_the_epoch_interval_and_the_value_it_watches(tmp_path: Path) -> None:
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plateau = sched.ReduceLROnPlateau(optimizer)
    with pytest.raises(ValueError) as per_step:
        Guard(model, optimizer, plateau, default_root_dir=tmp_path)
    assert str(per_step.value) == (
        "a ReduceLROnPlateau scheduler steps on the value it watches, which guard.step(loss) is not given (got "
        "scheduler_interval='step'): build the guard with scheduler_interval='epoch' and call guard.end_epoch(metric) "
        "with that value (a validation loss) at the end of each epoch"
    )
    guard = Guard(model, optimizer, plateau, scheduler_interval="epoch", default_root_dir=tmp_path)
    with pytest.raises(ValueError) as no_metric:
        guard.end_epoch()
    assert str(no_metric.value) == (
        "guard.end_epoch() at epoch 0: the ReduceLROnPlateau scheduler steps on the value it watches: pass it as a "
        "number, guard.end_epoch(metric)"
    )
    with pytest.raises(ValueError) as not_a_number:
        guard.end_epoch("low")  # type: ignore[arg-type]
    assert str(not_a_number.value) == (
        "guard.end_epoch() at epoch 0: the ReduceLROnPlateau scheduler steps on the value it watches: pass it as a "
        "number (got str 'low'), guard.end_epoch(metric)"
    )
    guard.close()
    counted = Guard(model, optimizer, sched.StepLR(optimizer, 2), scheduler_interval="epoch", default_root_dir=tmp_path)
    with pytest.raises(ValueError) as stray:
        counted.end_epoch(0.5)
    assert str(stray.value) == (
        "'metric' is the value a ReduceLROnPlateau scheduler watches, and this guard steps none (got metric=float "
        "0.5, scheduler=StepLR, scheduler_interval='epoch')"
    )
    counted.close()


# ---- Fabric, and the Trainer: the same decisions at the same steps ---------------------------------------------------
FAULTS = {
    "nan_loss": ({}, 16),
    "nan_weight": ({}, 16),
    "lr_too_high": (diverging(), 160),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_fabric_makes_the_plain_loops_decisions(tmp_path: Path, fault: str) -> None:
    options, steps = FAULTS[fault]
    kind = None if fault == "lr_too_high" else fault
    plain = loop(steps, default_callbacks(), tmp_path / "plain", fault=kind, **options)
    fabric = loop(steps, default_callbacks(), tmp_path / "fabric", fault=kind, fabric=True, **options)
    assert plain.events() and plain.events() == fabric.events()
    assert_bit_identical(weights(plain.model), weights(fabric.model))


@pytest.mark.parametrize(
    ("fault", "trials"), [("nan_loss", True), ("nan_weight", True), *((f, False) for f in FAULTS)]
)
def test_the_trainer_makes_the_same_decisions_at_the_same_steps(tmp_path: Path, fault: str, trials: bool) -> None:
    """The same events at the same steps as a ``Trainer`` fit of the same model. A certain fault is answered alike
    whether the Trainer runs trials or not; the guard, which cannot re-run a step, answers a suspicion at once, as
    the Trainer does with ``default_callbacks(trial=None)``."""
    options, steps = FAULTS[fault]
    kind = None if fault == "lr_too_high" else fault
    plain = loop(steps, default_callbacks(), tmp_path / "plain", fault=kind, **options)
    fabric = loop(steps, default_callbacks(), tmp_path / "fabric", fault=kind, fabric=True, **options)
    settings = {} if trials else {"trial": None}
    trainer = trainer_events(steps, default_callbacks(**settings), tmp_path, kind, **options)
    assert plain.events() and plain.events() == fabric.events() == trainer


# ---- the rest of the surface -----------------------------------------------------------------------------------------
def test_a_divergence_error_ends_the_guard_as_it_ends_a_fit(tmp_path: Path) -> None:
    callbacks = [NonFiniteDetector(), LRBackoff(triggers=("nonfinite_burst",), min_scale=0.5, cooldown=0, trial=None)]
    with pytest.raises(DivergenceError):
        loop(30, callbacks, tmp_path, fault=None, **diverging(lr=5.0))
    model = nn.Linear(2, 1)
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), default_root_dir=tmp_path)
    guard.close()
    with pytest.raises(RuntimeError, match="closed"):
        guard.step(torch.zeros(()))


def test_suspicions_are_answered_at_once_without_trials(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = nn.Linear(2, 1)
    with caplog.at_level(logging.INFO, logger="lightning_overflow"):
        guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), default_root_dir=tmp_path)
    assert "not the batch" in guard.board.trials.unavailable and not guard.board.trials.runs
    assert any("no trials in this loop" in r.getMessage() for r in caplog.records)
    guard.close()


def test_a_checkpoint_resumes_the_guard(tmp_path: Path) -> None:
    callbacks = default_callbacks(snapshot_every_n_steps=5, dirpath=tmp_path / "snapshots")
    run = loop(12, callbacks, tmp_path, fault="nan_loss")
    assert run.guard is not None
    path = tmp_path / "run.ckpt"
    guard = Guard(run.model, run.optimizer, callbacks=default_callbacks(snapshot_every_n_steps=5,
                  dirpath=tmp_path / "snapshots"), default_root_dir=tmp_path,
                  state=run.guard.state_dict())  # fmt: skip
    assert guard.global_step == 12
    guard.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)
    assert saved["guard"]["global_step"] == 12 and set(saved) >= {"model", "optimizer", "guard"}
    detector = next(cb for cb in guard.callbacks if isinstance(cb, NonFiniteDetector))
    assert detector.skipped_steps == 1  # carried over
    guard.close()


def test_a_guard_in_fabrics_saved_state_is_saved_as_its_state_and_resumed_from_what_fabric_load_returns(
    tmp_path: Path,
) -> None:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    model, optimizer = fabric.setup(*_model_and_optimizer())
    guard = Guard(model, optimizer, default_root_dir=tmp_path)
    for _ in range(5):
        loss = model(torch.ones(2, 3)).sum()
        fabric.backward(loss)
        guard.step(loss)
    fabric.save(tmp_path / "c.ckpt", {"model": model, "optimizer": optimizer, "guard": guard})
    saved = guard.state_dict()
    guard.close()
    model, optimizer = fabric.setup(*_model_and_optimizer())
    remainder = fabric.load(tmp_path / "c.ckpt", {"model": model, "optimizer": optimizer})
    assert remainder["guard"] == saved
    resumed = Guard(model, optimizer, default_root_dir=tmp_path, state=remainder["guard"])
    assert resumed.global_step == 5
    with pytest.raises(RuntimeError, match=r"^Guard.load_state_dict: a guard's state is loaded as the guard is built"):
        fabric.load(tmp_path / "c.ckpt", {"model": model, "optimizer": optimizer, "guard": resumed})
    resumed.close()


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Linear(3, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_a_nonfinite_checkpoint_is_rolled_back_before_it_is_written(tmp_path: Path) -> None:
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    start = weights(model)  # the snapshot the guard takes when it starts
    with Guard(model, optimizer, default_root_dir=tmp_path) as guard:
        loss = model(torch.ones(2, 3)).sum()
        loss.backward()
        guard.step(loss)
        with torch.no_grad():
            model.weight.view(-1)[0] = float("nan")
        guard.save_checkpoint(tmp_path / "c.ckpt")
    saved = torch.load(tmp_path / "c.ckpt", weights_only=False)
    assert_bit_identical(saved["model"], start)  # rolled back first, then written
    assert_bit_identical(weights(model), start)


def test_the_guard_looks_through_wrappers_and_refuses_sharding() -> None:
    model = nn.Linear(2, 1)
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), callbacks=[NonFiniteDetector()],
                  default_root_dir="/tmp")  # fmt: skip
    assert guard.module is model and guard.host.strategy.root_device == torch.device("cpu")
    assert dict(guard.host.lightning_module.named_parameters()) == dict(model.named_parameters())
    guard.close()
    with pytest.raises(ValueError, match="scheduler_interval"):
        Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler_interval="batch")


class _StepsWithACount:
    """A scheduler stepped with the epoch or update count, as timm's are (``step(epoch)``, ``step_update(n)``): a
    guard accepted it, and its first step raised ``TypeError`` after the optimizer had stepped."""

    def step(self, epoch: int, metric: float | None = None) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model": 3}, "'model' must be a torch.nn.Module (got 3)"),
        ({"optimizer": "two"}, ("'optimizer' must be a torch.optim.Optimizer or Fabric's wrapper of one (got str "
                                "'two'): a Guard steps one optimizer; a model with several (a GAN) needs the Trainer, "
                                "under manual optimization")),
        ({"scheduler": 0.5}, ("'scheduler' must be a learning-rate scheduler (with step() and state_dict()) or None "
                              "(got float 0.5)")),
        ({"gradient_clip_val": "1"}, "'gradient_clip_val' must be a number or None (got '1')"),
        ({"gradient_clip_val": -1.0}, "'gradient_clip_val' must be in [0, inf) (got -1)"),
        ({"gradient_clip_algorithm": "max"}, "'gradient_clip_algorithm' must be one of 'norm', 'value' (got 'max')"),
        # What would otherwise leave the loop unprotected without a word, or fail later with an unrelated error
        ({"callbacks": [default_callbacks()]}, ("'callbacks' must be a list of Lightning callbacks (got a list of 6 "
                                                "in it): pass the list itself, callbacks=default_callbacks()")),
        ({"callbacks": default_callbacks}, ("'callbacks' must be a list of Lightning callbacks or None (got a "
                                            "function): call it, callbacks=default_callbacks()")),
        ({"callbacks": [NonFiniteDetector]}, ("'callbacks' must be a list of Lightning callbacks (got a type in it): "
                                              "an instance, NonFiniteDetector()")),
        ({"callbacks": "skip"}, "'callbacks' must be a list of Lightning callbacks or None (got str 'skip')"),
        ({"default_root_dir": 123}, "'default_root_dir' must be a path or None (got 123)"),
        ({"logger": "csv"}, ("'logger' must be a Lightning logger (CSVLogger, TensorBoardLogger...) or None (got str "
                             "'csv')")),
        ({"scaler": True}, ("'scaler' must be a torch.amp.GradScaler or None (got bool True, without scale, unscale_, "
                            "step, update, state_dict)")),
        ({"state": {"model": {}, "guard": {"global_step": 3}}}, (
            "'state' must be a Guard.state_dict(), with its global_step a count of steps at least 0 (got a dict with "
            "global_step=None): pass the guard's part of the checkpoint, state=checkpoint['guard']")),
        ({"state": {"global_step": -5}}, ("'state' must be a Guard.state_dict(), with its global_step a count of steps "
                                          "at least 0 (got a dict with global_step=-5)")),
        ({"state": {"global_step": True}}, ("'state' must be a Guard.state_dict(), with its global_step a count of "
                                            "steps at least 0 (got a dict with global_step=True)")),
        ({"state": {"global_step": 3, "current_epoch": "x"}}, (
            "'state' must be a Guard.state_dict(), with its current_epoch a count of epochs at least 0 (got a dict "
            "with current_epoch='x')")),
        ({"state": {"global_step": 3, "callbacks": ["junk"]}}, (
            "'state' must be a Guard.state_dict(), with its callbacks each callback's state by its state_key (got a "
            "dict with callbacks=a list of 1)")),
        ({"callbacks": [LRBackoff(), LRBackoff()]}, (
            "Guard(callbacks=...) has two LRBackoff callbacks (LRBackoff{'factor': 0.5, 'per_optimizer': True} and "
            "LRBackoff{'factor': 0.5, 'per_optimizer': True}): LRBackoff acts on the whole run, so two of them would "
            "act twice on every step and log into the same keys. Keep one LRBackoff.")),
        ({"scheduler": sched.StepLR(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), 2)}, (
            "'scheduler' schedules another optimizer (a SGD) than the guard's (a SGD): build it on the optimizer "
            "given to the guard")),
        ({"scheduler": _StepsWithACount()}, (
            "'scheduler' must step with no argument, as the guard steps it (got a _StepsWithACount, whose step() needs "
            "'epoch'): a schedule stepped with a count (timm's step_update(num_updates)) stays the loop's; leave it "
            "out of the guard and step it yourself: the guard holds the rates it writes at the backed-off scale")),
        ({"optimizer": torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)}, (
            "'optimizer' steps none of the model's parameters (2 tensors, none of the model's 2): build it on "
            "model.parameters() of the model given to the guard")),
    ],
)  # fmt: skip
def test_the_guard_refuses_what_it_cannot_guard(kwargs: dict[str, Any], message: str, tmp_path: Path) -> None:
    model = nn.Linear(2, 1)
    given = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "default_root_dir": tmp_path,
             **kwargs}  # fmt: skip
    with pytest.raises((TypeError, ValueError)) as info:
        Guard(**given)
    assert str(info.value) == message


def test_a_default_root_dir_that_is_a_file_is_refused_where_the_guard_is_built(tmp_path: Path) -> None:
    """It was taken, and the first event's journal line raised ``FileExistsError`` out of the step it was about."""
    model, path = nn.Linear(2, 1), tmp_path / "a_file"
    path.write_text("")
    with pytest.raises(ValueError) as info:
        Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), default_root_dir=path)
    assert str(info.value) == (
        f"'default_root_dir' must be a directory, where the journal goes (got '{path}', which is a file)"
    )


def test_a_callback_of_the_unified_namespace_is_accepted(tmp_path: Path) -> None:
    """Fabric users write ``lightning.pytorch`` callbacks; the guard calls any Lightning callback's hooks."""
    import lightning.pytorch as unified

    class Counts(unified.Callback):
        steps = 0

        def on_train_batch_end(self, *_: Any) -> None:
            Counts.steps += 1

    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Guard(model, optimizer, None, [Counts()], default_root_dir=tmp_path) as guard:
        model(torch.ones(4, 2)).square().mean().backward()
        guard.step(model.weight.sum())
    assert Counts.steps == 1


def test_an_optimizer_that_evaluates_the_loss_itself_is_refused(tmp_path: Path) -> None:
    """LBFGS's ``step(closure)`` re-evaluates the loss several times a step; the guard steps once with the loop's
    gradients. It was accepted, and the first step ended the guard with LBFGS's own ``TypeError``."""
    model = nn.Linear(2, 1)
    with pytest.raises(TypeError) as info:
        Guard(model, torch.optim.LBFGS(model.parameters()), default_root_dir=tmp_path)
    assert str(info.value) == (
        "'optimizer' is a LBFGS, whose step(closure) evaluates the loss itself, several times a step: a Guard steps "
        "the optimizer once with the gradients the loop computed. Train it with the Trainer and default_callbacks() "
        "(its LightningModule's training_step is the closure)"
    )


def test_a_step_without_gradients_or_with_a_float_loss_is_refused_before_anything_happens(tmp_path: Path) -> None:
    model = nn.Linear(2, 1)
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), default_root_dir=tmp_path)
    before = weights(model)
    loss = model(torch.ones(4, 2)).square().mean()
    with pytest.raises(RuntimeError) as no_backward:
        guard.step(loss)
    assert str(no_backward.value).startswith(
        "Guard.step at step 0: no parameter of the optimizer has a gradient, so there is nothing to judge or step. "
        "Call loss.backward()"
    )
    loss.backward()
    with pytest.raises(TypeError) as number:
        guard.step(1.5)  # type: ignore[arg-type]
    assert str(number.value) == (
        "'loss' must be the loss tensor the backward pass started from, or a non-empty list of the micro-batches' "
        "loss tensors (got float 1.5): pass the tensor, not loss.item()"
    )
    assert guard.global_step == 0 and guard.step(loss).step == 0  # the guard goes on: nothing had happened
    assert not torch.equal(weights(model)["weight"], before["weight"])
    guard.close()


def test_loss_spike_detector_alone_in_a_plain_loop(tmp_path: Path) -> None:
    detector = LossSpikeDetector(warmup=5)
    run = loop(30, [detector], tmp_path, fault=None)
    assert run.guard is not None and not [o for o in run.outcomes if o.skipped]


def test_a_grad_scaler_skip_lowers_the_scale_and_leaves_the_weights(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    with Guard(model, optimizer, scaler=scaler, default_root_dir=tmp_path) as guard:
        for step in range(8):
            loss = nn.functional.mse_loss(model(x), y) * (float("nan") if step == 5 else 1.0)
            before = weights(model)
            scaler.scale(loss).backward()
            outcome = guard.step(loss)
            assert outcome.skipped == (step == 5)
            if step == 5:
                assert_bit_identical(before, weights(model))
                assert scaler.get_scale() == 2.0**9  # the scaler saw the inf/NaN gradients, as under the Trainer


def test_restored_to_after_a_trials_kept_remedy_counts_the_steps_it_trained(tmp_path: Path) -> None:
    """Under ``guard.train_step`` trials run: a remedy kept from the snapshot of step 30 trained 20 steps since, and
    its scheduler stands at step 50. ``restored_to`` says 50 (it said 30: a loop that set its count back to it ended
    20 steps behind the guard's own schedule)."""
    from test_trials import Suspect

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    schedule = sched.LambdaLR(optimizer, lambda n: 1.0)
    data = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=data)
    y = x @ torch.randn(4, 1, generator=data)
    rolled = []
    with Guard(model, optimizer, schedule, callbacks=[Suspect(31), LRBackoff(), Rollback(every_n_steps=10)],
               loss_fn=lambda net, batch: nn.functional.mse_loss(net(batch[0]), batch[1]),
               default_root_dir=tmp_path) as guard:  # fmt: skip
        for step in range(70):
            if guard.global_step == 30:
                with torch.no_grad():
                    model[0].weight.mul_(30.0)
            i = (step * 8) % 64
            outcome = guard.train_step((x[i : i + 8], y[i : i + 8]))
            if outcome.rolled_back:
                rolled.append((outcome.step, outcome.restored_to, schedule.last_epoch))
    assert rolled == [(51, 50, 50)]


def test_the_documented_ema_recipe_keeps_a_loops_ema_in_step_through_a_rollback(tmp_path: Path) -> None:
    """docs/plain-loop.md: an EMA updated after each step that went ahead, reloaded from the model after a rollback.
    An update writes inf into a weight at step 20; the guard finds it at step 21 and restores step 0's snapshot:
    the EMA, which took the inf at step 20, starts again from the restored weights and stays finite."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    ema = copy.deepcopy(model).requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    at = {"step": 0}

    def overflow(*_: Any) -> None:
        if at["step"] == 20:
            with torch.no_grad():
                model[2].weight[0, 0] = math.inf

    optimizer.register_step_post_hook(overflow)
    data = torch.Generator().manual_seed(0)
    rolled = []
    with Guard(model, optimizer, default_root_dir=tmp_path) as guard:
        for step in range(30):
            at["step"] = step
            x = torch.randn(32, 8, generator=data)
            loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
            loss.backward()
            outcome = guard.step(loss, batch=x)
            if outcome.rolled_back or outcome.backed_off:
                ema.load_state_dict(model.state_dict())
                rolled.append((outcome.step, outcome.restored_to))
                assert_bit_identical(weights(ema), weights(model))
            elif not outcome.skipped:
                with torch.no_grad():
                    for average, live in zip(ema.parameters(), model.parameters()):
                        average.mul_(0.99).add_(live, alpha=0.01)
    assert rolled == [(21, 0)]
    assert all(torch.isfinite(p).all() for p in [*ema.parameters(), *model.parameters()])


def test_a_loop_that_unscales_its_gradients_itself_is_told_what_to_remove(tmp_path: Path) -> None:
    """nanoGPT's ``scaler.unscale_(optimizer)`` and ``clip_grad_norm_`` kept above ``guard.step``: torch's own error
    came from inside the step ("unscale_() has already been called...") and closed the guard."""
    model = nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    guard = Guard(model, optimizer, scaler=scaler, default_root_dir=tmp_path)
    scaler.scale(model(torch.randn(8, 4)).pow(2).mean()).backward()
    scaler.unscale_(optimizer)
    before = weights(model)
    with pytest.raises(RuntimeError) as info:
        guard.step(model(torch.randn(8, 4)).pow(2).mean())
    assert str(info.value) == (
        "Guard.step at step 0: the GradScaler's unscale_() was already called on this optimizer since its last "
        "update(), and the guard unscales the gradients itself, so that the suite judges the true ones. Remove the "
        "loop's scaler.unscale_(optimizer) (and the clipping after it, clip_grad_norm_ or fabric.clip_gradients): clip "
        "with Guard(gradient_clip_val=...), where the guard clips after judging the step"
    )
    assert_bit_identical(before, weights(model))
    guard.close()


def test_nan_weights_under_a_grad_scaler_are_said_to_be_the_states_not_a_calibration(tmp_path: Path) -> None:
    """A NaN weight gives NaN gradients, which the GradScaler skips: the outcome names the weights, restored by a
    rollback (it said the scaler had lowered its scale as it calibrates; the rollback had restored the scale)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with Guard(model, optimizer, scaler=scaler, default_root_dir=tmp_path) as guard:
        for step in range(8):
            if step == 5:
                with torch.no_grad():
                    model[2].weight[0, 0] = math.nan
            loss = model(torch.randn(8, 4)).pow(2).mean()
            scaler.scale(loss).backward()
            outcome = guard.step(loss)
            assert outcome.skipped == outcome.rolled_back == (step == 5)
            if step == 5:
                assert outcome.skip_reason == ("the weights held inf/NaN, and so did the gradients: the GradScaler "
                                               "skipped the optimizer step")  # fmt: skip
                assert scaler.get_scale() == 2.0**16 and torch.isfinite(model[2].weight).all()


def _amp_loop(tmp_path: Path | None, init_scale: float, steps: int = 30, nan_at: int | None = None,
              **guard_kwargs: Any) -> tuple[nn.Module, torch.amp.GradScaler, list[StepOutcome]]:  # fmt: skip
    """A plain fp16 loop under ``torch.autocast`` with a ``GradScaler``: guarded (``tmp_path``) or bare (``None``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    guard = Guard(model, optimizer, scaler=scaler, default_root_dir=tmp_path, **guard_kwargs) if tmp_path else None
    data = torch.Generator().manual_seed(0)
    teacher = torch.randn(8, 1, generator=data)
    outcomes = []
    for step in range(steps):
        x = torch.randn(16, 8, generator=data)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), x @ teacher)
        if step == nan_at:
            loss = loss * float("nan")
        scaler.scale(loss).backward()
        if guard is not None:
            outcomes.append(guard.step(loss))
        else:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    if guard is not None:
        guard.close()
    return model, scaler, outcomes


def test_a_scaled_loop_is_judged_on_its_true_loss_and_a_high_initial_scale_is_calibration(tmp_path: Path) -> None:
    """The loss handed to ``guard.step`` is the unscaled one: the suite must not divide it by the scale again (it
    read 2e-12 of the true loss, doubling with every halving of the scale: a false divergence). A scaler started at
    2**40 overflows 24 times more than one started at 2**16 before it comes down to a workable scale: calibration,
    not a collapse."""
    bare, bare_scaler, _ = _amp_loop(None, 2.0**40)
    guarded, scaler, outcomes = _amp_loop(tmp_path, 2.0**40)
    assert_bit_identical(weights(bare), weights(guarded))
    assert scaler.get_scale() == bare_scaler.get_scale() < 2.0**16
    assert not [e for o in outcomes for e in o.events]
    overflowed = [o.step for o in outcomes if o.skipped]
    assert overflowed[:24] == list(range(24))  # the scaler's own skips, each told as one
    assert {o.skip_reason for o in outcomes if o.skipped} == {
        "the GradScaler found inf/NaN gradients: it skipped the optimizer step and lowered its scale, as it does "
        "while it calibrates"
    }


def test_a_nan_loss_under_a_scaler_is_the_suites_skip(tmp_path: Path) -> None:
    guarded, scaler, outcomes = _amp_loop(tmp_path, 2.0**8, steps=12, nan_at=6)
    skipped = [(o.step, o.skip_reason) for o in outcomes if o.skipped]
    assert skipped == [(6, "non-finite loss")]
    assert scaler.get_scale() == 2.0**7  # the scaler saw the inf/NaN gradients and lowered its scale


def test_a_candidates_schedule_steps_on_its_scalers_own_overflow_as_the_loops_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trial's candidate held its schedule on its GradScaler's own overflows (a finite loss), where the loop steps
    its scheduler (as a bare loop and Lightning do): a kept remedy came back with its schedule steps short."""
    from lightning_overflow import candidate

    held = []
    original = candidate.Candidate.train_on

    def train_on(self: Any, *args: Any, **kwargs: Any) -> Any:
        step = original(self, *args, **kwargs)
        held.append(step.skipped and math.isfinite(step.loss))
        return step

    monkeypatch.setattr(candidate.Candidate, "train_on", train_on)
    data = torch.Generator().manual_seed(0)
    x, teacher = torch.randn(40, 16, 8, generator=data), torch.randn(8, 1, generator=data)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1.0)  # far too high: suspicions, trials

    def loss_fn(net: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            out = net(batch)
        return nn.functional.mse_loss(out.float(), batch @ teacher)

    scaler = torch.amp.GradScaler("cpu", growth_interval=7)
    schedule = sched.LambdaLR(optimizer, lambda step: 1.0)
    with Guard(model, optimizer, schedule, scaler=scaler, loss_fn=loss_fn, default_root_dir=tmp_path) as guard:
        for batch in x:
            guard.train_step(batch)
    assert len(held) >= 20 and not any(held)


def _fabric_16_mixed_loop(tmp_path: Path | None, init_scale: float, clip: float | None = None, steps: int = 40,
                          hand_scaler: bool = False, **guard_kwargs: Any
                          ) -> tuple[nn.Module, Any, list[StepOutcome]]:  # fmt: skip
    """A Fabric loop under ``precision="16-mixed"`` (its ``MixedPrecision`` plugin with a CPU ``GradScaler``, as it
    builds one on CUDA), guarded (``tmp_path``; ``hand_scaler``: given that scaler too) or bare (``None``, clipping
    with ``fabric.clip_gradients``)."""
    from lightning.fabric import Fabric
    from lightning.fabric.plugins.precision import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    fabric.seed_everything(0, verbose=False)
    model, optimizer = fabric.setup(*(lambda m: (m, torch.optim.AdamW(m.parameters(), lr=1e-2)))(
        nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))))  # fmt: skip
    guard = None
    if tmp_path is not None:
        if hand_scaler:
            guard_kwargs["scaler"] = scaler
        guard = Guard(model, optimizer, default_root_dir=tmp_path, gradient_clip_val=clip, **guard_kwargs)
    data = torch.Generator().manual_seed(0)
    teacher = torch.randn(8, 1, generator=data)
    outcomes = []
    for _ in range(steps):
        x = torch.randn(16, 8, generator=data)
        loss = nn.functional.mse_loss(model(x).float(), x @ teacher)
        fabric.backward(loss)
        if guard is not None:
            outcomes.append(guard.step(loss))
        else:
            if clip is not None:
                fabric.clip_gradients(model, optimizer, max_norm=clip)
            optimizer.step()
            optimizer.zero_grad()
    if guard is not None:
        guard.close()
    return model, scaler, outcomes


@pytest.mark.parametrize("hand_scaler", [False, True])
def test_under_fabric_16_mixed_the_guard_steps_through_fabrics_scaler_as_a_bare_loop_does(
    tmp_path: Path, hand_scaler: bool
) -> None:
    """Fabric's optimizer steps and updates the scaler of its precision: the guard judges the unscaled gradients,
    lets Fabric step (a skip included, so that the scale comes down), and never updates the scaler twice. Before,
    the first routine overflow was skipped without Fabric's step: the scale never fell, every step overflowed and a
    healthy run ended in ``DivergenceError``; handed the scaler, the guard updated it twice (an ``AssertionError``)."""
    bare, bare_scaler, _ = _fabric_16_mixed_loop(None, 2.0**16)
    guarded, scaler, outcomes = _fabric_16_mixed_loop(tmp_path, 2.0**16, hand_scaler=hand_scaler)
    assert_bit_identical(weights(bare), weights(guarded))
    assert scaler.get_scale() == bare_scaler.get_scale() < 2.0**16  # it overflowed, and came down as bare
    assert [o.step for o in outcomes if o.skipped] and not [e for o in outcomes for e in o.events]


def test_a_scaler_beside_fabrics_own_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as other:
        _fabric_16_mixed_loop(tmp_path, 2.0**16, scaler=torch.amp.GradScaler("cpu"))
    assert str(other.value) == (
        "'scaler' is another GradScaler than the one of Fabric's precision ('16-mixed'), which scales "
        "fabric.backward(loss): pass none, and the guard uses Fabric's"
    )


def test_under_fabric_16_mixed_the_guards_clipping_is_fabrics_on_unscaled_gradients(tmp_path: Path) -> None:
    bare, _, _ = _fabric_16_mixed_loop(None, 2.0**4, clip=0.5)
    guarded, _, outcomes = _fabric_16_mixed_loop(tmp_path, 2.0**4, clip=0.5)
    unclipped, _, _ = _fabric_16_mixed_loop(None, 2.0**4)
    assert not [o for o in outcomes if o.skipped]
    assert_bit_identical(weights(bare), weights(guarded))
    assert not torch.equal(weights(unclipped)["0.weight"], weights(guarded)["0.weight"])


def test_the_readme_snippet_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import re

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Plain PyTorch and Fabric\n") :]
    snippet = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)  # type: ignore[union-attr]
    monkeypatch.chdir(tmp_path)
    model = TinyRegressor()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    before = weights(model)
    namespace = {"model": model, "optimizer": optimizer, "scheduler": sched.StepLR(optimizer, 4),
                 "loader": model.train_dataloader(), "loss_fn": nn.functional.mse_loss}  # fmt: skip
    exec(compile(snippet, "README.md", "exec"), namespace)
    assert namespace["guard"].global_step == 8 and not namespace["outcome"].skipped
    assert any(not torch.equal(a, b) for a, b in zip(before.values(), weights(model).values()))
    # The second snippet: the guard runs each step.
    stepping = re.findall(r"```python\n(.*?)```", section, re.DOTALL)[1]
    after_first = weights(model)
    exec(compile(stepping, "README.md", "exec"), namespace)
    guard = namespace["guard"]
    assert guard.global_step == 8 and guard.board.trials.unavailable == "" and not namespace["outcome"].skipped
    assert any(not torch.equal(a, b) for a, b in zip(after_first.values(), weights(model).values()))
    guard.close()


# ---- the guard that runs the step: trials and replays as under the Trainer -------------------------------------------
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_guard_that_runs_each_step_makes_the_trainers_decisions_with_trials(tmp_path: Path, fault: str) -> None:
    options, steps = FAULTS[fault]
    kind = None if fault == "lr_too_high" else fault
    plain = loop(steps, default_callbacks(), tmp_path / "plain", fault=kind, batches=True, **options)
    fabric = loop(steps, default_callbacks(), tmp_path / "fabric", fault=kind, fabric=True, batches=True, **options)
    trainer = trainer_events(steps, default_callbacks(), tmp_path, kind, **options)
    assert plain.events() and plain.events() == fabric.events() == trainer
    assert_bit_identical(weights(plain.model), weights(fabric.model))


def test_a_guard_that_runs_each_step_replays_a_nonfinite_step_and_names_its_origin(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    x[27, 1] = float("nan")  # batch 3 of 8 samples, row 3

    def loss_fn(net: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.mse_loss(net(batch[0]), batch[1])

    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.01), callbacks=[NonFiniteDetector(action="raise")],
                  default_root_dir=tmp_path, loss_fn=loss_fn)  # fmt: skip
    with pytest.raises(NonFiniteError) as info:
        for start in range(0, 32, 8):
            guard.train_step((x[start : start + 8], y[start : start + 8]))
    error = info.value
    assert error.step == 3 and error.diagnosis is not None and error.diagnosis.verdict == "persistent"
    origin = error.diagnosis.origin
    assert (origin.source, origin.module, origin.op) == ("input", "0", "linear")
    assert "batch 3 holds NaN in row 3" in error.diagnosis.message


def test_train_step_and_step_are_not_mixed_and_train_step_needs_a_loss_fn(tmp_path: Path) -> None:
    model = nn.Linear(2, 1)
    plain = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), default_root_dir=tmp_path)
    with pytest.raises(RuntimeError, match=r"needs Guard\(\.\.\., loss_fn=\.\.\.\)"):
        plain.train_step((torch.ones(4, 2), torch.ones(4, 1)))
    plain.close()
    stepping = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), default_root_dir=tmp_path,
                     loss_fn=lambda net, batch: net(batch).square().mean())  # fmt: skip
    with pytest.raises(RuntimeError, match="this Guard was given loss_fn"):
        stepping.step(torch.zeros(()))
    assert stepping.board.trials.unavailable == ""  # one process, the batch in hand: trials can run
    stepping.close()
    with pytest.raises(ValueError, match="'backward' is used by train_step only"):
        Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), backward=lambda loss: None)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_under_fabrics_precision_a_candidate_trains_through_fabrics_forward(tmp_path: Path, precision: str) -> None:
    """Fabric's mixed precision requires fabric.backward for every backward pass through its module: a candidate's
    own backward runs on the module as Fabric's forward (inputs converted, autocast), not through that check."""
    from lightning.fabric import Fabric

    pl.seed_everything(0, verbose=False)
    model = TinyRegressor()
    fabric = Fabric(accelerator="cpu", devices=1, precision=precision)  # type: ignore[arg-type]
    trained, optimizer = fabric.setup(model, model.configure_optimizers())
    guard = Guard(trained, optimizer, callbacks=default_callbacks(trial=TrialConfig(every_n_steps=10)),
                  default_root_dir=tmp_path, backward=fabric.backward,
                  loss_fn=lambda net, batch: nn.functional.mse_loss(net(batch[0]), batch[1]))  # fmt: skip
    for _ in range(4):
        for batch in model.train_dataloader():
            guard.train_step(batch)
    guard.close()
    assert [(e.step, e.kind) for e in guard.events if e.kind == "trial"] == [(30, "trial")]
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


@pytest.mark.parametrize(
    ("schedule", "suspected", "nan_weight_at", "scale"),
    [(lambda step: 0.01 * min(1.0, (step + 1) / 60), 30, None, 1.0),
     (lambda step: 0.01 if step < 32 else 0.001, 35, None, 1.0),
     (lambda step: 0.01 if step < 34 else 0.001, 35, 12, 0.5)],
    ids=["a_warm_up", "a_step_down_before_the_trial_then_the_same_rate",
         "a_step_down_written_once_after_a_backoff"],
)  # fmt: skip
def test_a_trials_candidates_train_at_the_rate_the_loop_writes_before_each_step(
    tmp_path: Path, schedule: Callable[[int], float], suspected: int, nan_weight_at: int | None, scale: float
) -> None:
    """A litgpt-style loop writes its own schedule into the param groups before each step. The candidates of the
    trial ran at the rate they were captured with, times their factor, while the loop's rose (a warm-up); or, once
    a loop's rate that stepped down before the trial opened stayed the same, at their snapshot's: a remedy kept at
    "x0.5" had been measured at a rate the run never used. Each candidate now trains at the loop's rate of the step
    times its factor, as the run does at its own scale."""
    from test_trials import Suspect

    from lightning_overflow import side_run

    pl.seed_everything(0, verbose=False)
    model = TinyRegressor(optimizer="sgd")
    optimizer = model.configure_optimizers()
    used: list[tuple[str | None, float]] = []
    optimizer.register_step_pre_hook(lambda opt, *_: used.append((side_run(), opt.param_groups[0]["lr"])))
    callbacks = [NonFiniteDetector(), Suspect(suspected), LRBackoff(), Rollback(every_n_steps=10)]
    guard = Guard(model, optimizer, callbacks=callbacks, default_root_dir=tmp_path,
                  loss_fn=lambda net, batch: nn.functional.mse_loss(net(batch[0]), batch[1]))  # fmt: skip
    written: list[float] = []
    while len(written) < 60:
        for x, y in model.train_dataloader():
            if len(written) == nan_weight_at:  # a backoff to 0.5x, and a rollback
                with torch.no_grad():
                    model.net[0].weight.view(-1)[0] = float("nan")
            written.append(schedule(len(written)))
            if nan_weight_at is None or len(written) in (1, 35):  # written when it changes only, after the snapshot
                for group in optimizer.param_groups:
                    group["lr"] = written[-1]
            guard.train_step((x, y))
    guard.close()
    trial = [rate for kind, rate in used if kind == "trial"]
    steps = range(suspected + 1, suspected + 21)
    assert trial == pytest.approx([written[step] * scale * f for step in steps for f in (0.5, 0.125)], rel=1e-12)
    if nan_weight_at is None:
        assert [rate for kind, rate in used if kind is None] == written  # a false alarm: the run as it was


def test_a_trials_candidates_step_an_epoch_schedule_as_the_loop_ends_each_epoch(tmp_path: Path) -> None:
    """``guard.end_epoch()`` steps a ``StepLR`` of ``scheduler_interval="epoch"`` outside every batch. The trial opened
    at step 30 spans the epoch ends at steps 32, 40 and 48: its candidates' schedules never stepped there, and a
    remedy kept came back an epoch behind for each. They step now as the loop's does."""
    from test_trials import Suspect

    from lightning_overflow import side_run

    pl.seed_everything(0, verbose=False)
    model = TinyRegressor(optimizer="sgd")  # eight batches an epoch
    optimizer = model.configure_optimizers()
    scheduler = sched.StepLR(optimizer, step_size=1, gamma=0.9)
    used: list[tuple[str | None, float]] = []
    optimizer.register_step_pre_hook(lambda opt, *_: used.append((side_run(), opt.param_groups[0]["lr"])))
    guard = Guard(model, optimizer, scheduler, [Suspect(30), LRBackoff(), Rollback(every_n_steps=10)],
                  scheduler_interval="epoch", default_root_dir=tmp_path,
                  loss_fn=lambda net, batch: nn.functional.mse_loss(net(batch[0]), batch[1]))  # fmt: skip
    for _ in range(7):
        for x, y in model.train_dataloader():
            guard.train_step((x, y))
        guard.end_epoch()
    guard.close()
    trial = [rate for kind, rate in used if kind == "trial"]
    expected = [0.01 * 0.9 ** (step // 8) * factor for step in range(31, 51) for factor in (0.5, 0.125)]
    assert trial == pytest.approx(expected, rel=1e-12)
    assert scheduler.last_epoch == 7


def test_a_trials_candidates_step_a_plateau_schedule_on_the_metric_the_loop_passes(tmp_path: Path) -> None:
    """``guard.end_epoch(metric)`` steps a ``ReduceLROnPlateau`` on the loop's metric. The trial opened at step 30
    spans the epoch ends at steps 32, 40 and 48, each a cut: the candidates' schedules never stepped there and ran at
    their snapshot's rate all along. They step now on the same metric."""
    from test_trials import Suspect

    from lightning_overflow import side_run

    pl.seed_everything(0, verbose=False)
    model = TinyRegressor(optimizer="sgd")  # eight batches an epoch
    optimizer = model.configure_optimizers()
    plateau = sched.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=0)  # the epoch's loss falls: a cut
    used: list[tuple[str | None, int, float]] = []
    optimizer.register_step_pre_hook(lambda opt, *_: used.append((side_run(), step, opt.param_groups[0]["lr"])))
    guard = Guard(model, optimizer, plateau, [Suspect(30), LRBackoff(), Rollback(every_n_steps=10)],
                  scheduler_interval="epoch", default_root_dir=tmp_path,
                  loss_fn=lambda net, batch: nn.functional.mse_loss(net(batch[0]), batch[1]))  # fmt: skip
    step = 0
    for epoch in range(7):
        for x, y in model.train_dataloader():
            guard.train_step((x, y))
            step += 1
        guard.end_epoch(1.0 / (epoch + 1))
    guard.close()
    run = {at: rate for kind, at, rate in used if kind is None}
    trial = [(at, rate) for kind, at, rate in used if kind == "trial" and at <= 50]
    assert [at for at, _ in trial] == [at for at in range(31, 51) for _ in range(2)]
    assert [rate for _, rate in trial] == [run[at] * factor for at in range(31, 51) for factor in (0.5, 0.125)]
    assert len({run[at] for at in range(31, 51)}) == 4  # the cuts at 32, 40 and 48 happened in the trial


def _accumulating_loop(tmp_path: Path, show: bool) -> Guard:
    """Two micro-batches a step; the first micro-batch of steps 10, 11 and 12 holds one NaN feature."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(40 * 32, 8, generator=g), torch.randn(8, 1, generator=g)
    y = x @ w
    guard = Guard(model, optimizer, callbacks=default_callbacks(), default_root_dir=tmp_path)
    for step in range(16):
        micro = [(x[i : i + 16].clone(), y[i : i + 16]) for i in (32 * step, 32 * step + 16)]
        if step in (10, 11, 12):
            micro[0][0][3, 2] = math.nan
        losses = [nn.functional.mse_loss(model(mx), my) for mx, my in micro]
        for loss in losses:
            (loss / 2).backward()
        guard.step(losses, batch=micro) if show else guard.step(losses)
    guard.close()
    return guard


def test_the_batches_handed_to_step_tell_a_data_fault_from_a_failing_state(tmp_path: Path) -> None:
    """NaN rows in three consecutive steps of a plain loop: shown the micro-batches, the guard skips them as data
    faults and leaves the state and the rate alone; not shown them, it cannot tell, and says so (it said the
    batches held no inf/NaN)."""
    events = _accumulating_loop(tmp_path / "shown", show=True).board.journal.events
    faults = [e for e in events if e.kind == "data_fault"]
    assert [(e.step, e.details["batch"]) for e in faults] == [(10, 10), (11, 11), (12, 12)]
    assert {e.kind for e in events} == {"data_fault", "skip"}
    for fault in faults:  # said once (it was said twice, read with two all-reduces)
        sentence = (f"Batch {fault.step} holds inf/NaN or values beyond 1e15 (a micro-batch accumulated into the step "
                    "before its last): a data fault.")  # fmt: skip
        assert fault.message.endswith(f"runs through. {sentence}") and fault.message.count(sentence) == 1
    unseen = _accumulating_loop(tmp_path / "unseen", show=False).board.journal.events
    (persistent,) = [e for e in unseen if e.kind == "backoff"]
    assert "on batches it was not shown (Guard.step(loss) sees no batch" in persistent.message


def test_step_refuses_a_batch_that_is_not_one_per_loss(tmp_path: Path) -> None:
    model, optimizer = _model_and_optimizer()
    loss = model(torch.ones(2, 3)).sum()
    loss.backward()
    with Guard(model, optimizer, default_root_dir=tmp_path) as guard, pytest.raises(ValueError) as info:
        guard.step([loss, loss.detach()], batch=(torch.ones(2, 3),))
    assert str(info.value) == ("'batch' must be the list of the 2 micro-batches the 2 losses came from, one per "
                               "loss (got a tuple of 1)")  # fmt: skip
