"""AutoClip: gradient clipping that follows the run's own statistics, survives NaN, resumes exactly, and reports."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import pytorch_lightning as pl
import torch
from torch import Tensor
from typing_extensions import override

from lightning_overflow import _compat
from lightning_overflow._validation import check_choice, check_float, check_int, check_names, refuse_removed
from lightning_overflow.callback_state import StateReader, versioned
from lightning_overflow.callbacks._base import CLIPPER, SuiteCallback
from lightning_overflow.candidate import Clip
from lightning_overflow.distributed import sum_and_read
from lightning_overflow.health import StepHealth, log, metric_key
from lightning_overflow.numerics import parameters_of, scale_grads_
from lightning_overflow.numerics.agc import agc_coefficients_and_norms, smallest_coefficient
from lightning_overflow.numerics.clipping import HostPercentile, HostZScore, host_clip_coefficient
from lightning_overflow.numerics.norms import FP32_MAX, squared_norm_share
from lightning_overflow.policy import (
    AGC_EPS,
    CLIP_EVENT_BELOW,
    CLIP_REBASELINE_AFTER,
    PERCENTILE_WINDOW,
    REMOVED_SETTINGS,
    RESTART_STEPS,
    UPDATE_BOUND,
    UPDATE_RATIO,
    WARMUP_ANCHOR_FACTOR,
    WARMUP_ANCHOR_STEPS,
    ZSCORE_ALPHA,
    ZSCORE_MIN_RATIO,
    ClipPlan,
    StepAction,
    Verdict,
)

__all__ = ["AutoClip"]

Mode = Literal["fixed", "percentile", "zscore", "agc"]
MODES = ("fixed", "percentile", "zscore", "agc")

Stats = HostPercentile | HostZScore


class _Clip:
    """What AutoClip proposes for one optimizer step; committed once the step is known not to have been skipped.

    Attributes:
        stats: the statistics that take ``learned`` in once the step went ahead.
        learned: what the statistics take in: the norm, or the anchor's cap during the z-score warm-up.
        threshold: the threshold applied.
        adaptive: whether the statistics set the threshold (not ``max_norm``, not the update bound).

    A step that no threshold could clip, whatever the last bits of the z-score's root (rounded as torch rounds it,
    a tensor op), gets ``threshold`` and ``adaptive`` from ``exact`` when first asked: only a logged step asks.
    """

    __slots__ = ("_adaptive", "_exact", "_threshold", "coef", "learned", "plan", "stats", "step", "total")

    def __init__(
        self, step: int, total: float, threshold: float, coef: float, stats: Stats | None, plan: ClipPlan,
        learned: float, adaptive: bool = False, exact: Callable[[], tuple[float, bool]] | None = None,
    ) -> None:  # fmt: skip
        self.step, self.total, self.coef, self.stats, self.plan, self.learned = step, total, coef, stats, plan, learned
        self._threshold, self._adaptive, self._exact = threshold, adaptive, exact

    @property
    def threshold(self) -> float:
        if self._exact is not None:
            (self._threshold, self._adaptive), self._exact = self._exact(), None
            self.plan.threshold = self._threshold
        return self._threshold

    @property
    def adaptive(self) -> bool:
        _ = self.threshold  # resolved with it
        return self._adaptive


@dataclass
class _AgcPlan:
    """AGC's coefficients for one step and the norms the gradients will have once they are applied."""

    record: StepHealth
    included: list[int]  # indices into record.params of the parameters clipped unit-wise
    params: list[Tensor]
    coefs: list[Tensor]
    norms: list[Tensor]  # the L2 norm of each included gradient after AGC

    def clipped_total(self) -> Tensor:
        """The total norm after AGC (float64, 0-d, where the step's norms live): the included gradients' clipped
        norms and the excluded ones' own, exact where the read refined them."""
        record = self.record
        device = record.grad_norms.device
        exact = record.exact_grad_norms
        norms = record.grad_norms if exact is None else torch.tensor(exact, dtype=torch.float64, device=device)
        squares = norms.to(torch.float64).square()
        if self.included:
            kept = torch.stack([n.to(device=device, dtype=torch.float64) for n in self.norms])
            index = torch.tensor(self.included, device=device)
            squares = squares.index_copy(0, index, kept.square())
        return squares.sum().sqrt()


class AutoClip(SuiteCallback):
    """Clip gradients before every optimizer step, to a threshold that follows the run's own gradient statistics.

    An intervention: it scales the gradients in ``on_before_optimizer_step``, after unscaling (16-mixed) and the DDP
    all-reduce, using the pre-clip total norm that the suite computes once per step (exact also where the FP32 norm
    overflows). The coefficient is a host value from the suite's one read per step, so a step that needs no
    clipping costs no pass over the gradients, and nothing extra is read from the device.

    Modes:

    - ``"fixed"``: clip the total norm to ``max_norm``, like ``Trainer(gradient_clip_val=...)`` but overflow-safe:
      finite gradients whose FP32 norm overflows are scaled to ``max_norm`` (``clip_grad_norm_`` zeroes them).
    - ``"percentile"``: AutoClip (Seetharaman et al., MLSP 2020): the threshold is the ``percentile``-th percentile
      of the total norms seen so far, this step's included, over the last ``PERCENTILE_WINDOW`` steps.
    - ``"zscore"``: ZClip (Kumar et al., 2025): EMA mean and variance of the total norm (after ``warmup_steps`` norms
      that only build them); a norm more than ``z_threshold`` standard deviations above the mean is clipped to
      ``mean + z_threshold**2 * std / z``, and the statistics are updated with the clipped value. During the
      warm-up the norm is capped at ``WARMUP_ANCHOR_FACTOR`` times the run's anchor (the median of its first
      ``WARMUP_ANCHOR_STEPS`` norms), and the statistics take the capped value in: a run whose norms explode inside the
      warm-up (a learning rate far too high) is held to where it started instead of teaching the statistics the
      diverged regime.
    - ``"agc"``: unit-wise adaptive gradient clipping (Brock et al., ICML 2021): each unit's gradient norm is kept
      within ``clipping`` times its weight norm, floored at ``AGC_EPS`` so that zero-initialised weights still move.

    A step with no gradient at all (a total norm of exactly 0: a hinge loss at 0) is left out of the statistics and
    of the anchor: fed zeros, the percentile and the z-score statistics fall to 0, and every later gradient is an
    outlier to them (measured on a hinge run of 1,500 steps: the z-score threshold fell from 5e-3 to 3e-8 and every
    step with a gradient was scaled by 1e-3 to 1e-7; the model stopped learning, 1.07x the bare run's evaluation).

    ``max_norm`` caps the threshold of the adaptive modes. In ``"agc"`` it caps the total norm after the unit-wise
    clipping (computed from the same pass, riding on the suite's one read): the final norm is ``max_norm`` whenever
    the unit-wise clipping left it above.

    The update bound (``"fixed"``, ``"percentile"``, ``"zscore"``): when ``Rollback`` restores the same snapshot
    twice in a row, and the state restored the first time diverged again within ``RESTART_STEPS`` optimizer steps
    after updates beyond ``UPDATE_RATIO`` times its weight norm (the learning rate times the gradient norm applied:
    the size an SGD step has), at a learning rate ``LRBackoff`` had already lowered, the gradients, not the rate,
    are out of scale (a recurrent net whose first gradients are 1e8, where halving the rate ten times cannot help).
    From then on the total norm is capped so that the learning rate times the norm stays within ``UPDATE_RATIO``
    times the weight norm of the restored state, and each further such return halves the ratio. The bound holds
    for the rest of the fit, journaled (``update_bound``) once per change; the statistics take the capped norms in.
    When it arms, ``LRBackoff`` returns to the snapshot's learning rate (the ``update_bound`` signal). A state that
    diverged again after updates within the bound (non-finite weights written by a fault) arms nothing: the bound
    would not have changed those updates.

    What never happens: a step whose norm is inf/NaN, or a step that ``NonFiniteDetector`` skipped (whatever the
    order of the callbacks), changes nothing: no clipping, no statistics, no log. Norms beyond the FP32 range are
    clipped but kept out of the statistics. Under manual optimization each optimizer has its own statistics. Under
    DDP the statistics come from the all-reduced norm, so they are identical on every rank.

    Args:
        mode: ``"fixed"``, ``"percentile"``, ``"zscore"`` (default) or ``"agc"``, as above.
        max_norm: the threshold of ``"fixed"`` (required there); a cap on the threshold of the other modes
            (default ``None``: no cap).
        percentile: ``"percentile"`` mode: the percentile of past norms to clip to, in ``[0, 100]`` (default 10,
            the paper's: most steps are clipped a little).
        z_threshold: ``"zscore"`` mode: z-score above which a norm is clipped (default 2.5, the paper's).
        warmup_steps: ``"zscore"`` mode: norms that only build the statistics before clipping starts (default 25,
            the paper's; at least 2, since a variance needs two norms).
        clipping: ``"agc"`` mode: the largest ratio of unit gradient norm to unit weight norm (default 0.01, the
            paper's at batch size 4096; larger batches want smaller values).
        exclude: ``"agc"`` mode: parameter names, or module names as prefixes, left out of unit-wise clipping (the
            paper leaves out the final classifier; default: none). Sparse gradients (``nn.Embedding(sparse=True)``)
            are always left out of the unit-wise step; ``max_norm`` still caps them.
        if_trainer_clips: what to do when the Trainer clips too (``gradient_clip_val``): ``"raise"`` (default) refuses
            the double clipping at setup; ``"defer"`` keeps the user's clipping and leaves this fit's gradients to it,
            said once at setup, as it does for a LightningModule that clips in its own
            ``configure_gradient_clipping`` (``default_callbacks()`` defers: a training script's own clipping is kept
            when the suite is added to it).

    Fixed values (constants of :mod:`lightning_overflow.policy`, no settings): ``"percentile"`` mode keeps the last
    ``PERCENTILE_WINDOW`` (1000) norms; ``"zscore"`` mode smooths with ``ZSCORE_ALPHA`` (0.97, the paper's), caps the
    warm-up at ``WARMUP_ANCHOR_FACTOR`` (10) times the median of the first ``WARMUP_ANCHOR_STEPS`` (3) norms (healthy
    runs stay within 6x of their first norms there), keeps its threshold at least ``ZSCORE_MIN_RATIO`` (5) times the
    running mean after the warm-up (small noisy batches put about one healthy step in a hundred beyond 2.5 standard
    deviations, at 3-5x the mean; clipping those changes a healthy run's trajectory and protects nothing), and after
    ``CLIP_REBASELINE_AFTER`` (3) steps in a row clipped by its statistics (not by ``max_norm`` nor the update bound)
    takes the norms for a new level, not outliers (new data, a harder task): the statistics start again from it,
    with a new warm-up, journaled as ``"rebaseline"`` (a task whose targets grow 3x is otherwise clipped for 160 steps
    and ends up to 1.11x the unprotected run; with it, within 1.05x on every seed); ``"agc"`` mode floors a unit's
    weight norm at ``AGC_EPS`` (1e-3, the paper's) so zero-initialised weights still move. A clip whose coefficient
    is below ``CLIP_EVENT_BELOW`` (0.1: the gradients shrunk tenfold) is journaled, at most once every
    :attr:`EVENT_GAP` optimizer steps per optimizer; the event counts those in between. The update bound's ratio is
    ``UPDATE_RATIO`` (0.01: an update of at most 1% of the weights, a few times what healthy steps make), armed when a
    restored state diverged again within ``RESTART_STEPS`` (10) optimizer steps.

    Attributes:
        steps: optimizer steps that went ahead with AutoClip's coefficient applied.
        clipped_steps: those whose coefficient was below 1.

    Raises:
        ValueError: at setup when ``Trainer(gradient_clip_val=...)`` is also set (double clipping) and
            ``if_trainer_clips="raise"``, or when ``exclude`` names no parameter of the model.

    Logged keys (suffixed ``_opt<i>`` when the model has several optimizers), through the Trainer's loggers:

    =======================  ================================================================================
    key                      meaning
    =======================  ================================================================================
    ``clip/threshold``       the threshold applied at this step (logged steps; not while it is infinite, e.g.
                             during the z-score warm-up); in ``"agc"`` mode the ``clipping`` ratio
    ``clip/coef``            the factor applied to the gradients (1.0 = untouched); in ``"agc"`` mode the
                             smallest unit's
    ``clip/fraction_epoch``  the fraction of this epoch's optimizer steps whose coefficient was below 1
    =======================  ================================================================================

    Example:
        >>> import pytorch_lightning as pl
        >>> trainer = pl.Trainer(callbacks=[AutoClip(mode="zscore")], logger=False)
        >>> fixed = AutoClip(mode="fixed", max_norm=1.0)  # gradient_clip_val=1.0, overflow-safe
        >>> agc = AutoClip(mode="agc", clipping=0.02, exclude=["classifier"])
    """

    EVENT_GAP = 50
    """Fewest optimizer steps between two journal events of one optimizer."""

    stage = CLIPPER
    one_per_trainer = True  # acts on the whole run: a second one would act twice (refused at setup)

    window = PERCENTILE_WINDOW
    alpha = ZSCORE_ALPHA
    anchor_factor, anchor_steps = WARMUP_ANCHOR_FACTOR, WARMUP_ANCHOR_STEPS
    min_ratio = ZSCORE_MIN_RATIO
    eps = AGC_EPS
    event_below = CLIP_EVENT_BELOW
    update_ratio, restart_steps = UPDATE_RATIO, RESTART_STEPS
    rebaseline_after = CLIP_REBASELINE_AFTER

    def __init__(
        self,
        mode: Mode = "zscore",
        max_norm: float | None = None,
        percentile: float = 10.0,
        z_threshold: float = 2.5,
        warmup_steps: int = 25,
        clipping: float = 0.01,
        exclude: Sequence[str] = (),
        if_trainer_clips: Literal["raise", "defer"] = "raise",
        **removed: Any,
    ) -> None:
        refuse_removed(AutoClip, removed, REMOVED_SETTINGS["AutoClip"])
        self.mode: Mode = check_choice("mode", mode, MODES)  # type: ignore[assignment]
        self.max_norm = check_float("max_norm", max_norm, low=0.0, low_open=True, optional=True)
        if self.mode == "fixed" and self.max_norm is None:
            raise ValueError("'max_norm' must be set when mode='fixed' (got None)")
        self.percentile = check_float("percentile", percentile, low=0.0, high=100.0)
        self.z_threshold = check_float("z_threshold", z_threshold, low=0.0, low_open=True)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, minimum=2)
        self.clipping = check_float("clipping", clipping, low=0.0, low_open=True)
        exclude = check_names("exclude", exclude, what="parameter names")
        if exclude and self.mode != "agc":
            raise ValueError(f"'exclude' applies to mode='agc' only (got mode={self.mode!r})")
        self.exclude = tuple(exclude)
        self.if_trainer_clips = check_choice("if_trainer_clips", if_trainer_clips, ("raise", "defer"))
        self._deferred = False  # this fit's gradients are the Trainer's gradient_clip_val's to clip
        self._reset()

    def _reset(self) -> None:
        self.steps = 0
        self.clipped_steps = 0
        self._stats: dict[int, Stats] = {}
        self._first: dict[int, list[float]] = {}  # optimizer index -> its first accepted norms (the anchor's)
        self._epoch: dict[int, list[int]] = {}  # optimizer index -> [steps, clipped] this epoch
        self._proposal: _Clip | None = None
        self._agc: _AgcPlan | None = None
        self._last_event: dict[int, int] = {}
        self._quiet_clips: dict[int, int] = {}
        self._bounds: dict[int, tuple[float, float]] = {}  # optimizer index -> (update ratio, weight norm)
        self._last_restore: tuple[int, int] | None = None  # (steps of the snapshot restored, self.steps then)
        self._largest_update: dict[int, float] = {}  # optimizer index -> largest lr x norm since the last restore
        self._streaks: dict[int, int] = {}  # optimizer index -> steps in a row its adaptive threshold clipped
        self._fit_clipped, self._fit_steps, self._smallest = 0, 0, 1.0  # this fit's clips, told at its end

    @property
    def state_key(self) -> str:
        try:
            return self._state_key  # built once: Lightning reads it often, its arguments never change
        except AttributeError:
            self._state_key: str = self._generate_state_key(mode=self.mode)
            return self._state_key

    # ---- wiring -----------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        sharded = _compat.sharded_strategy(trainer.strategy)  # the others are refused by every suite callback
        if stage == "fit" and self.mode == "agc" and sharded in _compat.SUPPORTED_SHARDED_STRATEGIES:
            raise NotImplementedError(
                f"AutoClip(mode='agc') does not support {sharded}: a unit of a sharded parameter (a bias, a row split "
                "by tensor parallelism) can span the ranks, and its norm would be that of one rank's part. Use "
                "AutoClip(mode='zscore'), 'percentile' or 'fixed' (they clip by the global norm), or AGC under "
                "strategy='ddp'."
            )
        clip_val = trainer.gradient_clip_val if stage == "fit" else None
        trainer_clips = clip_val is not None and clip_val > 0
        module_clips = stage == "fit" and _compat.clips_its_own_gradients(pl_module)
        self._deferred = trainer_clips or (module_clips and self.if_trainer_clips == "defer")
        owner = getattr(trainer, "arguments_of", "Trainer")  # a plain loop's Guard takes the Trainer's argument
        if trainer_clips and self.if_trainer_clips == "raise":
            raise ValueError(
                f"AutoClip(mode={self.mode!r}) and {owner}(gradient_clip_val={clip_val}) would both clip every step's "
                f"gradients (double clipping: AutoClip first, then {'Lightning' if owner == 'Trainer' else owner}'s "
                "clip_grad_norm_, which zeroes finite gradients whose FP32 norm overflows). Remove gradient_clip_val "
                f"from the {owner}; for a constant threshold use AutoClip(mode='fixed', max_norm={clip_val}), or pass "
                f"max_norm={clip_val} to cap an adaptive mode; or keep your clipping with "
                "AutoClip(if_trainer_clips='defer')."
            )
        super().setup(trainer, pl_module, stage)
        if stage != "fit":
            return
        self._reset()  # a new fit starts from scratch (a warm-up again); a resumed one loads its state right after
        if self._deferred and trainer.global_rank == 0:
            algorithm = str(getattr(trainer.gradient_clip_algorithm, "value", "norm"))
            whose = (
                f"{type(pl_module).__name__}.configure_gradient_clipping"
                if module_clips
                else f"{owner}(gradient_clip_val={clip_val}, gradient_clip_algorithm={algorithm!r}), which clips "
                "every step"
            )
            log.info(
                f"lightning_overflow: AutoClip leaves this fit's gradients to {whose}: your clipping is kept (the rest "
                "of the suite acts as usual)"
            )
        if self.mode == "agc" and self.exclude:
            names = [name for name, _ in pl_module.named_parameters()]
            unknown = [e for e in self.exclude if not any(self._matches(e, name) for name in names)]
            if unknown:
                raise ValueError(
                    f"'exclude' must name parameters or modules of the model (got {unknown!r}; parameters: "
                    f"{', '.join(names[:10])}{', ...' if len(names) > 10 else ''})"
                )

    @override
    def _stages(self) -> frozenset[str]:
        return frozenset() if self._deferred else super()._stages()

    @override
    def _judge(self, trainer: pl.Trainer, record: StepHealth) -> Verdict | None:
        self._proposal = None
        if not math.isfinite(record.total_norm):
            self._agc = None
            return None  # a non-finite step is the detector's business; nothing here may learn from it
        self._proposal = self._propose_agc(record) if self.mode == "agc" else self._propose_total(record)
        return Verdict(clip=self._proposal.plan)

    @override
    def _after_step(self, trainer: pl.Trainer, record: StepHealth, action: StepAction) -> None:
        clip, self._proposal = self._proposal, None
        if clip is None or action.clip_of(self) is None:
            return  # skipped: the step never happened, so nothing is learned or counted
        if record.log_due:
            _ = clip.threshold  # logged below: from the statistics as the step found them, before they learn from it
        index = record.optimizer_index
        # A step with no gradient at all (a hinge loss at exactly 0) tells nothing of the norms' scale: statistics fed
        # zeros fall to a mean and spread of 0, to which every later gradient is an outlier, clipped to nothing.
        scaled = clip.total > 0.0
        if clip.stats is not None and scaled:
            clip.stats.update(clip.learned)
            self._stats[index] = clip.stats
        if self._last_restore is not None:  # what the update bound weighs at the next return to the same snapshot
            update = _largest_lr(record.optimizer) * clip.coef * clip.total  # the gradient norm as applied
            self._largest_update[index] = max(self._largest_update.get(index, 0.0), update)
        first = self._first.setdefault(index, [])
        in_range = clip.total <= FP32_MAX or record.grads_float64  # a float64 norm beyond FP32 is a number too
        if len(first) < self.anchor_steps and scaled and math.isfinite(clip.total) and in_range:
            first.append(clip.total)
        clipped = clip.coef < 1.0
        epoch = self._epoch.setdefault(index, [0, 0])
        self.steps += 1
        self.clipped_steps += clipped
        self._fit_steps += 1
        if clipped:
            self._fit_clipped += 1
            self._smallest = min(self._smallest, clip.coef)
        epoch[0] += 1
        epoch[1] += clipped
        if clip.coef < self.event_below:
            self._journal(trainer, index, clip)
        self._weigh_streak(trainer, index, clip)
        if record.log_due:
            metrics = {record.metric_key("clip/coef"): clip.coef}
            if math.isfinite(clip.threshold):
                metrics[record.metric_key("clip/threshold")] = clip.threshold
            self._log(trainer, metrics, record.log_step)

    def _weigh_streak(self, trainer: pl.Trainer, index: int, clip: _Clip) -> None:
        """``"zscore"`` mode: an outlier is one step; ``CLIP_REBASELINE_AFTER`` steps in a row clipped by the statistics
        are a new level of the norms (new data, a harder task): the statistics start again from it, with a new
        warm-up, rather than clip the run for as long as they take to creep up (measured: a task whose targets grow 3x
        was clipped for 160 steps, and ended 1.11x the unclipped run). ``"percentile"`` mode clips most steps by
        design."""
        by_statistics = clip.coef < 1.0 and isinstance(clip.stats, HostZScore) and clip.adaptive
        self._streaks[index] = self._streaks.get(index, 0) + 1 if by_statistics else 0
        if self.rebaseline_after is None or self._streaks[index] < self.rebaseline_after:
            return
        self._streaks[index] = 0
        self._stats.pop(index, None)
        self._first.pop(index, None)
        self._event(
            trainer, "rebaseline",
            f"AutoClip({self.mode}): the gradient norm of optimizer {index} stayed above the clip threshold for "
            f"{self.rebaseline_after} steps in a row (last {clip.total:.4g}, threshold {clip.threshold:.4g}) at step "
            f"{clip.step}: a new level, not outliers; the statistics start again from it.",
            what="grad_norm", value=clip.total, optimizer=index,
        )  # fmt: skip

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        n_optimizers = len(trainer.optimizers)
        # Through Lightning's epoch-end logging, as GradNormMonitor's epoch aggregates: one row with its epoch metrics.
        for index, (steps, clipped) in sorted(self._epoch.items()):
            if steps:
                fraction = torch.tensor(clipped / steps, dtype=torch.float64)
                pl_module.log(metric_key("clip/fraction_epoch", index, n_optimizers), fraction, on_epoch=True)
        self._epoch.clear()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        # Every clip changed the run, and only the deepest are journaled one by one (event_below): the fit's end
        # says how many there were, so no clip goes unsaid.
        if self._fit_clipped:
            self._event(
                trainer, "clips",
                f"AutoClip({self.mode}): clipped {self._fit_clipped} of the fit's {self._fit_steps} optimizer steps; "
                f"the smallest coefficient {self._smallest:.3g}.",
                clipped=self._fit_clipped, steps=self._fit_steps, smallest_coef=self._smallest, mode=self.mode,
            )  # fmt: skip

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._proposal = None
        self._agc = None
        super().teardown(trainer, pl_module, stage)

    @override
    def _detach(self, state: dict[str, Any]) -> None:
        state["_proposal"] = state["_agc"] = None  # the clip of the step in progress

    # ---- the clip ---------------------------------------------------------------------------------------------
    def _propose_total(self, record: StepHealth) -> _Clip:
        """Fixed, percentile and z-score modes: one coefficient for all gradients, from the shared total norm (a host
        float, so the statistics are host floats too: no tensor op)."""
        total, index = record.total_norm, record.optimizer_index
        bound = self._update_bound(record)
        stats = self._stats.get(index)
        caps = min(bound if bound is not None else math.inf, self.max_norm if self.max_norm is not None else math.inf)
        if isinstance(stats, HostZScore) and stats.count >= self.warmup_steps and total <= caps and stats.inlier(total):
            # An inlier's threshold is at least the norm itself, the caps too: no clip, whatever the threshold's value,
            # which waits until a logged step asks for it (see _Clip).
            return _Clip(record.step, total, math.nan, 1.0, stats, ClipPlan([], 1.0, math.nan), total,
                         exact=lambda: self._capped(index, total, bound)[:2])  # fmt: skip
        threshold, adaptive, learned, stats = self._capped(index, total, bound)
        coef = host_clip_coefficient(total, threshold)
        grads = [p.grad for p in record.params]
        plan = ClipPlan([(grads, coef)] if coef < 1.0 else [], coef, threshold)  # type: ignore[list-item]
        return _Clip(record.step, total, threshold, coef, stats, plan, learned, adaptive=adaptive)

    def _capped(self, index: int, total: float, bound: float | None) -> tuple[float, bool, float, Stats | None]:
        """``(threshold, whether the statistics set it, what they would learn, the statistics)``: the statistics'
        threshold for ``total``, capped by the update bound and ``max_norm`` (nothing learned yet)."""
        adaptive, learned, stats = self._threshold(index, total)
        threshold = adaptive
        if bound is not None:
            threshold = min(threshold, bound)
            learned = min(learned, bound)
        if self.max_norm is not None:
            threshold = min(threshold, self.max_norm)
        return threshold, threshold == adaptive, learned, stats

    def _threshold(self, index: int, total: float) -> tuple[float, float, Stats | None]:
        """The threshold for a total norm of ``total`` from optimizer ``index``'s statistics, the value they would
        learn, and the statistics (nothing learned yet)."""
        stats: Stats | None = None
        threshold = math.inf  # "fixed": no statistics, only the caps
        if self.mode != "fixed":
            stats = self._stats.get(index)
            if stats is None:
                stats = self._new_stats()
            threshold = stats.threshold(total)
        learned = total
        if isinstance(stats, HostZScore) and stats.count >= self.warmup_steps:
            threshold = max(threshold, self.min_ratio * stats.mean)
        cap = self._warmup_cap(index, stats)
        if cap is not None:
            threshold = cap
            learned = min(total, cap)
        return threshold, learned, stats

    def _candidate_clip(self, index: int) -> Clip | None:
        """How the loop's step of optimizer ``index`` is clipped now, for a trial's candidate on the side: the same
        threshold from the same statistics, which the candidate's norms do not teach (``"agc"``: ``max_norm`` only);
        none where it leaves the fit's clipping to the Trainer's or the module's own, as it does the loop's."""
        if self._deferred:
            return None

        def clip(grads: list[Tensor], total: float) -> None:
            threshold = self.max_norm if self.mode == "agc" else self._threshold(index, total)[0]
            if threshold is not None and self.max_norm is not None:
                threshold = min(threshold, self.max_norm)
            coef = host_clip_coefficient(total, threshold) if threshold is not None else 1.0
            if coef < 1.0:
                scale_grads_(grads, coef)

        return clip

    def _warmup_cap(self, index: int, stats: Stats | None) -> float | None:
        """The z-score warm-up's cap, ``WARMUP_ANCHOR_FACTOR`` times the median of the first norms (``None``: none)."""
        if self.anchor_factor is None or not isinstance(stats, HostZScore) or stats.count >= self.warmup_steps:
            return None
        first = self._first.get(index, [])
        if len(first) < self.anchor_steps:
            return None
        return self.anchor_factor * sorted(first)[len(first) // 2]

    def _update_bound(self, record: StepHealth) -> float | None:
        """The update bound's cap on the total norm at this step's learning rate (``None``: not armed)."""
        bound = self._bounds.get(record.optimizer_index)
        if bound is None:
            return None
        ratio, weight_norm = bound
        lr = _largest_lr(record.optimizer)
        return ratio * weight_norm / lr if lr > 0 else None

    def _new_stats(self) -> Stats:
        if self.mode == "percentile":
            return HostPercentile(self.window, self.percentile)
        return HostZScore(alpha=self.alpha, z_threshold=self.z_threshold, warmup_steps=self.warmup_steps)

    @override
    def _contribute(self, trainer: pl.Trainer, pl_module: pl.LightningModule, record: StepHealth) -> None:
        if self.mode != "agc":
            return
        # AGC's unit norms are computed before the suite's one read, so that the smallest coefficient, and the
        # total norm after AGC that max_norm caps, ride on it.
        plan = self._plan_agc(record, exact=False)
        record.add(self._key("smallest"), smallest_coefficient(plan.coefs))
        if self.max_norm is not None:
            record.add(self._key("total"), plan.clipped_total())
        self._agc = plan

    def _propose_agc(self, record: StepHealth) -> _Clip:
        """Unit-wise mode: the coefficients computed before the read, then the optional cap on the total norm after
        them. Where the FP32 norms overflowed (a rare path, known from the read) everything is recomputed in
        float64 and read here."""
        plan, self._agc = self._agc, None
        if plan is not None and plan.record is record and record.grad_status != "overflow":
            smallest = record.value(self._key("smallest"))[0]
            clipped_total = record.value(self._key("total"))[0] if self.max_norm is not None else math.nan
        else:
            plan = self._plan_agc(record, exact=record.grad_status == "overflow")
            smallest = smallest_coefficient(plan.coefs).item()
            clipped_total = plan.clipped_total().item() if self.max_norm is not None else math.nan
        scales: list[tuple[list[Tensor], float | list[Tensor]]] = []
        if smallest < 1.0:
            scales.append(([p.grad for p in plan.params], plan.coefs))  # type: ignore[misc]
        cap = 1.0 if self.max_norm is None else host_clip_coefficient(clipped_total, self.max_norm)
        if cap < 1.0:
            scales.append(([p.grad for p in record.params], cap))  # type: ignore[misc]
        coef = smallest * cap
        plan = ClipPlan(scales, coef, self.clipping)
        return _Clip(record.step, record.total_norm, self.clipping, coef, None, plan, record.total_norm)

    def _plan_agc(self, record: StepHealth, exact: bool) -> _AgcPlan:
        # Sparse gradients (nn.Embedding(sparse=True)) have no unit-wise form here: AGC leaves them to max_norm.
        included = [
            i
            for i, name in enumerate(record.names)
            if not self._excluded(name) and record.params[i].grad.layout == torch.strided  # type: ignore[union-attr]
        ]
        params = [record.params[i] for i in included]
        coefs, norms = agc_coefficients_and_norms(params, self.clipping, self.eps, exact=exact)
        return _AgcPlan(record, included, params, coefs, norms)

    def _key(self, what: str) -> str:
        return f"{type(self).__name__}.{id(self)}.agc.{what}"

    def _excluded(self, name: str) -> bool:
        return any(self._matches(e, name) for e in self.exclude)

    @staticmethod
    def _matches(pattern: str, name: str) -> bool:
        return name == pattern or name.startswith(pattern + ".")

    # ---- commit, log, journal ---------------------------------------------------------------------------------
    def _journal(self, trainer: pl.Trainer, index: int, clip: _Clip) -> None:
        last = self._last_event.get(index)
        if last is not None and clip.step - last < self.EVENT_GAP:
            self._quiet_clips[index] = self._quiet_clips.get(index, 0) + 1
            return
        quiet = self._quiet_clips.pop(index, 0)
        self._last_event[index] = clip.step
        since = f"; {quiet} more such clip(s) since step {last} were not journaled" if quiet else ""
        what = f"clipping ratio {clip.threshold:g}" if self.mode == "agc" else f"threshold {clip.threshold:.4g}"
        message = (
            f"AutoClip({self.mode}): scaled the gradients of optimizer {index} by {clip.coef:.3g} at step "
            f"{clip.step}: total norm {clip.total:.4g}, {what}{since}."
        )
        self._event(
            trainer, "clip", message, step=clip.step, mode=self.mode, optimizer=index, grad_norm=clip.total,
            threshold=clip.threshold, coef=clip.coef, not_journaled=quiet,
        )

    # ---- state ------------------------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        return versioned({
            "mode": self.mode,
            "stats": {index: stats.to_dict() for index, stats in self._stats.items()},
            "steps": self.steps,
            "clipped_steps": self.clipped_steps,
            "epoch": {index: list(counts) for index, counts in self._epoch.items()},
            "first": {index: list(norms) for index, norms in self._first.items()},
            "bounds": {index: list(bound) for index, bound in self._bounds.items()},
            "streaks": dict(self._streaks),
        })  # fmt: skip

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = StateReader("AutoClip", state_dict, since={"streaks": 2})
        self.steps = state.get("steps", int)
        self.clipped_steps = state.get("clipped_steps", int)
        self._epoch = state.get("epoch", lambda v: {int(i): [int(c) for c in counts] for i, counts in v.items()})
        self._first = state.get("first", lambda v: {int(i): [float(n) for n in norms] for i, norms in v.items()})
        self._bounds = state.get("bounds", lambda v: {int(i): (float(r), float(w)) for i, (r, w) in v.items()})
        self._streaks = state.get("streaks", lambda v: {int(i): int(n) for i, n in v.items()}, old={})
        state.get("mode", str)
        state.get("stats", dict)
        self._load_stats(state_dict)
        state.finish()

    def _load_stats(self, state_dict: dict[str, Any]) -> None:
        self._stats = {}
        if state_dict.get("mode") != self.mode:
            return
        if self.mode not in ("percentile", "zscore"):
            return
        for index, saved in state_dict.get("stats", {}).items():
            stats = self._stats[int(index)] = self._new_stats()
            stats.load_state_dict(saved)

    @override
    def _snapshot_extra(self) -> dict[str, Any]:
        return self.state_dict()

    @override
    def _settings(self) -> tuple[float, ...]:
        return tuple(ratio for _, (ratio, _) in sorted(self._bounds.items()))

    @override
    def _after_restore(self, trainer: pl.Trainer, extra: dict[str, Any]) -> None:
        # The statistics go back with the weights; what was clipped meanwhile, and the update bound, stay.
        if not extra:
            return
        self._load_stats(extra)
        restored = (int(extra.get("steps", -1)), self.steps)
        last, self._last_restore = self._last_restore, restored
        largest, self._largest_update = self._largest_update, {}
        again = last is not None and last[0] == restored[0] and self.steps - last[1] <= self.restart_steps
        if again and self.update_ratio is not None and self.mode != "agc":
            self._bound_updates(trainer, self.steps - last[1], largest)  # type: ignore[index]

    def _bound_updates(self, trainer: pl.Trainer, steps: int, largest: dict[int, float]) -> None:
        """Arm the update bound for each optimizer whose updates since the last restore went beyond it (halve its
        ratio where it is armed already), from the restored weights' norms. Entered on every rank together (a
        restore is, and every rank read the same norms): one all-reduce of the weights' squared norms."""
        squares = [squared_norm_share(parameters_of(optimizer), trainer.world_size) for optimizer in trainer.optimizers]
        norms = [math.sqrt(v) for v in sum_and_read(torch.stack(squares))]
        for index, norm in enumerate(norms):
            previous = self._bounds.get(index)
            if previous is None and not largest.get(index, 0.0) > self.update_ratio * norm:  # type: ignore[operator]
                continue  # updates within the bound diverged: the bound would not have changed them
            ratio = self.update_ratio if previous is None else previous[0] / 2  # type: ignore[operator]
            self._bounds[index] = (ratio, norm)  # type: ignore[assignment]
            message = (
                f"AutoClip({self.mode}): the state restored at step {trainer.global_step} is the one restored last "
                f"time, which diverged again within {steps} optimizer step(s) at a lower learning rate: the "
                f"gradients are out of scale, not the rate. From now on the total norm of optimizer {index} is "
                f"capped so that the learning rate times the norm stays within {ratio:.3g} x the weight norm "
                f"({norm:.4g})."
            )
            self._event(trainer, UPDATE_BOUND, message, mode=self.mode, optimizer=index, update_ratio=ratio,
                        weight_norm=norm)  # fmt: skip
            if previous is None:  # the backoffs answered the out-of-scale gradients: the bound does that now
                self._signal(trainer, UPDATE_BOUND, message, index)


def _largest_lr(optimizer: torch.optim.Optimizer) -> float:
    """The largest learning rate of the optimizer's groups: the one a bound on every update must hold for."""
    return max(float(group["lr"]) for group in optimizer.param_groups)
