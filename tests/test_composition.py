"""default_callbacks(): the escalation ladder, rung by rung, with exact outcomes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import fit
from pytorch_lightning.callbacks import ModelCheckpoint

from lightning_overflow import (
    AutoClip,
    DivergenceError,
    LRBackoff,
    NonFiniteDetector,
    Rollback,
    TrialConfig,
    default_callbacks,
    read_journal,
)
from lightning_overflow.testing import Fault, FaultInjector, TinyRegressor


def kinds(path: Path) -> list[tuple[int, str]]:
    return [(e["step"], e["kind"]) for e in read_journal(path / "overflow_events.jsonl")]


def test_composition_and_options() -> None:
    assert [type(c).__name__ for c in default_callbacks()] == [
        "GradNormMonitor", "NonFiniteDetector", "LossSpikeDetector", "AutoClip", "LRBackoff", "Rollback"]
    callbacks = default_callbacks(clip=None, rollback=False, lr_factor=0.25)
    assert not any(isinstance(c, (AutoClip, Rollback)) for c in callbacks)
    assert next(c for c in callbacks if isinstance(c, LRBackoff)).factor == 0.25
    clip = next(c for c in default_callbacks(clip="agc") if isinstance(c, AutoClip))
    assert clip.mode == "agc"
    rollback = next(c for c in default_callbacks(snapshot_every_n_steps=7, max_rollbacks=2) if isinstance(c, Rollback))
    assert (rollback.every_n_steps, rollback.max_rollbacks) == (7, 2)
    # The two remedy providers share one trial setting; None answers suspicions at once.
    trial = TrialConfig(steps=12, remedies=1)
    assert {c.trial for c in default_callbacks(trial=trial) if isinstance(c, (LRBackoff, Rollback))} == {trial}
    assert {c.trial for c in default_callbacks(trial=None) if isinstance(c, (LRBackoff, Rollback))} == {None}


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"clip": "fixed"}, ValueError, "'clip' must be one of 'percentile', 'zscore', 'agc' (got 'fixed')"),
        ({"lr_factor": 1.0}, ValueError, "'lr_factor' must be in (0, 1) (got 1)"),
        ({"snapshot_every_n_steps": 0}, ValueError, "'snapshot_every_n_steps' must be >= 1 (got 0)"),
        ({"rollback": "no"}, TypeError, "'rollback' must be a bool (got 'no')"),
        ({"rollback": False, "dirpath": "snaps"}, ValueError,
         "'dirpath' needs rollback=True: it is where Rollback writes its snapshots (got 'snaps')"),
    ],
)
def test_bad_arguments(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error) as info:
        default_callbacks(**kwargs)
    assert str(info.value) == message


def test_isolated_nonfinite_step_is_absorbed_by_the_skip_alone(tmp_path: Path) -> None:
    callbacks = default_callbacks(snapshot_every_n_steps=5)
    model = TinyRegressor()
    fit(model, [*callbacks, FaultInjector(Fault(12, "nan_loss"))], max_steps=30, default_root_dir=tmp_path)
    assert kinds(tmp_path) == [(12, "nonfinite"), (12, "skip")]
    assert next(c for c in callbacks if isinstance(c, LRBackoff)).scales == [1.0]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_nonfinite_weights_roll_back_and_back_off(tmp_path: Path) -> None:
    callbacks = default_callbacks(snapshot_every_n_steps=5)
    model = TinyRegressor()
    fit(model, [*callbacks, FaultInjector(Fault(12, "nan_weight"))], max_steps=30, default_root_dir=tmp_path)
    events = {kind for _, kind in kinds(tmp_path)}
    assert {"rollback", "backoff"} <= events
    assert next(c for c in callbacks if isinstance(c, LRBackoff)).scales == [0.5]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_fault_that_never_ends_stops_with_divergence_error(tmp_path: Path) -> None:
    faults = FaultInjector(*[Fault(s, "nan_weight") for s in range(6, 60)])
    with pytest.raises(DivergenceError) as info:
        fit(TinyRegressor(), [*default_callbacks(snapshot_every_n_steps=2, max_rollbacks=2), faults], max_steps=60,
            default_root_dir=tmp_path)
    message = str(info.value)
    assert len(info.value.history) >= 2 and "Backoffs so far: step 6 (nonfinite_state) -> 0.5;" in message
    assert "add Rollback" not in message and "add LRBackoff" not in message  # advice names only what is missing


def test_no_checkpoint_holds_nonfinite_weights(tmp_path: Path) -> None:
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_last=True, save_top_k=-1)
    fit(TinyRegressor(), [*default_callbacks(snapshot_every_n_steps=3), FaultInjector(Fault(7, "nan_weight")), checkpoint],
        max_steps=15, enable_checkpointing=True, default_root_dir=tmp_path)
    files = sorted((tmp_path / "ckpt").glob("*.ckpt"))
    assert len(files) >= 15
    for path in files:
        state = torch.load(path, weights_only=True)["state_dict"]
        assert all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point()), path.name


def test_detector_options_are_the_documented_defaults() -> None:
    detector = next(c for c in default_callbacks() if isinstance(c, NonFiniteDetector))
    assert detector.action == "skip"
