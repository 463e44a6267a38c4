"""Headroom: decades between the largest magnitude of a sampled step and the FP32 limit, logged and warned once,
inside the suite's one host read, with hooks on the sampled steps only."""

from __future__ import annotations

import json
import math
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import MemoryLogger, assert_bit_identical, fit, tuned, weights
from ddp_utils import run_ddp
from torch import Tensor, nn

from lightning_overflow import NonFiniteDetector, OverflowWarning, default_callbacks, read_journal
from lightning_overflow.diagnosis.headroom import ActivationSampler, decades_below_fp32
from lightning_overflow.health import board_for
from lightning_overflow.numerics import FP32_MAX
from lightning_overflow.testing import Fault, FaultInjector, TinyRegressor


class Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: Tensor) -> Tensor:
        return x * self.factor


class Amplified(TinyRegressor):
    """TinyRegressor whose hidden activations pass through 1e25 and back (``net.1`` is the loud module)."""

    def __init__(self, factor: float = 1e25, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.net = nn.Sequential(nn.Linear(4, 32), Scale(factor), Scale(1.0 / factor), nn.Tanh(), nn.Linear(32, 1))


class Truth(pl.Callback):
    """The step's values computed independently: largest |output| of ``net.1``, the loss, the gradient norm."""

    def __init__(self) -> None:
        self.activation: dict[int, float] = {}
        self.loss: dict[int, float] = {}
        self.grad: dict[int, float] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, *_: Any) -> None:
        step = trainer.global_step
        self._handle = pl_module.net[1].register_forward_hook(
            lambda m, a, out: self.activation.__setitem__(step, float(out.detach().abs().amax()))
        )

    def on_before_backward(self, trainer: pl.Trainer, pl_module: Any, loss: Tensor) -> None:
        self.loss[trainer.global_step] = float(loss.detach())

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        grads = [p.grad.double().reshape(-1) for p in pl_module.parameters()]
        self.grad[trainer.global_step] = float(torch.cat(grads).norm())

    def on_train_batch_end(self, *_: Any) -> None:
        self._handle.remove()


def test_headroom_per_source_is_logged_every_n_steps_with_exact_values() -> None:
    logger, truth = MemoryLogger(), Truth()
    detector = NonFiniteDetector(headroom_every_n_steps=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OverflowWarning)
        fit(Amplified(), [truth, detector], max_steps=7, logger=logger, log_every_n_steps=1)
    assert [s for s, _ in logger.metrics["overflow/headroom_decades"]] == [0, 3, 6]
    for step, value in logger.metrics["overflow/headroom_activation_decades"]:
        assert value == math.log10(FP32_MAX / truth.activation[step])
    for step, value in logger.metrics["overflow/headroom_loss_decades"]:
        assert value == math.log10(FP32_MAX / truth.loss[step])
    for step, value in logger.metrics["overflow/headroom_grad_decades"]:
        assert value == pytest.approx(math.log10(FP32_MAX / truth.grad[step]), abs=1e-6)
    for (_, total), (_, act) in zip(logger.metrics["overflow/headroom_decades"],
                                    logger.metrics["overflow/headroom_activation_decades"]):
        assert total == act  # the activations are the loudest source here
    reading = detector.last_headroom
    assert (reading.step, reading.module, reading.module_type, reading.source) == (6, "net.1", "Scale", "activation")
    assert reading.decades == math.log10(FP32_MAX / truth.activation[6]) and reading.magnitude == truth.activation[6]


def test_one_warning_naming_the_module_and_one_journal_event(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(Amplified(), [NonFiniteDetector(headroom_every_n_steps=2)], max_steps=8, default_root_dir=tmp_path)
    ours = [str(w.message) for w in caught if issubclass(w.category, OverflowWarning)]
    assert len(ours) == 1  # four sampled steps below the threshold, one warning
    assert ours[0].startswith("NonFiniteDetector: the step's largest magnitude is only 13.")
    expected = "powers of ten (decades) below the FP32 limit 3.4e38 at step 0: the output of net.1 (Scale) reached"
    assert expected in ours[0]
    events = list(read_journal(tmp_path / "overflow_events.jsonl"))
    assert [(e["kind"], e["step"], e["details"]["module"]) for e in events] == [("headroom", 0, "net.1")]


def test_a_healthy_model_has_ample_headroom_and_no_warning() -> None:
    detector = NonFiniteDetector(headroom_every_n_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OverflowWarning)
        fit(TinyRegressor(), [detector], max_steps=3)
    assert detector.last_headroom.decades > 35


class WithUnusedOutputs(nn.Module):
    """A layer that also returns what no loss reads: NaN where nothing was computed (nequip's stress of a molecule
    without a cell) and a float64 quantity beyond the FP32 range, in range for its own dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 32)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        hidden = self.linear(x)
        return hidden, torch.full_like(hidden, float("nan")), hidden.double() * 1e50


class Unused(TinyRegressor):
    def __init__(self) -> None:
        super().__init__()
        self.first = WithUnusedOutputs()

    def forward(self, x: Tensor) -> Tensor:
        return self.net[1:](self.first(x)[0])


def test_outputs_no_loss_reads_are_no_headroom_warning() -> None:
    """Every healthy nequip run of molecules warned at step 0 that an output "reached inf ... approaching overflow":
    a NaN no loss reads was taken for inf, and a float64 value was measured against the FP32 limit."""
    detector = NonFiniteDetector(headroom_every_n_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OverflowWarning)
        fit(Unused(), [detector], max_steps=3)
    assert detector.last_headroom.decades > 30


def test_the_warning_threshold_is_the_policy_s() -> None:
    detector = tuned(NonFiniteDetector(headroom_every_n_steps=1), headroom_warn_decades=38.5)
    pattern = r"at step 0: the gradient norm reached .* \(the largest activation, .*, came out of net\.0 \(Linear\)\)"
    with pytest.warns(OverflowWarning, match=pattern):
        fit(TinyRegressor(), [detector], max_steps=1)


def test_a_nonfinite_step_has_no_headroom_reading() -> None:
    logger = MemoryLogger()
    detector = NonFiniteDetector(headroom_every_n_steps=2)
    fit(TinyRegressor(), [detector, FaultInjector(Fault(2, "inf_loss"))], max_steps=5, logger=logger)
    assert [s for s, _ in logger.metrics["overflow/headroom_decades"]] == [0, 4]  # step 2 was not a reading
    assert detector.skipped_steps == 1


def test_decades_below_fp32() -> None:
    assert decades_below_fp32(FP32_MAX) == 0.0 and decades_below_fp32(math.inf) == 0.0
    assert decades_below_fp32(0.0) == math.inf and decades_below_fp32(-3.4028234663852886e18) == pytest.approx(20.0)


# ---- cost ----------------------------------------------------------------------------------------------------------


def test_sampled_steps_stay_within_the_one_host_read(count_reads: Counter[str]) -> None:
    detector = NonFiniteDetector(check_weights_every_n_steps=None, headroom_every_n_steps=1)
    fit(TinyRegressor(), [detector], max_steps=5, logger=MemoryLogger(), log_every_n_steps=1)
    assert count_reads == Counter({"lightning_overflow.distributed": 5 + 1})  # and the state check at the end
    assert detector.last_headroom.step == 4


class HookCensus(pl.Callback):
    """Forward hooks on the model's modules while each step runs, and after it ends."""

    def __init__(self) -> None:
        self.during: list[int] = []
        self.after: list[int] = []

    @staticmethod
    def count(model: nn.Module) -> int:
        return sum(len(m._forward_hooks) for m in model.modules())

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        self.during.append(self.count(pl_module))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        self.after.append(self.count(pl_module))


def test_hooks_exist_on_sampled_steps_only_and_are_removed() -> None:
    census = HookCensus()
    model = TinyRegressor()
    fit(model, [census, NonFiniteDetector(headroom_every_n_steps=3)], max_steps=7)
    modules = len(list(model.modules()))
    assert census.during == [modules, 0, 0, modules, 0, 0, modules]
    assert census.after == [0] * 7


def test_accumulated_micro_batches_are_sampled_until_their_optimizer_step() -> None:
    census = HookCensus()
    model = TinyRegressor()
    detector = NonFiniteDetector(headroom_every_n_steps=2)
    fit(model, [census, detector], max_steps=3, accumulate_grad_batches=2)
    modules = len(list(model.modules()))
    assert census.during == [modules, modules, 0, 0, modules, modules]
    assert census.after == [modules, 0, 0, 0, modules, 0]
    assert detector.last_headroom.step == 2


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_sampling_every_step_leaves_a_healthy_run_bit_identical(optimizer: str) -> None:
    def run(callbacks: list[Any]) -> dict[str, Tensor]:
        pl.seed_everything(7, verbose=False)
        model = TinyRegressor(optimizer=optimizer, dropout=0.1, batch_norm=True)
        fit(model, callbacks, max_steps=6)
        return weights(model)

    assert_bit_identical(run([]), run([NonFiniteDetector(headroom_every_n_steps=1)]))


# ---- DDP -----------------------------------------------------------------------------------------------------------
class RankScaled(TinyRegressor):
    """``net.1`` multiplies by 1e30 on rank 1 and by 1 on rank 0; ``net.2`` undoes it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 32), Scale(1.0), Scale(1.0), nn.Tanh(), nn.Linear(32, 1))

    def setup(self, stage: str) -> None:
        factor = 1e30 if self.trainer.global_rank == 1 else 1.0
        self.net[1].factor, self.net[2].factor = factor, 1.0 / factor


class HeadroomReport(pl.Callback):
    def __init__(self, directory: Path, detector: NonFiniteDetector) -> None:
        self.directory, self.detector = directory, detector

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        reading = self.detector.last_headroom
        record = {"rank": reading.rank, "module": reading.module, "decades": reading.decades, "step": reading.step}
        (self.directory / f"headroom{trainer.global_rank}.json").write_text(json.dumps(record))


@pytest.mark.ddp
@pytest.mark.timeout(180)
def test_ddp_every_rank_reads_the_same_headroom_and_the_loud_rank(tmp_path: Path) -> None:
    detector = NonFiniteDetector(headroom_every_n_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OverflowWarning)
        reports = run_ddp(RankScaled(), [detector, HeadroomReport(tmp_path, detector)], tmp_path)
    assert [r["error"] for r in reports] == [None, None]
    readings = [json.loads((tmp_path / f"headroom{r}.json").read_text()) for r in range(2)]
    assert readings[0] == readings[1]
    assert (readings[0]["rank"], readings[0]["module"], readings[0]["step"]) == (1, "net.1", 4)
    assert readings[0]["decades"] < 9


def test_the_sampled_values_stay_on_the_device() -> None:
    # Meta tensors have no values: any read to the host (item, bool, tolist) raises on them.
    sampler = ActivationSampler()
    meta = torch.device("meta")
    sampler._maxima = {0: torch.empty((), device=meta), 3: torch.empty((), device=meta)}
    value, index = sampler.largest(meta)
    assert value.device == index.device == meta and value.dtype == index.dtype == torch.float64


@pytest.mark.parametrize("manual", [False, True])
def test_a_value_that_came_in_with_the_data_is_named_a_data_fault_under_manual_optimization_too(
    tmp_path: Path, manual: bool
) -> None:
    """One input of 1e30 (row 3 of the first batch) is the step's largest magnitude. Under manual optimization the
    batch was not kept, and the warning told to lower the learning rate, at step 0 (scvi-tools' TOTALVI)."""
    from test_trials import ManualTiny

    model = ManualTiny() if manual else TinyRegressor()
    model.data.tensors[0][3, 0] = 1e30
    fit(model, [NonFiniteDetector()], max_steps=2, default_root_dir=tmp_path)
    [event] = [e for e in read_journal(tmp_path) if e["kind"] in ("data_fault", "headroom")]
    assert (event["kind"], event["step"]) == ("data_fault", 0)
    assert event["message"].startswith("NonFiniteDetector: batch 0 holds values up to 1e+30 in row 3 (no normalised "
                                       "input holds such values: a data fault)")


class LargeUnits(pl.LightningModule):
    """A float64 regression on data in large units (about 1e20): its loss (about 1e40) and its gradient norm
    lie beyond the FP32 range (3.4e38) and are finite numbers in float64, far from its limit (1.8e308)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)
        x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        self.data = torch.utils.data.TensorDataset(x * 1e20, x.sum(1, keepdim=True) * 1e20)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.linear(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(self.data, batch_size=16)


def test_a_float64_run_whose_loss_and_gradients_pass_the_fp32_range_is_judged_in_float64() -> None:
    """darts trains float64 series in float64: in units of 1e20 every step's loss was rounded to float32 (inf),
    its gradient norm called "beyond the FP32 range", every step skipped and the fit stopped in NonFiniteError at
    step 19, where the bare run trains; and the headroom warned "0.0 decades below the FP32 limit". A NaN loss is
    still skipped, at its step."""
    runs = []
    for suite in ([], default_callbacks()):  # the headroom samples step 0
        torch.manual_seed(0)
        model = LargeUnits()
        with warnings.catch_warnings():
            warnings.simplefilter("error", OverflowWarning)
            trainer = fit(model, suite, max_steps=12, precision="64-true")
        runs.append(model)
    assert_bit_identical(weights(runs[1]), weights(runs[0]))
    assert board_for(trainer).journal.events == []
    reading = next(c for c in suite if isinstance(c, NonFiniteDetector)).last_headroom
    assert reading.limit == torch.finfo(torch.float64).max and 260 < reading.decades < 270
    assert reading.loss_value > 1e39 and reading.grad_norm > 1e39

    faulted = fit(LargeUnits(), [NonFiniteDetector(), FaultInjector(Fault(step=5, kind="nan_loss"))], max_steps=12,
                  precision="64-true")  # fmt: skip
    events = board_for(faulted).journal.events
    assert [e.step for e in events if e.kind == "skip"] == [5] and {e.step for e in events} == {5}
