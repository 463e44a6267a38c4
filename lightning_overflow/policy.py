"""What the suite does with one optimizer step, decided in one place from every participant's verdict.

Each suite callback judges the same final step record and may return a :class:`Verdict`: a reason to skip the
step, a proposed clip, or both. :func:`decide_step` turns all of them into one :class:`StepAction`, applied once by
the pipeline. The rules, in order:

==========================================  ====================================================================
rule                                        reason
==========================================  ====================================================================
any skip request wins                       a step that a detector found non-finite must not move the weights,
                                            whatever a clipper proposed for it
the first skip request (pipeline order)     one skip is journaled and counted once, by the participant that
is the one recorded                         asked first (detectors come before interventions)
without a skip, every clip is applied       each clipper owns its own optimizer's gradients (two ``AutoClip``
                                            on two optimizers never meet on one step)
==========================================  ====================================================================

Free of Lightning: the pipeline (:mod:`lightning_overflow.health`) calls it with plain values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

__all__ = ["ClipPlan", "StepAction", "Verdict", "decide_step"]


@dataclass
class ClipPlan:
    """Gradients to scale, and by what: ``(tensors, coefficient)`` pairs, where a coefficient is a host float (one
    for all the tensors of the pair) or a device tensor of per-tensor factors.

    Attributes:
        scales: the scaling operations, applied in order.
        coef: the overall coefficient for telemetry (1.0 = untouched).
        threshold: the threshold applied (for telemetry).
    """

    scales: list[tuple[list[Tensor], float | list[Tensor]]]
    coef: float
    threshold: float


@dataclass(frozen=True)
class Verdict:
    """One participant's judgement of one optimizer step.

    Attributes:
        skip: why the step must be a no-op (``None``: no objection).
        clip: a proposed clip of the gradients (``None``: none).
    """

    skip: str | None = None
    clip: ClipPlan | None = None


@dataclass
class StepAction:
    """The decision for one optimizer step.

    Attributes:
        skip_reason: why the step is skipped (``None``: it goes ahead).
        skipped_by: the participant whose request is recorded (``None`` when not skipped).
        clips: the clips to apply, with the participant that proposed each (empty when skipped).
    """

    skip_reason: str | None = None
    skipped_by: Any = None
    clips: list[tuple[Any, ClipPlan]] = field(default_factory=list)

    @property
    def skipped(self) -> bool:
        return self.skip_reason is not None

    def clip_of(self, participant: Any) -> ClipPlan | None:
        """The clip applied on behalf of ``participant`` (``None`` if it proposed none or the step was skipped)."""
        for owner, plan in self.clips:
            if owner is participant:
                return plan
        return None


def decide_step(verdicts: Sequence[tuple[Any, Verdict | None]]) -> StepAction:
    """One action from the verdicts of every participant, given in pipeline order."""
    for participant, verdict in verdicts:
        if verdict is not None and verdict.skip is not None:
            return StepAction(skip_reason=verdict.skip, skipped_by=participant)
    clips = [(p, v.clip) for p, v in verdicts if v is not None and v.clip is not None]
    return StepAction(clips=clips)
