"""The metric names are a contract (dashboards and alerts rely on them): logged as documented, listed in the docs."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from conftest import MemoryLogger, fit

from lightning_overflow import default_callbacks
from lightning_overflow.testing import Fault, FaultInjector, TinyGAN, TinyRegressor

CONTRACT = [
    "grad_norm/total",
    "clip/threshold",
    "clip/coef",
    "overflow/skipped_steps",
    "overflow/nonfinite_events",
    "overflow/spikes",
    "overflow/lr_scale",
    "overflow/rollbacks",
    "overflow/headroom_decades",
    "overflow/headroom_loss_decades",
    "overflow/headroom_grad_decades",
    "overflow/headroom_activation_decades",
]
METRICS_DOC = Path(__file__).resolve().parents[1] / "docs" / "journal.md"


def test_default_callbacks_log_every_contract_key(tmp_path: Path) -> None:
    logger = MemoryLogger(str(tmp_path))
    faults = FaultInjector(Fault(30, "nan_loss"), Fault(40, "nan_weight"))
    fit(TinyRegressor(), [*default_callbacks(snapshot_every_n_steps=5), faults], max_steps=60, logger=logger,
        log_every_n_steps=1, default_root_dir=tmp_path)
    missing = [key for key in CONTRACT if key not in logger.metrics]
    assert not missing
    keys = sorted(logger.metrics)
    prefixes = [(a, b) for a in keys for b in keys if b.startswith(a + "/")]
    assert not prefixes, f"metric names that are folders of others (MLflow's file store refuses them): {prefixes}"
    assert dict(logger.metrics["overflow/skipped_steps"])[59] >= 1
    assert dict(logger.metrics["overflow/rollbacks"])[59] >= 1
    assert dict(logger.metrics["overflow/lr_scale"])[59] == 0.5


def test_several_optimizers_are_suffixed_with_their_index(tmp_path: Path) -> None:
    logger = MemoryLogger(str(tmp_path))
    fit(TinyGAN(), default_callbacks(rollback=False), max_steps=6, logger=logger, log_every_n_steps=1,
        default_root_dir=tmp_path)
    assert {"grad_norm/total_opt0", "grad_norm/total_opt1", "clip/coef_opt0", "clip/coef_opt1"} <= set(logger.metrics)


def test_the_docs_document_every_key() -> None:
    text = METRICS_DOC.read_text()
    for key in CONTRACT:
        assert f"`{key}`" in text, key


def test_counters_are_monitorable_and_shown_in_the_progress_bar_once_something_happened() -> None:
    from lightning_overflow import NonFiniteDetector

    healthy = fit(TinyRegressor(), [NonFiniteDetector()], max_steps=4)
    assert float(healthy.callback_metrics["overflow/skipped_steps"]) == 0.0
    assert "skips" not in healthy.progress_bar_metrics
    faulty = fit(TinyRegressor(), [NonFiniteDetector(), FaultInjector(Fault(2, "nan_loss"))], max_steps=4)
    assert float(faulty.callback_metrics["overflow/skipped_steps"]) == 1.0
    assert faulty.progress_bar_metrics["skips"] == 1 and isinstance(faulty.progress_bar_metrics["skips"], int)


def test_without_a_logger_every_contract_key_is_in_callback_metrics_for_monitors() -> None:
    """``logger=False``: the values went nowhere, and ``EarlyStopping(monitor="grad_norm/total")`` raised that the
    metric was not available. They are in ``trainer.callback_metrics`` as with a logger, and the monitors read them;
    the last logged step's gradient norm is the one a logger would have received."""
    from pytorch_lightning.callbacks import EarlyStopping

    runs = {}
    for logger in (False, True):
        stopping = EarlyStopping(monitor="grad_norm/total", patience=1000, check_on_train_epoch_end=True)
        faults = FaultInjector(Fault(30, "nan_loss"), Fault(40, "nan_weight"))
        torch.manual_seed(0)
        trainer = fit(TinyRegressor(), [*default_callbacks(snapshot_every_n_steps=5), faults, stopping], max_steps=60,
                      logger=logger, log_every_n_steps=1)  # fmt: skip
        runs[logger] = {k: float(v) for k, v in trainer.callback_metrics.items()}
        assert not [key for key in CONTRACT if key not in trainer.callback_metrics]
        assert math.isfinite(float(stopping.best_score)) and stopping.wait_count < 1000
    assert runs[False] == runs[True]
