"""AutoClip in Lightning: exact clipping from the shared norm, NaN-proof statistics, exact resume, logs, journal."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import assert_bit_identical, fit, make_trainer, tuned, weights
from ddp_utils import run_ddp
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import Logger
from pytorch_lightning.plugins import MixedPrecision
from reference_numerics import PercentileState, ZScoreState, percentile_threshold, zscore_threshold
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_overflow import default_callbacks
from lightning_overflow.callbacks.auto_clip import AutoClip
from lightning_overflow.callbacks.grad_norm_monitor import GradNormMonitor
from lightning_overflow.callbacks.nonfinite_detector import NonFiniteDetector
from lightning_overflow.health import board_for
from lightning_overflow.numerics.agc import agc_coefficients
from lightning_overflow.numerics.clipping import clip_coefficient
from lightning_overflow.testing import Fault, FaultInjector, TinyGAN, TinyRegressor


@pytest.fixture(autouse=True)
def _run_in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # trainers without a logger journal into their default_root_dir, the cwd


# ---- helpers --------------------------------------------------------------------------------------------------------
class Captured(Logger):
    """Keeps every ``log_metrics`` call in memory (on every rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "captured"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append((int(step or 0), dict(metrics)))

    def series(self, key: str) -> list[tuple[int, float]]:
        return [(step, metrics[key]) for step, metrics in self.calls if key in metrics]

    def values(self, key: str) -> list[float]:
        return [value for _, value in self.series(key)]


class NormSpy(pl.Callback):
    """Records ``(optimizer index, float64 gradient norm)`` at its place in the callback list."""

    def __init__(self) -> None:
        self.norms: list[tuple[int, float]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        index = next(i for i, o in enumerate(trainer.optimizers) if o is optimizer)
        self.norms.append((index, math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))))

    def of(self, index: int = 0) -> list[float]:
        return [n for i, n in self.norms if i == index]


class DotModel(pl.LightningModule):
    """One parameter ``w`` (two zeros) and the loss ``w . [7, 24]``: its gradient is exactly ``[7, 24]``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return (self.w * torch.tensor([7.0, 24.0])).sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1.0)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.zeros(1, 1)), batch_size=1)


def clipped_run(autoclip: AutoClip, model: pl.LightningModule | None = None, extra: list[Any] | None = None,
                **kwargs: Any) -> tuple[pl.Trainer, Captured, NormSpy, NormSpy]:
    logger, before, after = Captured(), NormSpy(), NormSpy()
    callbacks = [before, autoclip, after, *(extra or [])]
    kwargs.setdefault("max_steps", 16)
    trainer = fit(model or TinyRegressor(), callbacks, logger=logger, log_every_n_steps=1, **kwargs)
    return trainer, logger, before, after


def assert_clipped_to(before: list[float], after: list[float], thresholds: list[float]) -> None:
    assert len(before) == len(after) == len(thresholds)
    for pre, post, threshold in zip(before, after, thresholds):
        assert post == pytest.approx(min(pre, threshold), rel=1e-5)


# ---- arguments -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"mode": "clip"}, ValueError, "'mode' must be one of 'fixed', 'percentile', 'zscore', 'agc' (got 'clip')"),
        ({"mode": "fixed"}, ValueError, "'max_norm' must be set when mode='fixed' (got None)"),
        ({"max_norm": 0}, ValueError, "'max_norm' must be in (0, inf) (got 0)"),
        ({"percentile": 101}, ValueError, "'percentile' must be in [0, 100] (got 101)"),
        ({"z_threshold": -1}, ValueError, "'z_threshold' must be in (0, inf) (got -1)"),
        ({"warmup_steps": 1}, ValueError, "'warmup_steps' must be >= 2 (got 1)"),
        ({"clipping": "big"}, TypeError, "'clipping' must be a number (got 'big')"),
        ({"exclude": "head"}, TypeError, "'exclude' must be a sequence of parameter names (got 'head')"),
        ({"exclude": ["head"]}, ValueError, "'exclude' applies to mode='agc' only (got mode='zscore')"),
        ({"if_trainer_clips": "ignore"}, ValueError, "'if_trainer_clips' must be one of 'raise', 'defer' (got 'ignore')"),
    ],
)
def test_rejects_bad_arguments(kwargs: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error) as info:
        AutoClip(**kwargs)
    assert str(info.value) == message


def test_gradient_clip_val_as_well_is_an_error_at_setup() -> None:
    with pytest.raises(ValueError) as info:
        fit(TinyRegressor(), [AutoClip(mode="zscore")], gradient_clip_val=0.5)
    assert str(info.value) == (
        "AutoClip(mode='zscore') and Trainer(gradient_clip_val=0.5) would both clip every step's gradients (double "
        "clipping: AutoClip first, then Lightning's clip_grad_norm_, which zeroes finite gradients whose FP32 norm "
        "overflows). Remove gradient_clip_val from the Trainer; for a constant threshold use "
        "AutoClip(mode='fixed', max_norm=0.5), or pass max_norm=0.5 to cap an adaptive mode; or keep your clipping "
        "with AutoClip(if_trainer_clips='defer')."
    )


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_the_default_composition_keeps_the_trainers_own_clipping_and_says_so_once(
    algorithm: str, caplog: pytest.LogCaptureFixture
) -> None:
    # pytorch-forecasting's tutorial trains with gradient_clip_val=0.01: adding the suite keeps that clip, exactly.
    pl.seed_everything(0, verbose=False)
    bare = TinyRegressor(lr=0.05)
    fit(bare, gradient_clip_val=0.01, gradient_clip_algorithm=algorithm, max_steps=24)
    pl.seed_everything(0, verbose=False)
    suite = TinyRegressor(lr=0.05)
    with caplog.at_level(logging.INFO, logger="lightning_overflow"):
        fit(suite, default_callbacks(), gradient_clip_val=0.01, gradient_clip_algorithm=algorithm, max_steps=24)
    assert_bit_identical(weights(bare), weights(suite))
    said = [r.getMessage() for r in caplog.records if "AutoClip leaves" in r.getMessage()]
    assert said == [
        f"lightning_overflow: AutoClip leaves this fit's gradients to Trainer(gradient_clip_val=0.01, "
        f"gradient_clip_algorithm={algorithm!r}), which clips every step: your clipping is kept (the rest of the "
        "suite acts as usual)"
    ]


def test_unknown_excluded_name_is_an_error_at_setup() -> None:
    with pytest.raises(ValueError, match=r"^'exclude' must name parameters or modules of the model \(got \['head'\]"):
        fit(TinyRegressor(), [AutoClip(mode="agc", exclude=["head"])])


# ---- the clip --------------------------------------------------------------------------------------------------------
def test_fixed_clip_by_hand() -> None:
    model = DotModel()
    _, logger, before, after = clipped_run(AutoClip(mode="fixed", max_norm=5.0), model, max_steps=1)
    assert before.of() == [25.0] and after.of() == [pytest.approx(5.0, rel=1e-7)]
    torch.testing.assert_close(model.w.detach(), torch.tensor([-1.4, -4.8]))  # SGD, lr 1: w = -[7, 24] * 0.2
    assert logger.series("clip/threshold") == [(0, 5.0)]
    assert logger.series("clip/coef") == [(0, pytest.approx(0.2, abs=1e-15))]


@pytest.mark.parametrize(
    "autoclip",
    [
        AutoClip(mode="fixed", max_norm=1.0),
        AutoClip(mode="percentile", percentile=25.0),
        tuned(AutoClip(mode="zscore", warmup_steps=3), min_ratio=1.0),
        AutoClip(mode="zscore", warmup_steps=3, max_norm=1.5),
    ],
    ids=["fixed", "percentile", "zscore", "zscore-capped"],
)
def test_gradients_are_clipped_to_the_logged_threshold(autoclip: AutoClip) -> None:
    spike = FaultInjector(Fault(step=9, kind="loss_spike", factor=30.0))
    _, logger, before, after = clipped_run(autoclip, extra=[spike])
    thresholds = [math.inf] * (16 - len(logger.values("clip/threshold"))) + logger.values("clip/threshold")
    assert_clipped_to(before.of(), after.of(), thresholds)
    coefs = logger.values("clip/coef")
    assert len(coefs) == 16 and coefs[9] < 0.2  # the spike was cut down
    assert autoclip.clipped_steps == sum(c < 1 for c in coefs) and autoclip.steps == 16


@pytest.mark.parametrize(
    "autoclip",
    [
        AutoClip(mode="fixed", max_norm=0.8),
        tuned(AutoClip(mode="percentile", percentile=25.0), window=5),
        AutoClip(mode="zscore", warmup_steps=3),
        tuned(AutoClip(mode="zscore", warmup_steps=3), min_ratio=1.0),
        AutoClip(mode="zscore", warmup_steps=3, max_norm=1.5),
    ],
    ids=["fixed", "percentile", "zscore", "zscore-paper", "zscore-capped"],
)
def test_thresholds_and_coefficients_are_bit_identical_to_the_tensor_forms(autoclip: AutoClip) -> None:
    """The callback's host statistics against the documented tensor functions, fed the norms the suite read."""
    faults = FaultInjector(Fault(step=6, kind="loss_spike", factor=30.0), Fault(step=9, kind="nan_grad"),
                           Fault(step=12, kind="loss_spike", factor=1e25))  # a spike, NaN, a norm beyond FP32
    _, logger, _, _ = clipped_run(autoclip, extra=[faults, GradNormMonitor(), NonFiniteDetector()], max_steps=20)
    z_state, p_state = ZScoreState.empty(), PercentileState.empty(autoclip.window)
    expected_thresholds, expected_coefs = [], []
    for step, norm in logger.series("grad_norm/total"):
        total = torch.tensor(norm, dtype=torch.float64)
        if not math.isfinite(norm):
            continue  # the detector skips a non-finite step: it changes nothing and logs nothing
        if autoclip.mode == "zscore":
            warmed, mean = int(z_state.count) >= autoclip.warmup_steps, z_state.mean
            threshold, z_state = zscore_threshold(z_state, total, warmup_steps=autoclip.warmup_steps)
            if warmed:  # never below min_ratio times the running mean (1: the paper's rule, which it never is)
                threshold = torch.maximum(threshold, autoclip.min_ratio * mean)
        elif autoclip.mode == "percentile":
            threshold, p_state = percentile_threshold(p_state, total, autoclip.percentile)
        else:
            threshold = torch.tensor(math.inf, dtype=torch.float64)
        if autoclip.max_norm is not None:
            threshold = threshold.clamp(max=autoclip.max_norm)
        expected_coefs.append((step, clip_coefficient(total, threshold).item()))
        if math.isfinite(threshold.item()):
            expected_thresholds.append((step, threshold.item()))
    assert len(expected_coefs) == 19 and min(c for _, c in expected_coefs) < 0.2
    assert logger.series("clip/coef") == expected_coefs
    assert logger.series("clip/threshold") == expected_thresholds


def test_finite_gradients_beyond_the_fp32_norm_are_clipped_not_zeroed() -> None:
    spike = FaultInjector(Fault(step=3, kind="loss_spike", factor=1e25))  # gradients ~1e25: finite, squares are not
    _, logger, before, after = clipped_run(AutoClip(mode="fixed", max_norm=1.0), extra=[spike], max_steps=5)
    assert before.of()[3] > 1e24
    assert after.of()[3] == pytest.approx(1.0, rel=1e-5)
    assert logger.values("clip/coef")[3] == pytest.approx(1.0 / before.of()[3], rel=1e-5)


def test_agc_clips_unit_wise_and_leaves_excluded_parameters_alone() -> None:
    class GradCopy(pl.Callback):
        def __init__(self) -> None:
            self.grads: list[dict[str, torch.Tensor]] = []

        def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
            self.grads.append({n: p.grad.clone() for n, p in pl_module.named_parameters()})

    first, last = GradCopy(), GradCopy()
    model = TinyRegressor()
    weights_at_start = weights(model)
    logger = Captured()
    autoclip = AutoClip(mode="agc", clipping=0.02, exclude=["net.2"])
    fit(model, [first, autoclip, last], logger=logger, log_every_n_steps=1, max_steps=1)
    pre, post = first.grads[0], last.grads[0]
    for name in ("net.2.weight", "net.2.bias"):
        assert torch.equal(pre[name], post[name])
    params = []
    for name in ("net.0.weight", "net.0.bias"):
        p = nn.Parameter(weights_at_start[name].clone())
        p.grad = pre[name].clone()
        params.append(p)
    coefs = agc_coefficients(params, clipping=0.02)
    for name, p, c in zip(("net.0.weight", "net.0.bias"), params, coefs):
        assert torch.equal(post[name], p.grad * c)
    smallest = min(float(c.min()) for c in coefs)
    assert smallest < 1.0
    assert logger.values("clip/coef") == [pytest.approx(smallest, rel=1e-6)]
    assert logger.values("clip/threshold") == [0.02]


class UnitModel(pl.LightningModule):
    """One unit ``w = [[3, 4]]`` (norm 5) with gradient ``[[70, 240]]`` (norm 250), and ``b`` (zeros) with gradient
    ``[0.6, 0.8]`` (norm 1); SGD with lr 1."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([[3.0, 4.0]], dtype=dtype))
        self.b = nn.Parameter(torch.zeros(2, dtype=dtype))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        w_grad = torch.tensor([[70.0, 240.0]], dtype=self.w.dtype)
        b_grad = torch.tensor([0.6, 0.8], dtype=self.b.dtype)
        return (self.w * w_grad).sum() + (self.b * b_grad).sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1.0)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.zeros(1, 1)), batch_size=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_agc_max_norm_caps_the_norm_after_agc_by_hand(dtype: torch.dtype) -> None:
    """AGC (clipping 0.2) brings w's gradient to norm 0.2 * 5 = 1; b is excluded and keeps norm 1. The total after
    AGC is sqrt(2), which max_norm=0.5 scales to exactly 0.5 (a cap from the norm before AGC, sqrt(250**2 + 1),
    would end far below 0.5)."""
    model = UnitModel(dtype)
    autoclip = AutoClip(mode="agc", clipping=0.2, max_norm=0.5, exclude=["b"])
    _, logger, before, after = clipped_run(autoclip, model, max_steps=1)
    assert before.of() == [pytest.approx(math.sqrt(250.0**2 + 1.0), rel=1e-12)]
    assert after.of() == [pytest.approx(0.5, rel=1e-6)]
    cap = 0.5 / math.sqrt(2.0)
    tolerance = {"rtol": 1e-6, "atol": 0.0} if dtype == torch.float32 else {"rtol": 1e-14, "atol": 0.0}
    expected_w = torch.tensor([[3.0 - 0.28 * cap, 4.0 - 0.96 * cap]], dtype=torch.float64)
    expected_b = torch.tensor([-0.6 * cap, -0.8 * cap], dtype=torch.float64)
    assert model.w.dtype == model.b.dtype == dtype
    torch.testing.assert_close(model.w.detach().double(), expected_w, **tolerance)
    torch.testing.assert_close(model.b.detach().double(), expected_b, **tolerance)
    assert logger.values("clip/coef") == [pytest.approx(cap / 250.0, rel=1e-6)]  # smallest unit's 1/250, x cap


@pytest.mark.parametrize("exclude", [[], ["net.2.bias"]])
def test_agc_max_norm_caps_the_norm_after_agc_also_where_the_fp32_norms_overflow(exclude: list[str]) -> None:
    spike = FaultInjector(Fault(step=3, kind="loss_spike", factor=1e25))  # gradients ~1e25: FP32 squares overflow
    autoclip = AutoClip(mode="agc", max_norm=1e-3, exclude=exclude)
    _, logger, before, after = clipped_run(autoclip, extra=[spike], max_steps=5)
    assert before.of()[3] > 1e24
    assert after.of() == [pytest.approx(1e-3, rel=1e-5)] * 5  # AGC leaves more than 1e-3 on every step
    assert logger.values("clip/coef")[3] < 1e-20


@pytest.mark.parametrize(
    "autoclip",
    [
        AutoClip(mode="fixed", max_norm=1e6),
        AutoClip(mode="percentile", percentile=100.0),
        AutoClip(mode="zscore", warmup_steps=2, z_threshold=1e6),
        AutoClip(mode="agc", clipping=1e6),
    ],
    ids=["fixed", "percentile", "zscore", "agc"],
)
def test_a_threshold_nothing_reaches_is_bit_identical_to_no_autoclip(autoclip: AutoClip) -> None:
    def run(callbacks: list[Any]) -> dict[str, torch.Tensor]:
        pl.seed_everything(3, verbose=False)
        model = TinyRegressor(optimizer="sgd", dropout=0.1)
        fit(model, callbacks, max_steps=12)
        return weights(model)

    assert_bit_identical(run([]), run([autoclip]))
    assert autoclip.steps == 12 and autoclip.clipped_steps == 0


# ---- NaN never enters the statistics --------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["zscore", "percentile"])
@pytest.mark.parametrize("fault", ["nan_loss", "inf_grad"])
def test_a_nan_step_leaves_the_statistics_finite_whatever_the_order(mode: str, fault: str) -> None:
    results = []
    for detector_first in (False, True):
        autoclip = AutoClip(mode=mode, warmup_steps=3)  # type: ignore[arg-type]
        detector = NonFiniteDetector()
        ordered = [detector, autoclip] if detector_first else [autoclip, detector]
        pl.seed_everything(0, verbose=False)
        model = TinyRegressor()
        logger = Captured()
        fit(model, [*ordered, FaultInjector(Fault(step=5, kind=fault))], logger=logger, log_every_n_steps=1,
            max_steps=12)
        state = autoclip.state_dict()
        stats = state["stats"][0]
        values = stats["history"] if mode == "percentile" else [stats["mean"], stats["var"]]
        assert all(math.isfinite(v) for v in values)
        assert stats["count"] == 11 and state["steps"] == 11 and detector.skipped_steps == 1
        assert 5 not in [step for step, _ in logger.series("clip/coef")]  # nothing logged for the skipped step
        assert all(math.isfinite(t) for t in logger.values("clip/threshold"))
        results.append((state, weights(model), logger.series("clip/coef") + logger.series("clip/threshold")))
    (state_a, weights_a, calls_a), (state_b, weights_b, calls_b) = results
    assert state_a == state_b and calls_a == calls_b
    assert_bit_identical(weights_a, weights_b)


def test_without_a_detector_a_nan_step_is_left_as_it_is_not_made_finite() -> None:
    autoclip = AutoClip(mode="fixed", max_norm=1e-3)
    _, logger, before, after = clipped_run(autoclip, extra=[FaultInjector(Fault(step=2, kind="nan_grad"))], max_steps=3)
    assert math.isnan(before.of()[2]) and math.isnan(after.of()[2])  # not zeroed, not scaled into finite numbers
    assert [step for step, _ in logger.series("clip/coef")] == [0, 1]
    assert autoclip.steps == 2


# ---- resume ----------------------------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
@pytest.mark.parametrize("mode", ["percentile", "zscore"])
def test_resume_clips_exactly_as_the_uninterrupted_run(mode: str, tmp_path: Path) -> None:
    def autoclip() -> AutoClip:
        return tuned(AutoClip(mode=mode, warmup_steps=4, percentile=30.0), window=6, min_ratio=1.0)  # type: ignore[arg-type]

    def spike() -> FaultInjector:
        return FaultInjector(Fault(step=12, kind="loss_spike", factor=30.0))

    def model(init_seed: int) -> TinyRegressor:
        pl.seed_everything(init_seed, verbose=False)
        return TinyRegressor()

    straight_model, straight_logger = model(0), Captured()
    straight = autoclip()
    fit(straight_model, [straight, spike()], logger=straight_logger, log_every_n_steps=1, max_steps=16)

    # A checkpoint written during the run, as a preempted job has (ModelCheckpoint saves after AutoClip's hook).
    first_logger = Captured()
    saver = ModelCheckpoint(dirpath=tmp_path, filename="half", every_n_train_steps=8, save_top_k=-1)
    first = make_trainer([autoclip(), spike(), saver], logger=first_logger, log_every_n_steps=1, max_steps=8,
                         enable_checkpointing=True)
    first.fit(model(0))
    checkpoint = tmp_path / "half.ckpt"
    saved = torch.load(checkpoint, weights_only=True)["callbacks"][straight.state_key]
    assert saved["mode"] == mode and saved["steps"] == 8

    resumed_model, resumed_logger = model(5), Captured()  # other initial weights: the checkpoint must bring all back
    resumed = autoclip()
    trainer = make_trainer([resumed, spike()], logger=resumed_logger, log_every_n_steps=1, max_steps=16)
    trainer.fit(resumed_model, ckpt_path=checkpoint)

    for key in ("clip/threshold", "clip/coef"):
        assert first_logger.series(key) + resumed_logger.series(key) == straight_logger.series(key)
    assert min(straight_logger.values("clip/coef")[8:]) < 0.5  # clipping happened after the resume
    assert resumed.state_dict() == straight.state_dict()
    assert_bit_identical(weights(resumed_model), weights(straight_model))


def test_inside_the_warm_up_a_norm_far_beyond_the_first_ones_is_capped_at_the_anchor() -> None:
    spike = FaultInjector(Fault(step=6, kind="loss_spike", factor=1e3))  # gradients x1000 at step 6
    autoclip = AutoClip(mode="zscore")  # warm-up of 25 steps
    _, logger, before, after = clipped_run(autoclip, extra=[spike], max_steps=8)
    norms = before.of()
    cap = 10.0 * sorted(norms[:3])[1]  # anchor_factor times the median of the first anchor_steps norms
    assert [step for step, _ in logger.series("clip/threshold")] == [3, 4, 5, 6, 7]
    assert logger.values("clip/threshold") == [pytest.approx(cap, rel=1e-6)] * 5
    assert norms[6] > 10 * cap and after.of()[6] == pytest.approx(cap, rel=1e-5)
    assert after.of()[:6] == pytest.approx(norms[:6], rel=1e-6) and after.of()[7] == pytest.approx(norms[7], rel=1e-6)
    # The statistics took the capped norm in: the warm-up mean of the eight norms, the spike's counted as the cap.
    learned = [*norms[:6], cap, norms[7]]
    assert autoclip._stats[0].mean == pytest.approx(sum(learned) / 8, rel=1e-6)


def test_after_the_warm_up_a_norm_within_min_ratio_times_the_mean_is_left_alone() -> None:
    """A healthy small batch puts a norm at 3-5x the mean now and then, many standard deviations out: at the default
    min_ratio (5) it passes, at 3 it is clipped to 3x the running mean."""
    for min_ratio in (5.0, 3.0):
        pl.seed_everything(0, verbose=False)
        spike = FaultInjector(Fault(step=30, kind="loss_spike", factor=8.0))  # the gradients of step 30 x8
        autoclip = tuned(AutoClip(mode="zscore"), min_ratio=min_ratio)  # warm-up of 25 steps
        model = TinyRegressor(lr=1e-4)  # the norms move slowly: the running mean is near the plain one
        _, logger, before, after = clipped_run(autoclip, model, extra=[spike], max_steps=32)
        norms, clipped = before.of(), after.of()
        mean = sum(norms[:30]) / 30
        assert 3.0 * mean < norms[30] < 5.0 * mean
        if min_ratio == 5.0:
            assert clipped == pytest.approx(norms, rel=1e-6) and autoclip.clipped_steps == 0
        else:
            assert clipped[30] < norms[30] and autoclip.clipped_steps == 1
            assert clipped[30] == pytest.approx(dict(logger.series("clip/threshold"))[30], rel=1e-5)


class SilentThenSmall(TinyRegressor):
    """No gradient at all from step 3 to 399 (a hinge loss sitting at exactly 0), then from step 400 the loss x0.05:
    a small violation, a twentieth of the gradients the run began with."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * (1.0 if self.global_step < 3 else 0.0 if self.global_step < 400 else 0.05)


@pytest.mark.parametrize("mode", ["zscore", "percentile"])
def test_steps_without_a_gradient_teach_the_statistics_nothing(mode: str) -> None:
    """397 norms of exactly 0 would leave statistics of mean and spread 0 (a window of zeros), to which the small
    gradient of step 400 is an outlier scaled to nothing: they are left out, and it passes whole."""
    pl.seed_everything(0, verbose=False)
    autoclip = AutoClip(mode=mode)  # type: ignore[arg-type]
    _, logger, before, after = clipped_run(autoclip, SilentThenSmall(lr=1e-3), max_steps=402)
    norms = before.of()
    assert norms[3:400] == [0.0] * 397 and 0.0 < norms[400] < 0.1 * min(norms[:3])
    assert after.of()[400] == pytest.approx(norms[400], rel=1e-6) and dict(logger.series("clip/coef"))[400] == 1.0
    stats = autoclip._stats[0].to_dict()
    assert stats["count"] == 5  # the first three norms and those of steps 400 and 401
    assert len(autoclip._first[0]) == 3 and 0.0 not in autoclip._first[0]


def test_without_an_anchor_factor_the_warm_up_lets_every_norm_through() -> None:
    spike = FaultInjector(Fault(step=6, kind="loss_spike", factor=1e3))
    autoclip = tuned(AutoClip(mode="zscore"), anchor_factor=None)  # the paper's warm-up
    _, logger, before, after = clipped_run(autoclip, extra=[spike], max_steps=8)
    assert logger.series("clip/threshold") == [] and after.of() == pytest.approx(before.of(), rel=1e-6)
    assert autoclip._stats[0].mean == pytest.approx(sum(before.of()) / 8, rel=1e-6)


def test_a_reused_autoclip_starts_a_new_fit_with_a_new_warmup() -> None:
    autoclip = AutoClip(mode="zscore", warmup_steps=5)
    _, first, _, _ = clipped_run(autoclip, max_steps=8)
    # Steps 3 and 4: the warm-up's cap, from the anchor of the first 3 norms; from step 5 on, the z-score.
    assert [step for step, _ in first.series("clip/threshold")] == [3, 4, 5, 6, 7]
    _, second, before, _ = clipped_run(autoclip, TinyRegressor(seed=1), max_steps=8)
    assert [step for step, _ in second.series("clip/threshold")] == [3, 4, 5, 6, 7]  # a new anchor, a new warm-up
    assert autoclip.state_dict()["first"] == {0: pytest.approx(before.of()[:3], rel=1e-6)}
    state = autoclip.state_dict()
    assert state["steps"] == 8 and state["stats"][0]["count"] == 8
    assert sum(f for _, f in second.series("clip/fraction_epoch")) * 8 == autoclip.clipped_steps


# ---- logs and journal ------------------------------------------------------------------------------------------------
def test_logged_keys_follow_log_every_n_steps_and_the_epoch_fraction_counts_clips() -> None:
    logger = Captured()
    autoclip = AutoClip(mode="fixed", max_norm=1.5)
    fit(TinyRegressor(), [autoclip], logger=logger, log_every_n_steps=3, max_steps=16)
    assert [step for step, _ in logger.series("clip/coef")] == [2, 5, 8, 11, 14]
    assert logger.series("clip/threshold") == [(s, 1.5) for s in (2, 5, 8, 11, 14)]
    fractions = logger.series("clip/fraction_epoch")
    assert [step for step, _ in fractions] == [7, 15]  # the step Lightning logs its epoch metrics at
    assert sum(f for _, f in fractions) * 8 == autoclip.clipped_steps
    assert 0 < autoclip.clipped_steps < 16


def test_large_clips_are_journaled_without_flooding(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(AutoClip, "EVENT_GAP", 4)
    trainer = fit(TinyRegressor(), [AutoClip(mode="fixed", max_norm=1e-4)], max_steps=10)
    events = [e for e in board_for(trainer).journal.events if e.kind == "clip"]
    assert [e.step for e in events] == [0, 4, 8]
    assert [e.details["not_journaled"] for e in events] == [0, 3, 3]
    assert events[1].source == "AutoClip" and events[1].details["coef"] < 1e-3
    assert events[1].message.startswith("AutoClip(fixed): scaled the gradients of optimizer 0 by ")
    assert "3 more such clip(s) since step 0 were not journaled" in events[1].message


def test_small_clips_are_not_journaled() -> None:
    trainer = fit(TinyRegressor(), [AutoClip(mode="fixed", max_norm=1.5)], max_steps=8)
    assert not [e for e in board_for(trainer).journal.events if e.kind == "clip"]


# ---- manual optimization, accumulation, 16-mixed ---------------------------------------------------------------------
def test_manual_optimization_keeps_statistics_per_optimizer() -> None:
    autoclip = tuned(AutoClip(mode="percentile"), window=100)
    _, logger, before, after = clipped_run(autoclip, TinyGAN(), max_steps=16)
    stats = autoclip.state_dict()["stats"]
    assert set(stats) == {0, 1}
    for index in (0, 1):
        assert stats[index]["history"] == pytest.approx(before.of(index), rel=1e-6)
        thresholds = logger.values(f"clip/threshold_opt{index}")
        assert_clipped_to(before.of(index), after.of(index), thresholds)
        assert len(logger.values(f"clip/fraction_epoch_opt{index}")) == 2
    assert before.of(0) != pytest.approx(before.of(1), rel=0.5)


def test_accumulated_gradients_are_clipped_once_per_optimizer_step() -> None:
    autoclip = AutoClip(mode="percentile", percentile=50.0)
    _, logger, before, after = clipped_run(autoclip, accumulate_grad_batches=2, max_steps=6)
    assert len(before.of()) == 6
    assert autoclip.state_dict()["stats"][0]["history"] == pytest.approx(before.of(), rel=1e-6)
    assert_clipped_to(before.of(), after.of(), logger.values("clip/threshold"))


def test_16_mixed_leaves_scaler_overflow_steps_alone() -> None:
    autoclip = AutoClip(mode="percentile", percentile=50.0)
    model = TinyRegressor()
    _, logger, before, after = clipped_run(autoclip, model, plugins=[MixedPrecision("16-mixed", "cpu")], max_steps=24)
    finite = [(i, n) for i, n in enumerate(before.of()) if math.isfinite(n)]
    assert 0 < len(finite) < 24  # the scaler overflowed while calibrating, then settled
    assert autoclip.state_dict()["stats"][0]["history"] == pytest.approx([n for _, n in finite], rel=1e-6)
    assert_clipped_to([n for _, n in finite], [after.of()[i] for i, _ in finite], logger.values("clip/threshold"))
    assert autoclip.steps == len(finite)
    assert all(bool(torch.isfinite(w).all()) for w in weights(model).values())


# ---- rollback protocol -----------------------------------------------------------------------------------------------
def test_statistics_go_back_with_a_restored_snapshot() -> None:
    autoclip = AutoClip(mode="zscore", warmup_steps=3)
    trainer = fit(TinyRegressor(), [autoclip], max_steps=6)
    extras = board_for(trainer).snapshot_extras(trainer)
    saved = autoclip.state_dict()["stats"]
    trainer = fit(TinyRegressor(seed=1), [autoclip], max_steps=6)
    assert autoclip.state_dict()["stats"] != saved
    board_for(trainer).after_restore(trainer, extras)
    assert autoclip.state_dict()["stats"] == saved


# ---- DDP -------------------------------------------------------------------------------------------------------------
class DumpMetrics(pl.Callback):
    def __init__(self, logger: Captured, directory: Path) -> None:
        self.logger, self.directory = logger, directory

    def on_fit_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        path = self.directory / f"metrics{trainer.global_rank}.json"
        path.write_text(json.dumps(self.logger.calls))


@pytest.mark.ddp
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["zscore", "percentile"])
def test_ddp_ranks_agree_on_every_threshold(mode: str, tmp_path: Path) -> None:
    logger = Captured()
    autoclip = AutoClip(mode=mode, warmup_steps=3, percentile=30.0)  # type: ignore[arg-type]
    spike = FaultInjector(Fault(step=5, kind="loss_spike", rank=1, factor=30.0))  # one rank's spike, all-reduced
    reports = run_ddp(TinyRegressor(), [autoclip, spike, DumpMetrics(logger, tmp_path)], tmp_path, max_steps=8,
                      logger=logger, log_every_n_steps=1)
    assert [r["error"] for r in reports] == [None, None]
    assert reports[0]["digest"] == reports[1]["digest"] and reports[0]["states"] == reports[1]["states"]
    metrics = [json.loads((tmp_path / f"metrics{r}.json").read_text()) for r in range(2)]
    assert metrics[0] == metrics[1]
    coefs = [m["clip/coef"] for _, m in metrics[0] if "clip/coef" in m]
    assert len(coefs) == 8 and coefs[5] < 0.5


class _ClipsItself(TinyRegressor):
    """Clips its own gradients in Lightning's hook for it, at a threshold of its own."""

    def configure_gradient_clipping(self, optimizer: Any, *_: Any, **__: Any) -> None:
        self.clip_gradients(optimizer, gradient_clip_val=0.01, gradient_clip_algorithm="norm")


def test_a_module_that_clips_its_own_gradients_keeps_its_clipping(caplog: pytest.LogCaptureFixture) -> None:
    pl.seed_everything(0, verbose=False)
    bare = _ClipsItself(lr=0.05)
    fit(bare, max_steps=24)
    pl.seed_everything(0, verbose=False)
    suite = _ClipsItself(lr=0.05)
    with caplog.at_level(logging.INFO, logger="lightning_overflow"):
        fit(suite, default_callbacks(), max_steps=24)
    assert_bit_identical(weights(bare), weights(suite))
    assert [r.getMessage() for r in caplog.records if "AutoClip leaves" in r.getMessage()] == [
        "lightning_overflow: AutoClip leaves this fit's gradients to _ClipsItself.configure_gradient_clipping: your "
        "clipping is kept (the rest of the suite acts as usual)"
    ]
    fit(_ClipsItself(), [AutoClip()], max_steps=2)  # an AutoClip built by hand keeps clipping, as before


def test_float64_norms_beyond_the_fp32_range_anchor_the_warm_up() -> None:
    """A float64 run in units of 1e20 has gradient norms beyond 3.4e38: numbers in float64. They were left out of the
    warm-up's anchor as overflows, so no anchor was learned and a spike in the warm-up went unclipped."""
    from test_headroom import LargeUnits

    clip = AutoClip()
    fit(LargeUnits(), [clip], max_steps=clip.anchor_steps + 2, precision="64-true")
    assert len(clip._first[0]) == clip.anchor_steps and min(clip._first[0]) > 3.5e38
