"""The live training state of a Lightning fit: read it, verify it finite, restore it, guard the checkpoints it goes to.

The *training state* is what a rollback puts back: the LightningModule's whole ``state_dict`` (parameters, floating
and integer buffers, the values of ``get_extra_state``), every optimizer's state (moments, step counts, param-group
hyperparameters), every LR scheduler's state and the precision plugin's (the GradScaler). This module knows no board
and no callback: it reads and writes a trainer's state and answers questions about it.

The one finiteness check of a training state lives here (:func:`nonfinite_flags` on the device, :func:`check_state`
across ranks, :func:`nonfinite_parts` for the names). Its rule:

- parameters and optimizer state (moments, not the 0-d step counters) are non-finite when they hold inf or NaN,
  read through each tensor's largest magnitude, which cannot overflow while the values are finite (see
  :mod:`lightning_overflow.numerics.snapshots`);
- buffers and extra-state tensors may hold non-finite *constants*: a causal-attention mask registered as a buffer
  holds ``-inf`` above the diagonal (``register_buffer("mask", torch.triu(torch.full((n, n), -inf), 1))``, the
  nanoGPT pattern). :class:`NonFiniteConstants` records, when it first sees a buffer, where it holds ``+inf`` and
  ``-inf`` (two boolean masks, only for the buffers that hold any; most hold none). A buffer is first seen when the
  fit starts, or when it appears or changes shape during the fit: a mask built on the first forward pass, or rebuilt
  for longer sequences. Later a buffer is non-finite when it holds NaN, or an inf where it held none when first
  seen, or of the other sign. BatchNorm's running statistics hold no inf at the start, so they stay strictly
  checked.

The checkpoint guard (:class:`CheckpointGuard`). Every Lightning writer of checkpoints (``ModelCheckpoint`` in all its
modes, ``OnExceptionCheckpoint``, a user's own call) goes through ``Trainer.save_checkpoint``, which Lightning
requires on every rank. ``ModelCheckpoint(save_weights_only=True)`` does not call the callbacks'
``on_save_checkpoint`` on the way, and the strategy's ``CheckpointIO`` writes on rank 0 alone, where a check that
needs every rank's verdict would hang the others. So the guard wraps ``save_checkpoint`` of one trainer instance:
before the checkpoint is assembled, on every rank together, it calls a function (Rollback's: check the state, roll
back when it is not finite), then delegates to the trainer's own method. It is installed in ``setup`` and removed in
``teardown``; nothing else on the trainer changes.

Sharded and split states. Under FSDP2 (``ModelParallelStrategy``) parameters and optimizer moments are ``DTensor``
shards: the training state here is each rank's local shards (views, see
:func:`~lightning_overflow.numerics.snapshots.local_state`), read, checked and restored in place without a
collective (the strategy's own ``lightning_module_state_dict`` and ``optimizer_state`` gather full copies to the CPU,
and its load methods do nothing). Under DDP every rank holds the same state, so a snapshot need not be kept on every
rank: :func:`split_snapshot` gives each tensor one owner (balanced by bytes), each rank keeps only its own, and
:func:`restore_` has every owner broadcast its tensors into the other ranks' live tensors.

Example:
    >>> module = torch.nn.Linear(2, 2)
    >>> module.register_buffer("mask", torch.tensor([0.0, float("-inf")]))
    >>> constants = NonFiniteConstants.record(module.state_dict(), ["weight", "bias"])
    >>> constants.paths
    ['mask']
    >>> nonfinite_parts(module.state_dict(), [], constants)
    ([], [])
    >>> module.mask[0] = float("-inf")  # an inf where the fit started with none
    >>> nonfinite_parts(module.state_dict(), [], constants)
    (['mask'], [])
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_overflow import _compat
from lightning_overflow.distributed import named_on_any_rank, per_rank_values, ranks_where, world
from lightning_overflow.numerics.norms import any_sharded, local_shard
from lightning_overflow.numerics.snapshots import (
    SnapshotError,
    clone_state,
    group_sizes,
    local_state,
    named_state_tensors,
    nonfinite_flag,
    nonfinite_indices,
    nonfinite_suspect,
    partition_by_size,
    restore_optimizer_,
    restore_state_,
    state_difference,
    state_tensors,
    synchronize,
)
from lightning_overflow.replicas import compare

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = [
    "STATE_PARTS",
    "CheckpointGuard",
    "NonFiniteConstants",
    "StateCheck",
    "across_pruning",
    "check_state",
    "checked_weights",
    "effective_weights",
    "live_state",
    "module_layout",
    "nonfinite_flags",
    "nonfinite_parts",
    "optimizer_labels",
    "own_optimizer",
    "own_optimizer_state",
    "parameter_names",
    "pruned_away",
    "pruned_pairs",
    "pruned_since",
    "restorable",
    "restore_",
    "restore_hint",
    "restore_module_",
    "snapshot_owners",
    "split_snapshot",
    "unrestorable_optimizer",
    "without_tolerated_infinity",
]

STATE_PARTS = ("model", "optimizers", "schedulers", "precision")
"""The keys of a training state as :func:`live_state` returns it."""

_EXTRA_STATE = "_extra_state"  # the key torch gives the value of ``get_extra_state`` (Module._EXTRA_STATE_KEY_SUFFIX)


# ---- reading and restoring --------------------------------------------------------------------------------------
def own_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer of the state this rank holds, for a check: a ``ZeroRedundancyOptimizer``'s local one (its own
    ``state_dict()`` raises until the ranks' parts are consolidated, a collective, and numbers the parameters of
    every rank)."""
    if _keeps_its_part(optimizer):
        return optimizer.optim  # type: ignore[attr-defined,no-any-return]
    return optimizer


def unrestorable_optimizer(optimizers: Sequence[torch.optim.Optimizer]) -> str | None:
    """The class name of an optimizer whose state cannot be restored in place (each rank of a
    ``ZeroRedundancyOptimizer`` keeps its own part, in a layout of its own); ``None`` when every one can be."""
    return next((type(o).__name__ for o in optimizers if _keeps_its_part(o)), None)


def _keeps_its_part(optimizer: torch.optim.Optimizer) -> bool:
    """Whether each rank holds only its part of ``optimizer``'s state (a ``ZeroRedundancyOptimizer``)."""
    return type(optimizer).__name__ == "ZeroRedundancyOptimizer"


def restore_hint(unrestorable: str | None) -> str:
    """How to get back a state verified finite: ``Rollback``, or where it cannot restore the optimizer
    (``unrestorable``, see :func:`unrestorable_optimizer`), the last checkpoint.

    Example:
        >>> restore_hint(None)
        'add Rollback (default_callbacks()) to restore the last state verified finite'
    """
    if unrestorable is None:
        return "add Rollback (default_callbacks()) to restore the last state verified finite"
    return (f"resume from your last checkpoint (Rollback cannot restore a {unrestorable}'s state; with a plain torch "
            "optimizer it can)")


def own_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``state_dict()`` of :func:`own_optimizer`."""
    return own_optimizer(optimizer).state_dict()


def live_state(trainer: pl.Trainer) -> dict[str, Any]:
    """The training state of ``trainer`` as live ``state_dict`` s: their tensors are the live ones (no copy).

    Returns:
        ``{"model": ..., "optimizers": [...], "schedulers": [...], "precision": ...}`` (see :data:`STATE_PARTS`),
        and beside them ``"scheduler_kinds"`` (each scheduler's class) and ``"averages"``: the averaged copies of the
        model that callbacks keep (``StochasticWeightAveraging``, ``WeightAveraging``, an EMA's ``AveragedModel``),
        which a rollback takes back with the weights they averaged.
    """
    strategy = trainer.strategy
    if _compat.sharded_strategy(strategy) is None:
        model = strategy.lightning_module_state_dict()
        optimizers = [strategy.optimizer_state(optimizer) for optimizer in trainer.optimizers]
    else:  # this rank's shards, as views: the strategy's methods would gather full copies (collectives)
        model = local_state(trainer.lightning_module.state_dict())
        optimizers = [local_state(optimizer.state_dict()) for optimizer in trainer.optimizers]
    return {
        "model": model,
        "optimizers": optimizers,
        "schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        "precision": trainer.precision_plugin.state_dict(),
        "scheduler_kinds": _scheduler_kinds(trainer),
        "averages": [
            _average_state(callback, average, swa) for callback, average, swa in _compat.weight_averages(trainer)
        ],
    }


def _scheduler_kinds(trainer: pl.Trainer) -> list[str]:
    return [type(config.scheduler).__qualname__ for config in trainer.lr_scheduler_configs]


def _average_state(callback: Any, average: torch.nn.Module, swa: bool) -> dict[str, Any]:
    """An averaged copy of the model (:func:`~lightning_overflow._compat.weight_averages`): its ``state_dict``, and
    for ``StochasticWeightAveraging`` the count of models in it (``None`` before its first epoch)."""
    if not swa:
        return {"model": average.state_dict()}  # an AveragedModel counts in its own buffer
    return {"model": average.state_dict(), "n_averaged": callback.n_averaged}


def checked_weights(trainer: pl.Trainer, state: Mapping[str, Any]) -> Mapping[str, Any]:
    """The weights a state check reads: the model state of ``state`` (a :func:`live_state`), and beside it the
    parameters of the averaged copies the callbacks keep, as ``<callback class>:<name>`` (``WeightAveraging`` writes
    its average into every checkpoint as the model's weights, and puts it in the model when the fit ends)."""
    averages = _compat.weight_averages(trainer)
    if not averages:
        return state["model"]
    weights = dict(state["model"])
    for callback, average, _ in averages:
        owner = type(callback).__name__
        weights.update((f"{owner}:{name}", p.detach()) for name, p in _compat.averaged_weights(average))
    return weights


def split_snapshot(trainer: pl.Trainer, state: Mapping[str, Any]) -> tuple[list[bool] | None, dict[str, int]]:
    """How the replicas of a DDP fit share a snapshot of ``state`` (a :func:`live_state`): the owners of
    :func:`snapshot_owners`, and which tensors this rank keeps.

    Returns:
        ``(held, owners)``: for each tensor of ``state`` in ``state_tensors`` order, whether this rank keeps it (for
        ``take_snapshot(held=...)``), and the owner of each split tensor by its path; ``(None, {})`` when nothing is
        split (one process, or a sharded strategy, whose ranks hold different shards anyway).
    """
    strategy = trainer.strategy
    world = int(trainer.world_size)
    if world < 2 or not _compat.replicated_strategy(strategy) or not torch.distributed.is_initialized():
        return None, {}
    owners = snapshot_owners(state, world, torch.device(strategy.root_device))
    rank = int(trainer.global_rank)
    held = [owners.get(path, rank) == rank for path, _ in named_state_tensors(state)]
    return held, owners


def snapshot_owners(state: Mapping[str, Any], world_size: int, device: torch.device) -> dict[str, int]:
    """The owner rank of each tensor of a training state that replicas split, by its path: the tensors of the model
    and of the optimizers' ``state`` that live on ``device`` (where the broadcast of a restore runs) and are not
    0-d, balanced by bytes (:func:`~lightning_overflow.numerics.snapshots.partition_by_size`). The small rest (step
    counters, extra state, schedulers, the scaler) is kept on every rank.

    Example:
        >>> state = {"model": {"w": torch.ones(4), "b": torch.ones(1)}, "optimizers": [{"state": {}}]}
        >>> snapshot_owners(state, 2, torch.device("cpu"))
        {'model.w': 0, 'model.b': 1}
    """
    parts = [named_state_tensors(_tensor_entries(state["model"]), "model")]
    for i, saved in enumerate(state["optimizers"]):
        parts.append(named_state_tensors(saved["state"], f"optimizers.{i}.state"))
    split = [
        (path, t) for part in parts for path, t in part
        if t.dim() > 0 and t.layout == torch.strided and t.device == device
    ]
    sizes = [t.numel() * t.element_size() for _, t in split]
    return {path: owner for (path, _), owner in zip(split, partition_by_size(sizes, world_size))}


def module_layout(module: Any) -> tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...]:
    """The names of every submodule's own parameters and buffers: what a reparametrization changes (``ModelPruning``
    turns ``weight`` into ``weight_orig`` and ``weight_mask``; a parametrization moves it into ``original``), read
    without building a ``state_dict`` (about a quarter of its cost).

    Example:
        >>> module_layout(torch.nn.Linear(2, 1))
        (('', ('weight', 'bias'), ()),)
    """
    return tuple((name, tuple(m._parameters), tuple(m._buffers)) for name, m in module.named_modules())


def parameter_names(module: Any) -> dict[int, str]:
    """Each parameter's name, by the identity of the parameter (which a reparametrization keeps)."""
    return {id(p): name for name, p in module.named_parameters()}


def pruned_since(before: Mapping[int, str], module: Any) -> dict[str, str]:
    """The parameters ``torch.nn.utils.prune`` reparametrized since ``before`` (:func:`parameter_names`) was read,
    old name -> new: the same parameter, its values untouched, now ``<name>_orig`` beside a ``<name>_mask`` buffer
    (``ModelPruning`` and every ``prune.*`` function do this). A parametrization is not among them: its ``original``
    holds another representation of the weight (``right_inverse``), so an older state cannot be put into it.

    Example:
        >>> layer = torch.nn.Linear(2, 1)
        >>> names = parameter_names(layer)
        >>> _ = torch.nn.utils.prune.l1_unstructured(layer, "weight", amount=0.5)
        >>> pruned_since(names, layer)
        {'weight': 'weight_orig'}
    """
    buffers = {name for name, _ in module.named_buffers()}
    renamed = {}
    for name, p in module.named_parameters():
        old = before.get(id(p))
        if old is not None and name == old + "_orig" and old + "_mask" in buffers:
            renamed[old] = name
    return renamed


def pruned_away(module: Any) -> set[int]:
    """The parameters ``torch.nn.utils.prune`` masks out whole (``<name>_orig`` beside a ``<name>_mask`` of zeros), by
    id: their gradient is 0 by design. One host read for every mask.

    Example:
        >>> layer = torch.nn.utils.prune.l1_unstructured(torch.nn.Linear(2, 1), "bias", amount=1)
        >>> pruned_away(layer) == {id(layer.bias_orig)}
        True
    """
    masked = [(id(orig), mask) for orig, mask in pruned_pairs(module).values()]
    if not masked:
        return set()
    device = masked[0][1].device
    kept = torch.stack([mask.any().to(device) for _, mask in masked]).tolist()
    return {i for (i, _), any_kept in zip(masked, kept) if not any_kept}


def effective_weights(module: Any) -> list[Tensor]:
    """The weights ``module`` computes with, each module's by name: a pruned one as ``<name>_orig * <name>_mask``,
    which is what making the pruning permanent writes into ``<name>``, so a checksum of them stays the same then.

    Example:
        >>> layer = torch.nn.utils.prune.l1_unstructured(torch.nn.Linear(2, 1), "weight", amount=0.5)
        >>> pruned = effective_weights(layer)
        >>> permanent = effective_weights(torch.nn.utils.prune.remove(layer, "weight"))
        >>> [torch.equal(a, b) for a, b in zip(pruned, permanent)]
        [True, True]
    """
    weights: list[Tensor] = []
    for m in module.modules():
        own: dict[str, Tensor] = {}
        for name, p in m._parameters.items():
            if p is None:
                continue
            base = name.removesuffix("_orig")
            mask = m._buffers.get(base + "_mask") if base != name else None
            own[base] = p.detach() * mask if mask is not None else p.detach()
        weights += [own[name] for name in sorted(own)]
    return weights


def across_pruning(
    saved: Mapping[str, Any], renamed: Mapping[str, str], live: Mapping[str, Any]
) -> dict[str, Any] | None:
    """A snapshot's model state (``saved``) in the layout of the live one after pruning (``renamed``, from
    :func:`pruned_since`): each pruned weight under its new name, and the mask the model prunes with now (a host copy
    of the live one) beside it, so a rollback returns the weights and keeps the pruning. ``None`` when the layouts
    differ in anything else.

    Example:
        >>> saved = {"weight": torch.ones(2), "bias": torch.zeros(1)}
        >>> live = {"bias": torch.zeros(1), "weight_orig": torch.ones(2), "weight_mask": torch.tensor([1.0, 0.0])}
        >>> across_pruning(saved, {"weight": "weight_orig"}, live)["weight_mask"]
        tensor([1., 0.])
    """
    was = {new: old for old, new in renamed.items()}
    masks = {new.removesuffix("_orig") + "_mask" for new in renamed.values()}
    carried: dict[str, Any] = type(saved)() if isinstance(saved, dict) else {}
    for key, value in live.items():
        if was.get(key, key) in saved:
            carried[key] = saved[was.get(key, key)]
        elif key in masks:
            carried[key] = value.detach().to("cpu", copy=True)
        else:
            return None
    if set(saved) - {was.get(key, key) for key in carried}:
        return None  # the live model lost something the snapshot holds
    if hasattr(live, "_metadata"):
        carried._metadata = copy.deepcopy(live._metadata)  # type: ignore[attr-defined]
    return carried


def restorable(trainer: pl.Trainer, state: Any) -> str:
    """Why ``state`` cannot be restored into ``trainer``, or ``""`` when it can.

    It can when it is a training state of this model (same parameters and buffers, the same extra-state entries),
    with one state per optimizer, and each optimizer's param groups are those of the snapshot, or more (groups added
    since, see :func:`~lightning_overflow.numerics.snapshots.restore_optimizer_`). The schedulers may differ: a
    callback can add or swap one during the fit (``StochasticWeightAveraging`` puts its ``SWALR`` in the first
    place when its epochs begin); :func:`restore_` restores those the snapshot holds of the same kind and place.
    """
    if not isinstance(state, Mapping) or not set(STATE_PARTS) <= state.keys():
        return f"it is not a training state (a mapping of {', '.join(STATE_PARTS)})"
    optimizers = state["optimizers"]
    if len(optimizers) != len(trainer.optimizers):
        return f"it holds {len(optimizers)} optimizer state(s), the fit has {len(trainer.optimizers)} optimizer(s)"
    for index, (optimizer, saved) in enumerate(zip(trainer.optimizers, optimizers)):
        live_sizes, saved_sizes = group_sizes(optimizer.param_groups), group_sizes(saved["param_groups"])
        if live_sizes[: len(saved_sizes)] != saved_sizes:
            return (
                f"optimizer {index} has param groups of {live_sizes} parameters, the snapshot {saved_sizes}: "
                f"it belongs to another model or optimizer"
            )
    difference = _module_difference(local_state(trainer.lightning_module.state_dict()), state["model"])
    return f"the model state differs ({difference})" if difference else ""


def restore_(trainer: pl.Trainer, state: Mapping[str, Any], owners: Mapping[str, int] | None = None) -> None:
    """Put a training state back into ``trainer``, copying into the live tensors (never aliasing ``state``).

    Check it first with :func:`restorable`. The gradients are cleared afterwards (``set_to_none``).

    Args:
        owners: for a snapshot split across the ranks (:func:`split_snapshot`), the owner of each split tensor:
            every rank restores what it holds, then each owner broadcasts its tensors into the live tensors of the
            others (a collective: every rank calls this at the same point).
    """
    synchronize()  # the host deep-copies parts of the snapshot: its device-to-host copies must have landed
    masks = _pruning_masks(trainer.lightning_module)
    restore_module_(trainer.lightning_module, state["model"])
    for optimizer, saved in zip(trainer.optimizers, state["optimizers"]):
        restore_optimizer_(optimizer, saved)
    # A scheduler of another kind than the snapshot's in its place, or none there (added since), stays as it is: its
    # state would not fit. A snapshot of an earlier release names no kinds: its schedulers are restored by place when
    # the fit has as many.
    kinds = state.get("scheduler_kinds")
    if kinds is None:
        kinds = _scheduler_kinds(trainer) if len(state["schedulers"]) == len(trainer.lr_scheduler_configs) else []
    for config, kind, saved in zip(trainer.lr_scheduler_configs, kinds, state["schedulers"]):
        if type(config.scheduler).__qualname__ == kind:
            config.scheduler.load_state_dict(copy.deepcopy(saved))  # schedulers keep what they load: copy first
    for (callback, average, swa), saved in zip(_compat.weight_averages(trainer), state.get("averages", [])):
        restore_module_(average, saved["model"])
        if swa and callback.n_averaged is not None:  # none before its first epoch: nothing averaged yet
            count = saved.get("n_averaged")
            callback.n_averaged.copy_(count) if count is not None else callback.n_averaged.zero_()
    if state["precision"]:
        trainer.precision_plugin.load_state_dict(copy.deepcopy(state["precision"]))
    if owners:
        _broadcast_from_owners(live_state(trainer), owners)
    for live, mask in masks:  # the pruning goes on as it stands: a rollback returns the weights, not the masks
        live.copy_(mask)
    for optimizer in trainer.optimizers:
        optimizer.zero_grad(set_to_none=True)


def _pruning_masks(module: torch.nn.Module) -> list[tuple[Tensor, Tensor]]:
    """``(live mask, a copy of it)`` of every weight ``torch.nn.utils.prune`` masks: ``ModelPruning`` prunes again at
    each epoch's end with the same layout, and a snapshot from before would otherwise bring back what it pruned."""
    return [(mask, mask.detach().clone()) for _, mask in pruned_pairs(module).values()]


def pruned_pairs(module: torch.nn.Module) -> dict[str, tuple[Tensor, Tensor]]:
    """``(<name>_orig, <name>_mask)`` of every weight ``torch.nn.utils.prune`` masks (a parameter beside a buffer),
    by the mask's name in ``module``'s state.

    Example:
        >>> layer = torch.nn.utils.prune.l1_unstructured(torch.nn.Linear(2, 1), "weight", amount=0.5)
        >>> list(pruned_pairs(torch.nn.Sequential(layer)))
        ['0.weight_mask']
    """
    pairs = {}
    for prefix, m in module.named_modules():
        for name, p in m._parameters.items():
            key = name.removesuffix("_orig") + "_mask"
            if p is not None and name.endswith("_orig") and m._buffers.get(key) is not None:
                pairs[f"{prefix}.{key}" if prefix else key] = (p, m._buffers[key])
    return pairs


def restore_module_(module: torch.nn.Module, saved: Mapping[str, Any]) -> None:
    """Restore a module's whole ``state_dict`` from a snapshot of it: parameters and buffers copied in place, each
    ``get_extra_state`` value handed to its module's ``set_extra_state`` (as a clone).

    Copying into ``module.state_dict()`` alone would miss the extra state: ``get_extra_state`` returns a new object,
    and a copy into it changes nothing. A snapshot of another layout is loaded from a clone instead.

    Example:
        >>> layer = torch.nn.Linear(2, 1)
        >>> saved = clone_state(layer.state_dict())
        >>> with torch.no_grad():
        ...     _ = layer.weight.fill_(float("nan"))
        >>> restore_module_(layer, saved)
        >>> bool(torch.equal(layer.weight, saved["weight"]))
        True
    """
    live = local_state(module.state_dict())
    difference = _module_difference(live, saved)
    if difference:
        if any_sharded(state_tensors(module.state_dict())):  # load_state_dict would want full tensors
            raise SnapshotError(f"a sharded module cannot load a snapshot of another layout ({difference})")
        module.load_state_dict(clone_state(saved))
        return
    restore_state_(_tensor_entries(live), _tensor_entries(saved))
    for key, value in saved.items():
        if _is_extra_state(key):
            owner = module.get_submodule(key[: -len(_EXTRA_STATE)].rstrip("."))
            owner.set_extra_state(clone_state(value))


# ---- finiteness -------------------------------------------------------------------------------------------------
class NonFiniteConstants:
    """Where the buffers of a module state held ``+inf``, ``-inf`` and NaN when they were first seen.

    Attributes:
        paths: the dotted state paths of the tensors that held an inf or NaN (most modules have none).
        placeholders: those of them that held NaN.

    Use :meth:`record` at the start of the fit and :meth:`learn` before each check; :func:`nonfinite_flags` then
    accepts those values where they were, and nowhere else. A buffer is seen first when the fit starts, or when it
    appears or changes shape during the fit (a causal mask built on the first forward, or rebuilt for a longer
    sequence): its infs then are constants too. A NaN a buffer held at the first record (the fit's start) is a
    placeholder for a value not computed yet (anomalib's thresholds and normalization bounds are ``nan`` until
    validation computes them); a NaN anywhere else, in a buffer seen later (a statistic computed from a bad batch), or
    in a running statistic every training forward updates (BatchNorm's), is corruption. Parameters are never
    recorded: they stay strictly checked.
    """

    def __init__(self, patterns: Mapping[str, tuple[Tensor, Tensor, Tensor]] | None = None) -> None:
        self._patterns = dict(patterns or {})
        self._shapes: dict[str, torch.Size] = {path: masks[0].shape for path, masks in self._patterns.items()}
        self._seen_once = bool(self._patterns)
        self._placeholders: set[str] = set()  # the paths whose NaN masks are set (known without a host read)

    @classmethod
    def record(cls, model_state: Mapping[str, Any], parameter_names: Iterable[str]) -> NonFiniteConstants:
        """Record the inf positions of every floating-point tensor of ``model_state`` that is no parameter.

        One host read for all tensors, and two boolean masks kept for each tensor that holds an inf.

        Args:
            model_state: a module's ``state_dict()`` (extra-state values are walked too).
            parameter_names: the state keys of the parameters (``named_parameters(remove_duplicate=False)``).
        """
        constants = cls()
        constants._see(model_state, set(parameter_names))
        return constants

    @classmethod
    def of_module(cls, module: torch.nn.Module) -> NonFiniteConstants:
        """:meth:`record` for a module's own state."""
        constants = cls()
        constants.learn(module)
        return constants

    def learn(self, module: torch.nn.Module) -> None:
        """Record the buffers of ``module`` that appeared or changed shape since the last record (one host read
        when there are any; nothing read otherwise). Entered by every rank alike: it needs no collective."""
        statistics = {f"{name}.{key}" if name else key
                      for name, m in module.named_modules() if getattr(m, "track_running_stats", False)
                      for key in ("running_mean", "running_var")}  # fmt: skip
        self._see(module.state_dict(), {name for name, _ in module.named_parameters(remove_duplicate=False)},
                  statistics)

    def _see(self, model_state: Mapping[str, Any], parameters: set[str], statistics: Collection[str] = ()) -> None:
        new = [
            (path, t.detach())
            for path, t in named_state_tensors(model_state)
            if path not in parameters and t.is_floating_point() and t.numel() > 0 and t.device.type != "meta"
            and self._shapes.get(path) != t.shape
        ]  # fmt: skip
        first, self._seen_once = not self._seen_once, True  # NaN is a placeholder only where the fit started with it
        if not new:
            return
        device = new[0][1].device
        # Two flags a tensor, one read: it holds an inf; it holds a NaN that may be a placeholder.
        flags = torch.stack([
            torch.stack([torch.isinf(t).any(), torch.isnan(t).any() & (first and path not in statistics)]).to(device)
            for path, t in new
        ]).tolist()  # fmt: skip
        for (path, t), (inf, nan) in zip(new, flags):
            self._shapes[path] = t.shape
            self._placeholders.discard(path)
            if inf or nan:
                missing = torch.isnan(t) if nan else torch.zeros_like(t, dtype=torch.bool)
                self._patterns[path] = (torch.isposinf(t), torch.isneginf(t), missing)
                if nan:
                    self._placeholders.add(path)
            else:
                self._patterns.pop(path, None)

    def forget_placeholders(self, written: Iterable[str]) -> None:
        """A buffer a training step wrote is no placeholder: a value not computed yet is computed elsewhere (at a
        validation's end), and a NaN a step keeps writing (a running mean resumed from a damaged checkpoint) is a
        fault. No host read."""
        for path in self._placeholders.intersection(written):
            self._placeholders.discard(path)
            positive, negative, missing = self._patterns[path]
            self._patterns[path] = (positive, negative, torch.zeros_like(missing))

    @property
    def paths(self) -> list[str]:
        return list(self._patterns)

    @property
    def placeholders(self) -> list[str]:
        return [path for path in self._patterns if path in self._placeholders]

    def without_constants(self, path: str, tensor: Tensor) -> Tensor:
        """``tensor`` with its recorded infs and NaNs set to 0 (no host read); ``tensor`` itself when it has none
        recorded.

        An inf of the recorded sign, or a NaN, at a position recorded for it is a constant; anything else that is not
        finite stays, and the finiteness check sees it.
        """
        pattern = self._patterns.get(path)
        if pattern is None or pattern[0].shape != tensor.shape:
            return tensor
        positive, negative, missing = (mask.to(tensor.device) for mask in pattern)
        known = ((positive & (tensor == float("inf"))) | (negative & (tensor == float("-inf")))
                 | (missing & torch.isnan(tensor)))  # fmt: skip
        return tensor.detach().masked_fill(known, 0)


def without_tolerated_infinity(moment: Tensor) -> Tensor:
    """An optimizer state tensor with the ``+inf`` its optimizer tolerates set to 0 (no host read).

    A second-moment accumulator (Adam's ``exp_avg_sq``, RMSprop's ``square_avg``, Adagrad's ``sum``) holds no
    negative value and divides the update: where it reached ``+inf`` (a gradient of 1e20 or more squared, often one
    extreme value in the data), that element's update is ``exp_avg / inf = 0``. The optimizer goes on, the weights
    stay finite, and a snapshot of that state restores a run that trains exactly as it would have. So ``+inf`` in a
    tensor with no negative value is no fault of the state; NaN, ``-inf``, or ``+inf`` in a signed tensor (a first
    moment: its update is inf) stays, and the check sees it. Should a tolerated inf ever reach the weights (an
    optimizer that multiplies by it), the weights' own check finds them.

    Example:
        >>> without_tolerated_infinity(torch.tensor([0.5, float("inf")]))
        tensor([0.5000, 0.0000])
        >>> without_tolerated_infinity(torch.tensor([-0.5, float("inf")]))
        tensor([-0.5000,     inf])
    """
    if not moment.is_floating_point() or moment.dim() == 0:
        return moment
    if moment.is_sparse:  # SGD's momentum of a sparse gradient (nn.Embedding(sparse=True)): its values say it all
        moment = moment.detach().coalesce().values()
    moment = local_shard(moment.detach())  # a DTensor's shard on this rank (it may be empty): the flags are per rank
    if moment.numel() == 0:
        return moment
    unsigned = moment.amin() >= 0  # NaN makes it False: a NaN tensor is checked as it is
    return moment.masked_fill((moment == float("inf")) & unsigned, 0)


@dataclass(frozen=True)
class StateCheck:
    """Which ranks hold non-finite weights (parameters and buffers) or optimizer state, and the offenders' names on
    any of them: identical on every rank."""

    weight_ranks: tuple[int, ...]
    state_ranks: tuple[int, ...]
    weight_names: tuple[str, ...] = ()
    state_names: tuple[str, ...] = ()
    #: The ranks whose weights differ from the other replicas' (only when asked, and only for a finite state).
    replica_ranks: tuple[int, ...] = ()

    @property
    def finite(self) -> bool:
        return not self.weight_ranks and not self.state_ranks

    @property
    def what(self) -> str:
        """``"weights"`` or ``"optimizer state"``: the part to name in a message (the weights first)."""
        return "weights" if self.weight_ranks else "optimizer state"

    @property
    def contain(self) -> str:
        """The verb that agrees with :attr:`what`: ``"contain"`` (the weights) or ``"contains"`` (the optimizer
        state)."""
        return "contain" if self.weight_ranks else "contains"

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks of :attr:`what`."""
        return self.weight_ranks or self.state_ranks

    @property
    def names(self) -> list[str]:
        return [*self.weight_names, *self.state_names]


def nonfinite_flags(
    model_state: Mapping[str, Any],
    optimizer_states: Sequence[Any],
    constants: NonFiniteConstants | None = None,
    *,
    suspect: bool = False,
) -> tuple[Tensor, Tensor]:
    """Two 0-d float64 device flags, ``1.0`` where the model state, and the optimizer states, hold inf/NaN by the
    rule of this module. No host read.

    Args:
        model_state: a module's ``state_dict()`` (the live one costs no copy), a snapshot or file of it.
        optimizer_states: ``optimizer.state_dict()`` of each optimizer (0-d entries, the step counters, are left
            out).
        constants: the buffers' legitimate infs (default: none, every inf is non-finite).
        suspect: the first look (:func:`~lightning_overflow.numerics.snapshots.nonfinite_suspect`, a sum of each
            tensor): never misses inf/NaN, and is raised by finite values only beyond about 1e32; :func:`check_state`
            decides a raised one with the exact flags.
    """
    constants = constants or NonFiniteConstants()
    weights = [constants.without_constants(path, t) for path, t in named_state_tensors(model_state)]
    if suspect:  # a sum: an inf the optimizer tolerates raises it too, and the exact check decides
        return nonfinite_suspect(weights), nonfinite_suspect(state_tensors(list(optimizer_states)), scalars=False)
    moments = [without_tolerated_infinity(t) for t in state_tensors(list(optimizer_states))]
    return nonfinite_flag(weights), nonfinite_flag(moments, scalars=False)


def nonfinite_parts(
    model_state: Mapping[str, Any],
    optimizer_states: Sequence[Any],
    constants: NonFiniteConstants | None = None,
    labels: Sequence[Sequence[str]] | None = None,
) -> tuple[list[str], list[str]]:
    """The names of the tensors that hold inf/NaN on this rank, by the rule of :func:`nonfinite_flags`: model state
    paths (``"net.0.weight"``, ``"bn.running_var"``) and optimizer state labels (``"net.0.weight.exp_avg_sq"``
    with ``labels``, ``"state.0.exp_avg_sq"`` without). One host read; for messages, off the hot path.

    Args:
        labels: for each optimizer, its parameter names in ``state_dict`` order (see :func:`optimizer_labels`); the
            parameters among the model state's names then come first (a message quotes the first few: SWAG's twenty
            buffers, registered before them, hid the parameters that held the NaN).
    """
    constants = constants or NonFiniteConstants()
    weights = named_state_tensors(model_state)
    moments = [
        (_label(path, labels[i] if labels is not None and i < len(labels) else None), t)
        for i, state in enumerate(optimizer_states)
        for path, t in named_state_tensors(state)
    ]
    checked = [constants.without_constants(path, t) for path, t in weights]
    weight_names = [weights[i][0] for i in nonfinite_indices(checked)]
    if labels is not None:
        trained = {name for names in labels for name in names}
        weight_names.sort(key=lambda name: name not in trained)  # stable: the parameters first, each in its order
    checked_moments = [without_tolerated_infinity(t) for _, t in moments]
    state_names = [moments[i][0] for i in nonfinite_indices(checked_moments, scalars=False)]
    return weight_names, state_names


def check_state(
    model_state: Mapping[str, Any],
    optimizer_states: Sequence[Any],
    constants: NonFiniteConstants | None,
    device: torch.device | str,
    labels: Callable[[], Sequence[Sequence[str]]] | None = None,
    parity: Tensor | None = None,
) -> StateCheck:
    """Check a training state on every rank together: one all-reduce of two flags per rank, one host read; the
    exact flags (a second, where the first look raised a suspect: :func:`nonfinite_flags` ``suspect``) and the names
    (a third) only when some rank may hold inf/NaN.

    Entered on every rank at the same point (the caller decides from values identical on all ranks).

    Args:
        device: where the flags are reduced (the strategy's root device).
        labels: returns the parameter names of :func:`nonfinite_parts` (called only when there is something to
            name, e.g. ``lambda: optimizer_labels(module, optimizers)``).
        parity: this rank's :func:`~lightning_overflow.replicas.checksum` of its weights, compared with the other
            ranks' in the same all-reduce (for replicas, which must hold the same weights); ``None``: not compared.
    """
    weights, moments = nonfinite_flags(model_state, optimizer_states, constants, suspect=True)
    world_size = world()[1]
    values = [weights, moments] if parity is None else [weights, moments, *parity.reshape(-1)]
    summed = per_rank_values(values, device)
    weight_ranks, state_ranks = ranks_where(summed[: 2 * world_size], world_size)
    if weight_ranks or state_ranks:  # every rank knows of the suspect, so every rank enters the exact check
        exact = per_rank_values(list(nonfinite_flags(model_state, optimizer_states, constants)), device)
        weight_ranks, state_ranks = ranks_where(exact, world_size)
    if not weight_ranks and not state_ranks:
        mismatch = compare(summed[2 * world_size :], world_size) if parity is not None else None
        return StateCheck((), (), replica_ranks=mismatch.ranks if mismatch is not None else ())
    names = labels() if labels is not None else None
    weight_names, state_names = named_on_any_rank(*nonfinite_parts(model_state, optimizer_states, constants, names))
    return StateCheck(weight_ranks, state_ranks, tuple(weight_names), tuple(state_names))


def optimizer_labels(module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> list[list[str]]:
    """For each optimizer, the names of its parameters in ``state_dict`` order (for :func:`nonfinite_parts`)."""
    names = {id(p): name for name, p in module.named_parameters()}
    return [
        [names.get(id(p), f"<unnamed {tuple(p.shape)}>") for group in optimizer.param_groups for p in group["params"]]
        for optimizer in optimizers
    ]


# ---- the checkpoint guard ---------------------------------------------------------------------------------------
class CheckpointGuard:
    """Call ``before_save(trainer)`` before every ``trainer.save_checkpoint(...)`` of one trainer, on every rank.

    ``before_save`` runs before the checkpoint is assembled, so what it changes (a rollback) is what gets written;
    when it raises, nothing is written. The trainer's own ``save_checkpoint`` (a subclass's too) does the writing.

    Args:
        trainer: the trainer whose saves to guard (held weakly).
        before_save: called with the trainer; entered on every rank together, as ``save_checkpoint`` is.

    Attributes:
        saving: ``True`` while a guarded save runs (so that a callback's ``on_save_checkpoint`` knows the state was
            just checked).

    Example:
        >>> import pytorch_lightning as pl
        >>> trainer = pl.Trainer(logger=False, enable_checkpointing=False)
        >>> guard = CheckpointGuard(trainer, lambda trainer: None)
        >>> trainer.save_checkpoint is guard
        True
        >>> guard.remove()
        >>> trainer.save_checkpoint is guard
        False
    """

    def __init__(self, trainer: pl.Trainer, before_save: Callable[[pl.Trainer], None]) -> None:
        self._trainer = weakref.ref(trainer)
        self._before_save = before_save
        self.saving = False
        # Another guard already there keeps working.
        self._inner = _compat.replace_method(trainer, "save_checkpoint", self)

    def __call__(self, filepath: Any, weights_only: bool | None = None, storage_options: Any | None = None) -> None:
        trainer = self._trainer()
        if trainer is None:
            raise RuntimeError("the trainer of this checkpoint guard is gone")
        self._before_save(trainer)
        save = self._inner if self._inner is not None else type(trainer).save_checkpoint.__get__(trainer)
        self.saving = True
        try:
            save(filepath, weights_only=weights_only, storage_options=storage_options)
        finally:
            self.saving = False

    def remove(self) -> None:
        """Give the trainer its own ``save_checkpoint`` back (what was there before the guard)."""
        trainer = self._trainer()
        if trainer is None or vars(trainer).get("save_checkpoint") is not self:
            return
        _compat.restore_method(trainer, "save_checkpoint", self._inner)


# ---- internals --------------------------------------------------------------------------------------------------
_BUCKET_BYTES = 64 << 20  # one broadcast per owner and dtype moves at most this much (plus one tensor)


def _broadcast_from_owners(live: Mapping[str, Any], owners: Mapping[str, int]) -> None:
    """Each owner broadcasts its tensors of ``live`` to the other ranks, flattened into buckets by dtype; the
    others copy them into their live tensors. Every rank walks ``owners`` in the same order."""
    tensors = dict(named_state_tensors(live))
    missing = [path for path in owners if path not in tensors]
    if missing:  # every rank has the same layout, so every rank raises here together
        raise SnapshotError(f"the live state has no tensor at {missing[:5]}, which the split snapshot holds")
    rank = torch.distributed.get_rank()
    groups: dict[tuple[int, torch.dtype], list[Tensor]] = {}
    for path, owner in owners.items():
        t = tensors[path].detach()
        groups.setdefault((owner, t.dtype), []).append(t)
    for (owner, _), group in groups.items():
        for bucket in _buckets(group):
            if rank == owner:
                flat = torch.cat([t.reshape(-1) for t in bucket])
            else:
                flat = torch.empty(sum(t.numel() for t in bucket), dtype=bucket[0].dtype, device=bucket[0].device)
            torch.distributed.broadcast(flat, src=owner)
            if rank != owner:
                views = [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in bucket]), bucket)]
                torch._foreach_copy_(bucket, views)


def _buckets(tensors: list[Tensor]) -> list[list[Tensor]]:
    out: list[list[Tensor]] = [[]]
    size = 0
    for t in tensors:
        if out[-1] and size + t.numel() * t.element_size() > _BUCKET_BYTES:
            out.append([])
            size = 0
        out[-1].append(t)
        size += t.numel() * t.element_size()
    return out


def _is_extra_state(key: str) -> bool:
    return key == _EXTRA_STATE or key.endswith("." + _EXTRA_STATE)


def _tensor_entries(state: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in state.items() if not _is_extra_state(key)}


def _module_difference(live: Mapping[str, Any], saved: Any) -> str:
    """Where a module snapshot cannot be restored in place: tensors by :func:`state_difference`, extra state by key
    (its values may change shape freely: they are handed to ``set_extra_state``)."""
    if not isinstance(saved, Mapping):
        return f"a {type(saved).__name__}, not a state_dict"
    extra_live = sorted(key for key in live if _is_extra_state(key))
    extra_saved = sorted(str(key) for key in saved if _is_extra_state(str(key)))
    if extra_live != extra_saved:
        return f"extra state of {extra_saved} in the snapshot, of {extra_live} in the model"
    return state_difference(_tensor_entries(live), _tensor_entries(saved))


def _label(path: str, names: Sequence[str] | None) -> str:
    """``state.<index>.<key>`` as ``<parameter name>.<key>`` when the names are known."""
    parts = path.split(".", 2)
    if names is None or len(parts) != 3 or parts[0] != "state" or not parts[1].isdigit():
        return path
    index = int(parts[1])
    return f"{names[index]}.{parts[2]}" if index < len(names) else path
