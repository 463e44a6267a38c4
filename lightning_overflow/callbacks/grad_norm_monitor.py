"""GradNormMonitor: log the gradient norm, correctly even where FP32 arithmetic overflows."""

from __future__ import annotations

import math

import pytorch_lightning as pl
import torch
from torch import Tensor
from typing_extensions import override

from lightning_overflow import _compat
from lightning_overflow._validation import check_bool, check_int, check_norm_type
from lightning_overflow.callbacks._base import SuiteCallback
from lightning_overflow.distributed import sum_and_read, world
from lightning_overflow.health import StepHealth, metric_key
from lightning_overflow.numerics import refine_norms, tensor_norms
from lightning_overflow.numerics._float64 import to_float32
from lightning_overflow.policy import StepAction

__all__ = ["GradNormMonitor"]


class GradNormMonitor(SuiteCallback):
    """Log the gradient norm of every optimizer step: pre-clip, after unscaling, overflow-safe.

    A monitor: it changes nothing in training. The norm is the one the suite computes once per optimizer step
    (shared with the other suite callbacks); finite gradients whose FP32 norm overflows (values above about 1.8e19)
    are logged with their true norm, where ``torch.nn.utils.clip_grad_norm_`` reports ``inf``.

    Args:
        norm_type: ``2`` (default) or ``inf``. The L2 norm is shared with the other callbacks; ``inf`` costs one
            extra pass over the gradients and is logged under ``grad_norm_inf/...`` instead of ``grad_norm/...``,
            so that an L2 monitor and an inf monitor in one Trainer each keep their own keys.
        per_parameter: also log each parameter's norm as ``grad_norm/<parameter name>``.
        log_every_n_steps: log the total every this many logging steps (Lightning's: training batches that stepped
            an optimizer, one per batch also under manual optimization; default: the Trainer's
            ``log_every_n_steps``).
        per_parameter_every_n_steps: log per-parameter norms every this many logging steps (default:
            ``log_every_n_steps``), independently of the total. Per-parameter keys cost more to log than to compute;
            space them out on big models.

    Logged keys (suffixed ``_opt<i>`` when the model has several optimizers; ``grad_norm_inf/`` for ``inf``):

    ===============================  ===============================================================
    key                              meaning
    ===============================  ===============================================================
    ``grad_norm/total``              norm of all gradients of the optimizer, before any clipping
    ``grad_norm/<parameter name>``   that parameter's gradient norm (``per_parameter=True``)
    ``grad_norm/total_epoch_mean``   mean of the finite totals over the epoch (synced across ranks)
    ``grad_norm/total_epoch_max``    max of the finite totals over the epoch (synced across ranks)
    ===============================  ===============================================================

    Example:
        >>> import pytorch_lightning as pl
        >>> trainer = pl.Trainer(callbacks=[GradNormMonitor(per_parameter=True)], logger=False)
    """

    def __init__(
        self,
        norm_type: float | str = 2.0,
        per_parameter: bool = False,
        log_every_n_steps: int | None = None,
        per_parameter_every_n_steps: int | None = None,
    ) -> None:
        self.norm_type = check_norm_type(norm_type)
        # Two monitors of different norm types in one Trainer never write into each other's keys.
        self.prefix = "grad_norm_inf" if math.isinf(self.norm_type) else "grad_norm"
        self.per_parameter = check_bool("per_parameter", per_parameter)
        self.log_every_n_steps = check_int("log_every_n_steps", log_every_n_steps, minimum=1, optional=True)
        self.per_parameter_every_n_steps = check_int(
            "per_parameter_every_n_steps", per_parameter_every_n_steps, minimum=1, optional=True
        )
        self._epoch: dict[int, _EpochTotals] = {}

    @property
    def state_key(self) -> str:
        try:
            return self._state_key  # built once: Lightning reads it often, its arguments never change
        except AttributeError:
            self._state_key: str = self._generate_state_key(norm_type=self.norm_type, per_parameter=self.per_parameter)
            return self._state_key

    # ---- wiring -----------------------------------------------------------------------------------------------
    @override
    def _after_step(self, trainer: pl.Trainer, record: StepHealth, action: StepAction) -> None:
        self._update_epoch(trainer.lightning_module, record)
        total_due, per_parameter_due = self._due_now(trainer)
        if trainer.loggers and (total_due or per_parameter_due):
            self._log_step(trainer, record, total_due, per_parameter_due)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Every rank took in the same steps (the norms are all-reduced), so all of them enter the collective.
        n_optimizers = len(trainer.optimizers)
        for index, (mean, maximum) in _epoch_aggregates(self._epoch, pl_module.device).items():
            pl_module.log(metric_key(f"{self.prefix}/total_epoch_mean", index, n_optimizers), mean, on_epoch=True)
            pl_module.log(metric_key(f"{self.prefix}/total_epoch_max", index, n_optimizers), maximum, on_epoch=True)
        self._epoch.clear()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().teardown(trainer, pl_module, stage)
        self._epoch.clear()

    # ---- the step's values ------------------------------------------------------------------------------------
    @override
    def _contribute(self, trainer: pl.Trainer, pl_module: pl.LightningModule, record: StepHealth) -> None:
        if math.isinf(self.norm_type):
            norms = tensor_norms([p.grad for p in record.params], self.norm_type)  # type: ignore[misc]
        elif trainer.loggers and self._due_now(trainer)[1]:
            norms = record.grad_norms
        else:
            return
        record.add(self._key(), norms)

    def _key(self) -> str:
        return f"{type(self).__name__}.{id(self)}.norms"

    def _due_now(self, trainer: pl.Trainer) -> tuple[bool, bool]:
        """Whether the total, and the per-parameter norms, are due on this logging step."""
        every = self.log_every_n_steps or max(int(trainer.log_every_n_steps), 1)
        step = _compat.batches_that_stepped(trainer) + 1
        per_parameter_every = self.per_parameter_every_n_steps or every
        return step % every == 0, self.per_parameter and step % per_parameter_every == 0

    def _norms(self, record: StepHealth) -> tuple[float, list[float]] | None:
        """``(total, per-tensor)`` in this monitor's norm type, exact; ``None`` when not read on this step."""
        key = self._key()
        if math.isinf(self.norm_type):
            if not record.has(key):
                return None
            fast = record.value(key)
            bad = [i for i, v in enumerate(fast) if not math.isfinite(v)]
            if bad:  # a non-finite max-abs is a real inf/NaN; refine only to be exact about which
                grads = [p.grad for p in record.params]
                fast = refine_norms(grads, torch.tensor(fast), bad, math.inf).tolist()  # type: ignore[arg-type]
            return (max(fast) if fast else 0.0), fast
        per_tensor = record.exact_grad_norms or (record.value(key) if record.has(key) else [])
        return record.total_norm, per_tensor

    def _update_epoch(self, pl_module: pl.LightningModule, record: StepHealth) -> None:
        norms = self._norms(record) if math.isinf(self.norm_type) else (record.total_norm, [])
        if norms is None or not math.isfinite(norms[0]):
            return  # non-finite steps are the detector's business and never enter the statistics
        totals = self._epoch.get(record.optimizer_index)
        if totals is None:
            totals = self._epoch[record.optimizer_index] = _EpochTotals()
        totals.add(norms[0])

    def _log_step(self, trainer: pl.Trainer, record: StepHealth, total_due: bool, per_parameter_due: bool) -> None:
        norms = self._norms(record)
        if norms is None:
            return
        total, per_tensor = norms
        metrics = {record.metric_key(f"{self.prefix}/total"): total} if total_due else {}
        if per_parameter_due and per_tensor:
            metrics.update({record.metric_key(f"{self.prefix}/{name}"): v for name, v in zip(record.names, per_tensor)})
        self._log(trainer, metrics, record.log_step)


class _EpochTotals:
    """Sum, count and maximum of one optimizer's finite totals over an epoch, in host floats.

    Rounded as ``torchmetrics``' ``MeanMetric`` and ``MaxMetric`` (in the default float32) would keep them: each
    norm rounded to float32, the sum rounded to float32 after each addition.
    """

    __slots__ = ("count", "maximum", "total")

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0
        self.maximum = -math.inf

    def add(self, value: float) -> None:
        value = to_float32(value)
        self.total = to_float32(self.total + value)  # a float64 sum of two float32 values, rounded: float32's sum
        self.count += 1
        self.maximum = max(self.maximum, value)


def _epoch_aggregates(epoch: dict[int, _EpochTotals], device: torch.device) -> dict[int, tuple[Tensor, Tensor]]:
    """``{optimizer index: (mean, max)}`` over every rank's steps, as float32 tensors on ``device``: one
    all-reduce for all optimizers (each rank's totals in its own slot), then the ranks' totals combined as
    ``torchmetrics`` combines its synced states (the float32 sums stacked and summed, the maxima maximised).

    Entered on every rank together.
    """
    rank, world_size = world()
    indices = sorted(epoch)
    local = [v for i in indices for v in (epoch[i].total, float(epoch[i].count), epoch[i].maximum)]
    per_rank = [[v] for v in local]
    if world_size > 1 and local:
        packed = torch.zeros(len(local) * world_size, dtype=torch.float64, device=device)
        packed[rank::world_size] = torch.tensor(local, dtype=torch.float64)
        summed = sum_and_read(packed)  # zeros elsewhere: each rank's value exact
        per_rank = [summed[k * world_size : (k + 1) * world_size] for k in range(len(local))]
    aggregates = {}
    for n, index in enumerate(indices):
        totals, counts, maxima = per_rank[3 * n : 3 * n + 3]
        total = torch.tensor(totals, dtype=torch.float32, device=device).sum(dim=0)
        count = torch.tensor(sum(counts), dtype=torch.float32, device=device)
        aggregates[index] = (total / count, torch.tensor(max(maxima), dtype=torch.float32, device=device))
    return aggregates
