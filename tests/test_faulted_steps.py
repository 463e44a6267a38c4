"""A ``training_step`` that a bad value breaks is answered as an inf/NaN loss: one that raises on a NaN (a likelihood
from ``torch.distributions``, as gluonts' and pytorch-forecasting's probabilistic models compute theirs), or returns a
loss cut from the graph. The step is skipped, bad weights are rolled back, and every rank decides alike. A failure
the values did not cause passes unchanged."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import assert_bit_identical, fit, weights
from ddp_utils import run_ddp
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_overflow import Guard, NonFiniteDetector, NonFiniteError, Rollback, default_callbacks, read_journal
from lightning_overflow.fit_summary import plain_lines
from lightning_overflow.testing import Fault, FaultInjector

STEP = 3  # the step whose batch is corrupted
ROW = 2  # the row of that batch


class GaussianRegressor(pl.LightningModule):
    """Predicts a mean and a scale; its loss is the Gaussian negative log-likelihood, whose ``Normal`` checks its
    arguments and raises ``ValueError`` on a NaN mean."""

    def __init__(
        self, nan_at: tuple[int, int] | None = None, error_at: tuple[int, BaseException] | None = None
    ) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))
        self.nan_at = nan_at  # (step, rank): the input of row ROW becomes NaN before training_step
        self.error_at = error_at  # (step, exception): training_step raises it at that step

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.nan_at is not None and (self.global_step, self.global_rank) == self.nan_at:
            batch[0][ROW, 0] = float("nan")  # a fresh collated tensor each step: the dataset stays clean

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        if self.error_at is not None and self.global_step == self.error_at[0]:
            raise self.error_at[1]
        x, y = batch
        mean, scale = self.net(x).unbind(dim=1)
        likelihood = torch.distributions.Normal(mean, nn.functional.softplus(scale) + 1e-3, validate_args=True)
        return -likelihood.log_prob(y).mean()

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(256, 4, generator=generator)
        y = x.sum(dim=1) + 0.1 * torch.randn(256, generator=generator)
        return DataLoader(TensorDataset(x, y), batch_size=16)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9)


class StepWeights(pl.Callback):
    """The weights before and after the optimizer step of one step."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.before: dict[str, Tensor] = {}
        self.after: dict[str, Tensor] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        if trainer.global_step == self.step:
            self.before = weights(pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        if not self.after and self.before:
            self.after = weights(pl_module)


def test_the_model_raises_without_the_suite() -> None:
    with pytest.raises(ValueError, match="Expected parameter loc"):
        fit(GaussianRegressor(nan_at=(STEP, 0)))


def test_a_nan_batch_that_makes_the_forward_raise_is_skipped_like_a_nan_loss(tmp_path: Path) -> None:
    seen = StepWeights(STEP)
    model = GaussianRegressor(nan_at=(STEP, 0))
    initial = weights(model)
    fit(model, [NonFiniteDetector(), seen], default_root_dir=tmp_path)
    assert_bit_identical(seen.before, seen.after)  # the step was skipped: nothing moved
    # The same fit with a NaN loss at that step instead, on a clean batch, ends with the same weights, bit for bit.
    reference = GaussianRegressor()
    reference.load_state_dict(initial)
    reference_run = [NonFiniteDetector(), FaultInjector(Fault(STEP, "nan_loss"))]
    fit(reference, reference_run, default_root_dir=tmp_path / "ref")
    assert_bit_identical(weights(model), weights(reference))
    [event] = [e for e in read_journal(tmp_path / "overflow_events.jsonl") if e["kind"] == "data_fault"]
    assert event["step"] == STEP
    assert (
        "training_step raised ValueError('Expected parameter loc (Tensor of shape (16,)) of distribution "
        "Normal(loc: torch.Size([16]), scale: torch.Size([16])) to satisfy the constraint Real(), but found invalid "
        f"values') while its batch holds inf/NaN in row(s) {ROW}: answered as an inf/NaN loss."
    ) in event["message"]
    assert "batch 3 holds NaN in row 2. Persistent" in event["message"]  # the replay ran through the guard too
    assert plain_lines(read_journal(tmp_path / "overflow_events.jsonl")) == [
        "1 step skipped: batch 3 of epoch 0 (step 3) holds NaN in row 2 (training_step raised ValueError, answered "
        "as an inf/NaN loss): a data fault; check the data"
    ]
    assert "training_step" not in vars(model)  # the fit's guard is gone with the fit


def test_nan_weights_that_make_the_forward_raise_are_rolled_back(tmp_path: Path) -> None:
    model = GaussianRegressor()
    rollback = Rollback(every_n_steps=2)
    fit(model, [NonFiniteDetector(), rollback, FaultInjector(Fault(5, "nan_weight", parameter="net.2.weight"))],
        default_root_dir=tmp_path, max_steps=10)  # fmt: skip
    assert all(bool(torch.isfinite(t).all()) for t in weights(model).values())
    events = list(read_journal(tmp_path))
    [found] = [e for e in events if e["kind"] == "nonfinite"]
    assert found["step"] == 5
    assert "while the model holds inf/NaN in net.2.weight: answered as an inf/NaN loss" in found["message"]
    [rolled] = [e for e in events if e["kind"] == "rollback"]
    assert rolled["details"]["snapshot_step"] == 4
    assert plain_lines(events)[0] == (
        "1 step found: the weights held inf/NaN at step 5 (training_step raised ValueError, answered as an inf/NaN "
        "loss)"
    )


def test_an_error_the_values_did_not_cause_passes_unchanged() -> None:
    bug = ValueError("the model's own bug")
    with pytest.raises(ValueError, match="the model's own bug") as caught:
        fit(GaussianRegressor(error_at=(STEP, bug)), [NonFiniteDetector()])
    assert caught.value is bug


@pytest.mark.parametrize(
    "error",
    [torch.OutOfMemoryError("out of memory"), NotImplementedError("not written"), KeyError("features")],
    ids=type,
)  # fmt: skip
def test_an_error_no_value_causes_passes_unchanged_on_a_nan_batch(error: BaseException) -> None:
    with pytest.raises(type(error)) as caught:
        fit(GaussianRegressor(nan_at=(STEP, 0), error_at=(STEP, error)), [NonFiniteDetector()])
    assert caught.value is error


@pytest.mark.parametrize(
    "error",
    [Exception("Loss is NaN, training stopped."), OverflowError("cannot convert float infinity to integer"),
     AssertionError("the input holds NaN")],
    ids=type,
)  # fmt: skip
def test_a_libraries_own_check_of_a_nan_batch_is_answered(error: BaseException, tmp_path: Path) -> None:
    """neuralforecast raises a bare ``Exception`` when its loss is NaN; ``int(inf)`` raises ``OverflowError``. The
    check raises because of the NaN: with it set to 0 the step goes through, so the error is the batch's."""

    class ChecksItsInput(GaussianRegressor):
        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            if not torch.isfinite(batch[0]).all():
                raise error
            return super().training_step(batch, batch_idx)

    seen = StepWeights(STEP)
    model = ChecksItsInput(nan_at=(STEP, 0))
    fit(model, [NonFiniteDetector(), seen], default_root_dir=tmp_path)
    assert_bit_identical(seen.before, seen.after)
    [event] = [e for e in read_journal(tmp_path) if e["kind"] == "data_fault"]
    assert f"training_step raised {type(error).__name__}({str(error)!r}) while its batch holds" in event["message"]


def test_a_step_that_keeps_raising_on_bad_batches_ends_the_fit_with_its_own_error(tmp_path: Path) -> None:
    """Data that holds NaN in every batch (or a bug that strikes only there) is not hidden: after
    ``max_consecutive_skips`` the fit ends with the module's own error, as without the suite, told what was tried."""

    class NanEveryStep(GaussianRegressor):
        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            batch[0][ROW, 0] = float("nan")

    with pytest.raises(ValueError, match="Expected parameter loc") as caught:
        fit(NanEveryStep(), [NonFiniteDetector(max_consecutive_skips=5)], default_root_dir=tmp_path)
    [note] = caught.value.__notes__
    assert note.startswith("lightning_overflow: NonFiniteDetector: at step 4 on rank(s) 0 training_step raised "
                           "ValueError('Expected parameter loc")  # fmt: skip
    assert note.endswith(f"while its batch holds inf/NaN in row(s) {ROW}; the fit ends with that error (5 consecutive "
                         "optimizer steps were non-finite, this one included).")  # fmt: skip
    events = list(read_journal(tmp_path))
    assert [e["step"] for e in events if e["kind"] == "data_fault"] == [0, 1, 2, 3]
    assert [e["step"] for e in events if e["kind"] == "abort"] == [4]


def test_under_action_raise_a_step_that_raised_on_bad_values_ends_the_fit_with_its_own_error() -> None:
    with pytest.raises(ValueError, match="Expected parameter loc") as caught:
        fit(GaussianRegressor(nan_at=(STEP, 0)), [NonFiniteDetector(action="raise")])
    assert "the fit ends with that error (action='raise')" in caught.value.__notes__[0]


def test_nan_weights_without_rollback_end_the_fit_with_the_modules_own_error() -> None:
    """NonFiniteDetector alone raises at non-finite weights (nothing can restore them): the step raised on them, so
    the module's error ends the fit, its cause the detector's."""
    with pytest.raises(ValueError, match="Expected parameter loc") as caught:
        fault = Fault(STEP, "nan_weight", parameter="net.2.weight")
        fit(GaussianRegressor(), [NonFiniteDetector(), FaultInjector(fault)])
    assert isinstance(caught.value.__cause__, NonFiniteError)
    assert caught.value.__notes__[0].startswith("lightning_overflow: NonFiniteDetector: the weights contained inf/NaN")


class MaskedRegressor(GaussianRegressor):
    """Scores only the rows whose target is finite, as forecasting losses mask missing values, and returns a constant
    0 when none is: a loss cut from the graph, on which Lightning's backward raises."""

    def __init__(self, inf_targets_at: int | None = None) -> None:
        super().__init__()
        self.inf_targets_at = inf_targets_at

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.global_step == self.inf_targets_at:
            batch[1].fill_(float("inf"))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        valid = torch.isfinite(y)
        if not valid.any():
            return x.new_zeros(())
        return nn.functional.mse_loss(self.net(x)[:, 0][valid], y[valid])


def test_a_loss_cut_from_the_graph_by_a_bad_batch_is_skipped(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="does not require grad"):
        fit(MaskedRegressor(inf_targets_at=STEP))  # without the suite
    seen = StepWeights(STEP)
    fit(MaskedRegressor(inf_targets_at=STEP), [NonFiniteDetector(), seen], default_root_dir=tmp_path)
    assert_bit_identical(seen.before, seen.after)
    [event] = [e for e in read_journal(tmp_path) if e["kind"] == "data_fault"]
    assert event["step"] == STEP
    assert (
        "training_step returned a loss (0) cut from the graph while its batch holds inf/NaN in row(s) 0, 1, 2, 3, 4, "
    ) in event["message"]


def test_a_loss_cut_from_the_graph_on_a_sound_batch_raises_as_without_the_suite() -> None:
    class Detached(GaussianRegressor):
        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            return super().training_step(batch, batch_idx).detach()

    with pytest.raises(RuntimeError, match="element 0 of tensors does not require grad"):
        fit(Detached(), [NonFiniteDetector()])


def test_a_healthy_run_is_bit_identical_with_the_guard() -> None:
    plain, guarded = GaussianRegressor(), GaussianRegressor()
    guarded.load_state_dict(plain.state_dict())
    fit(plain)
    fit(guarded, default_callbacks())
    assert_bit_identical(weights(plain), weights(guarded))


class CopiesTheModule(pl.Callback):
    """What users' code does mid-fit: deep-copy the module (an EMA of its own) and pickle it (torch.save(model))."""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *_: Any) -> None:
        if trainer.global_step != STEP:
            return
        assert "training_step" in vars(pl_module)  # the detector's, for the fit
        for copied in (copy.deepcopy(pl_module), pickle.loads(pickle.dumps(pl_module))):
            with torch.no_grad():
                copied.net[2].bias.add_(1.0)  # the copy answers with its own weights
                loss = copied.training_step(batch, 0)
                expected = type(copied).training_step(copied, batch, 0)
                live = pl_module.training_step(batch, 0)
            assert torch.equal(loss, expected) and not torch.equal(loss, live)
        # A copy of the detector (a module's hyperparameters pickle it into every checkpoint) guards no module.
        (detector,) = [cb for cb in trainer.callbacks if isinstance(cb, NonFiniteDetector)]
        assert detector._step_guard is not None
        assert pickle.loads(pickle.dumps(detector))._step_guard is None
        assert copy.deepcopy(detector)._step_guard is None


def test_a_module_copied_or_pickled_mid_fit_runs_its_own_training_step() -> None:
    fit(GaussianRegressor(), [NonFiniteDetector(), CopiesTheModule()])


class WithoutBatchIdx(GaussianRegressor):
    def training_step(self, batch: Any) -> Tensor:  # type: ignore[override]
        return super().training_step(batch, 0)


@pytest.mark.parametrize("injector_first", [False, True])
def test_lightning_reads_the_arguments_of_the_modules_own_training_step_through_other_wrappers(
    injector_first: bool,
) -> None:
    """Lightning passes ``batch_idx`` only to a ``training_step`` that takes it, reading the arguments one wrapper
    deep: a second wrapper (a fault injector's) set before or after the detector's must not hide them."""
    detector, injector = NonFiniteDetector(), FaultInjector(Fault(STEP, "nan_loss"))
    seen = StepWeights(STEP)
    fit(WithoutBatchIdx(), [injector, detector, seen] if injector_first else [detector, injector, seen])
    assert injector.fired == [(STEP, "nan_loss", 0)] and detector.skipped_steps == 1
    assert_bit_identical(seen.before, seen.after)


def test_a_plain_loop_through_guard_train_step_answers_it_as_the_trainer_does(tmp_path: Path) -> None:
    def likelihood_loss(net: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        mean, scale = net(batch[0]).unbind(dim=1)
        normal = torch.distributions.Normal(mean, nn.functional.softplus(scale) + 1e-3, validate_args=True)
        return -normal.log_prob(batch[1]).mean()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))
    x, y = torch.randn(64, 4), torch.randn(64)
    x[16 * STEP + ROW, 0] = float("nan")
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.02), callbacks=[NonFiniteDetector()],
                  default_root_dir=tmp_path, loss_fn=likelihood_loss)  # fmt: skip
    outcomes = []
    for start in range(0, 64, 16):
        before = weights(model)
        outcomes.append(guard.train_step((x[start : start + 16], y[start : start + 16])))
    guard.close()
    assert [o.skipped for o in outcomes] == [False, False, False, True]
    assert_bit_identical(before, weights(model))
    [event] = [e for e in outcomes[STEP].events if e.kind == "data_fault"]
    assert "; loss_fn raised ValueError('Expected parameter loc " in event.message
    assert f"while its batch holds inf/NaN in row(s) {ROW}: answered as an inf/NaN loss" in event.message


class NanOnRank1EveryStep(GaussianRegressor):
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.global_rank == 1:
            batch[0][ROW, 0] = float("nan")


@pytest.mark.ddp
@pytest.mark.timeout(180)
def test_ddp_steps_that_keep_raising_on_rank_1_end_every_rank_at_the_same_step(tmp_path: Path) -> None:
    reports = run_ddp(NanOnRank1EveryStep(), [NonFiniteDetector(max_consecutive_skips=3)], tmp_path)
    errors = [r["error"] for r in reports]
    assert [e["type"] for e in errors] == ["NonFiniteError", "ValueError"]  # rank 1 ends with its module's error
    assert all("3 consecutive optimizer steps were non-finite, the last at step 2" in e["message"] for e in errors[:1])
    assert reports[0]["global_step"] == reports[1]["global_step"] == 2


@pytest.mark.ddp
@pytest.mark.timeout(180)
def test_ddp_a_batch_that_raises_on_rank_1_is_skipped_on_both_ranks(tmp_path: Path) -> None:
    detector = NonFiniteDetector()
    reports = run_ddp(GaussianRegressor(nan_at=(STEP, 1)), [detector], tmp_path)
    assert [r["error"] for r in reports] == [None, None]
    assert reports[0]["digest"] == reports[1]["digest"]
    states = [r["states"][0] for r in reports]
    assert states[0] == states[1] and '"skipped_steps": 1' in states[0]


class ManualGaussian(GaussianRegressor):
    """The same model under manual optimization, with two optimizers (the heads' and the body's), as scvi-tools'
    adversarial training plans step theirs inside ``training_step``: a NaN batch or weight makes ``Normal`` raise
    before any step."""

    def __init__(self, nan_at: tuple[int, int] | None = None) -> None:
        super().__init__(nan_at=nan_at)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        first, second = self.optimizers()  # type: ignore[misc]
        x, y = batch
        mean, scale = self.net(x).unbind(dim=1)
        likelihood = torch.distributions.Normal(mean, nn.functional.softplus(scale) + 1e-3, validate_args=True)
        loss = -likelihood.log_prob(y).mean()
        first.zero_grad()
        second.zero_grad()
        self.manual_backward(loss)
        first.step()
        second.step()
        return loss.detach()

    def configure_optimizers(self) -> Any:
        return (torch.optim.SGD(self.net[0].parameters(), lr=0.02, momentum=0.9),
                torch.optim.Adam(self.net[2].parameters(), lr=0.01))  # fmt: skip


def test_under_manual_optimization_a_nan_batch_that_raises_is_skipped_by_every_optimizer(tmp_path: Path) -> None:
    """The batch of the second batch (global steps 2 and 3) holds a NaN: the module raises before its steps. Each
    optimizer steps on the stand-in NaN loss instead and the suite skips both steps: the weights and optimizer states
    end as those of the fit that never saw that batch's update (it raised without the suite)."""
    with pytest.raises(ValueError, match="Expected parameter loc"):
        fit(ManualGaussian(nan_at=(2, 0)), max_steps=6)
    seen = StepWeights(2)
    model = ManualGaussian(nan_at=(2, 0))
    initial = weights(model)
    detector = NonFiniteDetector()
    fit(model, [detector, seen], default_root_dir=tmp_path, max_steps=6)
    assert_bit_identical(seen.before, seen.after)  # both steps of the batch were skipped: nothing moved
    assert detector.skipped_steps == 2 and model.trainer.global_step == 6
    # The reference: the same batches, the second one's steps skipped on a NaN loss instead.
    reference = ManualGaussian()
    reference.load_state_dict(initial)
    fit(reference, [NonFiniteDetector(), FaultInjector(Fault(2, "nan_loss"))], default_root_dir=tmp_path / "ref",
        max_steps=6)  # fmt: skip
    assert_bit_identical(weights(model), weights(reference))
    events = list(read_journal(tmp_path / "overflow_events.jsonl"))
    found = [e for e in events if e["kind"] == "data_fault"]  # not replayed: the answered step's batch says why
    assert [(e["step"], e["details"]["batch"], e["details"]["rows"]) for e in found] == [(2, 1, [ROW]), (3, 1, [ROW])]
    assert ("training_step raised ValueError('Expected parameter loc (Tensor of shape (16,)) of distribution Normal"
            in found[0]["message"])  # fmt: skip
    assert f"while its batch holds inf/NaN in row(s) {ROW}: answered as an inf/NaN loss." in found[0]["message"]
    assert plain_lines(events) == [
        "2 steps skipped: batch 1 of epoch 0 (steps 2, 3) holds NaN in row 2 (training_step raised ValueError on "
        "each, answered as inf/NaN losses): a data fault; check the data"
    ]


def test_under_manual_optimization_nan_weights_that_make_the_forward_raise_are_rolled_back(tmp_path: Path) -> None:
    model = ManualGaussian()
    fit(model, [*default_callbacks(), FaultInjector(Fault(6, "nan_weight", parameter="net.2.weight"))],
        default_root_dir=tmp_path, max_steps=16)  # fmt: skip
    assert all(bool(torch.isfinite(t).all()) for t in weights(model).values())
    assert model.trainer.global_step == 16
    events = list(read_journal(tmp_path))
    assert [e["step"] for e in events if e["kind"] == "nonfinite"][0] == 6
    assert [e["kind"] for e in events].count("rollback") == 1
    assert "data_fault" not in [e["kind"] for e in events]  # the weights' fault, held against the state


class StepsThenRaises(ManualGaussian):
    """The GAN pattern: the first optimizer steps on a loss that does not check its arguments (NaN on a NaN batch),
    then the second one's loss raises. NaN rows in the batches ``poisoned`` (by index)."""

    def __init__(self, poisoned: tuple[int, ...]) -> None:
        super().__init__()
        self.poisoned = poisoned

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if batch_idx in self.poisoned:
            batch[0][ROW, 0] = float("nan")

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        first, second = self.optimizers()  # type: ignore[misc]
        x, y = batch
        first.zero_grad()
        self.manual_backward(nn.functional.mse_loss(self.net(x)[:, 0], y))
        first.step()
        mean, scale = self.net(x).unbind(dim=1)
        likelihood = torch.distributions.Normal(mean, nn.functional.softplus(scale) + 1e-3, validate_args=True)
        loss = -likelihood.log_prob(y).mean()
        second.zero_grad()
        self.manual_backward(loss)
        second.step()
        return loss.detach()


def test_under_manual_optimization_a_raise_after_a_step_answers_only_the_optimizers_yet_to_step(tmp_path: Path) -> None:
    """The first optimizer stepped (skipped, its loss NaN) before the second's loss raised: the answer stepped both
    again, one optimizer step too many (``global_step`` 13 for 6 batches of 2) and the batch split in the summary."""
    model = StepsThenRaises(poisoned=(1,))
    detector = NonFiniteDetector()
    fit(model, [detector], default_root_dir=tmp_path, max_steps=12)
    assert model.trainer.global_step == 12 and model.trainer.fit_loop.epoch_loop.batch_idx == 5
    assert detector.skipped_steps == 2
    assert plain_lines(list(read_journal(tmp_path / "overflow_events.jsonl"))) == [
        "2 steps skipped: batch 1 of epoch 0 (steps 2, 3) holds NaN in row 2 (training_step raised ValueError on 1 of "
        "them, answered as inf/NaN losses): a data fault; check the data"
    ]


def test_under_manual_optimization_nan_rows_in_consecutive_batches_are_data_faults_not_a_failing_state(
    tmp_path: Path,
) -> None:
    """Without a replay, a NaN loss on a batch that did not raise was never put down to its batch: three such batches
    in a row read as steps failing on clean batches, and the suite backed off and rolled back to the fit's start."""
    model = StepsThenRaises(poisoned=(1, 2, 3))
    fit(model, default_callbacks(), default_root_dir=tmp_path, max_steps=16)
    events = list(read_journal(tmp_path / "overflow_events.jsonl"))
    assert not [e for e in events if e["kind"] in ("backoff", "rollback")]
    assert [e["step"] for e in events if e["kind"] == "data_fault"] == [2, 3, 4, 5, 6, 7]
