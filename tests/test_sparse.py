"""Sparse gradients (nn.Embedding(sparse=True), with SGD or SparseAdam): norms, finiteness, clipping and the skip."""

from __future__ import annotations

from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import MemoryLogger, fit
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_overflow import AutoClip, GradNormMonitor, NonFiniteDetector, default_callbacks
from lightning_overflow.numerics import tensor_norms
from lightning_overflow.testing import Fault, FaultInjector


class SparseEmbedding(pl.LightningModule):
    def __init__(self, optimizer: str = "sgd", momentum: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8, sparse=True)
        self.head = nn.Linear(8, 1)
        self.optimizer_name = optimizer
        self.momentum = momentum
        self.automatic_optimization = optimizer == "sgd"

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.head(self.embed(x)).squeeze(-1), y)
        if not self.automatic_optimization:
            optimizers = self.optimizers()
            self.manual_backward(loss)
            for opt in optimizers:
                opt.step()
                opt.zero_grad()
        return loss

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "sparseadam":
            return [torch.optim.SparseAdam(list(self.embed.parameters()), lr=0.01),
                    torch.optim.SGD(self.head.parameters(), lr=0.01)]
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=self.momentum)

    def train_dataloader(self) -> DataLoader:
        gen = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randint(0, 50, (64,), generator=gen), torch.randn(64, generator=gen))
        return DataLoader(data, batch_size=8)


def test_the_norm_of_a_sparse_gradient_is_that_of_its_dense_form() -> None:
    indices = torch.tensor([[0, 2, 2]])  # row 2 twice: duplicates add up
    sparse = torch.sparse_coo_tensor(indices, torch.tensor([[3.0, 0.0], [1.0, 2.0], [2.0, 2.0]]), (4, 2))
    assert tensor_norms([sparse]).tolist() == pytest.approx([torch.linalg.vector_norm(sparse.to_dense()).item()])


def test_monitor_logs_the_dense_norm_of_sparse_gradients() -> None:
    logger, seen = MemoryLogger(), []

    class Dense(pl.Callback):
        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            seen.append(torch.cat([p.grad.to_dense().reshape(-1) for p in pl_module.parameters()]).double().norm())

    fit(SparseEmbedding(), [Dense(), GradNormMonitor()], max_steps=4, logger=logger, log_every_n_steps=1)
    assert [v for _, v in logger.metrics["grad_norm/total"]] == pytest.approx([t.item() for t in seen], rel=1e-6)


def test_a_nan_step_with_sparse_gradients_is_skipped_and_changes_nothing() -> None:
    model, at = SparseEmbedding(), {}

    class Probe(pl.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, *_: Any) -> None:
            at[trainer.global_step] = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}

    fit(model, [NonFiniteDetector(), Probe(), FaultInjector(Fault(3, "nan_loss"))], max_steps=6)
    assert all(torch.equal(at[3][k], at[4][k]) for k in at[3])
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("mode", ["fixed", "zscore", "percentile", "agc"])
def test_every_clipping_mode_runs_on_sparse_gradients(mode: str) -> None:
    clip = AutoClip(mode=mode, max_norm=1e-3 if mode == "fixed" else None)  # type: ignore[arg-type]
    norms: list[float] = []

    class After(pl.Callback):  # after AutoClip (a suite callback acts when the first of them is called)
        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            grads = [p.grad.to_dense().reshape(-1) for p in pl_module.parameters()]
            norms.append(torch.cat(grads).double().norm().item())

    model = SparseEmbedding()
    fit(model, [clip, After()], max_steps=5)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    if mode == "fixed":
        assert max(norms) == pytest.approx(1e-3, rel=1e-5)


def test_sparse_adam_with_the_whole_suite() -> None:
    model = SparseEmbedding("sparseadam")
    trainer = fit(model, [*default_callbacks(), FaultInjector(Fault(4, "nan_loss"))], max_steps=12)
    assert trainer.global_step == 12
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_nan_weights_beside_a_sparse_momentum_are_rolled_back_once() -> None:
    """SGD keeps a sparse momentum for a sparse gradient; the state check of the NaN weights ran ``amin`` on it, which
    sparse tensors lack: the fit crashed at the step it should have rolled back."""
    model = SparseEmbedding(momentum=0.9)
    nan_weight = FaultInjector(Fault(8, "nan_weight", parameter="embed.weight"))
    trainer = fit(model, [*default_callbacks(snapshot_every_n_steps=5), nan_weight], max_steps=16)
    rollback = trainer.callbacks[5]
    assert [(h["step"], h["snapshot_step"]) for h in rollback.history] == [(10, 5)]
    momentum = trainer.optimizers[0].state[model.embed.weight]["momentum_buffer"]
    assert momentum.is_sparse and torch.isfinite(momentum.coalesce().values()).all()
    assert trainer.global_step == 16 and all(torch.isfinite(p).all() for p in model.parameters())
