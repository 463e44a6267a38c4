"""The suite in a plain PyTorch loop or under Lightning Fabric: :class:`Guard`.

The decisions are the Trainer callbacks' own: a :class:`Guard` drives the suite's callbacks (``default_callbacks()``
unless given others) through the hooks Lightning would call, in Lightning's order, with a small host object
(:class:`LoopHost`) standing where the Trainer stands. No rule is written twice: a skip, a clip, a backoff and a
rollback are those a ``Trainer(callbacks=default_callbacks())`` fit makes at the same steps.

One optimizer step of the loop::

    loss = compute_loss(model, batch)
    loss.backward()                  # or fabric.backward(loss); or scaler.scale(loss).backward()
    outcome = guard.step(loss)       # the hooks, then optimizer.step() (or not), scheduler.step(), zero_grad()

:meth:`Guard.step` runs, for the callbacks, what the Trainer runs after the backward pass:
``on_before_backward(loss)``, ``on_after_backward``, ``on_before_optimizer_step`` (where the suite judges the step:
skip, clip or nothing), then ``optimizer.step()`` unless the step was skipped (a skipped step is a true no-op: the
optimizer is not called, the scheduler is not stepped, the buffers the forward wrote are put back), the scheduler,
``on_train_batch_end`` (where ``LRBackoff`` and ``Rollback`` act on the batch's signals), ``zero_grad``, and
``on_train_batch_start`` of the next batch, before its forward pass (the buffers are copied there, so that a skip can
put them back). ``global_step`` counts every optimizer step, skipped or not, as the Trainer's does.

What ``guard.step(loss)`` cannot do: the guard is handed the loss, not the batch, so it cannot re-run a step. Hence
no **trials**: a suspicion of divergence (the loss settled far above its best, a trend, runaway weights) is answered
at once, with a backoff and a rollback, paced as a false alarm would be (see :mod:`lightning_overflow.policy`: "where
no trial can run"); and no **replay** of a non-finite step to name the layer that produced it. A certain fault
(inf/NaN loss, gradients or weights, steps that keep failing) is answered exactly as under the Trainer.

Hand the guard the batch instead, and it can: with ``Guard(..., loss_fn=loss_fn)``, :meth:`Guard.train_step` runs
the whole step (``loss_fn(model, batch)``, the backward pass, then what :meth:`Guard.step` does), so a trial's
candidate trains on each batch before the loop does (the random streams put back), and a non-finite step is
replayed, as under the Trainer. A side run (a candidate, a replay) calls ``loss_fn`` with the model without its DDP
wrapper, as the Trainer's side runs do, and Fabric's module as its forward with Fabric's precision.

Distributed: under ``torch.distributed`` (a ``DistributedDataParallel`` model, or Fabric with ``strategy="ddp"``)
every rank builds its guard alike and calls :meth:`Guard.step` at the same steps; the decision is the same on every
rank (one all-reduce a step), and a rollback restores every rank to the same snapshot.
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from pytorch_lightning.utilities.enums import GradClipAlgorithmType
from pytorch_lightning.utilities.types import LRSchedulerConfig
from torch import Tensor, nn

from lightning_overflow import _compat
from lightning_overflow._validation import check_choice, check_float, check_int, check_type
from lightning_overflow.callbacks import AutoClip, LRBackoff, NonFiniteDetector, Rollback
from lightning_overflow.callbacks.nonfinite_detector import answered_call
from lightning_overflow.composition import default_callbacks
from lightning_overflow.distributed import per_rank_values, ranks_where, world
from lightning_overflow.events import Event, log
from lightning_overflow.faulted_steps import FaultedStep
from lightning_overflow.health import HealthBoard, board_for
from lightning_overflow.numerics.norms import any_sharded
from lightning_overflow.training_state import own_optimizer_state
from lightning_overflow.training_step import signature_parameters

__all__ = ["Guard", "LoopHost", "PlainLoopStrategy", "StepOutcome"]


NO_TRIALS = (
    "Guard.step(loss) is handed the loss, not the batch: no candidate can train beside a plain loop"
)
NO_REPLAY = (
    "a plain loop's step is not replayed: Guard.step(loss) does not run the forward pass (guard.train_step(batch) "
    "does); check the batch of this step and the layers it runs through"
)

SCALER_SKIPPED = (
    "the GradScaler found inf/NaN gradients: it skipped the optimizer step and lowered its scale, as it does while it "
    "calibrates"
)


@dataclass
class StepOutcome:
    """What :meth:`Guard.step` did with one optimizer step.

    Attributes:
        step: the step's index (``global_step`` before it; every step counts, skipped or not). What the suite does
            at the end of the step (a backoff, a rollback) is journaled at ``step + 1``, the ``global_step`` a
            Trainer reads then, as under the Trainer.
        skipped: the step was a no-op (the optimizer was not called: the suite skipped it, or a GradScaler found
            inf/NaN gradients); ``skip_reason`` says why.
        clipped: the gradients were clipped (``AutoClip`` scaled them down).
        backed_off: the learning rate was backed off at the end of this step (``LRBackoff``).
        rolled_back: the training state was restored to a verified snapshot (``Rollback``); the weights, optimizer
            and scheduler state are the snapshot's now.
        restored_to: the step whose state the model holds now (``None`` where nothing was restored): that
            snapshot's, or after a trial's kept remedy, its snapshot's and the steps the remedy trained since. What a
            loop's own counters of the state (an iteration count its schedule reads) go back to, if they should.
        lr: every param group's learning rate after the step, as the next step trains with it.
        events: what the suite journaled during the step (the same lines as the journal file).
    """

    step: int
    skipped: bool = False
    skip_reason: str = ""
    clipped: bool = False
    backed_off: bool = False
    rolled_back: bool = False
    restored_to: int | None = None
    lr: list[float] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)


# ---- the host: what the suite reads of a Trainer ------------------------------------------------------------------
class PlainLoopStrategy:
    """The host's strategy: one device, or every rank of ``torch.distributed`` holding the whole model (DDP).

    Its class name is among :data:`~lightning_overflow._compat.REPLICATED_STRATEGIES`."""

    def __init__(self, root_device: torch.device, host: LoopHost) -> None:
        self.root_device = root_device
        self._host = host

    @property
    def lightning_module(self) -> nn.Module:
        return self._host.lightning_module

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self._host.lightning_module.state_dict()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return own_optimizer_state(optimizer)  # this rank's part: a check reads it, no checkpoint

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed():
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src=src)
        return holder[0]

    def all_reduce(self, tensor: Tensor, reduce_op: str = "sum") -> Tensor:
        if _distributed():
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
            if reduce_op in ("mean", "avg"):
                tensor /= dist.get_world_size()
        return tensor

    def barrier(self, name: str | None = None) -> None:
        if _distributed():
            dist.barrier()


class _Precision:
    """The host's precision plugin: the ``GradScaler`` of a mixed-precision loop, if any."""

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)

    def train_step_context(self) -> Any:
        return nullcontext()


class _EpochLoop:
    def __init__(self) -> None:
        self._batches_that_stepped = 0  # the step Lightning logs with (every optimizer step here)
        self._results: dict[str, Any] = {}

    def _should_accumulate(self) -> bool:
        return False


class _FitLoop:
    def __init__(self) -> None:
        self.epoch_loop = _EpochLoop()


class _LoggerConnector:
    def __init__(self, host: LoopHost) -> None:
        self._host = host

    @property
    def should_update_logs(self) -> bool:
        """As Lightning decides it: every ``log_every_n_steps``-th step, and once a stop was asked for."""
        host = self._host
        every = host.log_every_n_steps
        if every == 0:
            return False
        return (host.fit_loop.epoch_loop._batches_that_stepped + 1) % every == 0 or bool(host.should_stop)


class _LoopModule:
    """The user's module as the suite sees a LightningModule: every attribute is the module's own (its parameters,
    buffers, ``state_dict``, by the same names), with automatic optimization. Its ``training_step`` is the guard's
    ``loss_fn`` on the model as the loop gave it (a side run: a trial's candidate, a replay); without one, there is
    nothing to re-run."""

    automatic_optimization = True
    replay_step_code = "loss_fn"  # what a replay's message calls the code outside every module
    clip_in_model_order = True  # a plain loop's clip_grad_norm_(model.parameters()); Fabric's clips by groups

    def __init__(self, module: nn.Module, host: LoopHost) -> None:
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_host", host)
        object.__setattr__(self, "_side_run", None)  # (loss_fn, model): what a side run calls, where one can run
        object.__setattr__(self, "replay_unavailable", NO_REPLAY)

    def allow_side_runs(self, loss_fn: Callable[[nn.Module, Any], Tensor], model: nn.Module) -> None:
        object.__setattr__(self, "_side_run", (loss_fn, model))
        object.__setattr__(self, "replay_unavailable", "")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    @property
    def traced_module(self) -> nn.Module:
        """The module a replay's tracer hooks, layer by layer."""
        return self._module

    @property
    def device(self) -> torch.device:
        first = next(iter(self._module.parameters()), None)
        return first.device if first is not None else torch.device("cpu")

    def training_step(self, batch: Any, batch_idx: int = 0) -> Any:
        if self._side_run is None:
            raise RuntimeError(NO_REPLAY)
        loss_fn, model = self._side_run
        return loss_fn(model, batch)

    # The hooks of a LightningModule's automatic step that a trial's candidate steps through (Candidate.train_on):
    # the loop's own, as the guard runs it.
    def on_before_backward(self, loss: Tensor) -> None:
        pass

    def backward(self, loss: Tensor) -> None:
        loss.backward()

    def on_after_backward(self) -> None:
        pass

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        optimizer.step(closure=optimizer_closure)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """The loop's own clipping (``Guard(gradient_clip_val=...)``), as the loop would clip, in the order that
        sums the total norm: a plain loop's ``clip_grad_norm_(model.parameters())``, the model's parameters in the
        model's order (then any other the optimizer holds); under Fabric ``fabric.clip_gradients``, the optimizer's
        in its groups' order, as the Trainer's precision plugin does."""
        if not gradient_clip_val:
            return
        held = [p for group in optimizer.param_groups for p in group["params"]]
        if self.clip_in_model_order:
            ids = {id(p) for p in held}
            ordered = [p for p in self._module.parameters() if id(p) in ids]
            known = {id(p) for p in ordered}
            held = ordered + [p for p in held if id(p) not in known]
        params = [p for p in held if p.grad is not None]
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            nn.utils.clip_grad_value_(params, gradient_clip_val)
        else:
            nn.utils.clip_grad_norm_(params, gradient_clip_val)

    def log(self, name: str, value: Any, **_: Any) -> None:
        """What a callback logs through the module at an epoch's end goes to the host's loggers (rank 0)."""
        host = self._host
        if not host.loggers or host.global_rank != 0:
            return
        number = float(value.detach().float().mean()) if isinstance(value, Tensor) else float(value)
        for logger in host.loggers:
            logger.log_metrics({name: number}, step=host.fit_loop.epoch_loop._batches_that_stepped)

    def log_dict(self, values: dict[str, Any], **kwargs: Any) -> None:
        for name, value in values.items():
            self.log(name, value, **kwargs)


class LoopHost:
    """What the suite's callbacks read of a ``Trainer``, for a loop that has none (see :class:`Guard`).

    Attributes:
        global_step: optimizer steps so far (skipped ones included, as the Trainer counts them).
        current_epoch: the epoch (moved by :meth:`Guard.end_epoch`).
        optimizers: the (unwrapped) torch optimizer, in a list.
        lr_scheduler_configs: the scheduler, as Lightning configures it (``interval="step"`` or ``"epoch"``).
        callbacks: the suite callbacks the guard drives.
        loggers: a user-supplied Lightning logger, or none.
    """

    training = True
    arguments_of = "Guard"  # whose arguments a message about the loop's settings names
    accumulate_grad_batches = 1
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str | None = None

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        scheduler_interval: str,
        callbacks: list[Any],
        loggers: list[Any],
        scaler: Any,
        default_root_dir: str,
        log_every_n_steps: int,
    ) -> None:
        rank, world_size = world()
        self.global_rank = self.local_rank = rank
        self.node_rank = 0
        self.world_size = self.num_devices = world_size
        self.global_step = 0
        self.current_epoch = 0
        self.callbacks = callbacks
        self.loggers = loggers
        self.optimizers = [optimizer]
        self.lr_scheduler_configs = (
            [LRSchedulerConfig(scheduler, interval=scheduler_interval, reduce_on_plateau=_on_plateau(scheduler))]
            if scheduler is not None
            else []
        )
        self.lightning_module = _LoopModule(module, self)
        self.strategy = PlainLoopStrategy(self.lightning_module.device, self)
        self.precision_plugin = _Precision(scaler)
        self.fit_loop = _FitLoop()
        self._logger_connector = _LoggerConnector(self)
        self.callback_metrics: dict[str, Any] = {}
        self.progress_bar_metrics: dict[str, Any] = {}
        self.logged_metrics: dict[str, Any] = {}
        self.default_root_dir = default_root_dir
        self.log_every_n_steps = log_every_n_steps
        self.should_stop = False
        self.interrupted = False
        self.sanity_checking = False
        self.checkpoint_path: str | None = None

    @property
    def logger(self) -> Any:
        return self.loggers[0] if self.loggers else None

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def log_dir(self) -> str | None:
        logger = self.logger
        return str(logger.log_dir) if logger is not None and hasattr(logger, "log_dir") else self.default_root_dir

    def save_checkpoint(self, filepath: Any, weights_only: bool | None = None, storage_options: Any = None) -> None:
        """Written by :meth:`Guard.save_checkpoint` (``Rollback`` checks the state first: it guards this method)."""
        if self.global_rank == 0:
            torch.save(self._guard._checkpoint(), filepath)
        if _distributed():
            dist.barrier()

    _guard: Guard


_BATCH_HOOKS = frozenset(
    ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
     "on_before_zero_grad", "on_train_batch_end")
)  # fmt: skip


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _unwrap_module(model: nn.Module) -> nn.Module:
    """The module whose parameters the optimizer steps, by their own names: under Fabric's ``_FabricModule``,
    ``DistributedDataParallel`` and ``torch.compile``'s wrapper."""
    while True:
        inner = getattr(model, "_original_module", None)  # lightning.fabric.wrappers._FabricModule
        if inner is None:
            inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else None
        if inner is None:
            inner = getattr(model, "_orig_mod", None)  # torch.compile
        if not isinstance(inner, nn.Module) or inner is model:
            return model
        model = inner


class _ReplicaForward:
    """Whether the loop's ``DistributedDataParallel`` forward pass of this step completed (its reducer then awaits a
    backward that reaches every parameter, as the stand-in loss's does), with no unused parameters to find (with
    ``find_unused_parameters`` or ``static_graph``, the reducer has marked some ready already, and the stand-in's
    backward would mark them twice). A step that broke inside the forward pass left the reducer expecting nothing:
    a backward there would leave the other ranks waiting in their reduction, so its error stands."""

    def __init__(self, model: nn.Module) -> None:
        self.done = False
        replica = next((m for m in model.modules() if isinstance(m, nn.parallel.DistributedDataParallel)), None)
        self._usable = replica is not None and not replica.find_unused_parameters and not replica.static_graph
        self._handle = replica.register_forward_hook(self._completed) if replica is not None and self._usable else None

    @property
    def ready(self) -> bool:
        return self._usable and self.done

    def _completed(self, *_: Any) -> None:
        self.done = True

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def _side_run_model(model: nn.Module) -> Any:
    """What a side run (a trial's candidate, a replay) hands ``loss_fn`` for ``model``: the model itself, but never
    through ``DistributedDataParallel`` (its backward would enter the gradient reduction the live step's makes; a
    candidate averages its gradients itself), and Fabric's module as its forward alone (:class:`_FabricForward`)."""
    original = getattr(model, "_original_module", None)  # lightning.fabric.wrappers._FabricModule
    strategy = getattr(model, "_strategy", None)
    if isinstance(original, nn.Module) and strategy is not None:
        return _FabricForward(original, strategy.precision)
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


class _FabricForward:
    """Fabric's module for a side run: the forward of ``_FabricModule`` (the inputs converted to the precision, its
    autocast, the output converted back), on the module without the DDP wrapper, and without the check that
    ``fabric.backward`` runs the backward pass (under mixed precision Fabric requires it; a side run makes its own).
    Every other attribute is the module's."""

    def __init__(self, module: nn.Module, precision: Any) -> None:
        self._module = module
        self._precision = precision

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        precision = self._precision
        args, kwargs = precision.convert_input((args, kwargs))
        with precision.forward_context():
            output = self._module(*args, **kwargs)
        return precision.convert_output(output)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer behind Fabric's ``_FabricOptimizer``."""
    inner = getattr(optimizer, "_optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def _fabric_scaler(wrapped: Any) -> Any | None:
    """The ``GradScaler`` of Fabric's precision (``"16-mixed"``) behind a ``_FabricModule`` or ``_FabricOptimizer``,
    ``None`` otherwise (``MixedPrecision.scaler`` is public; lightning 2.6.6)."""
    precision = getattr(getattr(wrapped, "_strategy", None), "precision", None)
    return getattr(precision, "scaler", None)


def _needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` requires a closure (``LBFGS``): it evaluates the loss itself, several times a step."""
    closure = signature_parameters(optimizer.step).get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty


def _on_plateau(scheduler: Any) -> bool:
    """Whether ``scheduler`` steps on a watched value (``ReduceLROnPlateau``) rather than on a count."""
    return isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def _mean_over_ranks(metric: float | Tensor | None, device: torch.device) -> tuple[float, tuple[int, ...]]:
    """``(metric's mean over the ranks, the ranks that passed none)``. Under ``torch.distributed`` one all-reduce on
    ``device``, entered by every rank whether it has a value or not: a rank without one cannot leave the others
    waiting in it, and every rank learns alike that one is missing. A scheduler that steps on the mean decides alike
    on every rank."""
    size = world()[1]
    value = _number(metric)
    given = value is not None
    if size == 1:
        return (value, ()) if value is not None else (math.nan, (0,))
    parts = [torch.tensor(value if given else 0.0, dtype=torch.float64),
             torch.tensor(0.0 if given else 1.0, dtype=torch.float64)]  # fmt: skip
    summed = per_rank_values(parts, device)
    return sum(summed[:size]) / size, ranks_where(summed[size:], size)[0]


def _number(value: Any) -> float | None:
    """``value`` as a float (a number or a one-element tensor), ``None`` where it is none or not a number: a value
    that cannot be read is refused on every rank alike, after the all-reduce every rank enters."""
    if value is None or isinstance(value, (bool, str)):
        return None
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def _shown(value: Any) -> str:
    """A value in an error message: a number or a string as written, anything else by its type."""
    if isinstance(value, (int, float, str)):
        return f"{type(value).__name__} {value!r}"
    return f"a list of {len(value)}" if isinstance(value, (list, tuple)) else f"a {type(value).__name__}"


def _losses(loss: Any) -> list[Tensor]:
    """The step's losses: one tensor, or a non-empty sequence of them (the micro-batches' under accumulation)."""
    losses = [loss] if isinstance(loss, Tensor) else list(loss) if isinstance(loss, Sequence) else None
    if not losses or not all(isinstance(value, Tensor) for value in losses):
        raise TypeError(
            f"'loss' must be the loss tensor the backward pass started from, or a non-empty list of the micro-batches' "
            f"loss tensors (got {_shown(loss)}): pass the tensor, not loss.item()"
        )
    return losses


def _arguments_needed(method: Any) -> list[str]:
    """The names of the arguments a call of ``method`` cannot leave out (none where its signature cannot be read)."""
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p.name for p in signature_parameters(method).values()
            if p.default is inspect.Parameter.empty and p.kind not in kinds]  # fmt: skip


def _check_scheduler_optimizer(scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
    """A scheduler must schedule the guard's optimizer: a backoff scales the rates it sets, a rollback restores it."""
    own = getattr(scheduler, "optimizer", None)
    if isinstance(own, torch.optim.Optimizer) and _unwrap_optimizer(own) is not optimizer:  # Fabric's wrapper is one
        raise ValueError(
            f"'scheduler' schedules another optimizer (a {type(own).__name__}) than the guard's (a "
            f"{type(optimizer).__name__}): build it on the optimizer given to the guard"
        )


def _check_optimizer_params(optimizer: torch.optim.Optimizer, module: nn.Module) -> None:
    """The optimizer must step the model's parameters (some of its own, a learned loss weight, may be outside it)."""
    own = {id(p) for p in module.parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if params and own and not any(id(p) in own for p in params):
        raise ValueError(
            f"'optimizer' steps none of the model's parameters ({len(params)} tensors, none of the model's "
            f"{len(own)}): build it on model.parameters() of the model given to the guard"
        )


def _check_scaler(scaler: Any, fabric_scaler: Any) -> None:
    missing = [name for name in ("scale", "unscale_", "step", "update", "state_dict")
               if not callable(getattr(scaler, name, None))]  # fmt: skip
    if missing:
        raise TypeError(f"'scaler' must be a torch.amp.GradScaler or None (got {_shown(scaler)}, without "
                        f"{', '.join(missing)})")  # fmt: skip
    if fabric_scaler is not None and scaler is not fabric_scaler:
        raise ValueError(
            "'scaler' is another GradScaler than the one of Fabric's precision ('16-mixed'), which scales "
            "fabric.backward(loss): pass none, and the guard uses Fabric's"
        )


def _checked_callbacks(callbacks: Any) -> list[Any]:
    """The callbacks as a list of Lightning ``Callback`` instances (of either namespace; one alone too, as the Trainer
    takes it): a list inside the list (``[default_callbacks()]``) or a class (``[NonFiniteDetector]``) would otherwise
    leave the loop unprotected, or fail at the first hook."""
    items = [callbacks] if isinstance(callbacks, _compat.CALLBACK_BASES) else None
    if isinstance(callbacks, (list, tuple)):
        items = list(callbacks)
    if items is None:
        hint = ": call it, callbacks=default_callbacks()" if callable(callbacks) else ""
        raise TypeError(f"'callbacks' must be a list of Lightning callbacks or None (got {_shown(callbacks)}){hint}")
    for item in items:
        if not isinstance(item, _compat.CALLBACK_BASES):
            hint = (": pass the list itself, callbacks=default_callbacks()" if isinstance(item, (list, tuple))
                    else f": an instance, {item.__name__}()" if isinstance(item, type) else "")  # fmt: skip
            raise TypeError(f"'callbacks' must be a list of Lightning callbacks (got {_shown(item)} in it){hint}")
    return items


def _checked_state(state: Any) -> dict[str, Any] | None:
    """A guard's :meth:`Guard.state_dict`, checked before any callback loads from it."""
    if state is None:
        return None
    if not isinstance(state, dict) or not _count(state.get("global_step")):
        hint = (": pass the guard's part of the checkpoint, state=checkpoint['guard']"
                if isinstance(state, dict) and isinstance(state.get("guard"), dict) else "")  # fmt: skip
        step = state.get("global_step") if isinstance(state, dict) else None
        raise ValueError(
            "'state' must be a Guard.state_dict(), with its global_step a count of steps at least 0 (got "
            f"{_shown(state) if not isinstance(state, dict) else f'a dict with global_step={step!r}'}){hint}"
        )
    if not _count(state.get("current_epoch", 0)):
        raise ValueError("'state' must be a Guard.state_dict(), with its current_epoch a count of epochs at least 0 "
                         f"(got a dict with current_epoch={state['current_epoch']!r})")  # fmt: skip
    if not isinstance(state.get("callbacks", {}), dict):
        raise ValueError("'state' must be a Guard.state_dict(), with its callbacks each callback's state by its "
                         f"state_key (got a dict with callbacks={_shown(state['callbacks'])})")  # fmt: skip
    return state


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_strategy(model: nn.Module, module: nn.Module) -> None:
    """The plain loop supports one device and replicated DDP; a sharded model belongs to the Trainer's
    ``ModelParallelStrategy``."""
    strategy = getattr(model, "_strategy", None)  # a _FabricModule's
    name = type(strategy).__name__ if strategy is not None else ""
    if name and name not in ("SingleDeviceStrategy", "DDPStrategy"):
        raise NotImplementedError(
            f"Guard supports Fabric's single-device and DDP strategies (got {name}); a sharded model needs the "
            "Trainer with ModelParallelStrategy (FSDP2) and default_callbacks()"
        )
    if any_sharded(list(module.parameters())):
        raise NotImplementedError(
            "Guard does not support sharded parameters (DTensor): use the Trainer with ModelParallelStrategy (FSDP2) "
            "and default_callbacks()"
        )


# ---- the guard ------------------------------------------------------------------------------------------------------
class Guard:
    """The suite's callbacks in a plain PyTorch loop or under Lightning Fabric (see the module docstring).

    Args:
        model: the model the loop trains (a ``DistributedDataParallel`` model, or what ``fabric.setup`` returned:
            the guard looks through the wrapper).
        optimizer: its optimizer (or Fabric's wrapper of it). The guard calls its ``step()`` and
            ``zero_grad(set_to_none=True)``; one whose ``step`` needs a closure (``LBFGS``) is refused.
        scheduler: a learning-rate scheduler the guard steps: after every optimizer step that was not skipped
            (``scheduler_interval="step"``, the default), or at :meth:`end_epoch` (``"epoch"``). Step no other
            scheduler of this optimizer yourself: ``LRBackoff`` scales the one it knows. A ``ReduceLROnPlateau``
            steps on the value it watches: build the guard with ``scheduler_interval="epoch"`` and hand the value to
            ``guard.end_epoch(metric)``.
        callbacks: the suite callbacks (default: ``default_callbacks()``). Another callback in the list is called
            too, with the host as its trainer: it finds there only what the suite reads of a Trainer.
        logger: a Lightning logger (``CSVLogger``, ``TensorBoardLogger``...) for the suite's metrics and, beside its
            files, the journal; without one the journal goes to ``default_root_dir``.
        scaler: the ``torch.amp.GradScaler`` of a mixed-precision loop that calls ``scaler.scale(loss).backward()``:
            the guard unscales the gradients before it judges them and steps through the scaler. Under Fabric's
            ``precision="16-mixed"`` the guard finds Fabric's own (pass none, or that one) and lets Fabric's optimizer
            step and update it.
        default_root_dir: where the journal goes without a logger (default: the working directory).
        log_every_n_steps: how often the suite's metrics go to the logger (as ``Trainer(log_every_n_steps=...)``).
        state: a :meth:`state_dict` of the guard of the run this one resumes (from :meth:`save_checkpoint`'s file):
            the step count and every callback's state, loaded between the callbacks' ``setup`` and the start of
            training, as a Trainer resumes from a checkpoint. Load the model, optimizer and scheduler yourself first.
        loss_fn: ``loss_fn(model, batch) -> loss``, the loss of one batch computed with ``model`` (as given here):
            the guard then runs each step itself (:meth:`train_step`), and a trial's candidate and a replay run it
            too. Without it, the loop calls :meth:`step`.
        backward: ``backward(loss)``, the backward pass of :meth:`train_step` (``fabric.backward`` under Fabric);
            default ``scaler.scale(loss).backward()`` with a scaler, else ``loss.backward()``.
        gradient_clip_val: the loop's own clipping, as ``Trainer(gradient_clip_val=...)`` (the ``max_norm`` of
            ``clip_grad_norm_`` or ``fabric.clip_gradients``): the guard clips where the Trainer does, after the suite
            judged the step and before ``optimizer.step()``, and a skipped step is not clipped. Clip here, not before
            :meth:`step`: clipped first, an overflowed gradient reaches the suite as NaN everywhere and the true norm
            is lost. ``AutoClip`` then acts as it does beside the Trainer's clipping (``default_callbacks()``
            leaves the gradients to it; ``AutoClip()`` refuses the double clipping). Default ``None``: no clipping of
            the loop's own.
        gradient_clip_algorithm: ``"norm"`` (default: the total norm, ``clip_grad_norm_``) or ``"value"`` (each
            element, ``clip_grad_value_``), as the Trainer's argument.

    Example:
        >>> model = torch.nn.Linear(4, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> x, y = torch.randn(8, 4), torch.randn(8, 1)
        >>> with Guard(model, optimizer, default_root_dir="/tmp/guard_doctest") as guard:
        ...     for _ in range(3):
        ...         loss = torch.nn.functional.mse_loss(model(x), y)
        ...         loss.backward()
        ...         outcome = guard.step(loss)
        >>> guard.global_step, outcome.skipped
        (3, False)
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        callbacks: Sequence[Any] | None = None,
        *,
        scheduler_interval: str = "step",
        logger: Any = None,
        scaler: Any = None,
        default_root_dir: str | os.PathLike[str] | None = None,
        log_every_n_steps: int = 50,
        state: dict[str, Any] | None = None,
        loss_fn: Callable[[nn.Module, Any], Tensor] | None = None,
        backward: Callable[[Tensor], Any] | None = None,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
    ) -> None:
        check_type("model", model, nn.Module, "a torch.nn.Module")
        gradient_clip_val = check_float("gradient_clip_val", gradient_clip_val, low=0.0, optional=True)
        check_choice("gradient_clip_algorithm", gradient_clip_algorithm, ("norm", "value"))
        for name, value in (("loss_fn", loss_fn), ("backward", backward)):
            if value is not None and not callable(value):
                raise TypeError(f"'{name}' must be a function or None (got {_shown(value)})")
        if backward is not None and loss_fn is None:
            raise ValueError("'backward' is used by train_step only, which needs 'loss_fn' as well (got loss_fn=None)")
        if not isinstance(_unwrap_optimizer(optimizer), torch.optim.Optimizer):
            raise TypeError(
                f"'optimizer' must be a torch.optim.Optimizer or Fabric's wrapper of one (got {_shown(optimizer)}): "
                "a Guard steps one optimizer; a model with several (a GAN) needs the Trainer, under manual "
                "optimization"
            )
        if scheduler is not None and not (callable(getattr(scheduler, "step", None))
                                          and callable(getattr(scheduler, "state_dict", None))):  # fmt: skip
            raise TypeError(
                f"'scheduler' must be a learning-rate scheduler (with step() and state_dict()) or None (got "
                f"{_shown(scheduler)})"
            )
        check_choice("scheduler_interval", scheduler_interval, ("step", "epoch"))
        if _on_plateau(scheduler) and scheduler_interval != "epoch":
            raise ValueError(
                "a ReduceLROnPlateau scheduler steps on the value it watches, which guard.step(loss) is not given "
                f"(got scheduler_interval={scheduler_interval!r}): build the guard with scheduler_interval='epoch' and "
                "call guard.end_epoch(metric) with that value (a validation loss) at the end of each epoch"
            )
        needed = _arguments_needed(scheduler.step) if scheduler is not None and not _on_plateau(scheduler) else []
        if needed:
            raise ValueError(
                f"'scheduler' must step with no argument, as the guard steps it (got a {type(scheduler).__name__}, "
                f"whose step() needs {', '.join(map(repr, needed))}): a schedule stepped with a count (timm's "
                "step_update(num_updates)) stays the loop's; leave it out of the guard and step it yourself: the "
                "guard holds the rates it writes at the backed-off scale"
            )
        log_every_n_steps = check_int("log_every_n_steps", log_every_n_steps, minimum=0)
        check_type("default_root_dir", default_root_dir, (str, os.PathLike), "a path", optional=True)
        if default_root_dir is not None and Path(default_root_dir).exists() and not Path(default_root_dir).is_dir():
            raise ValueError(f"'default_root_dir' must be a directory, where the journal goes (got "
                             f"{str(default_root_dir)!r}, which is a file)")  # fmt: skip
        if logger is not None and not callable(getattr(logger, "log_metrics", None)):
            raise TypeError(f"'logger' must be a Lightning logger (CSVLogger, TensorBoardLogger...) or None (got "
                            f"{_shown(logger)})")  # fmt: skip
        inner = _unwrap_optimizer(optimizer)
        if _needs_closure(inner):
            raise TypeError(
                f"'optimizer' is a {type(inner).__name__}, whose step(closure) evaluates the loss itself, several "
                "times a step: a Guard steps the optimizer once with the gradients the loop computed. Train it with "
                "the Trainer and default_callbacks() (its LightningModule's training_step is the closure)"
            )
        _check_scheduler_optimizer(scheduler, inner)
        _check_optimizer_params(inner, _unwrap_module(model))
        fabric_scaler = _fabric_scaler(model) or _fabric_scaler(optimizer)
        if scaler is not None:
            _check_scaler(scaler, fabric_scaler)
        scaler = scaler if scaler is not None else fabric_scaler
        if callbacks is None:
            callbacks = default_callbacks()
        callbacks = _checked_callbacks(callbacks)
        state = _checked_state(state)
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        # Fabric's optimizer steps and updates the scaler of its precision itself (MixedPrecision.optimizer_step)
        self._scaler_in_step = scaler is not None and _fabric_scaler(optimizer) is scaler
        self.loss_fn = loss_fn
        self._backward = backward
        self._interval = scheduler_interval
        module = _unwrap_module(model)
        _check_strategy(model, module)
        self.callbacks = callbacks
        root = str(Path(default_root_dir)) if default_root_dir is not None else os.getcwd()
        self.host = LoopHost(module, _unwrap_optimizer(optimizer), scheduler, scheduler_interval, self.callbacks,
                             [logger] if logger is not None else [], scaler, root, log_every_n_steps)  # fmt: skip
        self.host._guard = self
        if gradient_clip_val is not None and gradient_clip_val > 0:  # 0 clips nothing, as under the Trainer
            self.host.gradient_clip_val = gradient_clip_val
            self.host.gradient_clip_algorithm = GradClipAlgorithmType(gradient_clip_algorithm)
            self.host.lightning_module.clip_in_model_order = _unwrap_optimizer(optimizer) is optimizer
        if loss_fn is not None:
            self.host.lightning_module.allow_side_runs(loss_fn, _side_run_model(model))
        self._batch_hooks: dict[str, list[Any]] = {}
        self._board: HealthBoard | None = None
        self._clippers = [cb for cb in self.callbacks if isinstance(cb, AutoClip)]
        self._backoffs = [cb for cb in self.callbacks if isinstance(cb, LRBackoff)]
        self._rollbacks = [cb for cb in self.callbacks if isinstance(cb, Rollback)]
        self._closed = False
        self._batch_idx = 0
        self._epoch_open = False
        self._replica_forward = _ReplicaForward(model) if loss_fn is not None else None
        self._start(state)

    # ---- the fit ------------------------------------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        """The module the suite checks and restores (the model without its wrappers)."""
        return self.host.lightning_module._module  # type: ignore[no-any-return]

    @property
    def global_step(self) -> int:
        return self.host.global_step

    @property
    def board(self) -> HealthBoard:
        """The board the callbacks share (their journal, the current step's record): the one they joined in
        ``setup``, found through the host's callbacks (the guard keeps no board of its own)."""
        board = self._board
        if board is None or board.owner is not self.host:
            board = self._board = board_for(self.host)
        return board

    @property
    def events(self) -> list[Event]:
        """Everything the suite journaled so far."""
        return list(self.board.journal.events)

    @property
    def journal_path(self) -> Path | None:
        """Where the journal goes: the file is written with the run's first event, so a run where nothing happened
        leaves none."""
        return self.board.journal.path

    def _hook(self, name: str, *args: Any) -> None:
        """Call ``name`` on every callback that implements it, in order, as Lightning does (a hook a suite callback
        muted for the fit is ``None`` and skipped). The per-batch hooks are looked up once per fit: the callbacks
        mute theirs in ``setup`` and give them back in ``teardown`` only."""
        hooks = self._batch_hooks.get(name)
        if hooks is None:
            hooks = [hook for callback in self.callbacks if callable(hook := getattr(callback, name, None))]
            if name in _BATCH_HOOKS:
                self._batch_hooks[name] = hooks
        host, module = self.host, self.host.lightning_module
        for hook in hooks:
            hook(host, module, *args)

    @contextmanager
    def _guarded(self) -> Iterator[None]:
        """An error raised inside the hooks ends the fit as the Trainer ends it: ``on_exception``, then teardown."""
        try:
            yield
        except BaseException as error:
            self._end_on(error)
            raise

    def _end_on(self, error: BaseException) -> None:
        """The callbacks hear of ``error`` (``on_exception``: Rollback restores a finite state), then the fit ends."""
        if self._closed:
            return
        self._closed = True  # before the hooks: an error they raise is not told twice
        self.host.interrupted = True
        try:
            self._hook("on_exception", error)
        finally:
            self._teardown()

    def _teardown(self) -> None:
        self._closed = True
        if self._replica_forward is not None:
            self._replica_forward.remove()
        self._hook("teardown", "fit")
        self._batch_hooks.clear()  # the callbacks give their muted hooks back in teardown

    def _start(self, state: dict[str, Any] | None) -> None:
        with self._guarded():
            self._hook("setup", "fit")
            if state is not None:
                self._load(state)
            self._hook("on_fit_start")
            self._hook("on_train_start")
            trials = self.board.trials
            if trials.config is not None and not trials.unavailable and self.loss_fn is None:
                trials.unavailable = NO_TRIALS  # no side run without the batch
                if self.host.global_rank == 0:
                    log.info(f"lightning_overflow: no trials in this loop ({NO_TRIALS}): a suspicion of divergence "
                             "backs off and rolls back at once")  # fmt: skip
            if self.loss_fn is None:
                self._begin_batch(None)  # before the first forward pass: the buffers are copied there

    def _begin_batch(self, batch: Any) -> None:
        if not self._epoch_open:
            self._hook("on_train_epoch_start")
            self._epoch_open = True
        self._hook("on_train_batch_start", batch, self._batch_idx)

    def step(self, loss: Tensor | Sequence[Tensor], batch: Any = None) -> StepOutcome:
        """Judge the step whose gradients the loop has just computed, then step (or skip) it.

        Call it once per optimizer step, after the backward pass(es), instead of ``optimizer.step()``,
        ``scheduler.step()`` and ``optimizer.zero_grad()``.

        Args:
            loss: the loss the backward pass started from (as computed, before any scaling), or, under gradient
                accumulation, the list of the micro-batches' losses.
            batch: the batch ``loss`` came from (under gradient accumulation, the list of the micro-batches, one
                per loss), read only if the step is inf/NaN: a batch that holds inf/NaN or values beyond 1e15 makes
                it a data fault, skipped and never held against the state. Without it, NaN rows in consecutive
                batches read as a state whose steps keep failing (backed off and rolled back).

        Returns:
            what happened (:class:`StepOutcome`). An error the suite raises (``DivergenceError``, a
            ``NonFiniteError`` under ``NonFiniteDetector(action="raise")``) ends the guard, as it ends a Trainer fit.
        """
        if self._closed:
            raise RuntimeError("this Guard is closed: build a new one to guard another run")
        if self.loss_fn is not None:
            raise RuntimeError(
                "this Guard was given loss_fn: it runs each step with guard.train_step(batch), which opens the batch "
                "before the forward pass; build it without loss_fn to call guard.step(loss)"
            )
        losses = _losses(loss)
        if batch is not None:
            self._show_batches(batch, len(losses))
        self._check_gradients()
        outcome = self._judge_and_step(losses)
        with self._guarded():
            self._begin_batch(None)  # the next batch, before its forward pass: the buffers are copied there
        return outcome

    def _show_batches(self, batch: Any, losses: int) -> None:
        """Hand the step's batches to the detectors (their words for a data fault: no replay after ``step``)."""
        if losses > 1 and not (isinstance(batch, (list, tuple)) and len(batch) == losses):
            kind = type(batch).__name__
            got = f"a {kind} of {len(batch)}" if isinstance(batch, (list, tuple)) else kind
            raise ValueError(f"'batch' must be the list of the {losses} micro-batches the {losses} losses came from, "
                             f"one per loss (got {got})")  # fmt: skip
        batches = list(batch) if losses > 1 else [batch]
        for callback in self.callbacks:
            if isinstance(callback, NonFiniteDetector):
                callback.hear_step_batches(batches, self._batch_idx)

    def train_step(self, batch: Any) -> StepOutcome:
        """Run one optimizer step on ``batch``: ``loss_fn(model, batch)``, its backward pass (``backward(loss)`` if
        given, ``scaler.scale(loss).backward()`` with a scaler, else ``loss.backward()``), then what :meth:`step`
        does. Before the forward pass, a trial's candidate trains on the batch (the random streams put back), and the
        batch is kept for a replay should the step be non-finite: a suspicion is tried, as under the Trainer.

        Returns:
            what happened (:class:`StepOutcome`), as :meth:`step` returns it.
        """
        if self._closed:
            raise RuntimeError("this Guard is closed: build a new one to guard another run")
        if self.loss_fn is None:
            raise RuntimeError(
                "Guard.train_step(batch) needs Guard(..., loss_fn=...): the loss of a batch, loss_fn(model, batch); "
                "or call loss.backward() and guard.step(loss) yourself"
            )
        with self._guarded():
            self._begin_batch(batch)
            loss = self._loss_of(batch)
            if not isinstance(loss, Tensor):
                raise TypeError(f"'loss_fn' must return the loss tensor of the batch (got {_shown(loss)})")
            if self._backward is not None:
                self._backward(loss)
            elif self.scaler is not None:
                self.scaler.scale(loss).backward()
            else:
                loss.backward()
        self._check_gradients()
        return self._judge_and_step([loss])

    def _loss_of(self, batch: Any) -> Tensor:
        """``loss_fn(model, batch)``; a step that a bad value broke (it raised on an inf/NaN, or its loss came back cut
        from the graph) is answered as an inf/NaN loss, as ``NonFiniteDetector`` answers it under the Trainer
        (:func:`~lightning_overflow.callbacks.nonfinite_detector.answered_call`)."""
        loss_fn, model = self.loss_fn, self.model
        assert loss_fn is not None
        if self._replica_forward is not None:
            self._replica_forward.done = False
        loss: Tensor = answered_call(lambda: loss_fn(model, batch), self.module, batch, self._answers)
        return loss

    def _answers(self, faulted: FaultedStep) -> bool:
        """Whether the guard's ``NonFiniteDetector`` answers the step (none: the error stands). Across processes only
        where :class:`_ReplicaForward` says DDP's reducer awaits the stand-in's backward: then every rank's backward
        enters the same gradient reduction, and every rank skips the step alike."""
        if world()[1] > 1 and not (self._replica_forward is not None and self._replica_forward.ready):
            return False
        heard = [cb._hear_faulted(faulted) for cb in self.callbacks if isinstance(cb, NonFiniteDetector)]
        return bool(heard) and all(heard)

    def _check_gradients(self) -> None:
        if not any(p.grad is not None for group in self.host.optimizers[0].param_groups for p in group["params"]):
            raise RuntimeError(
                f"Guard.step at step {self.host.global_step}: no parameter of the optimizer has a gradient, so there "
                "is nothing to judge or step. Call loss.backward() (fabric.backward(loss), scaler.scale(loss)"
                ".backward()) before guard.step(loss), and zero_grad() nowhere else (the guard does it after the step)"
            )
        if self.scaler is not None and _compat.scaler_unscaled(self.scaler, self.host.optimizers[0]):
            raise RuntimeError(
                f"Guard.step at step {self.host.global_step}: the GradScaler's unscale_() was already called on this "
                "optimizer since its last update(), and the guard unscales the gradients itself, so that the suite "
                "judges the true ones. Remove the loop's scaler.unscale_(optimizer) (and the clipping after it, "
                "clip_grad_norm_ or fabric.clip_gradients): clip with Guard(gradient_clip_val=...), where the guard "
                "clips after judging the step"
            )

    def _judge_and_step(self, losses: list[Tensor]) -> StepOutcome:
        host, board = self.host, self.board
        step = host.global_step
        events = board.journal.events
        journaled = len(events)
        counts = self._counts()
        with self._guarded():
            scaler = self.scaler
            for value in losses:
                # The Trainer's hook receives the loss the backward pass started from, scaled under a GradScaler
                self._hook("on_before_backward", scaler.scale(value.detach()) if scaler is not None else value)
            self._hook("on_after_backward")
            if scaler is not None:
                scaler.unscale_(host.optimizers[0])  # the suite judges the true gradients, as under the Trainer
            self._hook("on_before_optimizer_step", host.optimizers[0])
            record = board.current
            judged = record is not None and record.step == step
            skipped = judged and record.skipped
            if not skipped:
                host.lightning_module.configure_gradient_clipping(
                    host.optimizers[0], host.gradient_clip_val, host.gradient_clip_algorithm
                )
            scaling = scaler is not None and getattr(scaler, "is_enabled", lambda: True)()
            # Whether the scaler skips the step itself: the record's gradients tell it without a read; where no
            # callback judged the step, the scaler's scale falls
            scale = scaler.get_scale() if scaling and not judged else None
            # With a scaler the optimizer is stepped through it even on a skip: a skipped step has no gradients left,
            # so the scaler's step is a no-op, and its update lowers the scale where the unscale found inf/NaN.
            if self._scaler_in_step:
                self.optimizer.step()
            elif scaler is not None:
                scaler.step(self.optimizer)
                scaler.update()
            elif not skipped:
                self.optimizer.step()
            overflowed = scaling and not skipped and (not record.grads_finite if judged else scaler.get_scale() < scale)
            host.global_step += 1
            if self.scheduler is not None and self._interval == "step" and not skipped:
                self.scheduler.step()
            self._hook("on_train_batch_end", {"loss": losses[-1]}, None, self._batch_idx)
            self._hook("on_before_zero_grad", host.optimizers[0])
            self.optimizer.zero_grad(set_to_none=True)
            host.fit_loop.epoch_loop._batches_that_stepped += 1
            self._batch_idx += 1
        after = self._counts()
        reason = record.skip_reason if skipped and record is not None else SCALER_SKIPPED if overflowed else ""
        check = record.state_check if judged and record is not None else None
        if overflowed and check is not None and not check.finite:  # no calibration: the state gave those gradients
            reason = f"the {check.what} held inf/NaN, and so did the gradients: the GradScaler skipped the optimizer " \
                     "step"
        return StepOutcome(
            step=step,
            skipped=skipped or overflowed,
            skip_reason=reason,
            clipped=after[0] > counts[0],
            backed_off=after[1] > counts[1],
            rolled_back=after[2] > counts[2],
            restored_to=self._restored_to(events[journaled:]) if after[2] > counts[2] else None,
            lr=[float(group["lr"]) for group in host.optimizers[0].param_groups],
            events=events[journaled:] if len(events) > journaled else [],
        )

    def _restored_to(self, events: list[Event]) -> int | None:
        """The step whose state the last rollback made (during the step that journaled ``events``) left: its
        snapshot's, and for a trial's kept remedy the steps that remedy trained from there."""
        last = [rollback.history[-1] for rollback in self._rollbacks if rollback.history]
        if not last:
            return None
        entry = max(last, key=lambda entry: entry["step"])
        trained = 0
        if entry["source"] == "trial":
            kept = [e for e in events if e.kind == "trial" and e.details.get("kept")]
            trained = int(kept[-1].details.get("steps", 0)) if kept else 0
        return int(entry["snapshot_step"]) + trained

    def _counts(self) -> tuple[int, int, int]:
        """How many steps were clipped, backoffs made and rollbacks made so far (the callbacks' public counts)."""
        clipped = sum(clipper.clipped_steps for clipper in self._clippers)
        backoffs = sum(1 for cb in self._backoffs for entry in cb.history if entry["action"] == "backoff")
        rollbacks = sum(rollback.rollbacks for rollback in self._rollbacks)
        return clipped, backoffs, rollbacks

    def end_epoch(self, metric: float | Tensor | None = None) -> None:
        """An epoch ended: the callbacks' epoch aggregates are logged, an ``interval="epoch"`` scheduler steps, and
        ``current_epoch`` moves on (optional: without it the whole run is epoch 0).

        Args:
            metric: the value a ``ReduceLROnPlateau`` scheduler watches (a validation loss), required with one and
                refused without. Under ``torch.distributed`` the scheduler steps on its mean over the ranks, so that
                every rank reduces its rate at the same epoch.
        """
        if self._closed:
            return
        plateau = self._interval == "epoch" and _on_plateau(self.scheduler)
        if metric is not None and not plateau:
            raise ValueError(
                f"'metric' is the value a ReduceLROnPlateau scheduler watches, and this guard steps none (got "
                f"metric={_shown(metric)}, scheduler="
                f"{type(self.scheduler).__name__ if self.scheduler is not None else None}, scheduler_interval="
                f"{self._interval!r})"
            )
        mean = math.nan
        if plateau:
            mean, missing = _mean_over_ranks(metric, self.host.strategy.root_device)
            if missing:
                where = f" rank(s) {', '.join(map(str, missing))} passed none:" if world()[1] > 1 else ""
                given = f" (got {_shown(metric)})" if metric is not None and _number(metric) is None else ""
                raise ValueError(
                    f"guard.end_epoch() at epoch {self.host.current_epoch}: the ReduceLROnPlateau scheduler steps on "
                    f"the value it watches:{where} pass it as a number{given}, guard.end_epoch(metric)"
                    + (" on every rank (it steps on the mean over the ranks)" if where else "")
                )
        with self._guarded():
            self._hook("on_train_epoch_end")
            if plateau:
                self.scheduler.step(mean)
                self.board.trials.note_plateau([[mean]])
            elif self.scheduler is not None and self._interval == "epoch":
                self.scheduler.step()
                self.board.trials.note_epoch_schedule()
            self.host.current_epoch += 1
            self._epoch_open = False
            self._batch_idx = 0

    def close(self) -> None:
        """End the run: the state is checked once more (inf/NaN left in it is restored or said), the fit summary is
        printed, the journal is written and uploaded (a run without any event has none), and the callbacks are
        released. Idempotent."""
        if self._closed:
            return
        with self._guarded():
            if self._epoch_open:
                self._hook("on_train_epoch_end")
                self._epoch_open = False
            self._hook("on_train_end")
            self._hook("on_fit_end")
            self._teardown()

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        if error is None:
            self.close()
        else:  # an error of the loop's own: the callbacks hear of it, as under the Trainer
            self._end_on(error)

    # ---- checkpoints ------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The guard's own state for a checkpoint: the step count and every callback's state (snapshots on disk are
        listed; those in memory are not kept)."""
        host = self.host
        return {
            "global_step": host.global_step,
            "current_epoch": host.current_epoch,
            "callbacks": {cb.state_key: cb.state_dict() for cb in self.callbacks if hasattr(cb, "state_key")},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Refused: a guard's state is loaded as it is built (``Guard(..., state=...)``), between its callbacks'
        setup and the start of training, as a Trainer resumes. The method is here so that a guard put in the state
        ``fabric.save`` writes is saved through :meth:`state_dict` (Fabric treats an object with both as stateful).

        Raises:
            RuntimeError: always, saying how to resume instead.
        """
        raise RuntimeError(
            "Guard.load_state_dict: a guard's state is loaded as the guard is built, before training starts, not into "
            f"a guard that has already started (a guard starts when it is built; this one is at step "
            f"{self.host.global_step}). Build the guard of the "
            "resumed run after loading the model and optimizer, with Guard(..., state=saved_guard_state). Under "
            "Fabric, leave the guard out of the state you pass to fabric.load and build it from what fabric.load "
            "returns: remainder = fabric.load(path, state); guard = Guard(model, optimizer, ..., "
            "state=remainder['guard'])."
        )

    def _load(self, state: dict[str, Any]) -> None:
        host = self.host
        host.global_step = int(state["global_step"])
        host.fit_loop.epoch_loop._batches_that_stepped = host.global_step
        host.current_epoch = int(state.get("current_epoch", 0))
        saved = state.get("callbacks", {})
        for callback in self.callbacks:
            key = getattr(callback, "state_key", None)
            if key in saved:
                callback.load_state_dict(saved[key])

    def save_checkpoint(self, filepath: str | os.PathLike[str]) -> None:
        """Write the model, optimizer, scheduler and guard state to ``filepath`` (rank 0). ``Rollback`` checks the
        state first: inf/NaN in it is rolled back before anything is written, or nothing is written."""
        with self._guarded():
            self.host.save_checkpoint(str(filepath))

    def _checkpoint(self) -> dict[str, Any]:
        return {
            "model": self.module.state_dict(),
            "optimizer": self.host.optimizers[0].state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "guard": self.state_dict(),
        }
