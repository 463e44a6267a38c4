"""No intervention may leave a run worse than doing nothing, unsaid: an infinite second moment Adam tolerates is no
fault of the state; a restore the fit ends behind is said in plain words."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import assert_bit_identical, fit, weights
from ddp_utils import run_ddp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_overflow import NonFiniteDetector, Rollback, default_callbacks
from lightning_overflow.fit_summary import behind_a_restore, plain_lines
from lightning_overflow.testing import TinyRegressor
from lightning_overflow.testing.faults import Fault, FaultInjector
from lightning_overflow.training_state import nonfinite_parts, without_tolerated_infinity


class _ExtremeInput(TinyRegressor):
    """A ReLU regression under Adam whose first batch holds one finite 1e30 (padding, a sentinel, a unit error): the
    first layer's gradient is about 1e29, its square overflows, and Adam's ``exp_avg_sq`` holds +inf from step 0."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(n_samples=64, **kwargs)
        self.net = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 1))
        x, y = self.data.tensors
        x = x.clone()
        x[3, 2] = 1e30
        self.data = TensorDataset(x, y)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.l1_loss(self(x), y)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size)


def test_an_infinite_second_moment_is_tolerated_and_a_signed_or_nan_one_is_not() -> None:
    inf, nan = float("inf"), float("nan")
    second = torch.tensor([0.25, inf, 0.0])
    assert torch.equal(without_tolerated_infinity(second), torch.tensor([0.25, 0.0, 0.0]))
    for bad in (torch.tensor([-0.25, inf]), torch.tensor([0.25, nan]), torch.tensor([0.25, -inf])):
        assert torch.equal(without_tolerated_infinity(bad).isfinite(), bad.isfinite())
    step = torch.tensor(inf)  # a 0-d entry is a counter: left as it is (the check leaves 0-d entries out)
    assert without_tolerated_infinity(step) is step
    state = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.tensor([1.0, -1.0]), "exp_avg_sq": second}}}
    assert nonfinite_parts({"w": torch.ones(2)}, [state]) == ([], [])
    state["state"][0]["exp_avg"] = torch.tensor([inf, -1.0])
    assert nonfinite_parts({"w": torch.ones(2)}, [state]) == ([], ["state.0.exp_avg"])


def test_adam_with_an_infinite_second_moment_from_one_extreme_value_is_left_to_train(tmp_path: Any) -> None:
    # Bare, Adam takes the 1e30 in: exp_avg_sq is +inf in the first layer, those elements stop moving, the rest
    # trains on. Rollback used to refuse every snapshot and return the run to step 0 at every snapshot step.
    pl.seed_everything(0, verbose=False)
    bare = _ExtremeInput()
    trainer = fit(bare, max_steps=40)
    assert torch.isinf(trainer.optimizers[0].state_dict()["state"][0]["exp_avg_sq"]).any()
    pl.seed_everything(0, verbose=False)
    guarded = _ExtremeInput()
    rollback = Rollback(every_n_steps=10)
    trainer = fit(guarded, [rollback], max_steps=40, default_root_dir=tmp_path)
    assert rollback.rollbacks == 0
    assert rollback.snapshot_steps == [30, 40]  # every snapshot taken: the state is a valid target
    assert_bit_identical(weights(bare), weights(guarded))


def _rollback(step: int, target: int, fit_start: int = 0, reason: str = "nonfinite_state") -> dict[str, Any]:
    details = {"snapshot_step": target, "fit_start": fit_start, "reason": reason, "budget_left": 2}
    return {"step": step, "kind": "rollback", "rank": 0, "source": "Rollback", "message": "", "details": details}


def test_a_fit_that_ends_behind_its_last_rollback_says_so() -> None:
    events = [_rollback(100, 0), _rollback(300, 0)]
    message, facts = behind_a_restore(events, last_step=300)  # type: ignore[misc]
    assert message == (
        "the fit ended 0 steps after the rollback at step 300 to the state the fit started from (after non-finite "
        "weights or optimizer state): the weights returned hold the training up to step 0 and 0 steps since; the "
        "300 steps before the rollback are not in them"
    )
    assert facts == {"rollback_step": 300, "snapshot_step": 0, "lost_steps": 300, "steps_after": 0}
    assert behind_a_restore([_rollback(120, 100, fit_start=0)], last_step=150) is None  # it trained past it
    assert behind_a_restore([_rollback(120, 100, fit_start=0)], last_step=135) is not None
    assert plain_lines(events)[0].startswith(
        "rolled back twice (2 more allowed at this learning rate): at step 100 to the snapshot of step 0 (where the "
        "fit started) after "
    )


def test_a_kept_remedy_counts_the_steps_it_trained_from_the_snapshot() -> None:
    """A trial opened after step 159 kept, at step 200, the remedy that restarted from step 0: the weights hold its 40
    steps, not none."""
    kept = _rollback(200, 0, reason="no_progress")
    kept["details"]["source"] = "trial"
    trial = {"step": 200, "kind": "trial", "rank": 0, "source": "lightning_overflow", "message": "",
             "details": {"opened_at": 159, "steps": 40, "kept": True}}  # fmt: skip
    message, facts = behind_a_restore([trial, kept], last_step=210)  # type: ignore[misc]
    assert message == (
        "the fit ended 10 steps after the trial at step 200 kept a remedy that restarted from the state the fit "
        "started from (after the loss stalled short of half its start): the weights returned hold the training up to "
        "step 0, the remedy's 40 steps at a lower learning rate and 10 steps since; the 200 steps the run had trained "
        "past step 0 are not in them"
    )
    assert facts == {"rollback_step": 200, "snapshot_step": 0, "lost_steps": 160, "steps_after": 10,
                     "remedy_steps": 40}  # fmt: skip
    assert behind_a_restore([trial, kept], last_step=360) is None  # 160 steps since: as many as the run lost


def test_a_rollback_on_the_last_step_ends_the_summary_with_what_was_lost(tmp_path: Any) -> None:
    model = TinyRegressor()
    callbacks = default_callbacks(snapshot_every_n_steps=4) + [FaultInjector(Fault(step=15, kind="nan_weight"))]
    trainer = fit(model, callbacks, max_steps=16, default_root_dir=tmp_path)
    board_events = [e for e in _journal(tmp_path) if e["kind"] in ("rollback", "behind")]
    assert [e["kind"] for e in board_events] == ["rollback", "behind"]
    assert board_events[1]["details"] == {"rollback_step": 16, "snapshot_step": 12, "lost_steps": 4, "steps_after": 0}
    assert trainer.global_step == 16


class ReloadsTheStart(pl.Callback):
    """Puts the fit's first weights back when training ends, as a callback that reloads its best checkpoint does."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.first = {k: v.clone() for k, v in pl_module.state_dict().items()}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pl_module.load_state_dict(self.first)


@pytest.mark.parametrize("replaced", [False, True])
def test_words_of_the_weights_the_fit_ended_with_are_said_not_to_hold_when_a_callback_replaced_them(
    replaced: bool, tmp_path: Any
) -> None:
    model = TinyRegressor()
    callbacks = default_callbacks(snapshot_every_n_steps=4) + [FaultInjector(Fault(step=15, kind="nan_weight"))]
    fit(model, callbacks + ([ReloadsTheStart()] if replaced else []), max_steps=16, default_root_dir=tmp_path)
    kinds = [e["kind"] for e in _journal(tmp_path)]
    assert "behind" in kinds
    assert ("weights_replaced" in kinds) is replaced
    if replaced:
        assert plain_lines(_journal(tmp_path))[-1] == (
            "after the fit's last step another callback put other weights into the model (one that reloads the best "
            "checkpoint when training ends, as scvi-tools' SaveCheckpoint(load_best_on_end=True) and GluonTS do): what "
            "is said above of the weights the fit ended with is not of the weights it returns"
        )


def _journal(root: Any) -> list[dict[str, Any]]:
    from lightning_overflow import read_journal

    return [dict(e) for e in read_journal(root)]


def test_an_extreme_value_in_the_data_is_told_as_a_data_fault_not_a_learning_rate(tmp_path: Any) -> None:
    fit(_ExtremeInput(), [NonFiniteDetector()], max_steps=4, default_root_dir=tmp_path)
    (found,) = [e for e in _journal(tmp_path) if e["kind"] in ("data_fault", "headroom")]
    assert found["kind"] == "data_fault" and found["step"] == 0
    assert (found["details"]["batch"], found["details"]["rows"]) == (0, [3])
    assert found["message"].startswith(
        "NonFiniteDetector: batch 0 holds values up to 1e+30 in row 3 (no normalised input holds such values: a data "
        "fault), and the step's largest magnitude is only "
    )
    assert "lower the learning rate" not in found["message"]


class _ExtremeIntoBatchNorm(TinyRegressor):
    """A BatchNorm regression whose batch 2 holds one finite 1e30: the batch variance overflows to inf, the output
    stays finite (normalised by inf: 0), the loss and the gradients stay finite, and only running_var takes the inf."""

    def __init__(self) -> None:
        super().__init__(batch_norm=True)
        x, y = self.data.tensors
        x = x.clone()
        x[2 * self.batch_size + 1, 0] = 1e30
        self.data = TensorDataset(x, y)


def test_a_batch_that_overflows_batchnorm_statistics_is_skipped_and_the_buffers_put_back(tmp_path: Any) -> None:
    pl.seed_everything(0, verbose=False)
    bare = _ExtremeIntoBatchNorm()
    fit(bare, max_steps=3)
    assert torch.isinf(bare.net[1].running_var).any()  # bare: the statistics hold inf from step 2 on
    pl.seed_everything(0, verbose=False)
    model = _ExtremeIntoBatchNorm()
    detector = NonFiniteDetector()
    fit(model, [detector], max_steps=3, default_root_dir=tmp_path)
    pl.seed_everything(0, verbose=False)
    two_steps = _ExtremeIntoBatchNorm()
    fit(two_steps, max_steps=2)
    assert detector.skipped_steps == 1
    assert_bit_identical(weights(model), weights(two_steps))  # step 2 a true no-op: buffers put back, bit for bit
    (found,) = [e for e in _journal(tmp_path) if e["kind"] in ("nonfinite", "data_fault")]
    assert (found["kind"], found["step"], found["details"]["where"]) == ("data_fault", 2, "buffer")
    assert found["details"]["parameters"] == ["net.1.running_var"]
    assert found["message"].startswith(
        "NonFiniteDetector: the forward pass wrote inf/NaN into buffers in net.1.running_var at step 2 (epoch 0) on "
        "rank(s) 0. The optimizer step was skipped. The batch: batch 2 holds values up to 1e+30 in row 1."
    )


class _ExtremeOnRankOne(TinyRegressor):
    """Under DDP (2 ranks, no shuffling) rank 1 takes the odd samples: sample 33 is row 0 of its batch 2."""

    def __init__(self) -> None:
        super().__init__(batch_norm=True)
        x, y = self.data.tensors
        x = x.clone()
        x[33, 0] = 1e30
        self.data = TensorDataset(x, y)


@pytest.mark.ddp
@pytest.mark.timeout(180)
def test_ddp_ranks_skip_together_when_one_ranks_batch_overflows_its_statistics(tmp_path: Path) -> None:
    detector = NonFiniteDetector()
    reports = run_ddp(_ExtremeOnRankOne(), [detector], tmp_path, max_steps=4)
    assert [r["error"] for r in reports] == [None, None]
    assert reports[0]["finite"] and reports[1]["finite"]  # rank 1's statistics put back (each rank keeps its own)
    assert reports[0]["states"] == reports[1]["states"]  # the same decisions on both
    assert '"skipped_steps": 1' in reports[0]["states"][0]


@dataclasses.dataclass
class _Batch:
    """A library's own batch class (darts' training batch, chemprop's molecule graph are dataclasses)."""

    x: torch.Tensor
    y: torch.Tensor


class _DataclassBatches(TinyRegressor):
    """Batches 3, 4 and 5 each hold a NaN in row 0; ``as_dataclass`` hands them to training_step as a dataclass."""

    def __init__(self, as_dataclass: bool) -> None:
        super().__init__(optimizer="sgd")
        self.as_dataclass = as_dataclass
        x, y = self.data.tensors
        x = x.clone()
        for batch in (3, 4, 5):
            x[batch * self.batch_size, 0] = float("nan")
        self.data = TensorDataset(x, y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = (batch.x, batch.y) if isinstance(batch, _Batch) else batch
        return nn.functional.mse_loss(self(x), y)

    def train_dataloader(self) -> DataLoader:
        def collate(items: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
            x, y = torch.stack([a for a, _ in items]), torch.stack([b for _, b in items])
            return _Batch(x, y) if self.as_dataclass else (x, y)

        return DataLoader(self.data, batch_size=self.batch_size, collate_fn=collate)


@pytest.mark.parametrize("as_dataclass", [False, True])
def test_bad_data_in_a_librarys_own_batch_class_is_a_data_fault_not_a_failing_state(
    as_dataclass: bool, tmp_path: Path
) -> None:
    # Three bad batches in a row used to read as "steps that keep failing on batches that hold no inf/NaN" when the
    # batch was a dataclass: the learning rate backed off and the run went back to step 0.
    callbacks = default_callbacks()
    fit(_DataclassBatches(as_dataclass), callbacks, max_steps=8, default_root_dir=tmp_path)
    kinds = [e["kind"] for e in _journal(tmp_path)]
    assert kinds.count("data_fault") == 3 and "nonfinite" not in kinds
    assert "backoff" not in kinds and "rollback" not in kinds
    found = [e for e in _journal(tmp_path) if e["kind"] == "data_fault"]
    assert [(e["step"], e["details"]["batch"], e["details"]["rows"]) for e in found] == [(3, 3, [0]), (4, 4, [0]),
                                                                                         (5, 5, [0])]


class _MostlyBadData(TinyRegressor):
    """Twelve of the sixteen batches of an epoch hold a NaN: one missing value in a series poisons every window
    that holds it."""

    def __init__(self) -> None:
        super().__init__(optimizer="sgd", n_samples=128)
        x, y = self.data.tensors
        x = x.clone()
        for batch in range(2, 14):
            x[batch * self.batch_size + 1, 2] = float("nan")
        self.data = TensorDataset(x, y)


def test_steps_skipped_for_bad_data_spend_no_skip_budget(tmp_path: Path) -> None:
    detector = NonFiniteDetector()
    fit(_MostlyBadData(), [detector], max_steps=32, default_root_dir=tmp_path)  # alone: it used to raise
    assert detector.skipped_steps == 24  # 12 bad batches in each of the 2 epochs, every one skipped
    kinds = [e["kind"] for e in _journal(tmp_path)]
    assert "skip_budget" not in kinds and "abort" not in kinds
    callbacks = default_callbacks()
    fit(_MostlyBadData(), callbacks, max_steps=32, default_root_dir=tmp_path / "suite")
    kinds = [e["kind"] for e in _journal(tmp_path / "suite")]
    assert kinds.count("data_fault") == 24 and "backoff" not in kinds and "rollback" not in kinds


class _MissingTargets(TinyRegressor):
    """Every batch misses one target (NaN), which the loss leaves out, as chemprop does with the missing values of a
    multi-task dataset: the NaN never reaches the loss or the gradients."""

    def __init__(self) -> None:
        super().__init__(optimizer="sgd", n_samples=64)
        x, y = self.data.tensors
        y = y.clone()
        y[:: self.batch_size] = float("nan")  # the first row of each batch
        self.data = TensorDataset(x, y)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        present = ~y.isnan()
        return nn.functional.mse_loss(self(x)[present], y[present])


def test_a_missing_value_the_model_masks_does_not_make_a_state_fault_a_data_fault(tmp_path: Path) -> None:
    """The last layer's weight multiplied by 1e36 before step 5: every loss from there on is inf. The batch of step 5
    holds a NaN target too, masked by the loss: set to 0, the replay is inf all the same, so the NaN is not the
    cause. The fault is the state's: it persists, the learning rate backs off and the run rolls back (as a data fault
    never held against the state, it was skipped 20 times and the fit ended with NonFiniteError)."""
    faults = FaultInjector(Fault(5, "scale_weight", parameter="net.2.weight", factor=1e36))
    model = _MissingTargets()
    fit(model, [*default_callbacks(), faults], max_steps=24, default_root_dir=tmp_path)
    events = _journal(tmp_path)
    kinds = [e["kind"] for e in events]
    assert "data_fault" not in kinds and "abort" not in kinds
    first = next(e for e in events if e["kind"] == "nonfinite")
    assert first["step"] == 5
    assert ("batch 5 holds NaN in row 0, not the cause: set to 0, the replay was inf/NaN all the same"
            in first["message"])  # fmt: skip
    assert [e["details"]["snapshot_step"] for e in events if e["kind"] == "rollback"] == [0]
    assert all(torch.isfinite(t).all() for t in weights(model).values())


def test_a_missing_value_that_reaches_the_loss_is_still_the_data_fault() -> None:
    """The same NaN, unmasked: set to 0, the replay is finite, so it is the cause."""

    class Unmasked(_MissingTargets):
        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self(x), y)

    model, detector = Unmasked(), NonFiniteDetector()
    fit(model, [detector], max_steps=3)
    events = detector.board(model.trainer).journal.events
    assert [(e.step, e.kind) for e in events][:2] == [(0, "data_fault"), (0, "skip")]
    assert events[0].details["data"] == "batch 0 holds NaN in row 0"


def test_an_intermediate_nan_the_step_masks_itself_does_not_acquit_the_batch() -> None:
    """A NaN in the features at step 0, and a NaN the step computes and masks itself every step (a mean over an empty
    group, as SCANVI's division by a count of 0): set to 0, the batch gives a finite loss and gradients, so the
    batch's NaN is the cause, whatever NaN the step makes on the way."""

    class MasksItsOwnNan(TinyRegressor):
        def __init__(self) -> None:
            super().__init__(optimizer="sgd")
            x, y = self.data.tensors
            x = x.clone()
            x[2, 1] = float("nan")
            self.data = TensorDataset(x, y)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            empty = (y > 1e9).float()
            group_mean = (y * empty).sum() / empty.sum()  # 0/0: NaN, left out below
            extra = torch.where(torch.isnan(group_mean), torch.zeros(()), group_mean)
            return nn.functional.mse_loss(self(x), y) + extra

    model, detector = MasksItsOwnNan(), NonFiniteDetector()
    fit(model, [detector], max_steps=2)
    events = detector.board(model.trainer).journal.events
    assert [(e.step, e.kind) for e in events][:2] == [(0, "data_fault"), (0, "skip")]
    assert events[0].details["data"] == "batch 0 holds NaN in row 2"


def test_an_error_of_the_models_own_on_a_batch_with_masked_missing_values_is_not_swallowed(tmp_path: Path) -> None:
    """A bug raises RuntimeError at step 3 in a model whose every batch misses a target it masks. The batch holds a
    NaN, but set to 0 the step raises all the same: the error is the module's own and ends the fit, as it does
    without the suite (it was answered as an inf/NaN loss and called a data fault)."""

    class Buggy(_MissingTargets):
        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            if self.global_step == 3:
                raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (8x4 and 5x32)")
            return super().training_step(batch, batch_idx)

    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes"):
        fit(Buggy(), [], max_steps=6)
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes"):
        fit(Buggy(), default_callbacks(), max_steps=6, default_root_dir=tmp_path)
