"""Headroom: how many decades separate the largest magnitude of a step from the FP32 limit (3.4e38).

A run rarely jumps from healthy to inf: activations and gradients grow for a while first. Measured every few steps,
the headroom shows the run approaching the cliff before it falls. Sources: the loss and the gradient norm (values the
suite reads anyway) and the activations, sampled with temporary forward hooks on that step only (no cost on other
steps). The sampler keeps device tensors; nothing is read until the step's one host read.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_overflow.diagnosis.tracer import floating_tensors
from lightning_overflow.health import StepHealth
from lightning_overflow.numerics import FP32_MAX

__all__ = ["ActivationSampler", "Headroom", "HeadroomProbe", "decades_below_fp32"]


def decades_below_fp32(magnitude: float) -> float:
    """``log10(3.4e38 / magnitude)``: 0 at or beyond the limit (and for inf/NaN), ``inf`` for 0.

    Example:
        >>> round(decades_below_fp32(3.4028234663852886e28), 6), decades_below_fp32(float("nan"))
        (10.0, 0.0)
    """
    magnitude = abs(magnitude)
    if not math.isfinite(magnitude) or magnitude >= FP32_MAX:
        return 0.0
    if magnitude == 0.0:
        return math.inf
    return math.log10(FP32_MAX / magnitude)


F64_SCALE = FP32_MAX / torch.finfo(torch.float64).max
"""A float64 value times this is as far below FP32's limit as the value is below float64's: each value is measured
against the range of its own dtype (a float64 loss of 1e40 is 268 decades from overflowing, not 0)."""


def _decades(magnitude: float, float64: bool) -> float:
    return decades_below_fp32(magnitude * F64_SCALE if float64 else magnitude)


@dataclass(frozen=True)
class Headroom:
    """The headroom of one sampled step.

    Attributes:
        step: the ``global_step`` of the sample.
        decades: the smallest headroom over the sources measured.
        loss, grad, activation: each source's headroom (``None``: not measured, e.g. no module ran).
        module, module_type: the module whose output had the largest magnitude.
        rank: the rank where that activation was seen.
        magnitude: that activation's largest magnitude.
        loss_value, grad_norm: the step's mean loss and total gradient norm.
        limit: the largest finite value of the dtype of the source with the least headroom (FP32's 3.4e38, or
            float64's 1.8e308), which ``decades`` is measured against.
    """

    step: int
    decades: float
    loss: float | None
    grad: float | None
    activation: float | None
    module: str | None = None
    module_type: str | None = None
    rank: int | None = None
    magnitude: float = 0.0
    loss_value: float = math.nan
    grad_norm: float = math.nan
    limit: float = FP32_MAX

    @property
    def source(self) -> str:
        """The source with the least headroom: ``"loss"``, ``"grad"`` or ``"activation"``."""
        measured = {k: v for k, v in (("activation", self.activation), ("grad", self.grad), ("loss", self.loss))
                    if v is not None}  # fmt: skip
        return min(measured, key=measured.__getitem__) if measured else "loss"

    def describe(self, distributed: bool = False) -> str:
        """``"the output of net.5 (Linear) reached 1.6e+26"`` for the source with the least headroom."""
        if self.source == "activation":
            where = f" on rank {self.rank}" if distributed else ""
            return f"the output of {self.module} ({self.module_type}) reached {self.magnitude:.3g}{where}"
        text = f"the gradient norm reached {self.grad_norm:.3g}" if self.source == "grad" else (
            f"the loss reached {self.loss_value:.3g}")  # fmt: skip
        if self.module is not None:
            text += f" (the largest activation, {self.magnitude:.3g}, came out of {self.module} ({self.module_type}))"
        return text

    def metrics(self) -> dict[str, float]:
        """The logged keys (``overflow/headroom_decades`` and one per measured source)."""
        metrics = {"overflow/headroom_decades": self.decades}
        for source in ("loss", "grad", "activation"):
            value = getattr(self, source)
            if value is not None:
                metrics[f"overflow/headroom_{source}_decades"] = value
        return metrics


class ActivationSampler:
    """Temporary forward hooks on every module: the largest |output| of each, kept on the device.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> sampler = ActivationSampler()
        >>> sampler.attach(model)
        >>> _ = model(torch.ones(1, 2))
        >>> value, index = sampler.largest(torch.device("cpu"))
        >>> sampler.detach()
        >>> sampler.active, sampler.module(int(index))[0] in ("0", "1")
        (False, True)
    """

    def __init__(self) -> None:
        self._handles: list[Any] = []
        self._modules: list[tuple[str, str]] = []
        self._maxima: dict[int, Tensor] = {}
        self._float64: set[int] = set()  # the modules whose largest output was measured in float64 terms

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def attach(self, model: nn.Module) -> None:
        """Hook every module; children come before their parents, so a tie names the innermost module."""
        self.detach()
        modules = list(model.named_modules())[::-1]
        self._modules = [(name, type(module).__name__) for name, module in modules]
        for index, (_, module) in enumerate(modules):
            self._handles.append(module.register_forward_hook(functools.partial(self._observe, index)))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._maxima.clear()
        self._float64.clear()

    def _observe(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        tensors = [t for t in floating_tensors(output) if t.numel()]
        if not tensors:
            return
        with torch.no_grad():
            device = tensors[0].device
            value = torch.stack([_magnitude(t).to(device) for t in tensors]).amax()
            if any(t.dtype == torch.float64 for t in tensors):
                self._float64.add(index)
            previous = self._maxima.get(index)
            self._maxima[index] = value if previous is None else torch.maximum(previous, value)

    def largest(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """The largest magnitude seen and its module's index, as float64 device tensors (no host read). ``(0, -1)``
        when no module ran."""
        if not self._maxima:
            zero = torch.zeros((), dtype=torch.float64, device=device)
            return zero, zero - 1
        # torch.full launches a fill with the value as an argument; torch.tensor(list, device=...) would copy from
        # pageable host memory, which waits for the device.
        indices = torch.stack([torch.full((), float(i), dtype=torch.float64, device=device) for i in self._maxima])
        values = torch.stack([v.to(device) for v in self._maxima.values()]).double()
        value, best = torch.nan_to_num(values, nan=math.inf).max(dim=0)
        return value, indices.index_select(0, best.reshape(1)).reshape(())  # indexing with a tensor would read it

    def module(self, index: int) -> tuple[str, str]:
        """``(qualified name, class name)`` of the module at ``index``."""
        return self._modules[index]

    def float64(self, index: int) -> bool:
        """Whether the module at ``index`` output float64 (its magnitude is in float64 terms, :data:`F64_SCALE`)."""
        return index in self._float64

    def __getstate__(self) -> dict[str, Any]:
        return {"_handles": [], "_modules": list(self._modules), "_maxima": {}, "_float64": set()}


def _magnitude(tensor: Tensor) -> Tensor:
    """The largest finite ``|value|`` of ``tensor`` in FP32 terms, as a 0-d float64 tensor. Its inf/NaN are left out:
    the probe reads healthy steps only, whose loss they never reached (nequip fills the stress of a molecule without
    a cell with NaN, and no loss reads it). A float64 output is measured against its own range, scaled to FP32's
    (:data:`F64_SCALE`)."""
    magnitude = tensor.detach().abs()  # a new tensor: filled in place
    largest = magnitude.masked_fill_(~torch.isfinite(magnitude), 0).amax().double()
    if tensor.dtype == torch.float64:
        largest = largest * F64_SCALE
    return largest


class HeadroomProbe:
    """Headroom every ``every`` optimizer steps, inside the suite's one host read per step.

    At the start of a sampled step it hooks every module (:class:`ActivationSampler`); when the step record is built
    it puts each rank's largest activation and its module in per-rank slots of the record (no read of its own); once
    the record is read, :meth:`read` turns the slots, the loss and the gradient norm into a :class:`Headroom`.

    Args:
        every: sample every this many optimizer steps (the first step is sampled).
        key: the record key for this probe's slots.
    """

    def __init__(self, every: int, key: str) -> None:
        self.every = every
        self.key = key
        self.sampler = ActivationSampler()
        self._started: int | None = None

    def reset(self) -> None:
        """Forget the last sampled step (a new fit starts counting at its own step 0)."""
        self.release()
        self._started = None

    def on_batch_start(self, model: nn.Module, step: int) -> None:
        if self.sampler.active or (self._started is not None and step - self._started < self.every):
            return
        self.sampler.attach(model)
        self._started = step

    def on_batch_end(self, step: int) -> None:
        """Unhook once the sampled step is over (accumulated micro-batches keep sampling until it steps)."""
        if self._started is not None and step > self._started:
            self.sampler.detach()

    def release(self) -> None:
        self.sampler.detach()

    def contribute(self, record: StepHealth) -> None:
        if not self.sampler.active:
            return
        device = record.grad_norms.device
        value, index = self.sampler.largest(device)
        self.sampler.detach()
        slots = torch.zeros(2 * record.world_size, dtype=torch.float64, device=device)
        slots[record.rank] = value
        slots[record.world_size + record.rank] = index
        record.add(self.key, slots, summed=True)

    def read(self, record: StepHealth) -> Headroom | None:
        """The headroom of a healthy sampled step (``None`` for other steps: a non-finite step has none)."""
        healthy = record.loss_finite and record.grads_finite and not record.grads_beyond_fp32
        if not record.has(self.key) or not healthy:
            return None
        values, world = record.value(self.key), record.world_size
        magnitudes, indices = values[:world], values[world:]
        rank = max(range(world), key=lambda r: magnitudes[r])
        activation = module = module_type = None
        magnitude, wide = 0.0, False
        if indices[rank] >= 0 and magnitudes[rank] > 0:
            activation = decades_below_fp32(magnitudes[rank])
            module, module_type = self.sampler.module(int(indices[rank]))
            wide = self.sampler.float64(int(indices[rank]))
            magnitude = magnitudes[rank] / F64_SCALE if wide else magnitudes[rank]
        loss_mean, norm = record.loss_mean, record.total_norm
        loss = _decades(loss_mean, record.loss_float64) if math.isfinite(loss_mean) and loss_mean else None
        grad = _decades(norm, record.grads_float64) if norm > 0 else None
        sources = [(v, f) for v, f in ((activation, wide), (grad, record.grads_float64), (loss, record.loss_float64))
                   if v is not None]  # fmt: skip
        least = min(sources, default=(math.inf, False))
        return Headroom(
            step=record.step,
            decades=least[0],
            loss=loss,
            grad=grad,
            activation=activation,
            module=module,
            module_type=module_type,
            rank=rank if module is not None else None,
            magnitude=magnitude,
            loss_value=loss_mean,
            grad_norm=norm,
            limit=FP32_MAX / F64_SCALE if least[1] else FP32_MAX,
        )

    def __getstate__(self) -> dict[str, Any]:
        return {"every": self.every, "key": self.key, "sampler": self.sampler, "_started": None}
