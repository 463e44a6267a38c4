"""Cost of the shared step record: norms against torch's, and whole training steps with and without the suite.

Everything is measured side by side in one run, interleaved round by round, and reported as medians and ratios
(machines are noisy; absolute times mean little). ``python benchmarks/bench_overhead.py [--quick]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_overflow import GradNormMonitor, NonFiniteDetector
from lightning_overflow.numerics import tensor_norms, total_norm


def median_ms(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def bench_norms(params: int, repeats: int) -> None:
    gen = torch.Generator().manual_seed(0)
    sizes = [params // 40] * 40
    grads = [torch.randn(n, generator=gen) for n in sizes]
    candidates: dict[str, Callable[[], Any]] = {
        "read all gradient bytes (sum)": lambda: [g.sum() for g in grads],
        "ours: tensor_norms + total_norm": lambda: total_norm(tensor_norms(grads)),
        "torch get_total_norm": lambda: torch.nn.utils.get_total_norm(grads),
        "isfinite(g).all() per tensor": lambda: [torch.isfinite(g).all() for g in grads],
    }
    results = {name: median_ms(fn, repeats) for name, fn in candidates.items()}
    base = results["read all gradient bytes (sum)"]
    print(f"\nnorm of {params / 1e6:.0f}M fp32 gradients in 40 tensors (median of {repeats}):")
    for name, ms in results.items():
        print(f"  {name:<34} {ms:8.2f} ms   {ms / base:5.2f}x the read")
    big = [g * 1e20 for g in grads]
    fp32 = torch.nn.utils.get_total_norm(big).item()
    print(f"  gradients x1e20: torch get_total_norm -> {fp32}, ours (refined) -> "
          f"{total_norm(torch.tensor([torch.linalg.vector_norm(g, dtype=torch.float64) for g in big])).item():.4g}")


class MLP(pl.LightningModule):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.GELU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, 1))
        gen = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(4096, width, generator=gen), torch.randn(4096, 1, generator=gen))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=64)


class StepTimer(pl.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, *_: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *_: Any) -> None:
        self.times.append(time.perf_counter() - self._start)


def step_ms(callbacks: list[pl.Callback], width: int, depth: int, steps: int) -> float:
    pl.seed_everything(0, verbose=False)
    timer = StepTimer()
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[timer, *callbacks])
    trainer.fit(MLP(width, depth))
    return 1000 * statistics.median(timer.times[3:])  # the first steps warm up allocators


def bench_steps(width: int, depth: int, steps: int, rounds: int) -> None:
    configs: dict[str, Callable[[], list[pl.Callback]]] = {
        "bare": lambda: [],
        "GradNormMonitor": lambda: [GradNormMonitor()],
        "NonFiniteDetector": lambda: [NonFiniteDetector(check_weights_every_n_steps=None)],
        "both": lambda: [GradNormMonitor(), NonFiniteDetector(check_weights_every_n_steps=None)],
        "both + weight check every step": lambda: [GradNormMonitor(), NonFiniteDetector(check_weights_every_n_steps=1)],
    }
    samples: dict[str, list[float]] = {name: [] for name in configs}
    step_ms([], width, depth, steps)  # warm-up: thread pools, allocator, imports
    for _ in range(rounds):  # interleaved, so drift in machine load hits every configuration alike
        for name, make in configs.items():
            samples[name].append(step_ms(make(), width, depth, steps))
    params = sum(p.numel() for p in MLP(width, depth).parameters())
    base = statistics.median(samples["bare"])
    print(f"\ntraining step, MLP {params / 1e6:.1f}M parameters, AdamW, batch 64 (median of {rounds} rounds x {steps} steps):")
    for name, values in samples.items():
        ms = statistics.median(values)
        print(f"  {name:<32} {ms:8.2f} ms   {ms / base:5.3f}x bare")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats")
    args = parser.parse_args()
    torch.set_flush_denormal(True)
    if args.quick:
        bench_norms(4_000_000, 5)
        bench_steps(width=512, depth=4, steps=15, rounds=2)
    else:
        bench_norms(24_000_000, 15)
        bench_steps(width=1024, depth=4, steps=30, rounds=3)


if __name__ == "__main__":
    main()
