"""EarlyStopping(check_finite=True) beside a detector that skips: a loss tensor logged with on_epoch=True leaves a
skipped step's NaN out of its epoch mean, so the rescued run goes on; a value kept in state of the user's own (a
torchmetrics Metric, a value computed at the epoch's end) is warned about when a training hook logged it (where
Lightning says it comes from, not its name), and the README's fix (a NaN-ignoring mean) keeps the run going."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torchmetrics
from conftest import fit, with_nan_sample
from pytorch_lightning.callbacks import EarlyStopping
from torch import nn

from lightning_overflow import NonFiniteDetector, OverflowWarning
from lightning_overflow.testing import TinyGAN, TinyRegressor


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


class OwnEpochMean(TinyRegressor):
    """Keeps its training loss's mean in a torchmetrics Metric it does not hold as a submodule (in a plain dict):
    state of its own, which a skipped step's NaN stays in."""

    def __init__(self) -> None:
        super().__init__()
        self.own = {"train_loss": torchmetrics.MeanMetric(nan_strategy="disable")}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.own["train_loss"](loss.detach())
        self.log("train_loss", self.own["train_loss"], on_step=False, on_epoch=True, metric_attribute="own")
        return loss


def _own(tmp_path: Any = None, *callbacks: Any) -> Any:
    model = OwnEpochMean()
    model.data.tensors[0][3 * model.batch_size, 0] = float("nan")  # batch 3 of every epoch: its loss is NaN
    stopper = callbacks[0] if callbacks else EarlyStopping(monitor="train_loss", patience=100)
    root = {"default_root_dir": str(tmp_path)} if tmp_path is not None else {}
    return fit(model, [NonFiniteDetector(), stopper], max_steps=24, **root)


def _fit(ignore_nan: bool) -> Any:
    stopper = EarlyStopping(monitor="train_loss", patience=100)  # check_finite=True by default
    model = EpochLoss(ignore_nan)
    model.data.tensors[0][3 * model.batch_size, 0] = float("nan")  # batch 3 of every epoch: its loss is NaN
    return fit(model, [NonFiniteDetector(), stopper], max_steps=24)  # 3 epochs of 8


def test_the_combination_is_warned_about_once_the_training_step_logged_it() -> None:
    with pytest.warns(OverflowWarning) as caught:
        _own()
    assert [str(w.message) for w in caught if "EarlyStopping" in str(w.message)] == [
        "NonFiniteDetector: EarlyStopping(monitor='train_loss', check_finite=True) stops the fit when 'train_loss' is "
        "not finite, and 'train_loss' is logged from a training hook through state of its own (a value computed at "
        "the epoch's end, or a torchmetrics Metric the module does not hold as a submodule). A step this detector "
        "skips has an inf/NaN loss; kept there, the value EarlyStopping checks is inf/NaN and the run is stopped "
        "although it was rescued. Log the loss tensor itself with self.log(..., on_epoch=True), or a torchmetrics "
        "Metric held by the module (a skipped step's value is left out of either), log only finite losses, monitor a "
        "validation metric, or pass EarlyStopping(check_finite=False)."
    ]


class _Named(TinyRegressor):
    """Logs its training loss and its validation loss under names of the user's choosing (neuralforecast:
    ``train_loss`` and ``ptl/val_loss``), or its training loss only at the end of each epoch."""

    def __init__(self, train_key: str, val_key: str, at_epoch_end: bool = False, on_step: bool = False,
                 epoch_key: str | None = None) -> None:  # fmt: skip
        super().__init__()
        self.train_key, self.val_key, self.at_epoch_end, self.on_step = train_key, val_key, at_epoch_end, on_step
        self.epoch_key = epoch_key or train_key

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if not self.at_epoch_end:
            self.log(self.train_key, loss, on_step=self.on_step, on_epoch=True)
        return loss

    def on_train_epoch_end(self) -> None:
        if self.at_epoch_end:
            self.log(self.epoch_key, torch.tensor(1.0))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log(self.val_key, torch.nn.functional.mse_loss(self(x), y))


@pytest.mark.parametrize(
    ("monitor", "model", "warned"),
    [
        ("ptl/val_loss", _Named("train_loss", "ptl/val_loss"), False),  # a validation metric, whatever its name
        ("loss", _Named("train_loss", "loss"), False),
        ("epoch_score", _Named("epoch_score", "v", at_epoch_end=True), True),  # computed and logged at the epoch's end
        ("val_score", _Named("v", "o", at_epoch_end=True, epoch_key="val_score"), True),  # the same, named "val"
        # A loss tensor logged from training_step: a skipped step's value is left out of its epoch mean.
        ("valid_hinge", _Named("valid_hinge", "v"), False),
        ("train_loss_epoch", _Named("train_loss", "v", on_step=True), False),  # its epoch form
    ],
)
def test_the_warning_follows_where_the_metric_is_logged_not_its_name(monitor: str, model: Any, warned: bool) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(model, [NonFiniteDetector(), EarlyStopping(monitor=monitor, patience=100)], max_steps=16,
            limit_val_batches=1)  # fmt: skip
    said = [w for w in caught if issubclass(w.category, OverflowWarning) and "EarlyStopping" in str(w.message)]
    assert len(said) == int(warned)


class TensorEpochLoss(TinyRegressor):
    """Logs its loss tensor per epoch (as chemprop does), keeping each step's loss; batch 3 of every epoch holds a
    NaN feature."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[torch.Tensor] = []
        self.data.tensors[0][3 * self.batch_size, 0] = float("nan")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.detach().clone())
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss


def test_a_skipped_steps_loss_is_left_out_of_its_epoch_mean_and_the_rescued_run_goes_on() -> None:
    bare = fit(TensorEpochLoss(), [EarlyStopping(monitor="train_loss", patience=100)], max_steps=24)
    assert bare.global_step == 8  # the epoch mean is NaN: EarlyStopping ends the run after its first epoch
    model = TensorEpochLoss()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(model, [NonFiniteDetector(), EarlyStopping(monitor="train_loss", patience=100)], max_steps=24)
    assert trainer.global_step == 24  # 3 epochs of 8 batches, batch 3 skipped in each
    assert not [w for w in caught if issubclass(w.category, OverflowWarning) and "EarlyStopping" in str(w.message)]
    # The last epoch's mean is Lightning's own sum over the 7 steps that went ahead (8 rows each), in their order.
    assert trainer.callback_metrics["train_loss"].item() == _mean_of_the_last_epochs_steps_ahead(model.losses, rows=8)


def _mean_of_the_last_epochs_steps_ahead(losses: list[torch.Tensor], rows: int) -> float:
    """The mean of the third epoch's losses but its skipped batch 3 (NaN), summed in order with ``rows`` each."""
    last = losses[16:]
    assert not torch.isfinite(last[3]) and all(torch.isfinite(v) for i, v in enumerate(last) if i != 3)
    total = torch.tensor(0.0)
    for i, value in enumerate(last):
        if i != 3:
            total = total + value * rows
    return (total / (7 * rows)).item()


def test_a_nan_ignoring_epoch_mean_keeps_the_rescued_run_going() -> None:
    assert _fit(ignore_nan=True).global_step == 24


def test_a_metric_the_module_holds_gets_back_its_state_before_a_skipped_step_and_the_rescued_run_goes_on() -> None:
    """A plain MeanMetric took in the skipped step's NaN, and EarlyStopping ended the rescued run after its first
    epoch. The skip puts the metric's state back: each epoch's value is the mean of the steps that went ahead, and
    nothing is warned about."""
    bare_model = EpochLoss(ignore_nan=False)
    bare_model.data.tensors[0][3 * bare_model.batch_size, 0] = float("nan")
    assert fit(bare_model, [EarlyStopping(monitor="train_loss", patience=100)], max_steps=24).global_step == 8

    class Kept(EpochLoss):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            self.losses.append(loss.detach())
            return loss

    model = Kept(ignore_nan=False)
    model.losses = []
    model.data.tensors[0][3 * model.batch_size, 0] = float("nan")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(model, [NonFiniteDetector(), EarlyStopping(monitor="train_loss", patience=100)], max_steps=24)
    assert trainer.global_step == 24
    assert not [w for w in caught if issubclass(w.category, OverflowWarning) and "EarlyStopping" in str(w.message)]
    # The last epoch's value is the mean of its 7 steps that went ahead, as MeanMetric sums them.
    assert trainer.callback_metrics["train_loss"].item() == _mean_of_the_last_epochs_steps_ahead(model.losses, rows=1)


@pytest.mark.filterwarnings("ignore::lightning_overflow.OverflowWarning")
def test_a_mean_of_its_own_lets_early_stopping_end_it() -> None:
    assert _own().global_step == 8


@pytest.mark.parametrize("monitor", ["val_loss", "val/acc", "validation_loss"])
def test_early_stopping_on_a_validation_metric_is_not_warned_about(monitor: str) -> None:
    """A validation metric never holds a skipped training step's NaN: nothing to warn about."""
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


def test_lightnings_anomaly_detection_is_warned_about_when_training_starts() -> None:
    with pytest.warns(OverflowWarning) as caught:
        fit(TinyRegressor(), [NonFiniteDetector()], max_steps=2, detect_anomaly=True)
    assert [str(w.message) for w in caught if "detect_anomaly" in str(w.message)] == [
        "NonFiniteDetector: Trainer(detect_anomaly=True) is on. torch's anomaly mode raises RuntimeError in the backward "
        "pass of the first step that computes inf/NaN, before this detector sees the step: a step it would skip ends "
        "the fit instead. Turn it off to let the suite skip the step; its replay names the module and the op as the "
        "anomaly mode would."
    ]
    with warnings.catch_warnings(record=True) as quiet:
        warnings.simplefilter("always")
        fit(TinyRegressor(), [NonFiniteDetector()], max_steps=2)
    assert not [w for w in quiet if "detect_anomaly" in str(w.message)]


@pytest.mark.filterwarnings("ignore::lightning_overflow.OverflowWarning")
def test_a_fit_early_stopping_ends_on_a_nonfinite_metric_says_so(tmp_path: Any) -> None:
    from lightning_overflow import read_journal

    trainer = _own(tmp_path)
    assert trainer.global_step == 8
    (stopped,) = [e for e in read_journal(tmp_path / "overflow_events.jsonl") if e["kind"] == "stopped"]
    assert stopped["message"].startswith(
        "EarlyStopping(monitor='train_loss') stopped the fit at step 8 because 'train_loss' was nan, not finite: the "
        "weights returned are those of that step."
    )


class NanValidation(TinyRegressor):
    """Trains on clean data; its validation batch holds a NaN feature, so val_loss is NaN whatever the weights."""

    def val_dataloader(self) -> Any:
        x, y = self.data.tensors
        x = x.clone()
        x[0, 0] = float("nan")
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64)


def test_early_stopping_on_a_nonfinite_validation_metric_is_not_blamed_on_skipped_steps(tmp_path: Any) -> None:
    from lightning_overflow import read_journal

    stopper = EarlyStopping(monitor="val_loss", patience=100)
    trainer = fit(NanValidation(), [NonFiniteDetector(), stopper], max_steps=24, default_root_dir=str(tmp_path),
                  limit_val_batches=1)  # fmt: skip
    assert trainer.global_step == 8
    (stopped,) = [e for e in read_journal(tmp_path / "overflow_events.jsonl") if e["kind"] == "stopped"]
    assert stopped["message"] == (
        "EarlyStopping(monitor='val_loss') stopped the fit at step 8 because 'val_loss' was nan, not finite: the "
        "weights returned are those of that step. 'val_loss' is not logged by a training hook: the model gave it on "
        "its weights as they were, which is no skipped step's doing; look at the data it was computed on and at the "
        "model's outputs"
    )


class StepLoss(TinyRegressor):
    """Logs its training loss per step only (``self.log`` in ``training_step``: Lightning's ``on_epoch=False``, as
    darts does); the last batch of every epoch holds a NaN feature, so the value EarlyStopping checks at the epoch's
    end is the skipped step's."""

    def __init__(self) -> None:
        super().__init__()
        self.data.tensors[0][7 * self.batch_size, 0] = float("nan")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


def test_a_per_step_monitor_is_warned_about_and_its_stop_said_as_what_it_is(tmp_path: Any) -> None:
    from lightning_overflow import read_journal

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(StepLoss(), [NonFiniteDetector(), EarlyStopping(monitor="train_loss", patience=100)],
                      max_steps=24, default_root_dir=str(tmp_path))  # fmt: skip
    assert trainer.global_step == 8  # the first epoch's last step was skipped: its NaN is the value checked
    [said] = [str(w.message) for w in caught if "EarlyStopping" in str(w.message)]
    assert "'train_loss' is logged from a training hook per step only (self.log(...) in training_step, whose " \
           "default is on_epoch=False): it holds the value of the last step before the check, inf/NaN where that " \
           "step was skipped. A step this detector skips" in said
    (stopped,) = [e for e in read_journal(tmp_path / "overflow_events.jsonl") if e["kind"] == "stopped"]
    assert stopped["message"] == (
        "EarlyStopping(monitor='train_loss') stopped the fit at step 8 because 'train_loss' was nan, not finite: the "
        "weights returned are those of that step. 'train_loss' is logged per step only (self.log(...) in "
        "training_step, whose default is on_epoch=False): it holds the value of the last step before the check, "
        "inf/NaN where that step was skipped: log the loss tensor with self.log(..., on_epoch=True) and monitor that "
        "(a skipped step's value is left out of the epoch's mean), log only finite values, or pass "
        "EarlyStopping(check_finite=False)"
    )


class LoudEarlyStopping(EarlyStopping):
    """A library's own EarlyStopping (scvi-tools' prints why it stopped)."""


def test_a_librarys_subclass_of_early_stopping_is_warned_about_and_its_stop_said(tmp_path: Any) -> None:
    from lightning_overflow import read_journal

    with pytest.warns(OverflowWarning) as caught:
        trainer = _own(tmp_path, LoudEarlyStopping(monitor="train_loss", patience=100))
    assert any("EarlyStopping(monitor='train_loss', check_finite=True)" in str(w.message) for w in caught)
    assert trainer.global_step == 8
    (stopped,) = [e for e in read_journal(tmp_path / "overflow_events.jsonl") if e["kind"] == "stopped"]
    assert stopped["message"].startswith("EarlyStopping(monitor='train_loss') stopped the fit at step 8")


def test_a_metric_collecting_predictions_is_put_back_to_the_ones_before_the_skipped_step() -> None:
    """A curve metric collects every step's predictions in list states: after the skipped step it holds those of the
    steps that went ahead, the same tensors, not copies made at each batch."""

    class Collects(TinyRegressor):
        def __init__(self) -> None:
            super().__init__()
            self.seen = torchmetrics.CatMetric(nan_strategy="disable")

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            self.seen.update(loss.detach().reshape(1))
            return loss

    model = Collects()
    model.data.tensors[0][3 * model.batch_size, 0] = float("nan")  # batch 3: its loss is NaN, its step skipped
    fit(model, [NonFiniteDetector()], max_steps=6)
    values = torch.cat(model.seen.value)
    assert len(values) == 5 and bool(torch.isfinite(values).all())


class LoggingGAN(TinyGAN):
    """``TinyGAN`` logging both losses per epoch after its two steps, as GANs do; sample 21 is NaN, so the
    discriminator's loss of batch 1 of each epoch (4 batches of 16) is NaN, and the generator's is not."""

    def __init__(self) -> None:
        super().__init__()
        self.data = with_nan_sample(self.data)
        self.d_losses: list[torch.Tensor] = []
        self.g_losses: list[torch.Tensor] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        (real,) = batch
        opt_d, opt_g = self.optimizers()  # type: ignore[misc]
        z = torch.randn(real.shape[0], self.latent, generator=self.noise_gen)
        bce, ones, zeros = nn.functional.binary_cross_entropy_with_logits, torch.ones(16, 1), torch.zeros(16, 1)
        fake = self.generator(z)
        d_loss = bce(self.discriminator(real), ones) + bce(self.discriminator(fake.detach()), zeros)
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        g_loss = bce(self.discriminator(fake), ones)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.d_losses.append(d_loss.detach().clone())
        self.g_losses.append(g_loss.detach().clone())
        self.log("d_loss", d_loss, on_step=False, on_epoch=True)
        self.log("g_loss", g_loss, on_step=False, on_epoch=True)


def test_under_manual_optimization_a_skipped_steps_nan_is_left_out_of_the_epoch_means_the_batch_logged() -> None:
    """Logged after both steps of the batch, the skipped discriminator step's NaN loss is taken out of its epoch
    mean, and the generator's loss of the same batch, finite, stays in its own: EarlyStopping on d_loss lets the
    rescued run go on (bare, the NaN mean ends it after the first epoch)."""
    bare = fit(LoggingGAN(), [EarlyStopping(monitor="d_loss", patience=100)], max_steps=24)
    assert bare.global_step == 8  # 4 batches of 2 optimizer steps
    model = LoggingGAN()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(model, [NonFiniteDetector(), EarlyStopping(monitor="d_loss", patience=100)], max_steps=24)
    assert trainer.global_step == 24
    assert not [w for w in caught if issubclass(w.category, OverflowWarning) and "EarlyStopping" in str(w.message)]
    d_last, g_last = model.d_losses[8:], model.g_losses[8:]  # the third epoch's 4 batches
    assert not torch.isfinite(d_last[1]) and all(torch.isfinite(v) for v in g_last)
    expected_d = torch.tensor(0.0)
    for i, value in enumerate(d_last):
        if i != 1:
            expected_d = expected_d + value * 16
    expected_g = torch.tensor(0.0)
    for value in g_last:
        expected_g = expected_g + value * 16
    assert trainer.callback_metrics["d_loss"].item() == (expected_d / 48).item()
    assert trainer.callback_metrics["g_loss"].item() == (expected_g / 64).item()


class MetricGAN(LoggingGAN):
    """``LoggingGAN`` whose discriminator loss goes through a ``MeanMetric`` the module holds."""

    def __init__(self, nan_strategy: str) -> None:
        super().__init__()
        self.d_mean = torchmetrics.MeanMetric(nan_strategy=nan_strategy)

    def log(self, name: str, value: Any, **kwargs: Any) -> None:  # type: ignore[override]
        if name == "d_loss":
            self.d_mean(value)
            value = self.d_mean
        super().log(name, value, **kwargs)


@pytest.mark.parametrize("nan_strategy", ["disable", "ignore"])
def test_under_manual_optimization_a_metric_the_batch_made_nan_gets_back_its_state(nan_strategy: str) -> None:
    """A MeanMetric fed the skipped step's NaN holds NaN after the batch ("disable"; "ignore" leaves it out by
    itself): the batch's end puts its state back, so its epoch value is the mean of the 3 batches that went ahead, no
    warning is given, and EarlyStopping lets the rescued run go on (bare, the NaN ends it after its first epoch)."""
    bare = fit(MetricGAN("disable"), [EarlyStopping(monitor="d_loss", patience=100)], max_steps=24)
    assert bare.global_step == 8
    model = MetricGAN(nan_strategy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(model, [NonFiniteDetector(), EarlyStopping(monitor="d_loss", patience=100)], max_steps=24)
    assert trainer.global_step == 24
    assert not [w for w in caught if issubclass(w.category, OverflowWarning) and "EarlyStopping" in str(w.message)]
    d_last = model.d_losses[8:]
    assert not torch.isfinite(d_last[1])
    ahead = torch.stack([v for i, v in enumerate(d_last) if i != 1])
    assert trainer.callback_metrics["d_loss"].item() == pytest.approx(ahead.mean().item(), rel=1e-6)
