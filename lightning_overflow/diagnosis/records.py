"""What a diagnosis found, as plain frozen records (primitives only: they pickle, gather across ranks and go into JSON).

``Origin`` is one place where a value first became non-finite; ``Growth`` a magnitude that grows layer after layer;
``Trace`` what one traced forward and backward pass showed; ``Replay`` what one rank's replay of its batch showed;
``Diagnosis`` all ranks together, with the verdict (transient or persistent), the sentence and the hint.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from lightning_overflow.numerics import FP32_MAX

HUGE_INPUT = 1e15
"""A batch value above this is no normalised input (its square is 1e30: a few such products reach the FP32 limit)."""

__all__ = ["Diagnosis", "Growth", "Origin", "Replay", "Trace"]

Direction = Literal["forward", "backward"]
Source = Literal["op", "input", "gradient_hook"]
Verdict = Literal["persistent", "transient", "unknown"]

OUTSIDE = "training_step"
"""The name reported for values computed outside every module (the loss written in ``training_step``)."""


@dataclass(frozen=True)
class Origin:
    """Where a value first became inf/NaN.

    Attributes:
        direction: ``"forward"`` (an activation, the loss) or ``"backward"`` (a gradient).
        source: ``"op"``: the op produced it from finite inputs; ``"input"``: it came into the op already non-finite
            (from the batch, a constant, or a tensor computed outside the traced model); ``"gradient_hook"``: every
            backward op was finite and the parameter's gradient became non-finite afterwards (a tensor hook).
        module: the qualified module name (``named_modules()``), ``""`` for the root module, ``None`` outside every
            module (the loss computed in ``training_step``).
        module_type: the module's class name (``None`` outside every module).
        op: the torch function (forward: ``"exp"``, ``"linear"``) or the autograd node (backward: ``"PowBackward0"``).
        kind: ``"nan"`` if any NaN appeared, ``"inf"`` if only infinities.
        input_magnitude: the largest finite magnitude that went into the op (incoming gradients in backward).
        output_magnitude: the largest finite magnitude that came out of it.
        nan_count, inf_count, numel: how many of the op's output values were NaN, inf, and in all.
        parameter: for ``source="gradient_hook"``, the parameter whose gradient became non-finite.
        outside: what the message calls the code outside every module: ``training_step``, or a plain loop's
            ``loss_fn`` (:class:`~lightning_overflow.guard.Guard`).
    """

    direction: Direction
    source: Source
    module: str | None
    module_type: str | None
    op: str
    kind: Literal["nan", "inf"]
    input_magnitude: float
    output_magnitude: float
    nan_count: int
    inf_count: int
    numel: int
    parameter: str | None = None
    outside: str = OUTSIDE

    @property
    def where(self) -> str:
        """``layers.3 (Planted)``, ``the root module (Net)`` or ``training_step (outside every module)``."""
        if self.module is None:
            return f"{self.outside} (outside every module)"
        if self.module == "":
            return f"the root module ({self.module_type})"
        return f"{self.module} ({self.module_type})"

    def describe(self) -> str:
        """The origin as a clause: where, which op, what came out, from what magnitudes."""
        values = " and ".join(f"{what} in {n}" for what, n in (("NaN", self.nan_count), ("inf", self.inf_count)) if n)
        values = f"{values} of {self.numel} values"
        if self.source == "gradient_hook":
            return (
                f"every backward op produced finite values, then the gradient of {self.parameter} became non-finite "
                f"({values}): a gradient hook on that parameter did it"
            )
        if self.source == "input":
            return (
                f"the first non-finite value of the {self.direction} pass came in from outside the model's ops (the "
                f"batch, a constant, or a tensor computed elsewhere) at op {self.op} in {self.where} ({values})"
            )
        incoming = "incoming gradients" if self.direction == "backward" else "inputs"
        return (
            f"the first non-finite value appeared in the {self.direction} pass in {self.where}, op {self.op} "
            f"({values}), from {incoming} of magnitude up to {self.input_magnitude:.3g}"
        )


@dataclass(frozen=True)
class Growth:
    """A magnitude growing layer after layer (activations in forward, gradients in backward).

    Attributes:
        direction: ``"forward"`` (activations) or ``"backward"`` (gradients).
        layers: how many parametrised layers the growth spans.
        first, last: the modules at both ends (in execution order).
        first_magnitude, last_magnitude: their largest output magnitudes.
        factor: the geometric-mean growth per layer.
    """

    direction: Direction
    layers: int
    first: str
    last: str
    first_magnitude: float
    last_magnitude: float
    factor: float

    def describe(self) -> str:
        what = "activations" if self.direction == "forward" else "gradients"
        return (
            f"the {what} grew about {self.factor:.3g}x per layer through {self.layers} layers ({self.first}: "
            f"{self.first_magnitude:.3g} -> {self.last}: {self.last_magnitude:.3g})"
        )


@dataclass(frozen=True)
class Trace:
    """What one traced forward and backward pass showed.

    Attributes:
        forward_origin: where the first non-finite activation or loss value appeared (``None``: none did).
        backward_origin: where the first non-finite gradient appeared (``None``: none did, or the forward pass
            already was non-finite).
        loss: the loss value (``nan``/``inf`` when it was non-finite).
        grad_norm: the exact total gradient norm (float64; beyond the FP32 range where the squares overflowed).
        nonfinite_gradients: the parameters whose gradient holds inf/NaN (the first 20; their weights may well be
            finite).
        largest_gradient: the parameter with the largest gradient norm and that norm.
        forward_growth, backward_growth: a magnitude growing through the depth of the model, if any.
    """

    forward_origin: Origin | None
    backward_origin: Origin | None
    loss: float
    grad_norm: float
    nonfinite_gradients: tuple[str, ...] = ()
    largest_gradient: tuple[str, float] | None = None
    forward_growth: Growth | None = None
    backward_growth: Growth | None = None

    @property
    def origin(self) -> Origin | None:
        """The earliest origin: forward before backward."""
        return self.forward_origin or self.backward_origin

    @property
    def loss_finite(self) -> bool:
        return math.isfinite(self.loss)

    @property
    def grads_finite(self) -> bool:
        return not self.nonfinite_gradients and not math.isnan(self.grad_norm)

    @property
    def beyond_fp32(self) -> bool:
        """Finite gradients whose norm cannot be represented in FP32."""
        return self.grads_finite and self.grad_norm > FP32_MAX

    @property
    def nonfinite(self) -> bool:
        """What the detector would have flagged: a non-finite loss or gradient, or a norm beyond FP32."""
        return not self.loss_finite or not self.grads_finite or self.beyond_fp32 or self.origin is not None

    @property
    def growth(self) -> Growth | None:
        return self.forward_growth or self.backward_growth


@dataclass(frozen=True)
class Replay:
    """One rank's replay of its batch.

    Attributes:
        rank: the global rank.
        replayed: whether the batch was replayed (see ``reason`` when not).
        reason: why it was not replayed, or why the verdict stays unknown (empty otherwise).
        error: the exception the replay raised, as ``Type: message`` (empty otherwise).
        trace: what the replay showed (``None`` when not replayed or when it failed).
        batch_idx: the batch's index within its epoch (``None`` when the batch was not kept).
        batch_magnitude: the largest finite magnitude in the batch's floating-point tensors.
        batch_nonfinite: how many inf/NaN values the batch holds.
        batch_nan: how many of those are NaN.
        batch_rows: the first sample rows (indices along the first dimension) that hold inf/NaN or values beyond
            ``HUGE_INPUT``.
        batch_harmless: those values were set to 0 and the replay was inf/NaN all the same: they are not what broke
            the step (a model that masks missing values, as chemprop masks its NaN targets).
    """

    rank: int
    replayed: bool
    reason: str = ""
    error: str = ""
    trace: Trace | None = None
    batch_idx: int | None = None
    batch_magnitude: float = 0.0
    batch_nonfinite: int = 0
    batch_nan: int = 0
    batch_rows: tuple[int, ...] = ()
    batch_harmless: bool = False

    def describe_batch(self) -> str:
        """What is wrong with the batch, in words (``"batch 11 holds NaN in row 3"``); empty when nothing is."""
        parts = []
        if self.batch_nonfinite:
            inf = self.batch_nonfinite - self.batch_nan
            what = " and ".join(f"{n} {word}" for n, word in ((self.batch_nan, "NaN"), (inf, "inf")) if n)
            parts.append(what.replace("1 NaN", "NaN").replace("1 inf", "inf") if self.batch_nonfinite == 1 else what)
        if self.batch_magnitude > HUGE_INPUT:
            parts.append(f"values up to {self.batch_magnitude:.3g}")
        if not parts:
            return ""
        what = " and ".join(parts)
        where = f"batch {self.batch_idx}" if self.batch_idx is not None else "the batch"
        rows = ""
        if self.batch_rows:
            rows = f" in row{'s' if len(self.batch_rows) > 1 else ''} {', '.join(map(str, self.batch_rows))}"
        return f"{where} holds {what}{rows}"

    @property
    def reproduced(self) -> bool:
        return self.trace is not None and self.trace.nonfinite

    @property
    def suspects_batch(self) -> bool:
        """Whether the replay reproduced the fault on a batch holding bad values: whether they broke it is to be
        tried (:func:`~lightning_overflow.diagnosis.replay.diagnose_step`)."""
        return self.reproduced and bool(self.describe_batch())

    @property
    def blames_batch(self) -> bool:
        """Whether the batch's bad values are the fault's cause: it holds some, and they were not found harmless."""
        return bool(self.describe_batch()) and not self.batch_harmless


@dataclass(frozen=True)
class Diagnosis:
    """Why an optimizer step was non-finite, from a replay of its batch on every rank.

    Attributes:
        step: the ``global_step`` of the optimizer step concerned.
        verdict: ``"persistent"`` (the replay on the same batch and weights reproduces it: data or model),
            ``"transient"`` (it does not: hardware, a nondeterministic kernel, a race) or ``"unknown"`` (no replay
            was possible, or it covered only part of the step: see ``reason``).
        replayed: whether any rank replayed its batch.
        reason: why there was no (complete) replay; empty when there was.
        origin: where the value first became non-finite, on the first rank that reproduced it.
        origin_rank: that rank (``None`` when none reproduced it).
        reproduced_ranks: every rank whose replay reproduced it.
        observed_ranks: the ranks that observed the fault in the step itself (their loss was non-finite; all ranks
            for all-reduced gradients).
        overflow: the replayed gradients were finite but their norm lies beyond FP32 (an overflow of the squared
            norm, not NaN).
        hint: what to try, from the cause (empty when the cause is unknown).
        message: the sentence for people (in events and errors).
        replays: each rank's replay, by rank.
    """

    step: int
    verdict: Verdict
    replayed: bool
    reason: str
    origin: Origin | None
    origin_rank: int | None
    reproduced_ranks: tuple[int, ...]
    observed_ranks: tuple[int, ...]
    overflow: bool
    hint: str
    message: str
    replays: tuple[Replay, ...] = field(default_factory=tuple)

    @property
    def persistent(self) -> bool:
        return self.verdict == "persistent"

    @property
    def transient(self) -> bool:
        return self.verdict == "transient"

    def to_dict(self) -> dict[str, Any]:
        """The record as JSON-ready primitives (the journal's ``details["diagnosis"]``)."""
        return asdict(self)
