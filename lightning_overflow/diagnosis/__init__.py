"""Why a step went non-finite, and how close a healthy run is to the FP32 limit.

- :func:`trace_nonfinite` / :class:`NonFiniteTracer`: run a forward and backward pass with hooks on every module
  and op, and name the first module and op whose output (forward) or gradient (backward) became inf/NaN. Pure
  torch: usable in a plain PyTorch loop.
- :mod:`~lightning_overflow.diagnosis.replay`: the same inside Lightning, on every rank, for the step
  ``NonFiniteDetector`` flagged: transient or persistent, which rank saw it first, the hint.
- :mod:`~lightning_overflow.diagnosis.headroom`: decades between a step's largest magnitude and 3.4e38.
"""

from lightning_overflow.diagnosis.headroom import Headroom, decades_below_fp32
from lightning_overflow.diagnosis.hints import find_growth, op_family
from lightning_overflow.diagnosis.records import Diagnosis, Growth, Origin, Replay, Trace
from lightning_overflow.diagnosis.tracer import NonFiniteTracer, trace_nonfinite
from lightning_overflow.preserve import RngState, capture_rng, preserved_state

__all__ = [
    "Diagnosis",
    "Growth",
    "Headroom",
    "NonFiniteTracer",
    "Origin",
    "Replay",
    "RngState",
    "Trace",
    "capture_rng",
    "decades_below_fp32",
    "find_growth",
    "op_family",
    "preserved_state",
    "trace_nonfinite",
]
