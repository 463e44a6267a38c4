"""Users' code pickles and deep-copies callbacks in the middle of a fit: a module's hyperparameters in every
checkpoint (neuralforecast passes its Trainer kwargs, callbacks included, to ``save_hyperparameters``), LightningCLI
and the tuner. Every suite callback survives both at every hook, and a copy shares nothing with the live fit."""

from __future__ import annotations

import copy
import io
import pickle
from typing import Any

import pytorch_lightning as pl
import torch
from conftest import assert_bit_identical, fit, weights
from pytorch_lightning.loggers import CSVLogger

from lightning_overflow import NonFiniteDetector, Rollback, default_callbacks
from lightning_overflow.testing import TinyRegressor

_HOOKS = (
    "setup", "on_fit_start", "on_train_start", "on_train_epoch_start", "on_train_batch_start", "on_before_backward",
    "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad", "on_train_batch_end",
    "on_validation_start", "on_validation_end", "on_train_epoch_end", "on_save_checkpoint", "on_train_end",
    "on_fit_end", "teardown",
)  # fmt: skip


class _CopyEverywhere(pl.Callback):
    """At every hook, pickles and deep-copies every other callback and the loggers; keeps what failed."""

    def __init__(self) -> None:
        self.failures: dict[tuple[str, str, str], str] = {}
        self.hooks_seen: set[str] = set()


def _copier(hook: str) -> Any:
    def at(self: _CopyEverywhere, trainer: pl.Trainer, *_: Any, **__: Any) -> None:
        self.hooks_seen.add(hook)
        for obj in [cb for cb in trainer.callbacks if cb is not self] + list(trainer.loggers):
            for how, act in (("pickle", lambda o: pickle.loads(pickle.dumps(o))), ("deepcopy", copy.deepcopy)):
                try:
                    act(obj)
                except Exception as err:  # noqa: BLE001 - every failure is the finding
                    self.failures.setdefault((hook, type(obj).__name__, how), repr(err))

    return at


for _hook in _HOOKS:
    setattr(_CopyEverywhere, _hook, _copier(_hook))


class _KeepsTrainerKwargs(TinyRegressor):
    """A module that stores its Trainer keyword arguments, callbacks included, as hyperparameters (neuralforecast)."""

    def __init__(self, callbacks: list[Any] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.save_hyperparameters()


def test_every_callback_pickles_and_deep_copies_at_every_hook_of_a_checkpointed_fit(tmp_path: Any) -> None:
    callbacks = default_callbacks()
    probe = _CopyEverywhere()
    model = _KeepsTrainerKwargs(callbacks=callbacks)
    trainer = fit(
        model, callbacks + [probe], max_epochs=2, max_steps=-1, logger=CSVLogger(tmp_path), enable_checkpointing=True,
        default_root_dir=tmp_path, limit_val_batches=2, log_every_n_steps=1,
    )  # fmt: skip
    assert probe.failures == {}
    assert probe.hooks_seen == set(_HOOKS)
    assert trainer.global_step == 16
    (saved,) = (tmp_path / "lightning_logs" / "version_0" / "checkpoints").glob("*.ckpt")
    hparams = torch.load(saved, weights_only=False)["hyper_parameters"]
    assert [type(cb).__name__ for cb in hparams["callbacks"]] == [type(cb).__name__ for cb in callbacks]


def test_a_copy_taken_mid_fit_shares_nothing_with_the_fit_and_trains_like_a_fresh_suite() -> None:
    copies: list[list[Any]] = []

    class CopyAtStep5(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
            if trainer.global_step == 5:
                copies.append(copy.deepcopy([cb for cb in trainer.callbacks if cb is not self]))

    callbacks = default_callbacks(snapshot_every_n_steps=2)
    fit(TinyRegressor(), callbacks + [CopyAtStep5()], max_steps=8)
    (copied,) = copies
    rollback = next(cb for cb in copied if isinstance(cb, Rollback))
    live = next(cb for cb in callbacks if isinstance(cb, Rollback))
    assert live.snapshot_steps == [6, 8]  # the live fit's snapshots, taken after the copy too
    assert rollback.snapshot_steps == []  # the copy holds none of the fit's model copies
    assert all(cb._board is None and not cb._muted for cb in copied)
    # The copy, in a fit of its own, changes nothing on a healthy run, as the bare run shows.
    pl.seed_everything(0, verbose=False)
    bare = TinyRegressor()
    fit(bare, max_steps=8)
    pl.seed_everything(0, verbose=False)
    protected = TinyRegressor()
    fit(protected, copied, max_steps=8)
    assert_bit_identical(weights(bare), weights(protected))


def test_a_pickled_callback_carries_no_model_after_a_fit() -> None:
    """Lightning gives every callback the module's bound ``log`` and ``log_dict`` at each fit: a copy that kept them
    would carry the whole model and its data into every checkpoint that stores the callbacks."""
    callbacks = default_callbacks()
    fit(TinyRegressor(), callbacks, max_steps=4)
    assert all("log" in vars(cb) for cb in callbacks)  # Lightning's, on the live callbacks

    class Globals(pickle.Unpickler):
        def __init__(self, data: bytes) -> None:
            super().__init__(io.BytesIO(data))
            self.found: set[str] = set()

        def find_class(self, module: str, name: str) -> Any:
            self.found.add(f"{module}.{name}")
            return super().find_class(module, name)

    reader = Globals(pickle.dumps(callbacks))
    copies = reader.load()
    assert not [g for g in reader.found if g.startswith(("torch.nn.", "lightning_overflow.testing"))]
    assert not any("log" in vars(cb) for cb in copies)


class PickleModuleAt(pl.Callback):
    """Pickles and deep-copies the module at the end of one batch, as a checkpoint that pickles it would."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.copies: list[Any] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        if trainer.global_step == self.step:
            self.copies = [pickle.loads(pickle.dumps(pl_module)), copy.deepcopy(pl_module)]


def test_a_module_under_fault_injection_still_pickles_mid_fit() -> None:
    """FaultInjector wrapped ``training_step`` in a closure on the module: pickling the module mid-fit raised
    ``PicklingError``. The copies get the module's own method back; the live fit's fault still fires."""
    from lightning_overflow import NonFiniteDetector
    from lightning_overflow.testing import Fault, FaultInjector

    probe, injector = PickleModuleAt(1), FaultInjector(Fault(3, "nan_loss"))
    model = TinyRegressor()
    fit(model, [NonFiniteDetector(), injector, probe], max_steps=5)
    assert injector.fired == [(3, "nan_loss", 0)]
    batch = next(iter(model.train_dataloader()))
    for copied in probe.copies:
        assert copied.training_step.__func__ is TinyRegressor.training_step
        assert torch.isfinite(copied.training_step(batch, 0))


def test_a_copy_taken_while_micro_batches_accumulate_holds_none_of_them() -> None:
    """Lightning pickles callbacks into every checkpoint (the module's hyperparameters): a detector copied between two
    micro-batches of one step carried the first one's batch and its flag."""
    probe: list[Any] = []

    class CopyMidWindow(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
            if trainer.global_step == 2 and len(detector._window) == 1 and not probe:  # the third micro-batch
                probe.append((copy.deepcopy(detector), pickle.loads(pickle.dumps(detector))))

    detector = NonFiniteDetector()
    fit(TinyRegressor(), [detector, CopyMidWindow()], max_steps=4, accumulate_grad_batches=3)
    ((copied, unpickled),) = probe
    assert copied._window == unpickled._window == [] and copied._held is None and unpickled._held is None
