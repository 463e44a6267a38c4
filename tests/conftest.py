"""Shared helpers: quiet, fast CPU trainers and bit-exact state comparison."""

from __future__ import annotations

import logging
import sys
import warnings
from collections import Counter
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import TensorDataset

from lightning_overflow.testing import TinyGAN

logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)
logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
warnings.filterwarnings("ignore", message=".*isinstance.*LeafSpec.*")


def make_trainer(callbacks: list[Any] | None = None, **kwargs: Any) -> pl.Trainer:
    """A quiet single-process CPU trainer; keyword arguments override the defaults."""
    options: dict[str, Any] = {
        "max_steps": 8,
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
    }
    options.update(kwargs)
    return pl.Trainer(callbacks=callbacks or [], **options)


def fit(model: pl.LightningModule, callbacks: list[Any] | None = None, **kwargs: Any) -> pl.Trainer:
    trainer = make_trainer(callbacks, **kwargs)
    trainer.fit(model)
    return trainer


def tuned(callback: Any, **values: Any) -> Any:
    """``callback`` with some of the policy's fixed values (its class attributes of the same names) changed on this
    instance only: a test that needs a shorter window or a sharper threshold than the suite's."""
    for name, value in values.items():
        if not hasattr(type(callback), name):
            raise AttributeError(f"{type(callback).__name__} has no fixed value {name!r}")
        setattr(callback, name, value)
    return callback


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A deep copy of the optimizer's state dict (tensors cloned)."""
    state = optimizer.state_dict()
    return {
        "state": {k: {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in v.items()} for k, v in state["state"].items()},
        "param_groups": [dict(g) for g in state["param_groups"]],
    }


def assert_optimizer_state_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        for n, t in a["state"][k].items():
            other = b["state"][k][n]
            if isinstance(t, torch.Tensor):
                assert torch.equal(t, other), f"state {k}.{n} differs"
            else:
                assert t == other


@pytest.fixture(autouse=True)
def _seed() -> None:
    pl.seed_everything(0, verbose=False)


class MemoryLogger(pl.loggers.Logger):
    """Keeps every logged metric in memory: ``metrics[key] == [(step, value), ...]``."""

    def __init__(self, save_dir: str | None = None) -> None:
        super().__init__()
        self.metrics: dict[str, list[tuple[int, float]]] = {}
        self._save_dir = save_dir

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    @property
    def save_dir(self) -> str | None:
        return self._save_dir

    @property
    def log_dir(self) -> str | None:
        return self._save_dir

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        for key, value in metrics.items():
            self.metrics.setdefault(key, []).append((int(step or 0), float(value)))

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass


@pytest.fixture
def count_reads(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts device-to-host reads made from the package's own code (item, tolist, bool of a tensor), by module."""
    reads: Counter[str] = Counter()
    for name in ("item", "tolist", "__bool__", "__float__"):
        original = getattr(torch.Tensor, name)

        def counting(self: torch.Tensor, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("lightning_overflow"):
                reads[caller] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    return reads


def with_nan_sample(data: TensorDataset, index: int = 21) -> TensorDataset:
    """``data`` (one tensor of features) with the first feature of sample ``index`` NaN: ``TinyGAN``'s data in batches
    of 16 holds it in batch 1 of each epoch."""
    x = data.tensors[0].clone()
    x[index, 0] = float("nan")
    return TensorDataset(x)


class BatchNormGAN(TinyGAN):
    """``TinyGAN`` whose discriminator normalises its hidden layer (``BatchNorm1d``), trained on data whose sample 21
    is NaN (:func:`with_nan_sample`; under DDP the sampler gives it to one rank an epoch)."""

    def __init__(self) -> None:
        super().__init__()
        self.discriminator = nn.Sequential(nn.Linear(2, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
        self.data = with_nan_sample(self.data)
