"""Diagnosis: the first module and op that went non-finite, its direction, transient or persistent, the hint, and a
replay that leaves every bit of training state as it was."""

from __future__ import annotations

import json
import logging
import math
import pickle
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import assert_bit_identical, fit, optimizer_state, weights
from ddp_utils import run_ddp
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_overflow.callbacks.nonfinite_detector as detector_module
from lightning_overflow import NonFiniteDetector, NonFiniteError, read_journal
from lightning_overflow.diagnosis import Diagnosis, trace_nonfinite
from lightning_overflow.diagnosis.replay import batch_stats, combine
from lightning_overflow.testing import Fault, FaultInjector, TinyGAN, TinyRegressor, regression_data


# ---- planted sources --------------------------------------------------------------------------------------------
class InfBackward(torch.autograd.Function):
    """Identity forward; its backward returns inf."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return torch.full_like(grad, math.inf)


class HugeBackward(torch.autograd.Function):
    """Identity forward; its backward returns 3e38: finite gradients whose squared norm overflows FP32."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return torch.full_like(grad, 3e38)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.linear(x))


class LogOfNegative(Block):
    def forward(self, x: Tensor) -> Tensor:
        return torch.log(-self.linear(x).abs() - 1.0)


class InfInBackward(Block):
    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(InfBackward.apply(self.linear(x)))


class HugeGradient(Block):
    def __init__(self, width: int) -> None:
        super().__init__(width)
        self.gain = nn.Parameter(torch.ones(width))

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.linear(x)) * HugeBackward.apply(self.gain)


class Stack(pl.LightningModule):
    """``n`` blocks of width 4 with ``planted`` at index ``k``, on the regression data of TinyRegressor."""

    def __init__(self, n: int = 8, k: int = 0, planted: type[Block] = Block, data: TensorDataset | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList([planted(4) if i == k else Block(4) for i in range(n)])
        self.head = nn.Linear(4, 1)
        self.data = data if data is not None else regression_data()

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=8)


def raised(model: pl.LightningModule, *callbacks: Any, **kwargs: Any) -> NonFiniteError:
    with pytest.raises(NonFiniteError) as info:
        fit(model, [NonFiniteDetector(action="raise"), *callbacks], **{"max_steps": 6, **kwargs})
    return info.value


# ---- where and which direction ----------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [0, 3, 7])
def test_forward_log_of_a_negative_value_is_found_at_layer_k(k: int) -> None:
    diagnosis = raised(Stack(8, k, LogOfNegative)).diagnosis
    origin = diagnosis.origin
    assert (origin.module, origin.module_type) == (f"layers.{k}", "LogOfNegative")
    assert (origin.direction, origin.op) == ("forward", "log")
    assert (origin.source, origin.kind, origin.nan_count, origin.numel) == ("op", "nan", 32, 32)
    assert origin.input_magnitude >= 1.0  # |input| of log: at least 1 by construction
    assert diagnosis.verdict == "persistent" and diagnosis.reproduced_ranks == (0,)
    assert "clamp" in diagnosis.hint and "eps" in diagnosis.hint


@pytest.mark.parametrize("k", [0, 3, 7])
def test_inf_returned_by_a_custom_backward_is_found_at_layer_k(k: int) -> None:
    error = raised(Stack(8, k, InfInBackward))
    origin = error.diagnosis.origin
    assert error.kind == "grad"
    assert (origin.module, origin.direction) == (f"layers.{k}", "backward")
    assert (origin.op, origin.kind) == ("InfBackwardBackward", "inf")
    assert origin.source == "op" and origin.inf_count == origin.numel == 32
    assert math.isfinite(origin.input_magnitude) and origin.input_magnitude > 0
    assert error.diagnosis.replays[0].trace.loss_finite  # the forward pass was finite


def test_the_message_names_module_op_direction_and_verdict() -> None:
    error = raised(Stack(8, 3, LogOfNegative))
    assert "the first non-finite value appeared in the forward pass in layers.3 (LogOfNegative), op log" in str(error)
    assert "Persistent: the replay of this batch on the same weights reproduces it" in str(error)
    assert str(error).endswith(f"HINT: {error.hint}.")


@pytest.mark.slow
def test_a_compiled_model_is_replayed_eagerly_and_the_op_named(caplog: pytest.LogCaptureFixture) -> None:
    # The tracer's hooks read every module's output: in a compiled graph each would be a graph break, warned by dynamo.
    model = Stack(8, 3, LogOfNegative)
    with caplog.at_level(logging.WARNING, logger="torch._dynamo"):
        error = raised(torch.compile(model))
    assert "the first non-finite value appeared in the forward pass in layers.3 (LogOfNegative), op log" in str(error)
    assert "Persistent: the replay of this batch on the same weights reproduces it" in str(error)
    assert not [r for r in caplog.records if r.name.startswith("torch._dynamo")]


def test_the_plain_pytorch_function_finds_the_same_origin() -> None:
    model = Stack(8, 5, InfInBackward)
    x, y = regression_data()[:8]
    trace = trace_nonfinite(model, lambda: nn.functional.mse_loss(model(x), y))
    assert (trace.origin.module, trace.origin.direction) == ("layers.5", "backward")
    assert trace.nonfinite_gradients[0] == "layers.0.linear.weight"
    assert all(p.grad is None for p in model.parameters())  # gradients were returned, not accumulated



def test_the_plain_pytorch_function_refuses_bad_arguments() -> None:
    model = nn.Linear(2, 1)
    with pytest.raises(TypeError, match=r"^'model' must be a torch.nn.Module \(got 3\)$"):
        trace_nonfinite(3, lambda: torch.zeros(()))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^'loss_fn' must be a callable returning the loss \(got Tensor\)$"):
        trace_nonfinite(model, torch.zeros(()))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^'module_backward_hooks' must be a bool \(got 1\)$"):
        trace_nonfinite(model, lambda: model(torch.ones(2)).sum(), module_backward_hooks=1)  # type: ignore[arg-type]

# ---- magnitudes beyond FP32 and growth ----------------------------------------------------------------------------
def test_finite_gradients_beyond_fp32_are_an_overflow_of_the_squared_norm_not_nan() -> None:
    error = raised(Stack(4, 2, HugeGradient))
    diagnosis = error.diagnosis
    assert error.overflow and diagnosis.overflow and diagnosis.origin is None
    assert diagnosis.verdict == "persistent"
    assert "an overflow of the squared norm, not NaN" in diagnosis.message
    assert "the largest being layers.2.gain (norm 6e+38)" in diagnosis.message
    assert "squared norm overflowed FP32, not NaN" in error.hint


class DeepMLP(pl.LightningModule):
    """40 linear layers initialised with std 2.5 (10x growth per layer): activations reach inf in the forward pass."""

    def __init__(self, depth: int = 40, width: int = 16, std: float = 2.5) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)], nn.Linear(width, 1))
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for layer in self.net:
                layer.weight.normal_(0.0, std, generator=gen)
        self.data = regression_data(64, width)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=8)


def test_activation_growing_through_a_deep_stack_points_at_initialisation() -> None:
    diagnosis = raised(DeepMLP()).diagnosis
    origin = diagnosis.origin
    assert (origin.direction, origin.op, origin.kind, origin.module_type) == ("forward", "linear", "inf", "Linear")
    growth = diagnosis.replays[0].trace.forward_growth
    assert growth is not None and growth.first == "net.0" and growth.layers >= 30 and 5 < growth.factor < 20
    sentence = f"the activations grew about {growth.factor:.3g}x per layer through {growth.layers} layers"
    assert sentence in diagnosis.message
    assert "initialisation" in diagnosis.hint and "LayerNorm" in diagnosis.hint


class GrowWeightsAt(pl.Callback):
    """Multiplies every weight by ``factor`` before step ``step``'s batch: weights that updates grew."""

    def __init__(self, step: int, factor: float) -> None:
        self.step, self.factor = step, factor

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                for parameter in pl_module.parameters():
                    parameter.mul_(self.factor)


def test_activation_growing_through_a_stack_grown_after_finite_steps_points_at_the_learning_rate() -> None:
    """The same growth after three finite steps (the weights grew, as a rate too high grows them): the hint said
    to initialise with std = gain / sqrt(fan_in) or add a normalisation, and never named the learning rate."""
    error = raised(DeepMLP(std=0.25), GrowWeightsAt(3, 10.0))
    diagnosis = error.diagnosis
    assert diagnosis.step == 3 and diagnosis.replays[0].trace.forward_growth is not None
    assert diagnosis.hint.startswith("a magnitude that grows layer after layer, after finite steps, points at "
                                     "weights the updates grew: lower the learning rate")  # fmt: skip


# ---- the cause's hint -----------------------------------------------------------------------------------------------
class Contrastive(pl.LightningModule):
    """InfoNCE with a raw exp(sim / tau) at tau = 0.1 on unnormalised embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(8, 16)
        with torch.no_grad():
            self.encoder.weight.mul_(20.0)
        gen = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(64, 8, generator=gen))

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        (x,) = batch
        a, b = self.encoder(x), self.encoder(x + 0.01)
        sim = a @ b.T / 0.1
        return -torch.log(torch.exp(sim.diagonal()) / torch.exp(sim).sum(dim=1)).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=8)


def test_exp_in_an_infonce_loss_gets_the_logsumexp_hint() -> None:
    error = raised(Contrastive())
    origin = error.diagnosis.origin
    assert (origin.module, origin.op, origin.direction, origin.kind) == (None, "exp", "forward", "inf")
    assert origin.input_magnitude > 88.7  # exp overflows FP32 above 88.7
    assert "in training_step (outside every module), op exp" in str(error)
    assert "torch.logsumexp" in error.hint and "subtract the max" in error.hint
    assert f"HINT: {error.hint}." in str(error)


# ---- transient or persistent -------------------------------------------------------------------------------------
def test_a_fault_that_fires_once_is_transient() -> None:
    error = raised(TinyRegressor(), FaultInjector(Fault(3, "nan_loss", once=True)))
    diagnosis = error.diagnosis
    assert (diagnosis.verdict, diagnosis.replayed) == ("transient", True)
    assert diagnosis.origin is None and diagnosis.reproduced_ranks == ()
    assert "transient: the replay of this batch on the same weights stayed finite" in str(error)
    assert diagnosis.hint == "" and "check this batch" in error.hint  # no cause found: the generic hint


def test_a_fault_that_fires_on_every_execution_is_persistent() -> None:
    diagnosis = raised(TinyRegressor(), FaultInjector(Fault(3, "nan_loss", once=False))).diagnosis
    assert diagnosis.verdict == "persistent"
    assert (diagnosis.origin.op, diagnosis.origin.source, diagnosis.origin.module) == ("mul", "input", None)


def poisoned_data(index: int, value: float) -> TensorDataset:
    x, y = regression_data().tensors
    x = x.clone()
    x[index, 1] = value
    return TensorDataset(x, y)


def test_a_nan_sample_in_the_data_is_persistent_and_blamed_on_the_batch() -> None:
    error = raised(Stack(4, 0, Block, data=poisoned_data(27, math.nan)))  # batch 3 holds sample 27
    diagnosis = error.diagnosis
    assert error.step == 3 and diagnosis.verdict == "persistent"
    origin = diagnosis.origin
    assert (origin.source, origin.module, origin.op) == ("input", "layers.0.linear", "linear")
    assert diagnosis.replays[0].batch_nonfinite == 1
    assert "batch 3 holds NaN in row 3" in diagnosis.message
    assert "the batch itself holds inf/NaN" in diagnosis.hint


def test_a_huge_sample_in_the_data_is_named_with_its_magnitude() -> None:
    class Linear2(Stack):
        def forward(self, x: Tensor) -> Tensor:
            return self.head(self.layers[0].linear(x))

    error = raised(Linear2(1, 0, Block, data=poisoned_data(27, 1e30)))
    diagnosis = error.diagnosis
    assert (error.step, diagnosis.verdict) == (3, "persistent")
    assert (diagnosis.origin.op, diagnosis.origin.kind) == ("mse_loss", "inf")
    assert "batch 3 holds values up to 1e+30 in row 3" in diagnosis.message
    assert "x**2 is inf once |x| > 1.8e19" in diagnosis.hint and "up to 1e+30" in diagnosis.hint


def test_accumulation_replays_only_the_last_micro_batch_and_says_so() -> None:
    diagnosis = raised(TinyRegressor(), FaultInjector(Fault(1, "nan_loss")), accumulate_grad_batches=2).diagnosis
    assert diagnosis.verdict == "unknown"
    assert "only the last of the 2 accumulated micro-batches was replayed" in diagnosis.reason


# ---- where no replay is possible ----------------------------------------------------------------------------------
def test_manual_optimization_is_not_replayed_and_the_report_says_why() -> None:
    detector = NonFiniteDetector()
    fit(TinyGAN(), [detector, FaultInjector(Fault(4, "nan_loss"))], max_steps=8)
    diagnosis = detector.last_diagnosis
    assert (diagnosis.replayed, diagnosis.verdict, diagnosis.origin) == (False, "unknown", None)
    assert "manual optimization" in diagnosis.reason and diagnosis.reason in diagnosis.message


class IteratorStep(TinyRegressor):
    def training_step(self, dataloader_iter: Any) -> Tensor:  # type: ignore[override]
        batch, _, _ = next(dataloader_iter)
        x, y = batch
        return nn.functional.mse_loss(self(x), y)


def test_a_batch_consumed_from_the_dataloader_iterator_is_not_replayed() -> None:
    diagnosis = raised(IteratorStep(), FaultInjector(Fault(2, "nan_loss", once=False))).diagnosis
    assert not diagnosis.replayed and "dataloader_iter" in diagnosis.reason


def test_diagnose_false_makes_no_diagnosis() -> None:
    with pytest.raises(NonFiniteError) as info:
        fit(TinyRegressor(), [NonFiniteDetector(action="raise", diagnose=False), FaultInjector(Fault(2, "nan_loss"))])
    assert info.value.diagnosis is None and "Diagnosis" not in str(info.value)


def test_combine_without_any_replay_says_unknown() -> None:
    from lightning_overflow.diagnosis import Replay

    diagnosis = combine(5, [Replay(0, False, reason="the batch of this step was not kept")], (0,))
    assert diagnosis.message == "Diagnosis: transient or persistent is unknown: the batch of this step was not kept."


# ---- the replay changes nothing -----------------------------------------------------------------------------------
def snapshot(trainer: pl.Trainer, model: pl.LightningModule) -> dict[str, Any]:
    return {
        "weights": weights(model),  # BatchNorm running statistics and counter included
        "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        "optimizer": optimizer_state(trainer.optimizers[0]),
        "rng": torch.get_rng_state(),
        "python": random.getstate(),
        "training": [m.training for m in model.modules()],
    }


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert_bit_identical(a["weights"], b["weights"])
    assert a["grads"].keys() == b["grads"].keys()
    for name in a["grads"]:  # bit for bit, NaN payloads included
        assert torch.equal(a["grads"][name].view(torch.int32), b["grads"][name].view(torch.int32)), name
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    for k, state in a["optimizer"]["state"].items():
        for n, t in state.items():
            assert torch.equal(t, b["optimizer"]["state"][k][n])
    assert torch.equal(a["rng"], b["rng"]) and a["python"] == b["python"] and a["training"] == b["training"]


def test_the_replay_leaves_weights_grads_optimizer_rng_and_batchnorm_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[dict[str, Any], dict[str, Any], Diagnosis]] = []
    original = detector_module.diagnose_step

    def spy(trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any) -> Diagnosis:
        before = snapshot(trainer, pl_module)
        diagnosis = original(trainer, pl_module, *args, **kwargs)
        seen.append((before, snapshot(trainer, pl_module), diagnosis))
        return diagnosis

    monkeypatch.setattr(detector_module, "diagnose_step", spy)
    model = TinyRegressor(optimizer="adamw", dropout=0.5, batch_norm=True)
    fit(model, [NonFiniteDetector(action="warn"), FaultInjector(Fault(3, "nan_loss", once=False))], max_steps=5)
    before, after, diagnosis = seen[0]
    assert diagnosis.verdict == "persistent"  # the replay did run and did reproduce
    assert_same(before, after)


def test_a_run_with_replays_is_bit_identical_to_one_without() -> None:
    def run(diagnose: bool) -> tuple[dict[str, Tensor], Tensor, Any, int]:
        pl.seed_everything(3, verbose=False)
        model = TinyRegressor(optimizer="adamw", dropout=0.5, batch_norm=True)
        detector = NonFiniteDetector(diagnose=diagnose)
        faults = FaultInjector(Fault(2, "nan_loss", once=False), Fault(5, "nan_loss", once=False))
        fit(model, [detector, faults], max_steps=10)
        return weights(model), torch.get_rng_state(), random.getstate(), detector.skipped_steps

    with_replay, without = run(True), run(False)
    assert_bit_identical(with_replay[0], without[0])
    assert torch.equal(with_replay[1], without[1]) and with_replay[2] == without[2]
    assert with_replay[3] == without[3] == 2


def test_the_replay_replays_the_steps_dropout_masks() -> None:
    # Dropout 0.5 on a model whose loss is finite: a replay with other masks would give another loss.
    class Recorder(pl.Callback):
        def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
            if trainer.global_step == 2:
                self.loss = float(loss.detach())

    recorder = Recorder()
    detector = NonFiniteDetector()
    model = TinyRegressor(dropout=0.5)
    fit(model, [recorder, detector, FaultInjector(Fault(2, "inf_grad", parameter="net.3.bias"))], max_steps=3)
    assert detector.last_diagnosis.replays[0].trace.loss == recorder.loss


def test_logging_inside_training_step_is_silenced_during_the_replay() -> None:
    class Logs(TinyRegressor):
        calls = 0

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            loss = super().training_step(batch, batch_idx)
            self.log("train_loss", loss, on_epoch=True)
            Logs.calls += 1
            return loss

    trainer = fit(Logs(), [NonFiniteDetector(), FaultInjector(Fault(1, "nan_loss", once=False))], max_steps=3)
    assert Logs.calls == 4  # three steps and one replay
    assert "log" not in vars(trainer.lightning_module)  # the silencer is gone
    assert math.isfinite(float(trainer.callback_metrics["train_loss_epoch"]))  # the replay's NaN was not logged


# ---- reporting -----------------------------------------------------------------------------------------------------
def test_the_journal_records_the_diagnosis(tmp_path: Path) -> None:
    fit(Stack(8, 3, LogOfNegative), [NonFiniteDetector(max_consecutive_skips=2)], max_steps=1,
        default_root_dir=tmp_path)
    events = list(read_journal(tmp_path / "overflow_events.jsonl"))
    diagnosis = events[0]["details"]["diagnosis"]
    assert (events[0]["kind"], diagnosis["verdict"]) == ("nonfinite", "persistent")
    assert diagnosis["origin"]["module"] == "layers.3"
    assert diagnosis["origin"]["op"] == "log" and diagnosis["replays"][0]["rank"] == 0
    assert "Diagnosis: the first non-finite value appeared" in events[0]["message"]


def test_the_error_keeps_its_diagnosis_through_pickle() -> None:
    error = raised(Stack(8, 3, LogOfNegative))
    clone = pickle.loads(pickle.dumps(error))
    assert isinstance(clone.diagnosis, Diagnosis) and repr(clone.diagnosis) == repr(error.diagnosis)


# ---- nothing on healthy steps ---------------------------------------------------------------------------------------
@pytest.fixture
def count_hooks(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    calls: Counter[str] = Counter()
    for name in ("register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook"):
        original = getattr(nn.Module, name)

        def counting(self: nn.Module, *args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(nn.Module, name, counting)
    original_enter = torch.overrides.TorchFunctionMode.__enter__

    def entering(self: Any) -> Any:
        calls["TorchFunctionMode"] += 1
        return original_enter(self)

    monkeypatch.setattr(torch.overrides.TorchFunctionMode, "__enter__", entering)
    return calls




def test_healthy_steps_register_no_hook_and_read_nothing_more(
    count_hooks: Counter[str], count_reads: Counter[str]
) -> None:
    detector = NonFiniteDetector(check_weights_every_n_steps=None, headroom_every_n_steps=None)
    fit(TinyRegressor(dropout=0.1, batch_norm=True), [detector], max_steps=6)
    assert count_hooks == Counter()
    # One a step; when training ends, the state check (and, the model having buffers, the record of their constants).
    assert count_reads == Counter({"lightning_overflow.distributed": 7, "lightning_overflow.training_state": 1})
    assert detector.last_diagnosis is None and detector._kept is None  # nothing kept once the batch is over


def test_the_replay_removes_every_hook_it_registered() -> None:
    model = Stack(8, 3, LogOfNegative)
    with pytest.raises(NonFiniteError):
        fit(model, [NonFiniteDetector(action="raise", headroom_every_n_steps=None)], max_steps=2)
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks and not module._backward_hooks
    assert torch.overrides._get_current_function_mode_stack() == []


# ---- DDP: which rank saw it first -----------------------------------------------------------------------------------
class DiagnosisReport(pl.Callback):
    def __init__(self, directory: Path, detector: NonFiniteDetector) -> None:
        self.directory, self.detector = directory, detector

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        diagnosis = self.detector.last_diagnosis
        record = None if diagnosis is None else json.loads(json.dumps(diagnosis.to_dict(), default=str))
        (self.directory / f"diagnosis{trainer.global_rank}.json").write_text(json.dumps(record))


def ddp_diagnoses(tmp_path: Path, fault: Fault) -> list[dict[str, Any]]:
    detector = NonFiniteDetector()
    reports = run_ddp(TinyRegressor(), [detector, FaultInjector(fault), DiagnosisReport(tmp_path, detector)], tmp_path)
    assert [r["error"] for r in reports] == [None, None] and reports[0]["digest"] == reports[1]["digest"]
    return [json.loads((tmp_path / f"diagnosis{r}.json").read_text()) for r in range(2)]


@pytest.mark.ddp
@pytest.mark.timeout(180)
def test_ddp_names_the_rank_that_saw_a_persistent_fault_first(tmp_path: Path) -> None:
    diagnoses = ddp_diagnoses(tmp_path, Fault(3, "nan_loss", rank=1, once=False))
    assert diagnoses[0] == diagnoses[1]  # combined with a collective: identical on both ranks
    diagnosis = diagnoses[0]
    assert (diagnosis["verdict"], diagnosis["origin_rank"], diagnosis["reproduced_ranks"]) == ("persistent", 1, [1])
    assert diagnosis["observed_ranks"] == [1]
    assert "First seen on rank 1; the replay on rank(s) 0 stayed finite." in diagnosis["message"]


@pytest.mark.ddp
@pytest.mark.timeout(180)
def test_ddp_attributes_an_all_reduced_gradient_fault_to_its_rank(tmp_path: Path) -> None:
    diagnoses = ddp_diagnoses(tmp_path, Fault(2, "nan_grad", rank=1, parameter="net.2.weight", once=False))
    diagnosis = diagnoses[0]
    assert diagnoses[0] == diagnoses[1]
    assert diagnosis["observed_ranks"] == [0, 1]  # after the all-reduce every rank sees NaN
    assert (diagnosis["origin_rank"], diagnosis["origin"]["parameter"]) == (1, "net.2.weight")


@pytest.mark.ddp
@pytest.mark.timeout(180)
def test_ddp_transient_fault_on_one_rank(tmp_path: Path) -> None:
    diagnosis = ddp_diagnoses(tmp_path, Fault(3, "nan_loss", rank=1, once=True))[0]
    assert (diagnosis["verdict"], diagnosis["origin_rank"]) == ("transient", None)
    assert "It was seen on rank(s) 1 only." in diagnosis["message"]


def test_batch_rows_are_named_only_in_tensors_of_one_row_per_sample() -> None:
    """A graph batch (chemprop's) holds one row per atom beside one per molecule: an atom's row names no sample."""
    atoms = torch.zeros(37, 3)
    atoms[20, 1] = float("inf")
    per_molecule, targets = torch.zeros(8, 2), torch.zeros(8)
    stats = batch_stats((atoms, per_molecule, targets))
    assert (stats.nan, stats.inf, stats.rows) == (0, 1, ())  # counted, its row not named
    per_molecule[5, 0] = float("nan")
    stats = batch_stats((atoms, per_molecule, targets))
    assert (stats.nan, stats.inf, stats.rows) == (1, 1, (5,))
    assert batch_stats((torch.full((4, 2), float("nan")),)).rows == (0, 1, 2, 3)  # one tensor: its rows are samples


def test_a_batch_with_inf_nan_and_huge_values_is_told_with_both() -> None:
    """A target of 1e30 beside two NaN: the words name both, not the NaN alone (the 1e30 was the cause)."""
    from lightning_overflow.diagnosis.records import Replay

    both = Replay(0, True, batch_idx=5, batch_magnitude=1e30, batch_nonfinite=2, batch_nan=2, batch_rows=(0, 5, 13))
    assert both.describe_batch() == "batch 5 holds 2 NaN and values up to 1e+30 in rows 0, 5, 13"
    assert both.blames_batch
    assert not Replay(0, True, batch_idx=5, batch_nonfinite=1, batch_nan=1, batch_harmless=True).blames_batch


class MomentumTeacher(TinyRegressor):
    """A student and a teacher that follows it by an exponential moving average written in ``training_step`` (the
    momentum encoder of MoCo, BYOL, DINO): frozen parameters that no optimizer trains."""

    def __init__(self) -> None:
        super().__init__()
        self.teacher = nn.Linear(4, 1)
        self.teacher.requires_grad_(False)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        with torch.no_grad():
            self.teacher.weight.mul_(0.9).add_(self.net[0].weight[:1], alpha=0.1)
        return super().training_step(batch, batch_idx) + 0.0 * self.teacher(batch[0]).mean()


class TeacherAt(pl.Callback):
    def __init__(self) -> None:
        self.at: dict[int, tuple[Tensor, Tensor]] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, *_: Any) -> None:
        self.at[trainer.global_step] = (pl_module.teacher.weight.clone(), pl_module.net[0].weight[:1].clone())


def test_the_replays_of_a_skipped_step_leave_a_momentum_teacher_as_the_step_left_it() -> None:
    """The two diagnostic replays of a NaN step run ``training_step`` again: each moved the teacher one more EMA step
    (three updates in one skipped step, bare makes one)."""
    model, probe = MomentumTeacher(), TeacherAt()
    model.data.tensors[0][3 * model.batch_size + 1, 0] = float("nan")  # the batch of step 3
    fit(model, [NonFiniteDetector(), probe], max_steps=5)
    teacher, student = probe.at[3]
    once = teacher.clone().mul_(0.9).add_(student, alpha=0.1)
    assert torch.equal(probe.at[4][0], once)  # the step's own update, and none of the replays'


class MemoryBank(TinyRegressor):
    """A memory of the last batch's outputs in a buffer that the forward reads, then writes (a bank of negatives,
    DINO's centre): the NaN batch writes its NaN into it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("bank", torch.zeros(self.batch_size, 1))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        out = self(x)
        loss = nn.functional.mse_loss(out, y) + 0.0 * self.bank.sum()
        with torch.no_grad():
            self.bank.copy_(out)
        return loss


def test_a_nan_sample_is_a_data_fault_though_the_forward_wrote_it_into_a_buffer(tmp_path: Path) -> None:
    """The replay with the batch's NaN set to 0 read the bank the step's forward had written NaN into, came out NaN
    all the same, and blamed the model (lightly's MoCo): the replays run on the buffers as the step read them."""
    model = MemoryBank()
    model.data.tensors[0][3 * model.batch_size + 1, 0] = float("nan")
    fit(model, [NonFiniteDetector()], max_steps=5, default_root_dir=tmp_path)
    assert [(e["step"], e["kind"]) for e in read_journal(tmp_path)] == [(3, "data_fault"), (3, "skip")]
    assert torch.isfinite(model.bank).all()


def test_a_growth_before_any_update_points_at_the_initialisation_at_every_skipped_step() -> None:
    """Steps 0-2 overflow and are skipped: no update moved the weights, yet steps 1 and 2 said "weights the updates
    grew: lower the learning rate"."""
    detector = NonFiniteDetector()
    fit(DeepMLP(), [detector], max_steps=3)
    assert detector.last_diagnosis.step == 2 and detector.nonfinite_events == 3
    assert detector.last_diagnosis.hint.startswith("a magnitude that grows layer after layer points at the "
                                                   "initialisation")  # fmt: skip
