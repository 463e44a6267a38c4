"""From the cause of a non-finite value to what to try: op families, magnitude growth through depth, the hint text.

Pure Python: works on the host values of a :class:`~lightning_overflow.diagnosis.records.Trace`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Sequence

from lightning_overflow.diagnosis.records import HUGE_INPUT, Direction, Growth, Origin
from lightning_overflow.training_state import restore_hint

__all__ = ["detection_hint", "divergence_hint", "find_growth", "op_family", "origin_hint"]

MIN_LAYERS = 4
"""Fewer layers than this are not a deep stack."""
MIN_TOTAL_GROWTH = 1e3
"""Growth through the whole run of layers below this is ordinary variation."""
MIN_FACTOR = 1.5
"""Geometric-mean growth per layer below this is not a trend."""
MAX_TRAIL = 256
"""Only the last layers before the origin are examined (a long recurrent loop yields one entry per step)."""

_FAMILIES: tuple[tuple[str, frozenset[str]], ...] = (  # names without underscores, lower case
    ("softmax", frozenset({"softmax", "logsoftmax", "softmin", "gumbelsoftmax"})),
    ("exp", frozenset({"exp", "exp2", "expm1", "rpow", "sinh", "cosh"})),
    ("log", frozenset({"log", "log2", "log10", "log1p", "xlogy", "binarycrossentropy", "kldiv", "nllloss",
                       "poissonnllloss", "logit", "atanh", "acosh", "digamma", "lgamma"})),
    ("sqrt", frozenset({"sqrt", "rsqrt", "cdist", "pdist", "norm", "vectornorm", "linalgvectornorm", "std",
                        "normalize"})),
    ("pow", frozenset({"pow", "square", "floatpower", "mseloss", "var", "varmean", "stdmean", "linalgnorm",
                       "frobeniusnorm"})),
    ("div", frozenset({"div", "truediv", "rtruediv", "truedivide", "divide", "reciprocal", "floordivide", "rdiv",
                       "remainder", "fmod", "tan", "atan2"})),
    ("matmul", frozenset({"linear", "bilinear", "matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "einsum",
                          "conv1d", "conv2d", "conv3d", "convtranspose1d", "convtranspose2d", "convtranspose3d",
                          "convolution", "rnntanh", "rnnrelu", "lstm", "gru", "rnntanhcell", "rnnrelucell",
                          "lstmcell", "grucell", "scaleddotproductattention", "multiheadattentionforward",
                          "tensordot", "dot", "mv", "sum", "cumsum", "mean", "add", "sub", "mul", "prod", "cumprod",
                          "addcmul"})),
)

_HINTS: dict[tuple[str, str], str] = {
    ("softmax", "forward"): "a softmax over inf or all -inf logits: keep the logits finite (clamp, or mask with a "
    "large negative finite value instead of -inf) and use torch.softmax / F.log_softmax, which subtract the max; "
    "never exp(x) / exp(x).sum()",
    ("softmax", "backward"): "the softmax's gradient became non-finite: its logits are huge or a whole row is masked; "
    "keep the logits finite and use F.log_softmax with F.nll_loss / F.cross_entropy",
    ("exp", "forward"): "exp() overflows FP32 above 88.7: compute the log of a sum of exponentials with "
    "torch.logsumexp, or subtract the max before exp (for an InfoNCE / contrastive loss, F.cross_entropy on the "
    "logits sim / tau does both)",
    ("exp", "backward"): "the gradient of exp() is exp() itself and overflowed: compute the loss in log space with "
    "torch.logsumexp, or subtract the max before exp",
    ("log", "forward"): "log() of a value <= 0 gives NaN or -inf: clamp its input with an eps (x.clamp_min(1e-12)), "
    "or stay in log space (F.log_softmax, torch.logsumexp, F.binary_cross_entropy_with_logits)",
    ("log", "backward"): "the gradient of log(x) is 1/x and is infinite at 0: clamp the input with an eps "
    "(x.clamp_min(1e-12)) or stay in log space (F.log_softmax, F.binary_cross_entropy_with_logits)",
    ("sqrt", "forward"): "sqrt() or a norm of a negative or overflowing value: clamp the input at 0 and add an eps "
    "(torch.sqrt(x.clamp_min(0) + 1e-12)); scale large vectors down before taking their norm",
    ("sqrt", "backward"): "the gradient of sqrt (and of a norm) is infinite at 0: add an eps inside, "
    "torch.sqrt(x + 1e-12), or use F.normalize(x, eps=...)",
    ("pow", "forward"): "a square or power overflowed FP32 (x**2 is inf once |x| > 1.8e19): normalise or clamp its "
    "input before squaring, or compute the norm with the overflow-safe lightning_overflow.numerics.tensor_norms",
    ("pow", "backward"): "the gradient of a power became non-finite: a fractional exponent has an infinite gradient "
    "at 0, so add an eps ((x + 1e-12) ** p); a large exponent overflows, so normalise the input",
    ("div", "forward"): "a division by a value at or near 0: add an eps to the denominator (x / (d + 1e-12)) or "
    "clamp it (d.clamp_min(1e-12))",
    ("div", "backward"): "the gradient of a division grows as 1/d**2 and overflows near d = 0: add an eps to the "
    "denominator or clamp it",
    ("matmul", "forward"): "a product or sum of huge inputs overflowed: look for what made them grow (the "
    "initialisation, a missing normalisation, a learning rate too high for this batch size)",
    ("matmul", "backward"): "a gradient overflowed in a matrix product: the incoming gradients were already huge; "
    "lower the learning rate, add AutoClip, or check the initialisation of the layers on the way",
}

GROWTH_HINT = (
    "a magnitude that grows layer after layer points at the initialisation or the normalisation: initialise with "
    "std = gain / sqrt(fan_in) (nn.init.kaiming_normal_ / xavier_normal_), or put a LayerNorm / BatchNorm between "
    "the layers"
)
GROWN_HINT = (
    "a magnitude that grows layer after layer, after finite steps, points at weights the updates grew: lower the "
    "learning rate or warm it up (the suite's LRBackoff and trials do it for this run); if the first steps were "
    "already near overflow, look at the initialisation"
)
OVERFLOW_HINT = (
    "the gradients are finite: their squared norm overflowed FP32, not NaN; lower the learning rate, add AutoClip "
    "(it clips with the overflow-safe norm), or check the initialisation and normalisation of deep stacks"
)
BATCH_NONFINITE_HINT = (
    "the batch itself holds inf/NaN: find the corrupt sample in the data pipeline; NonFiniteDetector(action='skip') "
    "absorbs an isolated one"
)
BATCH_HUGE_HINT = (
    "the batch holds values up to {magnitude:.3g}: a corrupt or unnormalised sample; normalise the inputs, or "
    "filter such samples in the data pipeline"
)
def op_family(op: str) -> str | None:
    """The family of a forward op (``"exp"``) or backward node (``"ExpBackward0"``): exp, log, pow, sqrt, softmax,
    div, or matmul (products and sums of huge inputs); ``None`` for the rest.

    Example:
        >>> op_family("ExpBackward0"), op_family("__truediv__"), op_family("log_softmax"), op_family("relu")
        ('exp', 'div', 'softmax', None)
    """
    name = re.sub(r"Backward\d*$", "", op).strip("_").lower()  # ExpBackward0 -> exp, exp_ -> exp
    if op.startswith("__i") and op.endswith("__"):
        name = name[1:]  # __itruediv__ -> truediv
    name = name.replace("_", "")
    for family, names in _FAMILIES:
        if name in names:
            return family
    return None


def origin_hint(origin: Origin | None, growth: Growth | None, overflow: bool, first_step: bool = True) -> str:
    """The hint for a cause: the depth growth, then the op family's stable form, then the overflow. A growth found
    at the fit's first step is the initialisation's; after finite steps, the updates' (``first_step=False``)."""
    parts: list[str] = []
    if growth is not None:
        parts.append(GROWTH_HINT if first_step else GROWN_HINT)  # the root cause first: the op overflowed what grew
    if origin is not None and origin.source == "op":
        family = op_family(origin.op)
        if family is not None and not (family == "matmul" and growth is not None):
            parts.append(_HINTS[(family, origin.direction)])
    if overflow:
        parts.append(OVERFLOW_HINT)
    return "; ".join(parts)


def batch_hint(nonfinite: int, magnitude: float) -> str:
    if nonfinite:
        return BATCH_NONFINITE_HINT
    if magnitude > HUGE_INPUT:
        return BATCH_HUGE_HINT.format(magnitude=magnitude)
    return ""


def find_growth(trail: Sequence[tuple[str, float]], direction: Direction) -> Growth | None:
    """The longest run of layers, ending at the last one, along which the magnitude keeps growing.

    Args:
        trail: ``(module name, largest magnitude)`` of the parametrised layers in execution order, up to where the
            value became non-finite.
        direction: ``"forward"`` for activations, ``"backward"`` for gradients.

    Example:
        >>> trail = [(f"net.{i}", 10.0**i) for i in range(6)]
        >>> find_growth(trail, "forward").describe()
        'the activations grew about 10x per layer through 6 layers (net.0: 1 -> net.5: 1e+05)'
    """
    values = [(name, v) for name, v in trail if math.isfinite(v) and v > 0][-MAX_TRAIL:]
    for start in range(len(values) - MIN_LAYERS + 1):
        run = values[start:]
        steps = len(run) - 1
        total = run[-1][1] / run[0][1]
        ups = sum(1 for a, b in zip(run, run[1:]) if b[1] > a[1])
        if total < MIN_TOTAL_GROWTH or ups < 0.75 * steps:
            continue
        factor = total ** (1.0 / steps)
        if factor < MIN_FACTOR:
            continue
        return Growth(direction, len(run), run[0][0], run[-1][0], run[0][1], run[-1][1], factor)
    return None


def detection_hint(key: str, present: Collection[str], unrestorable: str | None = None) -> str:
    """What to try after a detection of kind ``key``, suggesting only suite callbacks not in ``present``.

    Args:
        key: ``"loss"``, ``"grad"``, ``"overflow"``, ``"buffer"``, ``"weight"``, ``"optimizer_state"``, ``"scaler"``,
            ``"consecutive"`` or ``"headroom"``.
        present: class names of the callbacks the Trainer already has.
        unrestorable: the class name of an optimizer whose state ``Rollback`` cannot restore
            (:func:`~lightning_overflow.training_state.unrestorable_optimizer`): it is not suggested then.

    Example:
        >>> detection_hint("weight", {"NonFiniteDetector"})
        'the weights themselves are non-finite and skipping steps cannot repair them: add Rollback to restore the last finite state, and LRBackoff to lower the learning rate'
        >>> detection_hint("weight", {"NonFiniteDetector", "LRBackoff"}, unrestorable="ZeroRedundancyOptimizer")
        "the weights themselves are non-finite and skipping steps cannot repair them: resume from your last checkpoint (Rollback cannot restore a ZeroRedundancyOptimizer's state; with a plain torch optimizer it can)"
        >>> detection_hint("weight", {"Rollback", "LRBackoff"})
        "the weights themselves are non-finite and skipping steps cannot repair them: with NonFiniteDetector(action='skip') Rollback restores the last finite state and LRBackoff lowers the learning rate"
    """
    recover = _recovery(present, unrestorable)
    clip = "lower the learning rate" + ("" if "AutoClip" in present else ", add AutoClip")
    hints = {
        "loss": "check this batch for inf/NaN inputs; if the loss uses exp(), compute it with torch.logsumexp or "
        "subtract the max first; clamp the input of log() with an eps",
        "grad": "a backward op produced inf/NaN (sqrt, pow, log or a division near 0, or an overflowing activation); "
        "torch.autograd.set_detect_anomaly(True) names the op",
        "overflow": f"the gradients are finite but their norm lies beyond the FP32 range: {clip}, or check the "
        "initialisation and normalisation of deep stacks",
        "weight": f"the weights themselves are non-finite and skipping steps cannot repair them: {recover}",
        "buffer": "a batch overflowed a layer that keeps running statistics (BatchNorm's running_var): the step was "
        "skipped and the buffers put back; check the batch for extreme or unnormalised values",
        "optimizer_state": "the optimizer state (e.g. Adam's exp_avg_sq) is non-finite and poisons every later step: "
        f"{recover}",
        "scaler": "the GradScaler keeps overflowing: the model overflows fp16 even with a small loss scale; try "
        "precision='bf16-mixed' or lower the learning rate",
        "consecutive": "the fault repeats on every step: look at the data pipeline and the learning rate"
        + ("" if "Rollback" in present or unrestorable else "; add Rollback to restore the last finite state when the "
           "weights are affected"),
        "headroom": f"{clip} before the values overflow; if the module named sits deep in a stack, check its "
        "initialisation and add normalisation",
    }
    return hints[key]


def divergence_hint(present: Collection[str], cause: tuple[str, str] | None = None) -> str:
    """What to try when the suite stops a run that keeps diverging: the fix of the cause a diagnosis found first
    (``exp`` -> ``torch.logsumexp``), then the general remedies, naming only the callbacks the Trainer lacks.

    Args:
        present: class names of the suite callbacks in the fit.
        cause: the latest diagnosis's ``(message, hint)`` (``None``: none was made).

    Example:
        >>> divergence_hint({"NonFiniteDetector", "AutoClip", "LRBackoff", "Rollback"})
        'lower the configured learning rate or lengthen its warm-up, and look at the data around the steps journaled'
        >>> divergence_hint({"NonFiniteDetector"}, ("first in head (exp, forward pass)", "use torch.logsumexp"))
        'use torch.logsumexp; otherwise lower the configured learning rate or lengthen its warm-up, clip the gradients (AutoClip), add LRBackoff and Rollback (default_callbacks()) to back off and restore the last finite state, and look at the data around the steps journaled'
    """
    general = ["lower the configured learning rate or lengthen its warm-up"]
    if "AutoClip" not in present:
        general.append("clip the gradients (AutoClip)")
    missing = [name for name in ("LRBackoff", "Rollback") if name not in present]
    if missing:
        restore = "(default_callbacks()) to back off and restore the last finite state"
        general.append(f"add {' and '.join(missing)} {restore}")
    general.append("and look at the data around the steps journaled")
    text = ", ".join(general[:-1]) + (", " if len(general) > 1 else "") + general[-1]
    return f"{cause[1]}; otherwise {text}" if cause is not None and cause[1] else text


def _recovery(present: Collection[str], unrestorable: str | None = None) -> str:
    if unrestorable is not None:
        backoff = "" if "LRBackoff" in present else "; add LRBackoff to lower the learning rate"
        return restore_hint(unrestorable) + backoff
    missing = [
        text
        for name, text in (
            ("Rollback", "Rollback to restore the last finite state"),
            ("LRBackoff", "LRBackoff to lower the learning rate"),
        )
        if name not in present
    ]
    if missing:
        return "add " + ", and ".join(missing)
    return "with NonFiniteDetector(action='skip') Rollback restores the last finite state and LRBackoff lowers the " \
        "learning rate"
