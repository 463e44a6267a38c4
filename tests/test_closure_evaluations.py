"""Optimizers that evaluate the closure several times per step (LBFGS): each evaluation is judged on its own
gradients, with its own record."""

from __future__ import annotations

import copy
from typing import Any

import pytorch_lightning as pl
import torch
from conftest import fit

from lightning_overflow import AutoClip, NonFiniteDetector
from lightning_overflow.testing import TinyRegressor


class LBFGSRegressor(TinyRegressor):
    def __init__(self) -> None:
        super().__init__(batch_size=64)
        self.evaluations: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.evaluations.append(int(self.trainer.global_step))
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        return torch.optim.LBFGS(self.parameters(), lr=0.5, max_iter=4)


def test_every_evaluation_of_the_closure_gets_its_own_record() -> None:
    seen: list[tuple[int, float]] = []

    class Spy(NonFiniteDetector):
        def _judge(self, trainer: Any, record: Any) -> Any:
            seen.append((record.step, record.total_norm))
            return super()._judge(trainer, record)

    model = LBFGSRegressor()
    fit(model, [Spy(), AutoClip(mode="fixed", max_norm=1e30)], max_steps=3)
    assert [step for step, _ in seen] == model.evaluations
    assert len(seen) > 3, "LBFGS evaluated the closure more than once per step"
    norms = [norm for step, norm in seen if step == 0]
    assert len(set(norms)) == len(norms), "each evaluation judged on its own gradients"


class NaNOnEvaluation(LBFGSRegressor):
    """The loss is NaN on one evaluation of the closure within one step: after LBFGS already moved the weights."""

    def __init__(self, step: int, evaluation: int) -> None:
        super().__init__()
        self.fault = (step, evaluation)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        step = int(self.trainer.global_step)
        if (step, self.evaluations.count(step) - 1) == self.fault:
            loss = loss * float("nan")
        return loss


class StartOfStep(pl.Callback):
    """The weights and LBFGS state at the start and the end of each step."""

    def __init__(self) -> None:
        self.start: dict[int, Any] = {}
        self.end: dict[int, Any] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        self.start[trainer.global_step] = _snapshot(pl_module, trainer.optimizers[0])

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        self.end[trainer.global_step - 1] = _snapshot(pl_module, trainer.optimizers[0])


def _snapshot(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    return copy.deepcopy(([p.detach() for p in module.parameters()], optimizer.state_dict()["state"]))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_a_skip_on_a_later_evaluation_undoes_the_whole_lbfgs_step() -> None:
    """Step 1's third evaluation is NaN: LBFGS had moved the weights twice by then. The skipped step leaves the
    weights and LBFGS's state (its history, its step counts) exactly as step 1 found them, and step 2 goes on."""
    model, probe = NaNOnEvaluation(step=1, evaluation=2), StartOfStep()
    detector = NonFiniteDetector()
    fit(model, [detector, probe], max_steps=3)
    assert model.evaluations.count(1) == 3  # three evaluations (the NaN one ended the step); the replay leaves no trace
    assert detector.skipped_steps == 1
    assert _same(probe.end[1], probe.start[1])
    assert not _same(probe.end[2], probe.start[2])  # the next step trains


def test_a_skip_on_the_first_evaluation_needs_no_undo_and_healthy_steps_are_untouched() -> None:
    torch.manual_seed(0)
    bare, probe_bare = LBFGSRegressor(), StartOfStep()
    fit(bare, [probe_bare], max_steps=3)
    torch.manual_seed(0)
    guarded, probe = LBFGSRegressor(), StartOfStep()
    fit(guarded, [NonFiniteDetector(), probe], max_steps=3)
    assert all(_same(probe.end[s], probe_bare.end[s]) for s in range(3))
