"""The shared step record: one norm computation and one host read per optimizer step, whatever the callbacks."""

from __future__ import annotations

import itertools
import struct
import sys
from collections import Counter
from typing import Any

import pytest
import torch
from conftest import MemoryLogger, fit
from hypothesis import given, settings
from hypothesis import strategies as st

import lightning_overflow.health as health
from lightning_overflow import GradNormMonitor, NonFiniteDetector
from lightning_overflow.testing import TinyRegressor

STEPS = 6


@pytest.fixture
def count_norms(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts the norm kernels the package runs (on CPU ``torch.dot`` per tensor, or one ``_foreach_norm`` on one
    thread; ``_foreach_norm`` and ``vector_norm`` elsewhere), at the kernel: whichever name the package calls them
    through."""
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
        # One CPU thread: one _foreach_norm for all tensors; several: a dot per tensor.
        one_thread = torch.get_num_threads() == 1
        assert count_norms == (Counter({"_foreach_norm": STEPS}) if one_thread else Counter({"dot": STEPS * tensors}))


@pytest.mark.parametrize(("threads", "expected"), [(1, Counter({"_foreach_norm": STEPS})), (2, None)])
def test_one_norm_kernel_per_step_on_one_cpu_thread(threads: int, expected: Any, count_norms: Counter[str]) -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fit(TinyRegressor(), [GradNormMonitor(), NonFiniteDetector()], max_steps=STEPS, logger=MemoryLogger())
    finally:
        torch.set_num_threads(previous)
    tensors = len(list(TinyRegressor().parameters()))
    assert count_norms == (expected or Counter({"dot": STEPS * tensors}))


@pytest.mark.parametrize("callbacks", suites(), ids=["monitor", "detector", "three"])
def test_one_host_read_per_optimizer_step(callbacks: list[Any], count_reads: Counter[str]) -> None:
    fit(TinyRegressor(), callbacks, max_steps=STEPS, logger=MemoryLogger(), log_every_n_steps=1)
    # One a step, and one for the state check when training ends.
    assert count_reads == Counter({"lightning_overflow.distributed": STEPS + 1})


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


def test_the_board_hears_each_hook_once_through_the_first_suite_callback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the number of suite callbacks, and with foreign callbacks before them: each batch starts and ends
    once on the board, each backward pass gives it one loss, each optimizer step runs the pipeline once, and the
    first suite callback of ``trainer.callbacks`` is the one that forwards them."""
    from pytorch_lightning import Callback

    from lightning_overflow import LossSpikeDetector

    heard: Counter[tuple[str, str]] = Counter()
    for name in ("begin_batch", "observe_loss", "before_optimizer_step", "end_batch"):
        original = getattr(health.HealthBoard, name)

        def counting(self: Any, trainer: Any, *args: Any, _original: Any = original, _name: str = name) -> Any:
            heard[(_name, type(self._leader).__name__)] += 1
            return _original(self, trainer, *args)

        monkeypatch.setattr(health.HealthBoard, name, counting)
    callbacks = [Callback(), LossSpikeDetector(), GradNormMonitor(), Callback(), NonFiniteDetector()]
    fit(TinyRegressor(), callbacks, max_steps=STEPS, accumulate_grad_batches=2, logger=MemoryLogger())
    batches = 2 * STEPS
    assert heard == Counter({
        ("begin_batch", "LossSpikeDetector"): batches,
        ("observe_loss", "LossSpikeDetector"): batches,
        ("before_optimizer_step", "LossSpikeDetector"): STEPS,
        ("end_batch", "LossSpikeDetector"): batches,
    })


def test_lightning_calls_only_the_batch_hooks_a_suite_callback_works_in() -> None:
    """Lightning opens a profiler context around every callback hook it calls, every batch: for the fit, the suite's
    callbacks have it skip the hooks they have nothing to do in. The leader keeps the four it forwards to the board,
    the others none (NonFiniteDetector keeps the batch for a replay in a stage the leader forwards to); after the fit
    every hook answers again."""
    from pytorch_lightning.profilers import PassThroughProfiler

    from lightning_overflow import default_callbacks

    class Recording(PassThroughProfiler):
        def __init__(self) -> None:
            super().__init__()
            self.actions: Counter[str] = Counter()

        def start(self, action_name: str) -> None:
            if action_name.startswith("[Callback]"):
                hook = action_name.rsplit(".", 1)[1]
                if "batch" in hook or "backward" in hook or "optimizer_step" in hook or "zero_grad" in hook:
                    self.actions[action_name.split("{")[0].removeprefix("[Callback]") + "." + hook] += 1

    suite = default_callbacks()
    wrapped: list[int] = []  # a hook someone set on an instance is theirs: never muted
    suite[2].on_after_backward = lambda trainer, *_: wrapped.append(trainer.global_step)
    profiler = Recording()
    fit(TinyRegressor(), suite, max_steps=STEPS, logger=MemoryLogger(), profiler=profiler)
    assert wrapped == list(range(STEPS))
    assert profiler.actions == Counter({
        "LossSpikeDetector.on_after_backward": STEPS,
        "GradNormMonitor.on_train_batch_start": STEPS,
        "GradNormMonitor.on_before_backward": STEPS,
        "GradNormMonitor.on_before_optimizer_step": STEPS,
        "GradNormMonitor.on_train_batch_end": STEPS,
    })
    for callback in suite:
        assert callable(callback.on_after_backward) and callable(callback.on_train_batch_start)


def test_the_board_calls_a_callback_only_in_the_stages_its_class_implements(monkeypatch: pytest.MonkeyPatch) -> None:
    """A healthy step costs no call of a stage a callback leaves to the base class (six callbacks, six stages)."""
    from lightning_overflow import LRBackoff
    from lightning_overflow.callbacks._base import SuiteCallback

    called: Counter[str] = Counter()
    for stage in health.STAGES:
        original = getattr(SuiteCallback, stage)

        def counting(self: Any, *args: Any, _original: Any = original, _stage: str = stage) -> Any:
            called[_stage] += 1
            return _original(self, *args)

        monkeypatch.setattr(SuiteCallback, stage, counting)
    backoff = LRBackoff()
    # computed before the defaults were wrapped; _contribute holds a backed-off rate the module's code rewrites
    assert backoff._stages() == {"_contribute", "_after_batch", "_counters"}
    fit(TinyRegressor(), [backoff], max_steps=STEPS, logger=MemoryLogger())
    assert called == Counter()
    assert GradNormMonitor()._stages() == {"_contribute", "_after_step"}


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


def device_loss_facts(losses: list[float], scale: float | None, factor: int) -> tuple[int, float, int]:
    """The same facts from float32 tensor ops, as the board accumulates them across ranks."""
    flags = total = None
    for loss in losses:
        value = torch.tensor(loss, dtype=torch.float64).float()
        if scale is not None:
            value = value / torch.tensor(scale, dtype=torch.float32)
        value = value * factor
        bad = ~torch.isfinite(value)
        finite = torch.where(bad, torch.zeros_like(value), value)
        flags, total = (bad.float(), finite) if flags is None else (flags + bad.float(), total + finite)
    if flags is None or total is None:
        return 0, 0.0, 0
    return int(flags.item()), total.item(), len(losses)


def test_loss_facts_by_hand() -> None:
    assert health.loss_facts([1.5, float("nan"), 2.25], None, 1) == (1, 3.75, 3)
    assert health.loss_facts([0.25, 0.5], 0.5, 2) == (0, 3.0, 2)
    assert health.loss_facts([], None, 1) == (0, 0.0, 0)
    assert health.loss_facts([1e39], None, 1) == (1, 0.0, 1)  # beyond float32: inf, as Tensor.float() makes it


loss_values = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=-1e6, max_value=1e6, allow_subnormal=False),
)


@settings(max_examples=300, deadline=None)
@given(
    losses=st.lists(loss_values, max_size=6),
    scale=st.one_of(st.none(), st.sampled_from([65536.0, 0.5, 3.0, 1e-4, 2.0**-14])),
    factor=st.integers(min_value=1, max_value=16),
)
def test_host_loss_facts_equal_float32_tensor_ops_bit_for_bit(
    losses: list[float], scale: float | None, factor: int
) -> None:
    host = health.loss_facts(losses, None if scale is None else float(torch.tensor(scale).float()), factor)
    device = device_loss_facts(losses, scale, factor)
    assert host[0] == device[0] and host[2] == device[2]
    assert struct.pack("d", host[1]) == struct.pack("d", device[1])  # bit for bit, the sign of a zero included
