"""Replay a non-finite training step in Lightning: every rank re-runs its batch under the tracer, then the ranks
combine what they saw (Megatron's rerun idea, inside the Trainer).

The replay runs ``training_step`` on the plain LightningModule, never on the DDP wrapper, so that DDP's gradient
all-reduce does not run inside it (a ``training_step`` that itself calls collectives, such as ``self.all_gather`` or
SyncBatchNorm, still runs them, on every rank together, since every rank replays), and differentiates with ``torch.autograd.grad``, so that ``.grad`` and DDP's reducer are left alone. It
runs with the random streams the step started with (the same dropout masks) and puts back afterwards every random
stream, the buffers (BatchNorm statistics), metric states and the module's Python attributes (what ``training_step``
appended, counted or wrote: :mod:`lightning_overflow.preserve`); ``self.log`` is silenced while it runs, and
:func:`~lightning_overflow.side_run` answers ``"replay"``. Every rank
enters :func:`diagnose_step` together (the decision to diagnose comes from the shared step record), and the ranks'
results are combined with one ``all_gather_object``.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from torch import Tensor

from lightning_overflow import _compat
from lightning_overflow.diagnosis.hints import HUGE_INPUT, batch_hint, origin_hint
from lightning_overflow.diagnosis.records import Diagnosis, Replay, Trace
from lightning_overflow.diagnosis.tracer import NonFiniteTracer, floating_tensors
from lightning_overflow.distributed import world
from lightning_overflow.numerics import tensor_norms
from lightning_overflow.numerics._float64 import summed_loss
from lightning_overflow.preserve import RngState, preserved_state
from lightning_overflow.training_step import loss_of, signature_parameters, silenced_logging, takes_batch_idx

__all__ = ["BatchStats", "KeptBatch", "bad_values_zeroed", "batch_stats", "diagnose_step", "replay_batch"]

MAX_ROWS = 8  # sample rows named in a diagnosis: enough to find a corrupt sample, few enough to read


@dataclass(frozen=True)
class BatchStats:
    """What a batch holds: its largest finite magnitude, its NaN and inf counts, and the first ``MAX_ROWS`` sample
    rows (indices along the first dimension of its tensors of one row per sample) that hold inf/NaN or values beyond
    ``HUGE_INPUT``."""

    magnitude: float = 0.0
    nan: int = 0
    inf: int = 0
    rows: tuple[int, ...] = ()


@dataclass(frozen=True)
class KeptBatch:
    """What the detector keeps at the start of every batch to be able to replay it: no tensor copied.

    Attributes:
        batch: the batch as ``training_step`` receives it (on the device), its containers copied
            (:func:`~lightning_overflow.preserve.batch_copy`).
        batch_idx: its index.
        rng: the torch random streams when the batch started.
    """

    batch: Any
    batch_idx: int
    rng: RngState


def not_replayable(trainer: pl.Trainer, pl_module: pl.LightningModule, kept: KeptBatch | None) -> str:
    """Why this step cannot be replayed (empty when it can)."""
    unavailable = getattr(pl_module, "replay_unavailable", "")  # the plain loop's Guard: it never sees the batch
    if unavailable:
        return str(unavailable)
    if not pl_module.automatic_optimization:
        return (
            "manual optimization: this step's forward and backward ran inside training_step together with the other "
            "optimizers' steps, and re-running training_step would step them again; check the loss of each "
            "manual_backward instead"
        )
    if "dataloader_iter" in signature_parameters(pl_module.training_step):
        return "training_step takes the dataloader_iter: it consumed the batch from an iterator the callback cannot see"
    if not _compat.replicated_strategy(trainer.strategy):
        return f"{type(trainer.strategy).__name__} is not replayed (the replay needs the whole model on every rank)"
    if kept is None:
        return "the batch of this step was not kept"
    return ""


def replay_batch(trainer: pl.Trainer, pl_module: pl.LightningModule, kept: KeptBatch | None) -> Replay:
    """Re-run this rank's batch under :class:`~lightning_overflow.diagnosis.tracer.NonFiniteTracer`. Local: no
    collective. Never raises: a failed replay is reported in :attr:`Replay.error`."""
    rank = int(trainer.global_rank)
    reason = not_replayable(trainer, pl_module, kept)
    if reason:
        return Replay(rank, replayed=False, reason=reason)
    assert kept is not None
    stats = batch_stats(kept.batch)
    batch = {"batch_idx": kept.batch_idx, "batch_magnitude": stats.magnitude, "batch_nonfinite": stats.nan + stats.inf,
             "batch_nan": stats.nan, "batch_rows": stats.rows}  # fmt: skip
    error = ""
    for module_backward_hooks in (True, False):  # full backward hooks reject in-place ops on module outputs
        try:
            trace = _traced_step(trainer, pl_module, kept, module_backward_hooks)
        except _NoLoss:
            return Replay(rank, False, reason="training_step returned no loss on replay", **batch)
        except Exception as caught:  # the diagnosis must never take the run down with it
            error = f"{type(caught).__name__}: {caught}"
            continue
        return Replay(rank, True, trace=trace, **batch)
    return Replay(rank, False, error=error, **batch)


def diagnose_step(
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    kept: KeptBatch | None,
    step: int,
    observed_ranks: tuple[int, ...],
    updated: bool = True,
) -> Diagnosis:
    """Replay on every rank and combine. Every rank must call it together (it ends with one collective).
    ``updated``: an optimizer step has moved the weights since they were drawn (a growth then points at the rate).

    Where a rank's batch holds inf/NaN or values beyond ``HUGE_INPUT`` and its replay reproduced the fault, every rank
    replays once more, that rank with those values set to 0: inf/NaN again, and they are not what broke the step (a
    model that masks missing values); finite, and they are. Every rank replays twice or none does, so that the
    collectives a ``training_step`` calls are met on every rank."""
    replays = _gather(replay_batch(trainer, pl_module, kept))
    if any(r.suspects_batch for r in replays):  # the gathered replays: alike on every rank
        mine = next(r for r in replays if r.rank == int(trainer.global_rank))
        harmless = replace(mine, batch_harmless=_still_nonfinite_without_bad_values(trainer, pl_module, kept, mine))
        replays = _gather(harmless)
    accumulation = int(trainer.accumulate_grad_batches) if pl_module.automatic_optimization else 1
    return combine(step, replays, observed_ranks, accumulation, updated)


def combine(
    step: int, replays: list[Replay], observed_ranks: tuple[int, ...], accumulation: int = 1, updated: bool = True
) -> Diagnosis:
    """The verdict and the sentence from every rank's replay (identical on every rank: same inputs)."""
    replayed = any(r.replayed for r in replays)
    reproduced = tuple(r.rank for r in replays if r.reproduced)
    failed = [r for r in replays if not r.replayed]
    reason = ""
    if reproduced:
        verdict = "persistent"
    elif not replayed:
        verdict = "unknown"
        reason = failed[0].reason or f"the replay failed ({failed[0].error})"
    elif failed:
        verdict = "unknown"
        bad = failed[0]
        reason = f"rank {bad.rank} could not replay its batch ({bad.reason or bad.error})"
    elif accumulation > 1:
        verdict = "unknown"
        reason = f"only the last of the {accumulation} accumulated micro-batches was replayed, and it stayed finite"
    else:
        verdict = "transient"
    first = _first(reproduced, observed_ranks)
    chosen = next((r for r in replays if r.rank == first), None)
    trace = chosen.trace if chosen is not None else None
    origin = trace.origin if trace is not None else None
    overflow = trace is not None and origin is None and trace.beyond_fp32
    hint = ""
    if chosen is not None and trace is not None:
        growth = trace.growth if origin is None or origin.source == "op" else None
        # The data first: an op that overflowed on a corrupt sample is not the op's fault.
        hints = [batch_hint(chosen.batch_nonfinite, chosen.batch_magnitude) if chosen.blames_batch else "",
                 origin_hint(origin, growth, overflow, first_step=not updated)]  # fmt: skip
        hint = "; ".join(h for h in hints if h)
    message = _message(verdict, reason, chosen, replays, reproduced, observed_ranks)
    return Diagnosis(
        step=step,
        verdict=verdict,  # type: ignore[arg-type]
        replayed=replayed,
        reason=reason,
        origin=origin,
        origin_rank=first,
        reproduced_ranks=reproduced,
        observed_ranks=tuple(observed_ranks),
        overflow=overflow,
        hint=hint,
        message=message,
        replays=tuple(replays),
    )


# ---- the sentence -------------------------------------------------------------------------------------------------
def _message(
    verdict: str,
    reason: str,
    chosen: Replay | None,
    replays: list[Replay],
    reproduced: tuple[int, ...],
    observed: tuple[int, ...],
) -> str:
    if verdict == "unknown" and not reproduced:
        return f"Diagnosis: transient or persistent is unknown: {reason}."
    distributed = len(replays) > 1
    if verdict == "transient":
        finite = [r.trace for r in replays if r.trace is not None]
        values = ", ".join(f"loss {t.loss:.4g}, gradient norm {t.grad_norm:.4g}" for t in finite[:1])
        seen = f" It was seen on rank(s) {_ranks(observed)} only." if distributed and observed else ""
        return (
            f"Diagnosis: transient: the replay of this batch on the same weights stayed finite ({values}); a hardware "
            f"fault, a nondeterministic kernel or a race, not the data or the model.{seen}"
        )
    assert chosen is not None and chosen.trace is not None
    trace = chosen.trace
    parts = [_cause(trace)]
    if trace.growth is not None:
        parts.append(trace.growth.describe())
    if chosen.blames_batch:
        parts.append(chosen.describe_batch())
    elif chosen.describe_batch():
        parts.append(f"{chosen.describe_batch()}, not the cause: set to 0, the replay was inf/NaN all the same")
    sentence = "; ".join(parts)
    text = (
        f"Diagnosis: {sentence}. Persistent: the replay of this batch on the same weights reproduces it (the data or "
        f"the model, not the hardware)."
    )
    if distributed:
        others = [r.rank for r in replays if r.rank not in reproduced]
        text += f" First seen on rank {chosen.rank}"
        more = [r for r in reproduced if r != chosen.rank]
        text += f" (also on rank(s) {_ranks(more)})" if more else ""
        text += f"; the replay on rank(s) {_ranks(others)} stayed finite." if others else "."
    return text


def _cause(trace: Trace) -> str:
    origin = trace.origin
    if origin is not None:
        return origin.describe()
    if trace.beyond_fp32:
        largest = trace.largest_gradient
        which = f", the largest being {largest[0]} (norm {largest[1]:.3g})" if largest else ""
        return (
            f"no value became inf/NaN: the gradients are finite{which}, but their total norm {trace.grad_norm:.3g} "
            f"lies beyond FP32, so its square overflows (an overflow of the squared norm, not NaN)"
        )
    return f"the replay's loss was {trace.loss:.4g} and its gradient norm {trace.grad_norm:.4g}, no single op named"


def _ranks(ranks: Any) -> str:
    return ", ".join(str(r) for r in ranks)


def _first(reproduced: tuple[int, ...], observed: tuple[int, ...]) -> int | None:
    """The rank to report: one that both observed the fault and reproduced it, else the lowest that reproduced."""
    for rank in reproduced:
        if rank in observed:
            return rank
    return reproduced[0] if reproduced else None


# ---- the replay itself --------------------------------------------------------------------------------------------
class _NoLoss(Exception):
    pass


def _still_nonfinite_without_bad_values(
    trainer: pl.Trainer, pl_module: pl.LightningModule, kept: KeptBatch | None, replay: Replay
) -> bool:
    """Replay the batch with its inf/NaN and values beyond ``HUGE_INPUT`` set to 0 (in place, put back bit for bit
    afterwards): whether its loss or gradients are inf/NaN all the same. A rank whose batch is sound replays it as it
    is, to meet the others' collectives, and answers ``False``; so does a replay that fails."""
    if kept is None or not replay.replayed:
        return False
    suspect = replay.suspects_batch
    try:
        with bad_values_zeroed(kept.batch if suspect else ()):
            trace = _traced_step(trainer, pl_module, kept, module_hooks=False)
    except Exception:  # the diagnosis must never take the run down with it: the batch stays blamed
        return False
    # The loss and the gradients, not an intermediate NaN the step masks itself (SCANVI divides by a count of 0).
    return suspect and (not (trace.loss_finite and trace.grads_finite) or trace.beyond_fp32)


@contextlib.contextmanager
def bad_values_zeroed(batch: Any) -> Iterator[bool]:
    """The batch with its inf/NaN and values beyond ``HUGE_INPUT`` set to 0, in place, and put back bit for bit
    afterwards; yields whether it held any."""
    saved: list[tuple[Tensor, Tensor]] = []
    try:
        with torch.no_grad():
            for t in floating_tensors(batch):
                bad = ~torch.isfinite(t) | (t.abs() > HUGE_INPUT)
                if bool(bad.any()):
                    saved.append((t, t.clone()))
                    t.masked_fill_(bad, 0.0)
        yield bool(saved)
    finally:
        with torch.no_grad():
            for t, original in saved:
                t.copy_(original)


def _traced_step(trainer: pl.Trainer, pl_module: pl.LightningModule, kept: KeptBatch, module_hooks: bool) -> Trace:
    params = [p for p in pl_module.parameters() if p.requires_grad]
    names = [n for n, p in pl_module.named_parameters() if p.requires_grad]
    args = (kept.batch, kept.batch_idx) if takes_batch_idx(pl_module) else (kept.batch,)
    scaler = _compat.scaler_of(trainer)
    # Eager, under torch.compile too: the tracer's hooks read every output, which would break a compiled graph at
    # each module (dynamo warns at every break) and fuse the ops it names.
    with preserved_state(pl_module, kept.rng), silenced_logging(pl_module), torch.enable_grad():
        with (
            torch.compiler.set_stance("force_eager"),
            NonFiniteTracer(_traced(pl_module), module_backward_hooks=module_hooks) as tracer,
        ):
            with trainer.precision_plugin.train_step_context():
                output = pl_module.training_step(*args)
            loss = loss_of(output)
            if loss is None:
                raise _NoLoss
            value = float(summed_loss(loss))
            # Under 16-mixed the backward ran on the scaled loss; replay it the same way (scale() changes nothing).
            tracer.backward(scaler.scale(loss) if scaler is not None else loss, params)
            return _named_outside(replace(tracer.trace(names), loss=value), getattr(pl_module, "replay_step_code", ""))


def _named_outside(trace: Trace, step_code: str) -> Trace:
    """The trace with its origins' code outside every module called ``step_code`` (a plain loop's ``loss_fn``)."""
    if not step_code:
        return trace
    origins = {
        name: replace(origin, outside=step_code)
        for name in ("forward_origin", "backward_origin")
        if (origin := getattr(trace, name)) is not None
    }
    return replace(trace, **origins)


def _traced(pl_module: Any) -> torch.nn.Module:
    """The module whose layers the tracer hooks: the LightningModule, or the plain loop's module behind the object
    that stands for one (:class:`~lightning_overflow.guard.Guard`'s, its ``traced_module``)."""
    return pl_module if isinstance(pl_module, torch.nn.Module) else pl_module.traced_module


def batch_stats(batch: Any) -> BatchStats:
    """The largest finite magnitude in the batch, its inf/NaN counts, and the sample rows (along the first
    dimension) that hold inf/NaN or values beyond ``HUGE_INPUT``.

    Rows are sample rows only in the tensors whose first dimension is the batch's number of samples: the length most
    of its tensors share (a graph batch also holds one row per atom or per edge, which names no sample). A bad value
    in another tensor is counted, its row not named.
    """
    tensors = [t for t in floating_tensors(batch) if t.numel()]
    if not tensors:
        return BatchStats()
    lengths = Counter(len(t) for t in tensors if t.dim())
    ranked = lengths.most_common(2)
    samples = ranked[0][0] if ranked and (len(ranked) == 1 or ranked[0][1] > ranked[1][1]) else None
    magnitude, nan, inf = 0.0, 0, 0
    rows: set[int] = set()
    with torch.no_grad():
        for t in tensors:
            finite = torch.isfinite(t)
            size = torch.where(finite, t.abs(), torch.zeros((), dtype=t.dtype, device=t.device))
            counts = torch.stack([size.amax().double(), t.isnan().sum().double(), (~finite).sum().double()]).tolist()
            magnitude, nan, inf = max(magnitude, counts[0]), nan + int(counts[1]), inf + int(counts[2] - counts[1])
            if t.dim() and len(t) == samples and (counts[2] or counts[0] > HUGE_INPUT):
                bad = (~finite) | (size > HUGE_INPUT)
                rows.update(bad.reshape(len(t), -1).any(dim=1).nonzero().flatten().tolist())
    return BatchStats(magnitude if math.isfinite(magnitude) else 0.0, nan, inf, tuple(sorted(rows)[:MAX_ROWS]))


def holds_bad_values(batch: Any) -> Tensor | None:
    """Whether ``batch`` holds inf/NaN or values beyond ``HUGE_INPUT``, as a 0-d bool device tensor (no host read;
    one pass over each tensor); ``None`` for a batch without floating tensors. What :func:`batch_stats` names, told apart where
    only a flag is kept (the micro-batches of an accumulation window before its last, which the replay sees).

    Example:
        >>> holds_bad_values({"x": torch.ones(2), "y": torch.tensor([1.0, float("nan")])})
        tensor(True)
    """
    tensors = [t for t in floating_tensors(batch) if t.numel()]
    if not tensors:
        return None
    # The largest |value| of each tensor (aminmax: one read, no copy; NaN stays NaN), and NaN compares False: one
    # comparison finds inf, NaN and huge values alike.
    return tensor_norms(tensors, math.inf).le(HUGE_INPUT).all().logical_not()


def _gather(local: Replay) -> list[Replay]:
    """Every rank's replay, by rank: one collective that every rank enters together."""
    world_size = world()[1]
    if world_size == 1:
        return [local]
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, local)
    return sorted(gathered, key=lambda r: r.rank)
