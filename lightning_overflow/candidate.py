"""A second training state beside the live one: kept on the side, trained or scored on the loop's own batches.

A trial (:mod:`lightning_overflow.trial`) runs two candidates on the same batches: the state the run would continue
from, and a remedy (the last verified snapshot at a lower learning rate). The loop trains one of them; the other is a
:class:`Candidate`, kept in tensors of its own on the same devices. To train or score it, :meth:`Candidate.swap`
exchanges it with the live state *in place*: every parameter's and buffer's ``.data`` and ``.grad`` (pointer swaps:
no copy, and the objects the optimizer, DDP's reducer and the skip's buffer copy hold stay the same objects), each
optimizer's ``state`` and param-group hyperparameters, each LR scheduler's state and the GradScaler's. Swapped in, the
candidate is the live state: ``training_step`` runs on it, the trainer's own optimizer steps it with the candidate's
moments and learning rate, through the module's own hooks of an automatic step (``optimizer_step``, ``backward``,
``on_before_optimizer_step``, ``configure_gradient_clipping``: see :meth:`Candidate.train_on`), and the trainer's
schedulers step its schedule. Swapped back, the live state is exactly as it
was, bit for bit.

:meth:`Candidate.train_on` runs one batch through the candidate before the loop trains the live state on it: the
candidate's loss before its step is its prequential score (a loss on data it has not trained on). The torch random
streams are put back to where the batch started, so the loop draws the same dropout masks for the live state as the
candidate drew, and a run whose candidate is discarded stays bit-identical to a run without it. ``self.log`` is
silenced and torchmetrics states are put back while it runs. Under DDP the candidate's ``training_step`` runs on the
plain LightningModule (not the DDP wrapper), and its gradients are averaged across ranks here, as DDP would.

What ``training_step`` writes beside the tensors is kept apart too (:mod:`lightning_overflow.preserve` says which
attributes and how): the module's Python attributes (a list of losses, a counter, a dict, a queue held as a plain
tensor) are copied before a candidate's step and put back after it, so the run's own keep exactly what the run's own
steps wrote. A trained candidate keeps its side effects on the side: its own copy of the containers and plain
tensors, swapped in for its steps (its lists and queues follow its own steps; its other attributes, counters and
settings a callback may set, are the run's at each step), never into the run's, even when it is kept (the run's
attributes record the steps the loop ran and logged). A scored (frozen) candidate's steps leave no trace. Inside a
candidate's ``training_step``, :func:`~lightning_overflow.side_run` answers ``"trial"``: guard with it what the suite
cannot keep apart (objects of your own classes, files, prints, external counters)::

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        if not side_run():  # the run's own step
            print(f"step {self.global_step}: {float(loss)}", file=self.progress_file)
        return loss

What it leaves alone: manual optimization and closure optimizers (LBFGS), which re-run their own steps, are not
trained as candidates (:func:`trainable` says why).
"""

from __future__ import annotations

import copy
import math
import random
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_overflow import _compat
from lightning_overflow.distributed import world
from lightning_overflow.numerics import tensor_norms
from lightning_overflow.numerics._float64 import summed_loss
from lightning_overflow.numerics.lr_scaling import HELD, scale_group
from lightning_overflow.preserve import (
    ModuleAttributes,
    capture_attributes,
    capture_rng,
    metric_states,
    put_back_attributes,
    put_back_metric_states,
    restore_rng,
    running_aside,
)
from lightning_overflow.skip import repeats_closure
from lightning_overflow.training_state import pruned_pairs
from lightning_overflow.training_step import loss_of, signature_parameters, silenced_logging, takes_batch_idx

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["Candidate", "CandidateStep", "Clip", "RateHold", "trainable"]

Clip = Callable[[list[Tensor], float], None]
"""Scales finite gradients in place, given them and their total norm (the loop's clip, applied to a candidate)."""



def trainable(trainer: pl.Trainer) -> str:
    """Why a candidate cannot be trained beside this fit's loop (empty when it can)."""
    module = trainer.lightning_module
    if not module.automatic_optimization:
        return "manual optimization steps its optimizers inside training_step, which a candidate cannot re-run"
    if len(trainer.optimizers) != 1:
        return f"the module has {len(trainer.optimizers)} optimizers, and a trial compares one"
    if repeats_closure(trainer.optimizers[0]):
        return f"{type(trainer.optimizers[0]).__name__} evaluates its closure several times a step"
    if "dataloader_iter" in signature_parameters(module.training_step):
        return "training_step takes the dataloader_iter"
    if _compat.sharded_strategy(trainer.strategy) is not None:
        return f"{type(trainer.strategy).__name__} shards the state"
    return ""


@dataclass(frozen=True)
class RateHold:
    """How the suite holds a candidate's learning rates, as it holds the loop's.

    Attributes:
        written: the rates the loop's code wrote into the param groups, as written, by group (``None`` where a
            scheduler sets the rate, or no code wrote one: a litgpt-style loop writes its own schedule before each
            step): the candidate's own rates for the batch too, before its scale.
        settle: holds the rates written since at the scale the candidate's state holds (``LRBackoff``).
    """

    written: list[float | None]
    settle: Callable[[], Any]


@dataclass
class CandidateStep:
    """What one batch did to a candidate: its loss before the step (``nan`` when none was finite), whether its
    optimizer stepped and whether that step was skipped (inf/NaN loss or gradients: nothing changed)."""

    loss: float
    stepped: bool
    skipped: bool


@dataclass
class Candidate:
    """A training state kept beside the live one (see the module docstring).

    Attributes:
        params: ``.data`` of each parameter, by name (``named_parameters()`` order).
        grads: ``.grad`` of each parameter (``None`` where it has none).
        buffers: ``.data`` of each buffer, by name.
        optimizers: per optimizer, its ``state`` mapping and its param groups' hyperparameters (all but ``params``).
        schedulers: each LR scheduler's ``state_dict()``.
        precision: the precision plugin's ``state_dict()`` (the GradScaler's under ``16-mixed``).
        extra: each module's ``get_extra_state()`` value, by module name (a loss weighting its module's own
            schedule sets: nequip's ``LossCoefficientScheduler``), for the modules that have one.
        averages: the tensors of each averaged copy of the model the callbacks keep (:func:`_average_tensors`): an
            EMA or SWA average follows the weights it averaged, so a kept remedy brings back its own (a rollback's
            snapshot's, as ``Rollback`` restores them) and a discarded one leaves the run's untouched.
        pending_schedule: scheduler steps the loop made since the candidate last stepped its own schedule.
        pending_values: the values each ``ReduceLROnPlateau`` of the loop stepped on since then (the run's, as the
            candidate has no validation of its own).
        losses: this optimizer step's finite micro-batch losses (under gradient accumulation).
        attributes: the module's Python attributes as the candidate's last trained step left them (``None`` until
            it trains, and after a checkpoint: it starts from the run's then).
    """

    params: dict[str, Tensor]
    grads: dict[str, Tensor | None]
    buffers: dict[str, Tensor | None]
    optimizers: list[tuple[Any, list[dict[str, Any]]]]
    schedulers: list[dict[str, Any]]
    precision: dict[str, Any]
    averages: list[dict[str, Tensor]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    pending_schedule: list[int] = field(default_factory=list)
    pending_values: list[list[float]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    nonfinite: bool = False
    window_buffers: dict[str, Tensor] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)  # parameter ``id`` -> name, for the optimizer state
    scheduler_ids: list[int] = field(default_factory=list)  # the schedulers captured (``id``); none after a checkpoint
    attributes: ModuleAttributes | None = field(default=None, repr=False)
    swapped: bool = False  # swapped in: the live state is the candidate's, the run's is held here

    # ---- building and swapping -----------------------------------------------------------------------------------
    @classmethod
    def capture(cls, trainer: pl.Trainer) -> Candidate:
        """A copy of the live training state, on its own devices (one more copy of the weights, buffers and
        optimizer state in device memory)."""
        module = trainer.lightning_module
        with torch.no_grad():
            params = {name: p.data.clone() for name, p in module.named_parameters()}
            buffers: dict[str, Tensor | None] = {}
            copies: dict[int, Tensor] = {}  # a tensor in two slots has one copy, as it is one tensor
            for name, (_, _, buffer) in _buffer_slots(module).items():
                if buffer is not None and id(buffer) not in copies:
                    copies[id(buffer)] = buffer.data.clone()
                buffers[name] = None if buffer is None else copies[id(buffer)]
        optimizers = [(_clone_optimizer_state(o.state), _hyperparameters(o)) for o in trainer.optimizers]
        return cls(
            params=params,
            grads=dict.fromkeys(params),
            buffers=buffers,
            optimizers=optimizers,
            schedulers=[copy.deepcopy(c.scheduler.state_dict()) for c in trainer.lr_scheduler_configs],
            precision=copy.deepcopy(trainer.precision_plugin.state_dict()),
            averages=[{name: t.data.clone() for name, t in tensors.items()} for tensors in _average_tensors(trainer)],
            extra={name: copy.deepcopy(m.get_extra_state()) for name, m in _with_extra_state(module)},
            pending_schedule=[0] * len(trainer.lr_scheduler_configs),
            pending_values=[[] for _ in trainer.lr_scheduler_configs],
            names={id(p): name for name, p in module.named_parameters()},
            scheduler_ids=[id(c.scheduler) for c in trainer.lr_scheduler_configs],
        )

    def swap(self, trainer: pl.Trainer) -> None:
        """Exchange this candidate with the live training state, in place (its own inverse)."""
        module = trainer.lightning_module
        for name, param in module.named_parameters():
            side = self.params[name]
            self.params[name], param.data = param.data, side
            self.grads[name], param.grad = param.grad, self.grads[name]
        self._swap_buffers(module)
        for index, optimizer in enumerate(trainer.optimizers):
            state, groups = self.optimizers[index]
            live = (optimizer.state, _hyperparameters(optimizer))
            _adopt_added_groups(groups, live[1])
            optimizer.state = state
            for group, values in zip(optimizer.param_groups, groups):
                _set_hyperparameters(group, values)
            self.optimizers[index] = live
        for index, scheduler in self._own_schedulers(trainer):
            live_schedule = copy.deepcopy(scheduler.state_dict())
            scheduler.load_state_dict(self.schedulers[index])
            self.schedulers[index] = live_schedule
        live_precision = copy.deepcopy(trainer.precision_plugin.state_dict())
        if self.precision:
            trainer.precision_plugin.load_state_dict(self.precision)
        self.precision = live_precision
        for side, live in self._own_averages(trainer):
            for name, tensor in live.items():
                side[name], tensor.data = tensor.data, side[name]
        for name, owner in _with_extra_state(module):
            if name in self.extra:  # a copy: get_extra_state may return the object set_extra_state then updates
                live_extra = copy.deepcopy(owner.get_extra_state())
                owner.set_extra_state(self.extra[name])
                self.extra[name] = live_extra

    def layout_change(self, module: torch.nn.Module) -> str:
        """How the module's parameters differ from this candidate's (empty when they do not): a layout changed
        since the capture (``ModelPruning`` turns each ``weight`` into ``weight_orig`` and back) leaves a candidate
        that cannot be swapped in."""
        live = {name: p.shape for name, p in module.named_parameters()}
        if live.keys() == self.params.keys() and all(live[n] == t.shape for n, t in self.params.items()):
            repruned = self._repruned(module)
            return f"pruned again ({', '.join(repruned[:3])}{' ...' if len(repruned) > 3 else ''})" if repruned else ""
        gone, new = sorted(self.params.keys() - live.keys()), sorted(live.keys() - self.params.keys())
        reshaped = sorted(n for n in live.keys() & self.params.keys() if live[n] != self.params[n].shape)
        parts = [f"{label} {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
                 for label, names in (("without", gone), ("with", new), ("reshaped:", reshaped)) if names]  # fmt: skip
        return "; ".join(parts)

    def _repruned(self, module: torch.nn.Module) -> list[str]:
        """The pruning masks (``<name>_mask`` beside ``<name>_orig``) the module prunes with now and this candidate
        does not: ``ModelPruning`` prunes again at each epoch's end in the same layout, and a candidate swapped in
        would undo that pruning."""
        changed = []
        for name, (_, live) in pruned_pairs(module).items():
            side = self.buffers.get(name)
            if isinstance(side, Tensor) and not torch.equal(live, side):
                changed.append(name)
        return changed

    def _swap_buffers(self, module: torch.nn.Module) -> None:
        """Exchange the buffers: their ``.data`` where both branches hold a tensor, the slot's value where one holds
        ``None`` (registered empty, filled on first use) or has no such buffer (:data:`_ABSENT`: registered since by
        one branch's own steps). A buffer the run registered since the capture starts as the run's in the
        candidate; one the candidate's own step registered is the candidate's alone."""
        slots = _buffer_slots(module)
        exchanged: dict[int, str] = {}  # a tensor in several slots is exchanged once, at its first
        for name in [*slots, *(n for n in self.buffers if n not in slots)]:
            owner, key, live = slots.get(name) or (*_owner(module, name), _ABSENT)
            if owner is None:
                continue
            if name not in self.buffers:
                self.buffers[name] = _ABSENT if self.swapped else (None if live is None else live.data.clone())
            side = self.buffers[name]
            if isinstance(live, Tensor) and isinstance(side, Tensor):
                if id(live) in exchanged:
                    self.buffers[name] = self.buffers[exchanged[id(live)]]
                    continue
                exchanged[id(live)] = name
                self.buffers[name], live.data = live.data, side
                continue
            self.buffers[name] = live
            if side is _ABSENT:
                del owner._buffers[key]
            else:
                owner._buffers[key] = side
        self.swapped = not self.swapped

    def copy_to_live(self, trainer: pl.Trainer) -> None:
        """Copy this candidate into the live training state, in place (the candidate stays as it is); the live
        gradients are cleared."""
        module = trainer.lightning_module
        with torch.no_grad():
            for name, param in module.named_parameters():
                if name in self.params:
                    param.data.copy_(self.params[name])
                param.grad = None
            for name, (owner, key, buffer) in _buffer_slots(module).items():
                side = self.buffers.get(name, buffer)
                if isinstance(buffer, Tensor) and isinstance(side, Tensor) and side.shape == buffer.shape:
                    buffer.data.copy_(side)
                elif side is _ABSENT:
                    del owner._buffers[key]
                elif side is not buffer:  # filled by one branch only, or grown by its own steps
                    owner._buffers[key] = side.clone() if isinstance(side, Tensor) else None
        for index, optimizer in enumerate(trainer.optimizers):
            state, groups = self.optimizers[index]
            optimizer.state = _clone_optimizer_state(state)
            for group, values in zip(optimizer.param_groups, groups):
                _set_hyperparameters(group, copy.deepcopy(values))
        for index, scheduler in self._own_schedulers(trainer):
            scheduler.load_state_dict(copy.deepcopy(self.schedulers[index]))
        if self.precision:
            trainer.precision_plugin.load_state_dict(copy.deepcopy(self.precision))
        with torch.no_grad():
            for side, live in self._own_averages(trainer):
                for name, tensor in live.items():
                    tensor.data.copy_(side[name])
        for name, owner in _with_extra_state(module):
            if name in self.extra:
                owner.set_extra_state(copy.deepcopy(self.extra[name]))

    def _own_schedulers(self, trainer: pl.Trainer) -> list[tuple[int, Any]]:
        """The live schedulers this candidate holds a state of, with their index in its lists. One a callback added or
        swapped in since it was captured (``StochasticWeightAveraging``'s ``SWALR``, as its epochs begin) is both
        branches' alike: it is left as it is."""
        configs = trainer.lr_scheduler_configs
        if self.scheduler_ids:
            return [(i, c.scheduler) for i, c in enumerate(configs)
                    if i < len(self.scheduler_ids) and id(c.scheduler) == self.scheduler_ids[i]]  # fmt: skip
        return [(i, c.scheduler) for i, c in enumerate(configs) if i < len(self.schedulers)]

    def _own_averages(self, trainer: pl.Trainer) -> list[tuple[dict[str, Tensor], dict[str, Tensor]]]:
        """The averaged copies this candidate holds, paired with the live ones; one of another layout is both
        branches' alike (left as it is). An SWA that began counting since the capture (at its first epoch) averaged
        none of this candidate's weights: its count is 0 here, so a kept remedy's SWA starts again, as after a
        rollback."""
        live = _average_tensors(trainer)
        if len(live) != len(self.averages):
            return []
        for side, tensors in zip(self.averages, live):
            if _SWA_COUNT in tensors and _SWA_COUNT not in side:
                side[_SWA_COUNT] = torch.zeros_like(tensors[_SWA_COUNT])
        return [(side, tensors) for side, tensors in zip(self.averages, live)
                if side.keys() == tensors.keys() and all(side[n].shape == t.shape for n, t in tensors.items())]

    @contextmanager
    def swapped_in(self, trainer: pl.Trainer) -> Iterator[None]:
        """The candidate is the live state inside the body; the live state is back, exactly, after it."""
        self.swap(trainer)
        try:
            yield
        finally:
            self.swap(trainer)

    @property
    def nbytes(self) -> int:
        """Device bytes the candidate holds (weights, buffers, optimizer state, weight averages)."""
        buffers = {id(b): b for b in self.buffers.values() if isinstance(b, Tensor)}  # one tensor in two slots: once
        tensors = [*self.params.values(), *buffers.values(), *(t for a in self.averages for t in a.values())]
        for state, _ in self.optimizers:
            tensors += [v for values in state.values() for v in values.values() if isinstance(v, Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ---- training and scoring ------------------------------------------------------------------------------------
    def train_on(
        self, trainer: pl.Trainer, batch: Any, batch_idx: int, steps: bool, clip: Clip | None,
        rates: RateHold | None = None,
    ) -> CandidateStep:
        """Train the candidate on the loop's ``batch`` (before the loop trains the live state on it), through the
        module's own hooks of an automatic step, as Lightning calls them for the loop: ``on_before_backward``,
        ``backward``, ``on_after_backward``; on the batch that steps, ``optimizer_step`` (a warm-up written there),
        whose optimizer's ``step`` runs the forward and backward passes, then ``on_before_optimizer_step`` and
        ``configure_gradient_clipping`` (the module's own clipping, the Trainer's ``gradient_clip_val``).

        Args:
            steps: whether this batch ends an accumulation window (the loop's optimizer steps on it).
            clip: scales the candidate's finite gradients in place, given them and their total norm, as the suite
                clips the loop's step (``None``: no clip).
            rates: the rates the loop wrote before the batch, and what holds those and the ones the module writes
                (in ``optimizer_step``) at the scale the candidate's state holds, as the suite does for the loop's.
        """
        module = trainer.lightning_module
        rng = capture_rng()
        try:
            with self._aside(trainer, trains=True):
                self._catch_up_schedule(trainer)
                if rates is not None:
                    for group, rate in zip(trainer.optimizers[0].param_groups, rates.written):
                        if rate is not None:
                            group["lr"] = rate
                if not self.window_buffers:  # the buffers as the window began: a skipped step puts them back
                    self.window_buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
                if not steps:
                    _, value = self._forward_backward(trainer, batch, batch_idx)
                    return CandidateStep(value, stepped=False, skipped=False)
                optimizer = trainer.optimizers[0]
                stepper = _CandidateOptimizer(
                    optimizer, lambda: (self.nonfinite, self._step(trainer, optimizer, clip, rates))
                )
                module.optimizer_step(trainer.current_epoch, batch_idx, stepper,
                                      lambda: self._closure(trainer, batch, batch_idx))  # fmt: skip
                if stepper.result is None:  # the module's optimizer_step did not step (its closure may have run)
                    # A rank whose module chose so (its loss inf/NaN) makes the collectives the others' steps make,
                    # and holds its schedule as they hold theirs when a rank's loss was inf/NaN.
                    bad = _average_across_ranks([p for group in optimizer.param_groups for p in group["params"]],
                                                self.nonfinite)  # fmt: skip
                    optimizer.zero_grad(set_to_none=True)
                    stepper.result = (self.nonfinite, bad)  # no update, as the module chose
                    self.window_buffers, self.nonfinite = {}, False
        finally:
            restore_rng(rng)
        nonfinite, skipped = stepper.result
        mean = math.nan if nonfinite or not self.losses else sum(self.losses) / len(self.losses)
        self.losses, self.nonfinite = [], False
        return CandidateStep(mean, stepped=True, skipped=skipped)

    def _closure(self, trainer: pl.Trainer, batch: Any, batch_idx: int) -> Tensor | None:
        """What the module's ``optimizer_step`` gets as its closure: the forward and backward passes, then the loss
        as Lightning's closure returns it (divided by the accumulation, detached)."""
        loss, _ = self._forward_backward(trainer, batch, batch_idx)
        return None if loss is None else loss.detach() / trainer.accumulate_grad_batches

    def _forward_backward(self, trainer: pl.Trainer, batch: Any, batch_idx: int) -> tuple[Tensor | None, float]:
        """The candidate's ``training_step`` on ``batch`` and, for a finite loss, its backward pass through the
        module's hooks (as Lightning's closure); returns the loss and its value (``nan`` when there is none)."""
        module = trainer.lightning_module
        args = (batch, batch_idx) if takes_batch_idx(module) else (batch,)
        with trainer.precision_plugin.train_step_context():
            loss = loss_of(module.training_step(*args))
        value = float(summed_loss(loss)) if loss is not None else math.nan
        if not math.isfinite(value):
            self.nonfinite = True
            return loss, value
        self.losses.append(value)
        scaler = _compat.scaler_of(trainer)
        scaled = loss / trainer.accumulate_grad_batches  # type: ignore[operator]
        scaled = scaler.scale(scaled) if scaler is not None else scaled
        module.on_before_backward(scaled)
        module.backward(scaled)
        module.on_after_backward()
        return loss, value

    def score_on(self, trainer: pl.Trainer, batch: Any, batch_idx: int, steps: bool) -> CandidateStep:
        """Score the candidate, frozen, on the loop's ``batch``: its loss without a gradient, its buffers (BatchNorm
        statistics) and the random streams as they were. ``steps``: whether this batch ends the optimizer step
        (the score is the mean over the step's batches)."""
        module = trainer.lightning_module
        rng = capture_rng()
        try:
            with self._aside(trainer, trains=False):
                buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
                args = (batch, batch_idx) if takes_batch_idx(module) else (batch,)
                with trainer.precision_plugin.train_step_context():
                    loss = loss_of(module.training_step(*args))
                for name, buffer in module.named_buffers():
                    if name in buffers:
                        buffer.copy_(buffers[name])
        finally:
            restore_rng(rng)
        value = float(summed_loss(loss)) if loss is not None else math.nan
        if math.isfinite(value):
            self.losses.append(value)
        else:
            self.nonfinite = True
        if not steps:
            return CandidateStep(value, stepped=False, skipped=False)
        mean = math.nan if self.nonfinite or not self.losses else sum(self.losses) / len(self.losses)
        self.losses, self.nonfinite = [], False
        return CandidateStep(mean, stepped=True, skipped=True)

    @contextmanager
    def _aside(self, trainer: pl.Trainer, trains: bool) -> Iterator[None]:
        """The body runs the user's ``training_step`` for this candidate, leaving the run as it was: the candidate
        swapped in, the run's random streams, metric states, Python attributes and logs kept apart; with gradients
        when it ``trains`` (and keeps its own attributes for its next step), without when it is only scored."""
        module = trainer.lightning_module
        with (
            self.swapped_in(trainer),
            _kept_streams(module),
            self._own_attributes(module, keep=trains),
            silenced_logging(module),
            torch.enable_grad() if trains else torch.no_grad(),
        ):
            yield

    @contextmanager
    def _own_attributes(self, module: torch.nn.Module, keep: bool) -> Iterator[None]:
        """The body runs as a trial's side run, on the candidate's own containers and plain tensors where it has
        some (the rest as the run has them now: a callback may have set them); the run's attributes are put back
        after it. ``keep``: the candidate keeps what the body wrote (for its next step)."""
        live = capture_attributes(module)
        if keep and self.attributes is not None:
            put_back_attributes(self.attributes, accumulated_only=True)
        try:
            with running_aside("trial"):
                yield
        finally:
            if keep:
                self.attributes = capture_attributes(module)
            put_back_attributes(live)

    def _step(
        self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer, clip: Clip | None,
        rates: RateHold | None,
    ) -> bool:
        """Step the swapped-in candidate, its forward and backward passes done; return whether the step was skipped
        as the suite skips one (nothing changed, the schedule held). A GradScaler's own overflow of a finite loss
        changes nothing either, but the loop steps its schedule on it (as a bare loop and Lightning do): so does the
        candidate."""
        every = [p for group in optimizer.param_groups for p in group["params"]]
        bad_loss, self.nonfinite = _average_across_ranks(every, self.nonfinite), False
        params = [p for p in every if p.grad is not None]
        grads: list[Tensor] = [p.grad for p in params]  # type: ignore[misc]
        scaler = _compat.scaler_of(trainer)
        if scaler is not None and grads:
            scaler.unscale_(optimizer)
        if rates is not None:
            rates.settle()
        total = math.sqrt(float(tensor_norms(grads).double().pow(2).sum())) if grads else 0.0
        window_start, self.window_buffers = self.window_buffers, {}
        if bad_loss or not math.isfinite(total):  # the true no-op, as the loop's: no update, the window's buffers
            optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                for name, buffer in trainer.lightning_module.named_buffers():
                    if name in window_start:
                        buffer.copy_(window_start[name])
            if scaler is not None:
                scaler.update()  # the scaler lowers its scale on the overflow, as it does for the loop
            return bad_loss or scaler is None
        if clip is not None:
            clip(grads, total)
        module = trainer.lightning_module
        module.on_before_optimizer_step(optimizer)
        module.configure_gradient_clipping(optimizer, trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return False

    def note_schedule(self, steps_by_scheduler: list[int], skipped: bool) -> None:
        """The loop stepped its schedulers ``steps_by_scheduler`` times this batch: the candidate steps its own the
        same number of times before its next step, unless its own step was skipped (its schedule holds then)."""
        if skipped:
            return
        for index, steps in enumerate(steps_by_scheduler[: len(self.pending_schedule)]):
            self.pending_schedule[index] += steps

    def note_plateau(self, values_by_scheduler: list[list[float]]) -> None:
        """The loop's plateau schedulers stepped on these values: the candidate's step on them before its next step
        (a skipped step holds none: Lightning steps them whatever the batch did)."""
        for index, values in enumerate(values_by_scheduler[: len(self.pending_values)]):
            self.pending_values[index] += values

    def _catch_up_schedule(self, trainer: pl.Trainer) -> None:
        for index, scheduler in self._own_schedulers(trainer):
            for _ in range(self.pending_schedule[index]):
                scheduler.step()
            for value in self.pending_values[index]:
                scheduler.step(value)
            self.pending_schedule[index] = 0
            self.pending_values[index] = []

    def catch_up(self, trainer: pl.Trainer) -> None:
        """Apply the schedule steps still pending (before the candidate becomes the live state)."""
        with self.swapped_in(trainer):
            self._catch_up_schedule(trainer)


    # ---- checkpoints ------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The candidate as primitives and host tensors (loadable with ``torch.load(weights_only=True)``); its
        optimizer state keyed by parameter name."""
        optimizers = [
            ({self.names[id(p)]: _to_host(values) for p, values in state.items()}, copy.deepcopy(groups))
            for state, groups in self.optimizers
        ]
        return {
            "params": _to_host(self.params),
            "grads": _to_host(self.grads),
            "buffers": _to_host({k: v for k, v in self.buffers.items() if v is not _ABSENT}),
            "optimizers": [{"state": state, "groups": groups} for state, groups in optimizers],
            "schedulers": copy.deepcopy(self.schedulers),
            "precision": copy.deepcopy(self.precision),
            "averages": [_to_host(tensors) for tensors in self.averages],
            "extra": copy.deepcopy(self.extra),
            "pending_schedule": list(self.pending_schedule),
            "pending_values": [list(values) for values in self.pending_values],
            "losses": list(self.losses),
            "nonfinite": self.nonfinite,
            "window_buffers": _to_host(self.window_buffers),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], trainer: pl.Trainer) -> Candidate:
        """The candidate :meth:`state_dict` wrote, on the devices of the live state."""
        module = trainer.lightning_module
        params = dict(module.named_parameters())
        buffers = dict(module.named_buffers())

        def on(values: dict[str, Any], live: dict[str, Tensor]) -> dict[str, Any]:
            return {k: (v.to(live[k].device) if isinstance(v, Tensor) and k in live else v) for k, v in values.items()}

        optimizers = []
        for saved in state["optimizers"]:
            by_param: Any = defaultdict(dict)
            for name, values in saved["state"].items():
                device = params[name].device
                by_param[params[name]] = {k: (v.to(device) if isinstance(v, Tensor) and v.dim() else v)
                                          for k, v in values.items()}  # fmt: skip
            optimizers.append((by_param, copy.deepcopy(saved["groups"])))
        return cls(
            params=on(state["params"], params),
            grads=on(state["grads"], params),
            buffers=on(state["buffers"], buffers),
            optimizers=optimizers,
            schedulers=copy.deepcopy(state["schedulers"]),
            precision=copy.deepcopy(state["precision"]),
            # A checkpoint of an earlier release holds none: the averages are then both branches' alike.
            averages=[on(saved, live) for saved, live in zip(state.get("averages", []), _average_tensors(trainer))],
            extra=copy.deepcopy(state.get("extra", {})),
            pending_schedule=[int(n) for n in state["pending_schedule"]],
            pending_values=[[float(v) for v in values] for values in state.get("pending_values", [])]
            or [[] for _ in state["pending_schedule"]],
            losses=[float(v) for v in state["losses"]],
            nonfinite=bool(state["nonfinite"]),
            window_buffers=on(state["window_buffers"], buffers),
            names={id(p): name for name, p in params.items()},
        )


# ---- helpers ----------------------------------------------------------------------------------------------------
class _CandidateOptimizer:
    """The optimizer a module's ``optimizer_step`` steps for a candidate, as Lightning's ``LightningOptimizer`` is for
    the loop: ``step(closure)`` runs the closure (the forward and backward passes), then the candidate's step;
    ``result`` says how that went (``None``: the module did not step). Every other attribute is the optimizer's."""

    def __init__(self, optimizer: torch.optim.Optimizer, after: Callable[[], tuple[bool, bool]]) -> None:
        self.optimizer = optimizer
        self._after = after
        self.result: tuple[bool, bool] | None = None

    def step(self, closure: Callable[[], Any] | None = None, **_: Any) -> Any:
        loss = closure() if closure is not None else None
        self.result = self._after()
        return loss

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


_ABSENT: Any = object()
"""A buffer one branch has no slot for (the other's own steps registered it)."""


def _owner(module: torch.nn.Module, name: str) -> tuple[torch.nn.Module | None, str]:
    prefix, _, key = name.rpartition(".")
    try:
        return module.get_submodule(prefix), key
    except AttributeError:
        return None, key


def _buffer_slots(module: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, str, Tensor | None]]:
    """Every buffer slot of ``module`` by name, as ``(owner, key, tensor)``: those registered as ``None`` too (a
    memory bank filled on first use), which ``named_buffers()`` leaves out, and each slot of a tensor two modules
    share (one of them may be given a tensor of its own later)."""
    return {f"{prefix}.{key}" if prefix else key: (owner, key, value)
            for prefix, owner in module.named_modules(remove_duplicate=False) for key, value in owner._buffers.items()}


def _with_extra_state(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The submodules (``module`` itself as ``""``) that keep a ``get_extra_state`` value: state beside the tensors,
    each branch's own as its tensors are."""
    return [(name, m) for name, m in module.named_modules()
            if type(m).get_extra_state is not torch.nn.Module.get_extra_state]  # fmt: skip


def _average_tensors(trainer: pl.Trainer) -> list[dict[str, Tensor]]:
    """The tensors of each averaged copy of the model (:func:`~lightning_overflow._compat.weight_averages`), by
    name: its parameters and buffers (a tensor in two slots once), and ``StochasticWeightAveraging``'s count."""
    found = []
    for callback, average, swa in _compat.weight_averages(trainer):
        tensors: dict[str, Tensor] = {}
        seen: set[int] = set()
        for name, tensor in average.state_dict(keep_vars=True).items():
            if isinstance(tensor, Tensor) and id(tensor) not in seen:
                seen.add(id(tensor))
                tensors[name] = tensor
        if swa and isinstance(callback.n_averaged, Tensor):
            tensors[_SWA_COUNT] = callback.n_averaged
        found.append(tensors)
    return found


_SWA_COUNT = "<n_averaged>"  # StochasticWeightAveraging counts the models in its average on the callback


def _adopt_added_groups(groups: list[dict[str, Any]], live: list[dict[str, Any]]) -> None:
    """Param groups the live state holds beyond ``groups`` were added since this branch last held them
    (``BaseFinetuning``'s unfreeze): they join it as added, at its own backoff scale, their rates times the ratio of
    its scale to the live state's (each branch's first group's :data:`HELD`). Without it, every branch shared them at
    the run's rates, and a remedy kept at x0.125 left the group added during its trial at 1x."""
    if not groups or len(live) <= len(groups):
        return
    mine, theirs = groups[0].get(HELD), live[0].get(HELD)
    ratio = mine[1] / theirs[1] if mine and theirs and theirs[1] else 1.0
    for values in live[len(groups):]:
        values = copy.deepcopy(values)
        if ratio != 1.0:
            scale_group(values, ratio)
            if HELD in values:
                values[HELD] = [values["lr"], mine[1]]
        groups.append(values)


def _set_hyperparameters(group: dict[str, Any], values: dict[str, Any]) -> None:
    """Give ``group`` a branch's hyperparameters. The suite's own :data:`HELD` entry goes where the branch held none
    (a group one branch's backoff held since): left behind, it told the other branch its rate was written at that
    branch's scale. Other keys a branch lacks stay (a scheduler's, ``SWALR``'s ``swa_lr``, added since)."""
    if HELD not in values:
        group.pop(HELD, None)
    group.update(values)


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: copy.deepcopy(v) for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def _to_host(values: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.detach().to("cpu", copy=True) if isinstance(v, Tensor) else copy.deepcopy(v)) for k, v in values.items()}


def _clone_optimizer_state(state: Any) -> Any:
    cloned: Any = defaultdict(dict)
    for param, values in state.items():
        cloned[param] = {k: (v.clone() if isinstance(v, Tensor) else copy.deepcopy(v)) for k, v in values.items()}
    return cloned


def _average_across_ranks(params: list[Tensor], bad_loss: bool) -> bool:
    """Average the candidate's gradients across ranks, as DDP does for the loop, and return whether the loss was
    inf/NaN on any rank (then every rank skips the step). Every rank makes the same collectives whatever its own
    step left: a rank whose loss was inf/NaN made no backward pass, and a parameter without a gradient on one rank
    takes part with zeros (one all-reduce and one host read say which, then one all-reduce per gradient)."""
    world_size = world()[1]
    if world_size == 1 or not params:
        return bad_loss
    present = torch.tensor([float(p.grad is not None) for p in params] + [float(bad_loss)], device=params[0].device)
    dist.all_reduce(present)
    *anywhere, bad = present.tolist()
    for param, ranks in zip(params, anywhere):
        if ranks == 0:
            continue  # no gradient on any rank: left as the loop's step leaves it
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad)
        param.grad.div_(world_size)
    return bad > 0


@contextmanager
def _kept_streams(module: torch.nn.Module) -> Iterator[None]:
    """Python's and NumPy's random streams, the generators the modules own and every torchmetrics state are put
    back after the body (torch's own streams are the caller's)."""
    python_rng = random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_rng = numpy.random.get_state() if numpy is not None else None
    owned = [g for m in module.modules() for g in vars(m).values() if isinstance(g, torch.Generator)]
    generators = [(g, g.get_state()) for g in owned]
    metrics = metric_states(module)
    try:
        yield
    finally:
        for generator, state in generators:
            generator.set_state(state)
        random.setstate(python_rng)
        if numpy is not None:
            numpy.random.set_state(numpy_rng)
        put_back_metric_states(metrics)
