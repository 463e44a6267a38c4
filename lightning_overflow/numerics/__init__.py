"""Pure-torch numerics behind the callbacks, usable in a plain PyTorch loop (no Lightning import)."""

from lightning_overflow.numerics.norms import (
    FP32_MAX,
    NormReport,
    grad_norm_report,
    norm_status,
    refine_norms,
    tensor_norms,
    total_norm,
)
from lightning_overflow.numerics.state import optimizer_state_tensors, parameters_of

__all__ = [
    "FP32_MAX",
    "NormReport",
    "grad_norm_report",
    "norm_status",
    "optimizer_state_tensors",
    "parameters_of",
    "refine_norms",
    "tensor_norms",
    "total_norm",
]
