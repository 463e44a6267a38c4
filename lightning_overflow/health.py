"""The per-step health record that every suite callback of one trainer shares.

Several callbacks need the same gradient norm and the same verdict. The first suite callback that asks in
``on_before_optimizer_step`` builds a :class:`StepHealth` for that optimizer step: per-tensor gradient norms on the
device, every suite callback's own device statistics (:meth:`SuiteCallback._contribute`), and the loss flags
gathered in ``on_before_backward``. All of it is packed into one small tensor, all-reduced once where it differs
between ranks, and read to the host once. Everything after that is decided on identical host values on every rank.

Boards live in a ``WeakKeyDictionary`` keyed by the trainer: nothing is written onto the trainer.
"""

from __future__ import annotations

import copy
import logging
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_overflow import _compat
from lightning_overflow.distributed import reduce_and_read
from lightning_overflow.events import JOURNAL_NAME, Event, Journal
from lightning_overflow.numerics import (
    FP32_MAX,
    nonfinite_indices,
    norm_status,
    optimizer_state_tensors,
    parameters_of,
    refine_norms,
    tensor_norms,
    total_norm,
)

if TYPE_CHECKING:
    import pytorch_lightning as pl

    from lightning_overflow.callbacks._base import SuiteCallback

__all__ = ["SIGNAL_KINDS", "HealthBoard", "Signal", "StateCheck", "StepHealth", "board_for", "nonfinite_labels"]

log = logging.getLogger("pytorch_lightning.lightning_overflow")

_BOARDS: weakref.WeakKeyDictionary[Any, HealthBoard] = weakref.WeakKeyDictionary()

MAX_NAMES = 5  # offending parameter names quoted in a message


def board_for(trainer: pl.Trainer) -> HealthBoard:
    """The board of ``trainer``, created on first use."""
    board = _BOARDS.get(trainer)
    if board is None:
        board = _BOARDS[trainer] = HealthBoard()
    return board


SIGNAL_KINDS = ("nonfinite", "nonfinite_burst", "nonfinite_state", "scaler_collapse", "loss_spike", "grad_spike")
"""What detectors report to interventions:

- ``nonfinite``: one step was non-finite (and skipped); isolated, it is not divergence.
- ``nonfinite_burst``: several non-finite steps close together.
- ``nonfinite_state``: the weights or the optimizer state hold inf/NaN.
- ``scaler_collapse``: the GradScaler kept overflowing or its scale collapsed.
- ``loss_spike`` / ``grad_spike``: a statistical spike of the loss / the gradient norm.
"""


@dataclass(frozen=True)
class Signal:
    """A detector's report for this training batch, identical on every rank.

    Attributes:
        kind: one of :data:`SIGNAL_KINDS`.
        step: the ``global_step`` of the optimizer step concerned.
        reason: a sentence for messages and the journal.
        source: the callback that raised it.
        optimizer_index: the optimizer concerned.
    """

    kind: str
    step: int
    reason: str
    source: str
    optimizer_index: int = 0


@dataclass(frozen=True)
class StateCheck:
    """Which ranks hold non-finite weights or optimizer state, and the local names of the offenders."""

    weight_ranks: tuple[int, ...]
    state_ranks: tuple[int, ...]
    weight_names: tuple[str, ...]
    state_names: tuple[str, ...]

    @property
    def finite(self) -> bool:
        return not self.weight_ranks and not self.state_ranks


class StepHealth:
    """What the suite knows about one optimizer step, identical on every rank once :meth:`read` has run.

    Attributes:
        step: ``trainer.global_step`` when the optimizer was about to step.
        optimizer_index: the optimizer's index in ``trainer.optimizers``.
        names: the names of the parameters that have gradients, in the order of ``grad_norms``.
        grad_norms: per-tensor fp32 gradient norms (device tensor, pre-clip, after unscale).
        total_norm: the exact total L2 norm of the gradients (host float, pre-clip).
        grad_status: ``"finite"``, ``"overflow"`` (finite values whose FP32 norm overflowed) or ``"nonfinite"``.
        loss_nonfinite_ranks: the ranks whose loss was inf/NaN in this step's backward passes.
        loss_mean: the mean finite training loss of this step over micro-batches and ranks (``nan`` if none).
        loss_scale: the GradScaler scale under ``16-mixed`` (``None`` otherwise).
        skipped: whether a suite callback skipped this step.
    """

    def __init__(
        self,
        board: HealthBoard,
        trainer: pl.Trainer,
        optimizer: torch.optim.Optimizer,
        params: list[Tensor],
        names: list[str],
    ) -> None:
        self._board = board
        self._trainer = weakref.ref(trainer)  # the board is keyed weakly by the trainer: never hold it strongly
        self.optimizer = optimizer
        self.step = int(trainer.global_step)
        self.optimizer_index = _index_of(trainer.optimizers, optimizer)
        self.rank = int(trainer.global_rank)
        self.world_size = int(trainer.world_size)
        self.params = params
        self.names = names
        self.grad_norms = tensor_norms([p.grad for p in params])  # type: ignore[misc]
        self._summed: dict[str, Tensor] = {}
        self._local: dict[str, Tensor] = {}
        self._values: dict[str, list[float]] = {}
        self.total_norm = math.nan
        self.grad_status = "finite"
        self.exact_grad_norms: list[float] | None = None
        self.loss_nonfinite_ranks: tuple[int, ...] = ()
        self.loss_mean = math.nan
        self.loss_scale: float | None = None
        self.skipped = False
        self.skip_reason = ""
        self._state_check: StateCheck | None = None

    # ---- filled before the read -------------------------------------------------------------------------------
    def add(self, name: str, value: Tensor, *, per_rank: bool = False, summed: bool = False) -> None:
        """Contribute device values to the one read of this step.

        Args:
            name: the key under which :meth:`value` returns them.
            value: a device tensor (any shape; flattened).
            per_rank: each rank's values land in its own slot, so every rank learns every rank's values
                (``value`` must be a scalar).
            summed: the values are summed across ranks (for counts and sums); otherwise they must already be
                identical on every rank (derived from all-reduced gradients).
        """
        flat = value.detach().reshape(-1).to(torch.float64)
        if per_rank:
            slots = flat.new_zeros(self.world_size)
            slots[self.rank] = flat.sum()
            self._summed[name] = slots
        elif summed:
            self._summed[name] = flat
        else:
            self._local[name] = flat

    def read(self) -> None:
        """The one host read (and the one all-reduce) of this step."""
        device = self.grad_norms.device
        summed = _cat(self._summed, device)
        local = _cat(self._local, device)
        summed_values, local_values = reduce_and_read(summed, local)
        self._unpack(self._summed, summed_values)
        self._unpack(self._local, local_values)

    def _unpack(self, parts: dict[str, Tensor], values: list[float]) -> None:
        offset = 0
        for name, tensor in parts.items():
            self._values[name] = values[offset : offset + tensor.numel()]
            offset += tensor.numel()

    def value(self, name: str) -> list[float]:
        """The host values contributed under ``name`` (summed over ranks where asked)."""
        return self._values[name]

    def has(self, name: str) -> bool:
        return name in self._values

    # ---- derived facts ----------------------------------------------------------------------------------------
    @property
    def grads_finite(self) -> bool:
        return self.grad_status != "nonfinite"

    @property
    def grads_beyond_fp32(self) -> bool:
        """Finite gradients whose total norm cannot be represented in FP32 (3.4e38)."""
        return self.grads_finite and self.total_norm > FP32_MAX

    @property
    def loss_finite(self) -> bool:
        return not self.loss_nonfinite_ranks

    def offending_grads(self) -> list[tuple[str, float, str]]:
        """``(name, exact norm, status)`` of the gradients that are not plain finite (empty on healthy steps)."""
        if self.exact_grad_norms is None:
            return []
        fast = self.grad_norms.tolist()
        return [
            (name, exact, norm_status(f, exact))
            for name, f, exact in zip(self.names, fast, self.exact_grad_norms)
            if not math.isfinite(f)
        ]

    def check_state(self) -> StateCheck:
        """Check the weights and optimizer state of this step's optimizer on every rank (cached).

        Entered on every rank together (the caller decides from values identical on all ranks): it ends with one
        all-reduce of per-rank flags.
        """
        if self._state_check is None:
            self._state_check = _check_state(self, self._board.names)
        return self._state_check

    def skip(self, reason: str) -> bool:
        """Turn this optimizer step into a true no-op (see :meth:`HealthBoard.skip_step`). ``False`` if already."""
        if self.skipped:
            return False
        self.skipped = True
        self.skip_reason = reason
        trainer = self._trainer()
        if trainer is None:
            raise RuntimeError("the trainer of this step record is gone")
        self._board.skip_step(trainer, self.optimizer)
        return True


class HealthBoard:
    """Everything the suite shares for one trainer: the current step record, loss flags, journal, counters."""

    def __init__(self) -> None:
        self.names: dict[int, str] = {}
        self.journal = Journal(None)
        self.current: StepHealth | None = None
        self._loss_flags: Tensor | None = None
        self._loss_sum: Tensor | None = None
        self._loss_count = 0
        self._last_loss: weakref.ref[Tensor] | None = None
        self._held: list[tuple[Any, dict[str, Any]]] = []
        self._held_groups: list[tuple[list[dict[str, Any]], list[dict[str, Any]]]] = []
        self._logged_step: int | None = None
        self._summarised = False
        self.signals: list[Signal] = []

    # ---- lifecycle --------------------------------------------------------------------------------------------
    def attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Set up for a fit: parameter names, the journal. Idempotent within a fit; every rank calls it."""
        self.names = {id(p): name for name, p in pl_module.named_parameters()}
        log_dir = trainer.log_dir  # a broadcast under DDP: every rank gets here in setup
        path = None if log_dir is None else f"{log_dir}/{JOURNAL_NAME}"
        if self.journal.path is None or str(self.journal.path) != str(path):
            self.journal = Journal(path, write=trainer.global_rank == 0)
        self.release()
        self._summarised = False
        self._logged_step = None

    def release(self) -> None:
        """Drop everything tied to the last fit's tensors (records, held schedulers, loss flags, signals)."""
        self.current = None
        self._loss_flags = self._loss_sum = None
        self._loss_count = 0
        self._last_loss = None
        self._held.clear()
        self._held_groups.clear()
        self.signals.clear()

    def record(self, event: Event) -> None:
        self.journal.record(event)

    # ---- signals between detectors and interventions ----------------------------------------------------------
    def begin_batch(self) -> None:
        """Forget the previous batch's signals (called by every suite callback's ``on_train_batch_start``)."""
        self.signals.clear()

    def signal(self, signal: Signal) -> None:
        """Report a signal for this batch; interventions read :attr:`signals` in ``on_train_batch_end``."""
        self.signals.append(signal)

    def after_restore(self, trainer: pl.Trainer, extras: dict[str, Any]) -> None:
        """Tell every suite callback that the training state was restored from a snapshot.

        Args:
            extras: what each callback's ``_snapshot_extra()`` returned when the snapshot was taken, by state key.
        """
        for callback in suite_callbacks(trainer):
            callback._after_restore(trainer, extras.get(callback.state_key, {}))

    def snapshot_extras(self, trainer: pl.Trainer) -> dict[str, Any]:
        """Every suite callback's ``_snapshot_extra()``, by state key, to store beside a snapshot."""
        return {cb.state_key: cb._snapshot_extra() for cb in suite_callbacks(trainer)}

    # ---- loss observation (on_before_backward) ----------------------------------------------------------------
    def observe_loss(self, trainer: pl.Trainer, loss: Tensor) -> None:
        """Accumulate this backward pass's loss flags on the device (no host read). Idempotent per loss tensor."""
        if self._last_loss is not None and self._last_loss() is loss:
            return
        self._last_loss = weakref.ref(loss)
        value = loss.detach().float()
        if value.numel() != 1:
            value = value.sum()
        value = value.reshape(())
        scaler = _compat.scaler_of(trainer)
        scale = _compat.scaler_scale(scaler) if scaler is not None else None
        if scale is not None:
            value = value / scale.to(value.device).reshape(())
        if trainer.lightning_module.automatic_optimization:
            value = value * trainer.accumulate_grad_batches  # Lightning divided it by the accumulation
        bad = ~torch.isfinite(value)
        if self._loss_flags is None or self._loss_sum is None:
            self._loss_flags = bad.float()
            self._loss_sum = torch.where(bad, torch.zeros_like(value), value)
        else:
            self._loss_flags = self._loss_flags + bad.float()
            self._loss_sum = self._loss_sum + torch.where(bad, torch.zeros_like(value), value)
        self._loss_count += 1

    # ---- the step record (on_before_optimizer_step) -----------------------------------------------------------
    def step_health(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> StepHealth:
        """The record of this optimizer step, built and read by the first suite callback that asks."""
        current = self.current
        if current is not None and current.step == trainer.global_step and current.optimizer is optimizer:
            return current
        params = [p for p in parameters_of(optimizer) if p.grad is not None]
        names = [self._name(pl_module, p) for p in params]
        record = StepHealth(self, trainer, optimizer, params, names)
        self._contribute_core(trainer, record)
        for callback in suite_callbacks(trainer):
            callback._contribute(trainer, pl_module, record)
        record.read()
        self._interpret(trainer, record)
        self.current = record
        return record

    def _name(self, pl_module: pl.LightningModule, param: Tensor) -> str:
        name = self.names.get(id(param))
        if name is None:
            self.names = {id(p): n for n, p in pl_module.named_parameters()}
            name = self.names.get(id(param), f"<unnamed {tuple(param.shape)}>")
        return name

    def _contribute_core(self, trainer: pl.Trainer, record: StepHealth) -> None:
        device = record.grad_norms.device
        zero = torch.zeros((), device=device)
        flags = zero if self._loss_flags is None else self._loss_flags.to(device)
        loss_sum = zero if self._loss_sum is None else self._loss_sum.to(device)
        record.add("loss_nonfinite", flags, per_rank=True)
        record.add("loss_sum", loss_sum, summed=True)
        record.add("loss_count", torch.full((), float(self._loss_count), device=device), summed=True)
        self._loss_flags = self._loss_sum = None
        self._loss_count = 0
        record.add("grad_total", total_norm(record.grad_norms))
        scaler = _compat.scaler_of(trainer)
        scale = _compat.scaler_scale(scaler) if scaler is not None else None
        if scale is not None:
            record.add("loss_scale", scale)

    def _interpret(self, trainer: pl.Trainer, record: StepHealth) -> None:
        record.loss_nonfinite_ranks = tuple(r for r, v in enumerate(record.value("loss_nonfinite")) if v != 0)
        # Non-finite losses add 0 to the sum: leave them out of the count too, or a NaN step reads as a loss of 0.
        count = record.value("loss_count")[0] - sum(record.value("loss_nonfinite"))
        record.loss_mean = record.value("loss_sum")[0] / count if count > 0 else math.nan
        if record.has("loss_scale"):
            record.loss_scale = record.value("loss_scale")[0]
        total = record.value("grad_total")[0]
        if math.isfinite(total):
            record.total_norm = total
            return
        # The rare path: some fast norm is inf/NaN. Tell spurious FP32 overflow from real inf/NaN, in float64.
        grads = [p.grad for p in record.params]
        fast = record.grad_norms.tolist()
        bad = [i for i, v in enumerate(fast) if not math.isfinite(v)]
        exact = refine_norms(grads, record.grad_norms, bad).tolist()  # type: ignore[arg-type]
        record.exact_grad_norms = exact
        statuses = [norm_status(f, e) for f, e in zip(fast, exact)]
        record.grad_status = "nonfinite" if "nonfinite" in statuses else "overflow"
        record.total_norm = total_norm(torch.tensor(exact, dtype=torch.float64)).item() if exact else 0.0

    # ---- skipping ---------------------------------------------------------------------------------------------
    def skip_step(self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> None:
        """Make the coming ``optimizer.step()`` a no-op and hold the step-interval LR schedulers where they are.

        ``zero_grad(set_to_none=True)`` leaves parameters, moments, weight decay and the optimizer's step counts
        untouched (zeroing the gradients would still apply momentum and weight decay). Lightning steps the
        schedulers anyway (Lightning #18828), so their state and the param-group hyperparameters are saved here and
        put back in ``on_train_batch_end`` by :meth:`settle`.
        """
        optimizer.zero_grad(set_to_none=True)
        if not trainer.lightning_module.automatic_optimization:
            return  # the user steps the schedulers; Lightning does not
        for config in trainer.lr_scheduler_configs:
            if config.interval != "step" or config.reduce_on_plateau:
                continue
            scheduler = config.scheduler
            self._held.append((scheduler, copy.deepcopy(scheduler.state_dict())))
            opt = scheduler.optimizer
            saved = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
            self._held_groups.append((opt.param_groups, saved))

    def settle(self, trainer: pl.Trainer) -> None:
        """Put held schedulers back; called first by every suite callback's ``on_train_batch_end`` (runs once)."""
        for scheduler, state in self._held:
            scheduler.load_state_dict(state)
        for groups, saved in self._held_groups:
            for group, values in zip(groups, saved):
                group.update(values)
        self._held.clear()
        self._held_groups.clear()

    # ---- counters and summary ---------------------------------------------------------------------------------
    def log_counters(self, trainer: pl.Trainer, caller: SuiteCallback) -> None:
        """Log the suite's cumulative counters once per logging step, through the Trainer's loggers.

        Only the last suite callback in the list logs them, so they include what every suite callback did in this
        batch, whatever the order of the list.
        """
        step = _compat.batches_that_stepped(trainer)
        if self._logged_step == step or not trainer.loggers or not _compat.should_update_logs(trainer):
            return
        if suite_callbacks(trainer)[-1] is not caller:
            return
        self._logged_step = step
        counters: dict[str, float] = {}
        for callback in suite_callbacks(trainer):
            for key, value in callback._counters().items():
                counters[key] = counters.get(key, 0.0) + float(value)
        if counters:
            for logger in trainer.loggers:
                logger.log_metrics(counters, step=step)

    def summarise(self, trainer: pl.Trainer) -> None:
        """One line at the end of fit when anything happened (rank 0 only; once)."""
        if self._summarised:
            return
        self._summarised = True
        summary = self.journal.summary()
        if summary and trainer.global_rank == 0:
            where = f"; journal: {self.journal.path}" if self.journal.path else ""
            log.info(f"lightning_overflow: {summary} during this fit{where}")


def suite_callbacks(trainer: pl.Trainer) -> list[SuiteCallback]:
    from lightning_overflow.callbacks._base import SuiteCallback

    return [cb for cb in trainer.callbacks if isinstance(cb, SuiteCallback)]  # type: ignore[attr-defined]


def _index_of(items: Sequence[Any], item: Any) -> int:
    for i, candidate in enumerate(items):
        if candidate is item:
            return i
    return 0


def _cat(parts: dict[str, Tensor], device: torch.device) -> Tensor:
    if not parts:
        return torch.zeros(0, dtype=torch.float64, device=device)
    return torch.cat([t.to(device) for t in parts.values()])


def _check_state(record: StepHealth, names: dict[int, str]) -> StateCheck:
    optimizer = record.optimizer
    params = parameters_of(optimizer)
    param_names = [names.get(id(p), f"<unnamed {tuple(p.shape)}>") for p in params]
    states, state_names = optimizer_state_tensors(optimizer, names)
    bad_weights = nonfinite_labels(params, param_names)
    bad_states = nonfinite_labels(states, state_names)
    flags = torch.zeros(2 * record.world_size, dtype=torch.float64, device=record.grad_norms.device)
    flags[record.rank] = float(bool(bad_weights))
    flags[record.world_size + record.rank] = float(bool(bad_states))
    values, _ = reduce_and_read(flags, flags.new_zeros(0))
    weight_ranks = tuple(r for r in range(record.world_size) if values[r])
    state_ranks = tuple(r for r in range(record.world_size) if values[record.world_size + r])
    return StateCheck(weight_ranks, state_ranks, tuple(bad_weights), tuple(bad_states))


def nonfinite_labels(tensors: list[Tensor], labels: list[str]) -> list[str]:
    """Labels of the tensors holding inf/NaN, by the snapshots' rule (largest magnitude: no spurious FP32 overflow
    of finite values). One host read."""
    with torch.no_grad():
        return [labels[i] for i in nonfinite_indices(tensors)]
