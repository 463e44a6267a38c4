"""The shared step record: one norm computation and one host read per optimizer step, whatever the callbacks."""

from __future__ import annotations

import itertools
import sys
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
    """Counts the norm kernels the package runs (``torch.dot`` per tensor on CPU, ``_foreach_norm`` and
    ``vector_norm`` elsewhere), at the kernel: whichever name the package calls them through."""
    calls: Counter[str] = Counter()
    for owner, name in ((torch, "dot"), (torch, "_foreach_norm"), (torch.linalg, "vector_norm")):
        original = getattr(owner, name)

        def counting(*args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            if sys._getframe(1).f_globals.get("__name__", "").startswith("lightning_overflow"):
                calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counting)
    return calls




def suites() -> list[list[Any]]:
    return [
        [GradNormMonitor()],
        [NonFiniteDetector(check_weights_every_n_steps=None)],
        [GradNormMonitor(per_parameter=True), NonFiniteDetector(check_weights_every_n_steps=None), GradNormMonitor()],
    ]


@pytest.mark.parametrize("callbacks", suites(), ids=["monitor", "detector", "three"])
def test_one_norm_computation_per_optimizer_step(callbacks: list[Any], count_norms: Counter[str]) -> None:
    tensors = len(list(TinyRegressor().parameters()))
    for order in itertools.permutations(callbacks):
        count_norms.clear()
        fit(TinyRegressor(), list(order), max_steps=STEPS, logger=MemoryLogger(), log_every_n_steps=1)
        assert count_norms == Counter({"dot": STEPS * tensors})


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


def test_the_place_of_a_callback_in_the_list_changes_nothing(tmp_path: Any) -> None:
    from lightning_overflow import AutoClip, LossSpikeDetector, LRBackoff, Rollback, read_journal
    from lightning_overflow.testing import Fault, FaultInjector

    def run(order: list[int], where: str) -> tuple[list[tuple[int, str, str]], dict[str, torch.Tensor]]:
        suite = [GradNormMonitor(), NonFiniteDetector(), LossSpikeDetector(warmup=3), AutoClip(warmup_steps=3),
                 LRBackoff(), Rollback(every_n_steps=2)]
        faults = FaultInjector(Fault(4, "nan_loss"), Fault(9, "loss_spike", factor=1e4), Fault(12, "nan_weight"))
        torch.manual_seed(0)
        model = TinyRegressor()
        fit(model, [suite[i] for i in order] + [faults], max_steps=16, default_root_dir=str(tmp_path / where))
        events = [(e["step"], e["kind"], e["source"]) for e in read_journal(tmp_path / where / "overflow_events.jsonl")]
        return events, {k: v.detach().clone() for k, v in model.state_dict().items()}

    reference_events, reference_weights = run([0, 1, 2, 3, 4, 5], "forward")
    assert {kind for _, kind, _ in reference_events} >= {"skip", "spike", "backoff", "rollback"}
    for name, order in (("reversed", [5, 4, 3, 2, 1, 0]), ("shuffled", [3, 5, 0, 4, 2, 1])):
        events, final = run(order, name)
        assert events == reference_events
        assert all(torch.equal(final[k], reference_weights[k]) for k in final)
