"""Complex parameters (spectral layers, complex-valued networks): norms, finiteness, clipping, rollback, replicas."""

from __future__ import annotations

import math
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import MemoryLogger, assert_bit_identical, fit, weights
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_overflow import AutoClip, GradNormMonitor, NonFiniteDetector, Rollback, default_callbacks
from lightning_overflow.numerics import nonfinite_flag, refine_norms, tensor_norms, unitwise_norms
from lightning_overflow.replicas import checksum
from lightning_overflow.testing import Fault, FaultInjector


class ComplexMixer(pl.LightningModule):
    """A complex 4x4 mixing matrix, then the moduli into a real linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mix = nn.Parameter(0.3 * torch.randn(4, 4, dtype=torch.cfloat))
        self.head = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head((x.to(torch.cfloat) @ self.mix).abs()), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(64, 4, generator=gen)
        return DataLoader(TensorDataset(x, 2 * x[:, :1]), batch_size=8)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_the_norms_of_a_complex_tensor_are_those_of_its_moduli(dtype: torch.dtype) -> None:
    t = torch.tensor([3 + 4j, 0 - 1j, 1 + 1j], dtype=dtype)
    assert tensor_norms([t]).tolist() == pytest.approx([math.sqrt(25 + 1 + 2)])
    assert tensor_norms([t], math.inf).tolist() == [5.0]
    huge = torch.full((10,), 1e20 + 1e20j, dtype=dtype)  # its squares overflow FP32
    assert refine_norms([huge], tensor_norms([huge]), [0]).tolist() == pytest.approx([math.sqrt(20) * 1e20])
    rows = torch.tensor([[3 + 4j, 0j], [1j, 1 + 0j]], dtype=dtype)
    for exact in (False, True):
        (units,) = unitwise_norms([rows], exact=exact)
        assert units.shape == (2, 1) and units.flatten().tolist() == pytest.approx([5.0, math.sqrt(2)])


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
@pytest.mark.parametrize("value", [complex(1, math.nan), complex(math.inf, 0), complex(0, -math.inf)])
def test_a_complex_tensor_is_non_finite_when_either_part_is(dtype: torch.dtype, value: complex) -> None:
    t = torch.tensor([1 + 1j, value, 2j], dtype=dtype)
    assert nonfinite_flag([t]).item() == 1.0
    assert nonfinite_flag([torch.tensor([1e30 + 1e30j], dtype=dtype)]).item() == 0.0


def test_the_replica_checksum_counts_the_imaginary_parts() -> None:
    assert checksum([torch.tensor([1 + 2j, 3 - 1j])]).tolist() == [1 + 2 + 3 - 1, 1 + 4 + 9 + 1]


def test_the_monitor_logs_the_norm_of_complex_gradients() -> None:
    logger, seen = MemoryLogger(), []

    class Exact(pl.Callback):
        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            seen.append(math.sqrt(sum(float(torch.linalg.vector_norm(p.grad.to(torch.complex128))) ** 2
                                      for p in pl_module.parameters())))  # fmt: skip

    fit(ComplexMixer(), [Exact(), GradNormMonitor()], max_steps=4, logger=logger, log_every_n_steps=1)
    assert [v for _, v in logger.metrics["grad_norm/total"]] == pytest.approx(seen, rel=1e-6)


def test_a_healthy_run_with_the_suite_is_bit_identical() -> None:
    bare, suite = ComplexMixer(), ComplexMixer()
    fit(bare, [], max_steps=30)
    fit(suite, default_callbacks(clip=None, snapshot_every_n_steps=10), max_steps=30)
    assert_bit_identical(weights(bare), weights(suite))


@pytest.mark.parametrize("mode", ["fixed", "zscore", "percentile", "agc"])
def test_every_clipping_mode_runs_on_complex_gradients(mode: str) -> None:
    norms: list[float] = []

    class After(pl.Callback):  # after AutoClip (a suite callback acts when the first of them is called)
        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            grads = [torch.view_as_real(p.grad).reshape(-1) if p.grad.is_complex() else p.grad.reshape(-1)
                     for p in pl_module.parameters()]  # fmt: skip
            norms.append(torch.cat(grads).double().norm().item())

    model = ComplexMixer()
    fit(model, [AutoClip(mode=mode, max_norm=1e-3 if mode == "fixed" else None), After()], max_steps=5)  # type: ignore[arg-type]
    assert torch.isfinite(torch.view_as_real(model.mix)).all() and len(norms) == 5
    if mode == "fixed":
        assert norms == pytest.approx([1e-3] * 5, rel=1e-5)


def test_a_nan_in_the_imaginary_part_of_a_weight_is_rolled_back_to_the_snapshot() -> None:
    after: dict[int, dict[str, torch.Tensor]] = {}

    class ImaginaryNaN(pl.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, *_: Any) -> None:
            if trainer.global_step == 7:
                with torch.no_grad():
                    pl_module.mix[1, 2] = complex(0.5, math.nan)

    class After(pl.Callback):  # sees the state after the suite acted at the end of the batch
        def on_train_batch_end(self, trainer: Any, pl_module: Any, *_: Any) -> None:
            after[trainer.global_step] = weights(pl_module)

    rollback = Rollback(every_n_steps=5)
    fit(ComplexMixer(), [ImaginaryNaN(), NonFiniteDetector(check_weights_every_n_steps=1), rollback, After()],
        max_steps=8)  # fmt: skip
    # The step of batch 7 is skipped (Lightning counts it: the batch ends at global step 8), then rolled back.
    assert [(h["step"], h["reason"], h["snapshot_step"]) for h in rollback.history] == [(8, "nonfinite_state", 5)]
    assert_bit_identical(after[8], after[5])


def test_a_nan_weight_in_a_complex_parameter_under_the_whole_suite() -> None:
    model, suite = ComplexMixer(), default_callbacks(snapshot_every_n_steps=5)
    fit(model, [*suite, FaultInjector(Fault(12, "nan_weight", parameter="mix"))], max_steps=20)
    (rollback,) = [cb for cb in suite if isinstance(cb, Rollback)]
    assert [(h["step"], h["reason"], h["snapshot_step"]) for h in rollback.history] == [(13, "nonfinite_state", 10)]
    assert torch.isfinite(torch.view_as_real(model.mix)).all()
