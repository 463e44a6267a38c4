"""What ``training_step`` writes beside the tensors stays the run's own: a trial's candidate and a diagnosis replay run
the user's ``training_step`` on the user's module, and leave its lists, counters, dicts, deques, plain tensors and
EMA teacher as the run's own steps left them (the neuralforecast defect: ``train_trajectories`` held 420 entries after
300 steps with trials). :func:`side_run` tells user code which run it is in.
"""

from __future__ import annotations

import copy
from collections import deque
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import MemoryLogger, assert_bit_identical, fit, weights
from test_trials import Sabotaged, Suspect
from torch import nn

from lightning_overflow import (
    LRBackoff, NonFiniteDetector, NonFiniteError, Rollback, TrialConfig, read_journal, side_run,
)
from lightning_overflow.preserve import capture_attributes, preserved_state, put_back_attributes, running_aside
from lightning_overflow.testing import Fault, FaultInjector, TinyRegressor


class Calls:
    """An object of the user's own class: shared by every run (the suite does not copy it), so it sees every call."""

    def __init__(self) -> None:
        self.seen: list[tuple[str | None, float, list[float]]] = []  # (side_run(), loss, the deque before the step)
        self.beta: list[tuple[str | None, float]] = []  # (side_run(), the weight a callback set)


class Recorder(TinyRegressor):
    """A ``training_step`` with every kind of side effect: a list of losses, a counter, a dict holding a list, a
    deque, a plain tensor written in place, and an EMA teacher (a submodule) updated under ``no_grad``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.losses: list[float] = []
        self.steps = 0
        self.stats: dict[str, Any] = {"sum": 0.0, "batches": []}
        self.recent: deque[float] = deque(maxlen=3)
        self.queue = torch.zeros(4)  # not a buffer: a plain tensor attribute
        self.teacher = copy.deepcopy(self.net).requires_grad_(False)
        self.calls = Calls()
        self.beta = 0.0  # a setting rebound outside training_step (on_train_batch_end), read by it

    def on_train_batch_end(self, *_: Any) -> None:
        self.beta = self.trainer.global_step / 100  # a setting rebound from outside training_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        value = float(loss.detach())
        self.calls.seen.append((side_run(), value, list(self.recent)))
        self.calls.beta.append((side_run(), self.beta))
        self.losses.append(value)
        self.steps += 1
        self.stats["sum"] += value
        self.stats["batches"].append(batch_idx)
        self.recent.append(value)
        self.queue[self.steps % 4] = loss.detach()
        with torch.no_grad():
            for t, s in zip(self.teacher.parameters(), self.net.parameters()):
                t.mul_(0.9).add_(s, alpha=0.1)
        return loss


class Returned(pl.Callback):
    """The loss the loop's own ``training_step`` returned, batch by batch."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *_: Any) -> None:
        self.losses.append(float(outputs["loss"]))


def python_state(model: Recorder) -> dict[str, Any]:
    return {
        "losses": list(model.losses),
        "steps": model.steps,
        "stats": copy.deepcopy(model.stats),
        "recent": list(model.recent),
        "queue": model.queue.clone(),
    }


def assert_same_python_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert torch.equal(a.pop("queue"), b.pop("queue"))
    assert a == b


# ---- trials ---------------------------------------------------------------------------------------------------------
def test_a_trial_leaves_the_runs_attributes_as_a_run_without_the_suite_leaves_them() -> None:
    """The false alarm of ``test_trials``: two remedies train 20 batches each beside the run. The run's list, counter,
    dict, deque, plain tensor and EMA teacher end exactly as in the bare run: one entry per batch the run trained,
    each the loss the loop returned."""
    torch.manual_seed(0)
    bare = Recorder(dropout=0.2)
    fit(bare, [], max_steps=80)
    torch.manual_seed(0)
    model, returned = Recorder(dropout=0.2), Returned()
    queue, batches = model.queue, model.stats["batches"]
    fit(model, [Suspect(30), LRBackoff(), Rollback(every_n_steps=10), returned], max_steps=80)

    assert len(model.losses) == 80 and model.steps == 80
    assert model.losses == returned.losses == bare.losses
    assert_same_python_state(python_state(model), python_state(bare))
    assert model.stats["batches"] == list(range(8)) * 10
    assert model.queue is queue and model.stats["batches"] is batches  # put back in place
    assert_bit_identical(weights(model), weights(bare))  # the teacher too: it is a submodule
    # side_run(): None for the run's own 80 steps, "trial" for each remedy's 20 (before the loop's, every batch).
    kinds = [kind for kind, _, _ in model.calls.seen]
    assert kinds == [None] * 31 + ["trial", "trial", None] * 20 + [None] * 29


class Banked(TinyRegressor):
    """A memory bank as modules write one: a buffer registered empty (``None``) and filled on first use, from step 35,
    inside the trial; and a buffer registered in the middle of the fit, at step 40."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.register_buffer("bank", None)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        if self.trainer.global_step >= 35:
            self.bank = x[:2].detach() if self.bank is None else torch.cat([self.bank, x[:2].detach()])[-6:]
        if self.trainer.global_step >= 40 and not hasattr(self, "seen"):
            self.register_buffer("seen", torch.zeros(1))
        if hasattr(self, "seen"):
            self.seen += 1
        return super().training_step(batch, batch_idx)


def test_a_buffer_filled_or_registered_during_a_trial_is_each_branchs_own() -> None:
    """The candidates were captured when the bank was still empty and ``seen`` did not exist: swapping them in
    raised ``KeyError: 'bank'``. Each branch now fills its own; the run ends as the bare run does, bit for bit."""
    torch.manual_seed(0)
    bare = Banked(dropout=0.2)
    fit(bare, [], max_steps=80)
    torch.manual_seed(0)
    model = Banked(dropout=0.2)
    fit(model, [Suspect(30), LRBackoff(), Rollback(every_n_steps=10)], max_steps=80)
    assert model.bank.shape == (6, 4) and torch.equal(model.bank, bare.bank)
    assert float(model.seen) == float(bare.seen) == 40.0
    assert_bit_identical(weights(model), weights(bare))


class SharedScale(TinyRegressor):
    """One buffer in two submodules' slots; at step 35, inside the trial, one slot is given a tensor of its own (an
    ordinary buffer assignment), and it is updated in place from then on."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.enc, self.dec = nn.Module(), nn.Module()
        scale = torch.ones(4)
        self.enc.register_buffer("scale", scale)
        self.dec.register_buffer("scale", scale)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.trainer.global_step == 35:
            self.enc.scale = self.enc.scale * 1.0
        if self.trainer.global_step > 35:
            self.enc.scale.mul_(0.999)
        return super().training_step((x * self.enc.scale * self.dec.scale, y), batch_idx)


def _without_and_with_a_false_alarm(make: Any, suspected_at: int, max_steps: int) -> list[Any]:
    """The module ``make()`` builds, fitted bare and with a suspicion at ``suspected_at`` that a healthy run's trial
    finds false (the remedies from the snapshot every 10 steps), from the same seed."""
    models = []
    for suite in ([], [Suspect(suspected_at), LRBackoff(), Rollback(every_n_steps=10)]):
        torch.manual_seed(0)
        model = make()
        fit(model, suite, max_steps=max_steps)
        models.append(model)
    return models


def _the_data_fault(tmp_path: Any) -> tuple[int, str, list[int]]:
    """The step, the words and the rows of the fit's one data fault, from its journal."""
    (fault,) = [e for e in read_journal(tmp_path / "overflow_events.jsonl") if e["kind"] == "data_fault"]
    return fault["step"], fault["details"]["data"], fault["details"]["rows"]


def test_a_shared_buffer_one_slot_of_which_is_reassigned_during_a_trial_stays_in_both_slots() -> None:
    """The candidates were captured with the shared tensor under one of its names only: once the other slot held
    a tensor of its own, it looked registered since, and swapping the run back deleted it (``AttributeError`` at
    the run's next step). Every slot is the run's own again, and the run ends as the bare run does."""
    bare, model = _without_and_with_a_false_alarm(lambda: SharedScale(dropout=0.2), 30, max_steps=80)
    assert [name for name, _ in model.named_buffers()] == ["enc.scale", "dec.scale"]
    assert_bit_identical(weights(model), weights(bare))


def test_a_candidate_keeps_its_own_side_effects_for_its_next_steps() -> None:
    """Each remedy sees, in its ``training_step``, the deque its own previous steps filled, not the run's."""
    torch.manual_seed(0)
    model = Recorder(dropout=0.2)
    fit(model, [Suspect(30), LRBackoff(), Rollback(every_n_steps=10)], max_steps=80)
    trial = model.calls.seen[31:91]
    remedies = [trial[0::3], trial[1::3]]
    run = trial[2::3]
    assert all(kind == "trial" for side in remedies for kind, _, _ in side) and {k for k, _, _ in run} == {None}
    run_before = model.calls.seen[28:31]
    for side in remedies:
        # Its first step starts from the run's attributes; then its own losses fill its deque.
        assert side[0][2] == [v for _, v, _ in run_before]
        for k in range(1, 20):
            own = [v for _, v, _ in side[max(0, k - 3):k]]
            expected = ([v for _, v, _ in run_before] + own)[-3:]
            assert side[k][2] == expected
    assert side[5][2] != run[5][2]  # the run's deque is its own
    for k in range(1, 20):
        assert run[k][2] == ([v for _, v, _ in run_before] + [v for _, v, _ in run[:k]])[-3:]
    # A setting rebound from outside training_step (here the module's own hook) is the run's, for every candidate.
    betas = model.calls.beta[31:91]
    assert [b for _, b in betas] == [step / 100 for step in range(31, 51) for _ in range(3)]


def test_a_kept_remedy_leaves_the_run_one_entry_per_batch_it_trained() -> None:
    """The sabotaged run: a remedy wins and takes over the weights; the run's list still holds one entry per batch
    the loop trained, each the loss it returned."""
    model, returned = Sabotaged(), Returned()
    model.losses = []
    original = model.training_step

    def training_step(batch: Any, batch_idx: int) -> torch.Tensor:
        loss = original(batch, batch_idx)
        model.losses.append(float(loss))
        return loss

    model.training_step = training_step  # type: ignore[method-assign]
    trial = TrialConfig(remedies=1)
    suite = [Suspect(31), LRBackoff(trial=trial), Rollback(every_n_steps=10, trial=trial)]
    fit(model, [*suite, returned], max_steps=80)
    assert [h["step"] for h in suite[-1].history] == [52]  # the remedy was kept at step 52
    assert model.losses == returned.losses and len(model.losses) == 80


def test_a_frozen_trial_leaves_one_entry_per_batch_the_loop_trained() -> None:
    model, returned = Recorder(), Returned()
    trial = TrialConfig(mode="frozen", steps=10)
    fit(model, [Suspect(30), LRBackoff(trial=trial), Rollback(every_n_steps=10, trial=trial), returned], max_steps=60)
    assert model.losses == returned.losses and model.steps == 60 and len(model.stats["batches"]) == 60
    assert [kind for kind, _, _ in model.calls.seen].count("trial") == 10


# ---- the diagnosis replay -------------------------------------------------------------------------------------------
def test_a_replay_leaves_no_trace_on_the_modules_attributes() -> None:
    """A NaN loss at step 3: the detector replays the batch (``training_step`` runs a fifth time), then raises. The
    module holds the four steps the run ran, as they were."""
    model, returned = Recorder(), Returned()
    with pytest.raises(NonFiniteError) as info:
        fit(model, [NonFiniteDetector(action="raise"), FaultInjector(Fault(3, "nan_loss")), returned], max_steps=6)
    assert info.value.diagnosis.replayed
    assert [kind for kind, _, _ in model.calls.seen] == [None] * 4 + ["replay"]
    assert len(model.losses) == 4 and model.steps == 4 and model.stats["batches"] == [0, 1, 2, 3]
    assert model.losses == [v for _, v, _ in model.calls.seen[:4]]
    assert model.losses[:3] == returned.losses  # the fourth returned NaN (the fault), then the detector raised


def test_a_skipped_step_and_its_replay_leave_one_entry_per_batch() -> None:
    model, returned = Recorder(), Returned()
    fit(model, [NonFiniteDetector(), FaultInjector(Fault(3, "nan_loss")), returned], max_steps=8)
    assert [kind for kind, _, _ in model.calls.seen].count("replay") == 1
    assert len(model.losses) == 8 and model.steps == 8 and model.stats["batches"] == list(range(8))


# ---- the capture and put-back, piece by piece ---------------------------------------------------------------------
class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.items = [1, [2, 3]]
        self.table: dict[str, Any] = {"a": 1, "nested": {"b": [4]}}
        self.tags = {"x"}
        self.recent: deque[int] = deque([1, 2], maxlen=2)
        self.raw = bytearray(b"ab")
        self.count, self.name, self.pair = 0, "n", (1, 2)
        self.plain = torch.zeros(3)
        self.shared = Calls()
        self.child = nn.Linear(2, 2)
        self.gen = torch.Generator().manual_seed(0)


def test_put_back_restores_contents_in_place_and_references_and_removes_what_was_added() -> None:
    m = Holder()
    inner, nested, plain = m.items[1], m.table["nested"], m.plain
    kept = capture_attributes(m)
    outer = m.items
    m.items.append(9)
    inner.append(9)
    nested["b"].append(5)
    m.table["c"] = 3
    m.tags.add("y")
    m.recent.append(3)
    m.raw += b"c"
    m.count, m.name, m.pair = 1, "m", (3,)
    m.plain.add_(1.0)
    m.plain = torch.ones(1)  # rebound too: the old tensor comes back, with its old values
    m.shared.seen.append((None, 0.0, []))
    m.added = [1]
    del m.table["a"]
    m.items = ["rebound"]
    put_back_attributes(kept)
    assert m.items is outer and m.items == [1, [2, 3]] and m.items[1] is inner
    assert m.table == {"a": 1, "nested": {"b": [4]}} and m.table["nested"] is nested
    assert m.tags == {"x"} and list(m.recent) == [1, 2] and m.recent.maxlen == 2 and m.raw == bytearray(b"ab")
    assert (m.count, m.name, m.pair) == (0, "n", (1, 2))
    assert m.plain is plain and torch.equal(plain, torch.zeros(3))
    assert not hasattr(m, "added")
    assert len(m.shared.seen) == 1  # an object of another class is shared: documented


def test_only_the_users_own_attributes_are_kept() -> None:
    """Of a fitted LightningModule: the attributes its class set, none of Lightning's (the trainer, the hook dicts,
    ``hparams``), no submodule, no generator; library submodules (Linear, Sequential) are not walked."""
    model = Holder()
    kept = dict((type(sub).__name__, set(names)) for sub, names in capture_attributes(model).modules)
    assert kept == {"Holder": {"items", "table", "tags", "recent", "raw", "count", "name", "pair", "plain", "shared"}}
    fitted = TinyRegressor()
    fitted.save_hyperparameters({"lr": 0.01})
    fit(fitted, [], max_steps=2)
    modules = capture_attributes(fitted).modules
    assert [(type(sub), set(names)) for sub, names in modules] == [
        (TinyRegressor, {"lr", "optimizer_name", "scheduler_factory", "batch_size", "data"})
    ]


def test_nothing_is_captured_for_a_module_of_library_classes() -> None:
    assert capture_attributes(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))).modules == ()


def test_a_replay_context_puts_the_attributes_back_and_names_itself() -> None:
    m = Holder()
    assert side_run() is None
    with preserved_state(m):
        assert side_run() == "replay"
        m.items.append(4)
        m.count += 1
        with running_aside("trial"):
            assert side_run() == "trial"
        assert side_run() == "replay"
    assert side_run() is None and m.items == [1, [2, 3]] and m.count == 0


def test_a_tensor_attribute_too_large_to_copy_is_not_copied_and_a_write_into_it_is_said(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import lightning_overflow.preserve as preserve
    from lightning_overflow import OverflowWarning

    monkeypatch.setattr(preserve, "_CLONE_LIMIT", 16)  # bytes: 4 float32 values

    class Holder(nn.Module):
        pass

    module = Holder()
    module.small, module.large, module.untouched = torch.zeros(4), torch.zeros(8), torch.zeros(8)
    kept = capture_attributes(module)
    assert [saved.clone is None for saved in (kept.modules[0][1][n] for n in ("small", "large", "untouched"))] == [
        False, True, True
    ]
    module.small += 1
    module.large += 1
    with pytest.warns(OverflowWarning, match=r"wrote in place into a tensor attribute of 0 MiB, too large to copy"):
        put_back_attributes(kept)
    assert module.small.tolist() == [0.0] * 4  # put back
    assert module.large.tolist() == [1.0] * 8  # said, not undone
    assert module.untouched._version == 0  # never written: nothing done to it


class WritesItsOwnLogs(TinyRegressor):
    """Writes its own logs from training_step, through the logger's API and its experiment object."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.logger.log_metrics({"mine": float(loss.detach())}, step=self.global_step)
        self.logger.experiment.append(("mine", self.global_step))
        return loss


class ListExperimentLogger(MemoryLogger):
    """Keeps what it is given: ``log_metrics`` calls, and whatever the module appends to its ``experiment``."""

    def __init__(self) -> None:
        super().__init__()
        self._experiment: list[Any] = []

    @property
    def experiment(self) -> list[Any]:
        return self._experiment


def test_a_trial_writes_nothing_into_the_logs_a_module_writes_itself(tmp_path: Any) -> None:
    torch.manual_seed(0)
    logger = ListExperimentLogger()
    suite = [Suspect(31), LRBackoff(trial=TrialConfig()), Rollback(every_n_steps=10, trial=TrialConfig())]
    fit(WritesItsOwnLogs(), suite, max_steps=60, logger=logger, default_root_dir=tmp_path)
    assert [step for _, step in logger.experiment] == list(range(60))  # one entry per step of the run, none twice
    mine = [step for step, _ in logger.metrics["mine"]]
    assert mine == list(range(60))


class WritesIntoItsBatch(TinyRegressor):
    """A ``training_step`` that puts its prediction into its input dict, over the target it reads, as schnetpack's
    models do (``inputs.update(results)``)."""

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader([{"x": x, "y": y} for x, y in self.data], batch_size=self.batch_size)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        target = batch["y"]
        batch["y"] = self(batch["x"])
        return nn.functional.mse_loss(batch["y"], target)


def test_a_trial_and_a_diagnosis_read_the_batch_as_the_loader_gave_it_when_the_model_writes_into_it(
    tmp_path: Any,
) -> None:
    """The first candidate's prediction, graph and all, became the next candidate's target and the loop's: the loop's
    backward ran through the candidate's freed graph (``RuntimeError: Trying to backward through the graph a second
    time``) at the trial's first step. A false alarm now leaves the run bit-identical to the run without the suite;
    and a NaN target is named a data fault, where the words read the prediction written over it."""
    bare, tried = _without_and_with_a_false_alarm(WritesIntoItsBatch, 20, max_steps=48)
    assert_bit_identical(weights(bare), weights(tried))

    class NaNTarget(WritesIntoItsBatch):
        def on_train_batch_start(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
            if self.trainer.global_step == 5:
                batch["y"][2] = float("nan")

    fit(NaNTarget(), [NonFiniteDetector()], max_steps=8, default_root_dir=str(tmp_path))
    assert _the_data_fault(tmp_path) == (5, "batch 5 holds NaN in row 2", [2])


class PutsNaNIntoItsBatch(WritesIntoItsBatch):
    """Its own ``on_train_batch_start`` puts a new input with a NaN row into the batch at step 5 (a masking step that
    builds a new tensor); Lightning calls it after the callbacks' own hook."""

    def on_train_batch_start(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        if self.trainer.global_step == 5:
            x = batch["x"].clone()
            x[2, 0] = float("nan")
            batch["x"] = x


def test_the_batch_is_kept_as_training_step_receives_it_after_the_modules_own_hook(tmp_path: Any) -> None:
    """The detector copied the batch in its own ``on_train_batch_start``: the module's hook then put the NaN into
    the batch the step read, not into the copy, and the fault was blamed on the hardware ("the replay of this batch
    stayed finite")."""
    fit(PutsNaNIntoItsBatch(), [NonFiniteDetector()], max_steps=8, default_root_dir=str(tmp_path))
    assert _the_data_fault(tmp_path) == (5, "batch 5 holds NaN in row 2", [2])


class Graphs:
    """A batch record as PyTorch Geometric's ``Batch`` is one: attributes kept in a store of its own, ``to_dict()``,
    and a shallow ``__copy__`` (its tensors shared)."""

    def __init__(self, **tensors: torch.Tensor) -> None:
        self.__dict__["_store"] = dict(tensors)

    def __getattr__(self, name: str) -> torch.Tensor:
        try:
            return self.__dict__["_store"][name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: torch.Tensor) -> None:
        self._store[name] = value

    def __copy__(self) -> Graphs:
        return Graphs(**self._store)

    def to_dict(self) -> dict[str, torch.Tensor]:
        return dict(self._store)


class EncodesItsBatch(TinyRegressor):
    """``data.x = self.encoder(data.x)``, the PyG idiom: the step writes its encoding into the batch record."""

    def __init__(self, nan_at: int | None = None) -> None:
        super().__init__()
        self.nan_at = nan_at

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(self.data, batch_size=self.batch_size, collate_fn=lambda rows: Graphs(
            x=torch.stack([r[0] for r in rows]), y=torch.stack([r[1] for r in rows])))  # fmt: skip

    def on_train_batch_start(self, batch: Graphs, batch_idx: int) -> None:
        if self.trainer.global_step == self.nan_at:
            batch.x[2, 0] = float("nan")

    def training_step(self, batch: Graphs, batch_idx: int) -> torch.Tensor:
        batch.x = self.net[:2](batch.x)
        return nn.functional.mse_loss(self.net[2:](batch.x), batch.y)


def test_a_batch_record_is_copied_for_each_run_and_read_for_its_bad_values(tmp_path: Any) -> None:
    """A PyTorch Geometric batch was shared by the candidates and the loop (the loop's backward ran through a
    candidate's freed graph once a trial opened), and its NaN was never seen: each step read as the model's fault,
    and a few NaN graphs ended the fit in DivergenceError."""
    bare, tried = _without_and_with_a_false_alarm(EncodesItsBatch, 20, max_steps=48)
    assert_bit_identical(weights(bare), weights(tried))
    fit(EncodesItsBatch(nan_at=5), [NonFiniteDetector()], max_steps=8, default_root_dir=str(tmp_path))
    assert _the_data_fault(tmp_path) == (5, "batch 5 holds NaN in row 2", [2])


class Weighting(nn.Module):
    """A loss weighting kept as extra state (``get_extra_state``), which the module's own schedule changes at an
    epoch's start, as nequip's ``LossCoefficientScheduler`` does."""

    def __init__(self) -> None:
        super().__init__()
        self.coefficient = 1.0

    def get_extra_state(self) -> dict[str, float]:
        return {"coefficient": self.coefficient}

    def set_extra_state(self, state: dict[str, float]) -> None:
        self.coefficient = state["coefficient"]


class WeightingInPlace(Weighting):
    """The same, its own dict returned and updated in place: what ``get_extra_state`` returned changes with it."""

    def __init__(self) -> None:
        super().__init__()
        self.state = {"coefficient": 1.0}

    @property  # type: ignore[override]
    def coefficient(self) -> float:
        return self.state["coefficient"]

    @coefficient.setter
    def coefficient(self, value: float) -> None:
        self.__dict__.setdefault("state", {})["coefficient"] = value

    def get_extra_state(self) -> dict[str, float]:
        return self.state

    def set_extra_state(self, state: dict[str, float]) -> None:
        self.state.update(state)


class ScheduledWeighting(TinyRegressor):
    def __init__(self, weighting: type[Weighting] = Weighting) -> None:
        super().__init__()
        self.weighting = weighting()

    def on_train_epoch_start(self) -> None:
        if self.current_epoch == 4:  # step 32
            self.weighting.coefficient = 0.25

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.weighting.coefficient * super().training_step(batch, batch_idx)


@pytest.mark.parametrize("weighting", [Weighting, WeightingInPlace])
def test_a_false_alarm_leaves_the_modules_extra_state_as_the_run_left_it(weighting: type[Weighting]) -> None:
    """A trial opened at step 35 from the snapshot of step 30 restored the snapshot's extra state into the run to build
    its remedy, and nothing put the run's back: the run trained on with the weighting its schedule had replaced. A
    module whose ``get_extra_state`` returns the object its ``set_extra_state`` updates needs a copy of it kept."""
    bare, tried = _without_and_with_a_false_alarm(lambda: ScheduledWeighting(weighting), 35, max_steps=64)
    assert bare.weighting.coefficient == tried.weighting.coefficient == 0.25
    assert_bit_identical(weights(bare.net), weights(tried.net))


def test_batch_copy_copies_containers_shares_tensors_and_shares_what_it_cannot_rebuild() -> None:
    from collections.abc import Mapping

    from lightning_overflow.preserve import batch_copy

    x, y = torch.ones(2), torch.zeros(2)
    batch = {"inputs": [x], "target": y}
    copied = batch_copy(batch)
    assert copied == batch and copied is not batch and copied["inputs"] is not batch["inputs"]
    assert copied["inputs"][0] is x and copied["target"] is y

    class Pair(Mapping):  # type: ignore[type-arg]  # a constructor of its own: not rebuilt, shared
        def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
            self._items = {"a": a, "b": b}

        def __getitem__(self, key: str) -> torch.Tensor:
            return self._items[key]

        def __iter__(self) -> Any:
            return iter(self._items)

        def __len__(self) -> int:
            return 2

    pair = Pair(x, y)
    assert batch_copy(pair) is pair
