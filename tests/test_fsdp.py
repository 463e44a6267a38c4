"""FSDP2 (``ModelParallelStrategy`` with ``fully_shard`` in ``configure_model``) with 2 CPU processes on gloo.

Each rank holds half of every parameter, gradient and Adam moment (``DTensor`` shards; the last layer's ``(1, 32)``
weight and ``(1,)`` bias lie wholly on rank 0, rank 1's shards are empty). The suite must see the full model: the
global norm, the full parameters' norms under their own names, one verdict on every rank, a skip that changes no
shard, a state check that covers every shard, and clip thresholds identical on both ranks.

The strategy always relaunches the script (``strategy="ddp"`` style); here its processes are forked instead, as
``ddp_fork`` does for DDP: about 2 s a fit, where a relaunched script took 26 s on a busy 2-core machine (11 s of
it importing torch and Lightning in each process). Each rank writes what it saw to ``rank<r>.pt``; the test reads
both. A second case shards over a (2 x 1) mesh (HSDP): both ranks then hold replicas, which must count once.
"""

from __future__ import annotations

import math
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import MemoryLogger, tuned
from pytorch_lightning.strategies import FSDPStrategy, ModelParallelStrategy
from pytorch_lightning.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from lightning_overflow import (
    AutoClip,
    GradNormMonitor,
    LossSpikeDetector,
    NonFiniteDetector,
    Rollback,
    default_callbacks,
)
from lightning_overflow.health import board_for
from lightning_overflow.snapshot_store import load_snapshot
from lightning_overflow.testing import Fault, FaultInjector, TinyRegressor

pytestmark = [pytest.mark.ddp, pytest.mark.timeout(180)]

NAMES = ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]


# ---- running a fit on 2 forked processes ------------------------------------------------------------------------
class _ForkLauncher(_MultiProcessingLauncher):
    """Lightning's launcher of ``ddp_fork``. Rank 0 sends no weights back: they are shards, and each rank reports
    its own to the test."""

    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> _WorkerOutput | None:
        if self._strategy.local_rank != 0:
            return None
        return _WorkerOutput(None, None, trainer.state, results, self.get_extra_results(trainer))


class ForkedModelParallel(ModelParallelStrategy):
    """``ModelParallelStrategy`` whose processes are forked from the test's."""

    def __init__(self) -> None:
        # A collective that one rank never enters fails within a minute instead of hanging the test run.
        super().__init__(data_parallel_size=2, tensor_parallel_size=1, timeout=timedelta(seconds=60))

    def _configure_launcher(self) -> None:
        self._launcher = _ForkLauncher(self, start_method="fork")


class ShardedRegressor(TinyRegressor):
    """TinyRegressor with each linear layer and the whole model sharded by FSDP2 over the data-parallel ranks."""

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)


class HybridShardedRegressor(TinyRegressor):
    """TinyRegressor under HSDP: the 2 ranks replicate shards of size 1 (placements ``(Replicate(), Shard(0))``), so
    every rank holds a whole copy and each copy must count once."""

    def configure_model(self) -> None:
        mesh = self.device_mesh  # (data_parallel=2, tensor_parallel=1): replicate over the first, shard over the second
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for a DTensor: every rank calls it at the same point)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


class Recorder(pl.Callback):
    """Put after the suite: records, per step, what a test asserts on, and writes ``rank<r>.pt`` at the end of the
    fit (or where a suite callback raised)."""

    def __init__(self, directory: Path, watch: list[Any], logger: MemoryLogger | None = None) -> None:
        self.directory, self.watch, self.logger = directory, watch, logger
        self.steps: dict[int, dict[str, Any]] = {}
        for callback in watch:
            self._watch_errors(callback)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *_: Any) -> None:
        optimizer = trainer.optimizers[0]
        self.steps[int(trainer.global_step)] = {
            "weights": {n: full(p) for n, p in pl_module.named_parameters()},
            "shards": {n: local(p) for n, p in pl_module.named_parameters()},
            "moments": {k: local(v) for k, v in _moments(optimizer).items()},
            "batch": [t.clone() for t in batch],
        }

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        record = board_for(trainer).current
        if record is None:  # a fit without the suite: only what the optimizer is about to apply
            grads = {n: full(p.grad) for n, p in pl_module.named_parameters() if p.grad is not None}
            self.steps[int(trainer.global_step)].update(grads=grads)
            return
        assert record.step == trainer.global_step
        self.steps[record.step].update(
            total=record.total_norm,
            per_parameter=dict(zip(record.names, record.exact_grad_norms or [])),
            status=record.grad_status,
            skipped=record.skipped,
            # After the suite's action: the clipped gradients, or none at all on a skipped step.
            grads={n: full(p.grad) for n, p in pl_module.named_parameters() if p.grad is not None},
        )

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        step = self.steps[int(trainer.global_step) - 1]
        step["shards_after"] = {n: local(p) for n, p in pl_module.named_parameters()}
        step["moments_after"] = {k: local(v) for k, v in _moments(trainer.optimizers[0]).items()}

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.final = {n: full(p) for n, p in pl_module.named_parameters()}
        self.final_moments = {k: full(v) for k, v in _moments(trainer.optimizers[0]).items()}
        self._write(trainer, None)

    def _write(self, trainer: pl.Trainer, error: BaseException | None) -> None:
        report = {
            "rank": trainer.global_rank,
            "global_step": trainer.global_step,
            "steps": self.steps,
            "states": [cb.state_dict() for cb in self.watch],
            "metrics": {} if self.logger is None else self.logger.metrics,
            "final": getattr(self, "final", None),
            "final_moments": getattr(self, "final_moments", None),
            "snapshot_nbytes": [cb.snapshot_nbytes for cb in self.watch if hasattr(cb, "snapshot_nbytes")],
            "error": None if error is None else {"type": type(error).__name__, "message": str(error),
                                                 "kind": getattr(error, "kind", None),
                                                 "ranks": list(getattr(error, "ranks", ())),
                                                 "parameters": list(getattr(error, "parameters", ()))},
        }
        torch.save(report, self.directory / f"rank{trainer.global_rank}.pt")

    def _watch_errors(self, callback: Any) -> None:
        """Forked workers run without Lightning's exception handling: record errors where they are raised."""
        for hook in ("setup", "on_train_batch_start", "on_before_optimizer_step", "on_train_batch_end"):
            original = getattr(callback, hook)

            def wrapped(trainer: pl.Trainer, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
                try:
                    return _original(trainer, *args, **kwargs)
                except Exception as error:
                    self._write(trainer, error)
                    raise

            setattr(callback, hook, wrapped)


def _moments(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {f"{i}.{key}": value for i, state in enumerate(optimizer.state.values()) for key, value in state.items()}


def fit_sharded(callbacks: list[Any], directory: Path, *, logger: MemoryLogger | None = None,
                model: type[TinyRegressor] = ShardedRegressor, ckpt_path: str | None = None,
                **kwargs: Any) -> list[dict[str, Any]]:
    """Fit ``model`` (ShardedRegressor) on 2 forked processes; each rank's report, rank 0 first."""
    watch = [cb for cb in callbacks if hasattr(cb, "state_dict")]
    directory.mkdir(parents=True, exist_ok=True)
    options: dict[str, Any] = {
        "max_steps": 6, "accelerator": "cpu", "devices": 2, "strategy": ForkedModelParallel(),
        "logger": logger if logger is not None else False, "enable_checkpointing": False,
        "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0,
        "limit_val_batches": 0, "default_root_dir": str(directory),
    }
    options.update(kwargs)
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(callbacks=[*callbacks, Recorder(directory, watch, logger)], **options)
    error: BaseException | None = None
    try:
        trainer.fit(model(), ckpt_path=ckpt_path)
    except Exception as caught:  # a worker's exception, re-raised by the launcher
        error = caught
    files = [directory / f"rank{r}.pt" for r in range(2)]
    if error is not None and not all(f.exists() for f in files):
        raise error
    reports = [torch.load(f, weights_only=True) for f in files]
    if error is not None and all(r["error"] is None for r in reports):
        raise error
    return reports


class PoisonShard(pl.Callback):
    """Writes ``value`` into the first element of ``rank``'s local shard of a parameter's gradient (after the
    reduce-scatter: only that shard holds it) or of the parameter itself (before the batch), at ``step``."""

    def __init__(self, step: int, rank: int, target: str, parameter: str = "net.0.weight",
                 value: float = math.nan) -> None:
        self.step, self.rank, self.target, self.parameter, self.value = step, rank, target, parameter, value

    def _due(self, trainer: pl.Trainer) -> bool:
        return trainer.global_step == self.step and trainer.global_rank == self.rank

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        if self.target == "weight" and self._due(trainer):
            with torch.no_grad():
                _held(dict(pl_module.named_parameters())[self.parameter]).view(-1)[0] = self.value

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.target == "grad" and self._due(trainer):
            grad = dict(pl_module.named_parameters())[self.parameter].grad
            _held(grad).view(-1)[0] = self.value


def _held(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``t``: a DTensor's local shard (a view), a DDP replica itself."""
    return t.to_local() if isinstance(t, DTensor) else t


# ---- reference ----------------------------------------------------------------------------------------------------
def reference_norms(step: dict[str, Any], batches: list[list[torch.Tensor]]) -> dict[str, float]:
    """The gradient norms of the unsharded model in float64, with the step's weights, on both ranks' batches: FSDP2
    averages the ranks' gradients, as DDP does."""
    model = TinyRegressor().double()
    model.load_state_dict({n: w.double() for n, w in step["weights"].items()})
    losses = [nn.functional.mse_loss(model(x.double()), y.double()) for x, y in batches]
    (sum(losses) / len(losses)).backward()
    norms = {n: torch.linalg.vector_norm(p.grad).item() for n, p in model.named_parameters()}
    norms["total"] = math.sqrt(sum(v * v for v in norms.values()))
    return norms


# ---- norms ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("model", "shards"), [(ShardedRegressor, [(16, 4), (0, 32)]),
                                               (HybridShardedRegressor, [(32, 4), (1, 32)])], ids=["fsdp", "hsdp"])
def test_global_norm_equals_the_unsharded_models_in_float64(
    tmp_path: Path, model: type[TinyRegressor], shards: list[tuple[int, int]]
) -> None:
    logger = MemoryLogger(str(tmp_path))
    monitor = GradNormMonitor(per_parameter=True, log_every_n_steps=1)
    reports = fit_sharded([monitor, NonFiniteDetector(), LossSpikeDetector()], tmp_path, logger=logger,
                          model=model, log_every_n_steps=1)
    assert [r["error"] for r in reports] == [None, None]
    # FSDP: half of net.0.weight on each rank, all of net.2.weight on rank 0; HSDP: whole copies on both ranks.
    assert reports[1]["steps"][3]["shards"]["net.0.weight"].shape == shards[0]
    assert reports[1]["steps"][3]["shards"]["net.2.weight"].shape == shards[1]
    for step in range(6):
        steps = [r["steps"][step] for r in reports]
        reference = reference_norms(steps[0], [s["batch"] for s in steps])
        for seen in steps:
            assert seen["status"] == "finite" and not seen["skipped"]
            assert seen["total"] == pytest.approx(reference["total"], rel=2e-6, abs=0)  # FP32 gradients
            assert list(seen["per_parameter"]) == NAMES  # named as in the unsharded model
            for name in NAMES:
                assert seen["per_parameter"][name] == pytest.approx(reference[name], rel=2e-6, abs=0), name
        assert steps[0]["total"] == steps[1]["total"]  # identical, not just close
        assert steps[0]["per_parameter"] == steps[1]["per_parameter"]
    for report in reports:  # the logged keys: the full parameters' norms, under their own names
        metrics = report["metrics"]
        assert [v for _, v in metrics["grad_norm/total"]] == [report["steps"][s]["total"] for s in range(6)]
        assert [v for _, v in metrics["grad_norm/net.2.bias"]] == [
            report["steps"][s]["per_parameter"]["net.2.bias"] for s in range(6)
        ]
    assert reports[0]["metrics"] == reports[1]["metrics"]


def test_a_shard_whose_fp32_norm_overflows_gets_its_exact_norm_and_is_clipped_not_zeroed(tmp_path: Path) -> None:
    # 1e20 in rank 1's shard: finite, but its square overflows FP32, so that shard's fast norm is inf (the rare
    # path: a float64 recomputation of the shards and one more all-reduce).
    clip = AutoClip(mode="fixed", max_norm=1.0)
    reports = fit_sharded([NonFiniteDetector(), clip, PoisonShard(2, 1, "grad", value=1e20)], tmp_path)
    assert [r["error"] for r in reports] == [None, None]
    poison = float(torch.tensor(1e20))  # as FP32 holds it
    steps = [r["steps"][2] for r in reports]
    reference = reference_norms(steps[0], [s["batch"] for s in steps])
    for seen in steps:
        assert seen["status"] == "overflow" and not seen["skipped"]
        assert seen["total"] == pytest.approx(poison, rel=1e-12, abs=0)
        assert seen["per_parameter"]["net.0.weight"] == pytest.approx(poison, rel=1e-12, abs=0)
        for name in NAMES[1:]:  # the other parameters keep their own norms
            assert seen["per_parameter"][name] == pytest.approx(reference[name], rel=2e-6, abs=0), name
        after = math.sqrt(sum(torch.linalg.vector_norm(g.double()).item() ** 2 for g in seen["grads"].values()))
        assert after == pytest.approx(1.0, rel=1e-6)  # scaled to max_norm, not zeroed
        assert not torch.equal(seen["shards"]["net.0.weight"], seen["shards_after"]["net.0.weight"])
    assert steps[0]["per_parameter"] == steps[1]["per_parameter"]
    assert [r["states"][0]["skipped_steps"] for r in reports] == [0, 0]


# ---- the skip and the state check ------------------------------------------------------------------------------
def test_a_nan_in_one_shards_gradient_skips_the_step_on_both_ranks(tmp_path: Path) -> None:
    detector = NonFiniteDetector()
    reports = fit_sharded([detector, AutoClip(mode="zscore", warmup_steps=2), PoisonShard(3, 1, "grad")], tmp_path)
    assert [r["error"] for r in reports] == [None, None]
    for report in reports:
        step = report["steps"][3]
        assert step["skipped"] and step["status"] == "nonfinite" and math.isnan(step["total"])
        assert step["grads"] == {}  # dropped: the optimizer steps nothing
        for name, shard in step["shards"].items():  # every shard of every parameter unchanged, bit for bit
            assert torch.equal(shard, step["shards_after"][name]), name
        for key, moment in step["moments"].items():  # Adam's moments and step counts too
            assert torch.equal(moment, step["moments_after"][key]), key
        assert not torch.equal(report["steps"][2]["shards"]["net.0.weight"], report["steps"][2]["shards_after"]["net.0.weight"])
        assert report["states"][0]["skipped_steps"] == 1 and report["states"][0]["nonfinite_events"] == 1
        assert report["states"][1]["steps"] == 5  # AutoClip learned nothing from the skipped step
    assert reports[0]["states"] == reports[1]["states"]
    events = (tmp_path / "overflow_events.jsonl").read_text().splitlines()
    assert len(events) == 2  # one detection, one skip: journaled once, by rank 0
    assert "the gradients contained inf/NaN in net.0.weight (gradient norm nan) at step 3 (epoch 0)" in events[0]


def test_a_nan_weight_in_one_ranks_shard_is_found_by_every_rank(tmp_path: Path) -> None:
    detector = NonFiniteDetector(check_weights_every_n_steps=1, diagnose=False)
    reports = fit_sharded([detector, PoisonShard(4, 1, "weight", parameter="net.0.bias")], tmp_path)
    for report in reports:
        error = report["error"]
        assert error["type"] == "NonFiniteError" and error["kind"] == "weight" and error["ranks"] == [1]
        assert "the weights contained inf/NaN" in error["message"] and "at step 4" in error["message"]
        assert report["global_step"] == 4
    # Every rank names it, the one whose shard holds it and the other alike (it named none, and rank 0 writes the
    # journal and the checkpoints).
    assert [report["error"]["parameters"] for report in reports] == [["net.0.bias"], ["net.0.bias"]]


def test_fault_injector_writes_a_weight_fault_into_the_ranks_own_shard(tmp_path: Path) -> None:
    """FaultInjector wrote through the sharded parameter: a view that needs a collective only the faulting rank
    entered (gloo aborted the fit; NCCL would hang), or, on every rank, into a temporary (the fault never happened,
    and a test of it tested nothing). It writes into the rank's own shard now."""
    detector = NonFiniteDetector(check_weights_every_n_steps=1, diagnose=False)
    fault = FaultInjector(Fault(4, "nan_weight", rank=1, parameter="net.0.weight"))
    reports = fit_sharded([detector, fault], tmp_path)
    for report in reports:
        error = report["error"]
        assert error["type"] == "NonFiniteError" and error["ranks"] == [1] and error["parameters"] == ["net.0.weight"]


@pytest.mark.parametrize(
    ("fault", "refusal"),
    [(Fault(3, "nan_grad", rank=1), r"nan_grad.*cannot reach a sharded parameter's gradient \(FSDP2 writes it"),
     (Fault(3, "nan_weight", rank=1, parameter="net.2.bias"),
      r"names a parameter of which rank\(s\) 1 hold no element \(their shard is empty\)")],
    ids=["a_gradient_fault", "a_weight_fault_in_an_empty_shard"],
)  # fmt: skip
def test_fault_injector_refuses_a_fault_it_cannot_deliver_to_a_shard(
    tmp_path: Path, fault: Fault, refusal: str
) -> None:
    """A tensor hook on a sharded parameter never sees its gradient (FSDP2's reduce-scatter writes it): the fault
    was said fired and never happened. A weight fault in a shard a rank holds nothing of raised on that rank alone,
    at the fault's step (the others went on into their next collective). Both are refused at the fit's start, on
    every rank."""
    with pytest.raises(Exception, match=refusal):
        fit_sharded([NonFiniteDetector(), FaultInjector(fault)], tmp_path)


# ---- AutoClip -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["fixed", "percentile", "zscore"])
def test_autoclip_clips_by_the_global_norm_with_thresholds_identical_on_both_ranks(tmp_path: Path, mode: str) -> None:
    logger = MemoryLogger(str(tmp_path))
    options = {"fixed": {"max_norm": 1.0}, "percentile": {"percentile": 50.0}, "zscore": {"warmup_steps": 2}}[mode]
    # min_ratio 1, the paper's rule: clips as soon as the warm-up is over
    autoclip = tuned(AutoClip(mode=mode, **options), min_ratio=1.0)
    spike = FaultInjector(Fault(4, "loss_spike", factor=10.0))  # on both ranks: a gradient ten times the usual
    reports = fit_sharded([autoclip, spike], tmp_path, logger=logger, log_every_n_steps=1, max_steps=8)
    assert [r["error"] for r in reports] == [None, None]
    assert reports[0]["metrics"]["clip/threshold"] == reports[1]["metrics"]["clip/threshold"]
    assert reports[0]["metrics"]["clip/coef"] == reports[1]["metrics"]["clip/coef"]
    assert reports[0]["states"] == reports[1]["states"]
    thresholds = dict(reports[0]["metrics"]["clip/threshold"])  # logged at the global step (none in the warm-up)
    coefs = dict(reports[0]["metrics"]["clip/coef"])
    assert sorted(coefs) == list(range(8)) and coefs[4] < 0.5  # the spike was clipped
    for report in reports:
        for step, seen in report["steps"].items():
            threshold, coef = thresholds.get(step, math.inf), coefs[step]
            assert coef == pytest.approx(min(1.0, threshold / seen["total"]), rel=1e-12, abs=0)
            # The full gradients after the clip, gathered from the shards: scaled by that coefficient.
            after = math.sqrt(sum(torch.linalg.vector_norm(g.double()).item() ** 2 for g in seen["grads"].values()))
            assert after == pytest.approx(seen["total"] * coef, rel=1e-6, abs=0)


def test_agc_is_refused_under_sharding_with_what_to_use_instead() -> None:
    trainer = SimpleNamespace(strategy=ModelParallelStrategy(), gradient_clip_val=None)
    with pytest.raises(NotImplementedError) as caught:
        AutoClip(mode="agc").setup(trainer, TinyRegressor(), "fit")  # type: ignore[arg-type]
    assert str(caught.value) == (
        "AutoClip(mode='agc') does not support ModelParallelStrategy: a unit of a sharded parameter (a bias, a row "
        "split by tensor parallelism) can span the ranks, and its norm would be that of one rank's part. Use "
        "AutoClip(mode='zscore'), 'percentile' or 'fixed' (they clip by the global norm), or AGC under "
        "strategy='ddp'."
    )


# ---- Rollback -------------------------------------------------------------------------------------------------------
def fit_ddp(callbacks: list[Any], directory: Path, **kwargs: Any) -> list[dict[str, Any]]:
    """The same fit under DDP (``ddp_fork``, the unsharded model): the reference for the sharded one."""
    return fit_sharded(callbacks, directory, model=TinyRegressor, strategy="ddp_fork", **kwargs)


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Bit for bit, NaN where NaN."""
    assert list(a) == list(b)
    for name, x in a.items():
        y = b[name]
        assert torch.equal(torch.isnan(x), torch.isnan(y)) and torch.equal(x.nan_to_num(0.0), y.nan_to_num(0.0)), name


@pytest.mark.parametrize("model", [ShardedRegressor, HybridShardedRegressor], ids=["fsdp", "hsdp"])
def test_a_nan_weight_in_one_ranks_shard_rolls_back_to_identical_full_parameters(
    tmp_path: Path, model: type[TinyRegressor]
) -> None:
    def callbacks() -> list[Any]:
        detector = NonFiniteDetector(check_weights_every_n_steps=1, diagnose=False)
        return [detector, Rollback(every_n_steps=2), PoisonShard(4, 1, "weight")]

    sharded = fit_sharded(callbacks(), tmp_path / "fsdp", max_steps=8, model=model)
    replicated = fit_ddp(callbacks(), tmp_path / "ddp", max_steps=8)
    assert [r["error"] for r in sharded + replicated] == [None] * 4
    history = [{"step": 5, "reason": "nonfinite_state", "trigger_step": 4, "snapshot_step": 4, "source": "memory"}]
    for report in sharded + replicated:
        assert report["states"][1]["history"] == history and report["global_step"] == 8
    assert torch.isnan(sharded[1]["steps"][4]["shards"]["net.0.weight"]).any()  # rank 1's part, poisoned
    for report in sharded:
        restored = report["steps"][5]
        # Restored in place, bit for bit: every shard and every moment as the snapshot of step 4 held them.
        assert_same_tensors(restored["shards"], report["steps"][3]["shards_after"])
        assert_same_tensors(restored["moments"], report["steps"][3]["moments_after"])
    for step in (*range(4), 5, 6, 7):  # the full parameters, gathered: identical on both ranks and to the DDP run's
        assert_same_tensors(sharded[0]["steps"][step]["weights"], sharded[1]["steps"][step]["weights"])
        assert_same_tensors(sharded[0]["steps"][step]["weights"], replicated[0]["steps"][step]["weights"])
    assert_same_tensors(sharded[0]["final"], replicated[0]["final"])
    assert_same_tensors(sharded[0]["final_moments"], replicated[0]["final_moments"])


def test_a_sharded_rollback_to_the_start_clears_the_moments_and_training_goes_on(tmp_path: Path) -> None:
    # The snapshot of step 0 has no Adam state yet: the optimizer loads it (another shape than the live state).
    detector = NonFiniteDetector(check_weights_every_n_steps=1, diagnose=False)
    reports = fit_sharded([detector, Rollback(every_n_steps=100), PoisonShard(2, 1, "weight")], tmp_path)
    for report in reports:
        assert [(h["step"], h["snapshot_step"]) for h in report["states"][1]["history"]] == [(3, 0)]
        assert_same_tensors(report["steps"][3]["shards"], report["steps"][0]["shards"])
        assert report["steps"][3]["moments"] == {} and report["global_step"] == 6
        assert sorted(report["final_moments"]) == sorted(report["steps"][1]["moments"])  # state made anew
    assert_same_tensors(reports[0]["final"], reports[1]["final"])


def test_the_weight_growth_test_reads_the_norm_of_the_full_parameters_on_every_rank(tmp_path: Path) -> None:
    """Each rank adds its shards' squares: the norm every rank reads is that of the gathered parameters, as the
    unsharded DDP run reads it."""
    def callbacks() -> list[Any]:
        return [tuned(LossSpikeDetector(growth_every_n_steps=1), growth_window=4)]

    sharded = fit_sharded(callbacks(), tmp_path / "fsdp", max_steps=6)
    replicated = fit_ddp(callbacks(), tmp_path / "ddp", max_steps=6)
    samples = [r["states"][0]["growth"]["0"]["samples"] for r in sharded + replicated]
    assert [sample[0] for sample in samples[0]] == [1, 2, 3, 4, 5]  # those within the window of the last
    assert samples[0] == samples[1] and samples[2] == samples[3]
    for (step, norm, *_), (_, ddp_norm, *_) in zip(samples[0], samples[2]):
        weights = sharded[0]["steps"][step]["weights"]  # gathered as the batch began, before the step's update
        exact = math.sqrt(sum(float(w.double().square().sum()) for w in weights.values()))
        assert norm == pytest.approx(exact, rel=1e-6) and ddp_norm == pytest.approx(exact, rel=1e-6)


class ArmBound(pl.Callback):
    """Arms AutoClip's update bound at the end of one batch, on every rank, as a restore would."""

    def __init__(self, autoclip: AutoClip, step: int) -> None:
        self.autoclip, self.step = autoclip, step

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        if trainer.global_step == self.step:
            self.autoclip._bound_updates(trainer, 1, {0: math.inf})


def test_the_update_bound_weighs_the_full_parameters_on_every_rank(tmp_path: Path) -> None:
    """Arming the bound reads the weights' norm with one all-reduce of the shards' squares: every rank holds the
    norm of the gathered parameters, and the same bound."""
    autoclip = AutoClip()
    reports = fit_sharded([autoclip, ArmBound(autoclip, 3)], tmp_path, max_steps=5)
    bounds = [r["states"][0]["bounds"] for r in reports]
    assert bounds[0] == bounds[1] and list(bounds[0]) == [0] and bounds[0][0][0] == 0.01
    weights = reports[0]["steps"][3]["weights"]  # gathered as the batch after the arming began
    exact = math.sqrt(sum(float(w.double().square().sum()) for w in weights.values()))
    assert bounds[0][0][1] == pytest.approx(exact, rel=1e-6)


def test_default_callbacks_leave_a_healthy_sharded_fit_bit_identical(tmp_path: Path) -> None:
    suite = fit_sharded(default_callbacks(clip=None, snapshot_every_n_steps=2), tmp_path / "suite")
    bare = fit_sharded([], tmp_path / "bare")
    assert [r["error"] for r in suite] == [None, None]
    for with_suite, without in zip(suite, bare):
        assert_same_tensors(with_suite["final"], without["final"])
        assert_same_tensors(with_suite["final_moments"], without["final_moments"])
        for step in range(6):
            assert_same_tensors(with_suite["steps"][step]["grads"], without["steps"][step]["grads"])
    # Each rank keeps its own shards only: 2 snapshots of (weights + 2 Adam moments) in FP32, and 4 step counters.
    for report in suite:
        local_numel = sum(t.numel() for t in report["steps"][5]["shards_after"].values())
        assert report["snapshot_nbytes"] == [2 * (3 * 4 * local_numel + 4 * 4)]
    assert suite[0]["snapshot_nbytes"] == [2 * (3 * 4 * 113 + 16)]  # 64 + 16 + 32 + 1 elements on rank 0
    assert suite[1]["snapshot_nbytes"] == [2 * (3 * 4 * 80 + 16)]  # 64 + 16 (rank 1's shards of net.2 are empty)


def test_default_callbacks_under_fsdp2_skip_and_roll_back_as_under_ddp(tmp_path: Path) -> None:
    def run(fit: Any, directory: Path) -> list[dict[str, Any]]:
        suite = default_callbacks(snapshot_every_n_steps=2)
        return fit([*suite, PoisonShard(6, 1, "weight")], directory, max_steps=12, log_every_n_steps=1,
                   logger=MemoryLogger(str(directory)))

    sharded, replicated = run(fit_sharded, tmp_path / "fsdp"), run(fit_ddp, tmp_path / "ddp")
    assert [r["error"] for r in sharded + replicated] == [None] * 4
    # The same rollback at the same step to the same snapshot. Under DDP the replica-parity check (rank 1's weights
    # differ from rank 0's) names it first; under FSDP2 each shard exists once, and the state check finds the NaN.
    reasons = {"fsdp": "nonfinite_state", "ddp": "replica_mismatch"}
    for run_name, reports in (("fsdp", sharded), ("ddp", replicated)):
        for report in reports:
            history = report["states"][5]["history"]  # GradNormMonitor, NonFiniteDetector, ..., LRBackoff, Rollback
            assert [(h["step"], h["reason"], h["trigger_step"], h["snapshot_step"]) for h in history] == [
                (7, reasons[run_name], 6, 6)
            ]
    for fsdp, ddp in zip(sharded, replicated):
        # NonFiniteDetector's and LRBackoff's states, the spike counts (the running statistics of the norms differ
        # in the last bits: the global norm is summed in another order from the shards).
        assert (fsdp["states"][1], fsdp["states"][4]) == (ddp["states"][1], ddp["states"][4])
        spikes = [{k: r["states"][2][k] for k in ("loss_spikes", "grad_spikes")} for r in (fsdp, ddp)]
        assert spikes[0] == spikes[1] == {"loss_spikes": 0, "grad_spikes": 0}
        assert [fsdp["steps"][s]["skipped"] for s in range(12)] == [ddp["steps"][s]["skipped"] for s in range(12)]
        assert [fsdp["steps"][s]["total"] for s in range(12)] == pytest.approx(
            [ddp["steps"][s]["total"] for s in range(12)], rel=2e-6, abs=0, nan_ok=True
        )
        for step in (7, 11):  # after the rollback, the full parameters are the DDP run's, bit for bit
            assert_same_tensors(fsdp["steps"][step]["weights"], ddp["steps"][step]["weights"])
    assert_same_tensors(sharded[0]["final"], replicated[0]["final"])


# ---- strategies the suite refuses ----------------------------------------------------------------------------------
class DeepSpeedStrategy:
    """Named as Lightning's: deepspeed is not installed here, and Lightning runs it on CUDA only."""


@pytest.mark.parametrize("strategy", [FSDPStrategy(), DeepSpeedStrategy()], ids=["fsdp1", "deepspeed"])
def test_unsupported_sharded_strategies_are_refused_at_setup(strategy: Any) -> None:
    name = type(strategy).__name__
    for callback in (NonFiniteDetector(), GradNormMonitor(), AutoClip(), LossSpikeDetector()):
        with pytest.raises(NotImplementedError, match=f"^{type(callback).__name__} does not support {name}: ") as caught:
            callback.setup(SimpleNamespace(strategy=strategy, gradient_clip_val=None), TinyRegressor(), "fit")  # type: ignore[arg-type]
        assert "Supported: a single device, DDPStrategy" in str(caught.value)
        assert "ModelParallelStrategy (FSDP2: fully_shard in configure_model" in str(caught.value)


def test_sharded_disk_snapshots_are_each_ranks_shards_and_a_resumed_fit_rolls_back_to_them(tmp_path: Path) -> None:
    from pytorch_lightning.callbacks import ModelCheckpoint

    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    first = fit_sharded([NonFiniteDetector(), Rollback(every_n_steps=2, dirpath=tmp_path / "snaps"), checkpoints],
                        tmp_path / "first", max_steps=4, enable_checkpointing=True)
    assert sorted(p.name for p in (tmp_path / "snaps").iterdir()) == ["rank=0", "rank=1"]
    for rank, report in enumerate(first):
        _, payload = load_snapshot(tmp_path / "snaps" / f"rank={rank}" / "rollback-step=2.pt")
        assert (payload["rank"], payload["world_size"], payload["owners"]) == (rank, 2, {})
        assert_same_tensors(dict(payload["state"]["model"]), report["steps"][1]["shards_after"])
    ckpt = next((tmp_path / "ckpt").iterdir())
    detector = NonFiniteDetector(check_weights_every_n_steps=1, diagnose=False)
    rollback = Rollback(every_n_steps=2, dirpath=tmp_path / "snaps")
    resumed = fit_sharded([detector, rollback, PoisonShard(4, 1, "weight"), PoisonShard(5, 0, "weight")],
                          tmp_path / "resumed", max_steps=6, ckpt_path=str(ckpt))
    for rank, report in enumerate(resumed):
        history = report["states"][1]["history"]
        assert [(h["step"], h["snapshot_step"], h["source"]) for h in history] == [(5, 4, "disk"), (6, 2, "disk")]
    # The full parameters, identical on both ranks: the shards each rank wrote at step 2, before the restart.
    files = [tmp_path / "snaps" / f"rank={r}" / "rollback-step=2.pt" for r in (0, 1)]
    parts = [load_snapshot(f)[1]["state"]["model"] for f in files]
    expected = {name: torch.cat([parts[0][name], parts[1][name]]) for name in NAMES}  # Shard(0): rows in rank order
    assert_same_tensors(resumed[0]["final"], expected)
    assert_same_tensors(resumed[1]["final"], expected)


class ShardedLikelihoodRegressor(ShardedRegressor):
    """Scores a Normal likelihood (``torch.distributions`` checks its arguments); at step 3 every rank's batch holds
    a NaN, so every rank's ``training_step`` raises ``ValueError``."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.global_step == 3:
            batch[0][0, 0] = float("nan")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return -torch.distributions.Normal(self.net(x), 1.0, validate_args=True).log_prob(y).mean()


def test_a_step_that_raises_on_bad_values_is_not_answered_under_sharding(tmp_path: Path) -> None:
    """Under FSDP the module's error stands: a stand-in loss that skipped the layers on one rank would leave the other
    ranks waiting in the layers' gradient collectives."""
    with pytest.raises(Exception, match="Expected parameter loc"):
        fit_sharded([NonFiniteDetector()], tmp_path, model=ShardedLikelihoodRegressor)
