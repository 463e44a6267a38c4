"""A skipped step is a true no-op: parameters, buffers (BatchNorm's running statistics, which the forward pass of
the bad batch already moved), optimizer state and the LR schedule are exactly as before it."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from conftest import fit
from torchmetrics import CatMetric, MeanMetric

from lightning_overflow import NonFiniteDetector, default_callbacks
from lightning_overflow.skip import BufferCopy, MetricCopy
from lightning_overflow.testing import TinyRegressor

BAD_BATCH = 3


class StateProbe(pl.Callback):
    """Module state (parameters and buffers) and the LR at the end of every batch."""

    def __init__(self) -> None:
        self.at: dict[int, tuple[dict[str, torch.Tensor], float]] = {}  # by batch index

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        state = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        self.at[batch_idx] = (state, trainer.optimizers[0].param_groups[0]["lr"])


def _model_with_a_nan_sample() -> TinyRegressor:
    model = TinyRegressor(batch_norm=True, scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.9))
    model.data.tensors[0][BAD_BATCH * model.batch_size + 1, 0] = float("nan")
    return model


def test_a_skipped_step_leaves_the_buffers_as_they_were() -> None:
    probe = StateProbe()
    model = _model_with_a_nan_sample()
    fit(model, [NonFiniteDetector(), probe], max_steps=6)
    before, lr_before = probe.at[BAD_BATCH - 1]
    after, lr_after = probe.at[BAD_BATCH]
    assert set(before) >= {"net.1.running_mean", "net.1.running_var", "net.1.num_batches_tracked"}
    for key in before:
        assert torch.equal(before[key], after[key]), key
    assert lr_after == lr_before
    model.eval()
    with torch.no_grad():
        assert torch.isfinite(model(torch.randn(5, 4))).all()


def test_without_a_skip_the_bad_batch_poisons_the_running_statistics() -> None:
    probe = StateProbe()
    fit(_model_with_a_nan_sample(), [probe], max_steps=6)
    after, _ = probe.at[BAD_BATCH]
    assert not torch.isfinite(after["net.1.running_mean"]).all()


def test_the_whole_suite_keeps_buffers_through_accumulated_micro_batches() -> None:
    probe = StateProbe()
    model = _model_with_a_nan_sample()
    fit(model, [*default_callbacks(), probe], max_steps=4, accumulate_grad_batches=2)
    # Batches 2 and 3 form step 1: the window began before batch 2, whose forward pass moved the statistics too.
    before, _ = probe.at[1]
    after, _ = probe.at[3]
    for key in ("net.1.running_mean", "net.1.running_var", "net.1.num_batches_tracked"):
        assert torch.equal(before[key], after[key]), key


def test_under_manual_optimization_a_skip_puts_back_only_the_buffers_the_batch_made_nonfinite() -> None:
    """What a manual-optimization skip puts back (``BufferCopy.put_back_nonfinite``): a running statistic the batch
    made NaN goes back to its value at the batch's start; one it moved and left finite stays as it is (another
    optimizer's step may rely on it); a constant that held -inf before the batch (a causal mask), here re-assigned at
    another length by the forward pass, is not this batch's doing and stays as the forward left it."""
    module = torch.nn.Module()
    module.register_buffer("mean", torch.tensor([1.0, 2.0]))
    module.register_buffer("var", torch.tensor([3.0, 4.0]))
    module.register_buffer("mask", torch.full((4,), float("-inf")))
    copy = BufferCopy()
    copy.take(module)
    module.mean.copy_(torch.tensor([float("nan"), 5.0]))
    module.var.copy_(torch.tensor([6.0, 7.0]))
    module.mask = torch.full((6,), float("-inf"))
    copy.put_back_nonfinite()
    assert torch.equal(module.mean, torch.tensor([1.0, 2.0]))
    assert torch.equal(module.var, torch.tensor([6.0, 7.0]))
    assert module.mask.shape == (6,) and bool(torch.isneginf(module.mask).all())


def test_under_manual_optimization_a_skip_puts_back_only_the_metric_states_the_batch_made_nonfinite() -> None:
    """``MetricCopy.put_back_nonfinite``: a mean fed NaN and a list of predictions fed a NaN go back to their states at
    the batch's start; a metric the batch fed finite values keeps them."""
    module = torch.nn.Module()
    module.mean, module.cat, module.kept = MeanMetric(nan_strategy="disable"), CatMetric(), MeanMetric()
    module.mean.update(torch.tensor(1.0))
    module.cat.update(torch.tensor([1.0]))
    copy = MetricCopy()
    copy.take(module)
    module.mean.update(torch.tensor(float("nan")))
    module.cat.update(torch.tensor([float("nan")]))
    module.kept.update(torch.tensor(3.0))
    copy.put_back_nonfinite()
    assert module.mean.compute().item() == 1.0
    assert module.cat.compute().reshape(-1).tolist() == [1.0]
    assert module.kept.compute().item() == 3.0
