"""Optimizers that evaluate the closure several times per step (LBFGS): each evaluation is judged on its own
gradients, with its own record."""

from __future__ import annotations

from typing import Any

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
