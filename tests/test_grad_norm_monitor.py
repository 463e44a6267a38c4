"""GradNormMonitor: the logged norms equal float64 references, at the configured steps, under the contract's keys."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import MemoryLogger, fit
from hypothesis import given, settings
from hypothesis import strategies as st
from torchmetrics.aggregation import MaxMetric, MeanMetric

from lightning_overflow import GradNormMonitor
from lightning_overflow.callbacks.grad_norm_monitor import EpochAggregates
from lightning_overflow.testing import TinyGAN, TinyRegressor


class GradReference(pl.Callback):
    """Float64 norms of the gradients the optimizer is about to use, per optimizer step."""

    def __init__(self, norm_type: float = 2.0) -> None:
        self.norm_type = norm_type
        self.totals: list[float] = []
        self.per_param: list[dict[str, float]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        grads = {n: p.grad.double() for n, p in pl_module.named_parameters() if id(p) in ids and p.grad is not None}
        if self.norm_type == math.inf:
            per = {n: g.abs().max().item() for n, g in grads.items()}
            self.totals.append(max(per.values()))
        else:
            per = {n: g.norm().item() for n, g in grads.items()}
            self.totals.append(math.sqrt(sum(v * v for v in per.values())))
        self.per_param.append(per)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_total_and_per_parameter_norms_match_float64(norm_type: float) -> None:
    logger, reference = MemoryLogger(), GradReference(norm_type)
    model = TinyRegressor()
    fit(model, [reference, GradNormMonitor(norm_type=norm_type, per_parameter=True)], max_steps=5, logger=logger,
        log_every_n_steps=1)
    prefix = "grad_norm_inf" if math.isinf(norm_type) else "grad_norm"  # each norm type keeps its own keys
    totals = [v for _, v in logger.metrics[f"{prefix}/total"]]
    assert [s for s, _ in logger.metrics[f"{prefix}/total"]] == [0, 1, 2, 3, 4]
    assert totals == pytest.approx(reference.totals, rel=1e-5)
    names = [n for n, _ in model.named_parameters()]
    for name in names:
        logged = [v for _, v in logger.metrics[f"{prefix}/{name}"]]
        assert logged == pytest.approx([p[name] for p in reference.per_param], rel=1e-5)


def test_logging_interval_defaults_to_the_trainers() -> None:
    logger = MemoryLogger()
    fit(TinyRegressor(), [GradNormMonitor(per_parameter=True, per_parameter_every_n_steps=6)], max_steps=12,
        logger=logger, log_every_n_steps=3)
    assert [s for s, _ in logger.metrics["grad_norm/total"]] == [2, 5, 8, 11]
    assert [s for s, _ in logger.metrics["grad_norm/net.0.weight"]] == [5, 11]


def test_per_parameter_interval_is_independent_of_the_totals() -> None:
    logger = MemoryLogger()
    fit(TinyRegressor(), [GradNormMonitor(per_parameter=True, log_every_n_steps=4, per_parameter_every_n_steps=2)],
        max_steps=8, logger=logger, log_every_n_steps=1)
    assert [s for s, _ in logger.metrics["grad_norm/total"]] == [3, 7]
    assert [s for s, _ in logger.metrics["grad_norm/net.0.weight"]] == [1, 3, 5, 7]


def test_own_interval_overrides_the_trainers() -> None:
    logger = MemoryLogger()
    fit(TinyRegressor(), [GradNormMonitor(log_every_n_steps=4)], max_steps=8, logger=logger, log_every_n_steps=1)
    assert [s for s, _ in logger.metrics["grad_norm/total"]] == [3, 7]


def test_epoch_aggregates_are_mean_and_max_of_the_step_totals() -> None:
    reference = GradReference()
    trainer = fit(TinyRegressor(n_samples=32), [reference, GradNormMonitor()], max_epochs=1, max_steps=-1,
                  logger=MemoryLogger(), log_every_n_steps=1)
    metrics = trainer.callback_metrics
    assert metrics["grad_norm/total_epoch_mean"].item() == pytest.approx(sum(reference.totals) / 4, rel=1e-5)
    assert metrics["grad_norm/total_epoch_max"].item() == pytest.approx(max(reference.totals), rel=1e-5)


def test_epoch_aggregates_are_torchmetrics_fed_every_step_total() -> None:
    """The logged epoch values are those of MeanMetric and MaxMetric updated with each step's logged total."""
    logger = MemoryLogger()
    trainer = fit(
        TinyRegressor(n_samples=48), [GradNormMonitor()], max_epochs=1, max_steps=-1, logger=logger, log_every_n_steps=1
    )
    totals = [v for _, v in logger.metrics["grad_norm/total"]]
    assert len(totals) == 6
    metrics = trainer.callback_metrics
    logged = metrics["grad_norm/total_epoch_mean"].item(), metrics["grad_norm/total_epoch_max"].item()
    assert logged == torchmetrics_reference(totals)


def test_several_optimizers_are_suffixed() -> None:
    logger = MemoryLogger()
    fit(TinyGAN(), [GradNormMonitor()], max_steps=4, logger=logger, log_every_n_steps=1)
    assert {"grad_norm/total_opt0", "grad_norm/total_opt1"} <= set(logger.metrics)
    assert "grad_norm/total" not in logger.metrics


class HugeGrads(pl.Callback):
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for p in pl_module.parameters():
            p.grad.fill_(1e20)


def test_true_norm_of_finite_gradients_where_clip_grad_norm_gives_inf() -> None:
    logger = MemoryLogger()
    model = TinyRegressor(optimizer="sgd", lr=0.0)
    fit(model, [HugeGrads(), GradNormMonitor()], max_steps=1, logger=logger, log_every_n_steps=1)
    n = sum(p.numel() for p in model.parameters())
    (_, logged), = logger.metrics["grad_norm/total"]
    assert logged == pytest.approx(1e20 * math.sqrt(n), rel=1e-6)
    assert math.isinf(torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0).item())


def test_works_without_any_logger() -> None:
    monitor = GradNormMonitor(per_parameter=True)
    trainer = fit(TinyRegressor(n_samples=16), [monitor], max_epochs=1, max_steps=-1)
    assert trainer.callback_metrics["grad_norm/total_epoch_max"] > 0


# ---- the epoch aggregates: torchmetrics' metrics, fed the step totals in order, synced across ranks ----------------
def torchmetrics_reference(norms: list[float]) -> tuple[float, float]:
    mean, maximum = MeanMetric(nan_strategy="disable"), MaxMetric(nan_strategy="disable")
    for norm in norms:
        mean.update(norm)
        maximum.update(norm)
    return mean.compute().item(), maximum.compute().item()


def aggregates(norms: list[float]) -> tuple[float, float]:
    totals = EpochAggregates()
    for norm in norms:
        totals.add(norm)
    mean, maximum = totals.compute(torch.device("cpu"))
    assert mean.dtype == maximum.dtype == torch.float32
    return mean.item(), maximum.item()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.floats(min_value=0.0, max_value=1e3), st.floats(min_value=0.0, max_value=1e39)),
                min_size=1, max_size=200))
def test_epoch_mean_and_max_are_bit_identical_to_torchmetrics(norms: list[float]) -> None:
    assert aggregates(norms) == torchmetrics_reference(norms)  # float32 rounding, inf past the float32 range


def test_a_long_epoch_rounds_as_one_update_per_step() -> None:
    # Magnitudes 1e-3 to 1e6 over 3000 steps: the float32 sum loses low bits at every addition, as torchmetrics' does.
    gen = torch.Generator().manual_seed(0)
    norms = (10.0 ** (torch.rand(3000, generator=gen, dtype=torch.float64) * 9 - 3)).tolist()
    assert aggregates(norms) == torchmetrics_reference(norms)
    assert aggregates(norms)[0] != torch.tensor(sum(norms) / len(norms), dtype=torch.float32).item()  # not exact


def test_the_metrics_start_again_after_an_epoch() -> None:
    totals = EpochAggregates()
    for norm in (1.0, 3.0):
        totals.add(norm)
    totals.compute(torch.device("cpu"))
    totals.add(0.5)
    assert [v.item() for v in totals.compute(torch.device("cpu"))] == [0.5, 0.5]


def test_epoch_aggregates_round_as_float32_by_hand() -> None:
    assert aggregates([1.0, 2.0, 4.0]) == (torch.tensor(7 / 3, dtype=torch.float32).item(), 4.0)
    # 2**24 + 1 is not a float32: each addition rounds, so the ones are lost one by one
    assert aggregates([2.0**24, 1.0, 1.0])[0] == torch.tensor(2.0**24 / 3, dtype=torch.float32).item()


def _aggregate_on_rank(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        norms = [[1.5, 2.25, 7.0], [3.0, 0.125]][rank]  # different on each rank: the sync must combine them
        result = {"ours": aggregates(norms), "torchmetrics": torchmetrics_reference(norms)}  # both synced
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.ddp
@pytest.mark.timeout(120)
def test_epoch_aggregates_combine_the_ranks_as_torchmetrics_sync_does(tmp_path: Path) -> None:
    mp.start_processes(_aggregate_on_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2,
                       start_method="fork")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    expected = [torch.tensor(13.875 / 5, dtype=torch.float32).item(), 7.0]
    assert [r["ours"] for r in results] == [r["torchmetrics"] for r in results] == [expected, expected]


class ReadsTheNorm(pl.Callback):
    """A user's callback after the suite in the list: what ``trainer.callback_metrics`` holds at each batch's end."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, float]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        value = trainer.callback_metrics.get("grad_norm/total")
        if value is not None:
            self.seen.append((trainer.global_step, float(value)))


def test_the_logged_step_value_is_in_callback_metrics_as_the_logger_receives_it() -> None:
    """Where Lightning users look for a step value (``EarlyStopping(monitor=...)``, their own callbacks, the progress
    bar): the same value the logger receives, on the steps it is logged."""
    logger, reader = MemoryLogger(), ReadsTheNorm()
    fit(TinyRegressor(), [GradNormMonitor(), reader], logger=logger, log_every_n_steps=2, max_steps=8)
    logged = logger.metrics["grad_norm/total"]
    assert [step for step, _ in logged] == [1, 3, 5, 7]
    fresh = [(step - 1, value) for step, value in reader.seen if step % 2 == 0]  # global_step moved on by one
    assert fresh == logged  # bit for bit: the callback metric holds the logged float
