"""The step pipeline that every suite callback of one trainer shares.

One optimizer step travels in one direction::

    build the record (gradient norms)  ->  every participant contributes device values
    ->  one all-reduce, one host read  ->  every participant judges the same final record
    ->  the policy decides (skip, clip, nothing)  ->  the action is applied once
    ->  every participant learns from the outcome  ->  at batch end, interventions act on the batch's signals

Suite callbacks join their trainer's :class:`HealthBoard` in ``setup`` (they implement :class:`StepParticipant`);
the first to join, the first in ``trainer.callbacks`` (:meth:`HealthBoard.leads`), forwards each per-batch hook to
the board, and Lightning skips the others' forwarding hooks for the fit. So a callback's place in the list never
changes what it sees.
The record (:class:`StepHealth`) is a plain value: it holds no reference to the board or the trainer.

A healthy step that logs nothing costs the suite one norm kernel over the gradients (their finiteness comes with
it), the one read, and a few host-float updates per participant. The board calls a participant only in the stages
its class implements (:data:`STAGES`), keeps what stays the same from step to step (the parameters, their names, how
their norms are taken: ``_StepPlan``), leaves the trials alone while nothing is signalled or under way, and publishes
the ``overflow/...`` counters only when an event, a signal or a logging step may have moved them. What only a
flagged, logged or sampled step needs waits for one: the exact clip threshold and spike thresholds (their roots,
rounded as torch rounds them, cost a tensor op: a bracket of the root decides the rest), the weights check and the
weight-growth sample (every ``n`` steps, in the step's one read), the epoch aggregates (folded in batches).

A board belongs to the trainer (or the plain loop's :class:`~lightning_overflow.guard.Guard` host) whose
callbacks joined it, and it is held by those callbacks (``SuiteCallback._joined``): :func:`board_for` finds it through
``trainer.callbacks``. Nothing is written onto the trainer, and no module-level registry holds boards.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from lightning_overflow import _compat
from lightning_overflow.candidate import Clip, RateHold
from lightning_overflow.distributed import read_packed, sum_and_read
from lightning_overflow.events import Event, Journal, MetricBuffer, WarningCache, log
from lightning_overflow.fit_summary import (
    DEAD_SHARE,
    LossEnding,
    behind_a_restore,
    ending_words,
    left_alone,
    opened_because,
    plain_lines,
    schedule_behind,
    stalled_ending,
)
from lightning_overflow.loggers import (
    StepMerge,
    journal_location,
    prepare_dashboards,
    publish_events,
    upload_journal,
)
from lightning_overflow.numerics import (
    FP32_MAX,
    norm_status,
    parameters_of,
    refine_norms,
    scale_grads_,
    tensor_norms,
    total_norm,
)
from lightning_overflow.numerics._float64 import div, summed_loss, to_float32
from lightning_overflow.numerics.norms import any_sharded, host_total_norm, plain_cpu, plain_norms, shard_squares
from lightning_overflow.policy import SIGNAL_KINDS, Signal, StepAction, Verdict, decide_step
from lightning_overflow.replicas import checksum
from lightning_overflow.schedule_lag import ScheduleLag
from lightning_overflow.skip import BufferCopy, ClosureStepStart, HeldSchedules, MetricCopy, skip_step
from lightning_overflow.training_state import (
    NonFiniteConstants,
    StateCheck,
    check_state,
    checked_weights,
    effective_weights,
    live_state,
    nonfinite_flags,
    optimizer_labels,
    own_optimizer,
    own_optimizer_state,
    pruned_away,
    restore_hint,
    unrestorable_optimizer,
)
from lightning_overflow.trial import TrialConfig
from lightning_overflow.trials import Remedy, TrialOutcome, TrialRunner

if TYPE_CHECKING:
    import pytorch_lightning as pl

    from lightning_overflow.snapshot_store import Snapshot

__all__ = [
    "SIGNAL_KINDS",
    "HealthBoard",
    "Signal",
    "StateCheck",
    "StepHealth",
    "StepParticipant",
    "board_for",
    "finite_checked_monitors",
    "inspect_state",
    "state_flags",
]


MAX_NAMES = 5  # offending parameter names quoted in a message

_LOCAL, _SUMMED, _PER_RANK = 0, 1, 2  # how a contribution to the step's read travels across ranks

STAGES = ("_before_batch", "_contribute", "_judge", "_after_step", "_after_batch", "_counters")
"""The per-step stages of the pipeline. Each participant names those it implements (``_stages()``): a healthy step
calls no participant in a stage it leaves empty."""

_PROGRESS_BAR = {"overflow/skipped_steps": "skips", "overflow/rollbacks": "rollbacks", "overflow/lr_scale": "lr_scale"}
_PROGRESS_BAR_DEFAULTS = {"overflow/skipped_steps": 0.0, "overflow/rollbacks": 0.0, "overflow/lr_scale": 1.0}


def board_for(trainer: pl.Trainer) -> HealthBoard:
    """The board of ``trainer``: the one its suite callbacks joined (each holds it from ``setup`` on, and still after
    the fit, for a look at its journal), found through ``trainer.callbacks``; a new board, owned by ``trainer`` and
    held by nobody yet, when none joined one (the first callback to join holds it from then on).

    Every suite callback asks its own board (``SuiteCallback.board``) on the hot path; this walk of the callbacks (a
    few attribute reads) runs in ``setup`` and in the few places that are handed only the trainer."""
    for callback in getattr(trainer, "callbacks", None) or ():
        board = getattr(callback, "_joined", None)
        if board is not None and board.owner is trainer:
            return board  # type: ignore[no-any-return]
    return HealthBoard(trainer)


class StepParticipant(Protocol):
    """What a suite callback offers the pipeline. :class:`~lightning_overflow.callbacks._base.SuiteCallback`
    implements every method with a default that does nothing.

    Attributes:
        stage: the participant's place in the pipeline (monitors, detectors, clippers, then interventions); within
            a stage, the order in which they joined.
    """

    stage: int

    @property
    def state_key(self) -> str: ...

    def _stages(self) -> frozenset[str]:
        """The pipeline stages the participant implements (the board calls no other: see :data:`STAGES`)."""

    def _before_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        """Prepare for a training batch before its forward pass (NonFiniteDetector keeps it for a replay)."""

    def _wants_record(self) -> bool:
        """Whether the participant needs this step's record (the pipeline runs only if one does)."""

    def _contribute(self, trainer: pl.Trainer, pl_module: pl.LightningModule, record: StepHealth) -> None:
        """Add device values to the step's one host read."""

    def _judge(self, trainer: pl.Trainer, record: StepHealth) -> Verdict | None:
        """Judge the read record: ask for a skip, propose a clip, or nothing."""

    def _after_step(self, trainer: pl.Trainer, record: StepHealth, action: StepAction) -> None:
        """Learn from the step as decided (skipped or not, clipped or not); queue metrics and journal events."""

    def _after_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> None:
        """Act at the end of a training batch on its signals (interventions)."""

    def _counters(self) -> dict[str, float]:
        """Cumulative ``overflow/...`` counters."""

    def _snapshot_extra(self) -> dict[str, Any]:
        """Primitives to keep beside a rollback snapshot."""

    def _settings(self) -> tuple[float, ...]:
        """What the participant changed in how the run trains (LR scales)."""

    def _after_restore(self, trainer: pl.Trainer, extra: dict[str, Any]) -> None:
        """The training state was restored from a snapshot taken with ``extra`` beside it."""

    def _remedy_start(self, trainer: pl.Trainer, signal: Signal) -> Snapshot | None:
        """Turn the live state into the start of a trial's remedy (Rollback: restore a verified snapshot), quietly;
        return the snapshot restored (``None``: nothing done)."""

    def _remedy_lr(
        self, trainer: pl.Trainer, snapshot: Snapshot | None, signal: Signal | None, power: int
    ) -> tuple[list[float], float] | None:
        """Scale the live learning rate for a trial's remedy (LRBackoff: its factor to the ``power``), from the state
        ``snapshot`` left (the current state when ``None``); return the remedy's scales and the factor applied
        (``None``: nothing done)."""

    def _after_trial(self, trainer: pl.Trainer, outcome: TrialOutcome) -> None:
        """A trial ended: its remedy was kept (it is the live state now) or discarded."""

    def _answer_at_end(self, trainer: pl.Trainer, check: StateCheck) -> bool:
        """The fit ends with inf/NaN in its state: restore it, or say so; return whether it was answered."""


class StepHealth:
    """What the suite knows about one optimizer step: a plain value, filled stage by stage by the pipeline.

    Attributes:
        step: ``trainer.global_step`` when the optimizer was about to step.
        optimizer: the optimizer about to step.
        optimizer_index: its index in ``trainer.optimizers``.
        n_optimizers: how many optimizers the model has (for metric-name suffixes).
        rank, world_size: this process and the number of processes.
        params: the parameters that have gradients, in the order of ``grad_norms``.
        names: their names, as in ``named_parameters()``.
        all_names: names of every parameter by ``id``, for messages about weights and optimizer state.
        grad_norms: per-tensor fp32 gradient norms (device tensor, pre-clip, after unscale). Sharded gradients
            (``DTensor``): the norms of this rank's shards until the read, the norms of the full gradients after it.
        device: where the step's device values live (that of ``grad_norms``).
        sharded: whether some gradient is a ``DTensor`` (FSDP2): the norms of the full gradients then come from the
            shards' squares, summed across ranks in the read.
        total_norm: the exact total L2 norm of the gradients (host float, pre-clip), the same on every rank.
        grad_status: ``"finite"``, ``"overflow"`` (finite values whose FP32 norm overflowed) or ``"nonfinite"``.
        grad_ranks: under DDP, the ranks whose gradients held inf/NaN when the others' did not (``()`` otherwise):
            the replicas' gradients differ, and the step is judged ``"nonfinite"`` on every rank alike.
        exact_grad_norms: per-tensor norms recomputed in float64 (only when some fast norm was not finite); with
            sharded gradients, always: the norms of the full gradients (float64 sums of the shards' squares).
        loss_nonfinite_ranks: the ranks whose loss was inf/NaN in this step's backward passes.
        loss_mean: the mean finite training loss of this step over micro-batches and ranks (``nan`` if none).
        loss_seen: whether any backward pass of this step went through ``on_before_backward`` (a Pyro plan runs its
            own backward: no loss is seen, which is no inf/NaN loss).
        loss_scale: the GradScaler scale under ``16-mixed`` (``None`` otherwise).
        loss_float64, grads_float64: the losses came in float64, every gradient is float64: judged in float64, where
            a value beyond the FP32 range (3.4e38) is a finite number like any other.
        log_step: the step Lightning logs this batch at; ``log_due`` whether this batch logs.
        skipped, skip_reason: the decision, once taken.
        state_check: the weights and optimizer state check, once :func:`inspect_state` ran.
    """

    def __init__(
        self,
        *,
        step: int,
        optimizer: torch.optim.Optimizer,
        optimizer_index: int,
        n_optimizers: int,
        rank: int,
        world_size: int,
        params: list[Tensor],
        names: Sequence[str],
        all_names: Mapping[int, str],
        log_step: int,
        log_due: bool,
        grad_norms: Tensor,
        sharded: bool = False,
        grads_float64: bool = False,
    ) -> None:
        self.step = step
        self.optimizer = optimizer
        self.optimizer_index = optimizer_index
        self.n_optimizers = n_optimizers
        self.rank = rank
        self.world_size = world_size
        self.params = params
        self.names = names
        self.all_names = all_names
        self.log_step = log_step
        self.log_due = log_due
        self.grad_norms = grad_norms
        self.device = grad_norms.device
        self.sharded = sharded
        self.grads_float64 = grads_float64
        self._parts: list[tuple[str, Tensor, int]] = []  # (name, device values, _LOCAL / _SUMMED / _PER_RANK)
        self._values: dict[str, list[float]] = {}
        self.total_norm = math.nan
        self.grad_status = "finite"
        self.exact_grad_norms: list[float] | None = None
        self.grad_ranks: tuple[int, ...] = ()
        self.loss_nonfinite_ranks: tuple[int, ...] = ()
        self.loss_mean = math.nan
        self.loss_seen = False
        self.loss_scale: float | None = None
        self.loss_factor = 1  # what the losses are multiplied by (Lightning divided them by the accumulation)
        self.loss_float64 = False  # the losses came in float64: judged in it, as one beyond FP32's range is finite
        self.skipped = False
        self.skip_reason = ""
        self.state_check: StateCheck | None = None

    # ---- filled before the read -------------------------------------------------------------------------------
    def add(self, name: str, value: Tensor, *, per_rank: bool = False, summed: bool = False) -> None:
        """Contribute device values to the one read of this step (kept as they are until the read packs them).

        Args:
            name: the key under which :meth:`value` returns them.
            value: a device tensor (any shape; flattened), not written to before the read.
            per_rank: each rank's values land in its own slot, so every rank learns every rank's values
                (``value`` must be a scalar).
            summed: the values are summed across ranks (for counts and sums); otherwise they must already be
                identical on every rank (derived from all-reduced gradients).
        """
        self._parts.append((name, value, _PER_RANK if per_rank else _SUMMED if summed else _LOCAL))

    def _read(self) -> None:
        """The one host read (and the one all-reduce) of this step: every contribution in one concatenation."""
        device = self.device
        world_size = self.world_size
        front: list[tuple[str, Tensor]] = []  # summed across ranks
        back: list[tuple[str, Tensor]] = []  # identical on every rank
        for name, value, kind in self._parts:
            flat = value.detach() if value.requires_grad else value
            if flat.dim() != 1:
                flat = flat.reshape(-1)
            if flat.device != device:
                flat = flat.to(device)
            if kind == _LOCAL:
                back.append((name, flat if flat.is_floating_point() else flat.double()))
            elif world_size == 1:
                # One process: nothing to reduce, and a rank's slot is the value itself. The concatenation
                # promotes to float64 where any part is (the gradients' total always is), exactly.
                front.append((name, flat if flat.is_floating_point() else flat.double()))
            else:
                flat = flat.to(torch.float64)
                if kind == _PER_RANK:
                    slots = flat.new_zeros(world_size)
                    slots[self.rank] = flat.sum()
                    flat = slots
                front.append((name, flat))
        parts = front + back
        packed = torch.cat([t for _, t in parts]) if parts else torch.zeros(0, dtype=torch.float64, device=device)
        values = read_packed(packed, sum(t.numel() for _, t in front), world_size)
        offset = 0
        for name, tensor in parts:
            size = tensor.numel()
            self._values[name] = values[offset : offset + size]
            offset += size

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
        """Finite gradients whose total norm cannot be represented in FP32 (3.4e38), not all of them float64 (whose
        norms are float64 numbers: nothing of them overflows there)."""
        return self.grads_finite and not self.grads_float64 and self.total_norm > FP32_MAX

    @property
    def loss_finite(self) -> bool:
        return not self.loss_nonfinite_ranks

    @property
    def healthy(self) -> bool:
        """Finite loss, finite gradients whose norm FP32 can hold."""
        return self.loss_finite and self.grads_finite and not self.grads_beyond_fp32

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

    def metric_key(self, key: str) -> str:
        """``key`` with the ``_opt<i>`` suffix when the model has several optimizers."""
        return metric_key(key, self.optimizer_index, self.n_optimizers)


def loss_facts(
    losses: Sequence[float], scale: float | None, factor: int, float64: bool = False
) -> tuple[int, float, int]:
    """``(non-finite, sum of the finite, count)`` of one process's backward-pass losses, computed on host floats
    exactly as float32 tensor ops compute them (each loss in float32, divided by the GradScaler's ``scale``,
    multiplied by ``factor``, then summed in order, a non-finite loss adding 0), or float64 ones with ``float64``
    (losses that came in float64: one beyond the FP32 range is finite).

    Each step is one float32 rounding of a float64 result that is exact (a product of two float32 values) or
    correctly rounded (a quotient or a sum), which rounds as float32 arithmetic does.

    Example:
        >>> loss_facts([1.5, float("nan"), 2.25], scale=None, factor=1)
        (1, 3.75, 3)
        >>> loss_facts([1e40], scale=None, factor=1), loss_facts([1e40], scale=None, factor=1, float64=True)
        ((1, 0.0, 1), (0, 1e+40, 1))
    """
    rounded = (lambda value: value) if float64 else to_float32
    nonfinite = 0
    total = 0.0
    for i, loss in enumerate(losses):
        value = rounded(loss)
        if scale is not None:
            value = rounded(div(value, scale))
        if factor != 1:
            value = rounded(value * factor)
        if not math.isfinite(value):
            nonfinite += 1
            value = 0.0
        total = value if i == 0 else rounded(total + value)
    return nonfinite, total, len(losses)


def nonfinite_at_end(trainer: pl.Trainer, check: StateCheck, who: str = "lightning_overflow") -> str:
    """What ``who`` says of a fit that ends with inf/NaN in its state, nothing restored."""
    more = f" (+{len(check.names) - MAX_NAMES} more)" if len(check.names) > MAX_NAMES else ""
    return (
        f"{who}: the fit ended at step {trainer.global_step} with inf/NaN in its {check.what} on rank(s) "
        f"{', '.join(map(str, check.ranks))} (in {', '.join(check.names[:MAX_NAMES]) or 'no named tensor'}{more}); "
        f"nothing restored them. HINT: {restore_hint(unrestorable_optimizer(trainer.optimizers))}, "
        "and look at what wrote them (a BatchNorm statistic fed a NaN sample, a buffer updated outside the step)."
    )


def _silent(record: StepHealth, module: Any) -> tuple[tuple[int, int] | None, list[str]]:
    """``(gradient tensors exactly 0, tensors)`` of the step, and the names of a few of them where they are most (a
    dead network: :class:`~lightning_overflow.fit_summary.LossEnding`); a host count over the norms already read.
    A tensor pruning masks out whole is left out: its gradient is 0 by design (read only where most are 0)."""
    norms = record.exact_grad_norms if record.exact_grad_norms is not None else (
        record.value("grad_norms") if record.has("grad_norms") else None)  # fmt: skip
    if norms is None:
        return None, []
    zeros = norms.count(0.0)
    if zeros < DEAD_SHARE * len(norms):
        return (zeros, len(norms)), []
    pruned = pruned_away(module)
    kept = [(n, v) for n, v, p in zip(record.names, norms, record.params) if v != 0.0 or id(p) not in pruned]
    zeros = sum(v == 0.0 for _, v in kept)
    if zeros < DEAD_SHARE * len(kept):
        return (zeros, len(kept)), []
    return (zeros, len(kept)), [n for n, v in kept if v == 0.0][:MAX_NAMES]


def metric_key(key: str, optimizer_index: int, n_optimizers: int) -> str:
    """The suite's one rule for per-optimizer metric names, the way ``LearningRateMonitor`` names them."""
    return f"{key}_opt{optimizer_index}" if n_optimizers > 1 else key


class HealthBoard:
    """Everything the suite shares for one trainer: its participants, the step pipeline, the batch's signals,
    loss flags, held schedules, queued metrics, the journal."""

    def __init__(self, owner: Any = None) -> None:
        self._owner = None if owner is None else weakref.ref(owner)  # the trainer (or host) whose callbacks joined
        self.names: dict[int, str] = {}
        self._plans: dict[int, _StepPlan] = {}  # by optimizer id: what stays the same from step to step
        self._by_stage: dict[str, list[StepParticipant]] | None = None
        self.journal = Journal(None)
        self.cause = None
        self._participants: list[weakref.ref[StepParticipant]] = []
        self._ordered: list[StepParticipant] | None = None
        self.current: StepHealth | None = None
        self.signals: list[Signal] = []
        self.metrics = MetricBuffer()
        self._loss_flags: Tensor | None = None
        self._loss_sum: Tensor | None = None
        self._loss_count = 0
        self._losses: list[Tensor] = []  # one process: this step's losses as they came
        self._held = HeldSchedules()
        self._buffers = BufferCopy()
        self._metric_copy = MetricCopy()
        self._epoch_sums: list[tuple[Any, Tensor, Tensor | None]] = []  # the logged epoch sums as the window found them
        self._closure_start = ClosureStepStart()
        self._window_open = False
        self._skipped_in_batch = False  # manual optimization: a step of this batch was skipped
        self._leader: StepParticipant | None = None
        self._log_due: bool | None = None  # whether Lightning logs this batch, once asked
        self._summarised = False
        self.ending = LossEnding()
        self._said_of_weights: list[float] | None = None  # the weights' checksum when the fit's end spoke of them
        self._published: dict[str, float] = {}
        self._counted = -1  # the journal's length when the counters were last published (-1: not yet in this fit)
        self._merge = StepMerge()  # the suite's metrics of a step in Lightning's own logging call of that step
        self._constants: NonFiniteConstants | None = None
        self._journal_open = False
        self.trials = TrialRunner()
        self.schedule_lag = ScheduleLag()
        self._end_warnings = WarningCache()
        self._trial_config: tuple[str, TrialConfig | None] | None = None  # who set it, and the setting

    @property
    def owner(self) -> Any:
        """The trainer (or plain-loop host) this board belongs to; ``None`` once it is gone."""
        return None if self._owner is None else self._owner()

    # ---- lifecycle --------------------------------------------------------------------------------------------
    def join(self, participant: StepParticipant, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Register ``participant`` for this fit and set up for it. Every rank calls it, in ``setup``."""
        if not any(p is participant for p in self.participants):
            _refuse_a_second(participant, self.participants, getattr(trainer, "arguments_of", "Trainer"))
            # Weakly: Lightning gives callbacks the module's bound log methods, and the module holds the trainer,
            # which keys this board.
            self._participants.append(weakref.ref(participant))
            # Stable: participants of one stage keep the order in which they joined (their order in the list).
            self._participants.sort(key=lambda ref: getattr(ref(), "stage", 0))
            self._ordered = self._by_stage = None
        self._agree_on_trials(participant)  # every fit: the last one's settings were released with it
        self.names = {id(p): name for name, p in pl_module.named_parameters()}
        self._plans = {}
        self._published = {}
        self._counted = -1
        self._constants = None
        if not self._journal_open:  # the fit's first participant opens its journal; a broadcast: every rank, in setup
            # ... and leads: Lightning calls setup in the order of trainer.callbacks, as it calls every other hook.
            self._leader = participant
            path, run = journal_location(trainer)
            self.journal = Journal(path, write=trainer.global_rank == 0, run=run)
            self.ending = LossEnding()
            self.cause: tuple[str, str] | None = None
            self._journal_open = True
            prepare_dashboards(trainer)
        self._summarised = False

    def _agree_on_trials(self, participant: StepParticipant) -> None:
        """The interventions that offer remedies (``LRBackoff``, ``Rollback``) each carry the fit's trial settings:
        they must agree."""
        if not hasattr(participant, "trial"):
            return
        config: TrialConfig | None = participant.trial  # type: ignore[attr-defined]
        name = type(participant).__name__
        if self._trial_config is not None and self._trial_config[1] != config:
            other, theirs = self._trial_config
            raise ValueError(
                f"{other}(trial={theirs!r}) and {name}(trial={config!r}) disagree: the suite runs one kind of trial for "
                f"both remedies. Pass the same TrialConfig to both (default_callbacks(...) does)."
            )
        self._trial_config = (name, config)

    def check_at_end(self, trainer: pl.Trainer) -> None:
        """No fit leaves the suite's hands with inf/NaN in its weights, buffers or optimizer state unsaid: the state is
        checked when training ends (one all-reduce, every rank together), by the rule of every other check (a buffer
        holding from the start the infs it holds now, a causal mask, is legitimate). The participants are asked
        in reverse pipeline order to answer it (``Rollback`` restores the last verified snapshot, ``NonFiniteDetector``
        raises or warns); with none that does, the board warns itself and journals it."""
        state = live_state(trainer)
        check = check_state(checked_weights(trainer, state), state["optimizers"], self.constants(trainer),
                            trainer.strategy.root_device,
                            lambda: optimizer_labels(trainer.lightning_module, trainer.optimizers))  # fmt: skip
        if check.finite:
            return
        for participant in reversed(self.participants):
            if participant._answer_at_end(trainer, check):
                return
        message = nonfinite_at_end(trainer, check)
        self.record(Event(step=int(trainer.global_step), kind="nonfinite_at_end", rank=min(check.ranks), source=
                          "lightning_overflow", message=message, details={"parameters": check.names[:MAX_NAMES]}))  # fmt: skip
        self._end_warnings.warn("nonfinite_at_end", message)

    def note_ending(self, trainer: pl.Trainer) -> None:
        """Journal a training loss that ended far above its best (:class:`~lightning_overflow.fit_summary.LossEnding`):
        finite is not the same as well."""
        # The fit's events, taken once: what reads them below reads none of the end's own (ending, stopped).
        events = [asdict(e) for e in self.journal.events]
        details = self.ending.event_details() or stalled_ending(events, self.ending) or self.ending.start_out_of_scale()
        if details is not None:
            self._note_at_end(trainer, "ending", (ending_words(details), details))
        for stopper in _early_stops_on_nonfinite(trainer):
            self._note_at_end(trainer, "stopped", stopper)
        self._note_at_end(trainer, "behind", behind_a_restore(events, int(trainer.global_step)))
        late = schedule_behind(events, self.schedule_lag.behind(trainer), int(trainer.global_step))
        self._note_at_end(trainer, "schedule_behind", late)
        self._said_of_weights = None
        if any(e.kind in _OF_THE_WEIGHTS for e in self.journal.events[len(events):]):
            params = list(trainer.lightning_module.parameters())
            self._said_of_weights = None if any_sharded(params) else checksum(effective_weights(
                trainer.lightning_module)).tolist()  # fmt: skip
        # Suspicions nothing was left to answer: the journal says so, as the summary does.
        self._note_at_end(trainer, "left_alone", left_alone(events))

    def _note_at_end(self, trainer: pl.Trainer, kind: str, said: tuple[str, dict[str, Any]] | None) -> None:
        """Journal what the fit's end found (``said``: the message and its facts; ``None``: nothing to say)."""
        if said is not None:
            self.record(Event(step=int(trainer.global_step), kind=kind, rank=0, source="lightning_overflow",
                              message=said[0], details=said[1]))  # fmt: skip

    def answers(self, kind: str) -> bool:
        """Whether a participant acts on signals of ``kind`` (it lists it among its ``triggers``)."""
        return any(kind in getattr(p, "triggers", ()) for p in self.participants)

    def start_training(self, trainer: pl.Trainer) -> None:
        """Once the optimizers exist (``on_train_start``): whether this fit can run trials; and the buffers' constants
        and placeholders as the fit starts, before a forward pass wrote into them."""
        self.constants(trainer)
        withdrawn = self.trials.configure(self._trial_config[1] if self._trial_config is not None else None, trainer)
        if withdrawn and trainer.global_rank == 0:
            log.info(f"lightning_overflow: {withdrawn}")
        self.schedule_lag.start(trainer)
        if self.trials.unavailable and trainer.global_rank == 0:
            log.info(f"lightning_overflow: no trials in this fit ({self.trials.unavailable}): a suspicion of "
                     "divergence backs off and rolls back at once")  # fmt: skip

    def trial_host(self) -> StepParticipant | None:
        """The participant whose checkpoint state carries a trial under way: the last one that offers a remedy."""
        hosts = [p for p in self.participants if hasattr(p, "trial")]
        return hosts[-1] if hosts else None

    @property
    def participants(self) -> list[StepParticipant]:
        """The registered suite callbacks, in pipeline order (resolved once per fit: read several times a step)."""
        if self._ordered is None:
            self._ordered = [p for ref in self._participants if (p := ref()) is not None]
        return self._ordered

    def in_stage(self, stage: str) -> list[StepParticipant]:
        """The participants that implement ``stage`` (one of :data:`STAGES`), in pipeline order (resolved once per
        fit)."""
        if self._by_stage is None:
            self._by_stage = {name: [p for p in self.participants if name in p._stages()] for name in STAGES}
        return self._by_stage[stage]

    def leads(self, participant: StepParticipant) -> bool:
        """Whether ``participant`` forwards Lightning's per-batch hooks to the board: the fit's first participant to
        join (Lightning calls callbacks in the order of ``trainer.callbacks``, so the first of them in that list),
        so the board hears each hook once, as soon as any participant does."""
        return self._leader is participant

    def release(self) -> None:
        """Drop everything tied to the last fit's tensors (records, held schedules, buffers, loss flags)."""
        self.current = None
        self._ordered = self._by_stage = None  # strong references to the callbacks end with the fit
        self._plans = {}
        self._loss_flags = self._loss_sum = None
        self._loss_count = 0
        self._losses = []
        self._leader = None
        self._held.put_back_hooks()  # a fit that ended inside a skipped step
        self._held = HeldSchedules()
        self._buffers.release()
        self._metric_copy.release()
        self._epoch_sums = []
        self._closure_start.release()
        self._window_open = self._skipped_in_batch = False
        self.signals.clear()
        self.metrics.clear()
        self._merge.uninstall()
        self._journal_open = False  # the next fit opens its own journal
        self.trials.reset()
        self._trial_config = None
        self._end_warnings = WarningCache()

    def record(self, event: Event) -> None:
        self.journal.record(event)

    def signal(self, signal: Signal) -> None:
        """Report a signal for this batch; interventions read :attr:`signals` in ``_after_batch``."""
        self.signals.append(signal)

    def note_cause(self, message: str, hint: str) -> None:
        """The latest cause a diagnosis found (a replay that named the op and the layer) and its fix: whatever error
        ends the fit later carries it (:attr:`cause`)."""
        self.cause = (message, hint)

    def present(self) -> set[str]:
        """The class names of the suite callbacks in this fit, ``Rollback`` included when one restores the state (a
        subclass of it): advice names only what is not there."""
        present = {type(p).__name__ for p in self.participants}
        if any(getattr(p, "restores_state", False) for p in self.participants):
            present.add("Rollback")
        return present

    def watches_buffers(self) -> bool:
        """Whether the module has floating-point buffers a forward may write (its layout: alike on every rank)."""
        return self._buffers.watched

    def buffers_written(self) -> list[tuple[str, Tensor, Tensor]]:
        """The floating-point buffers this accumulation window's forward passes wrote, by name, with their copies
        from when the window began (what a skip puts back: :class:`~lightning_overflow.skip.BufferCopy`)."""
        return self._buffers.written()

    def known_constants(self) -> NonFiniteConstants:
        """The buffers' constants learned so far in this fit, without learning more (no module walk: a per-step
        check may ask)."""
        return self._constants if self._constants is not None else NonFiniteConstants()

    def constants(self, trainer: pl.Trainer) -> NonFiniteConstants:
        """The infs the module's buffers hold as constants (a causal mask's ``-inf``) and their NaN placeholders: the
        one record every state check of the suite uses, started the first time a check asks in this fit and brought
        up to date at each ask (a buffer built on the first forward). Placeholders are said once each, on the
        console: a NaN a fit starts with is taken as no fault."""
        if self._constants is None:
            self._constants = NonFiniteConstants()
        said = set(self._constants.placeholders)
        self._constants.learn(trainer.lightning_module)
        new = [path for path in self._constants.placeholders if path not in said]
        if new and trainer.global_rank == 0:
            more = f" (+{len(new) - MAX_NAMES} more)" if len(new) > MAX_NAMES else ""
            log.info(f"lightning_overflow: the buffer(s) {', '.join(new[:MAX_NAMES])}{more} hold NaN where first seen: "
                     "taken as placeholders for values not computed yet (a threshold, a bound), not as faults; a NaN "
                     "anywhere else in them is one.")
        return self._constants

    def state_before_step(self, module: torch.nn.Module) -> dict[str, Any]:
        """The module's state with its buffers as the step found them: this step's forward passes moved them (a NaN
        sample writes NaN into BatchNorm's statistics), and a skip puts them back, so they are not yet the state."""
        state = module.state_dict()
        for name, saved in self._buffers.saved().items():
            if name in state:
                state[name] = saved
        return state

    def settings(self) -> tuple[float, ...]:
        """Every participant's ``_settings()``, in pipeline order."""
        return tuple(value for p in self.participants for value in p._settings())

    def snapshot_extras(self, trainer: pl.Trainer) -> dict[str, Any]:
        """Every participant's ``_snapshot_extra()``, by state key, to store beside a snapshot."""
        return {p.state_key: p._snapshot_extra() for p in self.participants}

    def after_restore(self, trainer: pl.Trainer, extras: dict[str, Any]) -> None:
        """Tell every participant that the training state was restored from a snapshot.

        Args:
            extras: what each participant's ``_snapshot_extra()`` returned when the snapshot was taken, by state key.
        """
        if trainer.lr_scheduler_configs:
            self.schedule_lag.restored(trainer)
        for participant in self.participants:
            participant._after_restore(trainer, extras.get(participant.state_key, {}))

    # ---- trials ---------------------------------------------------------------------------------------------------
    def prepare_remedy(self, trainer: pl.Trainer, signal: Signal | None, power: int = 1) -> Remedy | None:
        """Turn the live state into a trial's remedy: the state a participant restores (a suspicion's: a scheduled
        trial starts from the current state), then the learning rate a participant backs off (by its factor to the
        ``power``). ``None`` when no participant changed anything (the live state is untouched then)."""
        snapshot = None
        if signal is not None:
            for participant in self.participants:
                snapshot = snapshot or participant._remedy_start(trainer, signal)
        scales, factor = None, 1.0
        for participant in self.participants:
            lr = participant._remedy_lr(trainer, snapshot, signal, power)
            if lr is not None:
                scales, factor = lr
        if snapshot is None and (scales is None or factor == 1.0):
            return None
        if snapshot is None:
            return Remedy(scales=scales, factor=factor)
        return Remedy(snapshot.step, dict(snapshot.extras), scales, factor)

    def after_trial(self, trainer: pl.Trainer, outcome: TrialOutcome) -> None:
        """Tell every participant how a trial ended. A kept remedy that trained beside the loop (``"ab"`` mode) is the
        run now: its losses on the trial's batches stand for those of the run it replaced, at the fit's end."""
        trial = outcome.trial
        if outcome.kept and trial.config.mode == "ab" and outcome.remedy.factor in trial.lr_factors:
            scores = trial.remedies[trial.lr_factors.index(outcome.remedy.factor)]
            self.ending.replace_from(outcome.step - len(scores), scores)
            if trainer.lr_scheduler_configs:  # its schedules came back with it from its snapshot, as a rollback's do
                self.schedule_lag.restored(trainer)
        for participant in self.participants:
            participant._after_trial(trainer, outcome)

    def journal_trial(self, trainer: pl.Trainer, outcome: TrialOutcome, extra_steps: int) -> None:
        """One ``trial`` line: what opened it, the remedies, the scores, the verdict and the cost."""
        trial, verdict = outcome.trial, outcome.verdict
        start = "the current state" if trial.snapshot_step is None else f"the snapshot of step {trial.snapshot_step}"
        rates = " and ".join(f"x{f:g}" for f in trial.lr_factors)
        if outcome.kept:
            kept = f"kept the remedy ({start} at the learning rate x{outcome.remedy.factor:g})"
        else:
            kept = "kept the run as it was"
        rung = ""
        if trial.rung > 1:  # a follow-up goes back to a snapshot only when the remedy kept diverged too (REMEDY_RISE)
            kept_one = "its remedy" if trial.snapshot_step is None else "a remedy whose loss rose over its trial"
            rung = f" (a follow-up: the trial before it kept {kept_one})"
        message = (
            f"lightning_overflow: a trial opened {opened_because(trial.kind, trial.step)}{rung} tried {start} at the "
            f"learning rate {rates} against the run as it was, {len(trial.incumbent)} steps on the same batches; at "
            f"step {outcome.step} it {kept}: {outcome.why}."
        )
        details: dict[str, Any] = {
            "signal": trial.kind,
            "opened_at": trial.step,
            "rung": trial.rung,
            "snapshot_step": trial.snapshot_step,
            "lr_factors": list(trial.lr_factors),
            "mode": trial.config.mode,
            "kept": outcome.kept,
            "kept_lr_factor": outcome.remedy.factor if outcome.kept else None,
            "false_alarm": outcome.false_alarm,
            "steps": len(trial.incumbent),
            "planned_steps": trial.config.steps,
            "extra_steps": extra_steps,
            "incumbent_losses": list(trial.incumbent),
            "remedy_losses": [list(scores) for scores in trial.remedies],
        }
        if outcome.layout_change:
            details["layout_change"] = outcome.layout_change
        if verdict is not None:
            details["comparisons"] = [
                {"lr_factor": f, "mean": c.mean, "stderr": c.stderr, "pairs": c.pairs, "better": c.better, "wins": c.wins}
                for f, c in zip(trial.lr_factors, verdict.comparisons)
            ]
        event = Event(step=outcome.step, kind="trial", rank=0, source=trial.source or "lightning_overflow",
                      message=message, details=details, epoch=int(trainer.current_epoch))  # fmt: skip
        self.record(event)
        if trainer.global_rank == 0:
            log.info(message)

    def candidate_clip(self, trainer: pl.Trainer) -> Clip | None:
        """The suite's clip of the loop's step, for a candidate's gradients: a clipper's current threshold (the
        Trainer's ``gradient_clip_val`` is the module's ``configure_gradient_clipping``, which the candidate calls)."""
        for participant in self.participants:
            clip = getattr(participant, "_candidate_clip", None)
            if clip is not None:
                return clip(0)  # type: ignore[no-any-return]
        return None

    def candidate_rates(self, trainer: pl.Trainer) -> RateHold | None:
        """How a candidate's rates are held at its own scale, as the suite holds the loop's: the rates the loop wrote
        before this batch (read now, on the live state), and those its module writes (a warm-up in
        ``optimizer_step``)."""
        for participant in self.participants:
            hold = getattr(participant, "_candidate_rates", None)
            if hold is not None:
                return hold(trainer)  # type: ignore[no-any-return]
        return None

    # ---- the batch --------------------------------------------------------------------------------------------
    def begin_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        """At the start of each training batch: forget the previous batch's signals, copy the buffers when an
        accumulation window begins, and let a trial's candidate on the side take the batch first."""
        self.signals.clear()
        self._log_due = None
        self._merge.send_leftover()  # a held step that Lightning did not log after all
        if trainer.lr_scheduler_configs:
            self.schedule_lag.begin_batch(trainer)
            self.follow_plateaus(trainer)
        # An accumulation window begins here; under manual optimization every batch begins one, since the batch steps
        # its optimizers itself: what a skipped step left inf/NaN in its buffers, logged sums and metrics goes back.
        if not self._window_open or not pl_module.automatic_optimization:
            self._buffers.take(pl_module)
            self._metric_copy.take(pl_module)
            self._epoch_sums = _compat.epoch_sums(trainer)
            self._window_open = True
        trials = self.trials
        if trials.sides:  # only a candidate on the side has anything to do with the batch here
            trials.begin_batch(trainer, self, batch, batch_idx)
        for participant in self.in_stage("_before_batch"):
            participant._before_batch(trainer, pl_module, batch, batch_idx)

    def follow_plateaus(self, trainer: pl.Trainer) -> None:
        """A ``ReduceLROnPlateau`` of the loop stepped since the last batch ended (on its metric, after that batch
        or as the epoch ended): a trial's candidates step theirs on the same values."""
        steps = self.schedule_lag.plateau_steps(trainer)
        if self.trials.sides and any(steps):
            self.trials.note_plateau(steps)

    def forget_batch_logs(self, trainer: pl.Trainer) -> None:
        """Take this batch's logged values out of the epoch's sums again, as a skipped step's are: its state was
        replaced (a rollback at its end), and an inf/NaN loss of it would make the epoch's mean inf/NaN."""
        if trainer.lightning_module.automatic_optimization:
            _compat.put_back_epoch_sums(trainer, self._epoch_sums)

    def observe_loss(self, trainer: pl.Trainer, loss: Tensor) -> None:
        """Note this backward pass's loss (no host read).

        On one process the loss is kept as it is: it rides on the step's read and is judged on the host, with no
        tensor op per backward pass. Across ranks its flags and sums are accumulated on the device, since the
        ranks' numbers of backward passes need not match and the read's layout must.
        """
        if trainer.world_size == 1:
            value = loss.detach()
            self._losses.append(value if value.numel() == 1 else summed_loss(value))
            return
        value = summed_loss(loss).reshape(())
        scaler = _compat.scaler_of(trainer)
        scale = _compat.scaler_scale(scaler) if scaler is not None else None
        if scale is not None:
            value = value / scale.to(value.device).reshape(())
        if trainer.lightning_module.automatic_optimization:
            value = value * trainer.accumulate_grad_batches  # Lightning divided it by the accumulation
        bad = ~torch.isfinite(value)
        finite = torch.where(bad, torch.zeros_like(value), value)
        if self._loss_flags is None or self._loss_sum is None:
            self._loss_flags, self._loss_sum = bad.float(), finite
        else:
            self._loss_flags, self._loss_sum = self._loss_flags + bad.float(), self._loss_sum + finite
        self._loss_count += 1

    def end_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any) -> None:
        """At the end of each training batch: put held schedules back, let every participant act in pipeline
        order, then log the batch's metrics with one call per logger."""
        trials = self.trials
        if trainer.lr_scheduler_configs:
            steps = self.schedule_lag.end_batch(trainer)
            if trials.sides:
                trials.note_schedule(steps)
        if self._held.schedulers or self._held.groups:  # a skipped step's schedules
            self._held.restore()
        self._closure_start.put_back()
        self._metric_copy.end_batch()
        if self._constants is not None and self._constants.placeholders:  # a buffer the steps write is no placeholder
            self._constants.forget_placeholders(name for name, _, _ in self._buffers.written())
        if self._skipped_in_batch and not pl_module.automatic_optimization:
            _compat.put_back_nonfinite_epoch_sums(trainer, self._epoch_sums)
            self._metric_copy.put_back_nonfinite()
        self._skipped_in_batch = False
        trials.end_batch(trainer, self)
        if trials.trial is not None and _compat.fit_ends_after_batch(trainer):
            # The fit's last batch: the verdict is taken here, not as the fit ends, so that the checkpoints written
            # at this step (their callbacks come after the suite's hooks) hold the state the fit returns.
            trials.end_fit(trainer, self)
        for participant in self.in_stage("_after_batch"):
            participant._after_batch(trainer, pl_module, outputs)
        if trainer.lr_scheduler_configs:  # after the batch's restores: a plateau's steps are counted from here
            self.schedule_lag.mark_plateaus(trainer, values=bool(trials.sides))
        logs = self.logs_now(trainer)
        # The counters move only with an event (a skip, a spike, a backoff, a rollback), a signal or a trial: a quiet
        # batch that logs nothing leaves them as they were published.
        if logs or len(self.journal.events) != self._counted or self.signals or self.trials.active:
            counters = self._publish_counters(trainer)
            if logs:
                self.metrics.add(counters, _compat.batches_that_stepped(trainer))
        self.flush(trainer, batch_end=True)

    def logs_now(self, trainer: pl.Trainer) -> bool:
        """Whether Lightning logs this batch's metrics: asked once per batch (its logging step stays the same until
        the batch ends), and true as well once a stop was asked for since (Lightning logs the last batch). Without a
        logger too: the values go to ``trainer.callback_metrics`` then, where Lightning puts its users' own."""
        if self._log_due is None:
            self._log_due = _compat.should_update_logs(trainer)
        return self._log_due or bool(trainer.should_stop)

    def _publish_counters(self, trainer: pl.Trainer) -> dict[str, float]:
        """Counters in ``trainer.callback_metrics`` (so ``ModelCheckpoint``/``EarlyStopping`` can monitor them) and,
        once anything happened, short ones in the progress bar. New tensors only when a value changed."""
        self._counted = len(self.journal.events)
        counters: dict[str, float] = {}
        for participant in self.in_stage("_counters"):  # several callbacks skip: their counts add up
            for key, value in participant._counters().items():
                counters[key] = counters.get(key, 0.0) + float(value)
        changed = {k: v for k, v in counters.items() if self._published.get(k) != v}
        if not changed:
            return counters
        self._published.update(changed)
        values = {k: torch.tensor(v) for k, v in changed.items()}
        _compat.callback_metrics(trainer).update(values)
        if any(self._published.get(key, default) != default for key, default in _PROGRESS_BAR_DEFAULTS.items()):
            # Plain numbers: the progress bar prints a tensor as "tensor(8.)"; counts as ints ("skips=8").
            shown = {
                short: (self._published[key] if key == "overflow/lr_scale" else int(self._published[key]))
                for key, short in _PROGRESS_BAR.items()
                if key in self._published
            }
            _compat.progress_bar_metrics(trainer).update(shown)
        return counters

    def flush(self, trainer: pl.Trainer, batch_end: bool = False) -> None:
        """Send every queued metric, and put the same values into ``trainer.callback_metrics``, where Lightning keeps
        its users' ``self.log(on_step=True)`` values (so that ``EarlyStopping(monitor="grad_norm/total")`` or a
        callback of the user's reads them).

        At the end of a batch that Lightning logs, the metrics of its step ride on Lightning's own ``log_metrics``
        call of that step (:class:`~lightning_overflow.loggers.StepMerge`: one ``metrics.csv`` row, one history entry
        per step); the others (a callback logging on steps of its own) are one ``log_metrics`` call per logger and
        step."""
        lightning_step = _compat.batches_that_stepped(trainer) if batch_end and self.logs_now(trainer) else None
        if not batch_end:
            self._merge.send_leftover()
            if len(self.journal.events) != self._counted:  # an event after the last batch: the epoch's or fit's end
                counters = self._publish_counters(trainer)
                self.metrics.add(counters, _compat.batches_that_stepped(trainer))
        for step, metrics in self.metrics.drain():
            if trainer.loggers and step == lightning_step:
                self._merge.hold(trainer.loggers, step, metrics)
            else:
                for logger in trainer.loggers:
                    logger.log_metrics(metrics, step=step)
            held = {k: torch.tensor(v, dtype=torch.float64) for k, v in metrics.items()}  # the logged float, exactly
            _compat.callback_metrics(trainer).update(held)
        events = self.journal.unpublished()
        if events:  # TensorBoard text; nothing to do on most steps
            publish_events(trainer, events)

    def upload_journal(self, trainer: pl.Trainer) -> None:
        """Upload the journal to the loggers that keep artifacts (MLflow, W&B), from rank 0, if it grew since."""
        upload_journal(trainer, self.journal)

    # ---- the step pipeline (on_before_optimizer_step) ---------------------------------------------------------
    def before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """Run the pipeline for this evaluation of the closure.

        Lightning calls ``on_before_optimizer_step`` after each evaluation of the closure (LBFGS evaluates it several
        times per step) and once per optimizer: each call is an evaluation with its own record.
        """
        if not self.trials.active and not any(p._wants_record() for p in self.participants):
            self.current = None
            self._window_open = False  # the accumulation window ends with this step all the same
            return
        self._run_step(trainer, pl_module, optimizer)

    def _run_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer) -> None:
        self._closure_start.note(int(trainer.global_step), optimizer)
        record = self._build(trainer, pl_module, optimizer)
        for participant in self.in_stage("_contribute"):
            participant._contribute(trainer, pl_module, record)
        self.trials.contribute(record)
        record._read()
        self._interpret(record)
        self.current = record
        verdicts = [(p, p._judge(trainer, record)) for p in self.in_stage("_judge")]
        action = decide_step(verdicts)
        self._apply(trainer, optimizer, record, action)
        for participant in self.in_stage("_after_step"):
            participant._after_step(trainer, record, action)
        if record.optimizer_index == 0:
            loss = record.loss_mean if record.loss_seen else None
            self.ending.add(record.step, loss, *_silent(record, pl_module), norm=record.total_norm)

    def _build(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer) -> StepHealth:
        """The step's record with the gradients' norms (device values, read with the rest of the step's)."""
        plan = self._plan(trainer, pl_module, optimizer)
        grads: list[Tensor] = [p.grad for p in plan.params]  # type: ignore[misc]
        record = StepHealth(
            step=int(trainer.global_step),
            optimizer=optimizer,
            optimizer_index=plan.index,
            n_optimizers=plan.n_optimizers,
            rank=plan.rank,
            world_size=plan.world_size,
            params=plan.params,
            names=plan.names,
            all_names=self.names,
            log_step=_compat.batches_that_stepped(trainer),
            log_due=self.logs_now(trainer),
            grad_norms=plain_norms(grads) if plan.plain else tensor_norms(grads),
            sharded=plan.sharded,
            grads_float64=plan.float64,
        )
        device = record.device
        if record.world_size == 1:
            losses, self._losses = self._losses, []
            if losses:
                record.add("losses", losses[0] if len(losses) == 1 else torch.cat([v.reshape(-1) for v in losses]))
                record.loss_float64 = any(v.dtype == torch.float64 for v in losses)
            # Lightning divided the loss by the accumulation under automatic optimization: multiplied back.
            record.loss_factor = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
        else:
            zero = torch.zeros((), device=device)
            flags, sums = self._loss_flags, self._loss_sum
            record.add("loss_nonfinite", zero if flags is None else flags.to(device), per_rank=True)
            record.add("loss_sum", zero if sums is None else sums.to(device), summed=True)
            record.loss_float64 = sums is not None and sums.dtype == torch.float64
            record.add("loss_count", torch.full((), float(self._loss_count), device=device), summed=True)
            self._loss_flags = self._loss_sum = None
            self._loss_count = 0
        if record.sharded:
            # Each rank's part of the full gradients' squared norms: summed in the read, not yet a norm of anything.
            record.add("grad_squares", shard_squares(record.grad_norms, grads, record.world_size), summed=True)
        else:
            # Replicated gradients (all-reduced by DDP, or one device): identical on every rank, so not reduced; their
            # total is taken on the host from the read norms (no kernel for it).
            record.add("grad_norms", record.grad_norms)
            if record.world_size > 1:
                # Unless a rank wrote to its own after the all-reduce (or DDP does not reduce a parameter): each
                # rank's sum tells whether its gradients held inf/NaN, so that every rank judges the step alike.
                record.add("grad_sums", record.grad_norms.sum(dtype=torch.float64), per_rank=True)
        if plan.scaler is not None:
            scale = _compat.scaler_scale(plan.scaler)
            if scale is not None:
                record.add("loss_scale", scale)
        return record

    def _plan(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer) -> _StepPlan:
        """What stays the same from one step of ``optimizer`` to the next: made again when the parameters that have
        gradients change (or the optimizers do)."""
        params = parameters_of(optimizer)
        if any(p.grad is None for p in params):
            params = [p for p in params if p.grad is not None]
        ids = list(map(id, params))
        plan = self._plans.get(id(optimizer))
        n_optimizers = len(trainer.optimizers)
        if plan is not None and plan.ids == ids and plan.n_optimizers == n_optimizers:
            return plan
        if any(i not in self.names for i in ids):
            self.names = {id(p): n for n, p in pl_module.named_parameters()}
        grads: list[Tensor] = [p.grad for p in params]  # type: ignore[misc]
        sharded = any_sharded(grads)
        plan = self._plans[id(optimizer)] = _StepPlan(
            ids=ids,
            params=params,
            names=tuple(self.names.get(id(p), f"<unnamed {tuple(p.shape)}>") for p in params),
            index=_index_of(trainer.optimizers, optimizer),
            n_optimizers=n_optimizers,
            rank=int(trainer.global_rank),
            world_size=int(trainer.world_size),
            sharded=sharded,
            plain=plain_cpu(grads),
            float64=bool(grads) and all(g.dtype == torch.float64 for g in grads),
            scaler=_compat.scaler_of(trainer),
        )
        return plan

    @staticmethod
    def _interpret(record: StepHealth) -> None:
        if record.has("loss_scale"):
            record.loss_scale = record.value("loss_scale")[0]
        if record.world_size == 1:
            nonfinite, loss_sum, count = loss_facts(
                record.value("losses") if record.has("losses") else [], record.loss_scale, record.loss_factor,
                record.loss_float64,
            )
            record.loss_nonfinite_ranks = (record.rank,) if nonfinite else ()
        else:
            nonfinite_by_rank = record.value("loss_nonfinite")
            record.loss_nonfinite_ranks = tuple(r for r, v in enumerate(nonfinite_by_rank) if v != 0)
            nonfinite, loss_sum, count = sum(nonfinite_by_rank), record.value("loss_sum")[0], record.value("loss_count")[0]
        record.loss_seen = count > 0
        # Non-finite losses add 0 to the sum: leave them out of the count too, or a NaN step reads as a loss of 0.
        count -= nonfinite
        record.loss_mean = loss_sum / count if count > 0 else math.nan
        if record.sharded:
            HealthBoard._interpret_shards(record)
            return
        total = host_total_norm(record.value("grad_norms"))
        apart = HealthBoard._ranks_apart(record)
        if math.isfinite(total):
            record.total_norm = total
        else:
            # The rare path: some fast norm is inf/NaN. Tell spurious FP32 overflow from real inf/NaN, in float64.
            grads = [p.grad for p in record.params]
            fast = record.grad_norms.tolist()
            bad = [i for i, v in enumerate(fast) if not math.isfinite(v)]
            exact = refine_norms(grads, record.grad_norms, bad).tolist()  # type: ignore[arg-type]
            record.exact_grad_norms = exact
            statuses = [norm_status(f, e) for f, e in zip(fast, exact)]
            record.grad_status = "nonfinite" if "nonfinite" in statuses else "overflow"
            record.total_norm = total_norm(torch.tensor(exact, dtype=torch.float64)).item() if exact else 0.0
        if apart:  # no total agreed by every rank: each rank's own would be a different number
            record.grad_status, record.grad_ranks, record.total_norm = "nonfinite", apart, math.nan

    @staticmethod
    def _ranks_apart(record: StepHealth) -> tuple[int, ...]:
        """The ranks whose gradients held inf/NaN (or overflowed FP32) when some other rank's did not; ``()`` when
        the ranks agree (DDP's all-reduce made the gradients identical) and in one process."""
        if not record.has("grad_sums"):
            return ()
        flagged = tuple(rank for rank, value in enumerate(record.value("grad_sums")) if not math.isfinite(value))
        return flagged if len(flagged) < record.world_size else ()

    @staticmethod
    def _interpret_shards(record: StepHealth) -> None:
        """The norms of the full gradients from the shards' squares summed in the read: identical on every rank.

        Where some full gradient's fast norm is inf/NaN (a shard's fp32 norm overflowed or holds inf/NaN: the rare
        path), every rank recomputes its shards of those gradients in float64 and one more all-reduce sums them.
        Every rank enters it: all of them read the same sums.
        """
        squares = record.value("grad_squares")
        fast = torch.tensor([math.sqrt(v) for v in squares], dtype=torch.float32)  # beyond FP32 reads as inf
        fast_host = fast.tolist()
        bad = [i for i, v in enumerate(fast_host) if not math.isfinite(v)]
        if bad:
            grads = [p.grad for p in record.params]
            local = refine_norms(grads, record.grad_norms, bad)  # type: ignore[arg-type]
            picked = local[torch.tensor(bad, device=local.device)]
            refined = sum_and_read(shard_squares(picked, [grads[i] for i in bad], record.world_size))  # type: ignore[misc]
            squares = list(squares)
            for i, value in zip(bad, refined):
                squares[i] = value
        exact = [math.sqrt(v) for v in squares]
        if bad:
            statuses = [norm_status(f, e) for f, e in zip(fast_host, exact)]
            record.grad_status = "nonfinite" if "nonfinite" in statuses else "overflow"
        record.grad_norms = fast.to(record.device, non_blocking=True)
        record.exact_grad_norms = exact
        record.total_norm = math.sqrt(sum(squares))

    def _apply(
        self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer, record: StepHealth, action: StepAction
    ) -> None:
        if action.skip_reason is not None:
            record.skipped, record.skip_reason = True, action.skip_reason
            skip_step(trainer, optimizer, self._held, self._buffers, self._epoch_sums, self._metric_copy)
            self._closure_start.skipped(optimizer)
            self._skipped_in_batch = True
        else:
            for _, plan in action.clips:
                for tensors, coef in plan.scales:
                    if isinstance(coef, float):
                        scale_grads_(tensors, coef)
                    else:
                        torch._foreach_mul_(tensors, coef)
        self._window_open = False  # the accumulation window ends with this step

    # ---- summary ----------------------------------------------------------------------------------------------
    def note_replaced_weights(self, trainer: pl.Trainer) -> None:
        """When the fit's end said something of the weights it ended with (:data:`_OF_THE_WEIGHTS`), and another
        callback put other weights into the model after that (one that reloads the best checkpoint when training
        ends), say that those words are not of the weights the fit returns (every rank alike: same weights)."""
        said, self._said_of_weights = self._said_of_weights, None
        if said is None or checksum(effective_weights(trainer.lightning_module)).tolist() == said:
            return
        message = ("after the fit's last step another callback put other weights into the model (one that reloads "
                   "the best checkpoint when training ends, as scvi-tools' SaveCheckpoint(load_best_on_end=True) and "
                   "GluonTS do): what is said above of the weights the fit ended with is not of the weights it "
                   "returns")  # fmt: skip
        self._note_at_end(trainer, "weights_replaced", (message, {}))

    def summarise(self, trainer: pl.Trainer) -> None:
        """The fit in plain words at its end, one line per finding, when anything happened (rank 0 only; once)."""
        if self._summarised:
            return
        self._summarised = True
        lines = plain_lines(asdict(e) for e in self.journal.events)
        if lines and trainer.global_rank == 0:
            path = self.journal.path
            # A logger's run folder holds this journal alone; without a logger, the folder is the root of everything.
            where = ""
            if path is not None and self.journal.write:  # not one that could not be written
                where = f" (the details: python -m lightning_overflow journal {path.parent if trainer.loggers else path})"
            log.info("\n".join([f"lightning_overflow: what happened in this fit{where}:", *(f"  - {l}" for l in lines)]))


_OF_THE_WEIGHTS = ("behind", "ending", "schedule_behind")  # what the fit's end says of the weights it ended with


@dataclass(slots=True)
class _StepPlan:
    """What the board keeps from one step of an optimizer to the next: the parameters that have gradients (``ids``),
    their names, the optimizer's index, the process's rank, and how the gradients' norms are computed.

    A parameter's gradient keeps its layout, dtype and device from step to step (autograd gives it the parameter's),
    so whether the checks of :func:`~lightning_overflow.numerics.tensor_norms` can be left out
    (:func:`~lightning_overflow.numerics.norms.plain_cpu`) is asked when the plan is made."""

    ids: list[int]
    params: list[Tensor]
    names: tuple[str, ...]
    index: int
    n_optimizers: int
    rank: int
    world_size: int
    sharded: bool
    plain: bool
    scaler: Any
    float64: bool  # every gradient is float64


def inspect_state(trainer: pl.Trainer, record: StepHealth) -> StateCheck:
    """Check the module state (parameters and buffers, less the buffers' constants) and the record's optimizer
    state on every rank, by the one rule of :mod:`lightning_overflow.training_state` (kept on the record).

    Entered on every rank together (callers decide from values identical on all ranks): one all-reduce.
    """
    if record.state_check is None:
        module = trainer.lightning_module
        record.state_check = check_state(
            board_for(trainer).state_before_step(module),
            [own_optimizer_state(record.optimizer)],
            board_for(trainer).constants(trainer),
            record.device,
            lambda: optimizer_labels(module, [own_optimizer(record.optimizer)]),
        )
    return record.state_check


def state_flags(trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> tuple[Tensor, Tensor]:
    """This rank's device flags for non-finite module state and optimizer state (no read), by the same rule: a first
    look (a sum of each tensor, never missing inf/NaN), which :func:`inspect_state` decides when it is raised."""
    board = board_for(trainer)
    model_state = board.state_before_step(trainer.lightning_module)
    return nonfinite_flags(model_state, [own_optimizer_state(optimizer)], board.constants(trainer), suspect=True)


def finite_checked_monitors(trainer: pl.Trainer) -> list[str]:
    """What the ``EarlyStopping`` callbacks that stop on a non-finite value (``check_finite``, their default)
    monitor: a skipped step's inf/NaN loss can reach them."""
    return [
        str(cb.monitor)
        for cb in trainer.callbacks  # type: ignore[attr-defined]
        # A library's own subclass too (scvi-tools' LoudEarlyStopping), of either Lightning package's class.
        if any(cls.__name__ == "EarlyStopping" for cls in type(cb).__mro__) and getattr(cb, "check_finite", False)
    ]


def skipped_loss_route(trainer: pl.Trainer, monitor: str) -> str | None:
    """How a skipped step's inf/NaN loss reaches ``monitor``, a metric a training hook logs, in words; ``None`` where
    it does not: a tensor summed over the epoch, whose skipped steps the skip takes out of the epoch's mean, or a
    torchmetrics ``Metric`` the module holds, whose state the skip puts back (:func:`~lightning_overflow.skip.skip_step`;
    under manual optimization, the sums and states a batch with a skipped step made inf/NaN, at its end)."""
    if _compat.summed_in_training(trainer, monitor):
        return None
    metrics = _compat.logged_metric_objects(trainer, monitor)
    held = {id(m) for m in trainer.lightning_module.modules()}
    if metrics and all(id(m) in held for m in metrics):
        return None
    if _compat.logged_per_step_only(trainer, monitor):
        return ("per step only (self.log(...) in training_step, whose default is on_epoch=False): it holds the value "
                "of the last step before the check, inf/NaN where that step was skipped")  # fmt: skip
    return ("through state of its own (a value computed at the epoch's end, or a torchmetrics Metric the module does "
            "not hold as a submodule)")  # fmt: skip


def _early_stops_on_nonfinite(trainer: pl.Trainer) -> list[tuple[str, dict[str, Any]]]:
    """The monitors of ``EarlyStopping`` callbacks that stopped this fit on a value that is not finite: a run the
    suite kept alive can still be ended by a metric its skipped steps made inf/NaN, and that ending is said."""
    found: list[tuple[str, dict[str, Any]]] = []
    if not trainer.should_stop:
        return found
    for monitor in finite_checked_monitors(trainer):
        value = _compat.callback_metrics(trainer).get(monitor)
        number = float(value) if value is not None else math.nan
        if math.isfinite(number):
            continue
        if _compat.logged_in_training(trainer, monitor):
            route = skipped_loss_route(trainer, monitor) or "from a training hook"
            why = (f"{monitor!r} is logged {route}: log the loss tensor with self.log(..., on_epoch=True) and monitor "
                   "that (a skipped step's value is left out of the epoch's mean), log only finite values, or pass "
                   "EarlyStopping(check_finite=False)")  # fmt: skip
        else:  # validation computed it on the weights as they are: no skipped step's loss is in it
            why = (f"{monitor!r} is not logged by a training hook: the model gave it on its weights as they were, "
                   "which is no skipped step's doing; look at the data it was computed on and at the model's "
                   "outputs")  # fmt: skip
        message = (
            f"EarlyStopping(monitor={monitor!r}) stopped the fit at step {trainer.global_step} because {monitor!r} "
            f"was {number:g}, not finite: the weights returned are those of that step. {why}"
        )
        found.append((message, {"monitor": monitor, "value": number}))
    return found


def _refuse_a_second(participant: StepParticipant, joined: Sequence[StepParticipant], owner: str) -> None:
    """Some callbacks act on the whole run (every optimizer's gradients, every LR, the whole state): two of one
    class would clip twice, back off twice or restore twice, and log into each other's keys. ``owner``: whose
    ``callbacks`` argument (``"Trainer"``, a plain loop's ``"Guard"``)."""
    if not getattr(participant, "one_per_trainer", False):
        return
    name = type(participant).__name__
    for other in joined:
        if type(other).__name__ == name:
            raise ValueError(
                f"{owner}(callbacks=...) has two {name} callbacks ({other.state_key} and {participant.state_key}): "
                f"{name} acts on the whole run, so two of them would act twice on every step and log into the same "
                f"keys. Keep one {name}."
            )


def _index_of(items: Sequence[Any], item: Any) -> int:
    for i, candidate in enumerate(items):
        if candidate is item:
            return i
    return 0
