"""Callbacks that change the training state during a fit: averaged copies of the model (Lightning's WeightAveraging
and StochasticWeightAveraging) are rolled back with the weights they average, a scheduler swapped in during the fit
survives a rollback to before it, and a model that pruning reparametrized is snapshot again before a fault needs
it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import assert_bit_identical, fit, weights
from pytorch_lightning.callbacks import (
    BackboneFinetuning,
    BaseFinetuning,
    ModelCheckpoint,
    ModelPruning,
    StochasticWeightAveraging,
    WeightAveraging,
)
from torch.nn.utils import prune
from torch.optim.swa_utils import SWALR
from typing_extensions import override

from lightning_overflow import LRBackoff, TrialConfig, default_callbacks, read_journal
from lightning_overflow._compat import Callback
from lightning_overflow.callbacks.nonfinite_detector import NonFiniteDetector
from lightning_overflow.callbacks.rollback import Rollback
from lightning_overflow.exceptions import RollbackError
from lightning_overflow.health import board_for
from lightning_overflow.numerics.snapshots import restore_optimizer_, take_snapshot
from lightning_overflow.testing import Fault, FaultInjector, TinyRegressor
from lightning_overflow.training_state import pruned_away, restorable
from test_trials import Sabotaged, Suspect


class AverageProbe(Callback):
    """The average's state (and the weights', the schedulers', the param groups') at the end of every batch, by
    ``global_step``; put it after Rollback, so that it sees what Rollback left."""

    def __init__(self, averaging: Any) -> None:
        self.averaging = averaging
        self.at: dict[int, dict[str, Any]] = {}
        self.epoch_start: dict[int, dict[str, torch.Tensor]] = {}  # the weights when an epoch starts

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.epoch_start[trainer.global_step] = weights(pl_module)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        self.at[trainer.global_step] = {
            "average": weights(self.averaging._average_model) if self.averaging is not None else {},
            "weights": weights(pl_module),
            "schedulers": [type(c.scheduler).__name__ for c in trainer.lr_scheduler_configs],
            "groups": [dict(g) for g in trainer.optimizers[0].param_groups],
        }


def nan_weight_at(step: int) -> FaultInjector:
    return FaultInjector(Fault(step=step, kind="nan_weight"))


def all_finite(tensors: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors.values() if t.is_floating_point())


def test_an_ema_that_averaged_nan_weights_is_rolled_back_with_them(tmp_path: Path) -> None:
    # WeightAveraging first: at the end of step 5 it averages the NaN weight in before Rollback acts.
    ema, rollback = WeightAveraging(), Rollback(every_n_steps=3)
    probe = AverageProbe(ema)
    saving = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    model = TinyRegressor()
    trainer = fit(model, [ema, NonFiniteDetector(), rollback, probe, nan_weight_at(5), saving], max_steps=12,
                  enable_checkpointing=True)  # fmt: skip

    assert [(h["step"], h["snapshot_step"]) for h in rollback.history] == [(6, 3)]
    assert_bit_identical(probe.at[6]["average"], probe.at[3]["average"])
    assert_bit_identical(probe.at[6]["weights"], probe.at[3]["weights"])
    assert all(all_finite(probe.at[step]["average"]) for step in probe.at)
    # The fit ends with the average in the model (WeightAveraging's on_train_end): finite, trained.
    average = {k.removeprefix("module."): v for k, v in probe.at[12]["average"].items() if k.startswith("module.")}
    assert_bit_identical(weights(model), average)
    # WeightAveraging writes its average as the checkpoint's weights: none holds inf/NaN.
    files = sorted(tmp_path.glob("*.ckpt"))
    assert len(files) == 12
    for path in files:
        checkpoint = torch.load(path, weights_only=True)
        assert all_finite(checkpoint["state_dict"]) and all_finite(checkpoint["current_model_state"]), path.name
    assert trainer.global_step == 12


class TorchEMA(Callback):
    """schnetpack's EMA callback, as it is: a ``torch_ema.ExponentialMovingAverage`` of the parameters, updated at
    each batch's end (here before the suite's callbacks, so it takes in the NaN weight before Rollback acts)."""

    def __init__(self) -> None:
        self.ema: Any = None
        self.shadows: dict[int, list[torch.Tensor]] = {}

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from torch_ema import ExponentialMovingAverage

        self.ema = ExponentialMovingAverage(pl_module.parameters(), decay=0.9)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        self.ema.update()
        self.shadows[trainer.global_step] = [t.clone() for t in self.ema.shadow_params]


class ShadowsAfterTheSuite(Callback):
    def __init__(self, ema: TorchEMA) -> None:
        self.ema = ema
        self.at: dict[int, list[torch.Tensor]] = {}

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        self.at[trainer.global_step] = [t.clone() for t in self.ema.ema.shadow_params]


def test_a_torch_ema_that_averaged_nan_weights_is_rolled_back_with_them() -> None:
    """schnetpack's EMA listed before the suite took in the NaN weight of step 5, which no snapshot held: every
    validation then swapped NaN weights into the model, the suite rolled back three times and raised DivergenceError,
    returning the untrained state. Its averages are part of the state now, checked, snapshot and restored."""
    ema = TorchEMA()
    after = ShadowsAfterTheSuite(ema)
    rollback = Rollback(every_n_steps=3)
    trainer = fit(TinyRegressor(), [ema, NonFiniteDetector(), rollback, after, nan_weight_at(5)], max_steps=12)
    assert [(h["step"], h["snapshot_step"]) for h in rollback.history] == [(6, 3)]
    assert not all(bool(torch.isfinite(t).all()) for t in ema.shadows[6])  # it took the NaN in
    assert all(torch.equal(a, b) for a, b in zip(after.at[6], after.at[3]))  # and is the snapshot's again
    assert all(bool(torch.isfinite(t).all()) for step in after.at for t in after.at[step])
    assert trainer.global_step == 12


def test_swa_rolls_back_to_before_its_scheduler_was_swapped_in() -> None:
    # 8 batches an epoch: SWA starts with the second epoch (step 8), its SWALR in the first place; the NaN weight of
    # step 10 goes back to the snapshot of step 6, taken before SWA began, with no scheduler.
    swa, rollback = StochasticWeightAveraging(swa_lrs=5e-3, swa_epoch_start=2), Rollback(every_n_steps=6)
    probe = AverageProbe(swa)
    trainer = fit(TinyRegressor(), [swa, NonFiniteDetector(), rollback, probe, nan_weight_at(10)], max_steps=-1,
                  max_epochs=4)  # fmt: skip

    assert [(h["step"], h["snapshot_step"]) for h in rollback.history] == [(11, 6)]
    assert_bit_identical(probe.at[11]["weights"], probe.at[6]["weights"])
    assert probe.at[6]["schedulers"] == [] and probe.at[11]["schedulers"] == ["SWALR"]
    # The snapshot's param groups, with SWALR's own keys kept: it reads them at its next step.
    restored = {k: v for k, v in probe.at[11]["groups"][0].items() if k != "params"}
    assert restored["swa_lr"] == 5e-3 and restored["lr"] == probe.at[6]["groups"][0]["lr"]
    # The average took in step 8's weights, which the rollback abandoned: it starts again with the next epoch.
    assert swa.n_averaged.item() == 2  # the weights at the start of the third and fourth epochs
    assert trainer.global_step == 32 and all_finite(weights(trainer.lightning_module))


@pytest.mark.parametrize("fault_step", [5, 20])
def test_a_backoff_sticks_under_swa_whether_it_came_before_or_during_its_epochs(fault_step: int) -> None:
    """SWA's ``SWALR`` anneals each group's rate towards its ``swa_lr``, and ``StochasticWeightAveraging`` sets both
    from its ``swa_lrs`` when its epochs begin: a backoff must scale them too, or the rate climbs back to the
    unscaled ``swa_lrs`` while the suite reports 0.5x (8 batches an epoch: SWA begins at step 8; step 5's backoff
    came before it, step 20's during it)."""
    rates = []
    for suite in ([], [*default_callbacks(snapshot_every_n_steps=5), nan_weight_at(fault_step)]):
        swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2, annealing_epochs=2)
        trainer = fit(TinyRegressor(lr=0.01), [*suite, swa], max_steps=-1, max_epochs=8)
        rates.append(trainer.optimizers[0].param_groups[0]["lr"])
    assert rates[0] == 0.05 and rates[1] == 0.5 * rates[0]


@pytest.mark.parametrize(("every", "start"), [(4, 3), (10, 4)])
def test_swa_beginning_during_a_trial_and_a_trials_remedy_leave_swa_at_the_scale_the_run_holds(
    every: int, start: int
) -> None:
    """SWA swaps its ``SWALR`` in as its epochs begin, perhaps while a trial runs: the candidate held no state of it
    (an ``IndexError`` ended the fit). A trial's remedy sets its rate for the candidate alone: SWA's rates follow the
    scale the run holds, not the remedy's (a discarded trial of x0.125 left SWA at 1/8 of its rate)."""
    swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=start, annealing_epochs=1)
    suite = default_callbacks(trial=TrialConfig(steps=4, every_n_steps=every))
    trainer = fit(TinyRegressor(lr=0.01), [*suite, swa], max_steps=-1, max_epochs=start + 2)
    backoff = next(cb for cb in suite if isinstance(cb, LRBackoff))
    assert trainer.global_step == 8 * (start + 2) and swa.n_averaged is not None and swa.n_averaged.item() > 0
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.05 * backoff.scales[0]


def test_a_healthy_run_with_an_ema_is_bit_identical_with_and_without_the_suite() -> None:
    runs = []
    for suite in ([], default_callbacks(clip=None)):
        torch.manual_seed(0)
        model = TinyRegressor()
        fit(model, [WeightAveraging(), *suite], max_steps=30)
        runs.append(weights(model))
    assert_bit_identical(runs[0], runs[1])


def test_a_false_alarm_leaves_an_ema_bit_identical_to_the_run_without_the_suite(tmp_path: Path) -> None:
    """A healthy run suspected at step 35 tries the snapshot of step 30: building the remedy restored the snapshot's
    average too, and the incumbent went on averaging from it. The run as it was, kept, must hold its own."""
    averages, finals = [], []
    for suite in ([], [Suspect(35), LRBackoff(), Rollback(every_n_steps=10)]):
        torch.manual_seed(0)
        ema, model = WeightAveraging(), TinyRegressor(dropout=0.2)
        fit(model, [ema, *suite], max_steps=60, default_root_dir=str(tmp_path))
        averages.append(weights(ema._average_model))
        finals.append(weights(model))
    assert [e["details"]["false_alarm"] for e in read_journal(tmp_path / "overflow_events.jsonl")
            if e["kind"] == "trial"] == [True]  # fmt: skip
    assert_bit_identical(averages[0], averages[1])
    assert_bit_identical(finals[0], finals[1])  # WeightAveraging puts its average in the model at the end


@pytest.mark.parametrize("averaging", ["ema", "swa_before", "swa_during"])
def test_a_kept_remedy_brings_back_the_average_of_the_snapshot_it_started_from(averaging: str) -> None:
    """The sabotage of step 30 is suspected at step 31 and the remedy (the snapshot of step 30) kept at step 52. The
    average had taken in the sabotaged weights of the trial's 20 steps (the run it replaced), and went on from
    them: a model 170x worse than the weights the suite rescued came back at the end. It is the snapshot's now, as a
    rollback's is; an SWA that began during the trial (its fifth epoch, step 32) starts again."""
    swa = StochasticWeightAveraging(swa_lrs=5e-3, swa_epoch_start=3 if averaging == "swa_before" else 5)
    average = WeightAveraging() if averaging == "ema" else swa
    probe = AverageProbe(average)
    suite = [Suspect(31), LRBackoff(), Rollback(every_n_steps=10)]
    fit(Sabotaged(), [average, *suite, probe], max_steps=60)
    assert [(h["step"], h["snapshot_step"]) for h in suite[-1].history] == [(52, 30)]
    if averaging != "swa_during":
        assert_bit_identical(probe.at[52]["average"], probe.at[30]["average"])
        then, before = probe.at[30]["average"], probe.at[51]["average"]  # the incumbent's, averaged since
        assert any(not torch.equal(before[k], then[k]) for k in then)
    if averaging == "swa_before":  # SWA averages as epochs start: steps 16 and 24, then 56 (those between went)
        assert swa.n_averaged.item() == 3
    if averaging == "swa_during":  # the next epoch (step 56) starts it again from the remedy's weights
        assert swa.n_averaged.item() == 1
        assert_bit_identical(weights(swa._average_model), probe.epoch_start[56])


class UnfreezeFirstLayer(BaseFinetuning):
    """The first layer frozen, then trained in a param group of its own from epoch 5 (step 40) at a tenth of the
    rate."""

    @override
    def freeze_before_training(self, pl_module: pl.LightningModule) -> None:
        self.freeze(pl_module.net[0])

    @override
    def finetune_function(self, pl_module: pl.LightningModule, epoch: int, optimizer: Any) -> None:
        if epoch == 5:
            self.unfreeze_and_add_param_group(pl_module.net[0], optimizer)


class TrainableOnly:
    def configure_optimizers(self) -> Any:
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=self.lr)


class HeadFirst(TrainableOnly, TinyRegressor):
    pass


class SabotagedHeadFirst(TrainableOnly, Sabotaged):
    pass


def test_a_group_added_during_a_false_alarm_leaves_the_run_bit_identical(tmp_path: Path) -> None:
    """The unfreeze of step 40 falls in the trial of steps 35-55: a remedy's backoff held the group at its scale,
    that entry stayed behind in the run's group, and the run then took the group's rate for one its code wrote at
    the remedy's scale: the run went on with the first layer at half its rate."""
    runs = []
    for suite in ([], [Suspect(35), LRBackoff(), Rollback(every_n_steps=10)]):
        torch.manual_seed(0)
        model = HeadFirst()
        trainer = fit(model, [UnfreezeFirstLayer(), *suite], max_steps=64, default_root_dir=str(tmp_path))
        runs.append((weights(model), [g["lr"] for g in trainer.optimizers[0].param_groups]))
    assert [e["details"]["false_alarm"] for e in read_journal(tmp_path / "overflow_events.jsonl")
            if e["kind"] == "trial"] == [True]  # fmt: skip
    assert_bit_identical(runs[0][0], runs[1][0])
    assert runs[0][1] == runs[1][1] == [0.01, 0.001]


def test_a_kept_remedy_holds_a_group_added_during_its_trial_at_its_own_rate() -> None:
    """The remedy at x0.5 is kept at step 52; the group added at step 40 trained at the run's rate in every branch,
    and stayed there after the keep, while the suite said the optimizer was at 0.5x its schedule."""
    config = TrialConfig(remedies=1)
    suite = [Suspect(31), LRBackoff(trial=config), Rollback(every_n_steps=10, trial=config)]
    trainer = fit(SabotagedHeadFirst(), [UnfreezeFirstLayer(), *suite], max_steps=64)
    assert [(h["step"], h["snapshot_step"]) for h in suite[-1].history] == [(52, 30)]
    assert [g["lr"] for g in trainer.optimizers[0].param_groups] == [0.5 * 0.01, 0.5 * 0.001]


def test_a_restore_keeps_the_keys_a_scheduler_added_to_the_param_groups_since() -> None:
    # The optimizer has no state yet: the restore loads the snapshot, and must not drop SWALR's swa_lr.
    parameter = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.Adam([parameter], lr=0.1)
    snapshot = take_snapshot(optimizer.state_dict())
    SWALR(optimizer, swa_lr=0.05, anneal_epochs=2)
    parameter.grad = torch.ones(3)
    optimizer.step()

    restore_optimizer_(optimizer, snapshot)

    (group,) = optimizer.param_groups
    assert group["swa_lr"] == 0.05 and group["lr"] == 0.1 and optimizer.state[parameter] == {}


def test_a_model_that_pruning_reparametrized_is_snapshot_again_when_the_next_epoch_starts() -> None:
    # ModelPruning turns each weight into weight_orig and weight_mask when the first epoch ends (step 8): the snapshots
    # of steps 0 and 6 no longer fit the model, and the NaN weight of step 12 goes back to the one of step 8.
    rollback = Rollback(every_n_steps=6)
    probe = AverageProbe(None)
    trainer = fit(TinyRegressor(), [ModelPruning("l1_unstructured", amount=0.3), NonFiniteDetector(), rollback, probe,
                                    nan_weight_at(12)], max_steps=-1, max_epochs=3)  # fmt: skip

    assert [(h["step"], h["snapshot_step"]) for h in rollback.history] == [(13, 8)]
    assert "net.0.weight_orig" in probe.at[13]["weights"]
    assert_bit_identical(probe.at[13]["weights"], probe.epoch_start[8])
    assert trainer.global_step == 24 and all_finite(weights(trainer.lightning_module))


def test_the_snapshots_from_before_pruning_stay_rollback_targets_in_the_new_layout() -> None:
    """Pruning at the first epoch's end (step 8) kept each parameter and renamed it: the snapshot of step 6 is put in
    the new layout (its weights as ``weight_orig``, the mask the model prunes with now beside them) and kept behind
    the one taken at step 8. It was dropped as unfit, so that the state right after pruning, whatever it was, became
    the only rollback target (a run whose learning rate was too high rolled back into its divergence)."""
    rollback = Rollback(every_n_steps=6)
    probe = AverageProbe(None)
    pruning = ModelPruning("l1_unstructured", amount=0.3, make_pruning_permanent=False)
    trainer = fit(TinyRegressor(), [pruning, NonFiniteDetector(), rollback, probe], max_steps=10)

    assert rollback.snapshot_steps == [6, 8]
    carried, newest = (s.state["model"] for s in rollback._memory.snapshots)
    assert list(carried) == list(newest) == list(trainer.lightning_module.state_dict())
    assert restorable(trainer, rollback._memory.snapshots[0].state) == ""
    for name in ("net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"):
        assert torch.equal(carried[f"{name}_orig"], probe.at[6]["weights"][name])
        assert torch.equal(carried[f"{name}_mask"], newest[f"{name}_mask"])
    assert not bool(carried["net.0.weight_mask"].all())  # the mask prunes


class PrunedTanh(pl.LightningModule):
    """A tanh regression whose biases pruning masks to 0 (global L1 on every parameter, 30% an epoch)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
        self.data = torch.utils.data.TensorDataset(x, x @ torch.randn(8, 1, generator=torch.Generator().manual_seed(1)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.body(batch[0]), batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(self.data, batch_size=16)


def test_a_healthy_pruned_run_is_neither_dead_nor_given_other_weights_at_its_end(tmp_path: Path) -> None:
    """Pruning masks both biases to 0, so their gradients are exactly 0 from then on: the summary said "the network
    died" (2 of its 4 tensors without gradient), then, as ModelPruning made the pruning permanent at the fit's end
    (the same weights under their old names), that "another callback put other weights into the model"."""
    runs = []
    for suite in ([], default_callbacks()):
        torch.manual_seed(0)
        model = PrunedTanh()
        trainer = fit(model, [*suite, ModelPruning("l1_unstructured", amount=0.3)], max_steps=-1, max_epochs=10,
                      default_root_dir=str(tmp_path))  # fmt: skip
        runs.append(model)
    assert [float(p.abs().sum()) == 0.0 for p in runs[1].parameters()] == [False, True, False, True]
    assert_bit_identical(weights(runs[1]), weights(runs[0]))
    kinds = [e.kind for e in board_for(trainer).journal.events]
    assert "ending" not in kinds and "weights_replaced" not in kinds


def test_a_trial_under_way_when_pruning_changes_the_layout_ends_with_the_run_as_it_is() -> None:
    """Scheduled trials (every 5 steps, 20 steps long) are under way when ModelPruning turns each weight into
    weight_orig and weight_mask at the first epoch's end (step 8), and when it prunes again at the second's (step 16):
    swapping the candidates of the old layout in raised ``KeyError: 'net.0.weight_orig'``; the candidate of the old
    masks, kept, brought back what the second pruning removed. Each trial ends there with the run as it is; the one
    under way at the fit's end is judged at its last batch (too few steps: the run as it is), before the pruning is
    made permanent. The run ends bit-identical to the bare run."""
    runs = []
    for suite in ([], default_callbacks(trial=TrialConfig(every_n_steps=5))):
        torch.manual_seed(0)
        trainer = fit(TinyRegressor(), [ModelPruning("l1_unstructured", amount=0.3), *suite], max_steps=-1,
                      max_epochs=3)  # fmt: skip
        runs.append(trainer)
    bare, suite_run = runs
    assert_bit_identical(weights(suite_run.lightning_module), weights(bare.lightning_module))
    trials = [e for e in board_for(suite_run).journal.events if e.kind == "trial"]
    ended = [(e.step, e.details["layout_change"].split(";")[0]) for e in trials if "layout_change" in e.details]
    assert ended == [(8, "without net.0.bias, net.0.weight, net.2.bias ..."),
                     (16, "pruned again (net.0.weight_mask, net.0.bias_mask, net.2.weight_mask ...)")]  # fmt: skip
    assert not any(e.details["kept"] for e in trials)


def test_a_model_pruned_at_a_validation_inside_the_epoch_is_snapshot_again_at_the_next_batch() -> None:
    """``ModelPruning(prune_on_train_epoch_end=False)`` prunes when validation ends: at step 4, inside the epoch
    (``val_check_interval=0.5``, eight batches an epoch). The NaN weight of step 5 found the snapshots of steps 0 and
    3 of the old layout only, and ended the fit in ``RollbackError``; the state is snapshot at the next batch now, and
    goes back there."""
    for pruning_first in (True, False):
        rollback = Rollback(every_n_steps=3)
        pruning = ModelPruning("l1_unstructured", amount=0.3, prune_on_train_epoch_end=False)
        order = [pruning, NonFiniteDetector(), rollback] if pruning_first else [NonFiniteDetector(), rollback, pruning]
        probe = AverageProbe(None)
        torch.manual_seed(0)
        trainer = fit(TinyRegressor(), [*order, probe, nan_weight_at(5)], max_steps=12, val_check_interval=0.5,
                      limit_val_batches=1)  # fmt: skip
        assert [(h["step"], h["snapshot_step"]) for h in rollback.history] == [(6, 4)]
        assert "net.0.weight_orig" in probe.at[6]["weights"] and all_finite(weights(trainer.lightning_module))


class PruneAt(Callback):
    """Prunes the first layer at the end of one step, inside an epoch: no epoch boundary sees the new layout."""

    def __init__(self, step: int) -> None:
        self.step = step

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        if trainer.global_step == self.step:
            prune.l1_unstructured(pl_module.net[0], "weight", amount=0.3)


class WeightNormAt(PruneAt):
    """Reparametrizes the first layer with weight_norm at the end of one step: its ``original0`` and ``original1``
    are new parameters, another representation of the weight, which no earlier snapshot holds."""

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        if trainer.global_step == self.step:
            torch.nn.utils.parametrizations.weight_norm(pl_module.net[0])


def test_pruning_inside_an_epoch_rolls_back_to_a_snapshot_from_before_it() -> None:
    """Pruned at step 4, inside the epoch: no epoch boundary carried the snapshots of steps 0 and 3 into the new
    layout, and the NaN weight of step 5 ended the fit in RollbackError (both dropped as unfit). They are carried
    when a restore needs them: step 3's weights come back as ``weight_orig``, the pruning's mask kept."""
    rollback = Rollback(every_n_steps=3)
    probe = AverageProbe(None)
    trainer = fit(TinyRegressor(), [NonFiniteDetector(), rollback, PruneAt(4), probe, nan_weight_at(5)], max_steps=8)
    assert [(h["step"], h["snapshot_step"]) for h in rollback.history] == [(6, 3)]
    restored = probe.at[6]["weights"]
    assert torch.equal(restored["net.0.weight_orig"], probe.at[3]["weights"]["net.0.weight"])
    assert torch.equal(restored["net.0.weight_mask"], probe.at[4]["weights"]["net.0.weight_mask"])
    assert all_finite(weights(trainer.lightning_module))


def test_no_snapshot_left_that_fits_says_why_it_is_missing() -> None:
    # weight_norm at step 4 (the first layer's weight is now parametrizations.weight.original0 and original1), a NaN
    # at step 5: the snapshots of steps 0 and 3 hold net.0.weight.
    rollback = Rollback(every_n_steps=3)
    with pytest.raises(RollbackError) as info:
        fit(TinyRegressor(), [NonFiniteDetector(), rollback, WeightNormAt(4), nan_weight_at(5)], max_steps=12)
    assert str(info.value).startswith(
        "Rollback: a rollback was needed at step 6 (nonfinite_state at step 5: NonFiniteDetector: the weights "
        "contained inf/NaN in net.0.bias at step 5 (epoch 0) on rank(s) 0.) but no snapshot verified finite "
        "is left: 2 could not be used in this fit (the journal's snapshot_unusable says why). Nothing was restored."
    )


class Finetuned(pl.LightningModule):
    """A backbone that ``BackboneFinetuning`` unfreezes at epoch 2 (step 16), adding its param group then."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh())
        self.head = torch.nn.Linear(16, 1)
        self.data = TinyRegressor().data

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.head(self.backbone(x)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=0.01)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(self.data, batch_size=8)


class RatesUsed(Callback):
    """The rates each optimizer step used, by step (a step post-hook)."""

    def __init__(self) -> None:
        self.used: dict[int, list[float]] = {}

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.optimizers[0].register_step_post_hook(
            lambda optimizer, *_: self.used.__setitem__(trainer.global_step, [g["lr"] for g in optimizer.param_groups])
        )


def test_a_param_group_added_since_the_snapshot_keeps_the_backoff_once_across_a_rollback() -> None:
    """The backbone's group, added at step 16, kept its live rate through the rollback to step 15's snapshot (one
    group then), already halved by the backoff; the ratio that brings the restored state to the backed-off scale
    halved it again: 0.25x the bare run's until BackboneFinetuning next wrote it."""
    runs = []
    for suite in ([], [*default_callbacks(snapshot_every_n_steps=5), nan_weight_at(18)]):
        torch.manual_seed(0)
        rates = RatesUsed()
        finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=2, lambda_func=lambda epoch: 1.5, verbose=False)
        fit(Finetuned(), [finetuning, rates, *suite], max_steps=-1, max_epochs=3)
        runs.append(rates.used)
    bare, suite_rates = runs
    assert all(bare[step] == [0.01, 0.001] for step in range(17, 24))
    assert all(suite_rates[step] == [0.005, 0.0005] for step in range(19, 24))


@pytest.mark.parametrize(
    ("fault_step", "initial"), [(10, None), (18, None), (10, 0.001)],
    ids=["backoff_before_the_unfreeze", "backoff_after_it", "before_the_unfreeze_at_a_rate_given"],
)
def test_backbone_finetuning_follows_the_backoff_through_every_epoch_and_its_alignment(
    fault_step: int, initial: float | None
) -> None:
    """BackboneFinetuning derives each epoch's backbone rate from the one it remembers, and aligns it with the first
    group's live rate. A backoff before the unfreeze gave it a memory already at the scale, which the suite scaled
    again as a rate written by the module: 0.25x the bare run's from the next epoch; after the unfreeze, its memory
    stayed at the bare rate, and the alignment came an epoch early. Both groups now run at 0.5x the bare run's at
    every step after the backoff, and align when the bare run does (step 64). A ``backbone_initial_lr`` given is the
    bare run's rate, brought to the scale when the group is added (it stayed at 1x for good, once its next rates
    were taken for derived ones)."""
    runs = []
    for suite in ([], [*default_callbacks(snapshot_every_n_steps=5), nan_weight_at(fault_step)]):
        torch.manual_seed(0)
        rates = RatesUsed()
        finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=2, lambda_func=lambda epoch: 1.5, verbose=False,
                                        backbone_initial_lr=initial)  # fmt: skip
        fit(Finetuned(), [finetuning, rates, *suite], max_steps=-1, max_epochs=9)
        runs.append(rates.used)
    bare, suite_rates = runs
    assert bare[63][1] < bare[63][0] and bare[64] == [0.01, 0.01]
    for step in range(fault_step + 2, 72):
        assert suite_rates[step] == pytest.approx([rate * 0.5 for rate in bare[step]], rel=1e-12), step


def test_only_a_tensor_pruning_masks_out_whole_is_left_out_of_a_dead_network() -> None:
    """A pruned tensor whose mask still keeps some values can die like any other (its kept units then pass nothing
    back): it counts. One whose mask holds nothing has no gradient by design: it does not."""
    layer = torch.nn.Linear(4, 2)
    prune.l1_unstructured(layer, "weight", amount=0.5)
    prune.l1_unstructured(layer, "bias", amount=2)
    assert pruned_away(layer) == {id(layer.bias_orig)}


def test_a_rollback_keeps_the_pruning_done_since_its_snapshot() -> None:
    """ModelPruning prunes again at step 16 in the same layout; the NaN weight of step 18 goes back to the snapshot
    of step 14, whose masks are the first pruning's: the rollback undid the second (the pruned share fell back)."""
    rollback = Rollback(every_n_steps=6)
    probe = AverageProbe(None)
    pruning = ModelPruning("l1_unstructured", amount=0.3, make_pruning_permanent=False)
    fit(TinyRegressor(), [pruning, NonFiniteDetector(), rollback, probe, nan_weight_at(18)], max_steps=20)
    assert [(h["step"], h["snapshot_step"]) for h in rollback.history] == [(19, 14)]
    before, after = probe.at[17]["weights"], probe.at[19]["weights"]
    assert not torch.equal(probe.at[14]["weights"]["net.0.weight_mask"], before["net.0.weight_mask"])
    for name in ("net.0.weight_mask", "net.2.weight_mask"):
        assert torch.equal(after[name], before[name])
