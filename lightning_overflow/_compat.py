"""The one place that touches Lightning's (and torch's) private API. Each item names the version it was checked on.

Checked against pytorch-lightning 2.6.6 and torch 2.13.0.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel

if importlib.util.find_spec("lightning") is not None and importlib.util.find_spec("lightning.pytorch") is not None:
    import lightning.pytorch as _unified

    _SWA: tuple[type, ...] = (pl.callbacks.StochasticWeightAveraging, _unified.callbacks.StochasticWeightAveraging)
    _BACKBONE: tuple[type, ...] = (pl.callbacks.BackboneFinetuning, _unified.callbacks.BackboneFinetuning)
    CALLBACK_BASES: tuple[type, ...] = (pl.Callback, _unified.Callback)

    class Callback(pl.Callback, _unified.Callback):  # type: ignore[misc]
        """A Lightning ``Callback`` in both namespaces: ``pytorch_lightning`` and the unified ``lightning.pytorch``.

        Trainers of either namespace run any object with the hook methods, but ``isinstance`` checks (LightningCLI's
        ``class_path`` validation, the Trainer's own checks) name one namespace; this base satisfies both.
        """

else:
    Callback = pl.Callback  # type: ignore[misc]
    _SWA = (pl.callbacks.StochasticWeightAveraging,)
    _BACKBONE = (pl.callbacks.BackboneFinetuning,)
    CALLBACK_BASES = (pl.Callback,)

__all__ = [
    "CALLBACK_BASES",
    "Callback",
    "REPLICATED_STRATEGIES",
    "SHARDED_STRATEGIES",
    "SUPPORTED_SHARDED_STRATEGIES",
    "UNSUPPORTED_STRATEGIES",
    "check_strategy",
    "replicated_strategy",
    "sharded_strategy",
    "batches_that_stepped",
    "callback_metrics",
    "epoch_sums",
    "put_back_epoch_sums",
    "summed_in_training",
    "progress_bar_metrics",
    "scaler_found_inf",
    "scaler_of",
    "scaler_scale",
    "scaler_unscaled",
    "should_update_logs",
    "BATCH_HOOKS",
    "mute_hooks",
    "optimizer_steps_this_batch",
    "fit_ends_after_batch",
    "unmute_hooks",
    "weight_averages",
    "averaged_weights",
]


def batches_that_stepped(trainer: pl.Trainer) -> int:
    """The step value Lightning itself logs with (``LearningRateMonitor`` uses the same; 2.6.6)."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def should_update_logs(trainer: pl.Trainer) -> bool:
    """Whether this training batch is a logging step under ``Trainer(log_every_n_steps=...)`` (2.6.6)."""
    return bool(trainer._logger_connector.should_update_logs)


def callback_metrics(trainer: pl.Trainer) -> dict[str, Any]:
    """The dict behind ``trainer.callback_metrics``: entries put there stay until Lightning overwrites the key
    (``_LoggerConnector._callback_metrics``, returned by the public property; 2.6.6)."""
    return trainer.callback_metrics


def _training_results(trainer: pl.Trainer) -> dict[str, Any]:
    """Lightning's training results: one entry per hook and logged name (2.6.6: ``fit_loop.epoch_loop._results``)."""
    return getattr(getattr(trainer.fit_loop, "epoch_loop", None), "_results", None) or {}


def _sums_over_the_epoch(entry: Any) -> bool:
    """Whether a results entry sums a tensor over the epoch (``self.log(name, tensor, on_epoch=True)``; 2.6.6:
    ``_ResultMetric`` with ``is_tensor`` and ``meta.on_epoch``). A torchmetrics ``Metric`` logged as the value keeps
    its state in the user's object."""
    return bool(getattr(entry, "is_tensor", False)) and bool(getattr(getattr(entry, "meta", None), "on_epoch", False))


def epoch_sums(trainer: pl.Trainer) -> list[tuple[Any, Tensor, Tensor | None]]:
    """Each epoch sum of the training results with its tensors as they are now: ``value`` and, for a mean, its
    ``cumulated_batch_size``. An update assigns new tensors and never writes into these (2.6.6:
    ``_ResultMetric.update``), so keeping them keeps this moment's sums, at no copy."""
    return [(entry, entry.value, getattr(entry, "cumulated_batch_size", None))
            for entry in _training_results(trainer).values() if _sums_over_the_epoch(entry)]  # fmt: skip


def put_back_epoch_sums(trainer: pl.Trainer, kept: list[tuple[Any, Tensor, Tensor | None]]) -> None:
    """The epoch sums as :func:`epoch_sums` kept them; a sum first logged since starts again from its defaults
    (``Metric.reset``), its step value kept for the batch's step logging."""
    kept_ids = set()
    for entry, value, count in kept:
        entry.value = value
        if count is not None:
            entry.cumulated_batch_size = count
        kept_ids.add(id(entry))
    for entry in _training_results(trainer).values():
        if _sums_over_the_epoch(entry) and id(entry) not in kept_ids:
            _restart(entry)


def put_back_nonfinite_epoch_sums(trainer: pl.Trainer, kept: list[tuple[Any, Tensor, Tensor | None]]) -> None:
    """The epoch sums that hold inf/NaN now, as :func:`epoch_sums` kept them (one first logged since starts again
    from its defaults); the others as they are. One host read a sum."""
    before = {id(entry): (value, count) for entry, value, count in kept}
    for entry in _training_results(trainer).values():
        if not _sums_over_the_epoch(entry) or bool(torch.isfinite(entry.value).all()):
            continue
        if id(entry) in before:
            entry.value, count = before[id(entry)]
            if count is not None:
                entry.cumulated_batch_size = count
        else:
            _restart(entry)


def _restart(entry: Any) -> None:
    """An epoch sum first logged since the sums were kept: back to its defaults (``Metric.reset``), its step value
    kept for the batch's step logging."""
    step_value, reset = entry._forward_cache, entry.has_reset
    entry.reset()
    entry._forward_cache, entry.has_reset = step_value, reset


def summed_in_training(trainer: pl.Trainer, key: str) -> bool:
    """Whether every entry of the training results that logged ``key`` (or its ``_step``/``_epoch`` forms) is a
    tensor summed over the epoch by a hook of the batch (``training_step``, ``on_train_batch_end``...): sums
    :func:`put_back_epoch_sums` takes a skipped step's values out of. Not so for a torchmetrics ``Metric`` (the user's
    state) or a value logged at an epoch's end (computed by the user's code)."""
    entries = _logged_as(trainer, key)
    return bool(entries) and all(_sums_over_the_epoch(e) and "epoch" not in str(e.meta.fx) for e in entries)


def hold_checkpoint_saves(callback: Any, step: int) -> None:
    """Have a ``ModelCheckpoint`` write nothing more at ``step``, as if it had saved there (2.6.6:
    ``_should_skip_saving_checkpoint`` compares ``_last_global_step_saved`` with the step): no public hook holds one
    save of a checkpoint callback."""
    callback._last_global_step_saved = step


def logged_per_step_only(trainer: pl.Trainer, key: str) -> bool:
    """Whether an entry of the training results that logged ``key`` holds one step's value, not an epoch's:
    ``self.log(name, value)`` from ``training_step`` (Lightning's default there is ``on_epoch=False``; 2.6.6:
    ``meta.on_epoch`` false). A monitor of it reads the value of the last step before the check."""
    return any(not getattr(getattr(e, "meta", None), "on_epoch", True) for e in _logged_as(trainer, key))


def monitors_one_step(trainer: pl.Trainer, key: str) -> bool:
    """Whether a monitor of ``key`` reads one training step's value: ``key`` was logged on the step only, or is the
    ``_step`` form of a value logged on the step and the epoch (2.6.6: ``meta.on_step``/``meta.on_epoch``)."""
    for entry in _logged_as(trainer, key):
        meta = getattr(entry, "meta", None)
        if getattr(meta, "on_step", False) and (not getattr(meta, "on_epoch", True) or key.endswith("_step")):
            return True
    return False


def logged_metric_objects(trainer: pl.Trainer, key: str) -> list[Any]:
    """The torchmetrics ``Metric`` objects the training results logged ``key`` from (2.6.6: the ``value`` of an
    entry whose ``is_tensor`` is false); empty when any entry logged a tensor."""
    entries = _logged_as(trainer, key)
    if not entries or any(getattr(e, "is_tensor", True) for e in entries):
        return []
    return [e.value for e in entries]


def logged_in_training(trainer: pl.Trainer, key: str) -> bool:
    """Whether a hook of the training loop (``training_step``, ``on_train_*``) logged ``key`` in this epoch so far,
    as ``key`` or its ``_step``/``_epoch`` forms: Lightning's training results (2.6.6:
    ``fit_loop.epoch_loop._results``, one entry per hook and name). Where a metric comes from, not how it is spelt."""
    return bool(_logged_as(trainer, key))


def _logged_as(trainer: pl.Trainer, key: str) -> list[Any]:
    """The training results' entries that logged ``key``, as ``key`` or its ``_step``/``_epoch`` forms."""
    names = {key, key.removesuffix("_epoch"), key.removesuffix("_step")}
    return [e for e in _training_results(trainer).values() if getattr(getattr(e, "meta", None), "name", None) in names]


def clips_its_own_gradients(pl_module: Any) -> bool:
    """Whether the LightningModule overrides ``configure_gradient_clipping`` (its own clipping, called by Lightning
    after the callbacks' ``on_before_optimizer_step``; checked against the Lightning base class it derives from, in
    either namespace)."""
    base = next((c for c in type(pl_module).__mro__ if c.__module__.endswith(".core.module")), None)
    hook = getattr(type(pl_module), "configure_gradient_clipping", None)
    return base is not None and hook is not getattr(base, "configure_gradient_clipping", hook)


def progress_bar_metrics(trainer: pl.Trainer) -> dict[str, Any]:
    """The dict behind ``trainer.progress_bar_metrics`` (``_LoggerConnector._progress_bar_metrics``; 2.6.6)."""
    return trainer.progress_bar_metrics


def scaler_of(trainer: pl.Trainer) -> Any | None:
    """The ``GradScaler`` of a ``16-mixed`` run, ``None`` otherwise (``MixedPrecision.scaler`` is public; 2.6.6)."""
    return getattr(trainer.precision_plugin, "scaler", None)


def scaler_found_inf(scaler: Any, optimizer: Any) -> bool:
    """Have ``scaler`` skip this step of ``optimizer`` and lower its scale, as when its ``unscale_`` finds inf/NaN
    (``_per_optimizer_states[id(optimizer)]["found_inf_per_device"]``; torch 2.13.0): under DDP, ranks whose gradients
    differ must keep one scale, or the next all-reduce averages gradients scaled apart. ``False`` before
    ``unscale_``."""
    state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer)) or {}
    found = state.get("found_inf_per_device") or {}
    for flag in found.values():
        flag.fill_(1.0)
    return bool(found)


def scaler_unscaled(scaler: Any, optimizer: Any) -> bool:
    """Whether ``scaler.unscale_(optimizer)`` was called since the scaler's last ``update()`` (a second call raises):
    ``_per_optimizer_states[id(optimizer)]["stage"]`` is ``OptState.UNSCALED`` then (torch 2.13.0)."""
    state = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer)) or {}
    return getattr(state.get("stage"), "name", "") == "UNSCALED"


def scaler_scale(scaler: Any) -> Tensor | None:
    """The scaler's current scale as a device tensor. ``GradScaler.get_scale()`` would read it to the host, a sync
    per call; ``_scale`` is the tensor behind it (torch 2.13.0). ``None`` before the first scaled backward."""
    return getattr(scaler, "_scale", None)


BATCH_HOOKS = (
    "on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
    "on_before_zero_grad", "on_train_batch_end", "on_validation_batch_start", "on_validation_batch_end",
    "on_test_batch_start", "on_test_batch_end", "on_predict_batch_start", "on_predict_batch_end",
)  # fmt: skip
"""The callback hooks Lightning calls once or more per batch (2.6.6)."""


def mute_hooks(callback: Any, hooks: list[str]) -> tuple[str, ...]:
    """Have Lightning skip ``hooks`` of this callback instance; return the ones muted.

    ``_call_callback_hooks`` calls a hook only when ``callable(getattr(callback, name))`` (2.6.6), and opens a
    profiler context around every call it makes: a few microseconds a hook, a callback and a batch. A hook already
    set on the instance (someone wrapped it) is left alone; ``on_save_checkpoint`` and ``on_load_checkpoint``, which
    Lightning calls directly, are never muted.
    """
    muted = tuple(name for name in hooks if name not in vars(callback))
    for name in muted:
        setattr(callback, name, None)
    return muted


def weight_averages(trainer: Any) -> list[tuple[Any, nn.Module, bool]]:
    """The averaged copies of the model that the trainer's callbacks keep, as ``(callback, average, swa)``: every
    ``torch.optim.swa_utils.AveragedModel`` a callback holds (Lightning's ``WeightAveraging``, an EMA callback of the
    user's), every ``torch_ema.ExponentialMovingAverage`` (schnetpack's EMA callback; its ``shadow_params`` as the
    buffers of a :class:`ShadowParams` view), and ``StochasticWeightAveraging``'s average (``swa``: its
    ``_average_model``, a copy of the LightningModule, whose count of models averaged is the callback's
    ``n_averaged``; 2.6.6).

    They are trained state as the model is: they average the weights a rollback takes back (see
    :func:`~lightning_overflow.training_state.live_state`)."""
    found: list[tuple[Any, nn.Module, bool]] = []
    for callback in getattr(trainer, "callbacks", []):
        if isinstance(callback, _SWA):
            average = getattr(callback, "_average_model", None)
            if isinstance(average, nn.Module):
                found.append((callback, average, True))
            continue
        for value in getattr(callback, "__dict__", {}).values():
            if isinstance(value, AveragedModel):
                found.append((callback, value, False))
            elif _is_torch_ema(value):
                found.append((callback, ShadowParams(value.shadow_params), False))
    return found


def _is_torch_ema(value: Any) -> bool:
    """A ``torch_ema.ExponentialMovingAverage`` (0.3): its averages are the tensors of its ``shadow_params`` list."""
    shadow = getattr(value, "shadow_params", None)
    return (type(value).__module__.startswith("torch_ema") and isinstance(shadow, list)
            and all(isinstance(t, Tensor) for t in shadow))  # fmt: skip


class ShadowParams(nn.Module):
    """A view of an average kept as a list of tensors (``torch_ema``'s ``shadow_params``): the same tensor objects as
    buffers ``0``, ``1``..., so that a snapshot reads them and a restore or a trial's swap writes into them in place.
    Built at each ask: the list may be replaced (``load_state_dict``, ``to``). Its step count is not restored."""

    def __init__(self, tensors: list[Tensor]) -> None:
        super().__init__()
        for index, tensor in enumerate(tensors):
            self._buffers[str(index)] = tensor


def averaged_weights(average: nn.Module) -> list[tuple[str, Tensor]]:
    """The averaged weights of an average of :func:`weight_averages`, by name: a copy of the model's parameters, or
    a :class:`ShadowParams` view's tensors."""
    return list(average.named_buffers() if isinstance(average, ShadowParams) else average.named_parameters())


def scale_swa_lrs(trainer: Any, scale: float, given: dict[int, Any]) -> None:
    """``StochasticWeightAveraging`` sets the rates of the first optimizer's groups from its ``swa_lrs`` when its
    epochs begin (its ``_swa_lrs``, 2.6.6), which would undo a backoff made before then: they are set to ``scale``
    times those it was given (``given``, by callback id, kept by the caller). Once begun, its ``SWALR`` reads each
    group's ``swa_lr``, which a backoff scales with the rates."""
    for callback in getattr(trainer, "callbacks", []):
        if isinstance(callback, _SWA) and not getattr(callback, "_initialized", True):
            lrs = given.setdefault(id(callback), callback._swa_lrs)
            callback._swa_lrs = [lr * scale for lr in lrs] if isinstance(lrs, list) else lrs * scale


def _unfrozen_backbones(trainer: Any) -> list[Any]:
    """The ``BackboneFinetuning`` callbacks past their unfreeze: those that remember a backbone rate
    (``previous_backbone_lr``, 2.6.6; ``None`` before)."""
    return [callback for callback in getattr(trainer, "callbacks", [])
            if isinstance(callback, _BACKBONE) and isinstance(callback.previous_backbone_lr, (int, float))]  # fmt: skip


def backbone_rates(trainer: Any) -> list[float]:
    """The backbone rates ``BackboneFinetuning`` callbacks remember: each writes its next rate,
    ``lambda_func(epoch + 1)`` times the one it remembers, into the last param group of every optimizer as its epochs
    begin, and remembers it."""
    return [float(callback.previous_backbone_lr) for callback in _unfrozen_backbones(trainer)]


def backbone_rate_given(trainer: Any, group: dict[str, Any]) -> bool:
    """Whether ``group`` is the backbone's, just added by a ``BackboneFinetuning`` at the ``backbone_initial_lr`` it
    was given (a rate as the user wrote it, not derived from the first group's live one; 2.6.6)."""
    rate = group.get("lr")
    return any(callback.backbone_initial_lr is not None
               and rate == callback.backbone_initial_lr == callback.previous_backbone_lr
               for callback in _unfrozen_backbones(trainer))  # fmt: skip


def follow_backbone_rates(trainer: Any, optimizer: Any) -> None:
    """``BackboneFinetuning`` derives the backbone's rate from its own memory and from the live rate of the first
    param group, which a backoff has scaled, so its memory is set to the rate the backbone's group holds now: every
    rate it derives is then the bare run's times the scale the run holds, and its alignment with the first group
    compares two rates at that scale (2.6.6)."""
    rate = optimizer.param_groups[-1].get("lr") if optimizer.param_groups else None
    if not isinstance(rate, (int, float)):
        return
    for callback in _unfrozen_backbones(trainer):
        callback.previous_backbone_lr = float(rate)


def unmute_hooks(callback: Any, hooks: tuple[str, ...]) -> None:
    """Undo :func:`mute_hooks`: the class's hooks answer again."""
    for name in hooks:
        if name in vars(callback) and vars(callback)[name] is None:
            delattr(callback, name)


REPLACED_METHODS = {
    "save_checkpoint": "every checkpoint writer goes through Trainer.save_checkpoint, and ModelCheckpoint("
    "save_weights_only=True) calls no callback hook before it writes: the state is checked there (CheckpointGuard)",
    "log_metrics": "Lightning logs a step in one Logger.log_metrics call after every on_train_batch_end, with no hook "
    "between: the suite's metrics of that step join that call, one row a step (StepMerge)",
    "log": "a side run's training_step (a trial's candidate, a replay) must log nothing, and LightningModule.log has "
    "no switch",
    "log_dict": "as log",
    "training_step": "a step that a bad value breaks (torch.distributions raises on a NaN argument; a library "
    "returns a loss cut from the graph) leaves no loss to skip, and no hook runs around training_step: "
    "NonFiniteDetector's guarded_training_step answers it there",
    "configure_gradient_clipping": "Lightning clips right after the callbacks' on_before_optimizer_step, with no hook "
    "between, and a skipped step has no gradients left: torch's clip_grad_value_ raises on an empty list of them "
    "(HeldSchedules.hold_step_hooks, for that one call)",
    "on_before_optimizer_step": "Lightning calls the module's right after the callbacks', with no hook between, and "
    "a step the suite skipped has no gradients left: a module's hook that edits one meets None "
    "(HeldSchedules.hold_step_hooks, for that one call)",
}
"""The Lightning methods the suite replaces on live objects, for a fit or a side run, and why: no public hook does it
(2.6.6). The instance attribute shadows the class's method and is removed afterwards."""


def replace_method(obj: Any, name: str, replacement: Any) -> Any:
    """Set ``replacement`` as ``obj.<name>`` (one of :data:`REPLACED_METHODS`); return what the instance held there
    before (``None``: nothing, the class's method answered)."""
    if name not in REPLACED_METHODS:
        raise ValueError(f"'{name}' is not a method the suite replaces (those: {', '.join(REPLACED_METHODS)})")
    previous = vars(obj).get(name)
    setattr(obj, name, replacement)
    return previous


def restore_method(obj: Any, name: str, previous: Any) -> None:
    """Undo :func:`replace_method`: ``previous`` back, or the class's method when there was none."""
    if previous is not None:
        setattr(obj, name, previous)
    elif name in vars(obj):
        delattr(obj, name)


SHARDED_STRATEGIES = ("FSDPStrategy", "XLAFSDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy", "XLAStrategy")
"""Strategies under which a rank holds only part of the model or of the optimizer state (class names, 2.6.6)."""

SUPPORTED_SHARDED_STRATEGIES = ("ModelParallelStrategy",)
"""Sharded strategies the suite supports: FSDP2's ``DTensor`` shards, whose norms and finiteness are combined across
ranks, and which Rollback snapshots and restores rank by rank (checked on CPU with 2 gloo processes, torch 2.13.0)."""

UNSUPPORTED_STRATEGIES = {
    "FSDPStrategy": (
        "FSDP1 flattens the parameters of each wrapped module into one FlatParameter and gives every rank a flat "
        "slice of it, so per-parameter norms, names and the state check would be those of one rank's slice, and "
        "Lightning runs it on CUDA only, where the suite has not been run under it; use ModelParallelStrategy with "
        "fully_shard in configure_model (FSDP2) instead"
    ),
    "XLAFSDPStrategy": (
        "XLA's FSDP flattens and shards the parameters as FSDP1 does, and the suite has not been run under it; use "
        "XLAStrategy (data parallel) instead"
    ),
    "DeepSpeedStrategy": (
        "DeepSpeed's engine keeps the gradients (partitioned under ZeRO) in its own buffers and clips and skips "
        "overflowing steps inside its own step, and Lightning runs it on CUDA only, where the suite has not been "
        "run under it; use ModelParallelStrategy with fully_shard in configure_model (FSDP2), or DDP, instead"
    ),
}
"""Strategies the suite refuses at ``setup``, each with the reason (class names, 2.6.6)."""

_SUPPORTED = (
    "Supported: a single device, DDPStrategy (strategy='ddp', 'ddp_spawn', 'ddp_fork') and ModelParallelStrategy "
    "(FSDP2: fully_shard in configure_model; there AutoClip(mode='agc') is not supported)."
)

REPLICATED_STRATEGIES = ("SingleDeviceStrategy", "DDPStrategy", "PlainLoopStrategy")
"""Strategies under which every rank holds the whole model (``ddp_fork``/``ddp_spawn`` are ``DDPStrategy``;
``PlainLoopStrategy`` is the plain loop's :class:`~lightning_overflow.guard.Guard`: one device, or DDP by hand)."""


def sharded_strategy(strategy: Any) -> str | None:
    """The name of the sharded strategy ``strategy`` is or derives from, ``None`` for a replicated one."""
    for cls in type(strategy).__mro__:
        if cls.__name__ in SHARDED_STRATEGIES:
            return cls.__name__
    return None


def check_strategy(strategy: Any, user: str) -> None:
    """Refuse a strategy the suite does not support, naming it, why, and what is supported.

    Args:
        strategy: the trainer's strategy.
        user: who refuses it (the callback's class name), for the message.

    Raises:
        NotImplementedError: ``strategy`` is, or derives from, one of :data:`UNSUPPORTED_STRATEGIES`.
    """
    for cls in type(strategy).__mro__:
        reason = UNSUPPORTED_STRATEGIES.get(cls.__name__)
        if reason is not None:
            raise NotImplementedError(f"{user} does not support {cls.__name__}: {reason}. {_SUPPORTED}")


def replicated_strategy(strategy: Any) -> bool:
    """Whether every rank holds the whole model (a known replicated strategy, and no sharded one)."""
    names = {cls.__name__ for cls in type(strategy).__mro__}
    return sharded_strategy(strategy) is None and bool(names & set(REPLICATED_STRATEGIES))


def fit_ends_after_batch(trainer: pl.Trainer) -> bool:
    """Whether Lightning's loops end the fit after the current training batch, asked at its ``on_train_batch_end``:
    ``max_steps`` reached, or the last batch of the last of ``max_epochs`` (2.6.6: ``FitLoop.done`` and the epoch
    loop's ``_num_ready_batches_reached``). A stop asked for (``should_stop``) does not count: the callbacks that ask
    for it (``Timer``, ``EarlyStopping``) do so after this hook, and a module's own may be one rank's. ``False`` in a
    loop that is not Lightning's (a plain loop ends where it ends)."""
    loop = trainer.fit_loop
    max_steps = getattr(loop, "max_steps", None)
    if max_steps is None:
        return False
    if max_steps != -1 and trainer.global_step >= max_steps:
        return True
    epochs = loop.max_epochs
    if epochs is None or epochs == -1 or loop.epoch_progress.current.processed + 1 < epochs:
        return False
    return bool(loop.epoch_loop._num_ready_batches_reached())


def optimizer_steps_this_batch(trainer: pl.Trainer) -> bool:
    """Whether the optimizer steps on the current training batch (not a batch that accumulates gradients), asked at
    ``on_train_batch_start``: the loop counted the batch as ready before that hook (``_should_accumulate``; 2.6.6)."""
    if not trainer.lightning_module.automatic_optimization:
        return True
    return not trainer.fit_loop.epoch_loop._should_accumulate()

