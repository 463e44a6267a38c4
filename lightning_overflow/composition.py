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
) -> list[Callback]:
    """The suite as we recommend it, ready for ``Trainer(callbacks=default_callbacks())``.

    The escalation ladder it implements:

    1. every step: the gradient norm is logged (``GradNormMonitor``) and clipped when it is an outlier
       (``AutoClip``, ZClip z-score by default);
    2. a non-finite step is skipped: nothing changes, not the weights, the moments or the schedule
       (``NonFiniteDetector``); an isolated one (one corrupt sample) stops there;
    3. evidence that the training state degrades (non-finite steps on clean batches, non-finite weights or
       moments, a collapsing GradScaler, a loss that stays above its reference, settles far above its best level
       or trends up, weights that grow 2x within 50 steps while the loss does not fall) multiplies the LR by
       ``lr_factor`` (``LRBackoff``) and restores the last snapshot verified finite (``Rollback``; for runaway
       weights or a loss finding, the last one from before the growth or the losses judged); a divergence again
       at the lower LR backs off further, by ``lr_factor`` twice when it comes within two snapshot intervals of
       the previous backoff; when the restored weights turn out as bad on the current data as the diverged ones
       (a ``data_shift``: new data, a harder task), the backoff is undone; when one snapshot, restored twice,
       diverges again within 10 steps each time at a lower LR, its gradients are out of scale: ``AutoClip`` bounds
       every update to 1% of the weight norm from then on and the backoffs since that snapshot are taken back
       (``update_bound``);
    4. after ``max_rollbacks`` retries with nothing changed within Rollback's window (a retry at a backed-off LR
       is progress and spends none), or the LR backed off to its floor, the run stops with
       :class:`~lightning_overflow.DivergenceError`, which lists what was tried.

    See the ladder in :mod:`lightning_overflow.policy` for every rule and the reason behind it.

    Args:
        clip: the ``AutoClip`` mode (``"zscore"``, ``"percentile"``, ``"agc"``; ``"fixed"`` needs a threshold, so
            build that ``AutoClip`` yourself), or ``None`` for no clipping (use this when the Trainer has
            ``gradient_clip_val``).
        lr_factor: the LR multiplier on divergence (default 0.5), applied twice when a backoff comes within two
            snapshot intervals of the previous one (build ``LRBackoff`` yourself to turn that off).
        snapshot_every_n_steps: Rollback's snapshot interval, and the interval of the DDP replica-parity check
            (default 100). Each snapshot holds the model and
            optimizer state in host memory, ``keep=2`` of them.
        max_rollbacks: rollbacks with nothing changed since the previous one allowed within Rollback's window
            before ``DivergenceError`` (default 3).
        dirpath: also write snapshots there (atomically), so a restarted run can roll back past the restart.
        per_parameter_norms: log ``grad_norm/<parameter>`` too.
        rollback: include ``Rollback`` (default ``True``). With ``False``, ``snapshot_every_n_steps``,
            ``max_rollbacks`` and ``dirpath`` have nothing to configure; a ``dirpath`` then is an error.

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
        callbacks.append(AutoClip(mode=clip))  # type: ignore[arg-type]
    # A restored state that diverges again within two snapshot intervals: the backoff was too small, back off twice.
    callbacks.append(LRBackoff(factor=factor, escalate_within=2 * every))
    if with_rollback:
        callbacks.append(Rollback(every_n_steps=every, max_rollbacks=budget, dirpath=dirpath))
    return callbacks
