"""No fit leaves the suite's hands with inf/NaN in its state unsaid: the check when training ends, and buffers that a
step's forward re-assigns, put back on a skip."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import assert_bit_identical, fit, weights

from lightning_overflow import (
    NonFiniteDetector,
    NonFiniteError,
    OverflowWarning,
    Rollback,
    default_callbacks,
    read_journal,
)
from lightning_overflow.testing import TinyRegressor


class PoisonRunningVar(pl.Callback):
    """Writes NaN into ``net.1.running_var`` after step 20, between steps: a buggy hook, a bad restore."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        if trainer.global_step == 20:
            pl_module.net[1].running_var[0] = float("nan")


def _overflow_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, OverflowWarning) and "fit ended" in str(w.message)]


def test_a_buffer_poisoned_between_checks_is_restored_when_the_fit_ends(tmp_path: Any) -> None:
    torch.manual_seed(0)
    model = TinyRegressor(batch_norm=True)
    start = weights(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(model, [*default_callbacks(), PoisonRunningVar()], max_steps=60, default_root_dir=str(tmp_path))
    message = (
        "Rollback: the fit ended at step 60 with inf/NaN in its weights on rank(s) 0 (in net.1.running_var); restored "
        "the snapshot of step 0 (memory): the model returned holds finite values, and the steps since that snapshot "
        "are lost."
    )
    assert _overflow_warnings(caught) == [message]
    assert_bit_identical(weights(model), start)  # the only snapshot of a 60-step fit: the one it started from
    (event,) = [e for e in _events(tmp_path) if e["kind"] == "exit_restore"]
    assert (event["step"], event["details"]["snapshot_step"], event["message"]) == (60, 0, message)


def _events(root: Any) -> list[dict[str, Any]]:
    path = root / "overflow_events.jsonl"
    return list(read_journal(path)) if path.exists() else []


@pytest.mark.parametrize("action", ["skip", "raise"])
def test_without_rollback_the_detector_says_so_naming_the_buffer_and_the_step(tmp_path: Any, action: str) -> None:
    message = (
        "NonFiniteDetector: the fit ended at step 60 with inf/NaN in its weights on rank(s) 0 (in "
        "net.1.running_var); nothing restored them. HINT: add Rollback (default_callbacks()) to restore the last state "
        "verified finite, and look at what wrote them (a BatchNorm statistic fed a NaN sample, a buffer updated "
        "outside the step)."
    )
    model = TinyRegressor(batch_norm=True)
    callbacks = [NonFiniteDetector(action=action), PoisonRunningVar()]  # type: ignore[arg-type]
    if action == "raise":
        with pytest.raises(NonFiniteError) as error:
            fit(model, callbacks, max_steps=60, default_root_dir=str(tmp_path))
        assert str(error.value) == message and error.value.step == 60
        assert error.value.parameters == ["net.1.running_var"]
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(model, callbacks, max_steps=60, default_root_dir=str(tmp_path))
    assert _overflow_warnings(caught) == [message]
    assert [(e["step"], e["kind"]) for e in _events(tmp_path)] == [(60, "nonfinite_at_end")]


class PoisonLastUpdate(pl.Callback):
    """NaN in a weight at the end of the last batch, after the suite's hooks: as an update that wrote NaN would."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        if trainer.global_step == trainer.max_steps:
            pl_module.net[0].weight.data[0, 0] = float("nan")


def test_a_final_update_that_wrote_nan_is_not_returned(tmp_path: Any) -> None:
    """The last step's weights are NaN: no later step finds them; the end of the fit does, and restores."""
    torch.manual_seed(0)
    model, after = TinyRegressor(), WeightsAt(20)
    fit(model, [NonFiniteDetector(), Rollback(every_n_steps=5), after, PoisonLastUpdate()], max_steps=22,
        default_root_dir=str(tmp_path))  # fmt: skip
    assert [(e["step"], e["kind"], e["details"]["snapshot_step"]) for e in _events(tmp_path)] == [
        (22, "exit_restore", 20)
    ]
    assert_bit_identical(weights(model), after.weights)


class WeightsAt(pl.Callback):
    """The weights at the end of one step's batch."""

    def __init__(self, step: int) -> None:
        self.step, self.weights = step, {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        if trainer.global_step == self.step:
            self.weights = weights(pl_module)


class MovingAverage(TinyRegressor):
    """A buffer re-assigned by each forward (``self.ema = 0.9 * self.ema + ...``), and a NaN batch at step 30."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ema", torch.zeros(()))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.trainer.global_step == 30:
            x = x * float("nan")
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.ema = 0.9 * self.ema + 0.1 * loss.detach()
        return loss


def test_a_buffer_the_forward_re_assigns_is_put_back_on_a_skip(tmp_path: Any) -> None:
    """The skipped step changes nothing, that buffer included: the run ends as the same run whose NaN batch came to a
    step that changed nothing."""
    model = MovingAverage()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(model, [NonFiniteDetector()], max_steps=40, default_root_dir=str(tmp_path))
    assert torch.isfinite(model.ema) and _overflow_warnings(caught) == []
    assert [(e["step"], e["kind"]) for e in _events(tmp_path) if e["kind"] == "skip"] == [(30, "skip")]


class CausalMask(TinyRegressor):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.triu(torch.full((3, 3), float("-inf")), 1))


def test_a_buffer_that_held_inf_from_the_start_is_legitimate_at_the_end(tmp_path: Any) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(CausalMask(), default_callbacks(), max_steps=10, default_root_dir=str(tmp_path))
    assert _overflow_warnings(caught) == []
    assert not [e for e in _events(tmp_path) if e["kind"] in ("exit_restore", "nonfinite_at_end")]
