"""Gradient and weight norms that stay correct where FP32 arithmetic overflows.

Pure torch, no Lightning. The hot path (:func:`tensor_norms`, :func:`total_norm`) never reads a value back to the
host, so it adds no synchronisation to a GPU step; the exact path (:func:`refine_norms`) runs only for the few
tensors whose fast norm came out non-finite, and tells a real inf/NaN from a spurious overflow of the squares.

Why not ``torch.nn.utils.get_total_norm``: for finite gradients of magnitude 1e20 the squares overflow FP32 and it
returns ``inf``; ``clip_grad_norm_`` then multiplies every gradient by ``max_norm / inf = 0`` and the step is lost
silently. Here the same gradients give their true norm (3.2e21 for ten of them).

Sharded tensors (``DTensor``, as FSDP2's ``fully_shard`` makes parameters, gradients and optimizer moments): every
function here works on this rank's local shard (``to_local()``, no copy and no collective), so a norm of a
``DTensor`` is the norm of the part this rank holds. The norm of the full tensor is the square root of the sum of
the shards' squares over the ranks: :func:`shard_squares` gives each rank's part of that sum, weighted so that
ranks holding the same shard (replicas) count once, for one all-reduce of all tensors together.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from lightning_overflow._validation import check_norm_type

__all__ = [
    "FP32_MAX",
    "NormReport",
    "any_sharded",
    "grad_norm_report",
    "host_total_norm",
    "is_sharded",
    "local_shard",
    "norm_status",
    "plain_cpu",
    "plain_norms",
    "real_values",
    "refine_norms",
    "shard_squares",
    "squared_norm_share",
    "tensor_norms",
    "total_norm",
]

FP32_MAX = float(torch.finfo(torch.float32).max)

NormStatus = Literal["finite", "overflow", "nonfinite"]
"""``finite``: the FP32 norm is exact; ``overflow``: every value is finite but the FP32 norm overflowed (the exact
norm is known in float64); ``nonfinite``: the tensor holds inf or NaN."""

_HALF = (torch.float16, torch.bfloat16)


def _dtensor_type() -> type | None:
    """``DTensor`` once its module is loaded, else ``None``: no DTensor can exist before, and importing
    ``torch.distributed.tensor`` here would cost every process that never shards."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_sharded(t: Tensor) -> bool:
    """Whether ``t`` is a ``DTensor`` (each rank holds a shard or a replica of it)."""
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(t, dtensor)


def any_sharded(tensors: Iterable[Tensor]) -> bool:
    """Whether some tensor of ``tensors`` is a ``DTensor`` (answered without a look at them before one can exist)."""
    dtensor = _dtensor_type()
    return dtensor is not None and any(isinstance(t, dtensor) for t in tensors)


def local_shard(t: Tensor) -> Tensor:
    """The part of ``t`` this rank holds: a ``DTensor``'s local tensor (a view: writing into it writes the
    ``DTensor``), any other tensor itself.

    A ``DTensor`` with a ``Partial`` placement (each rank holds a summand, not a shard) is first reduced to the
    replicated tensor: a collective, entered by every rank of its mesh at the same point.

    Example:
        >>> t = torch.ones(3)
        >>> local_shard(t) is t
        True
    """
    if not is_sharded(t):
        return t
    placements = t.placements  # type: ignore[attr-defined]
    if any(p.is_partial() for p in placements):
        from torch.distributed.tensor import Replicate

        t = t.redistribute(t.device_mesh, [Replicate() if p.is_partial() else p for p in placements])  # type: ignore[attr-defined]
    return t.to_local()  # type: ignore[attr-defined]


def _dense_values(t: Tensor) -> Tensor:
    """The values whose norm is ``t``'s: a sparse COO tensor's coalesced values (duplicates summed), else ``t``."""
    if t.layout == torch.sparse_coo:
        return t.coalesce().values()
    if t.layout != torch.strided:
        return t.to_dense()
    return t


def real_values(t: Tensor, norm_type: float = 2.0) -> Tensor:
    """A real tensor with ``t``'s norm: ``t`` itself, or for a complex ``t`` its real and imaginary parts as a view
    (L2: the same sum of squares) or its moduli (a copy, for the largest magnitude).

    Example:
        >>> real_values(torch.tensor([3 + 4j]), math.inf)
        tensor([5.])
    """
    if not t.is_complex():
        return t
    return t.abs() if math.isinf(norm_type) else torch.view_as_real(t.resolve_conj())


def _copies(t: Tensor, world_size: int) -> int:
    """How many of the ``world_size`` ranks hold the same local part of ``t``.

    A ``DTensor`` is replicated along the mesh dimensions of its ``Replicate`` placements, and once per copy of its
    mesh in the world (FSDP2 over the data-parallel sub-mesh of a data x tensor-parallel mesh: one copy per
    tensor-parallel rank). A plain tensor beside ``DTensor`` s is taken as replicated on every rank.
    """
    if not is_sharded(t):
        return world_size
    mesh = t.device_mesh  # type: ignore[attr-defined]
    copies = max(world_size // mesh.size(), 1)
    for dim, placement in enumerate(t.placements):  # type: ignore[attr-defined]
        if placement.is_replicate():
            copies *= mesh.size(dim)
    return copies


def _norms_on_one_device(tensors: list[Tensor], norm_type: float) -> Tensor:
    if math.isinf(norm_type):
        # aminmax reads the tensor once; vector_norm(ord=inf) is 10-37x slower on CPU.
        return torch.stack([_max_abs(t) for t in tensors])
    device = tensors[0].device
    if device.type != "cpu":
        # One fused kernel per dtype on accelerators; half inputs are accumulated in fp32 (float64 stays float64).
        return _foreach_norms(tensors)
    if torch.get_num_threads() == 1 and all(t.dtype == torch.float32 for t in tensors):
        # On one CPU thread _foreach_norm reads the tensors as fast as a plain sum does; a dot per tensor is a
        # quarter slower there.
        return torch.stack(torch._foreach_norm(tensors))
    # On several CPU threads a dot per tensor is faster than _foreach_norm (whose fp32 kernel runs on one thread),
    # and more accurate. The loop is the suite's hot path: one flat view per tensor (none for vectors), no
    # conversion of fp32 squares.
    squares = []
    for t in tensors:
        if t.dtype in _HALF:
            squares.append(torch.linalg.vector_norm(t, dtype=torch.float32).square())
            continue
        flat = t if t.dim() == 1 else t.reshape(-1)
        square = torch.dot(flat, flat)
        squares.append(square if t.dtype == torch.float32 else square.float())
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

    A ``DTensor`` gets the norm of this rank's shard (:func:`local_shard`); :func:`shard_squares` turns these into
    each rank's part of the full tensors' squared norms.

    Args:
        tensors: the tensors (gradients, weights, optimizer moments); sparse gradients (``nn.Embedding(sparse=True)``)
            are measured by their coalesced values, complex ones by their moduli.
        norm_type: ``2`` (L2) or ``inf`` (largest magnitude).

    Example:
        >>> tensor_norms([torch.tensor([3.0, 4.0]), torch.tensor([7.0, 24.0])])
        tensor([ 5., 25.])
    """
    norm_type = check_norm_type(norm_type)
    if not tensors:
        return torch.zeros(0, dtype=torch.float32)
    if _dtensor_type() is not None:  # no DTensor can exist before its module is loaded
        tensors = [local_shard(t) for t in tensors]
    tensors = [
        t if t.layout == torch.strided and not t.is_complex() else real_values(_dense_values(t), norm_type)
        for t in tensors
    ]
    device = tensors[0].device
    if all(t.device == device for t in tensors):
        return _norms_on_one_device(tensors, norm_type)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    out_device = next((d for d in by_device if d.type != "cpu"), tensors[0].device)
    norms: list[Tensor] = [torch.empty(0)] * len(tensors)
    for indices in by_device.values():
        part = _norms_on_one_device([tensors[i] for i in indices], norm_type)
        # Host-to-accelerator or accelerator-to-accelerator only: no copy is ever read before it lands.
        for i, value in zip(indices, part.to(out_device, non_blocking=True).unbind()):
            norms[i] = value
    return torch.stack(norms)


def plain_cpu(tensors: Sequence[Tensor]) -> bool:
    """Whether every tensor is a dense, real fp32 tensor on the CPU (no ``DTensor``): those :func:`plain_norms`
    takes.

    Example:
        >>> plain_cpu([torch.ones(2), torch.ones(2, dtype=torch.float16)])
        False
    """
    dtensor = _dtensor_type()
    return all(
        t.layout == torch.strided and t.dtype == torch.float32 and t.device.type == "cpu"
        and (dtensor is None or not isinstance(t, dtensor))
        for t in tensors
    )  # fmt: skip


def plain_norms(tensors: Sequence[Tensor]) -> Tensor:
    """:func:`tensor_norms` of tensors :func:`plain_cpu` accepts, without its checks of every tensor at every call:
    for a step's gradients, whose kinds the caller checked once (on a small model the checks cost a fifth of the
    kernels).

    Example:
        >>> plain_norms([torch.tensor([3.0, 4.0]), torch.tensor([7.0, 24.0])])
        tensor([ 5., 25.])
    """
    if not tensors:
        return torch.zeros(0, dtype=torch.float32)
    return _norms_on_one_device(list(tensors), 2.0)


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


def host_total_norm(norms: Sequence[float]) -> float:
    """The total L2 norm of per-tensor norms already read to the host, correctly rounded: each square is exact in
    float64 (the norms are FP32 values), their sum is exact before its one rounding (``math.fsum``), and so is the
    root. ``inf`` / ``nan`` where some norm is.

    Example:
        >>> host_total_norm([3.0, 4.0])
        5.0
    """
    squares = [v * v for v in norms]
    if all(math.isfinite(v) for v in squares):
        return math.sqrt(math.fsum(squares))
    return math.sqrt(sum(squares))


def refine_norms(tensors: Sequence[Tensor], norms: Tensor, indices: Iterable[int], norm_type: float = 2.0) -> Tensor:
    """Recompute the given entries of ``norms`` exactly, in float64; return all norms as float64.

    Call it only for the indices whose fast norm is not finite (a rare path): a tensor whose values are finite gets
    its true norm, a tensor holding inf gets ``inf``, one holding NaN gets ``nan``. A ``DTensor`` gets the exact norm
    of this rank's shard.

    Example:
        >>> big = torch.full((10,), 1e20)
        >>> fast = tensor_norms([big])
        >>> fast, refine_norms([big], fast, [0])
        (tensor([inf]), tensor([3.1623e+20], dtype=torch.float64))
    """
    norm_type = check_norm_type(norm_type)
    exact = norms.to(torch.float64, copy=True)
    for i in indices:
        t = real_values(_dense_values(local_shard(tensors[i].detach())), norm_type)
        if math.isinf(norm_type):
            value = _max_abs(t.double()).double() if t.numel() else exact.new_zeros(())
        else:
            value = torch.linalg.vector_norm(t, dtype=torch.float64)
        exact[i] = value.to(exact.device)
    return exact


def shard_squares(norms: Tensor, tensors: Sequence[Tensor], world_size: int) -> Tensor:
    """This rank's part of the squared L2 norms of the full tensors, from the norms of its shards (float64).

    Summed over the ``world_size`` ranks (one all-reduce for all tensors), entry ``i`` is the squared norm of the
    full ``tensors[i]``: a ``DTensor`` sharded across ranks adds up its shards, and ranks holding the same shard
    (replicas, see :func:`local_shard`) share its square, so it counts once. Non-finite norms stay non-finite.
    No host read.

    Args:
        norms: this rank's per-tensor L2 norms of ``tensors`` (:func:`tensor_norms` or :func:`refine_norms`).
        tensors: the tensors, for their placements.
        world_size: the number of ranks of the all-reduce.

    Example:
        >>> shard_squares(torch.tensor([3.0, 4.0]), [torch.zeros(1), torch.zeros(1)], world_size=1)
        tensor([ 9., 16.], dtype=torch.float64)
    """
    squares = norms.to(torch.float64).square()
    copies = [_copies(t, world_size) for t in tensors]
    if any(c != 1 for c in copies):
        shares = torch.tensor([1.0 / c for c in copies], dtype=torch.float64).to(squares.device, non_blocking=True)
        squares = squares * shares
    return squares


def squared_norm_share(tensors: Sequence[Tensor], world_size: int) -> Tensor:
    """This rank's part of the squared L2 norm of all ``tensors`` together (a float64 0-d tensor, no host read):
    summed over the ``world_size`` ranks, the squared norm of the full tensors (:func:`shard_squares`). For weights,
    which require gradients: no graph is built.

    Example:
        >>> squared_norm_share([torch.tensor([3.0]), torch.tensor([4.0], requires_grad=True)], world_size=1)
        tensor(25., dtype=torch.float64)
    """
    with torch.no_grad():
        if world_size == 1 and plain_cpu(tensors):
            return plain_norms(tensors).double().square().sum()  # what the general path computes, without its checks
        return shard_squares(tensor_norms(tensors), tensors, world_size).sum()


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
