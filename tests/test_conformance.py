"""One conformance suite over every exported callback: construct, validate, pickle, state, refit, change nothing."""

from __future__ import annotations

import inspect
import io
import pickle
from dataclasses import dataclass, field
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import assert_bit_identical, fit, make_trainer, weights

import lightning_overflow
from lightning_overflow import (
    AutoClip,
    GradNormMonitor,
    LossSpikeDetector,
    LRBackoff,
    NonFiniteDetector,
    Rollback,
    default_callbacks,
)
from lightning_overflow.testing import TinyRegressor


@dataclass
class Case:
    """How to exercise one callback: healthy-run arguments and bad arguments with the exact error."""

    healthy: dict[str, Any] = field(default_factory=dict)
    bad: list[tuple[dict[str, Any], type[Exception], str]] = field(default_factory=list)


CASES: dict[type, Case] = {
    GradNormMonitor: Case(
        healthy={"per_parameter": True, "norm_type": "inf"},
        bad=[
            ({"norm_type": 1}, ValueError, "'norm_type' must be 2 or inf (got 1)"),
            ({"per_parameter": "yes"}, TypeError, "'per_parameter' must be a bool (got 'yes')"),
            ({"log_every_n_steps": 0}, ValueError, "'log_every_n_steps' must be >= 1 (got 0)"),
            ({"per_parameter_every_n_steps": 2.5}, TypeError, "'per_parameter_every_n_steps' must be an int or None (got 2.5)"),
        ],
    ),
    NonFiniteDetector: Case(
        healthy={"check_weights_every_n_steps": 1},
        bad=[
            ({"action": "ignore"}, ValueError, "'action' must be one of 'skip', 'raise', 'warn' (got 'ignore')"),
            ({"max_consecutive_skips": 0}, ValueError, "'max_consecutive_skips' must be >= 1 (got 0)"),
            ({"check_weights_every_n_steps": -1}, ValueError, "'check_weights_every_n_steps' must be >= 0 (got -1)"),
            ({"diagnose": "yes"}, TypeError, "'diagnose' must be a bool (got 'yes')"),
            ({"headroom_every_n_steps": -1}, ValueError, "'headroom_every_n_steps' must be >= 0 (got -1)"),
        ],
    ),
    LossSpikeDetector: Case(
        healthy={"warmup": 2},
        bad=[
            ({"sigmas": 0}, ValueError, "'sigmas' must be in (0, inf) (got 0)"),
            ({"window": 1}, ValueError, "'window' must be >= 2 (got 1)"),
            ({"check_grad_norm": 1}, TypeError, "'check_grad_norm' must be a bool (got 1)"),
        ],
    ),
    AutoClip: Case(
        healthy={},
        bad=[
            ({"mode": "adaptive"}, ValueError, "'mode' must be one of 'fixed', 'percentile', 'zscore', 'agc' (got 'adaptive')"),
            ({"mode": "fixed"}, ValueError, "'max_norm' must be set when mode='fixed' (got None)"),
            ({"percentile": 150}, ValueError, "'percentile' must be in [0, 100] (got 150)"),
            ({"max_norm": -1.0}, ValueError, "'max_norm' must be in (0, inf) (got -1)"),
        ],
    ),
    LRBackoff: Case(
        healthy={"regrow_after": 2},
        bad=[
            ({"factor": 1.5}, ValueError, "'factor' must be in (0, 1) (got 1.5)"),
            ({"factor": "half"}, TypeError, "'factor' must be a number (got 'half')"),
            ({"cooldown": -1}, ValueError, "'cooldown' must be >= 0 (got -1)"),
        ],
    ),
    Rollback: Case(
        healthy={"every_n_steps": 1},
        bad=[
            ({"every_n_steps": 0}, ValueError, "'every_n_steps' must be >= 1 (got 0)"),
            ({"dirpath": 3}, TypeError, "'dirpath' must be a path or None (got 3)"),
            (
                {"triggers": ("boom",)},
                ValueError,
                "'triggers' must be one of 'nonfinite', 'nonfinite_burst', 'nonfinite_persistent', 'nonfinite_state', "
                "'scaler_collapse', 'loss_spike', 'grad_spike', 'loss_divergence', 'loss_trend', "
                "'no_progress', 'weight_growth', "
                "'replica_mismatch' (got 'boom')",
            ),
        ],
    ),
}


def exported_callbacks() -> list[type]:
    return [
        obj
        for name in lightning_overflow.__all__
        if inspect.isclass(obj := getattr(lightning_overflow, name)) and issubclass(obj, pl.Callback)
    ]


CALLBACKS = exported_callbacks()


def test_every_exported_callback_has_a_case() -> None:
    assert CALLBACKS and set(CALLBACKS) == set(CASES)


@pytest.mark.parametrize("cls", CALLBACKS, ids=lambda c: c.__name__)
def test_constructs_with_defaults(cls: type) -> None:
    callback = cls()
    assert isinstance(callback, pl.Callback)
    assert cls.__doc__ and "Args:" in cls.__doc__ and "Example:" in cls.__doc__


@pytest.mark.parametrize(
    ("cls", "kwargs", "error", "message"),
    [(cls, kw, err, msg) for cls in CALLBACKS for kw, err, msg in CASES[cls].bad],
    ids=lambda v: v.__name__ if inspect.isclass(v) and issubclass(v, pl.Callback) else None,
)
def test_rejects_bad_arguments_at_construction(cls: type, kwargs: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error) as info:
        cls(**kwargs)
    assert str(info.value) == message


@pytest.mark.parametrize("cls", CALLBACKS, ids=lambda c: c.__name__)
def test_pickles(cls: type) -> None:
    callback = cls(**CASES[cls].healthy)
    fit(TinyRegressor(), [callback], max_steps=2)
    clone = pickle.loads(pickle.dumps(callback))
    assert type(clone) is cls and clone.state_dict() == callback.state_dict()


@pytest.mark.parametrize("cls", CALLBACKS, ids=lambda c: c.__name__)
def test_state_round_trips_through_weights_only_load(cls: type) -> None:
    callback = cls(**CASES[cls].healthy)
    fit(TinyRegressor(), [callback], max_steps=3)
    buffer = io.BytesIO()
    torch.save(callback.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    fresh = cls(**CASES[cls].healthy)
    fresh.load_state_dict(loaded)
    assert _plain(fresh.state_dict()) == _plain(callback.state_dict())


@pytest.mark.parametrize("cls", CALLBACKS, ids=lambda c: c.__name__)
def test_fits_twice(cls: type) -> None:
    callback = cls(**CASES[cls].healthy)
    for _ in range(2):
        trainer = fit(TinyRegressor(), [callback], max_steps=3)
        assert trainer.global_step == 3


@pytest.mark.parametrize("cls", CALLBACKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_healthy_run_is_bit_identical_with_and_without(cls: type, optimizer: str) -> None:
    def run(callbacks: list[Any]) -> dict[str, torch.Tensor]:
        pl.seed_everything(7, verbose=False)
        model = TinyRegressor(optimizer=optimizer, dropout=0.1, batch_norm=True, scheduler=_cosine)
        fit(model, callbacks, max_steps=12)
        return weights(model)

    assert_bit_identical(run([]), run([cls(**CASES[cls].healthy)]))


def _cosine(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_the_whole_suite_together_changes_nothing_on_a_healthy_run(optimizer: str) -> None:
    def run(callbacks: list[Any]) -> dict[str, torch.Tensor]:
        pl.seed_everything(7, verbose=False)
        model = TinyRegressor(optimizer=optimizer, dropout=0.1, batch_norm=True, scheduler=_cosine)
        fit(model, callbacks, max_steps=24)
        return weights(model)

    suite = [GradNormMonitor(per_parameter=True), NonFiniteDetector(check_weights_every_n_steps=1), LossSpikeDetector(),
             AutoClip(mode="fixed", max_norm=1e30), LRBackoff(), Rollback(every_n_steps=3)]
    assert_bit_identical(run([]), run(suite))


# ---- after a fault: every state value non-default ------------------------------------------------------------------
FAULT_CASES: dict[type, dict[str, Any]] = {
    GradNormMonitor: {"per_parameter": True},
    NonFiniteDetector: {"check_weights_every_n_steps": 1},
    LossSpikeDetector: {"warmup": 2},
    AutoClip: {"mode": "zscore", "warmup_steps": 2},
    LRBackoff: {"regrow_after": 50},
    Rollback: {"every_n_steps": 2},
}


def _faulty_fit(callbacks: list[Any]) -> None:
    from lightning_overflow.testing import Fault, FaultInjector

    faults = FaultInjector(Fault(4, "nan_loss"), Fault(6, "loss_spike", factor=1e3), Fault(8, "nan_weight"))
    fit(TinyRegressor(), [*callbacks, faults], max_steps=12)


@pytest.mark.parametrize("cls", CALLBACKS, ids=lambda c: c.__name__)
def test_state_round_trips_after_a_fault(cls: type) -> None:
    suite = {c: c(**FAULT_CASES[c]) for c in CALLBACKS}
    _faulty_fit(list(suite.values()))
    callback = suite[cls]
    state = callback.state_dict()
    if state:
        assert _plain(state) != _plain(cls(**FAULT_CASES[cls]).state_dict()), "the fault left no trace in the state"
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    fresh = cls(**FAULT_CASES[cls])
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    assert _plain(fresh.state_dict()) == _plain(state)


SECOND_CONFIG: dict[type, tuple[dict[str, Any], dict[str, Any]]] = {
    NonFiniteDetector: ({"action": "skip"}, {"action": "warn"}),
    LossSpikeDetector: ({"sigmas": 6.0}, {"sigmas": 8.0}),
}


@pytest.mark.parametrize("cls", list(SECOND_CONFIG), ids=lambda c: c.__name__)
def test_two_differently_configured_instances_keep_their_own_state(cls: type, tmp_path: Any) -> None:
    first, second = (cls(**kwargs) for kwargs in SECOND_CONFIG[cls])
    assert first.state_key != second.state_key
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    fit(TinyRegressor(), [first, second, checkpoint], max_steps=6, enable_checkpointing=True)
    path = tmp_path / "epoch=0-step=6.ckpt"
    saved = torch.load(path, weights_only=True)["callbacks"]
    assert {first.state_key, second.state_key} <= set(saved)
    again = [cls(**kwargs) for kwargs in SECOND_CONFIG[cls]]
    trainer = make_trainer(again, max_steps=7)
    trainer.fit(TinyRegressor(), ckpt_path=str(path))
    assert trainer.global_step == 7
    for callback in again:  # each instance resumed from its own entry (a one-step fit changes none of these)
        assert set(_plain(callback.state_dict())) == set(_plain(saved[callback.state_key]))


def test_two_monitors_of_different_norm_types_log_their_own_keys() -> None:
    from conftest import MemoryLogger

    logger = MemoryLogger()
    l2, largest = GradNormMonitor(norm_type=2.0), GradNormMonitor(norm_type="inf")
    assert l2.state_key != largest.state_key
    model = TinyRegressor()
    seen: list[torch.Tensor] = []

    class Grads(pl.Callback):
        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            seen.append(torch.cat([p.grad.reshape(-1) for p in pl_module.parameters()]).double())

    fit(model, [l2, largest, Grads()], max_steps=3, logger=logger, log_every_n_steps=1)
    assert [v for _, v in logger.metrics["grad_norm/total"]] == pytest.approx([g.norm().item() for g in seen])
    assert [v for _, v in logger.metrics["grad_norm_inf/total"]] == pytest.approx([g.abs().max().item() for g in seen])


def test_the_whole_suite_with_real_loggers_writes_every_counter(tmp_path: Any) -> None:
    from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger

    csv = CSVLogger(tmp_path, name="csv")
    tensorboard = TensorBoardLogger(tmp_path, name="tb")
    suite = [c(**FAULT_CASES[c]) for c in CALLBACKS]
    from lightning_overflow.testing import Fault, FaultInjector

    fit(TinyRegressor(), [*suite, FaultInjector(Fault(4, "nan_loss"))], max_steps=12, logger=[csv, tensorboard],
        log_every_n_steps=1)
    import csv as csv_module

    with open(f"{csv.log_dir}/metrics.csv", encoding="utf-8") as f:
        rows = list(csv_module.DictReader(f))
    keys = set(rows[0])
    for key in ("grad_norm/total", "clip/coef", "clip/threshold", "overflow/skipped_steps",
                "overflow/nonfinite_events", "overflow/spikes", "overflow/lr_scale", "overflow/rollbacks"):
        assert key in keys, key
    assert max(float(r["overflow/skipped_steps"] or 0) for r in rows) == 1.0
    steps = [r["step"] for r in rows if r["grad_norm/total"]]
    assert len(steps) == len(set(steps)), "one row per logging step: the suite logs once per step"


@pytest.mark.parametrize("cls", [AutoClip, LRBackoff], ids=lambda c: c.__name__)
def test_a_second_instance_of_a_whole_run_intervention_is_refused_at_setup(cls: type) -> None:
    first, second = (cls(**kwargs) for kwargs in {
        AutoClip: ({"mode": "zscore"}, {"mode": "fixed", "max_norm": 1.0}),
        LRBackoff: ({"factor": 0.5}, {"factor": 0.25}),
    }[cls])
    with pytest.raises(ValueError) as info:
        fit(TinyRegressor(), [first, second], max_steps=2)
    name = cls.__name__
    assert str(info.value) == (
        f"Trainer(callbacks=...) has two {name} callbacks ({first.state_key} and {second.state_key}): {name} acts on "
        f"the whole run, so two of them would act twice on every step and log into the same keys. Keep one {name}."
    )


def test_a_second_rollback_is_refused_by_lightning_at_trainer_construction() -> None:
    with pytest.raises(RuntimeError, match="Found more than one stateful callback of type `Rollback`"):
        make_trainer([Rollback(every_n_steps=2), Rollback(every_n_steps=3)])


# ---- Lightning's tuners --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["Tuner.lr_find", "LearningRateFinder", "Tuner.scale_batch_size"])
def test_lightnings_tuners_find_the_same_values_and_the_fit_after_is_bit_identical(how: str, tmp_path: Any) -> None:
    """The tuners swap the trainer's callbacks for their own while they search (a range of rates up to one where the
    loss diverges, growing batch sizes), save the state before and restore it after: with the suite in the callbacks,
    the value found, and the fit after it, are those of the same run without the suite."""
    from pytorch_lightning.callbacks import LearningRateFinder
    from pytorch_lightning.tuner import Tuner

    def run(suite: list[Any], root: str) -> tuple[float, dict[str, torch.Tensor]]:
        pl.seed_everything(3, verbose=False)
        model = TinyRegressor(optimizer="sgd", lr=0.01)
        finder = LearningRateFinder(min_lr=1e-4, max_lr=10.0, num_training_steps=30)
        extra = [finder] if how == "LearningRateFinder" else []
        trainer = make_trainer([*extra, *suite], max_steps=40, default_root_dir=root)
        found: float = 0.0
        if how == "Tuner.lr_find":
            search = Tuner(trainer).lr_find(model, min_lr=1e-4, max_lr=10.0, num_training=30, update_attr=True)
            assert search is not None and 0 < len(search.results["loss"]) < 30  # it stopped where the loss diverged
            found = model.lr
        elif how == "Tuner.scale_batch_size":
            found = float(Tuner(trainer).scale_batch_size(model, max_trials=3) or 0)
        trainer.fit(model)
        if how == "LearningRateFinder":
            found = model.lr
        assert trainer.global_step == 40
        return found, weights(model)

    bare, guarded = run([], str(tmp_path / "bare")), run(default_callbacks(), str(tmp_path / "suite"))
    assert bare[0] == guarded[0]
    assert_bit_identical(bare[1], guarded[1])
