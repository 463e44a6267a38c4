"""Snapshots of a training state in host memory: copies taken, verified finite and restored in place.

Pure torch, no Lightning, no file I/O (files are :mod:`lightning_overflow.snapshot_store`'s). A *state* is any
nesting of dicts, lists and tuples whose leaves are tensors or plain values: a module's ``state_dict()``, an
optimizer's ``state_dict()``, a dict of those. A *snapshot* is the same nesting with every tensor copied into a host
buffer. It can be copied back into the live state in place.

Facts that shape it (torch 2.13):

- ``state_dict()`` returns the live tensors, so a snapshot must copy them. ``Optimizer.load_state_dict`` keeps the
  tensors it is given when they already have the right dtype and device: loading a host snapshot that way on a CPU
  would make the live Adam moments *be* the snapshot, and the next step would overwrite it. Restoring therefore
  copies into the live tensors (:func:`restore_state_`, :func:`restore_optimizer_`), or loads a clone.
- A copy into freshly allocated memory runs at about a third of the speed of a copy into memory already touched
  (page faults): :func:`take_snapshot` reuses the buffers of a snapshot that is no longer needed. On a GPU the buffers
  are pinned and every copy is ``non_blocking``: no host synchronisation per tensor. :func:`synchronize` waits once,
  before the host itself reads the buffers (to write them to disk, or to clone them).
- Param groups can be added during a fit (Lightning's ``BackboneFinetuning`` adds one when it unfreezes the
  backbone). A snapshot taken before holds fewer groups: :func:`restore_optimizer_` restores the groups it holds
  and leaves the newer ones in place, their parameters without state, as when they were added.
- Finiteness is read through each tensor's largest magnitude (the max-abs norm), on the device and without a host
  read (:func:`nonfinite_flag`). NaN propagates through it and, unlike the L2 norm, it cannot overflow while the
  values are finite: Adam's ``exp_avg_sq`` under gradients of 1e11 holds values near 1e19, whose squares overflow
  FP32 although nothing is wrong with them. A tensor is non-finite exactly when it holds inf or NaN. A first look
  costs half as much (:func:`nonfinite_suspect`): a tensor that holds inf or NaN has a sum that is not finite, and
  finite values sum beyond the FP32 range only when they reach about 1e32; the max-abs check decides the suspects.
- Sharded tensors (FSDP2's ``DTensor`` parameters and moments): a snapshot holds this rank's local shard, and is
  restored into it in place (:func:`local_state` gives the live state as local views, no copy, no collective).
- A snapshot may hold only part of the tensors (each DDP rank keeps about ``1/world`` of them, see
  :func:`partition_by_size`): every tensor it does not hold is a *placeholder*, a ``meta`` tensor of the same shape
  and dtype, which costs no memory, keeps the layout checks working, and which :func:`restore_state_` leaves for the
  rank that holds the tensor to broadcast.
- An optimizer state's 0-d entries are step counters (Adam's ``step``, kept on the CPU even when the moments live on
  a GPU); checks of optimizer states pass ``scalars=False`` to leave them out.

Example:
    >>> model = torch.nn.Linear(2, 1)
    >>> snapshot = take_snapshot(model.state_dict())
    >>> with torch.no_grad():
    ...     _ = model.weight.fill_(float("nan"))
    >>> nonfinite_flag(state_tensors(model.state_dict())).item()
    1.0
    >>> restore_state_(model.state_dict(), snapshot)
    >>> bool(torch.isfinite(model.weight).all())
    True
"""

from __future__ import annotations

import copy
import itertools
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_overflow.numerics.norms import is_sharded, local_shard, real_values, tensor_norms
from lightning_overflow.numerics.state import parameters_of

__all__ = [
    "SnapshotError",
    "clone_state",
    "group_sizes",
    "held_nbytes",
    "is_placeholder",
    "local_state",
    "named_state_tensors",
    "nonfinite_flag",
    "nonfinite_indices",
    "nonfinite_paths",
    "nonfinite_suspect",
    "partition_by_size",
    "restore_optimizer_",
    "restore_state_",
    "state_difference",
    "state_matches",
    "state_nbytes",
    "state_tensors",
    "synchronize",
    "take_snapshot",
    "without_placeholders",
]


class SnapshotError(ValueError):
    """A snapshot cannot be used: its file is unreadable or not a snapshot, or its structure differs from the state
    it should be restored into."""


# ---- taking and restoring ---------------------------------------------------------------------------------------
def take_snapshot(state: Any, reuse: Any = None, held: Sequence[bool] | None = None) -> Any:
    """Copy ``state`` into host buffers, without reading anything back to the host.

    Plain values (numbers, strings, ``None``) are deep-copied; every tensor is copied into a host buffer (pinned for
    CUDA tensors; a ``meta`` tensor gets a ``meta`` buffer) with one batched, non-blocking copy. A ``DTensor`` is
    copied as its local shard.

    Args:
        state: the live state (a ``state_dict()`` or any nesting of dicts, lists and tuples of them).
        reuse: a snapshot that is no longer needed: its buffers are reused wherever a tensor has the same position,
            shape and dtype. Its contents are overwritten.
        held: for each tensor of ``state`` (in :func:`state_tensors` order), whether this snapshot holds it; a tensor
            not held becomes a placeholder (a ``meta`` tensor: no copy, no memory). Default: every tensor is held.

    Returns:
        The snapshot: the nesting of ``state`` with host tensors (an ``OrderedDict`` keeps its ``_metadata``).
    """
    dst: list[Tensor] = []
    src: list[Tensor] = []
    position = itertools.count()

    def walk(node: Any, old: Any) -> Any:
        if isinstance(node, Tensor):
            node = local_shard(node.detach())
            if held is not None and not held[next(position)]:
                return torch.empty(node.shape, dtype=node.dtype, device="meta")
            if node.layout != torch.strided:  # sparse and other layouts: a plain copy, outside the batched one
                return node.to("cpu", copy=True)
            buffer = old if _fits(old, node) else _host_buffer(node)
            dst.append(buffer)
            src.append(node)
            return buffer
        return _rebuild(node, old, walk)

    snapshot = walk(state, reuse)
    _copy_all(dst, src)
    return snapshot


def restore_state_(live: Any, snapshot: Any) -> None:
    """Copy the tensors of ``snapshot`` into the tensors of ``live``, in place, in one batched non-blocking copy.

    Plain values in ``live`` are left alone (they cannot be changed in place); the caller restores those. A
    ``DTensor`` of ``live`` gets its local shard restored; a placeholder of ``snapshot`` (see :func:`is_placeholder`)
    leaves its live tensor as it is, for the rank that holds it to broadcast.

    Raises:
        SnapshotError: the two nestings differ (keys, lengths, tensor shapes or dtypes), naming the first place.
            Nothing has been copied then.
    """
    dst: list[Tensor] = []
    src: list[Tensor] = []
    _pair(live, snapshot, dst, src, "")
    _copy_all(dst, src)


def state_matches(live: Any, snapshot: Any) -> bool:
    """Whether :func:`restore_state_` can copy ``snapshot`` into ``live`` in place."""
    return not state_difference(live, snapshot)


def state_difference(live: Any, snapshot: Any) -> str:
    """The first place where ``snapshot`` cannot be copied into ``live`` in place, or ``""`` when it can.

    Example:
        >>> state_difference({"w": torch.zeros(2)}, {"w": torch.zeros(3)})
        'w: live (2,) torch.float32 vs snapshot (3,) torch.float32'
    """
    try:
        _pair(live, snapshot, [], [], "")
    except SnapshotError as err:
        return str(err)
    return ""


def restore_optimizer_(optimizer: torch.optim.Optimizer, snapshot: Mapping[str, Any]) -> None:
    """Restore an optimizer from a snapshot of its ``state_dict()``: moments and step counts copied in place, plain
    values and param-group hyperparameters (``lr``, ``betas``...) set back.

    When the live state has another shape (a parameter that had no state when the snapshot was taken), the optimizer
    loads a clone of the snapshot instead, so the live state never shares memory with it. When param groups were
    added since the snapshot (the snapshot's groups are the first groups of the optimizer, parameter for parameter),
    the snapshot's groups are restored and the newer groups stay, their hyperparameters as they are now and their
    parameters without state, as they were when the groups were added.

    Args:
        optimizer: the live optimizer.
        snapshot: a snapshot of ``optimizer.state_dict()`` (see :func:`take_snapshot`).

    Raises:
        SnapshotError: the param groups of the snapshot are neither those of the optimizer nor its first ones
            (:func:`group_sizes` names both layouts). Nothing has been changed then.

    Example:
        >>> p, q = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
        >>> optimizer = torch.optim.SGD([p], lr=0.1, momentum=0.9)
        >>> snapshot = take_snapshot(optimizer.state_dict())
        >>> optimizer.add_param_group({"params": [q], "lr": 0.01})
        >>> restore_optimizer_(optimizer, snapshot)
        >>> [group["lr"] for group in optimizer.param_groups]
        [0.1, 0.01]
    """
    live = local_state(optimizer.state_dict())
    groups, saved_groups = live["param_groups"], snapshot["param_groups"]
    live_sizes, saved_sizes = group_sizes(groups), group_sizes(saved_groups)
    if live_sizes != saved_sizes:
        if live_sizes[: len(saved_sizes)] != saved_sizes:
            raise SnapshotError(
                f"param groups of {saved_sizes} parameters in the snapshot, {live_sizes} in the optimizer"
            )
        synchronize()  # the host clones the buffers: pending device-to-host copies into them must be done
        kept = _groups_back(saved_groups, groups)
        state = _loadable(optimizer, dict(snapshot["state"]))
        optimizer.load_state_dict({"state": state, "param_groups": kept + list(groups[len(saved_groups) :])})
        return
    if not state_matches(live["state"], snapshot["state"]):
        synchronize()
        kept = _groups_back(saved_groups, groups)
        optimizer.load_state_dict({**clone_state(snapshot), "state": _loadable(optimizer, snapshot["state"]),
                                   "param_groups": kept})  # fmt: skip
        return
    restore_state_(live["state"], snapshot["state"])
    params = parameters_of(optimizer)
    for index, values in snapshot["state"].items():
        for key, value in values.items():
            if not isinstance(value, Tensor):
                optimizer.state[params[index]][key] = copy.deepcopy(value)
    for group, saved in zip(optimizer.param_groups, saved_groups):
        group.update({k: copy.deepcopy(v) for k, v in saved.items() if k != "params"})


def _groups_back(saved_groups: Sequence[Mapping[str, Any]], live_groups: Sequence[Mapping[str, Any]]) -> list[Any]:
    """The snapshot's param groups (clones) over the live ones, whose keys that the snapshot lacks stay: a scheduler
    added since wrote them (``SWALR``'s ``swa_lr``, a scheduler's ``initial_lr``) and reads them at its next step,
    as the in-place restore leaves them."""
    return [
        {**live, **clone_state(saved), "params": list(live["params"])} for saved, live in zip(saved_groups, live_groups)
    ]


def local_state(state: Any) -> Any:
    """``state`` with every ``DTensor`` replaced by this rank's local shard: a view (writing into it writes the
    ``DTensor``), no copy and no collective. Plain values are kept as they are, not copied; a state without
    ``DTensor`` s comes back as an equal nesting of the same tensors.

    Example:
        >>> state = {"w": torch.ones(2), "step": 3}
        >>> local_state(state)["w"] is state["w"]
        True
    """
    if isinstance(state, Tensor):
        return local_shard(state) if is_sharded(state) else state
    if isinstance(state, Mapping):
        items = [(k, local_state(v)) for k, v in state.items()]
        out: Any = OrderedDict(items) if isinstance(state, OrderedDict) else dict(items)
        metadata = getattr(state, "_metadata", None)
        if metadata is not None:
            out._metadata = metadata
        return out
    if isinstance(state, (list, tuple)):
        items = [local_state(v) for v in state]
        return tuple(items) if isinstance(state, tuple) else items
    return state


def partition_by_size(sizes: Sequence[int], parts: int) -> list[int]:
    """Give each of ``len(sizes)`` items an owner in ``range(parts)`` so that the owners' total sizes are balanced:
    the largest item first, each to the least loaded owner (the lowest index on a tie). Deterministic: every rank
    computes the same owners from the same sizes.

    The largest owner's total is at most ``sum(sizes) / parts + max(sizes)`` (and within 4/3 of the best possible).

    Raises:
        ValueError: ``parts`` below 1, or a negative size.

    Example:
        >>> partition_by_size([10, 3, 7, 2], 2)
        [0, 1, 1, 0]
    """
    if parts < 1:
        raise ValueError(f"'parts' must be at least 1 (got {parts})")
    if any(size < 0 for size in sizes):
        raise ValueError(f"'sizes' must be non-negative (got {list(sizes)})")
    owners = [0] * len(sizes)
    loads = [0] * parts
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owner = min(range(parts), key=lambda r: (loads[r], r))
        owners[index] = owner
        loads[owner] += sizes[index]
    return owners


def is_placeholder(snapshot_tensor: Tensor, live_tensor: Tensor | None = None) -> bool:
    """Whether a snapshot's tensor is a placeholder for one that another rank holds: a ``meta`` tensor (for a live
    tensor that is not ``meta`` itself, when it is given)."""
    if snapshot_tensor.device.type != "meta":
        return False
    return live_tensor is None or local_shard(live_tensor).device.type != "meta"


def without_placeholders(snapshot: Any) -> Any:
    """``snapshot`` without its placeholders (dropped from dicts; ``None`` in lists and tuples, so that the positions
    of the others stay), for checks of the tensors a snapshot holds: paths of the others stay the same."""
    if isinstance(snapshot, Tensor):
        return None if is_placeholder(snapshot) else snapshot
    if isinstance(snapshot, Mapping):
        return {k: v for k, v in ((k, without_placeholders(v)) for k, v in snapshot.items()) if v is not None}
    if isinstance(snapshot, (list, tuple)):
        return [without_placeholders(v) for v in snapshot]
    return snapshot


def held_nbytes(snapshot: Any) -> int:
    """Bytes of host memory the tensors of ``snapshot`` occupy (placeholders cost none)."""
    return sum(t.numel() * t.element_size() for t in state_tensors(snapshot) if t.device.type != "meta")


def group_sizes(param_groups: Sequence[Mapping[str, Any]]) -> list[int]:
    """The number of parameters in each param group (of an optimizer or of its ``state_dict()``).

    Example:
        >>> group_sizes([{"params": [0, 1]}, {"params": [2]}])
        [2, 1]
    """
    return [len(group["params"]) for group in param_groups]


def clone_state(state: Any) -> Any:
    """A deep copy of ``state`` whose tensors are fresh clones (on their own devices)."""
    return _rebuild(state, None, lambda tensor, _: tensor.detach().clone())


def state_tensors(state: Any) -> list[Tensor]:
    """The tensors of a state, in a fixed order (dicts in key order, sequences in order)."""
    out: list[Tensor] = []
    _visit(state, "", lambda path, t: out.append(t))
    return out


def named_state_tensors(state: Any, prefix: str = "") -> list[tuple[str, Tensor]]:
    """``(dotted path, tensor)`` for the tensors of a state, in the order of :func:`state_tensors`.

    Example:
        >>> [path for path, _ in named_state_tensors({"w": torch.ones(1), "opt": [{"m": torch.ones(1)}]})]
        ['w', 'opt.0.m']
    """
    found: list[tuple[str, Tensor]] = []
    _visit(state, prefix, lambda path, t: found.append((path, t)))
    return found


def state_nbytes(state: Any) -> int:
    """Bytes held by the tensors of ``state``: the host memory one snapshot of it costs."""
    return sum(t.numel() * t.element_size() for t in state_tensors(state))


def synchronize() -> None:
    """Wait for pending non-blocking copies (CUDA only; a no-op on CPU). Call before the host reads a snapshot."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


# ---- finiteness -------------------------------------------------------------------------------------------------
def nonfinite_flag(
    tensors: Sequence[Tensor], device: torch.device | str | None = None, *, scalars: bool = True
) -> Tensor:
    """``1.0`` when some floating-point tensor holds inf or NaN, else ``0.0``; no host read.

    Computed from each tensor's largest magnitude, which propagates NaN and cannot overflow while the values are
    finite: finite values far beyond what a norm can square (``1e30``, ``3e38``) are not flagged. Integer tensors
    (counters such as BatchNorm's ``num_batches_tracked``) and empty tensors are ignored.

    Args:
        tensors: the tensors to check, on any devices.
        device: where the flag goes. Default: where :func:`~lightning_overflow.numerics.norms.tensor_norms` puts
            the magnitudes (the tensors' device). A copy to an accelerator is asynchronous; a copy to the CPU
            waits for the value, so the host may read it at once.
        scalars: ``False`` leaves 0-d tensors out too (pass it for optimizer states, whose 0-d entries are step
            counters).

    Returns:
        A 0-d float64 tensor.

    Example:
        >>> nonfinite_flag([torch.tensor([3.0, 4.0]), torch.tensor([1.0, float("inf")])])
        tensor(1., dtype=torch.float64)
        >>> nonfinite_flag([torch.full((1000,), 1e30)])
        tensor(0., dtype=torch.float64)
    """
    checked = [t.detach() for t in tensors if _checked(t, scalars)]
    if not checked:
        return torch.zeros((), dtype=torch.float64, device=device or "cpu")
    flag = _nonfinite_each(checked).any().to(torch.float64)
    return flag if device is None else _moved(flag, torch.device(device))


def nonfinite_suspect(tensors: Sequence[Tensor], *, scalars: bool = True) -> Tensor:
    """``1.0`` when some floating-point tensor may hold inf or NaN, else ``0.0``; no host read: the first look of a
    state check, a read of each tensor (about half of :func:`nonfinite_flag`'s max-abs on the CPU).

    A tensor that holds inf or NaN always raises it (inf and NaN propagate through a sum); finite values raise it
    only when their sum passes the floating-point range (FP32: values of about 1e32 and more), so a raised flag is
    decided by :func:`nonfinite_flag`. Sums are taken per tensor on the CPU (vectorised, one thread or several), as
    one fused L1 norm elsewhere; half-precision tensors are summed in float32.

    Args:
        tensors, scalars: as for :func:`nonfinite_flag`.

    Example:
        >>> nonfinite_suspect([torch.tensor([3.0, 4.0]), torch.tensor([1.0, float("nan")])])
        tensor(1., dtype=torch.float64)
        >>> nonfinite_suspect([torch.full((1000,), 1e30)]), nonfinite_suspect([torch.full((1000,), 1e36)])
        (tensor(0., dtype=torch.float64), tensor(1., dtype=torch.float64))
    """
    checked = [local_shard(t.detach()) for t in tensors if _checked(t, scalars)]
    if not checked:
        return torch.zeros((), dtype=torch.float64, device="cpu")
    by_device: dict[torch.device, list[Tensor]] = {}
    for t in checked:
        by_device.setdefault(t.device, []).append(real_values(t))
    out = next(iter(by_device))
    moved = out.type not in ("cpu", "meta")  # to an accelerator: asynchronously
    flags = [_sums_nonfinite(group).to(out, non_blocking=moved) for group in by_device.values()]
    flag = flags[0] if len(flags) == 1 else torch.stack(flags).any()
    return flag.to(torch.float64)


def _sums_nonfinite(tensors: list[Tensor]) -> Tensor:
    """Whether some tensor's sum (of magnitudes, off the CPU) is not finite: a 0-d bool tensor on their device."""
    if tensors[0].device.type == "cpu":
        sums = [t.sum(dtype=torch.float32) if t.dtype in _HALF else t.sum() for t in tensors]
    else:
        sums = []
        for dtype in {t.dtype for t in tensors}:
            group = [t for t in tensors if t.dtype == dtype]
            kwargs = {"dtype": torch.float32} if dtype in _HALF else {}
            sums += torch._foreach_norm(group, 1, **kwargs)
    stacked = torch.stack(sums) if len({s.dtype for s in sums}) == 1 else torch.stack([s.double() for s in sums])
    return ~torch.isfinite(stacked).all()


def nonfinite_indices(tensors: Sequence[Tensor], *, scalars: bool = True) -> list[int]:
    """Positions in ``tensors`` of the floating-point tensors that hold inf or NaN (the rule of
    :func:`nonfinite_flag`), with one host read. For messages, off the hot path.

    Example:
        >>> nonfinite_indices([torch.tensor([float("nan")]), torch.full((1000,), 1e30), torch.tensor([-float("inf")])])
        [0, 2]
    """
    positions = [i for i, t in enumerate(tensors) if _checked(t, scalars)]
    if not positions:
        return []
    flags = _nonfinite_each([tensors[i].detach() for i in positions]).tolist()
    return [i for i, bad in zip(positions, flags) if bad]


def nonfinite_paths(state: Any, prefix: str = "", *, scalars: bool = True) -> list[str]:
    """Dotted paths of the floating-point tensors of ``state`` that hold inf or NaN (one host read).

    For messages, off the hot path. Example: ``["net.0.weight"]`` for a model state, ``["state.0.exp_avg_sq"]``
    for an optimizer state (pass ``scalars=False`` there to leave the step counters out, as :func:`nonfinite_flag`).
    """
    found = named_state_tensors(state, prefix)
    return [found[i][0] for i in nonfinite_indices([t for _, t in found], scalars=scalars)]


# ---- internals --------------------------------------------------------------------------------------------------
_HALF = (torch.float16, torch.bfloat16)


def _loadable(optimizer: torch.optim.Optimizer, saved_state: Mapping[Any, Any]) -> dict[Any, Any]:
    """A clone of a snapshot's optimizer ``state`` that ``optimizer.load_state_dict`` can keep: the moments of a
    ``DTensor`` parameter wrapped back into a ``DTensor`` of its layout (the snapshot holds the local shard), and
    placeholders made empty tensors (the rank that holds them broadcasts their values afterwards)."""
    params = parameters_of(optimizer)
    out: dict[Any, Any] = {}
    for index, values in clone_state(dict(saved_state)).items():
        param = params[index] if isinstance(index, int) and index < len(params) else None
        entry = {}
        for key, value in values.items():
            if isinstance(value, Tensor) and value.device.type == "meta":
                value = torch.empty(value.shape, dtype=value.dtype)
            if isinstance(value, Tensor) and param is not None and is_sharded(param) and value.dim() > 0:
                value = _like_parameter(value, param)
            entry[key] = value
        out[index] = entry
    return out


def _like_parameter(shard: Tensor, param: Tensor) -> Tensor:
    """A ``DTensor`` with ``param``'s mesh, placements and global shape whose local shard is ``shard``."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        shard.to(local_shard(param).device),
        param.device_mesh,  # type: ignore[attr-defined]
        param.placements,  # type: ignore[attr-defined]
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


def _fits(old: Any, new: Tensor) -> bool:
    if not isinstance(old, Tensor) or old.shape != new.shape or old.dtype != new.dtype:
        return False
    return old.device.type == ("meta" if new.device.type == "meta" else "cpu")


def _host_buffer(t: Tensor) -> Tensor:
    if t.device.type == "meta":
        return torch.empty(t.shape, dtype=t.dtype, device="meta")
    return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.device.type == "cuda")


def _checked(t: Tensor, scalars: bool) -> bool:
    """Whether a finiteness check reads ``t``: floating point, not empty on this rank (a ``DTensor``'s shard may
    be), and not 0-d unless ``scalars``."""
    return (t.is_floating_point() or t.is_complex()) and local_shard(t).numel() > 0 and (scalars or t.dim() > 0)


def _nonfinite_each(tensors: list[Tensor]) -> Tensor:
    """Per tensor, whether it holds inf or NaN (a ``DTensor``: its shard on this rank): a bool tensor, computed
    without a host read."""
    return ~torch.isfinite(tensor_norms([_fp32_proxy(local_shard(t)) for t in tensors], math.inf))


def _fp32_proxy(t: Tensor) -> Tensor:
    """``t`` itself, or for float64 a 2-element stand-in with the same verdict whose magnitude fits in FP32.

    :func:`tensor_norms` returns FP32 magnitudes, and finite float64 values beyond 3.4e38 would turn into inf there.
    The stand-in keeps only the non-finite bounds of ``t`` (its minimum and maximum, computed in float64).
    """
    if t.dtype == torch.complex128:
        t = real_values(t)  # the real and imaginary parts: non-finite where either is
    if t.dtype != torch.float64:
        return t
    bounds = torch.stack(torch.aminmax(t))  # NaN propagates through aminmax
    return torch.where(torch.isfinite(bounds), 0.0, bounds)


def _moved(t: Tensor, device: torch.device) -> Tensor:
    """``t`` on ``device``: asynchronously to an accelerator, blocking to the CPU (the host may read it at once)."""
    return t.to(device, non_blocking=device.type not in ("cpu", "meta"))


def _copy_all(dst: list[Tensor], src: list[Tensor]) -> None:
    if dst:
        # One batched copy; across devices it is asynchronous wherever the host side is pinned.
        torch._foreach_copy_(dst, src, non_blocking=True)


def _rebuild(node: Any, old: Any, leaf: Any) -> Any:
    """Rebuild a nesting, calling ``leaf(tensor, old_counterpart)`` for tensors; other leaves are deep-copied."""
    if isinstance(node, Tensor):
        return leaf(node, old)
    if isinstance(node, Mapping):
        old_map = old if isinstance(old, Mapping) else {}
        items = [(k, _rebuild(v, old_map.get(k), leaf)) for k, v in node.items()]
        out: Any = OrderedDict(items) if isinstance(node, OrderedDict) else dict(items)
        metadata = getattr(node, "_metadata", None)
        if metadata is not None:  # a module state_dict's version info, read by load_state_dict
            out._metadata = copy.deepcopy(metadata)
        return out
    if isinstance(node, (list, tuple)):
        olds = old if isinstance(old, (list, tuple)) and len(old) == len(node) else [None] * len(node)
        items = [_rebuild(v, o, leaf) for v, o in zip(node, olds)]
        return tuple(items) if isinstance(node, tuple) else items
    return copy.deepcopy(node)


def _pair(live: Any, snap: Any, dst: list[Tensor], src: list[Tensor], path: str) -> None:
    where = path or "<root>"
    if isinstance(live, Tensor):
        live = local_shard(live)
        if not isinstance(snap, Tensor):
            raise SnapshotError(f"{where}: the live state holds a tensor, the snapshot {type(snap).__name__}")
        if live.shape != snap.shape or live.dtype != snap.dtype:
            raise SnapshotError(
                f"{where}: live {tuple(live.shape)} {live.dtype} vs snapshot {tuple(snap.shape)} {snap.dtype}"
            )
        if is_placeholder(snap, live):
            return  # another rank holds it and broadcasts it
        # A sparse tensor's detached alias gets the copied indices and values, not the tensor: it is copied itself
        # (optimizer state, which autograd does not track: SGD's momentum of a sparse embedding's gradient)
        dst.append(live.detach() if live.layout == torch.strided else live)
        src.append(snap)
    elif isinstance(live, Mapping):
        if not isinstance(snap, Mapping) or set(live) != set(snap):
            missing = sorted(map(str, set(live) - set(snap))) if isinstance(snap, Mapping) else []
            extra = sorted(map(str, set(snap) - set(live))) if isinstance(snap, Mapping) else []
            raise SnapshotError(f"{where}: keys differ (missing {missing[:5]}, unexpected {extra[:5]})")
        for key, value in live.items():
            _pair(value, snap[key], dst, src, f"{path}.{key}" if path else str(key))
    elif isinstance(live, (list, tuple)):
        if not isinstance(snap, (list, tuple)) or len(live) != len(snap):
            raise SnapshotError(f"{where}: a sequence of another length")
        for i, (value, other) in enumerate(zip(live, snap)):
            _pair(value, other, dst, src, f"{path}.{i}" if path else str(i))
    elif isinstance(snap, Tensor):
        raise SnapshotError(f"{where}: the snapshot holds a tensor, the live state {type(live).__name__}")


def _visit(node: Any, path: str, fn: Any) -> None:
    if isinstance(node, Tensor):
        fn(path, node)
    elif isinstance(node, Mapping):
        for key, value in node.items():
            _visit(value, f"{path}.{key}" if path else str(key), fn)
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            _visit(value, f"{path}.{i}" if path else str(i), fn)
