"""The update bound: a restored state that diverges again at once, at a lower LR each time, has gradients out of
scale; AutoClip bounds every update by the weights from then on, and LRBackoff takes its backoffs back."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import fit, tuned
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_overflow import AutoClip, default_callbacks, read_journal
from lightning_overflow.health import board_for
from lightning_overflow.policy import UPDATE_BOUND
from lightning_overflow.testing import TinyRegressor

LR = 3e-3


class ExplodingRNN(pl.LightningModule):
    """A ReLU RNN over 48 steps whose recurrent matrix is orthogonal x 1.5: backpropagation through time multiplies
    the first gradients by about 1.5**48, so the first SGD step at a sound LR throws the weights 1e4 times their norm
    away and the next losses are NaN (Pascanu, Mikolov and Bengio, 2013)."""

    def __init__(self, seed: int = 2) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.rnn = nn.RNN(4, 32, nonlinearity="relu", batch_first=True)
        self.head = nn.Linear(32, 1)
        with torch.no_grad():
            nn.init.orthogonal_(self.rnn.weight_hh_l0)
            self.rnn.weight_hh_l0.mul_(1.5)
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(256, 48, 4, generator=gen)
        y = 0.1 * torch.randn(256, 48, 1, generator=gen)
        y[:, 2:, 0] += x[:, :-2, 0]
        self.data = TensorDataset(x, y)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(self.rnn(x)[0]), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=32)


def _journal(root: Path) -> list[dict[str, Any]]:
    return list(read_journal(root / "overflow_events.jsonl"))


def _norm(module: nn.Module) -> float:
    return math.sqrt(sum(float(p.detach().double().square().sum()) for p in module.parameters()))


def test_gradients_out_of_scale_are_bounded_and_the_backoffs_taken_back(tmp_path: Path) -> None:
    model = ExplodingRNN()
    initial_norm = _norm(model)
    trainer = fit(model, default_callbacks(), max_steps=40, default_root_dir=str(tmp_path))
    events = _journal(tmp_path)
    acted = [(e["step"], e["kind"], e["source"]) for e in events if e["kind"] in ("backoff", "rollback", "undo")]
    # Each restore of step 0's snapshot diverges again after its first update; at the second, the bound arms.
    assert acted == [
        (3, "backoff", "LRBackoff"), (4, "rollback", "Rollback"),
        (7, "backoff", "LRBackoff"), (8, "undo", "LRBackoff"), (8, "rollback", "Rollback"),
    ]  # fmt: skip
    bound = [e for e in events if e["kind"] == "update_bound"]
    assert [(e["step"], e["details"]["update_ratio"]) for e in bound] == [(8, 0.01)]
    assert bound[0]["details"]["weight_norm"] == pytest.approx(initial_norm, rel=1e-6)  # the restored weights
    assert "diverged again within 1 optimizer step(s) at a lower learning rate" in bound[0]["message"]
    # The first bounded step: the threshold is 1% of the weight norm over the LR, the schedule's again.
    first = next(e for e in events if e["kind"] == "clip" and e["step"] == 8)
    assert first["details"]["threshold"] == 0.01 * bound[0]["details"]["weight_norm"] / LR
    assert first["details"]["coef"] < 1e-5
    assert trainer.optimizers[0].param_groups[0]["lr"] == LR  # 1.0 x the schedule: both backoffs taken back
    assert not [e for e in events if e["kind"] in ("abort",) or (e["kind"] == "nonfinite" and e["step"] >= 8)]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_without_the_bound_the_same_run_backs_off_to_its_floor(tmp_path: Path) -> None:
    from lightning_overflow import DivergenceError

    suite = [tuned(c, update_ratio=None) if isinstance(c, AutoClip) else c for c in default_callbacks()]
    with pytest.raises(DivergenceError, match="already at its floor"):
        fit(ExplodingRNN(), suite, max_steps=60, default_root_dir=str(tmp_path))


def _restore(trainer: pl.Trainer, autoclip: AutoClip, extras: dict[str, Any], steps_since: int,
             update: float = 1e3) -> None:
    """Restore ``extras`` after the restored state took ``steps_since`` steps whose largest update (lr x gradient
    norm applied) was ``update``."""
    autoclip.steps += steps_since
    autoclip._largest_update = {0: update} if steps_since else {}
    board_for(trainer).signals.clear()
    board_for(trainer).after_restore(trainer, extras)


def test_the_bound_arms_on_a_second_quick_return_after_updates_beyond_it_and_halves_at_each_next() -> None:
    autoclip = tuned(AutoClip(), restart_steps=5)
    model = TinyRegressor()
    trainer = fit(model, [autoclip], max_steps=6)
    extras = board_for(trainer).snapshot_extras(trainer)
    norm = _norm(model)
    _restore(trainer, autoclip, extras, 0)  # a first return: nothing to compare with
    assert autoclip.state_dict()["bounds"] == {}
    _restore(trainer, autoclip, extras, 6)  # the restored state lasted 6 steps: not "at once"
    assert autoclip.state_dict()["bounds"] == {}
    _restore(trainer, autoclip, extras, 5, update=0.0099 * norm)  # its updates were within the bound
    assert autoclip.state_dict()["bounds"] == {}
    _restore(trainer, autoclip, extras, 5, update=0.0101 * norm)
    ratio, weight_norm = autoclip.state_dict()["bounds"][0]
    assert ratio == 0.01 and weight_norm == pytest.approx(norm, rel=1e-6)
    assert [s.kind for s in board_for(trainer).signals] == [UPDATE_BOUND]
    assert autoclip._settings() == (0.01,)  # a return with the bound armed is a change of settings: progress
    _restore(trainer, autoclip, extras, 1, update=0.0)  # armed: a quick return halves it, whatever the updates
    assert autoclip.state_dict()["bounds"][0][0] == 0.005
    assert board_for(trainer).signals == []  # only the arming takes the backoffs back
    other = dict(extras, **{autoclip.state_key: dict(extras[autoclip.state_key], steps=-7)})
    _restore(trainer, autoclip, other, 1)  # another snapshot: nothing learned about this one yet
    assert autoclip.state_dict()["bounds"][0][0] == 0.005


def test_the_bound_is_kept_in_checkpoints_and_agc_has_none() -> None:
    autoclip = AutoClip()
    autoclip.load_state_dict({**AutoClip().state_dict(), "bounds": {"0": [0.005, 12.5]}})
    assert autoclip.state_dict()["bounds"] == {0: [0.005, 12.5]}
    agc = AutoClip(mode="agc")
    trainer = fit(TinyRegressor(), [agc], max_steps=4)
    extras = board_for(trainer).snapshot_extras(trainer)
    for _ in range(3):
        _restore(trainer, agc, extras, 1)
    assert agc.state_dict()["bounds"] == {}


@pytest.mark.ddp
@pytest.mark.timeout(180)
def test_ddp_ranks_arm_the_same_bound_and_end_on_the_same_weights(tmp_path: Path) -> None:
    from ddp_utils import run_ddp

    suite = default_callbacks()
    reports = run_ddp(ExplodingRNN(), suite, tmp_path, max_steps=14)
    assert [r["error"] for r in reports] == [None, None]
    assert reports[0]["digest"] == reports[1]["digest"] and all(r["finite"] for r in reports)
    clip = [next(s for s in r["states"] if s.startswith("AutoClip:")) for r in reports]
    assert clip[0] == clip[1] and '"bounds": {"0": [0.01' in clip[0]
    assert all(r["lrs"][-1] == LR for r in reports)  # the backoffs taken back on both ranks
