"""Rollback: restores the last verified-finite state bit for bit, within a budget; no poisoned checkpoint."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import (
    assert_bit_identical,
    assert_optimizer_state_equal,
    fit,
    make_trainer,
    optimizer_state,
    tuned,
    weights,
)
from fsspec.implementations.local import LocalFileSystem
from pytorch_lightning.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from pytorch_lightning.plugins import MixedPrecision
from test_trials import ManualTiny
from typing_extensions import override

from lightning_overflow import LRBackoff, default_callbacks, snapshot_store
from lightning_overflow._compat import Callback
from lightning_overflow.callbacks._base import SuiteCallback
from lightning_overflow.callbacks.nonfinite_detector import NonFiniteDetector
from lightning_overflow.callbacks.rollback import Rollback
from lightning_overflow.exceptions import DivergenceError, OverflowWarning, RollbackError
from lightning_overflow.numerics.snapshots import named_state_tensors
from lightning_overflow.snapshot_store import load_snapshot, save_snapshot
from lightning_overflow.testing import Fault, FaultInjector, TinyGAN, TinyRegressor

SNAP = "rollback-step={}.pt"
RESUME = pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")


# ---- helpers ----------------------------------------------------------------------------------------------------
class Probe(Callback):
    """Records the full training state at the start of training and at the end of every batch, by ``global_step``
    (put it after Rollback: it then sees the state Rollback left)."""

    def __init__(self) -> None:
        self.at: dict[int, dict[str, Any]] = {}

    def _record(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        return {
            "weights": weights(pl_module),
            "optimizers": [optimizer_state(o) for o in trainer.optimizers],
            "schedulers": [copy.deepcopy(c.scheduler.state_dict()) for c in trainer.lr_scheduler_configs],
            "scaler": copy.deepcopy(trainer.precision_plugin.state_dict()),
            "lr": [g["lr"] for o in trainer.optimizers for g in o.param_groups],
        }

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.at[trainer.global_step] = self._record(trainer, pl_module)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        self.at[trainer.global_step] = self._record(trainer, pl_module)


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert_bit_identical(a["weights"], b["weights"])
    assert len(a["optimizers"]) == len(b["optimizers"])
    for x, y in zip(a["optimizers"], b["optimizers"]):
        assert_optimizer_state_equal(x, y)
        assert x["param_groups"] == y["param_groups"]
    assert a["schedulers"] == b["schedulers"]
    assert a["scaler"] == b["scaler"]


def all_finite(tensors: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors.values() if t.is_floating_point())


class SpikeSignal(SuiteCallback):
    """A stand-in spike detector: signals ``loss_spike`` when the step's mean loss exceeds ``threshold``."""

    def __init__(self, threshold: float = 100.0) -> None:
        self.threshold = threshold

    @override
    def _judge(self, trainer: pl.Trainer, record: Any) -> None:
        if record.loss_mean > self.threshold:
            self._signal(trainer, "loss_spike", f"loss {record.loss_mean:.3g} > {self.threshold:g}")


class FakeBackoff(SuiteCallback):
    """Follows the rollback protocol the way LRBackoff does: halves the LR on a trigger, re-applies it on restore."""

    def __init__(self) -> None:
        self.scale = 1.0
        self.received: list[dict[str, Any]] = []

    @override
    def _after_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> None:
        if any(s.kind == "nonfinite_state" for s in self.board(trainer).signals):
            self._rescale(trainer, 0.5)

    @override
    def _snapshot_extra(self) -> dict[str, Any]:
        return {"scale": self.scale}

    @override
    def _after_restore(self, trainer: pl.Trainer, extra: dict[str, Any]) -> None:
        self.received.append(dict(extra))
        self._multiply_lr(trainer, self.scale / extra["scale"])  # the restored LR carries the snapshot's scale

    def _rescale(self, trainer: pl.Trainer, factor: float) -> None:
        self.scale *= factor
        self._multiply_lr(trainer, factor)

    def _multiply_lr(self, trainer: pl.Trainer, factor: float) -> None:
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                group["lr"] *= factor


def step_lr(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.9)


def nan_at(*steps: int, **kwargs: Any) -> FaultInjector:
    return FaultInjector(*(Fault(step=s, kind="nan_weight", **kwargs) for s in steps))


def journal_kinds(trainer: pl.Trainer, callback: SuiteCallback) -> list[str]:
    return [e.kind for e in callback.board(trainer).journal.events]


def checkpoint_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.ckpt"))


def assert_checkpoint_finite(path: Path) -> None:
    checkpoint = torch.load(path, weights_only=True)
    assert all_finite(checkpoint["state_dict"]), f"{path.name} holds non-finite weights"
    for state in checkpoint.get("optimizer_states", []):
        for values in state["state"].values():
            assert all_finite({k: v for k, v in values.items() if isinstance(v, torch.Tensor)}), path.name


# ---- arguments --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"every_n_steps": 0}, ValueError, "'every_n_steps' must be >= 1 (got 0)"),
        ({"keep": 1.5}, TypeError, "'keep' must be an int (got 1.5)"),
        ({"max_rollbacks": 0}, ValueError, "'max_rollbacks' must be >= 1 (got 0)"),
        ({"dirpath": 3}, TypeError, "'dirpath' must be a path or None (got 3)"),
        ({"dirpath": ""}, ValueError, "'dirpath' must be a non-empty path or None (got '')"),
        ({"triggers": "loss_spike"}, TypeError, "'triggers' must be a collection of signal kinds (got 'loss_spike')"),
        ({"triggers": ("loss_spike", "boom")}, ValueError, "'triggers' must be one of 'nonfinite', "),
        ({"triggers": ()}, ValueError, "'triggers' must be a non-empty collection of signal kinds (got ())"),
        ({"triggers": []}, ValueError, "'triggers' must be a non-empty collection of signal kinds (got [])"),
    ],
)
def test_arguments_are_checked(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error) as info:
        Rollback(**kwargs)
    assert str(info.value).startswith(message)


def test_restores_state_follows_the_triggers() -> None:
    assert Rollback.restores_state is True
    assert Rollback().restores_state is True
    assert Rollback(triggers=("loss_spike",)).restores_state is False


@pytest.mark.parametrize("strategy", ["FSDPStrategy", "DeepSpeedStrategy"])
def test_strategies_the_suite_refuses_are_refused_by_rollback_in_setup(strategy: str) -> None:
    from pytorch_lightning import strategies

    cls = getattr(strategies, strategy)
    instance = cls() if strategy == "FSDPStrategy" else cls.__new__(cls)  # DeepSpeed's __init__ needs deepspeed
    with pytest.raises(NotImplementedError, match=f"^Rollback does not support {strategy}: ") as caught:
        Rollback().setup(SimpleNamespace(strategy=instance), TinyRegressor(), "fit")  # type: ignore[arg-type]
    supported = "ModelParallelStrategy (FSDP2: fully_shard in configure_model; there AutoClip(mode='agc') is not "
    supported += "supported)"
    assert supported in str(caught.value)


def test_a_sharded_strategy_rollback_has_not_run_under_is_refused_in_setup() -> None:
    class XLAStrategy:  # named as Lightning's (torch_xla is not installed here)
        pass

    with pytest.raises(NotImplementedError) as caught:
        Rollback().setup(SimpleNamespace(strategy=XLAStrategy()), TinyRegressor(), "fit")  # type: ignore[arg-type]
    assert str(caught.value) == (
        "Rollback does not support XLAStrategy: Rollback has not been run under it, and its ranks may hold parts of "
        "the state. Use strategy='ddp', or ModelParallelStrategy with fully_shard in configure_model (FSDP2), with a "
        "plain torch optimizer, or remove Rollback from the callbacks."
    )


# ---- rolling back -----------------------------------------------------------------------------------------------
def test_nan_weights_are_rolled_back_bit_for_bit() -> None:
    rollback, probe = Rollback(every_n_steps=3), Probe()
    model = TinyRegressor(scheduler=step_lr)
    trainer = fit(model, [NonFiniteDetector(), rollback, probe, nan_at(5)], max_steps=12)

    assert rollback.history == [
        {"step": 6, "reason": "nonfinite_state", "trigger_step": 5, "snapshot_step": 3, "source": "memory"}
    ]
    assert_same_state(probe.at[6], probe.at[3])  # weights, Adam moments and steps, scheduler, lr
    assert probe.at[6]["optimizers"][0]["state"][0]["step"].item() == 3.0
    assert trainer.global_step == 12 and all_finite(weights(model))
    assert rollback.rollbacks == 1 and rollback.snapshot_steps == [9, 12]
    # The scheduler went back 3 steps with the weights: the fit's end says so.
    assert journal_kinds(trainer, rollback) == ["nonfinite", "rollback", "schedule_behind"]
    assert rollback.board(trainer).journal.events[-1].details["behind"] == 3


def test_without_a_detector_the_snapshot_check_finds_the_nan() -> None:
    rollback, probe = Rollback(every_n_steps=2), Probe()
    trainer = fit(TinyRegressor(), [rollback, probe, nan_at(3)], max_steps=8)
    assert [(h["step"], h["reason"], h["snapshot_step"]) for h in rollback.history] == [(4, "nonfinite_state", 2)]
    assert_same_state(probe.at[4], probe.at[2])
    assert journal_kinds(trainer, rollback) == ["snapshot_refused", "rollback"]
    assert all_finite(weights(trainer.lightning_module))


def test_poison_batch_is_rolled_back_and_training_goes_on_from_the_snapshot() -> None:
    rollback, probe = Rollback(every_n_steps=2, triggers=("loss_spike",)), Probe()
    injector = FaultInjector(Fault(step=6, kind="loss_spike", factor=1e4))
    trainer = fit(TinyRegressor(scheduler=step_lr), [SpikeSignal(), rollback, probe, injector], max_steps=12)

    assert rollback.history == [
        {"step": 7, "reason": "loss_spike", "trigger_step": 6, "snapshot_step": 6, "source": "memory"}
    ]
    assert_same_state(probe.at[7], probe.at[6])
    # Step 7 trains again from the snapshot.
    assert not torch.equal(probe.at[8]["weights"]["net.0.weight"], probe.at[7]["weights"]["net.0.weight"])
    events = rollback.board(trainer).journal.events
    assert [(e.kind, e.step) for e in events if e.source == "Rollback"] == [("rollback", 7)]


def test_a_second_rollback_to_the_same_snapshot_goes_further_back() -> None:
    rollback, probe = Rollback(every_n_steps=2, keep=2), Probe()
    fit(TinyRegressor(), [NonFiniteDetector(), rollback, probe, nan_at(5, 6)], max_steps=10)
    assert [(h["step"], h["snapshot_step"]) for h in rollback.history] == [(6, 4), (7, 2)]
    assert_same_state(probe.at[7], probe.at[2])
    assert rollback.snapshot_steps == [2, 9]  # step 4 is dropped; counting starts afresh after each rollback


def test_budget_runs_out_with_divergence_error_naming_every_rollback() -> None:
    rollback, probe = tuned(Rollback(every_n_steps=2, max_rollbacks=2), window=100), Probe()
    model = TinyRegressor()
    trainer = make_trainer([NonFiniteDetector(), rollback, probe, nan_at(3, 7, 11)], max_steps=14)
    with pytest.raises(DivergenceError) as info:
        trainer.fit(model)
    error = info.value
    assert error.step == 12
    assert error.history == [
        {"step": 4, "reason": "nonfinite_state", "trigger_step": 3, "snapshot_step": 2, "source": "memory"},
        {"step": 8, "reason": "nonfinite_state", "trigger_step": 7, "snapshot_step": 6, "source": "memory"},
    ]
    message = str(error)
    assert "diverged again at step 12 on rank 0 (every rank stops together) (nonfinite_state at step 11" in message
    assert "after 2 rollback(s) within 100 steps (max_rollbacks=2)" in message
    assert "step 4: nonfinite_state at step 3 -> snapshot of step 2; step 8: nonfinite_state at step 7 -> " in message
    assert "The snapshot of step 10 was restored before stopping" in message and "HINT:" in message
    assert_bit_identical(weights(model), probe.at[10]["weights"])  # restored before raising: finite
    assert journal_kinds(trainer, rollback)[-1] == "abort"


def test_rollbacks_outside_the_window_do_not_count() -> None:
    rollback = tuned(Rollback(every_n_steps=2, max_rollbacks=1), window=4)
    trainer = fit(TinyRegressor(), [NonFiniteDetector(), rollback, nan_at(2, 8)], max_steps=12)
    assert [h["step"] for h in rollback.history] == [3, 9] and trainer.global_step == 12


def test_rollback_error_when_no_state_was_ever_finite() -> None:
    """A NaN in the weights before the first update (an initialisation computed from data holding inf/NaN, as
    pytorch-tabular's GANDALF does): no rollback target, no backoff (the rate is not the cause: it said "consider
    starting at 0.5x the learning rate"), and a hint about what set the state (it said to resume from a checkpoint
    written before the divergence)."""
    model = TinyRegressor()
    with torch.no_grad():
        model.net[0].weight[0, 0] = float("nan")
    rollback, backoff = Rollback(every_n_steps=2), LRBackoff()
    with pytest.warns(OverflowWarning, match="the fit starts from a non-finite state, which is no"), pytest.raises(
        RollbackError
    ) as info:
        fit(model, [NonFiniteDetector(), backoff, rollback])
    assert info.value.step == 1
    assert str(info.value).startswith(
        "Rollback: a rollback was needed at step 1 (nonfinite_state at step 0: NonFiniteDetector: the weights "
    )
    assert "no snapshot verified finite exists" in str(info.value)
    assert str(info.value).endswith(
        "HINT: the state held inf/NaN before the fit's first update, which no learning rate or rollback can mend: "
        "look at what set it (the model's initialisation, one computed from the data such as a mean of targets "
        "holding inf/NaN, or the checkpoint or weights it was loaded from)."
    )
    assert backoff.history == [] and backoff.scales == [1.0]


def test_healthy_run_is_bit_identical_with_and_without_rollback(tmp_path: Path) -> None:
    plain = TinyRegressor(dropout=0.2, scheduler=step_lr)  # dropout: any RNG draw by Rollback would show
    fit(plain, [], max_steps=10)
    pl.seed_everything(0, verbose=False)
    guarded = TinyRegressor(dropout=0.2, scheduler=step_lr)
    rollback = Rollback(every_n_steps=1, dirpath=tmp_path)
    trainer = fit(guarded, [rollback], max_steps=10)
    assert_bit_identical(weights(plain), weights(guarded))
    assert_optimizer_state_equal(optimizer_state(plain.optimizers().optimizer), optimizer_state(trainer.optimizers[0]))
    assert rollback.rollbacks == 0 and rollback.snapshot_steps == [9, 10]


def test_huge_but_finite_adam_moments_are_no_reason_to_roll_back(tmp_path: Path) -> None:
    """Gradients near 1e12 leave Adam's exp_avg_sq near 1e21: finite, though the FP32 L2 norm of it overflows. Such
    a state must pass the snapshot check and the checkpoint guard."""
    rollback = Rollback(every_n_steps=2)
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    spike = FaultInjector(Fault(step=3, kind="loss_spike", factor=1e13))
    trainer = fit(TinyRegressor(), [rollback, checkpoints, spike], max_steps=8, enable_checkpointing=True)
    assert journal_kinds(trainer, rollback) == []  # no snapshot refused, no rollback, no checkpoint refused
    assert rollback.rollbacks == 0 and rollback.snapshot_steps == [6, 8]
    assert len(checkpoint_files(tmp_path)) == 8
    moments = [state["exp_avg_sq"] for state in trainer.optimizers[0].state.values()]
    assert max(m.max().item() for m in moments) > 1e20  # squares beyond 1e40: the FP32 L2 norm is inf
    assert all(bool(torch.isfinite(m).all()) for m in moments)


def test_a_reused_instance_starts_every_fit_afresh() -> None:
    rollback = Rollback(every_n_steps=2, max_rollbacks=1)
    fit(TinyRegressor(), [NonFiniteDetector(), rollback, nan_at(3)], max_steps=5)
    assert [h["step"] for h in rollback.history] == [4]

    # A second fit: the budget is whole again (the first fit's rollback is not in its window).
    fit(TinyRegressor(), [NonFiniteDetector(), rollback, nan_at(3)], max_steps=5)
    assert [(h["step"], h["snapshot_step"]) for h in rollback.history] == [(4, 2)]
    assert rollback.rollbacks == 1

    # A third, healthy fit: nothing left over from the second; bit-identical with a fit without Rollback.
    pl.seed_everything(0, verbose=False)
    plain = TinyRegressor()
    fit(plain, [], max_steps=5)
    pl.seed_everything(0, verbose=False)
    guarded = TinyRegressor()
    fit(guarded, [rollback], max_steps=5)
    assert_bit_identical(weights(plain), weights(guarded))
    assert rollback.history == [] and rollback.rollbacks == 0
    assert rollback.snapshot_steps == [2, 4]


def test_after_restore_keeps_a_backoff_in_either_order() -> None:
    for order in ("backoff_first", "rollback_first"):
        pl.seed_everything(0, verbose=False)
        rollback, backoff, probe = Rollback(every_n_steps=2), FakeBackoff(), Probe()
        callbacks = [backoff, rollback] if order == "backoff_first" else [rollback, backoff]
        fit(TinyRegressor(optimizer="sgd"), [NonFiniteDetector(), *callbacks, probe, nan_at(3)], max_steps=6)
        assert backoff.received == [{"scale": 1.0}], order
        assert probe.at[4]["lr"] == [0.005], order  # the snapshot's lr, halved once
        assert_bit_identical(probe.at[4]["weights"], probe.at[2]["weights"])
        assert backoff.scale == 0.5


def _full_loss(model: TinyRegressor) -> float:
    x, y = model.data.tensors
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(x), y).item()


def test_poison_batch_with_spike_detector_and_lr_backoff_in_either_order() -> None:
    from lightning_overflow.callbacks.loss_spike_detector import LossSpikeDetector
    from lightning_overflow.callbacks.lr_backoff import LRBackoff

    clean = TinyRegressor()
    fit(clean, [], max_steps=60)
    finals = []
    for order in ("backoff_first", "rollback_first"):
        pl.seed_everything(0, verbose=False)
        model, rollback, backoff = (TinyRegressor(), Rollback(every_n_steps=5, triggers=("loss_spike",)),
                                   LRBackoff(factor=0.5, triggers=("loss_spike",)))
        pair = [backoff, rollback] if order == "backoff_first" else [rollback, backoff]
        poison = FaultInjector(Fault(step=30, kind="loss_spike", factor=1e4))
        trainer = fit(model, [NonFiniteDetector(), LossSpikeDetector(warmup=10), *pair, poison], max_steps=60)
        assert rollback.history == [
            {"step": 31, "reason": "loss_spike", "trigger_step": 30, "snapshot_step": 30, "source": "memory"}
        ], order
        assert backoff.scales == [0.5] and trainer.optimizers[0].param_groups[0]["lr"] == 0.005, order
        assert abs(_full_loss(model) - _full_loss(clean)) < 0.1 * _full_loss(clean), order
        finals.append(weights(model))
    assert_bit_identical(finals[0], finals[1])  # the order of the two callbacks makes no difference


# ---- mixed precision, manual optimization, accumulation ---------------------------------------------------------
def test_16_mixed_restores_the_grad_scaler() -> None:
    before, rollback, after = Probe(), Rollback(every_n_steps=3), Probe()
    callbacks = [before, NonFiniteDetector(), rollback, after, nan_at(5)]
    model = TinyRegressor()
    fit(model, callbacks, max_steps=10, plugins=[MixedPrecision("16-mixed", "cpu")])
    assert [h["snapshot_step"] for h in rollback.history] == [3]
    assert before.at[6]["scaler"]["scale"] == after.at[3]["scaler"]["scale"] / 2  # the NaN step halved it...
    assert after.at[6]["scaler"] == after.at[3]["scaler"]  # ...and the rollback put it back
    assert_same_state(after.at[6], after.at[3])
    assert all_finite(weights(model))


def test_bf16_mixed_rolls_back() -> None:
    rollback, probe = Rollback(every_n_steps=3), Probe()
    model = TinyRegressor()
    fit(model, [NonFiniteDetector(), rollback, probe, nan_at(4)], max_steps=8, precision="bf16-mixed")
    assert [(h["step"], h["snapshot_step"]) for h in rollback.history] == [(5, 3)]
    assert_same_state(probe.at[5], probe.at[3])
    assert all_finite(weights(model))


def test_manual_optimization_restores_both_optimizers() -> None:
    rollback, probe = Rollback(every_n_steps=2), Probe()
    model = TinyGAN()
    injector = nan_at(4, parameter="discriminator.0.weight")
    trainer = fit(model, [NonFiniteDetector(), rollback, probe, injector], max_steps=12)
    assert [(h["step"], h["reason"], h["snapshot_step"]) for h in rollback.history] == [(6, "nonfinite_state", 4)]
    assert_same_state(probe.at[6], probe.at[4])
    assert len(probe.at[6]["optimizers"]) == 2 and probe.at[6]["optimizers"][1]["state"]
    assert trainer.global_step == 12 and all_finite(weights(model))


def test_gradient_accumulation() -> None:
    rollback, probe = Rollback(every_n_steps=2), Probe()
    model = TinyRegressor(scheduler=step_lr)
    trainer = fit(model, [NonFiniteDetector(), rollback, probe, nan_at(3)], max_steps=8, accumulate_grad_batches=2)
    assert [(h["step"], h["snapshot_step"]) for h in rollback.history] == [(4, 2)]
    assert_same_state(probe.at[4], probe.at[2])
    assert trainer.global_step == 8 and all_finite(weights(model))


# ---- state and resume -------------------------------------------------------------------------------------------
def test_state_dict_loads_with_weights_only(tmp_path: Path) -> None:
    rollback = Rollback(every_n_steps=2, dirpath=tmp_path / "snaps")
    fit(TinyRegressor(), [NonFiniteDetector(), rollback, nan_at(3)], max_steps=6)
    torch.save(rollback.state_dict(), tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    other = Rollback(every_n_steps=2, dirpath=tmp_path / "snaps")
    other.load_state_dict(state)
    assert other.history == rollback.history and other.rollbacks == 1
    assert [{k: v for k, v in e.items() if k != "digests"} for e in state["disk"]] == [
        {"step": 2, "file": SNAP.format(2)}, {"step": 6, "file": SNAP.format(6)}
    ]
    assert all(len(e["digests"]) == 1 and len(e["digests"][0]) == 64 for e in state["disk"])  # one rank's sha256


def test_disk_snapshots_are_pruned_and_hold_the_state(tmp_path: Path) -> None:
    rollback, probe = Rollback(every_n_steps=2, keep=2, dirpath=tmp_path), Probe()
    model = TinyRegressor()
    fit(model, [rollback, probe], max_steps=8)
    assert sorted(os.listdir(tmp_path)) == [SNAP.format(6), SNAP.format(8)]
    for step in (6, 8):
        raw = torch.load(tmp_path / SNAP.format(step), weights_only=True)
        assert raw["step"] == step
        assert_bit_identical(dict(raw["payload"]["state"]["model"]), probe.at[step]["weights"])


def _first_run(tmp_path: Path, faults: FaultInjector, max_steps: int, every: int, **kwargs: Any) -> Path:
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=every, save_top_k=-1)
    rollback = Rollback(every_n_steps=2, dirpath=tmp_path / "snaps", **kwargs)
    fit(TinyRegressor(), [NonFiniteDetector(), rollback, faults, checkpoints], max_steps=max_steps,
        enable_checkpointing=True)
    return next(p for p in checkpoint_files(tmp_path / "ckpt") if f"step={every}" in p.name)


def _resume(
    tmp_path: Path, ckpt: Path, faults: FaultInjector, max_steps: int, **kwargs: Any
) -> tuple[Rollback, pl.Trainer]:
    rollback = Rollback(every_n_steps=2, dirpath=tmp_path / "snaps", **kwargs)
    trainer = make_trainer([NonFiniteDetector(), rollback, faults], max_steps=max_steps)
    trainer.fit(TinyRegressor(), ckpt_path=ckpt)
    return rollback, trainer


@RESUME
@pytest.mark.parametrize("on_disk", [False, True])
def test_a_fit_resumed_without_files_says_its_earlier_snapshots_are_gone(
    on_disk: bool, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A GPT-2 at 100x its rate, resumed at step 64 without ``dirpath``: its next trial restarted from the damaged state
    it resumed from ("the snapshot of step 64, where the fit started"), 2.94 against 1.08 uninterrupted, unsaid."""
    files = {"dirpath": tmp_path / "snaps"} if on_disk else {}
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=6, save_top_k=-1)
    fit(TinyRegressor(), [Rollback(every_n_steps=2, **files), checkpoints], max_steps=6, enable_checkpointing=True)
    ckpt = next(p for p in checkpoint_files(tmp_path / "ckpt") if "step=6" in p.name)
    with caplog.at_level(logging.INFO, logger="lightning_overflow"):
        make_trainer([Rollback(every_n_steps=2, **files)], max_steps=8).fit(TinyRegressor(), ckpt_path=ckpt)
    said = [r.message for r in caplog.records if "resumed at step" in r.message]
    assert said == ([] if on_disk else [
        "Rollback: this fit resumed at step 6; the snapshots of the fit it resumes were kept in memory and are gone, "
        "so the oldest state a rollback can return to is the one it resumed from. Rollback(dirpath=...) "
        "(default_callbacks(dirpath=...)) keeps them in files a resumed fit reads."])


@RESUME
def test_resume_keeps_the_rollback_budget(tmp_path: Path) -> None:
    ckpt = _first_run(tmp_path, nan_at(3), max_steps=6, every=6, max_rollbacks=2)
    with pytest.raises(DivergenceError) as info:
        _resume(tmp_path, ckpt, nan_at(7, 9), max_steps=14, max_rollbacks=2)
    assert [(h["step"], h["snapshot_step"]) for h in info.value.history] == [(4, 2), (8, 6)]
    assert "step 4: nonfinite_state at step 3 -> snapshot of step 2" in str(info.value)


@RESUME
def test_resume_rolls_back_to_a_disk_snapshot_taken_before_the_restart(tmp_path: Path) -> None:
    ckpt = _first_run(tmp_path, FaultInjector(), max_steps=4, every=4)
    assert sorted(os.listdir(tmp_path / "snaps")) == [SNAP.format(2), SNAP.format(4)]
    _, payload = load_snapshot(tmp_path / "snaps" / SNAP.format(2))
    rollback = Rollback(every_n_steps=2, dirpath=tmp_path / "snaps")
    probe = Probe()
    trainer = make_trainer([NonFiniteDetector(), rollback, probe, nan_at(4, 5)], max_steps=6)
    trainer.fit(TinyRegressor(), ckpt_path=ckpt)
    # First back to the state the resumed fit started from (step 4: its file, as the uninterrupted run's snapshot of
    # step 4), then, diverging again from there, one snapshot further back: the file written at step 2.
    history = [(h["step"], h["snapshot_step"], h["source"]) for h in rollback.history]
    assert history == [(5, 4, "disk"), (6, 2, "disk")]
    assert_bit_identical(probe.at[6]["weights"], dict(payload["state"]["model"]))
    saved_optimizer = payload["state"]["optimizers"][0]
    assert_optimizer_state_equal(probe.at[6]["optimizers"][0], saved_optimizer)


class SimulatedCrash(BaseException):
    """Stands for the process being killed between the temporary write and the rename."""


@RESUME
def test_crash_between_write_and_rename_leaves_no_usable_partial_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_move = LocalFileSystem.mv

    def crash_on_step_4(fs: LocalFileSystem, src: Any, dst: Any, **kwargs: Any) -> None:
        if Path(dst).name == SNAP.format(4):
            raise SimulatedCrash
        real_move(fs, src, dst, **kwargs)

    monkeypatch.setattr(LocalFileSystem, "mv", crash_on_step_4)
    with pytest.raises(SimulatedCrash):
        _first_run(tmp_path, FaultInjector(), max_steps=8, every=2)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path / "snaps")) == [SNAP.format(0), SNAP.format(2)]  # nothing for step 4
    ckpt = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
    assert checkpoint_files(tmp_path / "ckpt") == [ckpt]

    # A process killed outright leaves its temporary file; the next fit removes it and never reads it.
    stale = Path(snapshot_store.temporary_path(tmp_path / "snaps" / SNAP.format(4)))
    stale.write_bytes((tmp_path / "snaps" / SNAP.format(2)).read_bytes())
    rollback, _ = _resume(tmp_path, ckpt, nan_at(2, 3), max_steps=6)
    assert not stale.exists()
    assert [(h["snapshot_step"], h["source"]) for h in rollback.history] == [(2, "disk"), (0, "disk")]


@RESUME
@pytest.mark.filterwarnings("ignore:Using a non-tuple sequence for multidimensional indexing")
@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        ("truncated", "is not a readable snapshot"),
        ("rewritten", "it is not the file this run wrote for step 2 (sha256 "),  # a shared dirpath: another run's
        # Written anew, with a checkpoint of an earlier release (no digests): the checks after the digest's
        ("nan", "it holds inf/NaN (in net.0.weight)"),
        ("tensor_for_optimizer", "IndexError: too many indices"),  # any error of an untrusted file is caught
    ],
)
def test_a_corrupt_snapshot_file_is_never_used(tmp_path: Path, damage: str, problem: str) -> None:
    ckpt = _first_run(tmp_path, FaultInjector(), max_steps=4, every=4)
    path = tmp_path / "snaps" / SNAP.format(2)
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:200])
    else:
        _, payload = load_snapshot(path)
        if damage == "nan":
            payload["state"]["model"]["net.0.weight"][0, 0] = float("nan")
        elif damage == "rewritten":
            payload["state"]["model"]["net.0.weight"][0, 0] += 1.0
        else:
            payload["state"]["optimizers"] = [torch.zeros(1)]
        save_snapshot(payload, path, step=2)
        if damage != "rewritten":
            _without_digests(ckpt)
    with pytest.warns(OverflowWarning, match=r"rollback-step=2.pt cannot be used on rank\(s\) \[0\]: ") as warned:
        rollback, trainer = _resume(tmp_path, ckpt, nan_at(4, 5), max_steps=8)
    assert [str(w.message) for w in warned if "cannot be used" in str(w.message)][0].endswith(
        "; it is dropped and the next snapshot is tried."
    )
    # The second rollback tries one snapshot further back, cannot use the file, and uses step 4 again.
    assert [(h["snapshot_step"], h["source"]) for h in rollback.history] == [(4, "disk"), (4, "disk")]
    unusable = [e for e in rollback.board(trainer).journal.events if e.kind == "snapshot_unusable"]
    assert len(unusable) == 1 and unusable[0].details["file"] == SNAP.format(2)
    assert problem in unusable[0].details["problem"]  # which check refused it
    assert problem in unusable[0].message
    assert all_finite(weights(trainer.lightning_module))


@RESUME
def test_a_resumed_fit_none_of_whose_files_can_be_used_rolls_back_to_the_state_it_started_from(tmp_path: Path) -> None:
    """Both files its checkpoint lists are damaged (a shared dirpath, a bad disk): the resumed fit, which had checked
    the state it started from but kept no copy of it, raised ``RollbackError`` where the same resume without files
    goes back to that state. It keeps that state now as the last resort."""
    trainer = _resumed_back_to_the_state_it_started_from(tmp_path, _resumable_with_damaged_files(tmp_path),
                                                         warned="cannot be used")  # fmt: skip
    assert trainer.global_step == 6 and all_finite(weights(trainer.lightning_module))


def _resumed_back_to_the_state_it_started_from(tmp_path: Path, ckpt: Path, warned: str) -> pl.Trainer:
    """Resume ``ckpt`` with NaN weights at step 4 (``warned`` of its files); assert that the one rollback went back to
    the state the resumed fit started from, kept in memory."""
    probe = Probe()
    rollback = Rollback(every_n_steps=2, dirpath=tmp_path / "snaps")
    trainer = make_trainer([NonFiniteDetector(), rollback, probe, nan_at(4)], max_steps=6)
    with pytest.warns(OverflowWarning, match=warned):
        trainer.fit(TinyRegressor(), ckpt_path=ckpt)
    assert [(h["step"], h["snapshot_step"], h["source"]) for h in rollback.history] == [(5, 4, "memory")]
    assert_bit_identical(probe.at[5]["weights"], torch.load(ckpt, weights_only=False)["state_dict"])
    return trainer


def _resumable_with_damaged_files(tmp_path: Path) -> Path:
    """The checkpoint of step 4 of a first run, whose snapshot files of steps 2 and 4 are then truncated."""
    ckpt = _first_run(tmp_path, FaultInjector(), max_steps=4, every=4)
    for step in (2, 4):
        path = tmp_path / "snaps" / SNAP.format(step)
        path.write_bytes(path.read_bytes()[:200])
    return ckpt


@RESUME
def test_a_resumed_fit_none_of_whose_files_can_be_used_ends_on_the_state_it_started_from(tmp_path: Path) -> None:
    """The last update left NaN weights, after every check of the fit: its end restores the last verified state. With
    none of the listed files usable, that is the state the resumed fit started from (it ended NaN), held meanwhile
    and counted in ``snapshot_nbytes``."""
    from test_checkpoint_guard import NanAfterTheStep

    ckpt = _resumable_with_damaged_files(tmp_path)
    rollback = Rollback(every_n_steps=10, dirpath=tmp_path / "snaps")
    held: list[int] = []

    class Holds(Callback):
        def on_train_batch_start(self, *_: Any) -> None:
            held.append(rollback.snapshot_nbytes)

    trainer = make_trainer([NonFiniteDetector(), rollback, Holds(), NanAfterTheStep(6)], max_steps=6)
    with pytest.warns(OverflowWarning, match="cannot be used"):
        trainer.fit(TinyRegressor(), ckpt_path=ckpt)
    parameters = sum(w.numel() * 4 for w in weights(trainer.lightning_module).values())
    assert held[0] > 3 * parameters and held == [held[0]] * 2  # the weights and Adam's two moments, at least
    assert_bit_identical(weights(trainer.lightning_module), torch.load(ckpt, weights_only=False)["state_dict"])


@RESUME
def test_a_file_whose_write_failed_is_never_taken_for_this_runs_though_another_run_wrote_one_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write of step 4 failed (its digest is listed as none), then another run wrote its own step 4 into the same
    dirpath. Taken for a file of an earlier release (no digest to check), it was restored: the other run's weights."""
    monkeypatch.setattr(snapshot_store, "_save", _failing_write(4))
    ckpt = _first_run(tmp_path, FaultInjector(), max_steps=4, every=4)
    monkeypatch.undo()
    torch.manual_seed(1)
    fit(TinyRegressor(lr=0.05), [Rollback(every_n_steps=2, dirpath=tmp_path / "snaps")], max_steps=4)
    assert (tmp_path / "snaps" / SNAP.format(4)).exists()  # the other run's
    # Its file of step 2 was written over too: the state it resumed from is the one left.
    _resumed_back_to_the_state_it_started_from(tmp_path, ckpt,
                                               warned="this run's write of the snapshot of step 4 failed")


def _without_digests(ckpt: Path) -> None:
    """The checkpoint as an earlier release wrote it: its Rollback lists its files without their digests."""
    checkpoint = torch.load(ckpt, weights_only=False)
    for key, state in checkpoint["callbacks"].items():
        if key.startswith("Rollback"):
            for entry in state["disk"]:
                entry.pop("digests")
    torch.save(checkpoint, ckpt)


def _failing_write(step: int) -> Any:
    real = snapshot_store._save

    def save(payload: Any, path: Any, step: int) -> str:
        if step == failing_step:
            raise OSError(28, "No space left on device")
        return real(payload, path, step)

    failing_step = step
    return save


def test_a_failed_write_is_listed_and_leaves_no_older_file_under_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    snaps = tmp_path / "snaps"
    save_snapshot({"state": {}}, snaps / SNAP.format(4), step=4)  # left by an earlier run in the same directory
    monkeypatch.setattr(snapshot_store, "_save", _failing_write(4))
    rollback = Rollback(every_n_steps=2, keep=2, dirpath=snaps)
    with pytest.warns(OverflowWarning, match=r"could not write the snapshot of step 4 to .*No space left on device"):
        trainer = fit(TinyRegressor(), [rollback], max_steps=6)
    # Listed like on every other rank (which cannot know rank 0 failed); no file of another state under its name.
    assert [(e["step"], e["file"], len(e["digests"])) for e in rollback.state_dict()["disk"]] == [
        (4, SNAP.format(4), 1), (6, SNAP.format(6), 1)
    ]
    assert rollback.state_dict()["disk"][0]["digests"] == [None]  # nothing written: no digest
    assert sorted(os.listdir(snaps)) == [SNAP.format(6)]
    assert journal_kinds(trainer, rollback) == ["snapshot_write_failed"]


# ---- no poisoned checkpoint -------------------------------------------------------------------------------------
CHECKPOINTERS = {
    "save_last": lambda d: ModelCheckpoint(dirpath=d, save_last=True, save_top_k=0),
    "save_top_k": lambda d: ModelCheckpoint(dirpath=d, monitor="val_loss", save_top_k=2),
    "every_n_train_steps": lambda d: ModelCheckpoint(dirpath=d, every_n_train_steps=1, save_top_k=-1),
}


@pytest.mark.parametrize("kind", sorted(CHECKPOINTERS))
def test_every_checkpoint_written_is_finite(tmp_path: Path, kind: str) -> None:
    rollback = Rollback(every_n_steps=3)
    callbacks = [CHECKPOINTERS[kind](tmp_path), NonFiniteDetector(), rollback, nan_at(7, 11)]
    # A NaN at the last batch of epoch 0 (8 batches): validation and the epoch-end save follow at once.
    fit(TinyRegressor(), callbacks, max_steps=16, enable_checkpointing=True, limit_val_batches=2,
        default_root_dir=tmp_path)
    assert [h["trigger_step"] for h in rollback.history] == [7, 11]
    files = checkpoint_files(tmp_path)
    assert files, "no checkpoint written"
    for path in files:
        assert_checkpoint_finite(path)


@pytest.mark.filterwarnings("ignore:.*was called without a model")
def test_on_exception_checkpoint_is_finite(tmp_path: Path) -> None:
    rollback = Rollback(every_n_steps=2, max_rollbacks=1)
    callbacks = [OnExceptionCheckpoint(dirpath=tmp_path), NonFiniteDetector(), rollback, nan_at(3, 5)]
    with pytest.raises(DivergenceError):
        fit(TinyRegressor(), callbacks, max_steps=10, enable_checkpointing=True, default_root_dir=tmp_path)
    assert checkpoint_files(tmp_path) == [tmp_path / "on_exception.ckpt"]
    assert_checkpoint_finite(tmp_path / "on_exception.ckpt")


@pytest.mark.filterwarnings("ignore:.*was called without a model")
def test_an_error_raised_before_rollback_acts_still_leaves_a_finite_checkpoint(tmp_path: Path) -> None:
    """LRBackoff at its floor raises in on_train_batch_end before Rollback's turn, with NaN weights in memory:
    Rollback restores in on_exception, so OnExceptionCheckpoint writes finite values and the error stays the same."""
    from lightning_overflow.callbacks.lr_backoff import LRBackoff

    rollback, probe = Rollback(every_n_steps=2), Probe()
    backoff = LRBackoff(min_scale=1.0)  # at its floor from the start: the first trigger stops the run
    callbacks = [OnExceptionCheckpoint(dirpath=tmp_path), NonFiniteDetector(), backoff, rollback, probe, nan_at(3)]
    trainer = make_trainer(callbacks, max_steps=10, enable_checkpointing=True, default_root_dir=tmp_path)
    with pytest.raises(DivergenceError, match="^LRBackoff: nonfinite_state at step 3"):
        trainer.fit(TinyRegressor())
    assert rollback.history == [] and rollback.rollbacks == 0  # not a rollback: no budget spent
    restores = [e for e in rollback.board(trainer).journal.events if e.kind == "exit_restore"]
    assert len(restores) == 1
    assert restores[0].details == {"error": "DivergenceError", "snapshot_step": 2, "source": "memory"}
    assert "restored the snapshot of step 2 (memory)" in restores[0].message
    assert_bit_identical(weights(trainer.lightning_module), probe.at[2]["weights"])
    assert_checkpoint_finite(tmp_path / "on_exception.ckpt")


class Boom(Callback):
    """Raises a user's own error at the end of batch ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("boom")


def test_a_foreign_error_in_one_process_leaves_the_last_verified_weights_and_propagates() -> None:
    """A user's error (or a KeyboardInterrupt) with NaN weights in memory: in one process Rollback restores the last
    verified snapshot on the way out, as for its own errors (the model object held NaN weights, unsaid). Under DDP
    such an error may be one rank's alone, and Rollback enters no collective for it."""
    rollback, model, probe = Rollback(every_n_steps=100), TinyRegressor(), Probe()
    with pytest.raises(RuntimeError, match="^boom$"):
        fit(model, [rollback, probe, nan_at(3), Boom(4)], max_steps=10)
    assert_bit_identical(weights(model), probe.at[0]["weights"])
    (restore,) = [e for e in rollback.board(model.trainer).journal.events if e.kind == "exit_restore"]
    assert restore.details == {"error": "RuntimeError", "snapshot_step": 0, "source": "memory"}


def test_a_check_that_fails_on_the_way_out_of_a_foreign_error_leaves_that_error_to_propagate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The module's own error is the one to see: a state its error left that the check cannot read is said, and the
    error propagates unmasked."""

    def broken(*_: Any) -> None:
        raise RuntimeError("the check failed")

    rollback, model = Rollback(every_n_steps=100), TinyRegressor()
    monkeypatch.setattr(rollback, "_restore_if_nonfinite", broken)
    with pytest.warns(OverflowWarning, match=r"on the way out of RuntimeError the state could not be checked or "
                                             r"restored \(the check failed\); nothing was restored"):  # fmt: skip
        with pytest.raises(RuntimeError, match="^boom$"):
            fit(model, [rollback, nan_at(3), Boom(4)], max_steps=10)


class InterruptedAt(TinyRegressor):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.global_step == 11:
            raise KeyboardInterrupt
        return super().training_step(batch, batch_idx)


def test_an_interrupted_fit_does_not_return_nan_weights() -> None:
    """Ctrl-C at a step whose weights hold NaN: Lightning ends the fit gracefully (``SystemExit`` after its
    ``on_exception``), and the model returned held NaN without a word, though snapshots of steps 5 and 10 were
    there."""
    model, probe = InterruptedAt(), Probe()
    suite = default_callbacks(snapshot_every_n_steps=5)
    with pytest.raises(SystemExit):
        fit(model, [FaultInjector(Fault(11, "nan_weight")), *suite, probe], max_steps=-1, max_epochs=4)
    assert_bit_identical(weights(model), probe.at[10]["weights"])
    kinds = [(e.step, e.kind) for e in suite[-1].board(model.trainer).journal.events]
    assert kinds == [(11, "exit_restore")]


def test_without_rollback_the_same_run_writes_a_poisoned_checkpoint(tmp_path: Path) -> None:
    """The control: without Rollback a NaN checkpoint is written, and the check used above catches it."""
    fit(TinyRegressor(), [CHECKPOINTERS["every_n_train_steps"](tmp_path), nan_at(3)], max_steps=5,
        enable_checkpointing=True)
    with pytest.raises(AssertionError, match="holds non-finite weights"):
        for path in checkpoint_files(tmp_path):
            assert_checkpoint_finite(path)


# ---- DDP --------------------------------------------------------------------------------------------------------
def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(tensors):
        h.update(key.encode())
        h.update(tensors[key].detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _moment_tensors(record: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every optimizer state tensor of a Probe record (moments and step counts), by ``<opt>.<param>.<key>``."""
    return {
        f"{i}.{index}.{key}": value
        for i, optimizer in enumerate(record["optimizers"])
        for index, values in optimizer["state"].items()
        for key, value in values.items()
        if isinstance(value, torch.Tensor)
    }


class RankReport(Callback):
    """Each rank writes what it saw to ``<out>/rank<r>.json`` (worker state does not come back to the parent)."""

    def __init__(self, out: Path, probe: Probe, rollback: Rollback) -> None:
        self.out, self.probe, self.rollback = out, probe, rollback

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        report = {
            "history": self.rollback.history,
            "digests": {str(step): _digest(rec["weights"]) for step, rec in self.probe.at.items()},
            "moments": {str(step): _digest(_moment_tensors(rec)) for step, rec in self.probe.at.items()},
            "final": _digest(weights(pl_module)),
            "finite": all_finite(weights(pl_module)),
            "global_step": trainer.global_step,
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


@pytest.mark.ddp
@pytest.mark.timeout(180)
@pytest.mark.parametrize("detector", [True, False], ids=["detector", "snapshot_check"])
def test_ddp_nan_on_one_rank_rolls_back_every_rank_to_the_same_snapshot(tmp_path: Path, detector: bool) -> None:
    rollback, probe = Rollback(every_n_steps=2), Probe()
    callbacks = [rollback, probe, nan_at(5, rank=1), RankReport(tmp_path, probe, rollback)]
    fit(TinyRegressor(), [NonFiniteDetector()] * detector + callbacks, max_steps=10, strategy="ddp_fork", devices=2)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    # With the detector, the NaN is reported at step 5; without it, the check of the snapshot due at step 6 finds it.
    expected = [(6, 5, 4)] if detector else [(6, 6, 4)]
    for report in reports:
        assert [(h["step"], h["trigger_step"], h["snapshot_step"]) for h in report["history"]] == expected
        assert report["digests"]["6"] == report["digests"]["4"]  # restored to the snapshot, bit for bit
        assert report["moments"]["6"] == report["moments"]["4"]  # the Adam moments too (split across the ranks)
        assert report["global_step"] == 10 and report["finite"]
    assert reports[0]["digests"] == reports[1]["digests"]  # both ranks identical at every step
    assert reports[0]["moments"] == reports[1]["moments"]
    assert reports[0]["final"] == reports[1]["final"]


class DiskReport(Callback):
    """Each rank writes the files its Rollback lists (its checkpoint state) to ``<out>/disk<r>.json``."""

    def __init__(self, out: Path, rollback: Rollback) -> None:
        self.out, self.rollback = out, rollback

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        disk = self.rollback.state_dict()["disk"]
        (self.out / f"disk{trainer.global_rank}.json").write_text(json.dumps(disk))


@pytest.mark.ddp
@pytest.mark.timeout(180)
def test_ddp_each_rank_writes_its_part_and_a_write_failing_on_rank_0_keeps_the_lists_equal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = snapshot_store._save

    def save(payload: Any, path: Any, step: int) -> str:  # rank 0's write of step 4 fails
        if step == 4 and "rank=0" in str(path):
            raise OSError(28, "No space left on device")
        return real(payload, path, step)

    monkeypatch.setattr(snapshot_store, "_save", save)  # forked workers inherit it
    rollback = Rollback(every_n_steps=2, keep=2, dirpath=tmp_path / "snaps")
    fit(TinyRegressor(), [rollback, DiskReport(tmp_path, rollback)], max_steps=6, strategy="ddp_fork", devices=2)
    listed = [json.loads((tmp_path / f"disk{r}.json").read_text()) for r in (0, 1)]
    assert listed[0] == listed[1]  # the same targets, and each rank's digests, on every rank
    assert [(e["step"], e["file"]) for e in listed[0]] == [(4, SNAP.format(4)), (6, SNAP.format(6))]
    assert listed[0][0]["digests"][0] is None and len(listed[0][0]["digests"][1]) == 64  # rank 0's write failed
    assert sorted(os.listdir(tmp_path / "snaps")) == ["rank=0", "rank=1"]
    assert sorted(os.listdir(tmp_path / "snaps" / "rank=0")) == [SNAP.format(6)]
    assert sorted(os.listdir(tmp_path / "snaps" / "rank=1")) == [SNAP.format(4), SNAP.format(6)]
    # Each file holds its rank's part (the other tensors are meta placeholders), and the parts add up to the state.
    payloads = [load_snapshot(tmp_path / "snaps" / f"rank={r}" / SNAP.format(6))[1] for r in (0, 1)]
    assert [(p["rank"], p["world_size"]) for p in payloads] == [(0, 2), (1, 2)]
    owners = payloads[0]["owners"]
    assert owners == payloads[1]["owners"] and sorted(set(owners.values())) == [0, 1]
    for rank, payload in enumerate(payloads):
        held = {path for path, t in named_state_tensors(payload["state"]) if t.device.type != "meta"}
        assert {path for path, owner in owners.items() if owner == rank} <= held
        assert not {path for path, owner in owners.items() if owner != rank} & held


class BytesReport(Callback):
    """Each rank writes the host bytes its Rollback's snapshots hold at the end of the fit to ``<out>/bytes<r>``."""

    def __init__(self, out: Path, rollback: Rollback) -> None:
        self.out, self.rollback = out, rollback

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        (self.out / f"bytes{trainer.global_rank}").write_text(str(self.rollback.snapshot_nbytes))


@pytest.mark.ddp
@pytest.mark.timeout(180)
def test_ddp_snapshot_bytes_per_rank_halve_from_one_rank_to_two(tmp_path: Path) -> None:
    alone = Rollback(every_n_steps=2, keep=2)
    fit(TinyRegressor(), [alone], max_steps=6)
    rollback = Rollback(every_n_steps=2, keep=2)
    fit(TinyRegressor(), [rollback, BytesReport(tmp_path, rollback)], max_steps=6, strategy="ddp_fork", devices=2)
    per_rank = [int((tmp_path / f"bytes{r}").read_text()) for r in (0, 1)]
    # One snapshot: 193 FP32 parameters and their 2 Adam moments (2316 bytes) and 4 step counters (16 bytes). Split
    # by bytes over 2 ranks, largest first to the least loaded (512, 512, 512, then six of 128, then three of 4):
    # rank 0 keeps 512 + 512 + 128 + 4 + 4 = 1160 bytes, rank 1 512 + 5 x 128 + 4 = 1156; the step counters stay on
    # both ranks.
    assert alone.snapshot_nbytes == 2 * (2316 + 16)
    assert per_rank == [2 * (1160 + 16), 2 * (1156 + 16)]
    assert max(per_rank) / alone.snapshot_nbytes == pytest.approx(0.5, abs=0.01)


@RESUME
@pytest.mark.ddp
@pytest.mark.timeout(180)
def test_ddp_resume_rolls_back_to_the_parts_each_rank_wrote_before_the_restart(tmp_path: Path) -> None:
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    first = Rollback(every_n_steps=2, dirpath=tmp_path / "snaps")
    fit(TinyRegressor(), [NonFiniteDetector(), first, checkpoints], max_steps=4, enable_checkpointing=True,
        strategy="ddp_fork", devices=2)
    ckpt = next(p for p in checkpoint_files(tmp_path / "ckpt") if "step=4" in p.name)
    # The full state of step 2, assembled from the two ranks' parts.
    parts = [load_snapshot(tmp_path / "snaps" / f"rank={r}" / SNAP.format(2))[1]["state"] for r in (0, 1)]
    held = [dict(named_state_tensors(part["model"])) for part in parts]
    expected = {name: next(p[name] for p in held if p[name].device.type != "meta") for name in held[0]}

    rollback, probe = Rollback(every_n_steps=2, dirpath=tmp_path / "snaps"), Probe()
    report = RankReport(tmp_path, probe, rollback)
    trainer = make_trainer([NonFiniteDetector(), rollback, probe, nan_at(4, 5, rank=1), report], max_steps=6,
                           strategy="ddp_fork", devices=2)
    trainer.fit(TinyRegressor(), ckpt_path=ckpt)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for seen in reports:  # back to step 4 (its parts on disk), then one further back: the parts written at step 2
        assert [(h["step"], h["snapshot_step"], h["source"]) for h in seen["history"]] == [
            (5, 4, "disk"), (6, 2, "disk")
        ]
        assert seen["digests"]["6"] == _digest(expected)
    assert reports[0]["digests"] == reports[1]["digests"]


class TwoGroups(TinyRegressor):
    """Adam over the first layer only; :class:`AddGroup` adds the last layer's group later."""

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.net[0].parameters(), lr=self.lr)


class AddGroup(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        if trainer.global_step == self.step:
            trainer.optimizers[0].add_param_group({"params": list(pl_module.net[2].parameters()), "lr": 0.01})


@pytest.mark.ddp
@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", ["to_the_start", "group_added_since"])
def test_ddp_a_split_snapshot_of_another_optimizer_shape_is_rebuilt_on_every_rank(tmp_path: Path, case: str) -> None:
    """The restore loads the optimizer from a clone (the live state has another shape); the tensors another rank
    holds are filled in by its broadcast."""
    if case == "to_the_start":  # the snapshot of step 0 has no Adam state yet
        model, extra, rollback, fault, expected = TinyRegressor(), [], Rollback(every_n_steps=100), 2, (3, 0)
    else:  # the snapshot of step 2 holds one param group and its moments, split; a second group came at step 3
        model, extra, rollback, fault, expected = TwoGroups(), [AddGroup(3)], Rollback(every_n_steps=2), 3, (4, 2)
    probe = Probe()
    report = RankReport(tmp_path, probe, rollback)
    callbacks = [NonFiniteDetector(), rollback, probe, *extra, nan_at(fault, rank=1), report]
    fit(model, callbacks, max_steps=8, strategy="ddp_fork", devices=2)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    step, target = expected
    for report in reports:
        assert [(h["step"], h["snapshot_step"]) for h in report["history"]] == [expected]
        assert report["digests"][str(step)] == report["digests"][str(target)]
        assert report["moments"][str(step)] == report["moments"][str(target)]
        assert report["global_step"] == 8 and report["finite"]
    assert reports[0]["digests"] == reports[1]["digests"]
    assert reports[0]["moments"] == reports[1]["moments"]


# ---- resuming with rollbacks after the restart ------------------------------------------------------------------------
def test_a_resumed_run_rolls_back_exactly_as_the_uninterrupted_one(tmp_path: Path) -> None:
    """NaN weights at steps 8 and 23, snapshots every 5 healthy steps on disk, a checkpoint at step 16 (an epoch's end).
    Resumed from it, the run counts the healthy steps it had counted, keeps its decision state and goes on with the
    snapshot files the checkpoint lists: the rollbacks after the restart, the learning rate and the weights are the
    uninterrupted run's, bit for bit."""
    from lightning_overflow import LRBackoff

    def suite(root: Path) -> list[Any]:
        return [NonFiniteDetector(), LRBackoff(), Rollback(every_n_steps=5, dirpath=root / "snaps")]

    faults = (Fault(8, "nan_weight"), Fault(23, "nan_weight"))
    torch.manual_seed(0)
    whole, whole_suite = TinyRegressor(), suite(tmp_path / "whole")
    trainer = fit(whole, [*whole_suite, FaultInjector(*faults)], max_steps=32, default_root_dir=str(tmp_path / "whole"))
    whole_lr = trainer.optimizers[0].param_groups[0]["lr"]

    torch.manual_seed(0)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=16, save_top_k=-1)
    first = suite(tmp_path / "resumed")
    fit(TinyRegressor(), [*first, FaultInjector(*faults), checkpoints], max_steps=16, enable_checkpointing=True,
        default_root_dir=str(tmp_path / "resumed"))  # fmt: skip
    (path,) = (tmp_path / "ckpt").glob("*step=16*.ckpt")
    resumed, resumed_suite = TinyRegressor(), suite(tmp_path / "resumed")
    trainer = make_trainer([*resumed_suite, FaultInjector(Fault(23, "nan_weight"))], max_steps=32,
                           default_root_dir=str(tmp_path / "resumed"))  # fmt: skip
    trainer.fit(resumed, ckpt_path=str(path))
    history = [(h["step"], h["snapshot_step"]) for h in whole_suite[-1].history]
    assert history[0][0] == 9 and len(history) == 2  # one rollback before the restart, one after
    assert [(h["step"], h["snapshot_step"]) for h in resumed_suite[-1].history] == history
    assert trainer.optimizers[0].param_groups[0]["lr"] == whole_lr
    assert_bit_identical(weights(resumed), weights(whole))


def _one_cycle(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.01, total_steps=40)


def test_a_schedule_a_rollback_took_back_is_said_to_end_behind_the_fit(tmp_path: Path) -> None:
    """NaN weights at step 25 roll the run back to the fit's start, schedule included: the OneCycleLR sized to the
    fit's 40 steps ends 26 steps short of its end (its anneal cut off), and the journal and the summary say by how
    much and what to do."""
    from lightning_overflow import read_journal
    from lightning_overflow.fit_summary import plain_lines

    model = TinyRegressor(scheduler=_one_cycle)
    fit(model, [*default_callbacks(), FaultInjector(Fault(25, "nan_weight"))], max_steps=40, default_root_dir=tmp_path)
    assert model.trainer.lr_scheduler_configs[0].scheduler.last_epoch == 14
    events = list(read_journal(tmp_path))
    [late] = [e for e in events if e["kind"] == "schedule_behind"]
    assert (late["step"], late["details"]) == (40, {"schedulers": [{"scheduler": "OneCycleLR", "behind": 26}],
                                                    "behind": 26})  # fmt: skip
    assert plain_lines(events)[-1] == (
        "the learning-rate schedule ended behind the fit (OneCycleLR by 26 steps): a rollback returns it with the "
        "weights and a skipped step holds it while the fit's step count goes on, so at step 40 it stood where step 14 "
        "would have left it; a schedule sized to the fit (a OneCycleLR, a warm-up and its decay) has not reached its "
        "end: train 26 more steps to finish it"
    )


def _step_lr_by_epoch(optimizer: torch.optim.Optimizer) -> Any:
    return {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5), "interval": "epoch"}


def test_a_schedule_by_epochs_a_rollback_took_back_is_said_to_end_behind_the_fit(tmp_path: Path) -> None:
    """NaN weights at step 12 (epoch 1) roll the run back to the fit's start: the StepLR that halves the rate as each
    epoch ends goes back to its count then (0), while the fit goes on from epoch 1. It ends one epoch behind the bare
    run's (2 halvings, not 3), and nothing said so: the summary's "0.5x its schedule" ended at the bare run's rate."""
    from lightning_overflow import read_journal
    from lightning_overflow.fit_summary import plain_lines

    model = TinyRegressor(scheduler=_step_lr_by_epoch)
    fit(model, [*default_callbacks(), FaultInjector(Fault(12, "nan_weight"))], max_steps=-1, max_epochs=3,
        default_root_dir=tmp_path)  # fmt: skip
    assert model.trainer.lr_scheduler_configs[0].scheduler.last_epoch == 2
    events = list(read_journal(tmp_path))
    [late] = [e for e in events if e["kind"] == "schedule_behind"]
    assert late["details"] == {"schedulers": [{"scheduler": "StepLR", "behind": 1, "unit": "epoch"}], "behind": 1}
    assert plain_lines(events)[-1] == (
        "the learning-rate schedule ended behind the fit (StepLR by 1 epoch): a rollback returns it with the weights "
        "while the fit's epoch count goes on; a schedule sized to the fit (a OneCycleLR, a warm-up and its decay) has "
        "not reached its end: train 1 more epoch to finish it"
    )


def test_a_kept_remedy_that_took_an_epoch_schedule_back_is_said_to_end_behind_the_fit(tmp_path: Path) -> None:
    """The trial's remedy (the snapshot of step 22, epoch 2, at half the rate), opened at step 32 (epoch 4), is kept
    at step 52: its StepLR came back with it from the snapshot and stepped only at the epoch ends of the trial, two
    epochs behind the run's, as an immediate rollback's is. That rollback said so; the kept remedy (journaled as the
    rollback it is) did not."""
    from test_trials import Sabotaged, Suspect

    from lightning_overflow import Rollback, TrialConfig, read_journal

    def step_lr(optimizer: torch.optim.Optimizer) -> Any:
        return {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9), "interval": "epoch"}

    torch.manual_seed(0)
    model = Sabotaged(scheduler=step_lr)
    trial = TrialConfig(remedies=1)
    suite = [Suspect(31), LRBackoff(trial=trial), Rollback(every_n_steps=11, trial=trial)]
    fit(model, suite, max_steps=80, default_root_dir=tmp_path)
    events = list(read_journal(tmp_path))
    assert [(e["step"], e["details"]["snapshot_step"]) for e in events if e["kind"] == "rollback"] == [(52, 22)]
    [late] = [e for e in events if e["kind"] == "schedule_behind"]
    assert late["details"] == {"schedulers": [{"scheduler": "StepLR", "behind": 2, "unit": "epoch"}], "behind": 2}
    assert model.trainer.lr_scheduler_configs[0].scheduler.last_epoch == 10 - 2


def test_a_schedule_only_skipped_steps_held_is_not_said_to_end_behind(tmp_path: Path) -> None:
    from lightning_overflow import default_callbacks, read_journal

    model = TinyRegressor(scheduler=_one_cycle)
    fit(model, [*default_callbacks(), FaultInjector(Fault(25, "nan_loss"))], max_steps=40, default_root_dir=tmp_path)
    assert model.trainer.lr_scheduler_configs[0].scheduler.last_epoch == 39  # the skipped step held it
    assert "schedule_behind" not in [e["kind"] for e in read_journal(tmp_path)]


def _chained(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.ChainedScheduler([_one_cycle(optimizer)])


def _one_cycle_every_3(optimizer: torch.optim.Optimizer) -> Any:
    return {"scheduler": torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.01, total_steps=14), "frequency": 3,
            "interval": "step"}


@pytest.mark.parametrize(
    ("schedule", "behind", "count"),
    [(_chained, 26, 14), (_one_cycle_every_3, 24, 4)],  # at the 3rd and 6th of an epoch's 8 batches: 10 of 40 steps
    ids=["chained", "frequency-3"],
)
def test_a_schedule_behind_is_counted_in_the_fits_steps(tmp_path: Path, schedule: Any, behind: int, count: int) -> None:
    """NaN weights at step 25 roll the run back to the fit's start. A ``ChainedScheduler`` keeps no count of its own
    (torch 2.13): read as 0, it was never said to end behind. A scheduler stepped every 3 steps of an epoch (twice in
    its 8) ends 6 of its steps behind: 4 at step 40, where step 16 left it, which the words counted as step 34."""
    from lightning_overflow import read_journal

    model = TinyRegressor(scheduler=schedule)
    fit(model, [*default_callbacks(), FaultInjector(Fault(25, "nan_weight"))], max_steps=40, default_root_dir=tmp_path)
    scheduler = model.trainer.lr_scheduler_configs[0].scheduler
    assert (scheduler._schedulers[0] if schedule is _chained else scheduler).last_epoch == count
    [late] = [e for e in read_journal(tmp_path) if e["kind"] == "schedule_behind"]
    assert late["details"]["behind"] == behind
    assert f"so at step 40 it stood where step {40 - behind} would have left it" in late["message"]


class ManualSchedule(ManualTiny):
    """Manual optimization stepping its ``LambdaLR`` once a batch or as each epoch ends, both as Lightning's docs show
    (the scheduler's ``interval`` is Lightning's default, ``"epoch"``, which the loop does not act on here)."""

    def __init__(self, at_epoch_end: bool) -> None:
        super().__init__()
        self.at_epoch_end = at_epoch_end

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if not self.at_epoch_end:
            self.lr_schedulers().step()
        return loss

    def on_train_epoch_end(self) -> None:
        if self.at_epoch_end:
            self.lr_schedulers().step()

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        return [optimizer], [torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.98**step)]


@pytest.mark.parametrize(("at_epoch_end", "count", "behind"), [(False, 14, 26), (True, 2, 3)], ids=["batch", "epoch"])
def test_a_schedule_a_module_steps_itself_is_said_to_end_behind_by_its_own_steps(
    tmp_path: Path, at_epoch_end: bool, count: int, behind: int
) -> None:
    """Under manual optimization a rollback at step 26 to the fit's start took the module's own schedule back: 26 of
    its steps, stepped once a batch (the words said "by 26 epochs ... train 26 more epochs": the interval was taken
    for the unit), or 3, stepped as each of the 5 epochs ended (counted as the loop's epochs before)."""
    from lightning_overflow import read_journal

    model = ManualSchedule(at_epoch_end)
    fit(model, [*default_callbacks(), FaultInjector(Fault(25, "nan_weight"))], max_steps=40, default_root_dir=tmp_path)
    assert model.lr_schedulers().last_epoch == count
    [late] = [e for e in read_journal(tmp_path) if e["kind"] == "schedule_behind"]
    assert late["details"] == {"schedulers": [{"scheduler": "LambdaLR", "behind": behind, "unit": "call"}],
                               "behind": behind}  # fmt: skip
    assert late["message"] == (
        f"the learning-rate schedule ended behind the fit (LambdaLR by {behind} of its steps): a rollback returns it "
        "with the weights, while your code steps it as the fit goes on; a schedule sized to the fit (a OneCycleLR, a "
        f"warm-up and its decay) has not reached its end: train until your code has stepped it {behind} times more "
        "to finish it"
    )
