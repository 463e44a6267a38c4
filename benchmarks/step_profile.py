"""Where ``default_callbacks()`` spends its time inside a training step: per hook, per pipeline stage, per callback.

``overhead.py`` measures what the suite adds to a whole step against bare training; this script says where that time
goes. One fit of ``--steps`` steps with ``default_callbacks()`` (after a short fit that warms every code path), with
the thread's CPU clock (``time.thread_time``: with one torch thread every kernel runs on it, and the machine's load
does not inflate it) around every Lightning hook of the suite's callbacks (the outermost call only, so that
``super()`` is not counted twice) and around each stage of the step pipeline. Each line is microseconds per step, averaged over the
fit, so the work done every 100 steps (Rollback's snapshot, NonFiniteDetector's weights check and headroom sample)
is spread over the steps as it is in a run. The clocks themselves cost well under a microsecond a call.

Before that, unclocked fits of a bare model, of six empty Lightning callbacks and of ``default_callbacks()`` give the
CPU time of Lightning's per-batch callback hooks with its dispatch (the profiler context it opens around every hook
of every callback): what the suite costs there in all, muted hooks spared.

Then, inside ``on_before_optimizer_step`` of a bare fit of the same model: the suite's norm and finiteness check
against a plain sum of every gradient, taken first and second in turn. The first read of the gradients in a step
costs more than the same read in ``overhead.py``'s loop: the backward pass has just pushed them out of the caches.

Usage::

    python benchmarks/step_profile.py                       # the 1.05M-parameter MLP of overhead.py, 300 steps
    python benchmarks/step_profile.py --model gpt11m --steps 8
    python benchmarks/step_profile.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.trainer import call
from typing_extensions import Self

from lightning_overflow import _compat, default_callbacks
from lightning_overflow.health import STAGES, HealthBoard, StepHealth
from lightning_overflow.numerics.norms import host_total_norm, plain_norms

sys.path.insert(0, str(Path(__file__).parent))
import overhead  # the models and the fit of overhead.py, shared

HOOKS = ("on_train_batch_start", "on_before_backward", "on_before_optimizer_step", "on_train_batch_end")


class Clocks:
    """CPU time and calls per label; ``outermost`` labels count only calls not nested in another of them."""

    def __init__(self) -> None:
        self.seconds: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._depth = 0
        self._originals: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, name: str, label: str, outermost: bool = False) -> None:
        original = owner.__dict__[name]
        self._originals.append((owner, name, original))

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._depth += outermost
            start = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= outermost
                if not outermost or self._depth == 0:
                    self.seconds[label] += time.thread_time() - start
                    self.calls[label] += 1

        setattr(owner, name, timed)

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def remove(self) -> None:
        """Put back every method wrapped (the classes are the package's own, shared by the whole process)."""
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)
        self._originals.clear()


def instrument(clocks: Clocks) -> None:
    classes = {type(c) for c in default_callbacks()}
    wrapped: set[tuple[type, str]] = set()
    for cls in sorted(classes, key=lambda c: c.__name__):
        for klass in cls.__mro__:
            if not klass.__module__.startswith("lightning_overflow"):
                continue
            for hook in HOOKS:
                if hook in klass.__dict__ and (klass, hook) not in wrapped:  # a base class of several callbacks
                    clocks.wrap(klass, hook, f"hook  {hook}", outermost=True)
                    wrapped.add((klass, hook))
        for stage in STAGES:
            if stage in cls.__dict__:
                clocks.wrap(cls, stage, f"stage {cls.__name__}.{stage}")
    clocks.wrap(HealthBoard, "_build", "board the record: gradient norms and finiteness")
    clocks.wrap(StepHealth, "_read", "board the step's one host read (packing, read)")
    clocks.wrap(HealthBoard, "flush", "board logging (one log_metrics per logger and step)")


def profile_suite(spec: overhead.ModelSpec, steps: int, tmp: Path) -> tuple[Clocks, float]:
    clocks = Clocks()
    instrument(clocks)
    try:
        config = overhead.Config("suite", lambda _: (default_callbacks(), {}), "suite")
        overhead.fit_ms_per_step(spec, config, 5, "cpu", tmp, "warm")
        clocks.clear()
        ms = overhead.fit_ms_per_step(spec, config, steps, "cpu", tmp, "profiled", "thread")
    finally:
        clocks.remove()
    return clocks, ms


class FirstRead(pl.Callback):
    """In each step, the suite's norm and finiteness check as the step record runs it (per-tensor norms, read to the
    host, their total there) and a plain sum of every gradient, read to the host, taking turns at being first."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {
            "norms, first": [],
            "sum, first": [],
            "norms, second": [],
            "sum, second": [],
        }

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        reads: dict[str, Callable[[], Any]] = {
            "norms": lambda: host_total_norm(plain_norms(grads).tolist()),
            "sum": lambda: overhead.read_all(grads),
        }
        order = ("norms", "sum") if trainer.global_step % 2 else ("sum", "norms")
        for place, what in zip(("first", "second"), order):
            start = time.thread_time()
            reads[what]()
            self.times[f"{what}, {place}"].append(time.thread_time() - start)


class Dispatch:
    """CPU time of Lightning's per-batch callback hooks, its dispatch included (the profiler context it opens
    around every call, for every callback), while in use."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._original = call._call_callback_hooks

    def __enter__(self) -> Self:
        original = self._original

        def timed(trainer: pl.Trainer, hook_name: str, *args: Any, **kwargs: Any) -> Any:
            if hook_name not in _compat.BATCH_HOOKS:
                return original(trainer, hook_name, *args, **kwargs)
            start = time.thread_time()
            try:
                return original(trainer, hook_name, *args, **kwargs)
            finally:
                self.seconds += time.thread_time() - start

        call._call_callback_hooks = timed
        return self

    def __exit__(self, *_: object) -> None:
        call._call_callback_hooks = self._original


DISPATCHED = {
    "bare": list,
    "6 empty Lightning callbacks": lambda: [pl.Callback() for _ in range(6)],
    "default_callbacks()": default_callbacks,
}


def dispatch_costs(spec: overhead.ModelSpec, steps: int, tmp: Path) -> dict[str, float]:
    """Microseconds a step in Lightning's per-batch callback hooks, for each row of ``DISPATCHED``."""
    costs = {}
    for name, make in DISPATCHED.items():
        config = overhead.Config(name, lambda _, make=make: (make(), {}), "suite")
        with Dispatch() as dispatch:
            overhead.fit_ms_per_step(spec, config, steps, "cpu", tmp, "dispatch")
        costs[name] = dispatch.seconds / (steps + spec.warmup_steps + 1) * 1e6
    return costs


def first_reads(spec: overhead.ModelSpec, steps: int, tmp: Path) -> dict[str, float]:
    probe = FirstRead()
    overhead.fit_ms_per_step(spec, overhead.Config("read", lambda _: ([probe], {}), "bare"), steps, "cpu", tmp, "read")
    # The warm-up steps' reads (the allocator's first steps, AdamW's state being created) are left out.
    return {k: statistics.median(v[spec.warmup_steps :] or v) * 1e6 for k, v in probe.times.items() if v}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(overhead.MODELS), default="mlp")
    parser.add_argument("--steps", type=int, default=300, help="steps of the profiled fit (default 300)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1 (got {args.steps})")
    if args.threads < 1:
        parser.error(f"--threads must be at least 1 (got {args.threads})")
    overhead.quiet()
    torch.set_num_threads(args.threads)
    spec = overhead.MODELS[args.model]
    with tempfile.TemporaryDirectory() as root:
        tmp = Path(root)
        reads = first_reads(spec, args.steps, tmp)
        dispatched = dispatch_costs(spec, args.steps, tmp)
        clocks, ms = profile_suite(spec, args.steps, tmp)
    per_step = args.steps + spec.warmup_steps + 1
    n_params = sum(p.numel() for p in spec.build(1).parameters())
    print(f"torch {torch.__version__}, pytorch_lightning {pl.__version__}, CPU, {args.threads} thread(s)")
    print(
        f"\n## {args.model} ({n_params / 1e6:.2f}M parameters): default_callbacks(), {args.steps} steps of "
        f"{ms:.2f} ms (CPU time, this profiled fit)\n"
    )
    hooks = sum(v for k, v in clocks.seconds.items() if k.startswith("hook"))
    print(
        f"time inside the suite's hooks: {hooks / per_step * 1e6:.0f} us a step "
        f"({hooks / per_step * 1e3 / ms:.1%} of the step)\n"
    )
    print("| where | us per step | calls per step |")
    print("| --- | --- | --- |")
    for label, seconds in sorted(clocks.seconds.items(), key=lambda kv: -kv[1]):
        print(f"| {label} | {seconds / per_step * 1e6:.1f} | {clocks.calls[label] / per_step:.1f} |")
    print("\n(stages run inside the hooks, the board's parts inside the stages' hook: the rows overlap)")
    print("\nLightning's per-batch callback hooks, its dispatch included, us per step (unclocked fits):")
    for label, us in dispatched.items():
        print(f"  {label:28s} {us:8.1f}")
    print("\ninside on_before_optimizer_step of a bare fit, median us per step:")
    for label, us in reads.items():
        print(f"  {label:15s} {us:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
