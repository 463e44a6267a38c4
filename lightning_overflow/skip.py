"""The true no-op optimizer step.

A skipped step changes nothing: not the weights, not the optimizer's moments, weight decay or step counts
(``zero_grad(set_to_none=True)`` before ``optimizer.step()``: zeroing the gradients instead would still apply
momentum and weight decay), not the module's buffers (the forward pass already moved BatchNorm's running
statistics, so they are put back from a copy taken when the accumulation window began), and not the LR schedule
(Lightning steps the schedulers even on a skipped step, Lightning #18828: their state and the param-group
hyperparameters are saved here and put back once Lightning has stepped them, in ``on_train_batch_end``), and not the
epoch's logged means (the module's ``self.log("train_loss", loss, on_epoch=True)`` of a skipped step's NaN loss would
make the epoch's value NaN, and ``EarlyStopping`` or ``ModelCheckpoint`` monitoring it would end or misjudge the run
the skip rescued: the sums are put back as the window found them, and the step's own logged value stays).

An optimizer that evaluates its closure several times in one step (LBFGS) moves the weights between evaluations: a
skip decided on a later evaluation also puts back the weights and the optimizer state the step started from
(:class:`ClosureStepStart`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lightning_overflow import _compat
from lightning_overflow.numerics.snapshots import nonfinite_indices
from lightning_overflow.preserve import is_metric, metric_state, put_back_metric_states

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["CLOSURE_OPTIMIZERS", "BufferCopy", "ClosureStepStart", "HeldSchedules", "repeats_closure", "skip_step"]

CLOSURE_OPTIMIZERS = ("LBFGS",)
"""Optimizers that evaluate the closure several times in one step, moving the weights in between."""


def repeats_closure(optimizer: torch.optim.Optimizer) -> bool:
    return type(optimizer).__name__ in CLOSURE_OPTIMIZERS


STEP_HOOKS = ("on_before_optimizer_step", "configure_gradient_clipping")
"""The module's hooks Lightning calls between the callbacks' ``on_before_optimizer_step`` and the update."""


@dataclass
class HeldSchedules:
    """Scheduler states and param-group hyperparameters to put back after Lightning stepped the schedulers."""

    schedulers: list[tuple[Any, dict[str, Any]]] = field(default_factory=list)
    groups: list[tuple[list[dict[str, Any]], list[dict[str, Any]]]] = field(default_factory=list)
    hooks: list[tuple[Any, str, Any]] = field(default_factory=list)  # (module, hook, what its instance held)

    def restore(self) -> None:
        for scheduler, state in self.schedulers:
            scheduler.load_state_dict(state)
        for groups, saved in self.groups:
            for group, values in zip(groups, saved):
                group.update(values)
        self.schedulers.clear()
        self.groups.clear()
        self.put_back_hooks()

    def hold_step_hooks(self, pl_module: Any, names: tuple[str, ...] = STEP_HOOKS) -> None:
        """Right after the callbacks' ``on_before_optimizer_step`` Lightning calls the module's own, then clips
        (``Trainer(gradient_clip_val=...)``, or the module's ``configure_gradient_clipping``). A step the suite
        skipped has no gradients left (set to ``None``, so that the optimizer leaves every parameter as it was),
        where the same step without the suite had them: a hook that edits one meets ``None``, and torch's
        ``clip_grad_value_`` raises on an empty list of them (torch 2.13.0). For this step each does nothing, then
        answers again: the module's hooks see only steps that update."""
        for name in names:
            if any(held_name == name for _, held_name, _ in self.hooks):
                continue

            def skipped(*_: Any, _name: str = name, **__: Any) -> None:
                self.put_back_hooks(_name)

            self.hooks.append((pl_module, name, _compat.replace_method(pl_module, name, skipped)))

    def put_back_hooks(self, name: str | None = None) -> None:
        """The module's hooks answer again (``name``: that one only)."""
        for held in [h for h in self.hooks if name is None or h[1] == name]:
            self.hooks.remove(held)
            _compat.restore_method(*held)


class BufferCopy:
    """The buffers of a module as they were when an accumulation window began.

    Copies go into tensors allocated once per fit on the buffers' own devices (a few kilobytes for BatchNorm; a
    causal mask costs one copy of itself per step). The buffers are listed once per fit and the list is checked at
    each copy, one dictionary look-up a buffer: a buffer the module replaces by a new tensor (``self.ema = 0.9 *
    self.ema + ...``) is listed again, so it is put back on a skip and checked as it is now.
    """

    def __init__(self) -> None:
        self._module: nn.Module | None = None
        self._names: list[str] = []
        self._owners: list[tuple[nn.Module, str]] = []  # each buffer's module and its name there
        self._live: list[Tensor] = []
        self._saved: list[Tensor] = []
        self._versions: list[int] = []  # each buffer's in-place write counter when the window began
        self._running: list[bool] = []  # each buffer: a normalisation layer's running statistic
        self._watched = False

    def take(self, module: nn.Module) -> None:
        if self._module is not module or self._replaced():  # a module tree walk per batch costs tens of us
            named = list(module.named_buffers())
            self._module = module
            self._names = [name for name, _ in named]
            self._owners = [_owner(module, name) for name in self._names]
            self._live = [b for _, b in named]
            self._saved = [torch.empty_like(b) for b in self._live]
            self._running = [_running_statistic(owner, name) for owner, name in self._owners]
            self._watched = any(b.is_floating_point() for b in self._live)  # the layout's: decided when listed
        if self._live:
            with torch.no_grad():
                torch._foreach_copy_(self._saved, self._live)
            self._versions = [b._version for b in self._live]

    @property
    def watched(self) -> bool:
        """Whether the module has floating-point buffers that its forward may write (the same on every rank: the
        module's layout, not what one rank's forward did)."""
        return self._watched

    def written(self) -> list[tuple[str, Tensor, Tensor]]:
        """The floating-point buffers the window's forward passes wrote, by name, each with its copy from when the
        window began: those torch counts as written in place (``_version``: an EMA updated from Python), and the
        running statistics of normalisation layers, whose native kernel writes them uncounted. Constants such as a
        causal mask are never among them."""
        return [
            (name, live, saved)
            for name, live, saved, version, running in zip(
                self._names, self._live, self._saved, self._versions, self._running
            )
            if (running or live._version != version) and live.is_floating_point()
        ]

    def _replaced(self) -> bool:
        """Whether a listed buffer is no longer its module's (re-assigned, or removed)."""
        return any(owner._buffers.get(name) is not live for (owner, name), live in zip(self._owners, self._live))

    def put_back(self) -> None:
        """The buffers as the window found them; one the step's forward re-assigned gets the copy back in its place."""
        if not self._live:
            return
        with torch.no_grad():
            torch._foreach_copy_(self._live, self._saved)
            for (owner, name), live, saved in zip(self._owners, self._live, self._saved):
                if owner._buffers.get(name) is not live:
                    owner._buffers[name] = saved.clone()

    def put_back_nonfinite(self) -> None:
        """The buffers that hold inf/NaN now and did not when the batch began, as the batch found them; the others as
        they are. Under manual optimization a batch steps several optimizers, and a forward pass for one of them
        writes buffers the others' steps rely on: what a skipped step must not leave behind is the inf/NaN its
        forward wrote (a BatchNorm's running statistics of a NaN batch), and a constant that holds -inf (a causal
        mask) is none of that. Two host reads at most: on a skipped step only."""
        listed = [(owner, name, live, saved) for (owner, name), saved in zip(self._owners, self._saved)
                  if (live := owner._buffers.get(name)) is not None]  # fmt: skip
        now = set(nonfinite_indices([live for _, _, live, _ in listed]))
        if not now:
            return
        before = set(nonfinite_indices([listed[i][3] for i in sorted(now)]))  # not this batch's doing
        with torch.no_grad():
            for position, i in enumerate(sorted(now)):
                owner, name, live, saved = listed[i]
                if position in before:
                    continue
                if live.shape == saved.shape:
                    live.copy_(saved)
                else:  # re-assigned by the forward pass: the copy goes back in its place
                    owner._buffers[name] = saved.clone()

    def saved(self) -> dict[str, Tensor]:
        """The copies by buffer name: the buffers as the current step found them, before its forward passes."""
        return dict(zip(self._names, self._saved))

    def release(self) -> None:
        self._module = None
        self._names, self._owners, self._live, self._saved, self._versions, self._running = [], [], [], [], [], []
        self._watched = False


class MetricCopy:
    """The states of the torchmetrics ``Metric`` objects a module's training steps update, as they were when an
    accumulation window began, put back on a skip: a skipped step's inf/NaN loss is left out of a metric that
    accumulates it (chemprop's ``train_loss``, a ``MeanMetric`` that ``EarlyStopping`` watches), as it is left out of
    the epoch means Lightning keeps for ``self.log``.

    Which metrics the training steps update is learned from their update counts: all are copied on the fit's first
    batch, then those whose count moved in a training batch (validation metrics cost nothing). A metric a training
    step updates for the first time later in the fit is copied from its next batch on.
    """

    def __init__(self) -> None:
        self._module: nn.Module | None = None
        self._metrics: list[nn.Module] = []
        self._training: set[int] | None = None  # ids of the metrics the training steps update (None: not known yet)
        self._counts: list[int] = []  # each metric's update count when the window began
        self._saved: list[tuple[nn.Module, dict[str, Any]]] = []

    def take(self, module: nn.Module) -> None:
        if self._module is not module:
            self._module, self._training = module, None
            self._metrics = [m for m in module.modules() if is_metric(m)]
        if not self._metrics:
            return
        self._counts = [_update_count(m) for m in self._metrics]
        training = self._training
        copied = [m for m in self._metrics if training is None or id(m) in training]
        # A list state (predictions a curve metric collects) is only appended to: the same tensors in a new list.
        self._saved = [(m, metric_state(m, share_lists=True)) for m in copied]

    def end_batch(self) -> None:
        """After a training batch: the metrics whose count moved since the window began are the training steps'."""
        if not self._metrics or len(self._counts) != len(self._metrics):
            return
        moved = {id(m) for m, count in zip(self._metrics, self._counts) if _update_count(m) != count}
        self._training = moved if self._training is None else self._training | moved

    def put_back(self) -> None:
        put_back_metric_states(self._saved)

    def put_back_nonfinite(self) -> None:
        """Manual optimization, where a batch steps several optimizers and updates metrics for each: the states of
        the metrics that hold inf/NaN now and did not when the batch began, as the batch found them; the others as
        they are. Two host reads at most: after a batch with a skipped step only."""
        now = _nonfinite_states([m.metric_state for m, _ in self._saved])  # type: ignore[attr-defined]
        if not now:
            return
        before = _nonfinite_states([saved for _, saved in self._saved])
        put_back_metric_states([pair for i, pair in enumerate(self._saved) if i in now - before])

    def release(self) -> None:
        self._module, self._metrics, self._training, self._counts, self._saved = None, [], None, [], []


def _nonfinite_states(states: list[dict[str, Any]]) -> set[int]:
    """The positions of the metric states (a list state's tensors too) that hold inf/NaN, with one host read."""
    tensors, owners = [], []
    for position, state in enumerate(states):
        for value in state.values():
            for tensor in value if isinstance(value, list) else [value]:
                if isinstance(tensor, Tensor):
                    tensors.append(tensor)
                    owners.append(position)
    return {owners[i] for i in nonfinite_indices(tensors)}


def _update_count(metric: nn.Module) -> int:
    return int(vars(metric).get("_update_count", 0))


def _running_statistic(owner: nn.Module, name: str) -> bool:
    """A BatchNorm's (or InstanceNorm's) ``running_mean`` / ``running_var``: written by the forward in train mode."""
    return isinstance(owner, nn.modules.batchnorm._NormBase) and name in ("running_mean", "running_var")


class ClosureStepStart:
    """The weights and optimizer state a closure optimizer's step started from, to undo the whole step on a skip.

    LBFGS evaluates the closure several times in one ``optimizer.step()`` and moves the weights between evaluations;
    a skip decided on a later evaluation stops the step (no gradient left to follow) but keeps the moves already
    made. So, for such optimizers only, the first evaluation of each step copies the parameters and the optimizer
    state (LBFGS's history included: its cost), and a skip puts both back once the step returned.
    """

    def __init__(self) -> None:
        self._key: tuple[int, int] | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._params: list[tuple[Tensor, Tensor]] = []
        self._state: dict[Any, Any] = {}
        self._undo = False

    def note(self, step: int, optimizer: torch.optim.Optimizer) -> None:
        """At each evaluation, before it is judged: copy the step's start on its first evaluation."""
        if not repeats_closure(optimizer) or self._key == (step, id(optimizer)):
            return
        self._key, self._optimizer = (step, id(optimizer)), optimizer
        with torch.no_grad():
            self._params = [(p, p.detach().clone()) for g in optimizer.param_groups for p in g["params"]]
        self._state = copy.deepcopy(optimizer.state_dict()["state"])

    def skipped(self, optimizer: torch.optim.Optimizer) -> None:
        self._undo = self._undo or (self._optimizer is optimizer and repeats_closure(optimizer))

    def put_back(self) -> None:
        """Once the step returned: the weights and optimizer state it started from, if an evaluation was skipped."""
        if not self._undo or self._optimizer is None:
            return
        self._undo = False
        with torch.no_grad():
            for param, start in self._params:
                param.copy_(start)
        state = self._optimizer.state_dict()
        state["state"] = self._state
        self._optimizer.load_state_dict(state)
        self._key = None  # the copy now is the live state: the next step copies afresh

    def release(self) -> None:
        self._key, self._optimizer, self._params, self._state, self._undo = None, None, [], {}, False


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The submodule holding the buffer called ``name`` in ``module``'s ``named_buffers()``, and its own name."""
    path, _, leaf = name.rpartition(".")
    return (module.get_submodule(path) if path else module), leaf


def skip_step(
    trainer: pl.Trainer, optimizer: torch.optim.Optimizer, held: HeldSchedules, buffers: BufferCopy,
    sums: list[tuple[Any, Tensor, Tensor | None]], metrics: MetricCopy,
) -> None:  # fmt: skip
    """Make the coming ``optimizer.step()`` a no-op, put the buffers, the training metrics' states and the epoch's
    logged sums (``sums``, kept by :func:`~lightning_overflow._compat.epoch_sums` when the window began) back and hold
    the step-interval schedulers in ``held``.

    Under manual optimization the user steps the schedulers and may step several optimizers per batch: the
    gradients are dropped there, and the buffers that hold inf/NaN are put back as the batch found them (the others
    may hold what another optimizer's step of the batch relies on).
    """
    optimizer.zero_grad(set_to_none=True)
    module = trainer.lightning_module
    lightning = isinstance(module, nn.Module)  # a LightningModule, whose hooks Lightning calls (not the loop's host)
    if not module.automatic_optimization:
        if lightning:
            held.hold_step_hooks(module, ("on_before_optimizer_step",))  # no clipping hook under manual optimization
        buffers.put_back_nonfinite()
        return
    if lightning:
        held.hold_step_hooks(module)
    buffers.put_back()
    metrics.put_back()
    _compat.put_back_epoch_sums(trainer, sums)
    for config in trainer.lr_scheduler_configs:
        if config.interval != "step" or config.reduce_on_plateau:
            continue
        scheduler = config.scheduler
        held.schedulers.append((scheduler, copy.deepcopy(scheduler.state_dict())))
        opt = scheduler.optimizer
        saved = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
        held.groups.append((opt.param_groups, saved))
