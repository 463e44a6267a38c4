"""scale_lr: a change of the learning rate that every torch scheduler keeps, in a plain PyTorch loop."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.optim import lr_scheduler as sched

from lightning_overflow.numerics.lr_scaling import scale_lr, scheduler_tree

SchedulerFactory = Callable[[torch.optim.Optimizer], Any]

STEPS = 60
BACKOFF_AT = 17


def _cosine_restarts(o: torch.optim.Optimizer) -> Any:
    return sched.CosineAnnealingWarmRestarts(o, T_0=7, T_mult=2, eta_min=1e-3)


SCHEDULERS: dict[str, SchedulerFactory | None] = {
    "none": None,
    "LambdaLR": lambda o: sched.LambdaLR(o, lambda s: 1.0 / (1.0 + 0.1 * s)),
    "StepLR": lambda o: sched.StepLR(o, step_size=7, gamma=0.5),
    "MultiStepLR": lambda o: sched.MultiStepLR(o, milestones=[10, 25, 40], gamma=0.3),
    "ExponentialLR": lambda o: sched.ExponentialLR(o, gamma=0.97),
    "LinearLR": lambda o: sched.LinearLR(o, start_factor=0.1, end_factor=1.0, total_iters=30),
    "CosineAnnealingLR": lambda o: sched.CosineAnnealingLR(o, T_max=20, eta_min=1e-3),  # runs past T_max
    "CosineAnnealingWarmRestarts": _cosine_restarts,
    "OneCycleLR": lambda o: sched.OneCycleLR(o, max_lr=0.1, total_steps=STEPS + 1),
    "CyclicLR": lambda o: sched.CyclicLR(o, base_lr=1e-3, max_lr=0.1, step_size_up=5, mode="triangular2"),
    "SequentialLR": lambda o: sched.SequentialLR(
        o,
        [sched.LinearLR(o, start_factor=0.1, total_iters=10), sched.CosineAnnealingLR(o, T_max=15, eta_min=1e-3)],
        milestones=[BACKOFF_AT + 5],
    ),
    "ChainedScheduler": lambda o: sched.ChainedScheduler(
        [sched.LambdaLR(o, lambda s: 0.99**s), _cosine_restarts(o)], optimizer=o
    ),
    "ReduceLROnPlateau": lambda o: sched.ReduceLROnPlateau(o, factor=0.5, patience=2, min_lr=[2e-3, 1e-3]),
}


def _optimizer() -> torch.optim.Optimizer:
    w = torch.nn.Parameter(torch.zeros(3))
    b = torch.nn.Parameter(torch.zeros(1))
    # two param groups with different rates: each keeps its own ratio
    return torch.optim.SGD([{"params": [w]}, {"params": [b], "lr": 0.02}], lr=0.05, momentum=0.9)


def _lrs_of_run(factory: SchedulerFactory | None, scale_at: int | None, factor: float = 0.5) -> list[list[float]]:
    """The LR of each group at every step; ``scale_lr`` applied after the scheduler step of ``scale_at``."""
    optimizer = _optimizer()
    scheduler = factory(optimizer) if factory is not None else None
    lrs = []
    for step in range(STEPS):
        lrs.append([float(g["lr"]) for g in optimizer.param_groups])
        optimizer.step()
        if isinstance(scheduler, sched.ReduceLROnPlateau):
            scheduler.step(1.0)  # a flat metric: a reduction every patience + 1 steps, down to min_lr
        elif scheduler is not None:
            scheduler.step()
        if step == scale_at:
            scale_lr(optimizer, factor, [scheduler] if scheduler is not None else [])
    return lrs


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_the_scale_sticks_under_every_scheduler(name: str) -> None:
    factory = SCHEDULERS[name]
    reference = _lrs_of_run(factory, scale_at=None)
    scaled = _lrs_of_run(factory, scale_at=BACKOFF_AT)
    assert scaled[: BACKOFF_AT + 1] == reference[: BACKOFF_AT + 1]
    for step in range(BACKOFF_AT + 1, STEPS):
        for got, want in zip(scaled[step], reference[step]):
            assert got == pytest.approx(0.5 * want, rel=1e-6, abs=0.0), f"step {step}: {got} != 0.5 x {want}"


@pytest.mark.parametrize("name", ["LambdaLR", "OneCycleLR", "CyclicLR", "CosineAnnealingWarmRestarts"])
def test_halving_only_the_group_lr_is_undone_by_the_scheduler(name: str) -> None:
    """Why scale_lr exists: these schedulers recompute the rate from their references on the next step."""
    optimizer = _optimizer()
    scheduler = SCHEDULERS[name](optimizer)  # type: ignore[misc]
    reference = _optimizer()
    reference_scheduler = SCHEDULERS[name](reference)  # type: ignore[misc]
    for opt, s in ((optimizer, scheduler), (reference, reference_scheduler)):
        for _ in range(3):
            opt.step()
            s.step()
    for group in optimizer.param_groups:
        group["lr"] *= 0.5
    optimizer.step()
    scheduler.step()
    reference.step()
    reference_scheduler.step()
    assert optimizer.param_groups[0]["lr"] == reference.param_groups[0]["lr"]


def test_every_reference_is_scaled() -> None:
    optimizer = _optimizer()
    one_cycle = sched.OneCycleLR(optimizer, max_lr=[0.1, 0.04], total_steps=20)
    scale_lr(optimizer, 0.5, [one_cycle])
    for group, max_lr in zip(optimizer.param_groups, (0.1, 0.04)):
        assert group["max_lr"] == 0.5 * max_lr
        assert group["initial_lr"] == 0.5 * max_lr / 25
        assert group["min_lr"] == 0.5 * max_lr / 25 / 1e4
    assert one_cycle.base_lrs == [0.5 * 0.1 / 25, 0.5 * 0.04 / 25]

    optimizer = _optimizer()
    cyclic = sched.CyclicLR(optimizer, base_lr=1e-3, max_lr=[0.1, 0.2], step_size_up=5)
    scale_lr(optimizer, 0.25, [cyclic])
    assert cyclic.base_lrs == [0.25e-3, 0.25e-3] and cyclic.max_lrs == [0.025, 0.05]
    assert cyclic.get_last_lr() == [g["lr"] for g in optimizer.param_groups]

    optimizer = _optimizer()
    plateau = sched.ReduceLROnPlateau(optimizer, min_lr=1e-3, eps=1e-8)
    scale_lr(optimizer, 0.5, [plateau])
    assert plateau.min_lrs == [5e-4, 5e-4] and plateau.default_min_lr == 5e-4 and plateau.eps == 5e-9
    assert plateau.get_last_lr() == [0.025, 0.01]


def test_sequential_lr_shares_its_last_lr_list_with_a_child_and_it_is_scaled_once() -> None:
    optimizer = _optimizer()
    sequential = SCHEDULERS["SequentialLR"](optimizer)  # type: ignore[misc]
    active = sequential._schedulers[0]
    assert sequential._last_lr is active._last_lr
    before = list(sequential.get_last_lr())
    scale_lr(optimizer, 0.5, [sequential])
    assert sequential.get_last_lr() == [0.5 * v for v in before]
    assert [type(s).__name__ for s in scheduler_tree(sequential)] == ["SequentialLR", "LinearLR", "CosineAnnealingLR"]
    assert sequential._schedulers[1].eta_min == 0.5e-3


def test_tensor_learning_rates_are_scaled_in_place_without_aliasing() -> None:
    w = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.Adam([w], lr=torch.tensor(0.01))
    scheduler = sched.LambdaLR(optimizer, lambda s: 1.0)
    lr_tensor = optimizer.param_groups[0]["lr"]
    scale_lr(optimizer, 0.5, [scheduler])
    assert optimizer.param_groups[0]["lr"] is lr_tensor  # in place: compiled / capturable steps see it
    half = torch.tensor(0.01) * 0.5
    assert torch.equal(lr_tensor, half)
    assert torch.equal(optimizer.param_groups[0]["initial_lr"], half)
    assert torch.equal(scheduler.base_lrs[0], half) and torch.equal(scheduler.get_last_lr()[0], half)


def test_sync_free_on_meta_tensors() -> None:
    w = torch.nn.Parameter(torch.zeros(2, device="meta"))
    optimizer = torch.optim.SGD([w], lr=0.01)
    optimizer.param_groups[0]["lr"] = torch.tensor(0.01, device="meta")  # SGD's own check reads a tensor lr
    optimizer.param_groups[0]["initial_lr"] = torch.tensor(0.01, device="meta")
    scale_lr(optimizer, 0.5)
    assert optimizer.param_groups[0]["lr"].device.type == "meta"


def test_factor_two_undoes_a_halving_exactly() -> None:
    optimizer = _optimizer()
    scheduler = SCHEDULERS["CyclicLR"](optimizer)  # type: ignore[misc]
    state = {k: v for k, v in scheduler.state_dict().items() if k != "_scale_fn_ref"}
    groups = [dict(g, params=None) for g in optimizer.param_groups]
    scale_lr(optimizer, 0.5, [scheduler])
    scale_lr(optimizer, 2.0, [scheduler])
    assert [dict(g, params=None) for g in optimizer.param_groups] == groups
    assert {k: v for k, v in scheduler.state_dict().items() if k != "_scale_fn_ref"} == state


def test_the_scale_travels_in_the_state_dicts() -> None:
    """A checkpoint of a scaled run resumes scaled: nothing needs applying again."""
    factory = SCHEDULERS["LambdaLR"]
    optimizer = _optimizer()
    scheduler = factory(optimizer)  # type: ignore[misc]
    for _ in range(5):
        optimizer.step()
        scheduler.step()
    scale_lr(optimizer, 0.5, [scheduler])
    buffer = io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)  # LambdaLR pickles no lambda, but its state holds a list of None
    resumed = _optimizer()
    resumed_scheduler = factory(resumed)  # type: ignore[misc]
    resumed.load_state_dict(saved["optimizer"])
    resumed_scheduler.load_state_dict(saved["scheduler"])
    for _ in range(5):
        for opt, s in ((optimizer, scheduler), (resumed, resumed_scheduler)):
            opt.step()
            s.step()
        assert [g["lr"] for g in resumed.param_groups] == [g["lr"] for g in optimizer.param_groups]


def test_a_scheduler_of_another_optimizer_is_left_alone() -> None:
    mine, other = _optimizer(), _optimizer()
    other_scheduler = sched.LambdaLR(other, lambda s: 1.0)
    scale_lr(mine, 0.5, [other_scheduler])
    assert other_scheduler.base_lrs == [0.05, 0.02] and other.param_groups[0]["lr"] == 0.05
    assert mine.param_groups[0]["lr"] == 0.025


@pytest.mark.parametrize("factor", [0.0, -1.0, float("inf"), float("nan")])
def test_factor_must_be_finite_and_positive(factor: float) -> None:
    with pytest.raises(ValueError, match=r"'factor' must be in \(0, inf\)"):
        scale_lr(_optimizer(), factor)


@pytest.mark.parametrize("factor", ["0.5", None, True])
def test_factor_must_be_a_number(factor: object) -> None:
    optimizer = _optimizer()
    with pytest.raises(TypeError) as info:
        scale_lr(optimizer, factor)  # type: ignore[arg-type]
    assert str(info.value) == f"'factor' must be a number (got {factor!r})"
    assert optimizer.param_groups[0]["lr"] == 0.05  # nothing was changed
