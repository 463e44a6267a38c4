"""NonFiniteDetector: exact skips, errors with their fields, journal and counters, every training setup."""

from __future__ import annotations

import contextlib
import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import (
    BatchNormGAN,
    MemoryLogger,
    assert_bit_identical,
    assert_optimizer_state_equal,
    fit,
    make_trainer,
    optimizer_state,
    tuned,
    weights,
)
from pytorch_lightning.plugins import MixedPrecision

from lightning_overflow import (
    DivergenceError,
    LRBackoff,
    NonFiniteDetector,
    NonFiniteError,
    OverflowWarning,
    default_callbacks,
    read_journal,
)
from lightning_overflow.health import board_for
from lightning_overflow.testing import Fault, FaultInjector, TinyGAN, TinyRegressor


class StepRecorder(pl.Callback):
    """Weights and optimizer state before and after each optimizer step, and the LR of each step."""

    def __init__(self) -> None:
        self.before: dict[int, tuple[dict[str, torch.Tensor], dict[str, Any]]] = {}
        self.after: dict[int, tuple[dict[str, torch.Tensor], dict[str, Any]]] = {}
        self.lrs: list[float] = []
        self._step = 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        self._step = trainer.global_step
        self.before[self._step] = (weights(pl_module), optimizer_state(trainer.optimizers[0]))
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        self.after[self._step] = (weights(pl_module), optimizer_state(trainer.optimizers[0]))


def test_nan_loss_step_is_a_true_no_op_and_training_goes_on() -> None:
    recorder, detector = StepRecorder(), NonFiniteDetector()
    model = TinyRegressor(optimizer="adamw")
    fit(model, [detector, FaultInjector(Fault(3, "nan_loss")), recorder], max_steps=6)
    before_w, before_opt = recorder.before[3]
    after_w, after_opt = recorder.after[3]
    assert_bit_identical(before_w, after_w)
    assert_optimizer_state_equal(before_opt, after_opt)  # moments and AdamW's step counts untouched
    assert after_opt["state"][0]["step"].item() == 3.0
    assert not torch.equal(recorder.after[4][0]["net.0.weight"], after_w["net.0.weight"])  # the next step trains
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert (detector.skipped_steps, detector.nonfinite_events) == (1, 1)


@pytest.mark.parametrize("kind", ["nan_grad", "inf_grad", "inf_loss"])
def test_sgd_with_momentum_and_weight_decay_does_not_move_on_a_skipped_step(kind: str) -> None:
    recorder = StepRecorder()
    fit(TinyRegressor(optimizer="sgd"), [NonFiniteDetector(), FaultInjector(Fault(2, kind)), recorder], max_steps=4)
    assert_bit_identical(recorder.before[2][0], recorder.after[2][0])
    assert_optimizer_state_equal(recorder.before[2][1], recorder.after[2][1])


class ClipsByValueItself(TinyRegressor):
    """A module with its own clipping, by value, as ``configure_gradient_clipping``'s docs show it."""

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: Any = None) -> None:  # fmt: skip
        torch.nn.utils.clip_grad_value_(self.parameters(), 0.05)


@pytest.mark.parametrize("own", [False, True])
def test_a_skipped_step_is_not_clipped_and_the_next_one_is(own: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning clips right after the callbacks' ``on_before_optimizer_step``: a skipped step has no gradients left,
    and torch's ``clip_grad_value_`` raises on an empty list of them (the fit crashed at the first skip under
    ``gradient_clip_algorithm="value"``, or a module's own value clipping). The skipped step is not clipped; the
    others are, as before."""
    calls = []
    original = torch.nn.utils.clip_grad_value_

    def counted(parameters: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(1)
        original(parameters, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_value_", counted)
    recorder = StepRecorder()
    model = ClipsByValueItself() if own else TinyRegressor()
    clipping = {} if own else {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "value"}
    fit(model, [NonFiniteDetector(), FaultInjector(Fault(2, "nan_loss")), recorder], max_steps=5, **clipping)
    assert_bit_identical(recorder.before[2][0], recorder.after[2][0])
    assert len(calls) == 4  # steps 0, 1, 3 and 4
    assert "configure_gradient_clipping" not in vars(model)
    assert all(torch.isfinite(p).all() for p in model.parameters())


class EditsItsGradients(TinyRegressor):
    """A module whose ``on_before_optimizer_step`` edits a gradient (a bias it keeps where it is), counting its calls;
    under manual optimization too."""

    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = not manual
        self.calls: list[int] = []

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.calls.append(self.trainer.global_step)
        self.net[0].bias.grad.zero_()

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return None


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_a_skipped_step_does_not_call_the_modules_own_before_optimizer_step_hook(manual: bool) -> None:
    """A step the suite skipped has no gradients left: the module's hook met ``None`` and the fit crashed
    (``AttributeError``) where the bare fit, whose step had them, finished. The skipped step calls it not; every
    other step does, as before."""
    model = EditsItsGradients(manual)
    first_bias = model.net[0].bias.detach().clone()
    recorder = StepRecorder()
    fit(model, [NonFiniteDetector(), FaultInjector(Fault(2, "nan_grad")), recorder], max_steps=5)
    assert_bit_identical(recorder.before[2][0], recorder.after[2][0])
    assert model.calls == [0, 1, 3, 4]
    assert torch.equal(model.net[0].bias, first_bias) and "on_before_optimizer_step" not in vars(model)


def test_unprotected_run_is_poisoned_by_the_same_fault() -> None:
    model = TinyRegressor(optimizer="adamw")
    fit(model, [FaultInjector(Fault(3, "nan_loss"))], max_steps=6)
    assert not all(torch.isfinite(p).all() for p in model.parameters())


def test_the_lr_schedule_is_not_consumed_by_a_skipped_step() -> None:
    def scheduler(opt: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))

    clean, faulty = StepRecorder(), StepRecorder()
    fit(TinyRegressor(scheduler=scheduler), [NonFiniteDetector(), clean], max_steps=7)
    fit(TinyRegressor(scheduler=scheduler), [NonFiniteDetector(), FaultInjector(Fault(3, "nan_loss")), faulty], max_steps=8)
    # The step after the skipped one runs at the LR the skipped one would have had.
    assert faulty.lrs[:4] == clean.lrs[:4]
    assert faulty.lrs[4:] == clean.lrs[3:]


def test_journal_and_counters_say_what_happened(tmp_path: Any) -> None:
    logger = MemoryLogger(str(tmp_path))
    fit(TinyRegressor(), [NonFiniteDetector(), FaultInjector(Fault(3, "nan_loss"), Fault(5, "nan_grad"))],
        max_steps=8, logger=logger, log_every_n_steps=1, default_root_dir=tmp_path)
    events = list(read_journal(tmp_path / "overflow_events.jsonl"))
    assert [(e["step"], e["kind"]) for e in events] == [(3, "nonfinite"), (3, "skip"), (5, "nonfinite"), (5, "skip")]
    assert all(e["rank"] == 0 for e in events)
    assert events[0]["details"]["where"] == "loss"
    assert events[2]["details"]["where"] == "grad" and events[2]["details"]["parameters"] == ["net.0.weight"]
    skipped = dict(logger.metrics["overflow/skipped_steps"])
    assert skipped[2] == 0 and skipped[3] == 1 and skipped[5] == 2 and skipped[7] == 2
    assert dict(logger.metrics["overflow/nonfinite_events"])[7] == 2


def test_action_raise_stops_with_the_documented_fields() -> None:
    with pytest.raises(NonFiniteError) as info:
        fit(TinyRegressor(), [NonFiniteDetector(action="raise"), FaultInjector(Fault(3, "nan_loss"))], max_steps=6)
    error = info.value
    assert isinstance(error, FloatingPointError)
    assert (error.kind, error.step, error.ranks, error.parameters, error.overflow) == ("loss", 3, [0], [], False)
    assert str(error).startswith("NonFiniteDetector: the loss was inf/NaN at step 3 (epoch 0) on rank(s) 0.")
    assert "HINT: check this batch for inf/NaN inputs" in str(error)
    assert "logsumexp" in error.hint


def test_gradient_error_names_the_parameter() -> None:
    faults = FaultInjector(Fault(2, "inf_grad", parameter="net.2.bias"))
    with pytest.raises(NonFiniteError, match=r"gradients contained inf/NaN in net\.2\.bias .* at step 2") as info:
        fit(TinyRegressor(), [NonFiniteDetector(action="raise"), faults], max_steps=4)
    assert (info.value.kind, info.value.parameters) == ("grad", ["net.2.bias"])


def test_action_warn_warns_once_and_changes_nothing() -> None:
    model = TinyRegressor()
    faults = FaultInjector(Fault(2, "nan_loss"), Fault(4, "nan_loss"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        detector = NonFiniteDetector(action="warn")
        fit(model, [detector, faults], max_steps=6)
    ours = [w for w in caught if issubclass(w.category, OverflowWarning)]
    # Once per kind of finding: the NaN loss at step 2, then the weights it poisoned (not once per step); and, when
    # the fit ends, that the model it returns holds them.
    assert len(ours) == 3
    assert "the loss was inf/NaN at step 2" in str(ours[0].message)
    assert "the weights contained inf/NaN" in str(ours[1].message) and "at step 3" in str(ours[1].message)
    assert str(ours[2].message).startswith("NonFiniteDetector: the fit ended at step 6 with inf/NaN in its weights")
    assert detector.nonfinite_events >= 2 and detector.skipped_steps == 0
    assert not all(torch.isfinite(p).all() for p in model.parameters())  # a monitor does not protect


def test_consecutive_skips_end_in_an_error() -> None:
    faults = FaultInjector(*[Fault(s, "nan_loss") for s in range(2, 10)])
    detector = NonFiniteDetector(max_consecutive_skips=3)
    with pytest.raises(NonFiniteError, match=r"3 consecutive optimizer steps were non-finite, the last at step 4"):
        fit(TinyRegressor(), [detector, faults], max_steps=10)
    assert detector.skipped_steps == 3


def test_nonfinite_weights_cannot_be_skipped_away() -> None:
    with pytest.raises(NonFiniteError, match=r"the weights contained inf/NaN in net\.0\.bias at step 3") as info:
        fit(TinyRegressor(), [NonFiniteDetector(), FaultInjector(Fault(3, "nan_weight", parameter="net.0.bias"))],
            max_steps=6)
    assert info.value.kind == "weight" and "Rollback" in info.value.hint


class PoisonAdamState(pl.Callback):
    def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        if trainer.global_step == 4:
            state = next(iter(trainer.optimizers[0].state.values()))
            state["exp_avg_sq"].view(-1)[0] = float("nan")  # NaN: an +inf there Adam tolerates


def test_periodic_check_finds_nonfinite_optimizer_state() -> None:
    with pytest.raises(NonFiniteError, match=r"optimizer state contained inf/NaN in net\.0\.weight\.exp_avg_sq") as info:
        fit(TinyRegressor(), [NonFiniteDetector(check_weights_every_n_steps=2), PoisonAdamState()], max_steps=8)
    assert (info.value.kind, info.value.step) == ("optimizer_state", 4)


class ScaleGrads(pl.Callback):
    def __init__(self, step: int, value: float) -> None:
        self.step, self.value = step, value

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step == self.step:
            for p in pl_module.parameters():
                p.grad.fill_(self.value)


def test_finite_gradients_beyond_fp32_are_told_apart_from_nan() -> None:
    with pytest.raises(NonFiniteError, match=r"finite but their norm lies beyond the FP32 range") as info:
        fit(TinyRegressor(), [NonFiniteDetector(action="raise"), ScaleGrads(2, 3e38)], max_steps=4)
    assert info.value.overflow and info.value.kind == "grad"


def test_finite_gradients_of_1e20_are_not_a_detection() -> None:
    detector = NonFiniteDetector(action="raise")
    fit(TinyRegressor(optimizer="sgd"), [detector, ScaleGrads(2, 1e20)], max_steps=3)
    assert detector.nonfinite_events == 0


def test_routine_gradscaler_overflow_is_not_reported() -> None:
    detector = NonFiniteDetector(action="raise")
    trainer = fit(TinyRegressor(), [detector], max_steps=20, plugins=[MixedPrecision("16-mixed", "cpu")])
    assert trainer.precision_plugin.scaler.get_scale() < 65536.0  # the scaler did overflow and back off
    assert detector.nonfinite_events == 0


def test_persistent_gradscaler_overflow_is_reported() -> None:
    faults = FaultInjector(*[Fault(s, "inf_grad") for s in range(12)])
    detector = tuned(NonFiniteDetector(action="raise"), max_scaler_overflows=4)
    with pytest.raises(NonFiniteError, match=r"5 consecutive GradScaler overflows") as info:
        fit(TinyRegressor(), [detector, faults], max_steps=12, plugins=[MixedPrecision("16-mixed", "cpu")])
    assert "bf16-mixed" in info.value.hint


def test_a_scaler_started_above_the_default_scale_calibrates_down_to_it_unreported() -> None:
    """``GradScaler(init_scale=2**40)`` overflows 24 more times than the default's 2**16 before it is down to a
    workable scale: 26 overflows in a row, none of them a divergence (reported as ``scaler_collapse`` before)."""
    detector = NonFiniteDetector(action="raise")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    fit(TinyRegressor(), [detector], max_steps=40, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    assert detector.nonfinite_events == 0 and scaler.get_scale() <= 2.0**16


def test_nan_loss_under_gradscaler_is_real() -> None:
    detector = NonFiniteDetector()
    fit(TinyRegressor(), [detector, FaultInjector(Fault(6, "nan_loss"))], max_steps=10,
        plugins=[MixedPrecision("16-mixed", "cpu")])
    assert (detector.nonfinite_events, detector.skipped_steps) == (1, 1)


def test_bf16_mixed_nonfinite_is_skipped() -> None:
    recorder, detector = StepRecorder(), NonFiniteDetector()
    fit(TinyRegressor(), [detector, FaultInjector(Fault(2, "nan_loss")), recorder], max_steps=4, precision="bf16-mixed")
    assert detector.skipped_steps == 1
    assert_bit_identical(recorder.before[2][0], recorder.after[2][0])


def test_accumulation_skips_the_whole_window() -> None:
    recorder, detector = StepRecorder(), NonFiniteDetector()
    fit(TinyRegressor(), [detector, FaultInjector(Fault(1, "nan_loss")), recorder], max_steps=3, accumulate_grad_batches=4)
    assert detector.skipped_steps == 1
    # Micro-batches 4..7 form optimizer step 1; the NaN was in the first of them.
    assert_bit_identical(recorder.before[1][0], recorder.after[1][0])
    assert not torch.equal(recorder.before[2][0]["net.0.weight"], recorder.after[2][0]["net.0.weight"])


class ManualRecorder(pl.Callback):
    def __init__(self) -> None:
        self.d_before: dict[int, dict[str, torch.Tensor]] = {}
        self.d_after: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, *_: Any) -> None:
        self.d_before[trainer.global_step] = weights(pl_module.discriminator)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *_: Any) -> None:
        self.d_after[trainer.global_step - 2] = weights(pl_module.discriminator)


def test_manual_optimization_with_two_optimizers() -> None:
    recorder, detector = ManualRecorder(), NonFiniteDetector()
    model = TinyGAN()
    trainer = fit(model, [detector, FaultInjector(Fault(4, "nan_loss")), recorder], max_steps=10)
    # The fault poisons the discriminator's loss at global step 4 (two optimizer steps per batch).
    assert detector.skipped_steps == 1 and trainer.global_step == 10
    assert_bit_identical(recorder.d_before[4], recorder.d_after[4])
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("suite", ["detector", "default"])
def test_under_manual_optimization_a_skip_puts_back_the_buffers_its_forward_made_nonfinite(
    suite: str, tmp_path: Any
) -> None:
    """The discriminator's forward on the NaN batch writes NaN into its running statistics before its step is
    skipped. The skip puts those buffers back: the generator's step of the same batch goes on, the run skips that
    one step per epoch and nothing else (it had ended in NonFiniteError with the detector alone, and been backed off
    twice and rolled back at every epoch with the whole suite), and the discriminator's weights are unchanged by
    the batch. The batch holds the NaN: each is a data fault (without a replay, its batch says so)."""
    recorder = ManualRecorder()
    callbacks = [NonFiniteDetector()] if suite == "detector" else default_callbacks()
    model = BatchNormGAN()  # sample 21: batch 1 of each epoch, global steps 2 and 3
    trainer = fit(model, [*callbacks, recorder], max_steps=40, default_root_dir=tmp_path)
    assert trainer.global_step == 40
    kinds = [(e["step"], e["kind"]) for e in _events(tmp_path)]
    assert kinds == [(step, kind) for step in (2, 10, 18, 26, 34) for kind in ("data_fault", "skip")]
    params = dict(model.discriminator.named_parameters()).keys()  # its buffers moved with the generator's forward
    assert_bit_identical(*({k: v for k, v in d.items() if k in params} for d in (recorder.d_before[2],
                                                                             recorder.d_after[2])))  # fmt: skip
    assert all(bool(torch.isfinite(v).all()) for v in model.state_dict().values() if v.is_floating_point())


def test_state_survives_a_checkpoint(tmp_path: Any) -> None:
    detector = NonFiniteDetector()
    trainer = fit(TinyRegressor(), [detector, FaultInjector(Fault(1, "nan_loss"), Fault(2, "nan_loss"))], max_steps=4)
    path = tmp_path / "a.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    state = checkpoint["callbacks"][detector.state_key]
    assert state["skipped_steps"] == 2 and state["recent"] == [1, 2]
    resumed = NonFiniteDetector()
    trainer = pl.Trainer(max_steps=6, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[resumed, FaultInjector(Fault(4, "nan_loss"))])
    trainer.fit(TinyRegressor(), ckpt_path=path)
    assert (resumed.skipped_steps, resumed.nonfinite_events) == (3, 3)


def test_summary_line_at_the_end_of_fit(caplog: pytest.LogCaptureFixture, tmp_path: Any) -> None:
    with caplog.at_level("INFO", logger="lightning_overflow"):
        fit(TinyRegressor(), [NonFiniteDetector(), FaultInjector(Fault(1, "nan_loss"))], max_steps=3,
            default_root_dir=tmp_path)
    assert (
        f"lightning_overflow: what happened in this fit (the details: python -m lightning_overflow journal {tmp_path / 'overflow_events.jsonl'}):\n"
        "  - 1 step skipped: the loss was inf/NaN at step 1 (not reproduced on replay: a hardware fault, a "
        "nondeterministic kernel or a race)\n"
    ) in caplog.text


def test_journal_lines_are_valid_json(tmp_path: Any) -> None:
    fit(TinyRegressor(), [NonFiniteDetector(), FaultInjector(Fault(1, "inf_loss"))], max_steps=3, default_root_dir=tmp_path)
    lines = (tmp_path / "overflow_events.jsonl").read_text().splitlines()
    parsed = [json.loads(line) for line in lines]
    assert parsed[0]["details"]["grad_norm"] in ("nan", "inf") or math.isnan(float(parsed[0]["details"]["grad_norm"]))


def _events(root: Path) -> list[dict[str, Any]]:
    return list(read_journal(root / "overflow_events.jsonl"))


class _Unscaler(torch.nn.Module):
    """A scaler the batch carries, as tsl's ``ScalerModule``: the model un-scales its output with its statistics."""

    def __init__(self, bias: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("bias", bias)
        self.register_buffer("scale", scale)


class _CarriesItsScaler(pl.LightningModule):
    """One NaN in the raw series made column 2 of the scaler's statistics NaN: every batch's scaled input holds NaN
    there, and so does the scaler each batch carries (``batch["transform"]``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 4)
        raw = torch.randn(257, 4, generator=torch.Generator().manual_seed(0))
        raw[100, 2] = math.nan
        # The dataset's, not the model's: a plain dict is no submodule.
        self.data = {"raw": raw, "scaler": _Unscaler(raw.mean(0, keepdim=True), raw.std(0, keepdim=True))}

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        scaler = batch["transform"]
        return (self.net(batch["x"]) * scaler.scale + scaler.bias - batch["y"]).abs().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        raw, scaler = self.data["raw"], self.data["scaler"]
        pairs = list(zip((raw[:-1] - scaler.bias) / scaler.scale, raw[1:]))
        return torch.utils.data.DataLoader(pairs, batch_size=32, collate_fn=lambda items: {
            "x": torch.stack([a for a, _ in items]), "y": torch.stack([b for _, b in items]), "transform": scaler})


def test_bad_values_in_a_module_the_batch_carries_are_the_datas(tmp_path: Path) -> None:
    """The replay sets the batch's bad values to 0, the scaler's statistics too: the step is a data fault, skipped.
    They were left as they were, the replay stayed NaN, and the run was backed off and rolled back ten times ("on
    batches that hold no inf/NaN", while the batch held 32), then stopped by DivergenceError: lower the rate."""
    model = _CarriesItsScaler()
    scaler = model.data["scaler"]
    bias, scale = scaler.bias.clone(), scaler.scale.clone()
    fit(model, default_callbacks(), max_steps=4, default_root_dir=str(tmp_path))
    events = _events(tmp_path)
    assert [(e["step"], e["kind"]) for e in events if e["kind"] in ("data_fault", "backoff", "rollback")] == [
        (step, "data_fault") for step in range(4)
    ]
    assert "batch 0 holds 34 NaN" in events[0]["message"]  # 32 in the inputs, the scaler's 2
    for after, before in ((scaler.bias, bias), (scaler.scale, scale)):  # the replay put them back as they were
        assert torch.equal(after.isnan(), before.isnan()) and torch.equal(after.nan_to_num(), before.nan_to_num())


# ---- the skip budget ------------------------------------------------------------------------------------------------
def test_a_run_that_only_skips_is_stopped_by_the_skip_budget_when_nothing_can_restore_it(tmp_path: Path) -> None:
    """The loss is NaN on every step from step 5 and ``max_consecutive_skips`` is out of reach: the 11th skipped step
    of the last 20, step 15, stops the run with what happened, where, and what to try."""
    faults = FaultInjector(*(Fault(step, "nan_loss") for step in range(5, 100)))
    detector = tuned(NonFiniteDetector(max_consecutive_skips=1000), burst_count=2)
    with pytest.raises(DivergenceError) as caught:
        fit(TinyRegressor(), [detector, faults], max_steps=100, default_root_dir=str(tmp_path))
    assert caught.value.step == 15
    assert str(caught.value) == (
        "NonFiniteDetector: 11 of the last 20 optimizer steps were skipped, the last at step 15 (non-finite loss): the "
        "run is not training on rank(s) 0, and no callback in the list can restore the state or lower the learning "
        "rate: skipping each step was all that was tried. HINT: lower the configured learning rate or lengthen its "
        "warm-up, clip the gradients (AutoClip), add LRBackoff and Rollback (default_callbacks()) to back off and "
        "restore the last finite state, and look at the data around the steps journaled."
    )
    assert caught.value.history == [{"step": 15, "reason": "skip_budget", "skipped": 11, "window": 20}]
    assert detector.skipped_steps == 11


def test_skips_that_are_not_consecutive_count_against_the_budget_too(tmp_path: Path) -> None:
    """Two steps of every three from step 3 are NaN: never more than two in a row, yet most of the run skipped."""
    steps = [step for step in range(3, 100) if step % 3 != 0]
    faults = FaultInjector(*(Fault(step, "nan_loss") for step in steps))
    with pytest.raises(DivergenceError) as caught:
        fit(TinyRegressor(), [NonFiniteDetector(), faults], max_steps=100, default_root_dir=str(tmp_path))
    assert caught.value.step == 19  # skipped: 4, 5, 7, 8, 10, 11, 13, 14, 16, 17, 19
    assert "11 of the last 20 optimizer steps were skipped" in str(caught.value)


def test_the_skip_budget_escalates_to_the_remedies_present_and_stops_when_they_are_spent(tmp_path: Path) -> None:
    """The issue's composition: one backoff on the first three skips, then one for each budget spent, and at
    LRBackoff's floor the run stops, with every backoff listed."""
    faults = FaultInjector(*(Fault(step, "nan_loss") for step in range(5, 100)))
    suite = [tuned(NonFiniteDetector(max_consecutive_skips=1000), burst_count=2), LRBackoff(min_scale=0.25, cooldown=2)]
    with pytest.raises(DivergenceError) as caught:
        fit(TinyRegressor(), [*suite, faults], max_steps=100, default_root_dir=str(tmp_path))
    assert caught.value.step == 26
    assert "Backoffs so far: step 7 (nonfinite_persistent) -> 0.5; step 15 (nonfinite_persistent) -> 0.25." in str(
        caught.value
    )
    budget = [(e["step"], e["details"]["skipped"]) for e in _events(tmp_path) if e["kind"] == "skip_budget"]
    assert budget == [(15, 11), (26, 11)]
    # The batches' bad values were not the cause: none here; with some, set to 0 (it said "hold no inf/NaN" of those).
    first = next(e for e in _events(tmp_path) if e["kind"] == "backoff")
    assert ("3 consecutive optimizer steps were non-finite on batches whose inf/NaN, if any, were not the cause (set "
            "to 0, the step failed all the same)") in first["message"]  # fmt: skip


def test_a_fault_the_fit_went_past_without_firing_is_said() -> None:
    """Under manual optimization with two optimizers a batch's ``global_step`` moves by two: a gradient fault at an
    odd step never fires (its hook is set at a batch's start). A test written that way tested nothing, silently."""
    odd = FaultInjector(Fault(9, "nan_grad"))
    with pytest.warns(UserWarning, match=r"never fired, though the fit went on to step 16") as said:
        fit(TinyGAN(), [odd], max_steps=16)
    assert odd.fired == [] and len([w for w in said if "never fired" in str(w.message)]) == 1
    even = FaultInjector(Fault(8, "nan_grad"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(TinyGAN(), [even], max_steps=16)
    assert even.fired == [(8, "nan_grad", 0)] and not [w for w in caught if "never fired" in str(w.message)]


def test_a_resumed_fit_is_not_told_of_the_faults_of_the_steps_before_it(tmp_path: Path) -> None:
    first = FaultInjector(Fault(2, "nan_loss"), Fault(8, "nan_loss"))
    trainer = fit(TinyRegressor(), [NonFiniteDetector(), first], max_steps=6, default_root_dir=tmp_path)
    path = tmp_path / "at6.ckpt"
    trainer.save_checkpoint(path)
    resumed = FaultInjector(Fault(2, "nan_loss"), Fault(8, "nan_loss"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer([NonFiniteDetector(), resumed], max_steps=12, default_root_dir=tmp_path).fit(
            TinyRegressor(), ckpt_path=path
        )
    assert resumed.fired == [(8, "nan_loss", 0)] and not [w for w in caught if "never fired" in str(w.message)]


@pytest.mark.parametrize(("precision", "said"), [("16-true", True), ("bf16-true", False), ("16-mixed", False)])
def test_an_eps_that_is_zero_in_the_weights_dtype_is_said_at_the_start(precision: str, said: bool) -> None:
    """Adam's eps=1e-8 is 0 in float16: under ``16-true`` every update divides by zero wherever a second moment is
    0, at any learning rate, and the backoffs that follow cannot help. Said once, at the start, with what to do."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with contextlib.suppress(NonFiniteError):  # 16-true: the first update wrote NaN into the weights
            fit(TinyRegressor(optimizer="adam"), [NonFiniteDetector()], max_steps=2, precision=precision)
    told = [str(w.message) for w in caught if "which is 0 in" in str(w.message)]
    assert told == ([
        "NonFiniteDetector: optimizer 0 (Adam) has eps=1e-08, which is 0 in float16, its parameters' dtype: its update "
        "divides by the root of a second moment plus eps, inf/NaN wherever that moment is 0, at any learning rate. "
        "Train in precision='bf16-true' or '16-mixed' (float32 weights), or pass a larger eps (1e-4)."
    ] if said else [])


class NaNRowsIn(pl.LightningModule):
    """A regression whose batches ``bad`` (16 samples each, in order) hold one NaN feature each."""

    def __init__(self, bad: tuple[int, ...]) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        g = torch.Generator().manual_seed(0)
        x = torch.randn(640, 8, generator=g)
        y = x @ torch.randn(8, 1, generator=g)
        for batch in bad:
            x[batch * 16 + 3, 2] = math.nan
        self.data = torch.utils.data.TensorDataset(x, y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(self.data, batch_size=16)


@pytest.mark.parametrize("micro_batch", [0, 1])
def test_nan_rows_in_any_micro_batch_of_an_accumulated_step_are_a_data_fault(micro_batch: int) -> None:
    """Batches 20, 22, 24 (or 21, 23, 25) hold a NaN row; two micro-batches a step. Only the last micro-batch is
    replayed: NaN rows in the first read as steps failing on clean batches, three in a row, and the run was backed
    off to half its rate and rolled back to step 0."""
    callbacks = default_callbacks()
    trainer = fit(NaNRowsIn(tuple(b + micro_batch for b in (20, 22, 24))), callbacks, max_steps=16,
                  accumulate_grad_batches=2)  # fmt: skip
    events = board_for(trainer).journal.events
    faults = [(e.step, e.details["batch"]) for e in events if e.kind == "data_fault"]
    assert faults == [(10, 20 + micro_batch), (11, 22 + micro_batch), (12, 24 + micro_batch)]
    assert [e.step for e in events if e.kind == "skip"] == [10, 11, 12]
    assert {e.kind for e in events} == {"data_fault", "skip"}
    assert trainer.optimizers[0].param_groups[0]["lr"] == 1e-2


class MasksItsMissingValues(NaNRowsIn):
    """Every sample's feature 0 is NaN (missing), and the model masks it itself (as GluonTS does)."""

    def __init__(self) -> None:
        super().__init__(())
        self.data.tensors[0][:, 0] = math.nan

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.net(torch.nan_to_num(batch[0])), batch[1])


class BlowUpAt(pl.Callback):
    """Puts the first layer's weights at 1e25 (finite, far out of scale) before the first micro-batch of ``step``."""

    def __init__(self, step: int) -> None:
        self.step, self.done = step, False

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        if trainer.global_step == self.step and not self.done:
            self.done = True
            with torch.no_grad():
                pl_module.net[0].weight.fill_(1e25)


def test_harmless_nan_in_an_earlier_micro_batch_is_no_data_fault_when_the_state_fails() -> None:
    """Every micro-batch holds NaN the model masks; the weights blow up at step 10. The replay of the last micro-batch
    reproduces the fault with its NaN found harmless: the state's. The earlier micro-batches' NaN were taken for its
    cause, every step from 10 called a data fault, and the fit ran into NonFiniteError instead of rolling back."""
    trainer = fit(MasksItsMissingValues(), [*default_callbacks(), BlowUpAt(10)], max_steps=20,
                  accumulate_grad_batches=2)  # fmt: skip
    events = board_for(trainer).journal.events
    assert [e.step for e in events if e.kind == "nonfinite"] == [10, 11, 12]
    assert not [e for e in events if e.kind == "data_fault"]
    assert [(e.kind, e.step) for e in events if e.kind in ("backoff", "rollback")] == [("backoff", 12), ("rollback", 13)]


class ManualAccumulation(NaNRowsIn):
    """Manual optimization stepping every second batch (the module accumulates its own gradients)."""

    def __init__(self, bad: tuple[int, ...]) -> None:
        super().__init__(bad)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        self.manual_backward(super().training_step(batch, batch_idx))
        if batch_idx % 2 == 1:
            optimizer.step()
            optimizer.zero_grad()


def test_nan_rows_in_a_batch_a_manual_step_accumulated_are_a_data_fault() -> None:
    """NaN rows in the first of the two batches of steps 10-12 read as steps failing on clean batches (only the
    stepping batch was looked at): backed off and rolled back."""
    trainer = fit(ManualAccumulation((20, 22, 24)), default_callbacks(), max_steps=16)
    events = board_for(trainer).journal.events
    assert [(e.step, e.details["batch"]) for e in events if e.kind == "data_fault"] == [(10, 20), (11, 22), (12, 24)]
    assert not [e for e in events if e.kind in ("backoff", "rollback")]
