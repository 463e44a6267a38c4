"""The training state: buffers' non-finite constants, buffers and extra state in every snapshot, param groups added
during the fit, what can be restored."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import assert_bit_identical, fit
from pytorch_lightning.callbacks import BackboneFinetuning
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_overflow import NonFiniteError, default_callbacks, read_journal
from lightning_overflow._compat import Callback
from lightning_overflow.callbacks.nonfinite_detector import NonFiniteDetector
from lightning_overflow.callbacks.rollback import Rollback
from lightning_overflow.numerics.snapshots import clone_state, nonfinite_flag, state_tensors, take_snapshot
from lightning_overflow.testing import Fault, FaultInjector, TinyRegressor
from lightning_overflow.training_state import (
    NonFiniteConstants,
    StateCheck,
    check_state,
    nonfinite_flags,
    nonfinite_parts,
    optimizer_labels,
    restorable,
    restore_module_,
)

INF = float("inf")


# ---- models and probes ------------------------------------------------------------------------------------------
class TinyCausalLM(pl.LightningModule):
    """One causal self-attention layer, nanoGPT style: the mask is a buffer holding ``-inf`` above the diagonal.

    Sequences are ``block`` tokens; the model reads the first ``block - 1``, so the mask's last row is never used by
    the forward pass (a fault written there can only be found by the state check).
    """

    def __init__(self, vocab: int = 11, block: int = 6, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.qkv = nn.Linear(width, 3 * width)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("mask", torch.triu(torch.full((block, block), -INF), 1))
        gen = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randint(0, vocab, (64, block), generator=gen))

    def forward(self, idx: Tensor) -> Tensor:
        x = self.embed(idx)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        t = idx.shape[1]
        attention = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(x.shape[-1]) + self.mask[:t, :t], dim=-1)
        return self.head(x + attention @ v)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        (idx,) = batch
        logits = self(idx[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=8)


class BufferFault(Callback):
    """Writes ``value`` at ``index`` of buffer ``name`` when batch ``step`` starts (once); ``between_steps``: when
    the batch before it ends instead (outside any step: a buggy hook, a bad restore)."""

    def __init__(self, step: int, name: str, index: tuple[int, ...], value: float, between_steps: bool = False) -> None:
        self.step, self.name, self.index, self.value = step, name, index, value
        self.between_steps = between_steps
        self.fired = False

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        if not self.between_steps:
            self._fire(trainer, pl_module, trainer.global_step)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        if self.between_steps:
            self._fire(trainer, pl_module, trainer.global_step)

    def _fire(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        if step == self.step and not self.fired:
            self.fired = True
            with torch.no_grad():
                pl_module.get_buffer(self.name)[self.index] = self.value


class StateAt(Callback):
    """The module's whole state (and extra state) at the start and at the end of every batch (after Rollback)."""

    def __init__(self) -> None:
        self.at: dict[int, dict[str, Any]] = {}

    def _record(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.at[trainer.global_step] = clone_state(pl_module.state_dict())

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._record(trainer, pl_module)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        self._record(trainer, pl_module)


def _bits(t: Tensor) -> Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)


def journal(trainer: pl.Trainer, rollback: Rollback) -> list[tuple[str, int]]:
    return [(e.kind, e.step) for e in rollback.board(trainer).journal.events]


# ---- non-finite constants ---------------------------------------------------------------------------------------
def test_the_causal_mask_fails_the_strict_rule() -> None:
    """Why constants are recorded: every state of this model holds -inf."""
    assert nonfinite_flag(state_tensors(TinyCausalLM().state_dict())).item() == 1.0


def test_a_healthy_run_with_a_causal_mask_takes_every_snapshot() -> None:
    rollback = Rollback(every_n_steps=2)
    trainer = fit(TinyCausalLM(), [rollback], max_steps=8)
    assert trainer.global_step == 8 and rollback.rollbacks == 0
    assert rollback.snapshot_steps == [6, 8]
    assert journal(trainer, rollback) == []  # no snapshot refused, no warning, no rollback
    assert torch.equal(trainer.lightning_module.mask, TinyCausalLM().mask)


@pytest.mark.parametrize(
    ("index", "value", "what"),
    [((5, 0), float("nan"), "NaN below the diagonal"), ((5, 0), -INF, "-inf where it held 0"),
     ((4, 5), float("nan"), "NaN where it held -inf"), ((4, 5), INF, "+inf where it held -inf")],
)
def test_corruption_of_the_mask_is_found_and_rolled_back(index: tuple[int, int], value: float, what: str) -> None:
    """Row 5 is not read by the forward pass, (4, 5) is masked out anyway: the loss and the weights stay finite, and
    only the state check can find the fault, written at step 3 and found at the snapshot due at step 4."""
    rollback, probe = Rollback(every_n_steps=2), StateAt()
    faults = BufferFault(3, "mask", index, value)
    trainer = fit(TinyCausalLM(), [rollback, probe, faults], max_steps=6)
    assert rollback.history == [
        {"step": 4, "reason": "nonfinite_state", "trigger_step": 4, "snapshot_step": 2, "source": "memory"}
    ], what
    assert journal(trainer, rollback) == [("snapshot_refused", 4), ("rollback", 4)]
    refused = rollback.board(trainer).journal.events[0]
    assert refused.message == (
        "Rollback: the weights at step 4 contain inf/NaN on rank(s) 0 (in mask); this state is no rollback target"
    )
    assert torch.equal(_bits(probe.at[4]["mask"]), _bits(probe.at[2]["mask"]))  # bit for bit, -inf included
    assert trainer.global_step == 6 and rollback.snapshot_steps == [2, 6]


def test_constants_are_recorded_for_buffers_only_and_judged_by_position_and_sign() -> None:
    module = TinyCausalLM(block=3)
    with torch.no_grad():
        module.qkv.bias[0] = -INF  # a parameter: never a constant
    names = [n for n, _ in module.named_parameters(remove_duplicate=False)]
    constants = NonFiniteConstants.record(module.state_dict(), names)
    assert constants.paths == ["mask"]
    assert nonfinite_parts(module.state_dict(), [], constants) == (["qkv.bias"], [])
    with torch.no_grad():
        module.qkv.bias[0] = 0.0
    assert [f.item() for f in nonfinite_flags(module.state_dict(), [], constants)] == [0.0, 0.0]
    mask = module.mask
    for position, value, bad in [
        ((0, 1), -INF, False),  # the constant itself
        ((0, 1), 0.0, False),  # a constant gone finite is no inf/NaN
        ((0, 1), INF, True),  # the other sign
        ((1, 0), -INF, True),  # a new position
        ((0, 0), float("nan"), True),
    ]:
        saved = mask.clone()
        mask[position] = value
        flag = nonfinite_flags(module.state_dict(), [], constants)[0].item()
        assert flag == float(bad), (position, value)
        mask.copy_(saved)
    assert nonfinite_parts(module.state_dict(), [], NonFiniteConstants()) == (["mask"], [])  # strict without them


class WithPlaceholders(TinyRegressor):
    """Buffers that hold NaN until computed, as every anomalib model's post-processor does (its thresholds and
    normalization bounds): the bounds are computed at each validation's end."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("threshold", torch.tensor(float("nan")))  # never computed in this fit
        self.register_buffer("bounds", torch.full((2,), float("nan")))

    @override
    def on_validation_epoch_end(self) -> None:
        self.bounds.copy_(torch.tensor([-1.0, 1.0]) * self.trainer.current_epoch)


def test_a_nan_placeholder_buffer_is_no_fault_and_a_nan_anywhere_else_is(caplog: pytest.LogCaptureFixture) -> None:
    """anomalib's models hold NaN placeholders from their first step: the suite refused every healthy fit
    (``RollbackError``: no snapshot verified finite), and each callback alone warned of inf/NaN weights at the end."""
    runs = []
    for suite in ([], default_callbacks()):
        torch.manual_seed(0)
        model = WithPlaceholders()
        with caplog.at_level(logging.INFO, logger="lightning_overflow"):
            fit(model, suite, max_epochs=3, max_steps=-1, limit_val_batches=1)
        runs.append(model.state_dict())
    assert math.isnan(runs[1]["threshold"]) and runs[1]["bounds"].tolist() == [-2.0, 2.0]
    assert all(torch.equal(a, b) for key, a in runs[0].items() for b in [runs[1][key]] if key != "threshold")
    said = [r.message for r in caplog.records if "placeholders" in r.message]
    assert said == ["lightning_overflow: the buffer(s) threshold, bounds hold NaN where first seen: taken as "
                    "placeholders for values not computed yet (a threshold, a bound), not as faults; a NaN anywhere "
                    "else in them is one."]  # fmt: skip
    module = WithPlaceholders()
    constants = NonFiniteConstants.of_module(module)
    assert constants.placeholders == ["threshold", "bounds"]
    assert nonfinite_parts(module.state_dict(), [], constants) == ([], [])
    module.bounds[0] = 0.5  # computed, then NaN again where it was one: still the placeholder
    module.bounds[0] = float("nan")
    assert nonfinite_parts(module.state_dict(), [], constants) == ([], [])
    module.net[0].bias.data[0] = float("nan")  # a parameter is never a placeholder
    assert nonfinite_parts(module.state_dict(), [], constants) == (["net.0.bias"], [])


class TracksInputMean(TinyRegressor):
    """A running mean of the inputs kept for inference, which the loss leaves out rows with missing (NaN) features
    from: a NaN row writes NaN into the buffer and leaves the loss finite."""

    def __init__(self, poisoned: tuple[int, ...]) -> None:
        super().__init__()
        self.register_buffer("x_mean", torch.zeros(4))
        self.poisoned = poisoned

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.trainer.global_step in self.poisoned:
            batch[0][2, 0] = float("nan")

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        with torch.no_grad():
            self.x_mean.mul_(0.9).add_(0.1 * x.mean(0))
        keep = torch.isfinite(x).all(1)
        return nn.functional.mse_loss(self(x[keep]), y[keep])


def test_a_nan_the_first_forward_writes_or_a_running_statistic_holds_is_no_placeholder(tmp_path: Any) -> None:
    """Placeholders are what the fit starts with, outside the statistics every training forward updates: the first
    record had come from the detector's check after step 0's forward, so the NaN it wrote into a buffer was taken for
    one and the same fault at step 20 went unsaid; and a BatchNorm ``running_var`` NaN at the start was accepted."""
    model = TracksInputMean(poisoned=(0, 20))
    fit(model, [NonFiniteDetector()], max_steps=30, default_root_dir=str(tmp_path))
    events = [(e["step"], e["kind"]) for e in read_journal(tmp_path / "overflow_events.jsonl")]
    assert events == [(0, "data_fault"), (0, "skip"), (20, "data_fault"), (20, "skip")]
    assert bool(torch.isfinite(model.x_mean).all())
    normalised = TinyRegressor(batch_norm=True)
    normalised.net[1].running_var[3] = float("nan")
    assert NonFiniteConstants.of_module(normalised).placeholders == []
    with pytest.raises(NonFiniteError, match=r"inf/NaN in net\.1\.running_var"):
        fit(normalised, [NonFiniteDetector()], max_steps=4)


def test_a_placeholder_a_training_step_writes_is_one_no_longer() -> None:
    """A buffer the steps write (a running mean resumed from a damaged checkpoint) computes its value there: a NaN it
    keeps is a fault, found by the next check."""
    module = TracksInputMean(poisoned=())
    module.x_mean.fill_(float("nan"))
    constants = NonFiniteConstants.of_module(module)
    assert constants.placeholders == ["x_mean"] and nonfinite_parts(module.state_dict(), [], constants) == ([], [])
    constants.forget_placeholders(["net.0.weight", "x_mean"])
    assert constants.placeholders == [] and nonfinite_parts(module.state_dict(), [], constants) == (["x_mean"], [])


def test_the_parameters_that_hold_nan_are_named_before_the_buffers() -> None:
    """SWAG registers its moments as buffers before the parameters: the message quoted five buffers and hid the
    parameter that held the NaN behind "+N more"."""

    class Moments(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for i in range(6):
                self.register_buffer(f"moment_{i}", torch.full((2,), float("nan")))
            self.linear = nn.Linear(2, 1)

    module = Moments()
    module.moment_0.fill_(0.0)  # the first buffer finite; five NaN at this check (no constants recorded)
    with torch.no_grad():
        module.linear.weight[0, 0] = float("nan")
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    weights, _ = nonfinite_parts(module.state_dict(), [optimizer.state_dict()], None,
                                 optimizer_labels(module, [optimizer]))  # fmt: skip
    assert weights == ["linear.weight", "moment_1", "moment_2", "moment_3", "moment_4", "moment_5"]
    assert nonfinite_parts(module.state_dict(), [])[0][0] == "moment_1"  # without labels: state order


class LazyMaskLM(TinyCausalLM):
    """The mask built on the first forward pass (a ``None`` buffer until then), as many attention layers cache it."""

    def __init__(self, block: int = 6) -> None:
        super().__init__(block=block)
        self.block = block
        self.register_buffer("mask", None)

    @override
    def forward(self, idx: Tensor) -> Tensor:
        if self.mask is None:
            self.mask = torch.triu(torch.full((self.block, self.block), -INF), 1)
        return super().forward(idx)


def test_a_mask_built_on_the_first_forward_is_a_constant_too() -> None:
    rollback = Rollback(every_n_steps=2)
    trainer = fit(LazyMaskLM(), [NonFiniteDetector(check_weights_every_n_steps=1), rollback], max_steps=8)
    assert trainer.global_step == 8 and rollback.rollbacks == 0
    assert rollback.snapshot_steps == [6, 8]
    assert journal(trainer, rollback) == []
    assert torch.equal(trainer.lightning_module.mask, TinyCausalLM().mask)


def test_corruption_of_a_mask_built_on_the_first_forward_is_found_and_rolled_back() -> None:
    rollback, probe = Rollback(every_n_steps=2), StateAt()
    fit(LazyMaskLM(), [rollback, probe, BufferFault(3, "mask", (5, 0), float("nan"))], max_steps=6)
    assert [(h["step"], h["reason"], h["snapshot_step"]) for h in rollback.history] == [(4, "nonfinite_state", 2)]
    assert torch.equal(_bits(probe.at[4]["mask"]), _bits(probe.at[2]["mask"]))


def test_constants_learn_the_buffers_that_appear_or_change_shape() -> None:
    module = TinyCausalLM(block=3)
    constants = NonFiniteConstants.of_module(module)
    module.register_buffer("cache", torch.tensor([0.0, -INF]))  # appears during the fit, holding a constant
    module.register_buffer("stats", torch.tensor([1.0, float("nan")]))  # appears holding NaN: no placeholder
    module.lazy = nn.Linear(2, 2)
    with torch.no_grad():
        module.lazy.weight[0, 0] = -INF  # a parameter that appears: never a constant
    constants.learn(module)
    assert constants.paths == ["mask", "cache"]
    assert nonfinite_parts(module.state_dict(), [], constants) == (["stats", "lazy.weight"], [])
    module.mask = torch.triu(torch.full((4, 4), -INF), 1)  # rebuilt for longer sequences: learned again
    module.stats = torch.ones(2)
    with torch.no_grad():
        module.lazy.weight[0, 0] = 0.0
    assert nonfinite_flags(module.state_dict(), [], constants)[0].item() == 1.0  # not yet learned
    constants.learn(module)
    assert [f.item() for f in nonfinite_flags(module.state_dict(), [], constants)] == [0.0, 0.0]
    module.cache[0] = -INF  # the same shape: an inf at a new position is no constant
    assert nonfinite_parts(module.state_dict(), [], constants) == (["cache"], [])


def test_constants_apply_to_copies_and_files_of_the_state() -> None:
    """The rule follows the state path, so a snapshot or a file read back (CPU tensors) is judged alike."""
    module = TinyCausalLM(block=3)
    constants = NonFiniteConstants.of_module(module)
    snapshot = take_snapshot(module.state_dict())
    assert nonfinite_parts(snapshot, [], constants) == ([], [])
    snapshot["mask"][2, 0] = -INF
    assert nonfinite_parts(snapshot, [], constants) == (["mask"], [])
    snapshot["mask"] = torch.full((4, 4), -INF)  # another shape: strictly checked
    assert nonfinite_parts(snapshot, [], constants) == (["mask"], [])


def test_the_flags_are_computed_without_a_host_read() -> None:
    module = nn.Linear(4, 4, device="meta")
    module.register_buffer("mask", torch.empty(4, 4, device="meta"))
    constants = NonFiniteConstants.of_module(module)  # meta tensors have no values: none recorded, no read
    optimizer = torch.optim.Adam(module.parameters())
    weights_flag, moments_flag = nonfinite_flags(module.state_dict(), [optimizer.state_dict()], constants)
    assert weights_flag.device.type == "meta" and moments_flag.device.type == "cpu"  # no moments yet: a CPU zero
    weights_flag, _ = nonfinite_flags(module.state_dict(), [optimizer.state_dict()], constants, suspect=True)
    assert weights_flag.device.type == "meta"


def test_huge_finite_values_are_a_suspect_that_the_exact_check_clears() -> None:
    module = nn.Linear(100, 100)
    with torch.no_grad():
        module.weight.fill_(1e36)  # finite, but their sum is not
    suspect, _ = nonfinite_flags(module.state_dict(), [], suspect=True)
    assert suspect.item() == 1.0
    check = check_state(module.state_dict(), [], None, "cpu", lambda: pytest.fail("nothing to name"))
    assert check == StateCheck((), ()) and check.finite


def test_check_state_names_weights_buffers_and_moments() -> None:
    module = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    optimizer = torch.optim.Adam(module.parameters())
    module(torch.randn(4, 2)).sum().backward()
    optimizer.step()
    optimizer.state[module[0].weight]["exp_avg_sq"][0, 0] = float("nan")  # +inf there Adam tolerates: no fault of the state
    module[1].running_var[1] = float("nan")
    def labels() -> list[list[str]]:
        return [["0.weight", "0.bias", "1.weight", "1.bias"]]

    check = check_state(module.state_dict(), [optimizer.state_dict()], NonFiniteConstants(), "cpu", labels)
    assert check == StateCheck((0,), (0,), ("1.running_var",), ("0.weight.exp_avg_sq",))
    assert not check.finite and check.what == "weights" and check.ranks == (0,)
    assert check.names == ["1.running_var", "0.weight.exp_avg_sq"]
    finite = check_state(nn.Linear(2, 2).state_dict(), [], None, "cpu", lambda: pytest.fail("nothing to name"))
    assert finite == StateCheck((), ()) and finite.finite


# ---- buffers in the snapshots and the periodic check ------------------------------------------------------------
def test_nan_in_a_batchnorm_running_var_is_found_at_the_next_check_and_rolled_back() -> None:
    """BatchNorm in train mode normalises with the batch statistics: the loss and the weights stay finite, and only
    the check of the buffers finds the NaN written between steps 2 and 3 (no step wrote it: a skip could not mend
    it), at the snapshot due at step 4."""
    rollback, probe = Rollback(every_n_steps=2), StateAt()
    model = TinyRegressor(batch_norm=True)
    faults = BufferFault(3, "net.1.running_var", (7,), float("nan"), between_steps=True)
    trainer = fit(model, [NonFiniteDetector(), rollback, probe, faults], max_steps=6)
    assert rollback.history == [
        {"step": 4, "reason": "nonfinite_state", "trigger_step": 4, "snapshot_step": 2, "source": "memory"}
    ]
    refused = rollback.board(trainer).journal.events[0]
    assert (refused.kind, refused.step) == ("snapshot_refused", 4)
    assert "contain inf/NaN on rank(s) 0 (in net.1.running_var)" in refused.message
    for key in ("net.1.running_var", "net.1.running_mean", "net.1.num_batches_tracked", "net.0.weight"):
        assert torch.equal(_bits(probe.at[4][key]), _bits(probe.at[2][key])), key
    assert probe.at[4]["net.1.num_batches_tracked"].item() == 2  # integer buffers come back too
    assert bool(torch.isfinite(model.net[1].running_var).all())


def test_nan_written_into_a_running_var_during_a_step_is_skipped_and_put_back_at_once() -> None:
    """The same NaN written while step 3's window is open: that step is skipped, which puts the buffers back as the
    window found them, bit for bit, and nothing needs rolling back."""
    detector, rollback, probe = NonFiniteDetector(), Rollback(every_n_steps=2), StateAt()
    model = TinyRegressor(batch_norm=True)
    faults = BufferFault(3, "net.1.running_var", (7,), float("nan"))
    fit(model, [detector, rollback, probe, faults], max_steps=6)
    assert detector.skipped_steps == 1 and rollback.history == []
    for key in ("net.1.running_var", "net.1.running_mean", "net.1.num_batches_tracked", "net.0.weight"):
        assert torch.equal(_bits(probe.at[4][key]), _bits(probe.at[3][key])), key  # step 3: a true no-op


# ---- extra state ------------------------------------------------------------------------------------------------
class CountingRegressor(TinyRegressor):
    """Counts its training batches in ``get_extra_state``: a plain value and a tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.seen = torch.zeros(2)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.calls += 1
        self.seen = self.seen + batch[0][:, :2].mean(0)
        return super().training_step(batch, batch_idx)

    def get_extra_state(self) -> dict[str, Any]:
        return {"calls": self.calls, "seen": self.seen.clone()}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.calls, self.seen = state["calls"], state["seen"]


def test_rollback_restores_get_extra_state_values() -> None:
    rollback, probe = Rollback(every_n_steps=2), StateAt()
    model = CountingRegressor()
    fit(model, [NonFiniteDetector(), rollback, probe, FaultInjector(Fault(step=3, kind="nan_weight"))], max_steps=4)
    assert [(h["step"], h["snapshot_step"]) for h in rollback.history] == [(4, 2)]
    assert probe.at[2]["_extra_state"]["calls"] == 2
    assert probe.at[4]["_extra_state"]["calls"] == 2 and model.calls == 2  # 4 batches ran; the state of 2 is back
    assert torch.equal(_bits(model.seen), _bits(probe.at[2]["_extra_state"]["seen"]))
    tensors = {k: v for k, v in model.state_dict().items() if k != "_extra_state"}
    assert_bit_identical(tensors, {k: v for k, v in probe.at[2].items() if k != "_extra_state"})


def test_restore_module_hands_a_clone_to_set_extra_state() -> None:
    model = CountingRegressor()
    saved = take_snapshot(model.state_dict())
    model.calls, model.seen = 9, torch.ones(2)
    restore_module_(model, saved)
    assert model.calls == 0 and torch.equal(model.seen, torch.zeros(2))
    assert model.seen.data_ptr() != saved["_extra_state"]["seen"].data_ptr()  # the snapshot stays the snapshot
    model.seen.add_(5.0)
    assert torch.equal(saved["_extra_state"]["seen"], torch.zeros(2))


# ---- param groups added during the fit --------------------------------------------------------------------------
class TransferRegressor(pl.LightningModule):
    """A backbone and a head, for ``BackboneFinetuning``: the optimizer starts with the head only."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.head = nn.Linear(8, 1)
        self.data = TinyRegressor().data

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(filter(lambda p: p.requires_grad, self.parameters()), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=8)  # 8 batches an epoch


class GroupsAt(Callback):
    def __init__(self) -> None:
        self.at: dict[int, list[dict[str, Any]]] = {}
        self.states: dict[int, int] = {}

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        optimizer = trainer.optimizers[0]
        self.at[trainer.global_step] = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        self.states[trainer.global_step] = len(optimizer.state)


def test_a_snapshot_from_before_backbone_finetuning_added_a_group_is_restored() -> None:
    """BackboneFinetuning adds the backbone's group at epoch 1 (step 8). The NaN of step 9 rolls back to the
    snapshot of step 8, which has one group: the head's state comes back, the backbone's group stays (with the LR
    BackboneFinetuning gave it) and its parameters start again without state, as when the group was added."""
    rollback, groups, probe = Rollback(every_n_steps=4), GroupsAt(), StateAt()
    finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=1)
    model = TransferRegressor()
    callbacks = [finetuning, NonFiniteDetector(), rollback, groups, probe, FaultInjector(Fault(9, "nan_weight"))]
    trainer = fit(model, callbacks, max_steps=16)
    assert rollback.history == [
        {"step": 10, "reason": "nonfinite_state", "trigger_step": 9, "snapshot_step": 8, "source": "memory"}
    ]
    snapshot_groups = 1
    assert len(groups.at[8]) == snapshot_groups and len(groups.at[9]) == 2  # step 8's batch ran in epoch 0
    assert len(groups.at[10]) == 2 and groups.at[10][1]["lr"] == groups.at[9][1]["lr"]
    assert groups.states[9] == 4 and groups.states[10] == 2  # the head's two parameters keep their state
    assert_bit_identical(probe.at[10], probe.at[8])
    assert "snapshot_unusable" not in [kind for kind, _ in journal(trainer, rollback)]
    assert trainer.global_step == 16 and groups.states[16] == 4
    assert not torch.equal(probe.at[16]["backbone.0.weight"], probe.at[8]["backbone.0.weight"])  # it trains


def test_restorable_names_what_does_not_fit() -> None:
    model = TinyRegressor()
    optimizer = torch.optim.Adam(model.parameters())
    trainer = SimpleNamespace(optimizers=[optimizer], lr_scheduler_configs=[], lightning_module=model)
    state = {"model": model.state_dict(), "optimizers": [optimizer.state_dict()], "schedulers": [], "precision": {}}
    assert restorable(trainer, state) == ""  # type: ignore[arg-type]
    assert restorable(trainer, {"model": {}}) == (  # type: ignore[arg-type]
        "it is not a training state (a mapping of model, optimizers, schedulers, precision)"
    )
    assert restorable(trainer, {**state, "optimizers": []}) == (  # type: ignore[arg-type]
        "it holds 0 optimizer state(s), the fit has 1 optimizer(s)"
    )
    split = torch.optim.Adam([{"params": [model.net[0].weight]}, {"params": list(model.parameters())[1:]}])
    assert restorable(trainer, {**state, "optimizers": [split.state_dict()]}) == (  # type: ignore[arg-type]
        "optimizer 0 has param groups of [4] parameters, the snapshot [1, 3]: it belongs to another model or optimizer"
    )
    wider = TinyRegressor(hidden=16).state_dict()
    assert restorable(trainer, {**state, "model": wider}) == (  # type: ignore[arg-type]
        "the model state differs (net.0.weight: live (32, 4) torch.float32 vs snapshot (16, 4) torch.float32)"
    )


class SplitGroups(Callback):
    """At the start of batch ``step``, moves the optimizer's last parameter into a group of its own (a layout no
    earlier snapshot can be restored into)."""

    def __init__(self, step: int) -> None:
        self.step = step

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        if trainer.global_step == self.step:
            optimizer = trainer.optimizers[0]
            last = optimizer.param_groups[0]["params"].pop()
            optimizer.add_param_group({"params": [last]})


def test_a_snapshot_of_another_layout_is_journaled_and_a_newer_one_used() -> None:
    rollback = Rollback(every_n_steps=2, keep=2)
    faults = FaultInjector(Fault(step=5, kind="nan_weight"), Fault(step=7, kind="nan_weight"))
    trainer = fit(TinyRegressor(), [NonFiniteDetector(), rollback, SplitGroups(3), faults], max_steps=8)
    # Step 6: back to the snapshot of step 4 (taken after the split). Step 8: again from step 4, so one further back
    # (step 2, before the split): refused with its reason, and step 4 serves again.
    assert [(h["step"], h["snapshot_step"]) for h in rollback.history] == [(6, 4), (8, 4)]
    unusable = [e for e in rollback.board(trainer).journal.events if e.kind == "snapshot_unusable"]
    problem = "optimizer 0 has param groups of [3, 1] parameters, the snapshot [4]: it belongs to another model or optimizer"
    assert [e.message for e in unusable] == [
        f"Rollback: the snapshot of step 2 in memory cannot be used: {problem}; it is dropped and the next snapshot "
        "is tried."
    ]
    assert unusable[0].details == {"file": None, "snapshot_step": 2, "problem": problem, "ranks": []}
