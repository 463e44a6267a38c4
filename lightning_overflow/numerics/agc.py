"""Adaptive gradient clipping (AGC), unit-wise: each output unit's gradient norm is held below a fraction of its
weight norm.

Pure torch, no Lightning, sync-free: the coefficients stay on the device, clamped and always multiplied. The rules of
:mod:`~lightning_overflow.numerics.clipping` hold here too: a unit whose gradient norm is inf/NaN keeps coefficient 1
(the gradients are left for a detector to see, never turned into finite numbers), and a coefficient never drops
below the smallest normal FP32 number. ``exact=True`` computes the norms in float64, for gradients above about 1e19
whose FP32 squares overflow.

A plain PyTorch loop::

    for batch in loader:
        model(batch).backward()
        agc_(list(model.parameters()), clipping=0.01)
        optimizer.step()

Paper:
    A. Brock, S. De, S. L. Smith, K. Simonyan, "High-Performance Large-Scale Image Recognition Without
    Normalization", ICML 2021.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_overflow._validation import check_bool, check_float
from lightning_overflow.numerics.clipping import FP32_TINY

__all__ = ["agc_", "agc_coefficients", "agc_coefficients_and_norms", "smallest_coefficient", "unitwise_norms"]


def unitwise_norms(tensors: Sequence[Tensor], exact: bool) -> list[Tensor]:
    """The L2 norm of each unit (output row) of each tensor, broadcastable against it.

    A unit is a slice along the first dimension (an output neuron or channel, as ``nn.Linear`` and ``nn.Conv*``
    store their weights); a vector or scalar (bias, gain) is one unit. Accumulated in FP32, or in float64 with
    ``exact=True`` (for values above about 1e19, whose FP32 squares overflow) and for float64 tensors.

    Example:
        >>> unitwise_norms([torch.tensor([[3.0, 4.0], [0.0, 1.0]]), torch.tensor([7.0, 24.0])], exact=False)
        [tensor([[5.],
                [1.]]), tensor(25.)]
    """
    check_bool("exact", exact)
    norms = []
    for t in tensors:
        dtype = torch.float64 if exact or t.dtype.to_real() == torch.float64 else torch.float32
        if t.dim() <= 1:
            norms.append(_vector_norm(t, dtype))
        else:
            norms.append(_vector_norm(t, dtype, dim=tuple(range(1, t.dim())), keepdim=True))
    return norms


def _vector_norm(t: Tensor, dtype: torch.dtype, **dims: Any) -> Tensor:
    """``vector_norm`` accumulated in the real ``dtype``; a complex tensor in the complex type of that precision
    (its moduli: the norm is real either way)."""
    if t.is_complex():
        dtype = torch.complex128 if dtype == torch.float64 else torch.complex64
    return torch.linalg.vector_norm(t, dtype=dtype, **dims)


def agc_coefficients(
    params: Sequence[Tensor], clipping: float = 0.01, eps: float = 1e-3, exact: bool = False
) -> list[Tensor]:
    """AGC's per-unit coefficients: ``min(1, clipping * max(|W_i|, eps) / |G_i|)`` for each unit ``i``.

    The floor ``eps`` on the weight norm lets zero-initialised weights move (without it their gradients would be
    clipped to zero for ever). A unit whose gradient norm is inf/NaN keeps coefficient 1 (left for the detector),
    and so does a unit whose weights are non-finite.

    Args:
        params: parameters with gradients (any floating dtype; float64 ones are handled in float64).
        clipping: the largest allowed ratio of gradient norm to weight norm, per unit, in (0, inf) (paper: 0.01 at
            batch 4096, larger for smaller batches).
        eps: floor on the weight norm, in (0, inf) (paper: 1e-3).
        exact: compute the norms in float64 (gradients above about 1e19).

    Returns:
        One coefficient tensor per parameter, in the gradient's dtype (a complex one's real dtype), broadcastable
        against it.

    Raises:
        TypeError: ``clipping`` or ``eps`` is not a number, or ``exact`` not a bool.
        ValueError: ``clipping`` or ``eps`` is not in (0, inf).
    """
    return agc_coefficients_and_norms(params, clipping, eps, exact)[0]


def agc_coefficients_and_norms(
    params: Sequence[Tensor], clipping: float, eps: float, exact: bool
) -> tuple[list[Tensor], list[Tensor]]:
    """AGC's coefficients (as :func:`agc_coefficients`) and the L2 norm each gradient will have once multiplied by
    them, from the same pass over the gradients; nothing is changed.

    The norms give the total norm after AGC, which is what a cap on the total norm must be computed from: a cap
    computed from the norm before AGC would bring the final norm below it.

    Returns:
        ``(coefficients, norms)``: the coefficients of :func:`agc_coefficients`, and one 0-d tensor per parameter
        on its device (float32; float64 with ``exact`` or for float64 gradients).

    Example:
        >>> w = torch.nn.Parameter(torch.tensor([[3.0, 4.0], [0.0, 1.0]]))
        >>> w.grad = torch.tensor([[70.0, 240.0], [0.0, 0.1]])
        >>> coefs, norms = agc_coefficients_and_norms([w], clipping=0.2, eps=1e-3, exact=False)
        >>> norms  # row 1 clipped to 0.2 * 5 = 1, row 2 within 0.2 * 1: sqrt(1 + 0.01)
        [tensor(1.0050)]
    """
    clipping, eps = _check_agc(clipping, eps, exact)
    if _batchable(params, exact):
        return _batched_coefficients_and_norms(params, clipping, eps)
    weights = unitwise_norms([p.detach() for p in params], exact)
    grads = unitwise_norms([p.grad for p in params], exact)  # type: ignore[misc]
    coefs: list[Tensor] = []
    norms: list[Tensor] = []
    for p, w, g in zip(params, weights, grads):
        limit = clipping * w.clamp(min=eps)
        clip = torch.isfinite(g) & (g > limit)
        coef = torch.where(clip, limit / torch.where(clip, g, torch.ones_like(g)), torch.ones_like(g))
        coef = coef.clamp(min=FP32_TINY)
        norms.append(torch.linalg.vector_norm(g * coef))
        coefs.append(coef.to(p.grad.dtype.to_real()))  # type: ignore[union-attr]
    return coefs, norms


def _batchable(params: Sequence[Tensor], exact: bool) -> bool:
    """Whether every unit of every parameter can be treated in one flat tensor: FP32 norms, one gradient dtype (the
    coefficients' dtype), one device."""
    if exact or not params:
        return False
    grad = params[0].grad
    if grad is None:
        return False
    dtype, device = grad.dtype, grad.device
    return dtype.to_real() != torch.float64 and all(
        p.grad is not None and p.grad.dtype == dtype and p.grad.device == device and p.dtype.to_real() != torch.float64
        for p in params
    )


def _flat_unit_norms(tensors: Sequence[Tensor]) -> tuple[Tensor, list[int]]:
    """Every unit's FP32 norm (as :func:`unitwise_norms` computes it, unit by unit the same values) in one flat
    tensor, and the number of units of each tensor."""
    norms = []
    for t in tensors:
        if t.dim() <= 1:
            norms.append(_vector_norm(t, torch.float32).reshape(1))
        else:
            norms.append(_vector_norm(t, torch.float32, dim=tuple(range(1, t.dim()))))
    return torch.cat(norms), [n.numel() for n in norms]


def _batched_coefficients_and_norms(
    params: Sequence[Tensor], clipping: float, eps: float
) -> tuple[list[Tensor], list[Tensor]]:
    """:func:`agc_coefficients_and_norms` with the arithmetic on all units at once: a handful of kernels for the
    whole model instead of a dozen per parameter. Element by element the same operations, so the same values."""
    with torch.no_grad():
        weights, sizes = _flat_unit_norms(params)
        grads, _ = _flat_unit_norms([p.grad for p in params])  # type: ignore[misc]
        limit = clipping * weights.clamp(min=eps)
        clip = torch.isfinite(grads) & (grads > limit)
        coef = torch.where(clip, limit / torch.where(clip, grads, 1.0), 1.0).clamp(min=FP32_TINY)
        clipped = (grads * coef).split(sizes)
        norms = [torch.linalg.vector_norm(unit_norms) for unit_norms in clipped]
        flat = coef.to(params[0].grad.dtype.to_real()).split(sizes)  # type: ignore[union-attr]
    coefs = [c.reshape(()) if p.dim() <= 1 else c.reshape(-1, *([1] * (p.dim() - 1))) for p, c in zip(params, flat)]
    return coefs, norms


def agc_(params: Sequence[Tensor], clipping: float = 0.01, eps: float = 1e-3, exact: bool = False) -> Tensor:
    """Adaptive gradient clipping, unit-wise and in place (Brock et al., 2021); sync-free.

    Parameters without a gradient are ignored. See :func:`agc_coefficients` for the arguments.

    Returns:
        The smallest coefficient applied (a 0-d float32 tensor; 1 when nothing was clipped).

    Raises:
        TypeError: ``clipping`` or ``eps`` is not a number, or ``exact`` not a bool.
        ValueError: ``clipping`` or ``eps`` is not in (0, inf).

    Example:
        >>> w = torch.nn.Parameter(torch.tensor([[3.0, 4.0]]))
        >>> w.grad = torch.tensor([[70.0, 240.0]])
        >>> agc_([w], clipping=0.2)
        tensor(0.0040)
        >>> w.grad
        tensor([[0.2800, 0.9600]])
    """
    _check_agc(clipping, eps, exact)
    params = [p for p in params if p.grad is not None]
    if not params:
        return torch.ones(())
    coefs = agc_coefficients(params, clipping, eps, exact)
    torch._foreach_mul_([p.grad for p in params], coefs)  # type: ignore[misc]
    return smallest_coefficient(coefs)


def _check_agc(clipping: float, eps: float, exact: bool) -> tuple[float, float]:
    clipping = check_float("clipping", clipping, low=0.0, low_open=True)
    eps = check_float("eps", eps, low=0.0, low_open=True)
    check_bool("exact", exact)
    return clipping, eps


def smallest_coefficient(coefs: Sequence[Tensor]) -> Tensor:
    """The smallest of several coefficient tensors, as a float32 0-d tensor on the first accelerator among them (on
    the CPU when all are there): nothing is copied from an accelerator into host memory."""
    if not coefs:
        return torch.ones(())
    device = next((c.device for c in coefs if c.device.type != "cpu"), coefs[0].device)
    if all(c.device == device for c in coefs):  # one kernel for all (the minimum is exact in any dtype)
        return torch.cat([c.reshape(-1) for c in coefs]).amin().to(torch.float32)
    into_accelerator = device.type != "cpu"
    return torch.stack(
        [c.amin().to(device=device, dtype=torch.float32, non_blocking=into_accelerator) for c in coefs]
    ).amin()
