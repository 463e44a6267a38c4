"""Trace one forward and backward pass to the first value that became inf/NaN (fairseq's NanDetector idea).

What is in place while tracing, and removed on exit:

- on every module, a forward pre-hook and a forward hook (the stack of modules being run, each parametrised layer's
  output magnitude) and a full backward hook (each module's incoming and outgoing gradients);
- a ``TorchFunctionMode`` that checks the output of every torch op of the forward pass, so that the first
  non-finite value is pinned to its op (``exp``, ``log``, ``linear``) and the module running it, or to the loss
  computed outside every module;
- a hook on every autograd node of the backward pass, which pins the first non-finite gradient to its node
  (``ExpBackward0``, a custom ``Function``'s backward).

This costs a host read per op and per module: run it once a step is known to be bad, never on healthy steps.
Gradients are computed with ``torch.autograd.grad``, so ``.grad`` and any DDP reducer are left alone.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_overflow._validation import check_bool, check_type
from lightning_overflow.diagnosis.hints import find_growth
from lightning_overflow.diagnosis.records import Origin, Trace
from lightning_overflow.numerics import grad_norm_report
from lightning_overflow.numerics._float64 import summed_loss
from lightning_overflow.preserve import preserved_state

__all__ = ["NonFiniteTracer", "trace_nonfinite"]

_IGNORED = frozenset({
    "__get__", "__set__", "__delete__", "__repr__", "__format__", "__len__", "__bool__", "__float__", "__int__",
    "__index__", "__iter__", "__hash__", "__eq__", "__ne__", "size", "dim", "numel", "item", "tolist", "data_ptr",
    "is_floating_point", "requires_grad_", "register_hook", "retain_grad", "detach", "detach_", "untyped_storage",
})  # fmt: skip
MAX_NAMES = 20  # parameter names kept in a trace (it goes into the journal)
_DEPTH = 4  # how deep outputs and arguments are searched for tensors (tuples of tuples, dicts of lists)
# What torch warns of a full backward hook on a module whose output is no tensor (a library's own output or batch
# class, once per replay) or that it cannot serve: the replay falls back to the autograd nodes, so it says nothing.
_BACKWARD_HOOK_WARNING = r".*([Ff]ull backward hook|For backward hooks to be called).*"


@dataclass
class _Frame:
    name: str
    module_type: str
    start: int = 0  # the op clock when the module's call began


@dataclass
class _Stats:
    nan: int
    inf: int
    numel: int
    magnitude: float  # the largest finite |value|

    @property
    def kind(self) -> str:
        return "nan" if self.nan else "inf"


class NonFiniteTracer:
    """Hooks on every module of ``model`` and on every op, recording where the first inf/NaN appeared.

    Use it as a context manager around a forward pass, then call :meth:`backward` inside it, and :meth:`trace`
    after. :func:`trace_nonfinite` does all of it, leaving the model's state as it was.

    Args:
        model: the model whose modules are hooked (every module, the root included).
        module_backward_hooks: also register full backward hooks (default). They wrap each module's inputs and
            outputs in an identity autograd function, which in-place ops on those tensors reject; turn them off to
            trace such a model (the autograd node hooks still name the op).

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        >>> with NonFiniteTracer(model) as tracer:
        ...     loss = torch.log(-model(torch.ones(1, 2)).abs() - 1).sum()
        ...     _ = tracer.backward(loss)
        >>> origin = tracer.trace().forward_origin
        >>> origin.op, origin.kind, origin.where
        ('log', 'nan', 'training_step (outside every module)')
    """

    def __init__(self, model: nn.Module, module_backward_hooks: bool = True) -> None:
        self.model = check_type("model", model, nn.Module, "a torch.nn.Module")
        self.module_backward_hooks = check_bool("module_backward_hooks", module_backward_hooks)
        self._modules = [(name, m) for name, m in model.named_modules(remove_duplicate=True)]
        self._layers = {id(m) for _, m in self._modules if next(m.parameters(recurse=False), None) is not None}
        self._owners: dict[int, tuple[str, str, str]] = {}  # id(param) -> (module, module type, parameter name)
        for name, module in self._modules:
            for pname, param in module.named_parameters(recurse=False):
                self._owners.setdefault(id(param), (name, type(module).__name__, f"{name}.{pname}".lstrip(".")))
        self._handles: list[Any] = []
        self._stack: list[_Frame] = []
        self._creators: dict[Any, tuple[int, _Frame | None]] = {}  # autograd node -> (op clock, module running)
        self._clock = 0
        self._forward_trail: list[tuple[str, Tensor]] = []
        self._backward_trail: list[tuple[str, Tensor]] = []
        self._mode: _OpWatch | None = None
        self._quiet: Any = None  # the warnings filter of the traced region
        self.busy = False
        self.forward_origin: Origin | None = None
        self._module_origin: Origin | None = None  # backward, from the module hooks
        self._node_origin: tuple[Origin, Any] | None = None  # backward, from the autograd node hooks
        self._loss: Tensor | None = None
        self._params: list[Tensor] = []
        self._grads: Sequence[Tensor | None] = ()

    # ---- context --------------------------------------------------------------------------------------------------
    def __enter__(self) -> NonFiniteTracer:
        self._quiet = warnings.catch_warnings()
        self._quiet.__enter__()
        warnings.filterwarnings("ignore", message=_BACKWARD_HOOK_WARNING)
        for name, module in self._modules:
            self._handles.append(module.register_forward_pre_hook(functools.partial(self._enter_module, name)))
            self._handles.append(module.register_forward_hook(functools.partial(self._exit_module, name)))
            if self.module_backward_hooks:
                try:
                    hook = functools.partial(self._module_backward, name)
                    self._handles.append(module.register_full_backward_hook(hook))
                except RuntimeError:
                    pass  # the module already has old-style backward hooks, which exclude full ones
        self._mode = _OpWatch(self)
        self._mode.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._stop_ops()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._creators.clear()
        self._stack.clear()
        quiet, self._quiet = self._quiet, None
        if quiet is not None:
            quiet.__exit__(None, None, None)

    def _stop_ops(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None

    # ---- forward ----------------------------------------------------------------------------------------------
    def _enter_module(self, name: str, module: nn.Module, args: Any) -> None:
        self._clock += 1
        self._stack.append(_Frame(name, type(module).__name__, self._clock))

    def _exit_module(self, name: str, module: nn.Module, args: Any, output: Any) -> None:
        if self._stack and self._stack[-1].name == name:
            frame = self._stack.pop()
        else:
            frame = _Frame(name, type(module).__name__)
        if self.forward_origin is not None:
            return
        self.busy = True
        try:
            outputs = floating_tensors(output)
            self._claim_nodes(outputs, frame)
            if id(module) in self._layers and outputs:
                self._forward_trail.append((name, _magnitude(outputs)))
            # A safety net for ops the mode cannot see (compiled or scripted code): the module's own output.
            if outputs and _any_nonfinite(outputs):
                inputs = floating_tensors(args)
                source = "input" if _any_nonfinite(inputs) else "op"
                self.forward_origin = _origin("forward", source, frame, f"forward of {frame.module_type}",
                                              inputs, outputs)  # fmt: skip
        finally:
            self.busy = False

    def _claim_nodes(self, outputs: Sequence[Tensor], frame: _Frame) -> None:
        """Attribute to ``frame`` the autograd nodes its call created that the op mode did not see (a custom
        ``Function``'s node): unclaimed nodes reachable from its outputs through nodes created during the call."""
        stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
        seen = set(stack)
        while stack:
            node = stack.pop()
            if hasattr(node, "variable"):
                continue  # a leaf's accumulator
            known = self._creators.get(node)
            if known is None:
                self._creators[node] = (frame.start, frame)
            elif known[0] < frame.start:
                continue  # created before this call: an input
            for child, _ in node.next_functions:
                if child is not None and child not in seen:
                    seen.add(child)
                    stack.append(child)

    def _watch_op(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], run: Callable[[], Any]) -> Any:
        """Run one op of the forward pass; the first one whose output is non-finite becomes the forward origin."""
        if self.busy or self.forward_origin is not None or name in _IGNORED:
            return run()
        inputs = floating_tensors((args, kwargs))
        in_place = (name.endswith("_") and not name.endswith("__")) or name.startswith("__i") or kwargs.get("inplace")
        inputs_bad = (_any_nonfinite(inputs) or _nonfinite_number((args, kwargs))) if in_place else None
        output = run()
        self.busy = True
        try:
            outputs = floating_tensors(output)
            frame = self._stack[-1] if self._stack else None
            self._clock += 1
            for tensor in outputs:
                if tensor.grad_fn is not None:
                    self._creators.setdefault(tensor.grad_fn, (self._clock, frame))
            if outputs and _any_nonfinite(outputs):
                if inputs_bad is None:
                    inputs_bad = _any_nonfinite(inputs) or _nonfinite_number((args, kwargs))
                source = "input" if inputs_bad else "op"
                self.forward_origin = _origin("forward", source, frame, name, inputs, outputs)
        finally:
            self.busy = False
        return output

    # ---- backward ---------------------------------------------------------------------------------------------
    def backward(self, loss: Tensor, inputs: Sequence[Tensor] | None = None) -> tuple[Tensor | None, ...]:
        """Backward from ``loss`` with every autograd node hooked; returns the gradients without touching ``.grad``.

        Args:
            loss: the forward pass's result (summed if not a scalar).
            inputs: the tensors to differentiate (default: every parameter of the model that requires grad).
        """
        self._stop_ops()
        self._loss = loss.detach()
        params = list(inputs) if inputs is not None else [p for p in self.model.parameters() if p.requires_grad]
        self._params = params
        wanted = [i for i, p in enumerate(params) if p.requires_grad]
        if loss.grad_fn is None or not wanted:
            self._grads = tuple(None for _ in params)
            return tuple(self._grads)
        nodes = _graph(loss.grad_fn)
        handles = [node.register_hook(functools.partial(self._node_backward, node)) for node in nodes]
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_BACKWARD_HOOK_WARNING)
                target = loss if loss.numel() == 1 else loss.sum()
                computed = torch.autograd.grad(target, [params[i] for i in wanted], allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        grads: list[Tensor | None] = [None] * len(params)
        for i, grad in zip(wanted, computed):
            grads[i] = grad
        self._grads = tuple(grads)
        return self._grads

    def _module_backward(self, name: str, module: nn.Module, grad_input: Any, grad_output: Any) -> None:
        if self._module_origin is not None:
            return
        self.busy = True
        try:
            incoming = floating_tensors(grad_output)
            if id(module) in self._layers and incoming:
                self._backward_trail.append((name, _magnitude(incoming)))
            outgoing = floating_tensors(grad_input)
            if outgoing and _any_nonfinite(outgoing) and not _any_nonfinite(incoming):
                frame = _Frame(name, type(module).__name__)
                self._module_origin = _origin("backward", "op", frame, f"backward of {frame.module_type}",
                                              incoming, outgoing)  # fmt: skip
        finally:
            self.busy = False

    def _node_backward(self, node: Any, grad_inputs: Any, grad_outputs: Any) -> None:
        if self._node_origin is not None:
            return
        results = floating_tensors(grad_inputs)
        incoming = floating_tensors(grad_outputs)
        if results and _any_nonfinite(results) and not _any_nonfinite(incoming):
            origin = _origin("backward", "op", self._owner(node), node.name(), incoming, results)
            self._node_origin = (origin, node)

    def _owner(self, node: Any) -> _Frame | None:
        """The module that created ``node`` in the forward pass; for a node the op mode did not see (a custom
        ``Function``), the module that created its inputs, or the owner of the parameter it feeds."""
        queue, seen = [node], set()
        for _ in range(16):
            if not queue:
                break
            current = queue.pop(0)
            if current in self._creators:
                return self._creators[current][1]
            variable = getattr(current, "variable", None)
            if isinstance(variable, Tensor) and id(variable) in self._owners:
                name, module_type, _ = self._owners[id(variable)]
                return _Frame(name, module_type)
            seen.add(current)
            queue.extend(n for n, _ in current.next_functions if n is not None and n not in seen)
        return None

    # ---- the result -------------------------------------------------------------------------------------------
    def trace(self, names: Sequence[str] | None = None) -> Trace:
        """What the pass showed (host values).

        Args:
            names: names of the differentiated tensors, for messages (default: the model's parameter names when
                :meth:`backward` differentiated its parameters).
        """
        names = list(names) if names is not None else self._parameter_names()
        loss = float(summed_loss(self._loss)) if self._loss is not None else math.nan
        pairs = [(n, g) for n, g in zip(names, self._grads) if g is not None]
        report = grad_norm_report([g for _, g in pairs]) if pairs else None
        grad_norm = report.total if report is not None else 0.0
        bad = tuple(n for (n, _), s in zip(pairs, report.status) if s == "nonfinite") if report else ()
        bad = bad[:MAX_NAMES]
        largest = None
        if report is not None and report.per_tensor:
            finite = [(v, n) for (n, _), v in zip(pairs, report.per_tensor) if math.isfinite(v)]
            if finite:
                value, name = max(finite)
                largest = (name, value)
        forward_trail = _read_trail(self._forward_trail)
        backward_trail = _read_trail(self._backward_trail)
        return Trace(
            forward_origin=self.forward_origin,
            backward_origin=None if self.forward_origin is not None else self._backward_origin(pairs, bad),
            loss=loss,
            grad_norm=grad_norm,
            nonfinite_gradients=bad,
            largest_gradient=largest,
            forward_growth=find_growth(forward_trail, "forward"),
            backward_growth=find_growth(backward_trail, "backward"),
        )

    def _backward_origin(self, pairs: list[tuple[str, Tensor]], bad: tuple[str, ...]) -> Origin | None:
        # The node hooks name the op and the module that created it; the module hooks are the net for the rest.
        if self._node_origin is not None:
            return self._node_origin[0]
        if self._module_origin is not None:
            return self._module_origin
        if bad:  # every backward op was finite: a hook changed the parameter's gradient afterwards
            grads = dict(pairs)
            name = bad[0]
            owner = next((o for o in self._owners.values() if o[2] == name), None)
            stats = _stats([grads[name]])
            return Origin("backward", "gradient_hook", owner[0] if owner else None, owner[1] if owner else None,
                          "gradient hook", stats.kind, 0.0, stats.magnitude, stats.nan, stats.inf,  # type: ignore[arg-type]
                          stats.numel, parameter=name)  # fmt: skip
        return None

    def _parameter_names(self) -> list[str]:
        by_id = {id(p): n for n, p in self.model.named_parameters()}
        return [by_id.get(id(p), f"<input {i}>") for i, p in enumerate(self._params)]


class _OpWatch(TorchFunctionMode):
    """Sends every torch op of the forward pass through :meth:`NonFiniteTracer._watch_op`."""

    def __init__(self, tracer: NonFiniteTracer) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", None) or repr(func)
        return self.tracer._watch_op(name, args, kwargs, lambda: func(*args, **kwargs))


def trace_nonfinite(
    model: nn.Module, loss_fn: Callable[[], Tensor], module_backward_hooks: bool = True
) -> Trace:
    """Run ``loss_fn`` (a forward pass returning the loss) and its backward under :class:`NonFiniteTracer`.

    Usable in a plain PyTorch loop once a step came out non-finite. The model's parameters, their ``.grad``, its
    buffers (BatchNorm statistics), metric states and the random streams are as they were afterwards (the pass
    runs with the current random streams, so call it where the bad step started to replay its dropout masks).

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 4), nn.Linear(4, 1))
        >>> with torch.no_grad():  # the output is 1 for a zero input
        ...     _ = model[0].bias.zero_(), model[1].bias.fill_(1.0)
        >>> x = torch.zeros(3, 2)
        >>> trace = trace_nonfinite(model, lambda: torch.exp(model(x) * 1e3).sum())
        >>> trace.forward_origin.op, trace.forward_origin.kind, trace.loss_finite
        ('exp', 'inf', False)
    """
    check_type("model", model, nn.Module, "a torch.nn.Module")
    if not callable(loss_fn):
        raise TypeError(f"'loss_fn' must be a callable returning the loss (got {type(loss_fn).__name__})")
    with preserved_state(model), NonFiniteTracer(model, module_backward_hooks) as tracer:
        loss = loss_fn()
        tracer.backward(loss)
        return tracer.trace()


# ---- small tensor helpers (host reads: the diagnosis path only) ---------------------------------------------------
def floating_tensors(value: Any, depth: int = 0) -> list[Tensor]:
    """The dense floating-point tensors in ``value``: a tensor, or the collections Lightning moves to the device
    (tuples, lists, mappings, dataclasses such as darts' training batch or chemprop's molecule graph) of them."""
    if isinstance(value, Tensor):
        ok = value.is_floating_point() and value.layout == torch.strided and value.device.type != "meta"
        return [value] if ok else []
    if depth >= _DEPTH:
        return []
    return [t for v in _members(value) for t in floating_tensors(v, depth + 1)]


def _nonfinite_number(value: Any, depth: int = 0) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if depth >= _DEPTH:
        return False
    return any(_nonfinite_number(v, depth + 1) for v in _members(value))


def _members(value: Any) -> list[Any]:
    """The items of a collection a batch is made of, of a record that gives itself as a dict (``to_dict()``: a
    PyTorch Geometric ``Data``/``Batch``), and the buffers and parameters of a module the batch carries (tsl's
    scaler, with which the model un-scales its output); empty for anything else: no object is walked blindly."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, nn.Module):
        return [*value.buffers(), *value.parameters()]
    if isinstance(value, Mapping):
        return list(value.values())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [getattr(value, f.name, None) for f in dataclasses.fields(value)]
    to_dict = getattr(type(value), "to_dict", None)
    if callable(to_dict) and not isinstance(value, type | Tensor):
        try:
            items = value.to_dict()
        except Exception:  # noqa: BLE001  (a to_dict of another meaning, or one that needs arguments: not walked)
            return []
        return list(items.values()) if isinstance(items, Mapping) else []
    return []


def _any_nonfinite(tensors: Sequence[Tensor]) -> bool:
    with torch.no_grad():
        return any(not bool(torch.isfinite(t).all()) for t in tensors if t.numel())


def _magnitude(tensors: Sequence[Tensor]) -> Tensor:
    """The largest |value| of the tensors, NaN-propagating, as a float64 tensor on the first one's device."""
    with torch.no_grad():
        device = tensors[0].device
        parts = [t.detach().abs().amax().double().to(device) for t in tensors if t.numel()]
        return torch.stack(parts).amax() if parts else torch.zeros((), dtype=torch.float64, device=device)


def _stats(tensors: Sequence[Tensor]) -> _Stats:
    nan = inf = numel = 0
    magnitude = 0.0
    with torch.no_grad():
        for t in tensors:
            if not t.numel():
                continue
            t = t.detach()
            finite = torch.isfinite(t)
            values = torch.stack([
                torch.isnan(t).sum().double(), torch.isinf(t).sum().double(),
                torch.where(finite, t.abs(), torch.zeros((), dtype=t.dtype, device=t.device)).amax().double(),
            ]).tolist()  # fmt: skip
            nan, inf, numel = nan + int(values[0]), inf + int(values[1]), numel + t.numel()
            magnitude = max(magnitude, values[2])
    return _Stats(nan, inf, numel, magnitude)


def _origin(
    direction: str, source: str, frame: _Frame | None, op: str, inputs: Sequence[Tensor], outputs: Sequence[Tensor]
) -> Origin:
    stats = _stats(outputs)
    return Origin(
        direction=direction,  # type: ignore[arg-type]
        source=source,  # type: ignore[arg-type]
        module=frame.name if frame is not None else None,
        module_type=frame.module_type if frame is not None else None,
        op=op,
        kind=stats.kind,  # type: ignore[arg-type]
        input_magnitude=_stats(inputs).magnitude,
        output_magnitude=stats.magnitude,
        nan_count=stats.nan,
        inf_count=stats.inf,
        numel=stats.numel,
    )


def _read_trail(trail: list[tuple[str, Tensor]]) -> list[tuple[str, float]]:
    if not trail:
        return []
    values = torch.stack([v.to(trail[0][1].device) for _, v in trail]).tolist()
    return [(name, value) for (name, _), value in zip(trail, values)]


def _graph(root: Any) -> list[Any]:
    """Every autograd node reachable from ``root`` (iterative: recurrent graphs are deep)."""
    nodes, stack, seen = [], [root], {root}
    while stack:
        node = stack.pop()
        nodes.append(node)
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return nodes
