"""The recommended composition of the suite: detect, clip, back off, roll back."""

from __future__ import annotations

import os

from lightning_overflow._compat import Callback
from lightning_overflow._validation import check_bool, check_choice, check_float, check_int, check_type
from lightning_overflow.callbacks.auto_clip import MODES, AutoClip
from lightning_overflow.callbacks.grad_norm_monitor import GradNormMonitor
from lightning_overflow.callbacks.loss_spike_detector import LossSpikeDetector
from lightning_overflow.callbacks.lr_backoff import LRBackoff
from lightning_overflow.callbacks.nonfinite_detector import NonFiniteDetector
from lightning_overflow.callbacks.rollback import Rollback
from lightning_overflow.trial import DEFAULT_TRIAL, TrialConfig

__all__ = ["default_callbacks"]


def default_callbacks(
    *,
    clip: str | None = "zscore",
    lr_factor: float = 0.5,
    snapshot_every_n_steps: int = 100,
    max_rollbacks: int = 3,
    dirpath: str | os.PathLike[str] | None = None,
    per_parameter_norms: bool = False,
    rollback: bool = True,
    trial: TrialConfig | None = DEFAULT_TRIAL,
) -> list[Callback]:
    """The suite as we recommend it, ready for ``Trainer(callbacks=default_callbacks())``.

    What it does (the policy in :mod:`lightning_overflow.policy`):

    1. every step: the gradient norm is logged (``GradNormMonitor``) and clipped when it is an outlier
       (``AutoClip``, ZClip z-score by default);
    2. a non-finite loss or gradient: the step is skipped, a true no-op (``NonFiniteDetector``);
    3. a certain fault (inf/NaN weights or moments, steps that keep failing): the learning rate is multiplied by
       ``lr_factor`` (``LRBackoff``) and the last snapshot verified finite is restored (``Rollback``), at once;
    4. a suspicion (``LossSpikeDetector``: the loss settled far above its best, a trend, runaway weights; a
       GradScaler that keeps overflowing): a trial. The last verified snapshot at ``lr_factor`` times the learning
       rate runs against the run as it is, ``trial.steps`` optimizer steps on the same batches, each batch scored
       by both before either trains on it; the remedy is kept only when it does better beyond the noise, and
       otherwise the run goes on exactly as if nothing had been suspected (see :mod:`lightning_overflow.trial`);
    5. a certain fault once nothing is left to try (the LR at its floor, ``max_rollbacks`` retries with nothing
       changed) stops the run with :class:`~lightning_overflow.DivergenceError`, which lists what was tried.

    Args:
        clip: the ``AutoClip`` mode (``"zscore"``, ``"percentile"``, ``"agc"``; ``"fixed"`` needs a ``max_norm``, so
            build that ``AutoClip`` yourself), or ``None`` for no clipping. With ``Trainer(gradient_clip_val=...)``
            the Trainer's clipping is kept and ``AutoClip`` leaves the gradients to it (said once at setup).
        lr_factor: the LR multiplier of a backoff and of a trial's remedy (default 0.5).
        snapshot_every_n_steps: Rollback's snapshot interval, and the interval of the DDP replica-parity check
            (default 100). Each snapshot holds the model and
            optimizer state in host memory, ``keep=2`` of them.
        max_rollbacks: rollbacks with nothing changed since the previous one allowed within Rollback's window
            before ``DivergenceError`` (default 3).
        dirpath: also write snapshots there (atomically), so a restarted run can roll back past the restart.
        per_parameter_norms: log ``grad_norm/<parameter>`` too.
        rollback: include ``Rollback`` (default ``True``). With ``False``, ``snapshot_every_n_steps``,
            ``max_rollbacks`` and ``dirpath`` have nothing to configure; a ``dirpath`` then is an error.
        trial: how suspicions are tried (:class:`~lightning_overflow.TrialConfig`: 20 steps, ``"ab"`` mode, at
            most a quarter of the steps; ``every_n_steps`` adds scheduled trials of a lower learning rate); ``None``
            answers suspicions at once, without a trial.

    Example:
        >>> [type(cb).__name__ for cb in default_callbacks()]
        ['GradNormMonitor', 'NonFiniteDetector', 'LossSpikeDetector', 'AutoClip', 'LRBackoff', 'Rollback']
    """
    if clip is not None:
        check_choice("clip", clip, tuple(m for m in MODES if m != "fixed"))
    factor = check_float("lr_factor", lr_factor, low=0.0, high=1.0, low_open=True, high_open=True)
    every = check_int("snapshot_every_n_steps", snapshot_every_n_steps, minimum=1)
    budget = check_int("max_rollbacks", max_rollbacks, minimum=1)
    per_parameter = check_bool("per_parameter_norms", per_parameter_norms)
    with_rollback = check_bool("rollback", rollback)
    check_type("dirpath", dirpath, (str, os.PathLike), "a path", optional=True)
    check_type("trial", trial, TrialConfig, "a TrialConfig", optional=True)
    if dirpath is not None and not with_rollback:
        raise ValueError(f"'dirpath' needs rollback=True: it is where Rollback writes its snapshots (got {dirpath!r})")
    callbacks: list[Callback] = [
        GradNormMonitor(per_parameter=per_parameter),
        # Replica parity once a snapshot interval, naming the parameters that differ (Rollback also compares the
        # replicas before each snapshot it keeps).
        NonFiniteDetector(action="skip", check_replicas_every_n_steps=every),
        LossSpikeDetector(),
    ]
    if clip is not None:
        # A training script's own gradient_clip_val is kept: adding the suite must not refuse it.
        callbacks.append(AutoClip(mode=clip, if_trainer_clips="defer"))  # type: ignore[arg-type]
    callbacks.append(LRBackoff(factor=factor, trial=trial))
    if with_rollback:
        callbacks.append(Rollback(every_n_steps=every, max_rollbacks=budget, dirpath=dirpath, trial=trial))
    return callbacks
