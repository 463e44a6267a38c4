"""Every ending is told (finished, stopped, raised), and an error carries the diagnosis the suite already made: an
InfoNCE whose raw ``exp`` overflows on every step (SwaV's Sinkhorn at a tiny epsilon does the same) names ``exp``,
``torch.logsumexp`` and where, and advice names only what the Trainer lacks."""

from __future__ import annotations

import logging
import statistics
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import fit
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_overflow import DivergenceError, LRBackoff, NonFiniteDetector, default_callbacks, read_journal
from lightning_overflow.callbacks._base import DETECTOR, SuiteCallback
from lightning_overflow.health import StepHealth, board_for
from lightning_overflow.policy import StepAction
from lightning_overflow.testing import TinyRegressor

_SUMMARY = "lightning_overflow: what happened in this fit"


class _OverflowingContrast(pl.LightningModule):
    """Embeddings matched by a raw ``exp(sim / tau)`` at a temperature so low that it overflows from the first step."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.data = TensorDataset(torch.randn(256, 8, generator=torch.Generator().manual_seed(0)) * 3)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        (x,) = batch
        a, b = self.encoder(x), self.encoder(x + 0.01)
        sim = a @ b.T / 1e-3
        return -torch.log(torch.exp(sim.diagonal()) / torch.exp(sim).sum(dim=1)).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=16)


def test_the_skip_budgets_error_names_the_op_its_fix_and_only_the_missing_callbacks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="lightning_overflow"):
        with pytest.raises(DivergenceError) as caught:
            fit(_OverflowingContrast(), [NonFiniteDetector()], max_steps=60)
    message = str(caught.value)
    assert message.startswith("NonFiniteDetector: 11 of the last 20 optimizer steps were skipped, the last at step 10")
    assert (
        "Diagnosis: the first non-finite value appeared in the forward pass in training_step (outside every "
        "module), op exp"
    ) in message
    hint = message.split("HINT: ", 1)[1]
    assert hint.startswith("exp() overflows FP32 above 88.7: compute the log of a sum of exponentials with "
                           "torch.logsumexp")  # fmt: skip
    assert "clip the gradients (AutoClip), add LRBackoff and Rollback (default_callbacks())" in hint
    summaries = [r.getMessage() for r in caplog.records if r.getMessage().startswith(_SUMMARY)]
    assert len(summaries) == 1  # the fit raised, and still ends with its summary
    assert "torch.logsumexp" in summaries[0]


def test_the_full_suite_stops_with_the_diagnosis_and_names_no_callback_it_has(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="lightning_overflow"):
        with pytest.raises(DivergenceError) as caught:
            fit(_OverflowingContrast(), default_callbacks(), max_steps=400)
    message = str(caught.value)
    hint = message.split("HINT: ", 1)[1]
    assert "torch.logsumexp" in hint
    for present in ("AutoClip", "add LRBackoff", "add Rollback"):
        assert present not in hint.split("; Rollback's own settings")[0]
    assert " on rank 0 (every rank stops together)" in message
    assert len([r for r in caplog.records if r.getMessage().startswith(_SUMMARY)]) == 1


class _LostItsBest(pl.LightningModule):
    """A loss of 1 for 60 steps, then ``after`` for good (a weight whose gradient is 0 carries it): a run that ends far
    above its best whatever the suite does, with losses known exactly."""

    def __init__(self, after: float) -> None:
        super().__init__()
        self.after = after
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        value = 1.0 if self.trainer.global_step < 60 else self.after
        return value + 0.0 * self.layer(batch[0]).sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(64, 4, generator=torch.Generator().manual_seed(0))), batch_size=8)


@pytest.mark.parametrize(("after", "ratio"), [(10.0, "10x"), (1e6, "1e6x")])
def test_a_run_the_full_suite_keeps_finite_but_far_above_its_best_says_so_at_its_end(
    caplog: pytest.LogCaptureFixture, tmp_path: Any, after: float, ratio: str
) -> None:
    with caplog.at_level(logging.INFO, logger="lightning_overflow"):
        fit(_LostItsBest(after), default_callbacks(), max_steps=200, default_root_dir=tmp_path)
    (summary,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith(_SUMMARY)]
    (line,) = [line for line in summary.splitlines() if "the training loss ended" in line]
    assert line.startswith(f"  - the training loss ended {ratio} above its best (median {after:g}".replace("e+0", "e"))
    assert line.endswith(": look at the loss curve before using these weights; if the data did not change, try a lower "
                         "learning rate")  # fmt: skip
    from lightning_overflow import read_journal

    (ending,) = [e for e in read_journal(tmp_path) if e["kind"] == "ending"]
    assert (ending["details"]["against"], ending["details"]["best"], ending["details"]["last"]) == ("best", 1.0, after)



class _RecurrentDrawnLarge(pl.LightningModule):
    """A tanh RNN over 48 steps whose recurrent matrix is orthogonal times ``gain``, SGD: at 2.5 its first gradient
    norm is about 1,000x those of the steps after it (its first update saturates the state), at 1 about 1.7x."""

    def __init__(self, gain: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn, self.head = nn.RNN(2, 16, batch_first=True), nn.Linear(16, 1)
        with torch.no_grad():
            nn.init.orthogonal_(self.rnn.weight_hh_l0)
            self.rnn.weight_hh_l0.mul_(gain)
        gen = torch.Generator().manual_seed(0)
        x, y = torch.randn(256, 48, 2, generator=gen), 0.1 * torch.randn(256, 48, 1, generator=gen)
        y[:, 2:, 0] += x[:, :-2, 0]  # the first feature of two steps before
        self.data = TensorDataset(x, y)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(self.rnn(x)[0]), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=32)


@pytest.mark.parametrize("gain", [2.5, 1.0])
def test_a_fit_whose_first_gradients_were_out_of_scale_says_so_at_its_end(
    caplog: pytest.LogCaptureFixture, tmp_path: Any, gain: float
) -> None:
    """No rule acts on the first step (nothing is known of a normal one yet), and the loss ends neither far above its
    best nor its start: the end still says that the model was drawn out of scale. Drawn right, nothing is said."""
    with caplog.at_level(logging.INFO, logger="lightning_overflow"):
        fit(_RecurrentDrawnLarge(gain), default_callbacks(), max_steps=40, default_root_dir=tmp_path)
    endings = [e for e in read_journal(tmp_path) if e["kind"] == "ending"] if (tmp_path / "overflow_events.jsonl"
                                                                               ).exists() else []  # fmt: skip
    if gain == 1.0:
        assert endings == []
        return
    (ending,) = endings
    details = ending["details"]
    assert details["norm_steps"] == 24 and details["scale_ratio"] == details["start_norm"] / details["typical_norm"]
    assert details["scale_ratio"] > 500
    (summary,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith(_SUMMARY)]
    (line,) = [line for line in summary.splitlines() if "first step" in line]
    assert line.startswith(f"  - the fit's first step had a gradient norm of {details['start_norm']:.4g}, ")
    assert line.endswith(
        "the model was drawn out of scale (a recurrent matrix, or layers, drawn too large), or its first updates grew "
        "the weights of normalised layers, whose gradients shrink as they grow (a learning rate too high). A run that "
        "starts so can end far above what the same model drawn right reaches: compare its loss with such a run's, and "
        "draw the weights smaller (std = gain / sqrt(fan_in); an orthogonal recurrent matrix of gain 1), or lower the "
        "learning rate or warm it up"
    )


class _SolvedByLBFGS(pl.LightningModule):
    """A noise-free linear regression under LBFGS: its first step solves it, and its gradients fall 10,000x."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 1)
        x = torch.randn(256, 4, generator=torch.Generator().manual_seed(0))
        self.data = TensorDataset(x, x @ torch.tensor([[1.0], [2.0], [-1.0], [0.5]]) + 3)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.linear(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.LBFGS(self.parameters(), lr=1, max_iter=20)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=256)


def test_a_problem_solved_in_its_first_step_is_not_a_model_out_of_scale(tmp_path: Any) -> None:
    trainer = fit(_SolvedByLBFGS(), default_callbacks(), max_steps=30, default_root_dir=tmp_path)
    ending = board_for(trainer).ending
    assert len(ending.start_norms) == 25  # one norm a step, though LBFGS evaluates its closure up to 20 times
    assert ending.start_norms[0] > 1e4 * statistics.median(ending.start_norms[1:])
    assert not (tmp_path / "overflow_events.jsonl").exists()  # nothing journaled: no ending


class _JournaledSuspect(SuiteCallback):
    """A detector that suspects the loss at exact steps and journals it, as LossSpikeDetector does."""

    stage = DETECTOR

    def __init__(self, *steps: int) -> None:
        self.steps = set(steps)

    @property
    def state_key(self) -> str:
        return "JournaledSuspect"

    def _after_step(self, trainer: pl.Trainer, record: StepHealth, action: StepAction) -> None:
        if record.step in self.steps:
            self._signal(trainer, "loss_divergence", f"suspected at step {record.step}", onset=record.step)
            self._event(trainer, "loss_divergence", f"suspected at step {record.step}", step=record.step)


def test_suspicions_left_alone_at_the_learning_rate_floor_are_journaled_at_the_end(tmp_path: Any) -> None:
    backoff = LRBackoff(trial=None, min_scale=0.25, cooldown=0)
    suspect = _JournaledSuspect(*range(10, 200, 5))  # acted on at once (no trials), paced as false alarms are
    fit(TinyRegressor(), [suspect, backoff], max_steps=200, default_root_dir=str(tmp_path))
    journal = list(read_journal(tmp_path / "overflow_events.jsonl"))
    backoffs = [(e["step"], e["details"]["scale"], e["details"]["floor"]) for e in journal if e["kind"] == "backoff"]
    assert backoffs == [(10, 0.5, 0.25), (50, 0.25, 0.25)]
    (alone,) = [e for e in journal if e["kind"] == "left_alone"]
    assert alone["step"] == 200 and alone["details"]["why"] == "lr_floor"
    assert alone["details"]["scale"] == 0.25 and alone["details"]["floor"] == 0.25
    assert alone["details"]["steps"] == [s for s in range(55, 200, 5)]
    assert alone["message"].endswith(
        "(the loss rose far above its best and stayed there): the learning rate was already at its floor (0.25x its "
        "schedule), the lowest LRBackoff may set; try starting at a lower learning rate"
    )


def test_a_fit_that_ends_soon_after_a_kept_remedy_is_judged_on_the_remedy(tmp_path: Any) -> None:
    """A trial keeps its remedy (the snapshot before the fault, at half the rate) at step 53, and the fit ends at 70,
    within a block of it: the losses of the run it replaced (about 1000, steps 33-52) no longer stand for the run's.
    They used to: "the training loss ended 432x above its best", of weights that end at 0.09."""
    from lightning_overflow.testing import Fault, FaultInjector

    pl.seed_everything(0, verbose=False)
    model = TinyRegressor(n_samples=256)
    fault = FaultInjector(Fault(30, "scale_weight", parameter="net.2.weight", factor=30.0))
    trainer = fit(model, [*default_callbacks(snapshot_every_n_steps=10), fault], max_steps=70,
                  default_root_dir=tmp_path)  # fmt: skip
    events = board_for(trainer).journal.events
    kept = [e.step for e in events if e.kind == "trial" and e.details["kept"]]
    assert kept == [53] and not [e for e in events if e.kind == "ending"]
    x, y = model.data.tensors
    with torch.no_grad():
        assert nn.functional.mse_loss(model(x), y).item() < 0.2
