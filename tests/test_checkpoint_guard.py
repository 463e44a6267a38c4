"""No checkpoint with inf/NaN in any mode, and no rescuable run killed by the guard: roll back first, then save."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import assert_bit_identical, fit, make_trainer, weights
from pytorch_lightning.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from typing_extensions import override

from lightning_overflow._compat import Callback
from lightning_overflow import default_callbacks
from lightning_overflow.callbacks.nonfinite_detector import NonFiniteDetector
from lightning_overflow.callbacks.rollback import Rollback
from lightning_overflow.exceptions import NonFiniteError
from lightning_overflow.testing import Fault, FaultInjector, TinyRegressor
from lightning_overflow.training_state import CheckpointGuard


class WeightsAt(Callback):
    """Records the weights when training starts and at the end of every batch (put it after Rollback)."""

    def __init__(self) -> None:
        self.at: dict[int, dict[str, torch.Tensor]] = {}

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.at[trainer.global_step] = weights(pl_module)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        self.at[trainer.global_step] = weights(pl_module)


def finite(tensors: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors.values() if t.is_floating_point())


def saved(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=True)


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("*.ckpt"))


def kinds(trainer: pl.Trainer, rollback: Rollback) -> list[str]:
    return [e.kind for e in rollback.board(trainer).journal.events]


def nan_grad(step: int) -> FaultInjector:
    """One NaN in ``net.0.weight``'s gradient: with no step skipped, the update itself writes NaN into that weight."""
    return FaultInjector(Fault(step=step, kind="nan_grad", parameter="net.0.weight"))


# ---- save_weights_only: no callback hook, still no NaN file -----------------------------------------------------
def test_weights_only_checkpoint_at_a_nan_step_is_rolled_back_first(tmp_path: Path) -> None:
    """``save_weights_only=True`` calls no callback's ``on_save_checkpoint``. No detector, no snapshot due: only the
    guard sees the NaN weight of step 5 when the file of step 6 is about to be written."""
    rollback, probe = Rollback(every_n_steps=100), WeightsAt()
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1, save_weights_only=True)
    faults = FaultInjector(Fault(step=5, kind="nan_weight"))
    trainer = fit(TinyRegressor(), [rollback, probe, faults, checkpoints], max_steps=9, enable_checkpointing=True)

    assert rollback.history == [
        {"step": 6, "reason": "nonfinite_state", "trigger_step": 6, "snapshot_step": 0, "source": "memory"}
    ]
    assert names(tmp_path) == ["epoch=0-step=3.ckpt", "epoch=0-step=6.ckpt", "epoch=1-step=9.ckpt"]
    at_six = saved(tmp_path / "epoch=0-step=6.ckpt")
    assert "optimizer_states" not in at_six and "callbacks" not in at_six  # weights only, indeed
    assert_bit_identical(dict(at_six["state_dict"]), probe.at[0])  # the snapshot the fit started from
    for name in names(tmp_path):
        assert finite(saved(tmp_path / name)["state_dict"]), name
    assert trainer.global_step == 9 and finite(weights(trainer.lightning_module))
    assert kinds(trainer, rollback) == ["rollback", "behind"]  # 3 steps trained since, 6 thrown away
    assert rollback.board(trainer).journal.events[0].message == (
        "Rollback: restored the snapshot of step 0 (memory) at step 6 after nonfinite_state at step 6 (Rollback: the "
        "weights held inf/NaN (in net.0.weight, net.0.bias, net.2.weight, net.2.bias, net.0.weight.exp_avg (+7 more)) "
        "when a checkpoint was to be written). This one is counted: 2 more allowed within 1000 steps (max_rollbacks=3; "
        "one that follows a backoff of the learning rate is not counted)."
    )


def test_without_rollback_the_weights_only_checkpoint_holds_the_nan(tmp_path: Path) -> None:
    """The control for the test above: the same run without Rollback writes NaN into the file of step 6."""
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1, save_weights_only=True)
    fit(TinyRegressor(), [FaultInjector(Fault(step=5, kind="nan_weight")), checkpoints], max_steps=6,
        enable_checkpointing=True)
    assert finite(saved(tmp_path / "epoch=0-step=3.ckpt")["state_dict"])
    assert not finite(saved(tmp_path / "epoch=0-step=6.ckpt")["state_dict"])


# ---- a NaN made by the update itself on a save step ---------------------------------------------------------------
@pytest.mark.filterwarnings("ignore::lightning_overflow.exceptions.OverflowWarning")
def test_an_update_that_makes_nan_weights_on_a_save_step_is_rolled_back_then_saved(tmp_path: Path) -> None:
    """A detector that only warns lets the step with a NaN gradient happen: the update writes NaN into the weights
    of step 4, where ModelCheckpoint saves. Rollback restores the snapshot of step 2 first, the file of step 4 holds
    it, and the run goes on to its last step."""
    rollback, probe = Rollback(every_n_steps=2), WeightsAt()
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    callbacks = [NonFiniteDetector(action="warn"), rollback, probe, nan_grad(3), checkpoints]
    trainer = fit(TinyRegressor(), callbacks, max_steps=8, enable_checkpointing=True)

    assert rollback.history == [
        {"step": 4, "reason": "nonfinite_state", "trigger_step": 4, "snapshot_step": 2, "source": "memory"}
    ]
    assert not finite(probe.at[4])  # Rollback's own hook saw no trigger: the save found the NaN
    assert names(tmp_path) == ["epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt"]
    at_four = saved(tmp_path / "epoch=0-step=4.ckpt")
    assert_bit_identical(dict(at_four["state_dict"]), probe.at[2])
    for state in at_four["optimizer_states"][0]["state"].values():
        assert all(bool(torch.isfinite(v).all()) for v in state.values())
    assert at_four["callbacks"]["Rollback"]["rollbacks"] == 1  # the checkpoint is assembled after the rollback
    assert trainer.global_step == 8 and finite(weights(trainer.lightning_module))
    assert kinds(trainer, rollback) == ["nonfinite", "rollback"]


# ---- refusals, with hints for what the list lacks -----------------------------------------------------------------
@pytest.mark.filterwarnings("ignore::lightning_overflow.exceptions.OverflowWarning")
@pytest.mark.parametrize("detector", [True, False], ids=["with_detector", "without_detector"])
def test_without_nonfinite_state_the_save_is_refused_with_a_true_hint(tmp_path: Path, detector: bool) -> None:
    rollback = Rollback(every_n_steps=100, triggers=("loss_spike",))  # not this instance's to repair
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    callbacks = [NonFiniteDetector(action="warn")] * detector + [rollback, nan_grad(3), checkpoints]
    with pytest.raises(NonFiniteError) as info:
        fit(TinyRegressor(), callbacks, max_steps=8, enable_checkpointing=True)
    message = str(info.value)
    assert message.startswith(
        "Rollback: refused to write a checkpoint at step 4: its weights contain inf/NaN on rank(s) 0 (in "
        "net.0.weight, net.0.weight.exp_avg, net.0.weight.exp_avg_sq), and 'nonfinite_state' is not among "
        "Rollback's triggers; nothing was written. HINT: add 'nonfinite_state' to Rollback's triggers, so that it "
        "rolls back before a save"
    )
    detector_hint = "; add NonFiniteDetector, so that inf/NaN is found at the step it appears."
    assert message.endswith(".") and (detector_hint in message) is (not detector)
    assert ("NonFiniteDetector" in message) is (not detector)  # never suggested when it is in the list
    error = info.value
    assert error.kind == "weight" and error.step == 4 and error.ranks == [0]
    assert error.parameters == ["net.0.weight", "net.0.weight.exp_avg", "net.0.weight.exp_avg_sq"]
    assert names(tmp_path) == ["epoch=0-step=2.ckpt"]  # nothing written for step 4


class UnguardedSave(Callback):
    """Writes a checkpoint at ``step`` through the class's method, past the guard on the instance."""

    def __init__(self, path: Path, step: int) -> None:
        self.path, self.step = path, step

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        if trainer.global_step == self.step:
            pl.Trainer.save_checkpoint(trainer, self.path)


def test_a_writer_past_the_guard_meets_on_save_checkpoint(tmp_path: Path) -> None:
    rollback = Rollback(every_n_steps=100)
    callbacks = [rollback, FaultInjector(Fault(step=3, kind="nan_weight")), UnguardedSave(tmp_path / "x.ckpt", 4)]
    with pytest.raises(NonFiniteError) as info:
        fit(TinyRegressor(), callbacks, max_steps=8)
    assert str(info.value).startswith(
        "Rollback: refused to write a checkpoint at step 4: its weights contain inf/NaN on rank(s) 0 (in net.0.weight"
    )
    assert str(info.value).endswith(
        "and it was assembled outside trainer.save_checkpoint; nothing was written. HINT: add NonFiniteDetector, so "
        "that inf/NaN is found at the step it appears."
    )
    assert not (tmp_path / "x.ckpt").exists()


# ---- the guard itself ---------------------------------------------------------------------------------------------
class CountingTrainer(pl.Trainer):
    """A Trainer subclass with its own ``save_checkpoint``: the guard must still call it."""

    saves = 0

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        CountingTrainer.saves += 1
        super().save_checkpoint(*args, **kwargs)


class SeesTheGuard(Callback):
    def __init__(self) -> None:
        self.seen: list[bool] = []

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        self.seen.append(isinstance(vars(trainer).get("save_checkpoint"), CheckpointGuard))


def test_the_guard_lives_for_the_fit_and_delegates_to_the_trainers_own_method(tmp_path: Path) -> None:
    CountingTrainer.saves = 0
    sees = SeesTheGuard()
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, save_weights_only=True)
    trainer = CountingTrainer(
        callbacks=[Rollback(every_n_steps=2), sees, checkpoints], max_steps=4, accelerator="cpu", devices=1,
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(TinyRegressor())
    assert sees.seen == [True] * 4
    assert CountingTrainer.saves == 2 and names(tmp_path) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
    assert "save_checkpoint" not in vars(trainer)  # removed in teardown
    trainer.save_checkpoint(tmp_path / "after.ckpt")  # the class's own method again
    assert CountingTrainer.saves == 3


class Boom(Callback):
    """A user's own error at the end of batch ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("boom")


@pytest.mark.filterwarnings("ignore:.*was called without a model")
def test_an_exception_checkpoint_after_a_foreign_error_is_finite(tmp_path: Path) -> None:
    """A user's error with NaN weights in memory: ``OnExceptionCheckpoint`` (which Lightning calls after the other
    callbacks) writes the last verified snapshot's weights, restored by Rollback's own ``on_exception`` in one
    process (under DDP, where that error may be one rank's alone, by the guard before the file is written); the
    user's error propagates."""
    rollback, probe = Rollback(every_n_steps=2), WeightsAt()
    callbacks = [OnExceptionCheckpoint(dirpath=tmp_path), rollback, probe, nan_grad(2), Boom(3)]
    trainer = make_trainer(callbacks, max_steps=10, enable_checkpointing=True, default_root_dir=tmp_path)
    with pytest.raises(RuntimeError, match="^boom$"):
        trainer.fit(TinyRegressor())
    assert_bit_identical(dict(saved(tmp_path / "on_exception.ckpt")["state_dict"]), probe.at[2])
    restores = [e for e in rollback.board(trainer).journal.events if e.kind == "exit_restore"]
    assert [e.details for e in restores] == [{"error": "RuntimeError", "snapshot_step": 2, "source": "memory"}]
    assert rollback.rollbacks == 0 and rollback.history == []  # no rollback: the budget is untouched


def test_no_check_and_no_read_on_steps_without_a_checkpoint(count_reads: Any) -> None:
    """The guard costs nothing on the steps where nothing is saved: Rollback reads the device only for its
    snapshots and the check when training ends (one read each for the flags of the state)."""
    fit(TinyRegressor(), [Rollback(every_n_steps=4)], max_steps=8)
    assert count_reads["lightning_overflow.distributed"] == 4  # snapshots of steps 0, 4 and 8; the end of the fit
    assert count_reads["lightning_overflow.training_state"] == 0  # no buffer: no constants to record


# ---- DDP --------------------------------------------------------------------------------------------------------
class RankHistory(Callback):
    """Each rank writes its Rollback history to ``<out>/rank<r>.json`` (worker state does not come back)."""

    def __init__(self, out: Path, rollback: Rollback) -> None:
        self.out, self.rollback = out, rollback

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        report = {"history": self.rollback.history, "finite": finite(weights(pl_module)), "step": trainer.global_step}
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))


@pytest.mark.ddp
@pytest.mark.timeout(180)
def test_ddp_a_nan_on_rank_1_is_rolled_back_on_every_rank_before_a_weights_only_save(tmp_path: Path) -> None:
    rollback = Rollback(every_n_steps=100)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1,
                                  save_weights_only=True)
    faults = FaultInjector(Fault(step=5, kind="nan_weight", rank=1))
    callbacks = [rollback, faults, RankHistory(tmp_path, rollback), checkpoints]
    fit(TinyRegressor(), callbacks, max_steps=9, strategy="ddp_fork", devices=2, enable_checkpointing=True)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for report in reports:
        assert report["history"] == [
            {"step": 6, "reason": "nonfinite_state", "trigger_step": 6, "snapshot_step": 0, "source": "memory"}
        ]
        assert report["finite"] and report["step"] == 9
    for name in names(tmp_path / "ckpt"):
        assert finite(saved(tmp_path / "ckpt" / name)["state_dict"]), name
    # 32 samples a rank: 4 batches an epoch
    assert names(tmp_path / "ckpt") == ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt", "epoch=2-step=9.ckpt"]


# ---- validation scores the weights the checkpoints hold ----------------------------------------------------------
class UnusedRow(TinyRegressor):
    """A parameter the loss never reads (an embedding's row for an unseen category): a NaN there leaves the losses
    and the validation finite. Eight batches an epoch, one validation batch of 64."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = torch.nn.Parameter(torch.zeros(3))

    def val_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(self.data, batch_size=64)


def test_a_checkpoint_is_scored_on_the_weights_it_holds_when_validation_finds_the_state_nonfinite(
    tmp_path: Path,
) -> None:
    """The NaN written at step 12 is found when validation is to score the weights (the end of epoch 1, step 16):
    Rollback restores the snapshot of step 0 first, so the val_loss that names the epoch's checkpoint is that of the
    restored weights. Found at the save instead, the restored weights were filed under the replaced ones' score."""
    model = UnusedRow()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val_loss", save_top_k=-1)
    rollback = Rollback(every_n_steps=100)  # one snapshot: the fit's start
    fault = FaultInjector(Fault(step=12, kind="nan_weight", parameter="unused"))
    fit(model, [NonFiniteDetector(check_weights_every_n_steps=None), rollback, fault, checkpoint], max_steps=24,
        default_root_dir=tmp_path, limit_val_batches=1, enable_checkpointing=True)  # fmt: skip
    x, y = model.data.tensors
    assert len(checkpoint.best_k_models) == 3  # one an epoch
    for path, score in checkpoint.best_k_models.items():
        scored = UnusedRow()
        scored.load_state_dict(saved(Path(path))["state_dict"])
        with torch.no_grad():
            assert torch.nn.functional.mse_loss(scored(x), y).item() == pytest.approx(score.item(), rel=1e-6)
    [rolled] = [e for e in rollback.board(model.trainer).journal.events if e.kind == "rollback"]
    assert (rolled.step, rolled.details["snapshot_step"]) == (16, 0)
    assert "when validation was to score them" in rolled.message


# ---- a score logged by training steps: the weights it was logged on are gone after a rollback ----------------------
class EpochTrainLoss(TinyRegressor):
    """Logs its training loss as an epoch mean (``train_loss``), the monitor of checkpoints in a fit without
    validation (chemprop, GluonTS); eight batches an epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.epoch_losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def on_train_epoch_end(self) -> None:
        self.epoch_losses.append(float(self.trainer.callback_metrics["train_loss"]))


def test_a_rollback_leaves_no_checkpoint_ranked_by_the_training_loss_of_the_weights_it_replaced(tmp_path: Path) -> None:
    """The NaN written into the weights before step 15, the last of epoch 1, rolls the run back to the fit's first
    weights at once. That step's NaN loss is taken out of the epoch's mean, as a skipped step's (it made the mean NaN,
    which EarlyStopping stops a rescued run on). The mean is that of the weights replaced: a checkpoint of the restored
    weights filed under it ranked them, the fit's first, as the best, and removed epoch 0's, trained. The checkpoint
    callbacks that rank by a metric of the training steps write nothing more until the epoch of the rollback ends."""
    model = EpochTrainLoss()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="train_loss", save_top_k=1)
    rollback = Rollback(every_n_steps=100)  # one snapshot: the fit's start
    fault = FaultInjector(Fault(step=15, kind="nan_weight"))
    fit(model, [NonFiniteDetector(), rollback, fault, checkpoint], max_steps=24, default_root_dir=tmp_path,
        enable_checkpointing=True)  # fmt: skip
    [rolled] = [e for e in rollback.board(model.trainer).journal.events if e.kind == "rollback"]
    assert (rolled.step, rolled.details["snapshot_step"]) == (16, 0)
    assert len(model.epoch_losses) == 3 and all(math.isfinite(v) for v in model.epoch_losses)
    assert model.epoch_losses[1] < model.epoch_losses[0]  # it would have ranked the restored weights best
    # Epochs 0 and 2 were scored on the weights their files hold; epoch 1 wrote none.
    assert names(tmp_path / "ckpt") == ["epoch=0-step=8.ckpt"]
    assert Path(checkpoint.best_model_path).name == "epoch=0-step=8.ckpt"
    [held] = [e for e in rollback.board(model.trainer).journal.events if e.kind == "checkpoint_skipped"]
    assert held.step == 16
    assert held.message == (
        "Rollback: ModelCheckpoint(monitor='train_loss') wrote no checkpoint at step 16: 'train_loss' is logged by the "
        "training steps, and its value is that of the weights the rollback at step 16 replaced; the restored weights "
        "(the snapshot of step 0) get checkpoints ranked by it once the epoch of the rollback ends"
    )


class StepTrainLoss(TinyRegressor):
    """Logs its training loss on the step and the epoch: ``train_loss_step`` holds each step's value."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss


def test_after_a_rollback_a_checkpoint_ranked_by_one_steps_loss_is_held_at_that_step_only(tmp_path: Path) -> None:
    """``train_loss_step`` is the replaced weights' at the rollback's step (6) only: every later step logs the
    restored weights' own. That one save is held; the others, ``last.ckpt`` included, are written as without the
    fault. They were all held until the epoch's end: in a one-epoch fit, ``last.ckpt`` stayed at step 6."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="train_loss_step", every_n_train_steps=1,
                                 save_top_k=-1, save_last=True)  # fmt: skip
    rollback = Rollback(every_n_steps=4)
    model = StepTrainLoss(n_samples=128)  # 16 batches: one epoch
    fit(model, [NonFiniteDetector(), rollback, FaultInjector(Fault(step=5, kind="nan_weight")), checkpoint],
        max_steps=14, default_root_dir=tmp_path, enable_checkpointing=True)  # fmt: skip
    [rolled] = [e for e in rollback.board(model.trainer).journal.events if e.kind == "rollback"]
    assert (rolled.step, rolled.details["snapshot_step"]) == (6, 4)
    written = [f"epoch=0-step={step}.ckpt" for step in range(1, 15) if step != 6]
    assert names(tmp_path / "ckpt") == sorted([*written, "last.ckpt"])
    assert saved(tmp_path / "ckpt" / "last.ckpt")["global_step"] == 14
    [held] = [e for e in rollback.board(model.trainer).journal.events if e.kind == "checkpoint_skipped"]
    assert held.step == 6
    assert held.message.endswith("get checkpoints ranked by it from the next step, logged of their own")


class NanAfterTheStep(pl.Callback):
    """Writes NaN into the first weight at the end of batch ``step`` (after its update, before the suite's hooks of the
    batch end): an update that itself writes NaN, on a step no detector checks the weights at."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                next(pl_module.parameters()).view(-1)[0] = float("nan")


def test_nonfinite_weights_at_an_epochs_end_are_rolled_back_before_its_checkpoints_rank_them(tmp_path: Path) -> None:
    """NaN written into the weights by the last update of epoch 1 (step 16), where no detector looks: found at the
    epoch's end, before ModelCheckpoint saves, and rolled back there; the checkpoint ranked by train_loss is not
    written. Found only at the save, the restored weights (the fit's first) were filed under epoch 1's train_loss, kept
    as the best, and epoch 0's file removed."""
    model = EpochTrainLoss()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="train_loss", save_top_k=1)
    rollback = Rollback(every_n_steps=100)
    callbacks = [NanAfterTheStep(16), NonFiniteDetector(check_weights_every_n_steps=None), rollback, checkpoint]
    fit(model, callbacks, max_steps=24, default_root_dir=tmp_path, enable_checkpointing=True)
    [rolled] = [e for e in rollback.board(model.trainer).journal.events if e.kind == "rollback"]
    assert (rolled.step, rolled.details["snapshot_step"]) == (16, 0)
    assert "when the epoch's checkpoints were to be written" in rolled.message
    assert names(tmp_path / "ckpt") == ["epoch=0-step=8.ckpt"]
    assert [e.kind for e in rollback.board(model.trainer).journal.events].count("checkpoint_skipped") == 1


def test_a_rollback_at_an_epochs_end_is_counted_in_the_metrics_the_fit_leaves(tmp_path: Path) -> None:
    """A rollback after the last batch of the fit (the epoch's end, before its checkpoints) comes after the counters'
    last publication at a batch end: trainer.callback_metrics and the logger still get it (they said 0 rollbacks)."""
    model = EpochTrainLoss()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="train_loss", save_top_k=1)
    rollback = Rollback(every_n_steps=100)
    callbacks = [NanAfterTheStep(16), NonFiniteDetector(check_weights_every_n_steps=None), rollback, checkpoint]
    logger = pl.loggers.CSVLogger(tmp_path)
    fit(model, callbacks, max_steps=16, default_root_dir=tmp_path, enable_checkpointing=True, logger=logger,
        log_every_n_steps=1)  # fmt: skip
    [rolled] = [e for e in rollback.board(model.trainer).journal.events if e.kind == "rollback"]
    assert rolled.step == 16
    assert float(model.trainer.callback_metrics["overflow/rollbacks"]) == 1.0
    rows = (Path(logger.log_dir) / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    counts = [row.split(",")[header.index("overflow/rollbacks")] for row in rows[1:]]
    assert [float(c) for c in counts if c][-1] == 1.0


class SavesAt(pl.Callback):
    """A user's callback that writes a checkpoint at the end of one batch."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def test_a_checkpoint_another_callback_writes_on_a_batch_with_nan_weights_is_preceded_by_one_rollback(
    tmp_path: Path,
) -> None:
    """NaN weights at step 23 and 33, each found at the next batch's end, where another callback writes a checkpoint.
    Listed before the suite, its save was preceded by the rollback, and Rollback rolled back again for the same
    finding at its own hook: 4 rollbacks against 2 listed after, the budget spent twice as fast. One each now, in
    either order, to the same snapshots, and the same weights."""
    runs = []
    for first in (True, False):
        root = tmp_path / str(first)
        saver = SavesAt(24, root / "user.ckpt")
        suite = default_callbacks(snapshot_every_n_steps=5)
        torch.manual_seed(0)
        model = TinyRegressor()
        faults = FaultInjector(Fault(23, "nan_weight"), Fault(33, "nan_weight"))
        fit(model, [faults, *([saver, *suite] if first else [*suite, saver])], max_steps=60, default_root_dir=root)
        rollback = next(c for c in suite if isinstance(c, Rollback))
        runs.append(([(h["step"], h["snapshot_step"]) for h in rollback.history], weights(model)))
        assert (root / "user.ckpt").exists()
    assert runs[0][0] == runs[1][0] == [(24, 20), (34, 29)]
    assert_bit_identical(runs[0][1], runs[1][1])
