"""GradNormMonitor: log the gradient norm, correctly even where FP32 arithmetic overflows.

The epoch aggregates round as torchmetrics' ``MeanMetric`` and ``MaxMetric`` updated every step (float32 states) and
sync across ranks through torchmetrics' states; a step only adds its total on the host (:class:`EpochAggregates`).
"""

from __future__ import annotations

import math

import pytorch_lightning as pl
import torch
from torch import Tensor
from torchmetrics.aggregation import MaxMetric, SumMetric
from typing_extensions import override

from lightning_overflow._validation import check_bool, check_int, check_norm_type
from lightning_overflow.callbacks._base import SuiteCallback
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
        self._epoch: dict[int, EpochAggregates] = {}

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
        self._update_epoch(record)
        total_due, per_parameter_due = self._due_now(trainer, record.log_step)
        if total_due or per_parameter_due:
            self._log_step(trainer, record, total_due, per_parameter_due)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Every rank took in the same steps (the norms are all-reduced), so all of them enter the collectives.
        n_optimizers = len(trainer.optimizers)
        for index, aggregates in sorted(self._epoch.items()):
            mean, maximum = aggregates.compute(pl_module.device)
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
        if math.isinf(self.norm_type):  # the L2 norms are the step's own
            record.add(self._key(), tensor_norms([p.grad for p in record.params], self.norm_type))  # type: ignore[misc]

    def _key(self) -> str:
        return f"{type(self).__name__}.{id(self)}.norms"

    def _due_now(self, trainer: pl.Trainer, log_step: int) -> tuple[bool, bool]:
        """Whether the total, and the per-parameter norms, are due on the logging step ``log_step + 1``."""
        every = self.log_every_n_steps or max(int(trainer.log_every_n_steps), 1)
        step = log_step + 1
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
        # The step's own per-tensor norms: exact where some fast norm was not (and always for sharded gradients).
        exact = record.exact_grad_norms
        return record.total_norm, exact if exact is not None else record.value("grad_norms")

    def _update_epoch(self, record: StepHealth) -> None:
        total = record.total_norm if not math.isinf(self.norm_type) else self._inf_total(record)
        if not math.isfinite(total):
            return  # non-finite steps are the detector's business and never enter the statistics
        aggregates = self._epoch.get(record.optimizer_index)
        if aggregates is None:
            aggregates = self._epoch[record.optimizer_index] = EpochAggregates()
        aggregates.add(total)

    def _inf_total(self, record: StepHealth) -> float:
        norms = self._norms(record)
        return math.nan if norms is None else norms[0]

    def _log_step(self, trainer: pl.Trainer, record: StepHealth, total_due: bool, per_parameter_due: bool) -> None:
        norms = self._norms(record)
        if norms is None:
            return
        total, per_tensor = norms
        metrics = {record.metric_key(f"{self.prefix}/total"): total} if total_due else {}
        if per_parameter_due and per_tensor:
            metrics.update({record.metric_key(f"{self.prefix}/{name}"): v for name, v in zip(record.names, per_tensor)})
        self._log(trainer, metrics, record.log_step)


class EpochAggregates:
    """The mean and the maximum of one optimizer's finite total norms over an epoch, exactly as torchmetrics'
    ``MeanMetric`` and ``MaxMetric`` updated once per step give them (float32 states), synced across ranks when
    computed.

    A step costs a host addition, not a metric update (tens of microseconds of tensor operations each): the running
    sum is rounded to float32 after each value, as ``MeanMetric``'s state is (the float64 sum of two float32 values
    rounds to their float32 sum exactly). The sum, the count and the maximum enter torchmetrics' states once, in
    :meth:`compute`, for their sync across ranks; the mean is their float32 quotient, as ``MeanMetric.compute``
    divides.

    Example:
        >>> aggregates = EpochAggregates()
        >>> for norm in (1.0, 2.0, 4.0):
        ...     aggregates.add(norm)
        >>> [round(v.item(), 4) for v in aggregates.compute(torch.device("cpu"))]
        [2.3333, 4.0]
    """

    def __init__(self) -> None:
        self.total = SumMetric(nan_strategy="disable")
        self.count = SumMetric(nan_strategy="disable")
        self.maximum = MaxMetric(nan_strategy="disable")
        self._sum, self._count, self._max = 0.0, 0, -math.inf

    def add(self, value: float) -> None:
        self._sum = to_float32(self._sum + to_float32(value))
        self._count += 1
        self._max = max(self._max, value)

    def compute(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """``(mean, max)`` as float32 tensors on ``device``, every rank's values together (entered on every rank
        together: each metric's sync is a collective); then the metrics start again."""
        metrics = (self.total, self.count, self.maximum)
        for metric in metrics:  # where the ranks' collective can run (NCCL: the GPU)
            metric.to(device)
        if self._count:
            for metric, value in zip(metrics, (self._sum, float(self._count), self._max)):
                metric.update(torch.tensor(value, dtype=torch.float64, device=device))
        mean, maximum = self.total.compute() / self.count.compute(), self.maximum.compute()
        for metric in metrics:  # the next epoch's values on the host again
            metric.reset()
            metric.to("cpu")
        self._sum, self._count, self._max = 0.0, 0, -math.inf
        return mean, maximum
