"""The shared step record: one norm computation and one host read per optimizer step, whatever the callbacks."""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import pytest
import torch
from conftest import MemoryLogger, fit

import lightning_overflow.health as health
from lightning_overflow import GradNormMonitor, NonFiniteDetector
from lightning_overflow.testing import TinyRegressor

STEPS = 6


@pytest.fixture
def count_norms(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    calls: Counter[str] = Counter()
    original = health.tensor_norms

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls["tensor_norms"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(health, "tensor_norms", counting)
    return calls




def suites() -> list[list[Any]]:
    return [
        [GradNormMonitor()],
        [NonFiniteDetector(check_weights_every_n_steps=None)],
        [GradNormMonitor(per_parameter=True), NonFiniteDetector(check_weights_every_n_steps=None), GradNormMonitor()],
    ]


@pytest.mark.parametrize("callbacks", suites(), ids=["monitor", "detector", "three"])
def test_one_norm_computation_per_optimizer_step(callbacks: list[Any], count_norms: Counter[str]) -> None:
    for order in itertools.permutations(callbacks):
        count_norms.clear()
        fit(TinyRegressor(), list(order), max_steps=STEPS, logger=MemoryLogger(), log_every_n_steps=1)
        assert count_norms["tensor_norms"] == STEPS


@pytest.mark.parametrize("callbacks", suites(), ids=["monitor", "detector", "three"])
def test_one_host_read_per_optimizer_step(callbacks: list[Any], count_reads: Counter[str]) -> None:
    fit(TinyRegressor(), callbacks, max_steps=STEPS, logger=MemoryLogger(), log_every_n_steps=1)
    assert count_reads == Counter({"lightning_overflow.distributed": STEPS})


def test_every_callback_sees_the_same_record() -> None:
    seen: list[Any] = []

    class Spy(NonFiniteDetector):
        def _judge(self, trainer: Any, record: Any) -> Any:
            seen.append(record)
            return super()._judge(trainer, record)

    fit(TinyRegressor(), [Spy(), Spy(action="warn"), GradNormMonitor()], max_steps=3)
    assert len(seen) == 6 and seen[0] is seen[1] and seen[2] is seen[3] and seen[0] is not seen[2]
    assert [r.step for r in seen[::2]] == [0, 1, 2]


def test_boards_are_not_stored_on_the_trainer() -> None:
    trainer = fit(TinyRegressor(), [NonFiniteDetector()], max_steps=2)
    assert not any(isinstance(v, health.HealthBoard) for v in vars(trainer).values())
    assert health.board_for(trainer) is health.board_for(trainer)


def test_trainer_and_model_are_freed_after_fit() -> None:
    import gc
    import weakref

    model = TinyRegressor()
    trainer = fit(model, [GradNormMonitor(), NonFiniteDetector()], max_steps=3)
    refs = weakref.ref(trainer), weakref.ref(model)
    del trainer, model
    gc.collect()
    assert refs[0]() is None and refs[1]() is None


@pytest.mark.parametrize("order", ["detector first", "backoff first"])
def test_counters_logged_at_a_step_include_every_callbacks_action(order: str) -> None:
    from lightning_overflow import LRBackoff
    from lightning_overflow.testing import Fault, FaultInjector

    logger = MemoryLogger()
    suite = [NonFiniteDetector(), LRBackoff()]
    if order == "backoff first":
        suite.reverse()
    faults = FaultInjector(*[Fault(s, "nan_loss") for s in (2, 3, 4)])
    fit(TinyRegressor(), [*suite, faults], max_steps=6, logger=logger, log_every_n_steps=1)
    assert dict(logger.metrics["overflow/lr_scale"])[4] == 0.5  # the burst's third step backs off: logged then
    assert dict(logger.metrics["overflow/skipped_steps"])[4] == 3
