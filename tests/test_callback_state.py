"""Callback state in checkpoints: versioned, read strictly; the previous release's checkpoints still load."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import make_trainer

from lightning_overflow import (
    AutoClip,
    LossSpikeDetector,
    LRBackoff,
    NonFiniteDetector,
    OverflowWarning,
    Rollback,
    default_callbacks,
)
from lightning_overflow.callback_state import VERSION, StateReader
from lightning_overflow.testing import TinyRegressor

PREVIOUS_RELEASE = Path(__file__).parent / "data" / "previous_release.ckpt"
"""Written by 0.2 (version 1 of the state, no version entry): default_callbacks(snapshot_every_n_steps=4) on
``TinyRegressor(batch_norm=True)``, NaN weights at step 6 (one backoff, one rollback), saved at step 16."""


def test_a_checkpoint_of_the_previous_release_still_loads_and_the_fit_goes_on(tmp_path: Path) -> None:
    saved = torch.load(PREVIOUS_RELEASE, weights_only=True)
    assert all("version" not in state for key, state in saved["callbacks"].items() if "Checkpoint" not in key)
    suite = default_callbacks(snapshot_every_n_steps=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = make_trainer(suite, max_steps=24, default_root_dir=str(tmp_path))
        trainer.fit(TinyRegressor(batch_norm=True), ckpt_path=str(PREVIOUS_RELEASE))
    assert not [w for w in caught if issubclass(w.category, OverflowWarning)]  # nothing unknown, nothing reset
    assert trainer.global_step == 24
    backoff, rollback = suite[-2], suite[-1]
    assert backoff.scales == [0.5] and [h["action"] for h in backoff.history] == ["backoff"]
    assert rollback.rollbacks == 1 and rollback.history[0]["snapshot_step"] == 4
    assert all(torch.isfinite(p).all() for p in trainer.lightning_module.parameters())
    # What 0.2 did not write starts from its documented value.
    assert (rollback._last_target, rollback._retries, rollback._rollback_settings) == (None, 0, None)


def _state(callback: Any) -> dict[str, Any]:
    make_trainer([callback], max_steps=4).fit(TinyRegressor())
    state = callback.state_dict()
    assert state["version"] == VERSION
    return state


CALLBACKS = {
    "Rollback": (lambda: Rollback(every_n_steps=2), "healthy_steps"),
    "LRBackoff": (LRBackoff, "windows"),
    "NonFiniteDetector": (NonFiniteDetector, "consecutive"),
    "AutoClip": (AutoClip, "first"),
    "LossSpikeDetector": (LossSpikeDetector, "loss_spikes"),
}


@pytest.mark.parametrize("name", list(CALLBACKS))
def test_a_missing_entry_is_an_error_naming_it(name: str) -> None:
    build, key = CALLBACKS[name]
    state = _state(build())
    del state[key]
    with pytest.raises(ValueError) as error:
        build().load_state_dict(state)
    assert str(error.value) == (
        f"{name}'s checkpoint state has no {key!r} entry (version {VERSION} writes it): the checkpoint is damaged or "
        "was written by another callback"
    )


@pytest.mark.parametrize("name", list(CALLBACKS))
def test_a_malformed_entry_is_an_error_naming_it_and_its_value(name: str) -> None:
    build, key = CALLBACKS[name]
    state = _state(build())
    state[key] = "three"
    with pytest.raises(ValueError, match=rf"^{name}'s checkpoint state has a malformed {key!r} entry \('three'\): "):
        build().load_state_dict(state)


@pytest.mark.parametrize("name", list(CALLBACKS))
def test_an_unknown_entry_is_named_in_a_warning_and_ignored(name: str) -> None:
    build, _ = CALLBACKS[name]
    state = _state(build())
    state[f"from_a_later_release_{name}"] = 1
    with pytest.warns(OverflowWarning) as caught:
        build().load_state_dict(state)
    assert [str(w.message) for w in caught] == [
        f"{name}: the checkpoint state holds entries this release does not know (from_a_later_release_{name}); they "
        "were ignored."
    ]


def test_a_state_from_a_later_version_is_refused() -> None:
    with pytest.raises(ValueError) as error:
        StateReader("LRBackoff", {"version": VERSION + 1})
    assert str(error.value) == (
        f"LRBackoff's checkpoint state has version {VERSION + 1}; this release reads versions 1 to {VERSION}: it was "
        "written by a later release, or is damaged"
    )


def test_rollbacks_spent_index_must_lie_within_the_history() -> None:
    state = _state(Rollback(every_n_steps=2))
    state["free"] = [3]
    with pytest.raises(ValueError, match=r"malformed 'free' entry \(\[3\]\): an index lies outside the 0 rollbacks"):
        Rollback(every_n_steps=2).load_state_dict(state)
