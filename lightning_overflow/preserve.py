"""Leave no trace: a replay or a second candidate must not move the RNG streams, the BatchNorm statistics, any
metric's state or whatever ``training_step`` writes on the module's Python attributes.

A replay (the diagnosis re-running a failing batch) and a trial's candidate (:mod:`lightning_overflow.candidate`) run
the user's own ``training_step`` on the user's own module. Its tensors are swapped or put back; what it writes beside
them (a list of losses, a counter, a queue held as a plain tensor) is the module's *Python state*, which
:func:`capture_attributes` copies and :func:`put_back_attributes` puts back. :func:`side_run` tells user code which of
the two is running.

Which attributes are kept, module by module (every submodule is walked):

- only modules of the user's own classes: those of torch, Lightning and torchmetrics (``nn.Linear``, ``BatchNorm``)
  keep no Python state in ``forward``, and a torchmetrics ``Metric`` has its own put-back (:func:`metric_states`);
- of those, every ``__dict__`` entry except the library's own: the names a fresh ``nn.Module()`` sets (the
  parameter, buffer, submodule and hook dicts, ``training``) and, for a LightningModule, those a fresh
  ``LightningModule()`` sets (``_trainer``, ``_fabric``, ``_current_fx_name``, ``_metric_attributes``...);
- and except entries that hold a submodule (walked on its own), a ``torch.Generator`` (put back with the random
  streams) or an object of Lightning (the trainer, ``hparams``): the suite's business, never copied.

How each is put back: a rebound attribute (an int, a str, a new object) gets its old reference back, and an added one
is removed; a list, dict, set, ``deque`` or ``bytearray`` gets its old contents back *in place* (others may hold a
reference to it), containers nested in it too; a plain tensor attribute (not a parameter nor a buffer: a queue, an
accumulator) is cloned and copied back in place. The rest is shared: objects of other classes are put back as
references, never copied (their own attributes, the tensors inside a list, the containers inside a tuple), as is
everything outside the module (files, prints, globals, external loggers). Cost, per capture: a shallow copy of each
container and a clone of each plain tensor attribute; nothing for a module whose classes add no attributes.

The batch is the other thing ``training_step`` may write into: schnetpack's models put their predictions into the
input dict, over the targets. Each side run, and the batch a detector keeps for its diagnosis, get
:func:`batch_copy`: the containers copied, the tensors shared.
"""

from __future__ import annotations

import abc
import copy
import functools
import random
import sys
import warnings
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn

from lightning_overflow.exceptions import OverflowWarning

__all__ = [
    "ModuleAttributes",
    "RngState",
    "batch_copy",
    "capture_attributes",
    "capture_rng",
    "is_metric",
    "metric_state",
    "metric_states",
    "preserved_state",
    "put_back_attributes",
    "put_back_metric_states",
    "restore_rng",
    "running_aside",
    "side_run",
]

_SIDE_RUN: ContextVar[str | None] = ContextVar("lightning_overflow_side_run", default=None)


def side_run() -> str | None:
    """What the suite is running on your module besides the run's own steps: ``None`` during the run's own steps,
    ``"trial"`` while a trial's candidate runs your ``training_step``, ``"replay"`` while the diagnosis replays a
    failing batch.

    Your module's tensors and its Python attributes (lists, dicts, counters, plain tensors) are kept apart for you;
    what lies outside it is not: objects of your own classes held by the module, files, prints, globals, an external
    logger or counter. Guard those with it.

    Example:
        >>> import pytorch_lightning as pl
        >>> from lightning_overflow import side_run
        >>> class Model(pl.LightningModule):
        ...     def training_step(self, batch, batch_idx):
        ...         loss = self.layer(batch).sum()
        ...         if side_run():  # "trial" or "replay": not one of the run's own steps
        ...             return loss
        ...         print(f"step {self.global_step}: {float(loss)}")  # the run's own steps only
        ...         return loss
        >>> side_run() is None  # outside the suite's side runs
        True
    """
    return _SIDE_RUN.get()


@contextmanager
def running_aside(kind: str) -> Iterator[None]:
    """:func:`side_run` answers ``kind`` inside the body."""
    token = _SIDE_RUN.set(kind)
    try:
        yield
    finally:
        _SIDE_RUN.reset(token)


@dataclass(frozen=True)
class RngState:
    """The torch random streams: the CPU generator and, once CUDA is initialised, every CUDA device's generator."""

    cpu: Tensor
    cuda: tuple[Tensor, ...] | None


def batch_copy(batch: Any) -> Any:
    """``batch`` with its containers (dicts, lists, tuples, named tuples, dataclasses) and records (:class:`_Record`:
    a PyTorch Geometric ``Data``/``Batch``) copied, and its tensors shared: what ``training_step`` writes into the
    copy (a model that puts its outputs into its input dict, ``data.x = self.encoder(data.x)``) leaves the original
    as the loop will read it. Objects of other classes are shared as they are, and so is a batch whose containers
    cannot be rebuilt so (a mapping whose constructor takes other arguments)."""
    if isinstance(batch, Tensor):
        return batch
    try:
        return apply_to_collection(batch, (Tensor, _Record), _leaf_copy)
    except Exception:  # noqa: BLE001  (Lightning's own transfer rebuilds the batches it moves the same way)
        return batch


class _Record(abc.ABC):
    """A batch element that copies itself shallowly and gives itself as a dict (``__copy__`` and ``to_dict``, as
    PyTorch Geometric's ``Data`` does): copied with ``copy.copy``, its tensors shared."""

    @classmethod
    def __subclasshook__(cls, other: type) -> bool:
        if issubclass(other, Tensor):
            return NotImplemented  # type: ignore[return-value]
        copies = any("__copy__" in vars(base) for base in other.__mro__[:-1])
        return True if copies and callable(getattr(other, "to_dict", None)) else NotImplemented  # type: ignore[return-value]


def _leaf_copy(value: Any) -> Any:
    return value if isinstance(value, Tensor) else copy.copy(value)


def capture_rng() -> RngState:
    """The torch random streams now (a 5 KB copy of the CPU state; CUDA states are a seed and an offset, no sync)."""
    # is_initialized() alone: CUDA that is not available is never initialised, and the availability check costs
    # more than the copy on every training batch.
    cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() else None
    return RngState(torch.get_rng_state(), cuda)


def restore_rng(state: RngState) -> None:
    torch.set_rng_state(state.cpu)
    if state.cuda is not None:
        torch.cuda.set_rng_state_all(list(state.cuda))


@contextmanager
def preserved_state(module: nn.Module, start_rng: RngState | None = None, kind: str = "replay") -> Iterator[None]:
    """Run the body, then put back every random stream, every buffer of ``module``, every metric's state and the
    modules' Python attributes (:func:`capture_attributes`); :func:`side_run` answers ``kind`` inside it.

    Random streams: torch's CPU and CUDA generators, Python's ``random``, NumPy's global generator, and every
    ``torch.Generator`` stored as an attribute of one of the modules (those are put back, not rewound to the start
    of the step: the body runs with their current state).

    Parameters that no optimizer trains (``requires_grad=False``) are put back too: a momentum encoder or an EMA
    teacher that ``training_step`` updates in place (MoCo's, BYOL's, DINO's) would otherwise take one more update per
    replay. The trained parameters and their ``.grad`` are the caller's business (compute gradients with
    ``torch.autograd.grad``, which leaves ``.grad`` alone).

    Args:
        module: the model whose buffers (BatchNorm running statistics and counters) and torchmetrics states are kept.
        start_rng: the torch random streams to run the body with (those of the step being replayed, so that dropout
            draws the same masks); ``None`` runs it with the current streams.
        kind: what :func:`side_run` answers inside the body (default ``"replay"``).

    Example:
        >>> bn = nn.BatchNorm1d(2)
        >>> with preserved_state(bn):
        ...     _ = bn(torch.randn(4, 2))
        >>> bn.running_mean, int(bn.num_batches_tracked)
        (tensor([0., 0.]), 0)
    """
    rng = capture_rng()
    python_rng = random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_rng = numpy.random.get_state() if numpy is not None else None
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    frozen = [(p, p.detach().clone()) for p in module.parameters() if not p.requires_grad]
    metrics = metric_states(module)
    owned = [g for m in module.modules() for g in vars(m).values() if isinstance(g, torch.Generator)]
    generators = [(g, g.get_state()) for g in owned]
    attributes = capture_attributes(module)
    if start_rng is not None:
        restore_rng(start_rng)
    try:
        with running_aside(kind):
            yield
    finally:
        put_back_attributes(attributes)
        restore_rng(rng)
        for generator, state in generators:
            generator.set_state(state)
        random.setstate(python_rng)
        if numpy is not None:
            numpy.random.set_state(numpy_rng)
        with torch.no_grad():
            for live, saved in buffers + frozen:
                live.copy_(saved)
        put_back_metric_states(metrics)


def metric_states(module: nn.Module) -> list[tuple[nn.Module, dict[str, Any]]]:
    """A copy of the state of every torchmetrics ``Metric`` among ``module``'s submodules."""
    return [(m, metric_state(m)) for m in module.modules() if is_metric(m)]


def put_back_metric_states(states: list[tuple[nn.Module, dict[str, Any]]]) -> None:
    """Put back the states :func:`metric_states` copied."""
    for metric, state in states:
        for name, value in state.items():
            setattr(metric, name, value)


def is_metric(module: nn.Module) -> bool:
    """A torchmetrics ``Metric`` (duck-typed: its public ``metric_state`` property)."""
    return isinstance(getattr(type(module), "metric_state", None), property)


def metric_state(metric: nn.Module, share_lists: bool = False) -> dict[str, Any]:
    """A copy of one metric's state (and of its update count and cached result). ``share_lists``: a list state as a
    new list of the same tensors, enough where the metric is only updated since (an update appends to a list state;
    a copy of its tensors would cost every prediction collected so far)."""
    state: dict[str, Any] = {}
    for name, value in metric.metric_state.items():  # type: ignore[operator, union-attr]
        if isinstance(value, Tensor):
            state[name] = value.detach().clone()
        elif isinstance(value, list):
            state[name] = list(value) if share_lists else [v.detach().clone() if isinstance(v, Tensor) else v
                                                           for v in value]  # fmt: skip
        else:
            state[name] = value
    # What an update changes beside the states: its count, and the cached result of compute().
    for name in ("_update_count", "_computed"):
        if name in vars(metric):
            state[name] = vars(metric)[name]
    return state


# ---- the modules' Python attributes ---------------------------------------------------------------------------------
_LIGHTNING = ("pytorch_lightning", "lightning", "lightning_fabric")
_LIBRARIES = ("torch", "torchmetrics", *_LIGHTNING)
_CONTAINERS = (list, dict, set, deque, bytearray)
_DEPTH = 8  # containers nested deeper than this are put back as references
# What a LightningModule's save_hyperparameters() sets after its __init__ (checked against Lightning 2.6.6; everything
# else Lightning sets on the module is set in its __init__ first, and found by building one).
_LIGHTNING_LATER = frozenset({"_hparams", "_hparams_initial", "_hparams_name"})


@dataclass(frozen=True)
class ModuleAttributes:
    """The Python state of a module's submodules, as :func:`capture_attributes` copied it.

    Attributes:
        modules: per module walked, its kept attributes by name (each a reference, or a copy of a container's or a
            plain tensor's contents).
    """

    modules: tuple[tuple[nn.Module, dict[str, Any]], ...]


def capture_attributes(module: nn.Module) -> ModuleAttributes:
    """A copy of the Python attributes of ``module`` and its submodules (which ones: the module docstring).

    Example:
        >>> class Counting(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.losses, self.steps = [], 0
        >>> model = Counting()
        >>> kept = capture_attributes(model)
        >>> losses = model.losses
        >>> model.losses.append(0.5); model.steps += 1
        >>> put_back_attributes(kept)
        >>> model.losses, model.steps, model.losses is losses
        ([], 0, True)
    """
    memo: dict[int, Any] = {}
    walked = []
    for sub in module.modules():
        own = _library_names(type(sub))
        if own is None or is_metric(sub):
            continue
        kept = {name: _copy(value, memo, 0) for name, value in vars(sub).items() if _kept(name, value, own)}
        walked.append((sub, kept))
    return ModuleAttributes(tuple(walked))


def put_back_attributes(state: ModuleAttributes, accumulated_only: bool = False) -> None:
    """Put back the attributes :func:`capture_attributes` copied; remove those added since (containers keep their
    identity, plain tensors are written in place).

    Args:
        accumulated_only: put back only the containers and plain tensors (the state a ``training_step`` accumulates:
            lists, queues), and leave every other attribute as it is now (the settings and counters that code outside
            it, such as a callback, may have rebound since).
    """
    done: set[int] = set()
    for sub, kept in state.modules:
        own = _library_names(type(sub)) or frozenset()
        attributes = vars(sub)
        if not accumulated_only:
            for name in [n for n, v in attributes.items() if n not in kept and _kept(n, v, own)]:
                del attributes[name]
        for name, saved in kept.items():
            if not accumulated_only or isinstance(saved, (_Contents, _TensorContents)):
                attributes[name] = _restore(saved, done)


def _kept(name: str, value: Any, own: frozenset[str]) -> bool:
    if name in own or isinstance(value, (nn.Module, torch.Generator)):
        return False
    return _package(type(value)) not in _LIGHTNING


@functools.cache
def _library_names(cls: type) -> frozenset[str] | None:
    """The attribute names the libraries set on instances of ``cls`` (``None``: ``cls`` is a library's own class,
    whose Python state is not walked)."""
    if _package(cls) in _LIBRARIES:
        return None
    names = frozenset(vars(nn.Module()))
    base = next((c for c in cls.__mro__ if _package(c) in _LIGHTNING), None)
    if base is not None:
        names |= _LIGHTNING_LATER
        try:
            names |= frozenset(vars(base()))  # LightningModule(): its private attributes, set in its __init__
        except Exception:  # noqa: BLE001 - a Lightning base that needs arguments: nn.Module's names only
            pass
    return names


def _package(cls: type) -> str:
    return (getattr(cls, "__module__", None) or "").partition(".")[0]


@dataclass(slots=True)
class _Contents:
    """A container and a copy of its contents (items copied in turn where they are containers)."""

    container: Any
    items: Any = None


_CLONE_LIMIT = 64 << 20  # a plain tensor attribute larger than this (a dataset kept on the module) is not copied


@dataclass(frozen=True, slots=True)
class _TensorContents:
    """A plain tensor attribute, its in-place write counter, and a copy of its values (``None`` above
    ``_CLONE_LIMIT``: a side run that writes into it in place is then said, not undone)."""

    tensor: Tensor
    version: int
    clone: Tensor | None


def _copy(value: Any, memo: dict[int, _Contents], depth: int) -> Any:
    """What :func:`_restore` needs to put ``value`` back: ``value`` itself (a reference), or a copy of its contents
    (a container's, and a plain tensor's where it is an attribute itself: ``depth`` 0)."""
    if isinstance(value, Tensor):
        if depth:
            return value
        small = value.numel() * value.element_size() <= _CLONE_LIMIT
        return _TensorContents(value, value._version, value.detach().clone() if small else None)
    if not isinstance(value, _CONTAINERS) or depth >= _DEPTH:
        return value
    if id(value) in memo:  # held twice, or a cycle: copied once
        return memo[id(value)]
    saved = memo[id(value)] = _Contents(value)
    if isinstance(value, dict):
        saved.items = [(k, _copy(v, memo, depth + 1) if isinstance(v, _CONTAINERS) else v) for k, v in value.items()]
    elif isinstance(value, (set, bytearray)):
        saved.items = value.copy()
    else:  # list, deque
        saved.items = [_copy(v, memo, depth + 1) if isinstance(v, _CONTAINERS) else v for v in value]
    return saved


def _restore(saved: Any, done: set[int]) -> Any:
    """Put the contents back in place (once per call of :func:`put_back_attributes`); return the reference."""
    if isinstance(saved, _TensorContents):
        if id(saved) not in done and saved.tensor._version != saved.version:  # written in place since
            done.add(id(saved))
            tensor, clone = saved.tensor, saved.clone
            if clone is None:
                warnings.warn(
                    f"a side run of the suite (a trial's candidate or a replay) wrote in place into a tensor attribute "
                    f"of {tensor.numel() * tensor.element_size() >> 20} MiB, too large to copy before each side run: "
                    "the write stays. Guard it with lightning_overflow.side_run() in training_step.",
                    OverflowWarning,
                    stacklevel=2,
                )
                return tensor
            with torch.inference_mode() if tensor.is_inference() else torch.no_grad():
                if tensor.shape == clone.shape and tensor.dtype == clone.dtype:
                    tensor.copy_(clone)
                else:  # resized or cast in place: its old values back
                    tensor.data = clone.clone()
        return saved.tensor
    if not isinstance(saved, _Contents):
        return saved
    container = saved.container
    if id(saved) in done:
        return container
    done.add(id(saved))
    if isinstance(container, (set, bytearray)):
        container.clear()
        container.extend(saved.items) if isinstance(container, bytearray) else container.update(saved.items)
        return container
    if isinstance(container, dict):
        items = [(k, _restore(v, done) if isinstance(v, _Contents) else v) for k, v in saved.items]
        container.clear()
        for key, value in items:  # the container's own __setitem__ (a Counter's update() would add)
            container[key] = value
        return container
    values = [_restore(v, done) if isinstance(v, _Contents) else v for v in saved.items]
    container.clear()
    container.extend(values)  # list, deque (its maxlen kept)
    return container
