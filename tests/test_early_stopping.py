"""EarlyStopping(check_finite=True) beside a detector that skips: warned about at setup, and the README's fix
(the loss logged through a NaN-ignoring mean) keeps the rescued run going."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torchmetrics
from conftest import fit
from pytorch_lightning.callbacks import EarlyStopping

from lightning_overflow import NonFiniteDetector, OverflowWarning
from lightning_overflow.testing import TinyRegressor


class EpochLoss(TinyRegressor):
    """Logs its training loss per epoch, as the README shows: through MeanMetric(nan_strategy='ignore')."""

    def __init__(self, ignore_nan: bool) -> None:
        super().__init__()
        self.ignore_nan = ignore_nan
        self.train_loss = torchmetrics.MeanMetric(nan_strategy="ignore" if ignore_nan else "disable")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.train_loss(loss.detach())
        self.log("train_loss", self.train_loss, on_step=False, on_epoch=True)
        return loss


def _fit(ignore_nan: bool) -> Any:
    stopper = EarlyStopping(monitor="train_loss", patience=100)  # check_finite=True by default
    model = EpochLoss(ignore_nan)
    model.data.tensors[0][3 * model.batch_size, 0] = float("nan")  # batch 3 of every epoch: its loss is NaN
    return fit(model, [NonFiniteDetector(), stopper], max_steps=24)  # 3 epochs of 8


def test_the_combination_is_warned_about_at_setup() -> None:
    with pytest.warns(OverflowWarning, match=r"EarlyStopping\(monitor='train_loss', check_finite=True\) stops"):
        _fit(ignore_nan=True)


@pytest.mark.filterwarnings("ignore::lightning_overflow.OverflowWarning")
def test_a_nan_ignoring_epoch_mean_keeps_the_rescued_run_going() -> None:
    assert _fit(ignore_nan=True).global_step == 24


@pytest.mark.filterwarnings("ignore::lightning_overflow.OverflowWarning")
def test_a_plain_epoch_mean_lets_early_stopping_end_it() -> None:
    assert _fit(ignore_nan=False).global_step == 8


@pytest.mark.parametrize("monitor", ["val_loss", "val/acc", "validation_loss"])
def test_early_stopping_on_a_validation_metric_is_not_warned_about(monitor: str) -> None:
    """A validation metric never holds a skipped training step's NaN: nothing to warn about."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(TinyRegressor(), [NonFiniteDetector(), EarlyStopping(monitor=monitor, strict=False)], max_steps=2,
            limit_val_batches=0)  # fmt: skip
    assert not [w for w in caught if issubclass(w.category, OverflowWarning)]


def test_lightnings_spike_detection_beside_the_suite_is_warned_about_at_setup(tmp_path: Any) -> None:
    from pytorch_lightning.callbacks import SpikeDetection

    with pytest.warns(OverflowWarning) as caught:
        fit(TinyRegressor(), [NonFiniteDetector(), SpikeDetection(exclude_batches_path=str(tmp_path))], max_steps=2)
    assert [str(w.message) for w in caught if "SpikeDetection" in str(w.message)] == [
        "NonFiniteDetector: Lightning's SpikeDetection is in the callbacks. It raises TrainingSpikeException at the "
        "first step whose loss is NaN (or spikes), the very step this detector skips: a run the suite would rescue is "
        "stopped there. Remove SpikeDetection: LossSpikeDetector finds the spikes, and the suite skips the non-finite "
        "steps and tries the remedies of the rest."
    ]
