"""Per-step cost of AutoClip's modes against no clipping and against ``Trainer(gradient_clip_val=...)``.

Every configuration trains the same MLP (about 3.7M parameters) on the same synthetic batches. The configurations
run side by side: in each round every one of them fits for a few steps, in a rotated order, so that drift of the
machine (other processes, thermal state) spreads over all of them. The first steps of each fit are dropped as
warm-up; the table shows the median cost of one training step (``on_train_batch_start`` to
``on_train_batch_end``: forward, backward, clipping, optimizer step) in CPU time of the process, and its ratio to
the two references. The ratios are medians over rounds of the ratio within each round (paired), which cancels slow
drift of a shared machine better than a ratio of overall medians. Median wall time is shown beside, and the
median CPU time of the clipping hook alone (AutoClip's ``on_before_optimizer_step``, shared norm included;
Lightning's ``configure_gradient_clipping`` for ``gradient_clip_val``), the least noisy figure.

Thresholds are set so that clipping happens: ``fixed`` and ``gradient_clip_val`` clip every step, ``percentile``
(p=10) about nine steps in ten, ``agc`` some units every step, and ``agc_max_norm`` caps the total norm after AGC
on every step as well; ``zscore`` computes its threshold every step and clips only outliers, as it would in a real
run.

Run:  python benchmarks/bench_clipping.py            (about a minute on 2 CPU cores)
      python benchmarks/bench_clipping.py --quick    (a few seconds, for a smoke test)
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_overflow.callbacks.auto_clip import AutoClip

CLIP = 1e-3  # far below the gradient norm: fixed clipping and gradient_clip_val act on every step
CLIP_TIMES: list[float] = []  # CPU time of the clipping hook of each step (AutoClip's or Lightning's)


class Mlp(pl.LightningModule):
    def __init__(self, width: int = 1024, depth: int = 4, n_samples: int = 4096, batch_size: int = 64) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(256, width), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.ReLU()]
        layers.append(nn.Linear(width, 10))
        self.net = nn.Sequential(*layers)
        gen = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(n_samples, 256, generator=gen), torch.randint(0, 10, (n_samples,)))
        self.batch_size = batch_size

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)

    def configure_gradient_clipping(self, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        start = time.process_time()
        super().configure_gradient_clipping(optimizer, *args, **kwargs)  # Trainer(gradient_clip_val=...) clips here
        if self.trainer.gradient_clip_val:
            CLIP_TIMES.append(time.process_time() - start)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=False)


class StepTimer(pl.Callback):
    """CPU time of this process (all threads) and wall time of each training batch.

    CPU time is the figure of merit: on a shared machine, wall time also counts the time other processes held the
    cores, which varies from step to step far more than the cost being measured.
    """

    def __init__(self) -> None:
        self.cpu: list[float] = []
        self.wall: list[float] = []
        self._start = (0.0, 0.0)

    def on_train_batch_start(self, *_: Any) -> None:
        self._start = (time.process_time(), time.perf_counter())

    def on_train_batch_end(self, *_: Any) -> None:
        self.cpu.append(time.process_time() - self._start[0])
        self.wall.append(time.perf_counter() - self._start[1])


def timed(autoclip: AutoClip) -> AutoClip:
    """Time AutoClip's hook; it includes the suite's shared norm, which other suite callbacks would reuse."""
    hook = autoclip.on_before_optimizer_step

    def on_before_optimizer_step(*args: Any) -> None:
        start = time.process_time()
        hook(*args)
        CLIP_TIMES.append(time.process_time() - start)

    autoclip.on_before_optimizer_step = on_before_optimizer_step  # type: ignore[method-assign]
    return autoclip


def configurations() -> dict[str, tuple[list[Any], dict[str, Any]]]:
    """name -> (callbacks, Trainer keyword arguments)."""
    return {
        "none": ([], {}),
        "gradient_clip_val": ([], {"gradient_clip_val": CLIP}),
        "fixed": ([timed(AutoClip(mode="fixed", max_norm=CLIP))], {}),
        "percentile": ([timed(AutoClip(mode="percentile"))], {}),
        "zscore": ([timed(AutoClip(mode="zscore"))], {}),
        "agc": ([timed(AutoClip(mode="agc"))], {}),
        "agc_max_norm": ([timed(AutoClip(mode="agc", max_norm=CLIP))], {}),
    }


def fit_once(callbacks: list[Any], trainer_kwargs: dict[str, Any], steps: int) -> StepTimer:
    timer = StepTimer()
    CLIP_TIMES.clear()
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*callbacks, timer],
        **trainer_kwargs,
    )
    pl.seed_everything(0, verbose=False)
    trainer.fit(Mlp())
    return timer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (smoke test)")
    parser.add_argument("--rounds", type=int, default=None, help="fits per configuration (default 10, quick 2)")
    parser.add_argument("--steps", type=int, default=None, help="steps per fit (default 20, quick 8)")
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch threads (default 1: with more, threads spin at barriers whenever the machine is shared, which "
        "inflates CPU time with noise)",
    )
    args = parser.parse_args()
    rounds = args.rounds or (2 if args.quick else 10)
    steps = args.steps or (8 if args.quick else 20)
    warmup = 3 if args.quick else 5

    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # denormals can make CPU steps several times slower
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning_overflow").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    n_params = sum(p.numel() for p in Mlp().parameters())
    print(f"MLP with {n_params / 1e6:.2f}M parameters, batch 64, SGD; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {rounds} rounds x {steps} steps per configuration "
          f"(first {warmup} of each fit dropped)")
    started = time.perf_counter()
    names = list(configurations())
    cpu: dict[str, list[float]] = {name: [] for name in names}
    wall: dict[str, list[float]] = {name: [] for name in names}
    clip: dict[str, list[float]] = {name: [] for name in names}
    per_round: list[dict[str, float]] = []
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        configs = configurations()  # fresh callbacks each round
        medians = {}
        for name in order:
            callbacks, kwargs = configs[name]
            timer = fit_once(callbacks, kwargs, steps)
            cpu[name].extend(timer.cpu[warmup:])
            wall[name].extend(timer.wall[warmup:])
            clip[name].extend(CLIP_TIMES[warmup:])
            medians[name] = statistics.median(timer.cpu[warmup:])
        per_round.append(medians)

    none = statistics.median(cpu["none"])
    print("\nCPU time per step (all threads), median; ratios are medians of per-round paired ratios")
    print(f"{'configuration':<20}{'ms/step':>9}{'+ms vs none':>13}{'x none':>9}{'x clip_val':>12}{'wall ms':>10}"
          f"{'clip hook ms':>14}")
    for name in names:
        median = statistics.median(cpu[name])
        x_none = statistics.median([m[name] / m["none"] for m in per_round])
        x_clip = statistics.median([m[name] / m["gradient_clip_val"] for m in per_round])
        hook = statistics.median(clip[name]) * 1e3 if clip[name] else 0.0
        print(f"{name:<20}{median * 1e3:>9.2f}{(median - none) * 1e3:>13.2f}{x_none:>9.3f}{x_clip:>12.3f}"
              f"{statistics.median(wall[name]) * 1e3:>10.2f}{hook:>14.2f}")
    print(f"\n{sum(len(c) for c in cpu.values())} timed steps in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
