"""Gradient and weight norms that stay correct where FP32 arithmetic overflows.

Pure torch, no Lightning. The hot path (:func:`tensor_norms`, :func:`total_norm`) never reads a value back to the
host, so it adds no synchronisation to a GPU step; the exact path (:func:`refine_norms`) runs only for the few
tensors whose fast norm came out non-finite, and tells a real inf/NaN from a spurious overflow of the squares.

Why not ``torch.nn.utils.get_total_norm``: for finite gradients of magnitude 1e20 the squares overflow FP32 and it
returns ``inf``; ``clip_grad_norm_`` then multiplies every gradient by ``max_norm / inf = 0`` and the step is lost
silently. Here the same gradients give their true norm (3.2e21 for ten of them).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from lightning_overflow._validation import check_norm_type

__all__ = [
    "FP32_MAX",
    "NormReport",
    "grad_norm_report",
    "norm_status",
    "refine_norms",
    "tensor_norms",
    "total_norm",
]

FP32_MAX = float(torch.finfo(torch.float32).max)

NormStatus = Literal["finite", "overflow", "nonfinite"]
"""``finite``: the FP32 norm is exact; ``overflow``: every value is finite but the FP32 norm overflowed (the exact
norm is known in float64); ``nonfinite``: the tensor holds inf or NaN."""

_HALF = (torch.float16, torch.bfloat16)


def _norms_on_one_device(tensors: list[Tensor], norm_type: float) -> Tensor:
    if math.isinf(norm_type):
        # aminmax reads the tensor once; vector_norm(ord=inf) is 10-37x slower on CPU.
        return torch.stack([_max_abs(t) for t in tensors])
    device = tensors[0].device
    if device.type != "cpu":
        # One fused kernel per dtype on accelerators; half inputs are accumulated in fp32 (float64 stays float64).
        return _foreach_norms(tensors)
    # On CPU a dot per tensor is faster than _foreach_norm (whose fp32 kernel runs on one thread) and more accurate.
    squares = [
        torch.linalg.vector_norm(t, dtype=torch.float32).square()
        if t.dtype in _HALF
        else torch.dot(t.reshape(-1), t.reshape(-1)).float()
        for t in tensors
    ]
    return torch.stack(squares).sqrt()


def _foreach_norms(tensors: list[Tensor]) -> Tensor:
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    norms: list[Tensor] = [tensors[0].new_zeros((), dtype=torch.float32)] * len(tensors)
    for dtype, indices in by_dtype.items():
        group = [tensors[i] for i in indices]
        parts = torch._foreach_norm(group, 2.0, dtype=torch.float32) if dtype in _HALF else torch._foreach_norm(group, 2.0)
        for i, part in zip(indices, parts):
            norms[i] = part.float()
    return torch.stack(norms)


def _max_abs(t: Tensor) -> Tensor:
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    low, high = torch.aminmax(t)
    # maximum() propagates NaN, so a NaN anywhere makes the result NaN.
    return torch.maximum(low.abs(), high.abs()).float()


def tensor_norms(tensors: Sequence[Tensor], norm_type: float = 2.0) -> Tensor:
    """Norm of each tensor, as one float32 tensor on the first tensor's device, without reading it to the host.

    Any mix of fp32/fp16/bf16 is accumulated in fp32. An entry is ``inf`` where the tensor holds inf or where FP32
    arithmetic overflowed (squares beyond 3.4e38, i.e. values above about 1.8e19); ``nan`` where it holds NaN.
    :func:`refine_norms` tells the two apart.

    Tensors on several devices (a model split across GPUs, or CPU counters beside GPU moments) are allowed: the
    result then lies on the first accelerator among them, so nothing waits on a device-to-host copy.

    Args:
        tensors: the tensors (gradients, weights, optimizer moments). Dense only.
        norm_type: ``2`` (L2) or ``inf`` (largest magnitude).

    Example:
        >>> tensor_norms([torch.tensor([3.0, 4.0]), torch.tensor([7.0, 24.0])])
        tensor([ 5., 25.])
    """
    norm_type = check_norm_type(norm_type)
    if not tensors:
        return torch.zeros(0, dtype=torch.float32)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    if len(by_device) == 1:
        return _norms_on_one_device(list(tensors), norm_type)
    out_device = next((d for d in by_device if d.type != "cpu"), tensors[0].device)
    norms: list[Tensor] = [torch.empty(0)] * len(tensors)
    for indices in by_device.values():
        part = _norms_on_one_device([tensors[i] for i in indices], norm_type)
        # Host-to-accelerator or accelerator-to-accelerator only: no copy is ever read before it lands.
        for i, value in zip(indices, part.to(out_device, non_blocking=True).unbind()):
            norms[i] = value
    return torch.stack(norms)


def total_norm(norms: Tensor, norm_type: float = 2.0) -> Tensor:
    """Combine per-tensor norms into the total norm, in float64 (no overflow while the parts are finite).

    Example:
        >>> total_norm(torch.tensor([3.0, 4.0]))
        tensor(5., dtype=torch.float64)
    """
    norm_type = check_norm_type(norm_type)
    norms = norms.to(torch.float64)
    if norms.numel() == 0:
        return norms.new_zeros(())
    if math.isinf(norm_type):
        return norms.amax()
    return norms.square().sum().sqrt()


def refine_norms(tensors: Sequence[Tensor], norms: Tensor, indices: Iterable[int], norm_type: float = 2.0) -> Tensor:
    """Recompute the given entries of ``norms`` exactly, in float64; return all norms as float64.

    Call it only for the indices whose fast norm is not finite (a rare path): a tensor whose values are finite gets
    its true norm, a tensor holding inf gets ``inf``, one holding NaN gets ``nan``.

    Example:
        >>> big = torch.full((10,), 1e20)
        >>> fast = tensor_norms([big])
        >>> fast, refine_norms([big], fast, [0])
        (tensor([inf]), tensor([3.1623e+20], dtype=torch.float64))
    """
    norm_type = check_norm_type(norm_type)
    exact = norms.to(torch.float64, copy=True)
    for i in indices:
        t = tensors[i].detach()
        if math.isinf(norm_type):
            value = _max_abs(t.double()).double() if t.numel() else exact.new_zeros(())
        else:
            value = torch.linalg.vector_norm(t, dtype=torch.float64)
        exact[i] = value.to(exact.device)
    return exact


def norm_status(fast: float, exact: float) -> NormStatus:
    """Classify one tensor from its fast (fp32) norm and its exact (float64) norm."""
    if math.isfinite(fast):
        return "finite"
    return "overflow" if math.isfinite(exact) else "nonfinite"


@dataclass(frozen=True)
class NormReport:
    """Norms of a set of tensors read back to the host, for plain PyTorch loops and for error messages.

    Attributes:
        total: the exact total norm (a float64 value; may exceed the FP32 range, ``inf``/``nan`` if any tensor
            holds inf/NaN).
        per_tensor: the exact norm of each tensor.
        status: the :data:`NormStatus` of each tensor.
    """

    total: float
    per_tensor: tuple[float, ...]
    status: tuple[NormStatus, ...]

    @property
    def finite(self) -> bool:
        """Every tensor holds only finite values (their norm may still lie beyond FP32, see :attr:`overflow`)."""
        return "nonfinite" not in self.status

    @property
    def overflow(self) -> bool:
        """Some tensor is finite but its FP32 norm overflowed."""
        return "overflow" in self.status

    @property
    def beyond_fp32(self) -> bool:
        """The values are finite but the total norm itself cannot be represented in FP32."""
        return self.finite and self.total > FP32_MAX


def grad_norm_report(tensors: Sequence[Tensor], norm_type: float = 2.0) -> NormReport:
    """Exact norms of ``tensors`` with one host read (two when something overflowed), for plain PyTorch loops.

    Example:
        >>> report = grad_norm_report([torch.tensor([7.0, 24.0]), torch.full((10,), 1e20)])
        >>> report.status, f"{report.total:.4g}"
        (('finite', 'overflow'), '3.162e+20')
    """
    fast = tensor_norms(tensors, norm_type)
    fast_host = fast.tolist()
    bad = [i for i, v in enumerate(fast_host) if not math.isfinite(v)]
    exact = refine_norms(tensors, fast, bad, norm_type).tolist() if bad else fast_host
    status = tuple(norm_status(f, e) for f, e in zip(fast_host, exact))
    total = total_norm(torch.tensor(exact, dtype=torch.float64), norm_type).item() if exact else 0.0
    return NormReport(total=total, per_tensor=tuple(exact), status=status)
