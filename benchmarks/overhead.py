"""Per-step cost of the suite against bare Lightning training and against the other safety nets, side by side.

Every configuration trains the same model from the same initial weights in its own short ``Trainer.fit``; the
configurations take turns, round after round, in one process (a drift in the machine's load hits all of them alike;
the order rotates every round), every ratio is taken to the bare fits that open and close the same round, and the
median over rounds is reported with its spread. A first round of short fits warms every code path and is discarded.
A step is the time from one ``on_train_batch_start`` to the next: data loading, forward, backward, the optimizer,
every hook, and Lightning's logging into a ``CSVLogger`` (``log_every_n_steps=50``, Lightning's default; shorter
windows log once per window, which only makes logging weigh more). The model logs its loss every step, as real
training does.

Also measured: the host memory a ``Rollback`` snapshot holds (``keep=2``).

Inside the hooks (``--hooks``; after the whole-step table unless ``--no-hooks``): on a shared machine a step's wall
time measures the scheduler as much as the work, so the suite's own cost is taken as CPU time too. With one torch
thread every kernel runs on the calling thread, and ``time.thread_time`` around the suite's Lightning hooks (the
outermost call only, so that ``super()`` and the board's forwarding count once; muted hooks are never called) is the
CPU time the suite spends in a step, whatever else loads the machine. Its share of a bare step (the bare fit's
``thread_time`` per step, in the same round) is printed per round, with the median and spread over rounds. The window
holds 100 steps, so the work done every 10, 50 or 100 steps (the weight-growth sample, logging, the weights check,
Rollback's snapshot, whose own time is printed beside its amortised cost) weighs as in a run. The same rounds time,
on one thread, one read of all gradient bytes (``g.sum()`` of every gradient, one host read) against the suite's norm
and finiteness check as a step runs it (the per-tensor norms, one host read, the total taken on the host).

Models: ``mlp`` (about 1M parameters), ``gpt`` (a GPT-like transformer, about 25M parameters), ``gpt11m`` (11M).
On the GPTs the default rows are the peers and ``default_callbacks()`` (``--all-rows`` adds every single callback).
Peers that are not installed are skipped with a line saying so. Install them (the ``bench`` extra) with::

    pip install --no-deps zclip arc-training && pip install scipy   # ZClip's callback also imports ``lightning``

On a machine shared with other busy processes, OpenMP's waiting threads turn every parallel region of a 2-thread
run into a wait for a scheduler time slice (a 1M-parameter step then takes ten times longer, and the figures measure
the scheduler): there, ``--threads 1 --clock cpu`` measures the work itself (the process's CPU time per step).

Usage::

    python benchmarks/overhead.py                    # mlp + gpt, 7 rounds (the longest: tens of minutes)
    python benchmarks/overhead.py --quick            # mlp + gpt11m, 3 rounds, 5-step GPT windows (minutes)
    python benchmarks/overhead.py --model gpt11m --rounds 9
    python benchmarks/overhead.py --accelerator gpu  # the same on one GPU (synchronised at every step boundary)
    python benchmarks/overhead.py --threads 1 --clock cpu   # on a shared, busy machine
    python benchmarks/overhead.py --hooks            # only the CPU time inside the hooks, the norm check, snapshots
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_overflow import (
    AutoClip,
    GradNormMonitor,
    LossSpikeDetector,
    LRBackoff,
    NonFiniteDetector,
    Rollback,
    default_callbacks,
)
from lightning_overflow.numerics import tensor_norms
from lightning_overflow.numerics.norms import host_total_norm
from lightning_overflow.numerics.snapshots import state_nbytes

THREADS = 2
LOG_EVERY = 50  # Lightning's default log_every_n_steps

# ---- targets ----------------------------------------------------------------------------------------------------
SUITE = "default_callbacks()"
SUITE_TARGET = {"mlp": 1.05, "gpt": 1.02, "gpt11m": 1.02}
SINGLE_TARGET = 1.03  # every single callback of ours, on the MLP
NORM_TARGET = 1.2  # norm + finiteness check against one read of the gradient bytes
HOOK_TARGET = {"mlp": 0.05, "gpt": 0.01, "gpt11m": 0.01}  # CPU time inside the suite's hooks / a bare step's
SNAPSHOT_TARGET_US = 50.0  # a Rollback snapshot's cost per step at its default interval, on the MLP
SNAPSHOT_EVERY = 100  # Rollback's default every_n_steps
HOOK_WINDOW = 100  # steps timed inside the hooks: the work done every 10, 50 and 100 steps weighs as in a run
PEERS_TO_BEAT = ("detect_anomaly=True", "ZClip callback", "ARC callback")


# ---- models -----------------------------------------------------------------------------------------------------
class MLP(pl.LightningModule):
    """Regression MLP: ``depth`` hidden layers of ``width`` (4 x 512: 1.05M parameters), AdamW, batch 64, fitting a
    linear teacher. Learnable targets: on random ones the loss never comes down, which the suite rightly suspects
    (``no_progress``) and tries, and the figure would time a trial instead of the steps."""

    def __init__(self, width: int = 512, depth: int = 4, batch_size: int = 64, samples: int = 4096) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.GELU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, 1))
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(samples, width, generator=gen)
        self.data = TensorDataset(x, x @ torch.randn(width, 1, generator=gen) / width**0.5)
        self.batch_size = batch_size

    def example_batch(self) -> tuple[Tensor, Tensor]:
        x, y = self.data[: self.batch_size]
        return x, y

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class GPT(pl.LightningModule):
    """A GPT-like causal language model (pre-norm blocks, learned positions, untied head), AdamW, on learnable
    sequences: each token follows from the one before by a fixed permutation of the vocabulary, from a random start.
    On random tokens the loss never comes down, which the suite rightly suspects (``no_progress``) and tries, and the
    figure would time a trial instead of the steps."""

    def __init__(
        self, dim: int, layers: int, heads: int = 8, vocab: int = 512, context: int = 64, batch_size: int = 4,
        samples: int = 512,
    ) -> None:  # fmt: skip
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Parameter(torch.zeros(context, dim))
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(layers)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        gen = torch.Generator().manual_seed(0)
        successor = torch.randperm(vocab, generator=gen)
        windows = torch.empty(samples, context + 1, dtype=torch.long)
        windows[:, 0] = torch.randint(0, vocab, (samples,), generator=gen)
        for position in range(context):
            windows[:, position + 1] = successor[windows[:, position]]
        self.data = TensorDataset(windows[:, :-1], windows[:, 1:])
        self.batch_size = batch_size

    def example_batch(self) -> tuple[Tensor, Tensor]:
        x, y = self.data[: self.batch_size]
        return x, y

    def forward(self, x: Tensor) -> Tensor:
        h = self.tokens(x) + self.positions[: x.shape[1]]
        return self.head(self.norm(self.blocks(h)))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=3e-4, weight_decay=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size)


@dataclass(frozen=True)
class ModelSpec:
    key: str
    build: Callable[[int], pl.LightningModule]  # samples needed -> model
    warmup_steps: int  # steps of each fit before the timed window (allocator, AdamW state)
    timed_steps: int
    quick_timed_steps: int
    norm_repeats: int  # calls of each norm row per round
    hook_rounds: int = 5  # rounds of the CPU time inside the hooks


MODELS = {
    # 100 steps: the window holds two logging steps and, once each, the work done every 100 steps (Rollback's
    # snapshot, NonFiniteDetector's weights check and headroom sample), so the mean amortises them exactly.
    "mlp": ModelSpec("mlp", lambda n: MLP(samples=64 * n), 5, 100, 100, norm_repeats=30),
    "gpt": ModelSpec("gpt", lambda n: GPT(dim=512, layers=8, samples=4 * n), 2, 8, 4, norm_repeats=5, hook_rounds=3),
    "gpt11m": ModelSpec(
        "gpt11m", lambda n: GPT(dim=384, layers=6, samples=4 * n), 2, 10, 5, norm_repeats=10, hook_rounds=3
    ),
}


# ---- configurations ---------------------------------------------------------------------------------------------
class LightningGradNorm(pl.Callback):
    """Lightning's recipe for logging gradient norms: ``grad_norm`` in ``on_before_optimizer_step``, every step."""

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        from pytorch_lightning.utilities import grad_norm

        pl_module.log_dict(grad_norm(pl_module, norm_type=2))


@dataclass
class Config:
    name: str
    make: Callable[[Path], tuple[list[Any], dict[str, Any]]]  # temp dir -> (callbacks, Trainer kwargs)
    kind: str  # "bare", "lightning", "peer", "single" (one of ours), "suite"


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _zclip(_: Path) -> tuple[list[Any], dict[str, Any]]:
    from zclip import ZClipLightningCallback

    return [ZClipLightningCallback(mode="zscore", alpha=0.97, z_thresh=2.5)], {}


def _arc(_: Path) -> tuple[list[Any], dict[str, Any]]:
    from arc.api.integrations import LightningCallback

    return [LightningCallback(verbose=False)], {}


def _spike_detection(tmp: Path) -> tuple[list[Any], dict[str, Any]]:
    from pytorch_lightning.callbacks import SpikeDetection

    return [SpikeDetection(mode="min", window=10, warmup=1, rtol=2.0, exclude_batches_path=tmp / "skip.json")], {}


def configurations(all_rows: bool, model: str) -> list[Config]:
    """Every row for the MLP; on the GPTs the peers and the suite unless ``all_rows``."""
    rows = [
        Config("bare", lambda _: ([], {}), "bare"),
        Config("gradient_clip_val=1.0", lambda _: ([], {"gradient_clip_val": 1.0}), "lightning"),
        Config("Lightning grad_norm logged", lambda _: ([LightningGradNorm()], {}), "lightning"),
        Config("detect_anomaly=True", lambda _: ([], {"detect_anomaly": True}), "lightning"),
        Config("Lightning SpikeDetection", _spike_detection, "lightning"),
        # What Lightning's hook dispatch alone costs six callbacks (as many as default_callbacks() has): the floor
        # of any composition of six, whatever they do.
        Config("6 empty Lightning callbacks", lambda _: ([pl.Callback() for _ in range(6)], {}), "lightning"),
    ]
    if _installed("zclip") and _installed("lightning"):
        rows.append(Config("ZClip callback", _zclip, "peer"))
    else:
        print("skipped: ZClip callback (zclip, which needs lightning, is not installed)")
    if _installed("arc") and _installed("scipy"):
        rows.append(Config("ARC callback", _arc, "peer"))
    else:
        print("skipped: ARC callback (arc-training and scipy are not installed)")
    singles = [
        Config("GradNormMonitor", lambda _: ([GradNormMonitor()], {}), "single"),
        Config("NonFiniteDetector", lambda _: ([NonFiniteDetector()], {}), "single"),
        Config("LossSpikeDetector", lambda _: ([LossSpikeDetector()], {}), "single"),
        Config("LRBackoff", lambda _: ([LRBackoff()], {}), "single"),
        Config("Rollback", lambda _: ([Rollback()], {}), "single"),
        Config("AutoClip(fixed, max_norm=1.0)", lambda _: ([AutoClip(mode="fixed", max_norm=1.0)], {}), "single"),
        Config("AutoClip(percentile)", lambda _: ([AutoClip(mode="percentile")], {}), "single"),
        Config("AutoClip(zscore)", lambda _: ([AutoClip(mode="zscore")], {}), "single"),
        Config("AutoClip(agc)", lambda _: ([AutoClip(mode="agc")], {}), "single"),
    ]
    if model == "mlp" or all_rows:
        rows += singles
    rows.append(Config(SUITE, lambda _: (default_callbacks(), {}), "suite"))
    return rows


# ---- one fit ----------------------------------------------------------------------------------------------------
CLOCKS: dict[str, Callable[[], float]] = {
    "wall": time.perf_counter, "cpu": time.process_time, "thread": time.thread_time,
}  # fmt: skip


class StepTimer(pl.Callback):
    """The clock at every ``on_train_batch_start`` (first in the list, so before any other callback's hook), and
    beside it the value of ``probe`` (the CPU time spent inside the suite's hooks so far)."""

    def __init__(self, cuda: bool, clock: Callable[[], float], probe: Callable[[], float] | None = None) -> None:
        self.cuda = cuda
        self.clock = clock
        self.probe = probe
        self.starts: list[float] = []
        self.probed: list[float] = []

    def on_train_batch_start(self, *_: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.starts.append(self.clock())
        if self.probe is not None:
            self.probed.append(self.probe())


def fit_ms_per_step(
    spec: ModelSpec, config: Config, timed: int, accelerator: str, tmp: Path, tag: str, clock: str = "wall"
) -> float:
    """Mean milliseconds per step over the timed window of one fresh fit."""
    timer = timed_fit(spec, config, timed, accelerator, tmp, tag, clock)
    start, end = timer.starts[spec.warmup_steps], timer.starts[spec.warmup_steps + timed]
    return 1000 * (end - start) / timed


def timed_fit(
    spec: ModelSpec, config: Config, timed: int, accelerator: str, tmp: Path, tag: str, clock: str = "wall",
    probe: Callable[[], float] | None = None,
) -> StepTimer:  # fmt: skip
    """One fresh fit of ``spec.warmup_steps + timed + 1`` steps; its timer holds the clock at each step's start."""
    steps = spec.warmup_steps + timed + 1  # the timed window ends at the start of the last step
    torch.manual_seed(0)
    model = spec.build(steps)
    callbacks, kwargs = config.make(tmp)
    timer = StepTimer(cuda=accelerator == "gpu", clock=CLOCKS[clock], probe=probe)
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator=accelerator,
        devices=1,
        logger=CSVLogger(tmp, name=tag),
        log_every_n_steps=min(LOG_EVERY, timed),
        default_root_dir=tmp,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[timer, *callbacks],
        **kwargs,
    )
    trainer.fit(model)
    return timer


# ---- the gradient read against the norm check -------------------------------------------------------------------
def gradients(spec: ModelSpec, accelerator: str) -> list[Tensor]:
    torch.manual_seed(0)
    model = spec.build(1)
    device = torch.device("cuda" if accelerator == "gpu" else "cpu")
    model.to(device)
    x, y = (t.to(device) for t in model.example_batch())  # the loss without log(), which needs a trainer
    out = model.net(x) if isinstance(model, MLP) else model(x)
    loss = F.mse_loss(out, y) if isinstance(model, MLP) else F.cross_entropy(out.flatten(0, 1), y.flatten())
    loss.backward()
    return [p.grad for p in model.parameters() if p.grad is not None]


def read_all(grads: list[Tensor]) -> float:
    """One read of every gradient byte: the sum of each gradient, then one host read."""
    return torch.stack([g.sum() for g in grads]).sum().item()


def norm_and_check(grads: list[Tensor]) -> bool:
    """The suite's check as a step runs it: per-tensor norms, one host read, the exact total taken on the host from
    the read norms, finite or not."""
    return math.isfinite(host_total_norm(_STEP_NORMS(grads).tolist()))


try:  # what a step computes its gradients' norms with (tensor_norms before plain_norms existed)
    from lightning_overflow.numerics.norms import plain_norms as _STEP_NORMS
except ImportError:
    _STEP_NORMS = tensor_norms


def torch_total_norm(grads: list[Tensor]) -> float:
    return torch.nn.utils.get_total_norm(grads).item()


def isfinite_each(grads: list[Tensor]) -> bool:
    return bool(torch.stack([torch.isfinite(g).all() for g in grads]).all().item())


NORM_OURS = "ours: the step's norms + finiteness"
NORM_ROWS: dict[str, Callable[[list[Tensor]], Any]] = {
    "one read of the gradient bytes (sum)": read_all,
    NORM_OURS: norm_and_check,
    "torch get_total_norm": torch_total_norm,
    "torch isfinite(g).all() per tensor": isfinite_each,
}


def time_norms(grads: list[Tensor], repeats: int) -> dict[str, float]:
    """Median milliseconds of each norm row, interleaved within the repeats."""
    times: dict[str, list[float]] = {name: [] for name in NORM_ROWS}
    for _ in range(repeats):
        for name, fn in NORM_ROWS.items():
            start = time.perf_counter()
            fn(grads)
            times[name].append(time.perf_counter() - start)
    return {name: 1000 * statistics.median(values) for name, values in times.items()}


# ---- the snapshot's memory --------------------------------------------------------------------------------------
def snapshot_memory(spec: ModelSpec, accelerator: str, tmp: Path) -> tuple[int, int, int]:
    """``(snapshot bytes held with keep=2, parameter bytes, snapshots held)`` after a short fit."""
    torch.manual_seed(0)
    model = spec.build(12)
    rollback = Rollback(every_n_steps=5, keep=2)
    trainer = pl.Trainer(
        max_steps=12, accelerator=accelerator, devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp, callbacks=[rollback],
    )  # fmt: skip
    trainer.fit(model)
    memory = rollback._memory.snapshots
    held = sum(state_nbytes(snapshot.state) for snapshot in memory if snapshot.state is not None)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return held, params, len(memory)


# ---- CPU time inside the suite's hooks --------------------------------------------------------------------------
_PACKAGE = "lightning_overflow"


class HookClock:
    """The calling thread's CPU time (``time.thread_time``) inside the suite's Lightning hooks, outermost calls only,
    and inside each ``Rollback`` snapshot, while installed.

    The hooks are wrapped on the package's classes, not on callback instances: a hook the suite mutes for a fit (set
    to ``None`` on the instance, so that Lightning skips it) stays muted and costs nothing here, as in a run.
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self.snapshots: list[tuple[int, float]] = []  # (global_step after the snapshot, seconds)
        self._depth = 0
        self._originals: list[tuple[type, str, Any]] = []

    def install(self) -> None:
        named = ("setup", "teardown")
        hooks = [n for n, v in vars(pl.Callback).items() if callable(v) and (n.startswith("on_") or n in named)]
        classes = {k for c in default_callbacks() for k in type(c).__mro__ if k.__module__.startswith(_PACKAGE)}
        for cls in sorted(classes, key=lambda c: c.__qualname__):
            for name in hooks:
                if name in vars(cls):
                    self._wrap_hook(cls, name)
        self._wrap_snapshot()

    def remove(self) -> None:
        for owner, name, original in reversed(self._originals):
            setattr(owner, name, original)
        self._originals.clear()

    def __call__(self) -> float:
        return self.seconds

    def _wrap_hook(self, owner: type, name: str) -> None:
        original = vars(owner)[name]
        self._originals.append((owner, name, original))

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._depth += 1
            start = time.thread_time() if self._depth == 1 else 0.0
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1
                if not self._depth:
                    self.seconds += time.thread_time() - start

        setattr(owner, name, timed)

    def _wrap_snapshot(self) -> None:
        original = vars(Rollback)["_take"]  # the snapshot with its check
        self._originals.append((Rollback, "_take", original))

        def timed(callback: Any, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return original(callback, trainer, *args, **kwargs)
            finally:
                self.snapshots.append((int(trainer.global_step), time.thread_time() - start))

        Rollback._take = timed  # type: ignore[method-assign]


@dataclass
class HookRun:
    spec: ModelSpec
    params: int
    bare_ms: list[float] = field(default_factory=list)  # the bare fit's CPU ms per step, per round
    hooks_us: list[float] = field(default_factory=list)  # CPU us a step inside the suite's hooks, per round
    snapshots_ms: list[float] = field(default_factory=list)  # each snapshot inside the windows
    snapshot_us: list[float] = field(default_factory=list)  # snapshots' CPU us per step of the window, per round
    norm_ms: dict[str, list[float]] = field(default_factory=dict)
    norm_ratios: dict[str, list[float]] = field(default_factory=dict)

    @property
    def shares(self) -> list[float]:
        return [hooks / 1000 / bare for hooks, bare in zip(self.hooks_us, self.bare_ms)]


def bench_hooks(spec: ModelSpec, args: argparse.Namespace, tmp: Path) -> HookRun:
    """Rounds of a bare fit and a ``default_callbacks()`` fit on one torch thread, ``HOOK_WINDOW`` steps timed."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    grads = gradients(spec, "cpu")
    run = HookRun(spec, sum(g.numel() for g in grads))
    run.norm_ms = {name: [] for name in NORM_ROWS}
    run.norm_ratios = {name: [] for name in NORM_ROWS}
    rounds = args.rounds or spec.hook_rounds
    bare = Config("bare", lambda _: ([], {}), "bare")
    suite = Config(SUITE, lambda _: (default_callbacks(), {}), "suite")
    print(f"\n## {spec.key}: the suite's hooks, CPU time on one thread; {rounds} rounds of a bare fit and a {SUITE} "
          f"fit, {spec.warmup_steps} + {HOOK_WINDOW} steps each", flush=True)  # fmt: skip
    clock = HookClock()
    clock.install()
    started = time.perf_counter()
    try:
        for round_index in range(rounds + 1):  # round 0 warms every code path with short fits and is discarded
            timed = HOOK_WINDOW if round_index else 2
            first, second = (bare, suite) if round_index % 2 else (suite, bare)
            low, high = spec.warmup_steps, spec.warmup_steps + timed
            marks: dict[str, StepTimer] = {}
            window: list[float] = []  # the seconds of each snapshot taken inside the suite fit's window
            for config in (first, second):
                clock.snapshots.clear()
                marks[config.name] = timed_fit(spec, config, timed, "cpu", tmp, f"hooks-{spec.key}", "thread", clock)
                if config is suite:
                    window = [seconds for step, seconds in clock.snapshots if low < step <= high]
            measured = time_norms(grads, spec.norm_repeats)
            if not round_index:
                continue
            bare_timer, suite_timer = marks[bare.name], marks[suite.name]
            run.bare_ms.append(1000 * (bare_timer.starts[high] - bare_timer.starts[low]) / timed)
            run.hooks_us.append(1e6 * (suite_timer.probed[high] - suite_timer.probed[low]) / timed)
            run.snapshots_ms += [1000 * seconds for seconds in window]
            run.snapshot_us.append(1e6 * sum(window) / timed)
            for name, ms in measured.items():
                run.norm_ms[name].append(ms)
                run.norm_ratios[name].append(ms / measured["one read of the gradient bytes (sum)"])
            print(f"  round {round_index}/{rounds}: bare {run.bare_ms[-1]:.2f} ms CPU a step, inside the hooks "
                  f"{run.hooks_us[-1]:.0f} us ({run.shares[-1]:.4f}), snapshots in the window "
                  f"{[round(1000 * s, 2) for s in window]} ms ({time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip
    finally:
        clock.remove()
        torch.set_num_threads(threads)
    return run


def report_hooks(run: HookRun) -> list[tuple[str, bool]]:
    """Print one model's CPU time inside the hooks, its norm check and its snapshots; return its targets."""
    spec, checks = run.spec, []
    share, limit = statistics.median(run.shares), HOOK_TARGET[spec.key]
    print(f"\n### {spec.key} ({run.params / 1e6:.2f}M parameters): CPU time inside the suite's hooks, one torch "
          f"thread, medians of {len(run.shares)} rounds x {HOOK_WINDOW} steps (min-max over rounds)")  # fmt: skip
    print(f"bare step: {statistics.median(run.bare_ms):.2f} ms CPU ({spread(run.bare_ms)})")
    print(f"inside the hooks of {SUITE}: {statistics.median(run.hooks_us):.0f} us a step "
          f"({min(run.hooks_us):.0f}-{max(run.hooks_us):.0f})")  # fmt: skip
    met = share <= limit
    print(f"share of a bare step: {share:.4f} ({min(run.shares):.4f}-{max(run.shares):.4f})  target <= {limit} "
          f"{verdict(met)}")  # fmt: skip
    checks.append((f"{spec.key}: CPU inside the hooks {share:.4f} of a bare step <= {limit}", met))
    print(f"gradients of {spec.key} ({run.params / 1e6:.2f}M fp32 values), one thread: median ms per call, ratio to "
          "the read in the same round")  # fmt: skip
    for name, values in run.norm_ms.items():
        ratio = statistics.median(run.norm_ratios[name])
        line = f"  {name:<38} {statistics.median(values):8.3f} ms  {ratio:6.3f}x  ({spread(run.norm_ratios[name])})"
        if name == NORM_OURS:
            met = ratio <= NORM_TARGET
            checks.append((f"{spec.key}: norm + finiteness {ratio:.3f}x one read of the gradients <= {NORM_TARGET}x",
                           met))  # fmt: skip
            line += f"  target <= {NORM_TARGET}x {verdict(met)}"
        print(line)
    if run.snapshots_ms:
        one, amortised = statistics.median(run.snapshots_ms), statistics.median(run.snapshot_us)
        line = (f"Rollback snapshot (its check and copy, CPU): {one:.2f} ms each ({spread(run.snapshots_ms)}, "
                f"{len(run.snapshots_ms)} taken); amortised over the window: {amortised:.1f} us a step "
                f"(every_n_steps={SNAPSHOT_EVERY})")  # fmt: skip
        if spec.key == "mlp":
            met = amortised <= SNAPSHOT_TARGET_US
            checks.append((f"mlp: a snapshot's amortised cost {amortised:.1f} us a step <= {SNAPSHOT_TARGET_US:g} us",
                           met))  # fmt: skip
            line += f"  target <= {SNAPSHOT_TARGET_US:g} us {verdict(met)}"
        print(line)
    return checks


# ---- the run ----------------------------------------------------------------------------------------------------
@dataclass
class Result:
    config: Config
    ms: list[float] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)
    failed: str = ""


def spread(values: list[float]) -> str:
    return f"{min(values):.3f}-{max(values):.3f}"


def bench_model(spec: ModelSpec, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    configs = configurations(args.all_rows, spec.key)
    timed = args.timed_steps or (spec.quick_timed_steps if args.quick else spec.timed_steps)
    rounds = args.rounds or (3 if args.quick else 7)
    results = {c.name: Result(c) for c in configs}
    grads = gradients(spec, args.accelerator)
    n_params = sum(g.numel() for g in grads)
    print(f"\n## {spec.key}: {n_params / 1e6:.2f}M parameters; {rounds} rounds of {len(configs) + 1} fits "
          f"(bare first and last), {spec.warmup_steps} + {timed} steps each", flush=True)  # fmt: skip
    started = time.perf_counter()
    bare_config, others = configs[0], configs[1:]
    for round_index in range(rounds + 1):  # round 0 warms every code path with short fits and is discarded
        steps = timed if round_index else 2
        # Bare opens and closes the round (its ratio base is the mean of both); the others rotate, so that none
        # always runs right after the same neighbour.
        shift = round_index % len(others)
        order = [bare_config, *others[shift:], *others[:shift], bare_config]
        measured_ms: dict[str, list[float]] = {}
        for config in order:
            result = results[config.name]
            if result.failed:
                continue
            try:
                tag = f"{spec.key}-r{round_index}"
                ms = fit_ms_per_step(spec, config, steps, args.accelerator, tmp, tag, args.clock)
            except Exception as err:  # noqa: BLE001 - a peer that breaks on this model is reported, the others go on
                result.failed = f"{type(err).__name__}: {err}"
                print(f"  {config.name}: failed ({result.failed}); dropped", flush=True)
                continue
            measured_ms.setdefault(config.name, []).append(ms)
        if not round_index:
            continue
        bare = statistics.mean(measured_ms["bare"])
        for name, values in measured_ms.items():
            results[name].ms.append(statistics.mean(values))
            results[name].ratios.append(statistics.mean(values) / bare)
        suite = results[SUITE].ratios[-1] if results[SUITE].ratios else math.nan
        print(f"  round {round_index}/{rounds}: bare {bare:.2f} ms/step, {SUITE} {suite:.3f}x "
              f"({time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip
    held, param_bytes, count = snapshot_memory(spec, args.accelerator, tmp)
    return {
        "spec": spec, "params": n_params, "results": results, "snapshot": (held, param_bytes, count), "rounds": rounds,
        "timed": timed,
    }  # fmt: skip


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def report(run: dict[str, Any]) -> list[tuple[str, bool]]:
    """Print one model's figures; return its targets as ``(description, met)``."""
    spec: ModelSpec = run["spec"]
    results: dict[str, Result] = run["results"]
    bare = results["bare"].ms
    checks: list[tuple[str, bool]] = []
    print(f"\n### {spec.key} ({run['params'] / 1e6:.2f}M parameters): ms per step, medians of {run['rounds']} "
          f"rounds x {run['timed']} steps; ratio to bare of the same round (min-max over rounds)")  # fmt: skip
    print(f"bare: {statistics.median(bare):.2f} ms/step (rounds {spread(bare)}; "
          f"spread of the bare step {100 * (max(bare) - min(bare)) / statistics.median(bare):.0f}%)")  # fmt: skip
    print("| configuration | ms/step | x bare | min-max | +ms/step | target |")
    print("| --- | --- | --- | --- | --- | --- |")
    suite = statistics.median(results[SUITE].ratios) if results[SUITE].ratios else math.nan
    for name, result in results.items():
        if result.failed or not result.ratios:
            print(f"| {name} | failed: {result.failed} | | | | |")
            continue
        ratio = statistics.median(result.ratios)
        extra = statistics.median([m - b for m, b in zip(result.ms, bare)])
        target = ""
        if result.config.kind == "suite":
            limit = SUITE_TARGET[spec.key]
            checks.append((f"{spec.key}: {SUITE} {ratio:.3f}x <= {limit}x", ratio <= limit))
            target = f"<= {limit}x {verdict(ratio <= limit)}"
        elif result.config.kind == "single" and spec.key == "mlp":
            checks.append((f"mlp: {name} {ratio:.3f}x <= {SINGLE_TARGET}x", ratio <= SINGLE_TARGET))
            target = f"<= {SINGLE_TARGET}x {verdict(ratio <= SINGLE_TARGET)}"
        elif name in PEERS_TO_BEAT:
            checks.append((f"{spec.key}: {SUITE} {suite:.3f}x < {name} {ratio:.3f}x", suite < ratio))
            target = f"suite cheaper {verdict(suite < ratio)}"
        row = f"| {name} | {statistics.median(result.ms):.2f} | {ratio:.3f} | {spread(result.ratios)} | "
        print(row + f"{extra:+.3f} | {target} |")
    if run["timed"] < 100:
        print(f"(a window of {run['timed']} steps holds none of the work done every 100 steps: Rollback's snapshot, "
              "NonFiniteDetector's weights check and headroom sample; the CPU time inside the hooks holds them)")  # fmt: skip
    held, param_bytes, count = run["snapshot"]
    print(f"Rollback snapshots (keep=2): {count} held, {held / 2**20:.1f} MiB of host memory = "
          f"{held / param_bytes:.2f}x the parameter bytes ({held / max(count, 1) / 2**20:.1f} MiB each, model + "
          "AdamW state)")  # fmt: skip
    return checks


ISSUE_COLUMNS = (
    "bare", "gradient_clip_val=1.0", "detect_anomaly=True", "ZClip callback", "ARC callback", "GradNormMonitor",
    "NonFiniteDetector", SUITE,
)  # fmt: skip


def summary_table(runs: list[dict[str, Any]]) -> None:
    print("\n| model | " + " | ".join(f"`{c}`" for c in ISSUE_COLUMNS) + " |")
    print("| --- " * (len(ISSUE_COLUMNS) + 1) + "|")
    for run in runs:
        cells = []
        for column in ISSUE_COLUMNS:
            result = run["results"].get(column)
            if result is None or not result.ratios:
                cells.append("-")
            elif column == "bare":
                cells.append(f"{statistics.median(result.ms):.2f} ms")
            else:
                ratio = statistics.median(result.ratios)
                cells.append(f"**{ratio:.2f}x**" if column == SUITE else f"{ratio:.2f}x")
        print(f"| {run['params'] / 1e6:.1f}M {run['spec'].key} | " + " | ".join(cells) + " |")


def quiet() -> None:
    for name in ("pytorch_lightning", "lightning.pytorch", "lightning.fabric", "lightning_fabric",
                 "lightning_overflow"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*GPU available but not used.*")
    warnings.filterwarnings("ignore", message=".*The number of training batches.*")
    warnings.filterwarnings("ignore", message=".*isinstance.treespec, LeafSpec.*")
    warnings.filterwarnings("ignore", message=".*dataloader is not resumable.*")
    warnings.filterwarnings("ignore", message=".*Anomaly Detection has been enabled.*")
    warnings.filterwarnings("ignore", message=".*anomaly.*")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", choices=sorted(MODELS), help="default: mlp gpt (--quick: mlp gpt11m)")
    parser.add_argument("--quick", action="store_true", help="3 rounds and shorter GPT windows: a couple of minutes")
    parser.add_argument("--rounds", type=int, help="rounds measured after the warm-up round (default 7; quick 3)")
    parser.add_argument("--all-rows", action="store_true", help="every single callback on the GPTs too")
    parser.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--threads", type=int, default=THREADS, help=f"torch CPU threads (default {THREADS})")
    parser.add_argument(
        "--clock", choices=sorted(CLOCKS), default="wall",
        help="wall (default) or cpu: the process's CPU time, which waiting for the scheduler does not inflate "
        "(with --threads 1 it is the work itself; CPU only)",
    )  # fmt: skip
    parser.add_argument("--timed-steps", type=int, help="steps timed per fit (default: 100 on the MLP, 8-10 on GPTs)")
    parser.add_argument(
        "--hooks", action="store_true",
        help="only the CPU time inside the suite's hooks, the norm check and the snapshots (default models: mlp gpt11m)",
    )  # fmt: skip
    parser.add_argument("--no-hooks", action="store_true", help="only the whole-step ratios")
    args = parser.parse_args()
    for name in ("rounds", "threads", "timed_steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1 (got {value})")
    if args.accelerator == "gpu" and not torch.cuda.is_available():
        parser.error("--accelerator gpu needs CUDA, and torch.cuda.is_available() is False here")
    if args.accelerator == "gpu" and args.clock == "cpu":
        parser.error("--clock cpu measures host CPU time, which says nothing of GPU work: use --clock wall")
    if args.hooks and args.no_hooks:
        parser.error("--hooks and --no-hooks exclude each other")
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    quiet()
    models = args.model or (["mlp", "gpt11m"] if args.quick or args.hooks else ["mlp", "gpt"])
    hook_models = [] if args.no_hooks else args.model or ["mlp", "gpt11m"]
    device = torch.cuda.get_device_name() if args.accelerator == "gpu" else f"CPU, {torch.get_num_threads()} thread(s)"
    print(f"torch {torch.__version__}, pytorch_lightning {pl.__version__}, {device}, {args.clock} clock, "
          f"Python {sys.version.split()[0]}")  # fmt: skip
    runs, hook_runs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for key in [] if args.hooks else models:
            runs.append(bench_model(MODELS[key], args, Path(tmp)))
        for key in hook_models:
            hook_runs.append(bench_hooks(MODELS[key], args, Path(tmp)))
    checks: list[tuple[str, bool]] = []
    for run in runs:
        checks += report(run)
    if runs:
        summary_table(runs)
    for hook_run in hook_runs:
        checks += report_hooks(hook_run)
    print("\ntargets:")
    for description, ok in checks:
        print(f"  {verdict(ok)}  {description}")
    failed = sum(not ok for _, ok in checks)
    print(f"{len(checks) - failed} of {len(checks)} targets met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
