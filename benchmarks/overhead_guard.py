"""The cost of ``Guard`` in a plain PyTorch loop: CPU time inside ``guard.step`` against a bare step.

The model is ``overhead.py``'s MLP (4 x 512 + head, 1.05M parameters, AdamW, batch 64), trained in a plain loop:
forward, backward, then either ``optimizer.step(); optimizer.zero_grad()`` (bare) or ``guard.step(loss)`` with
``default_callbacks()``. With one torch thread every kernel runs on the calling thread, so ``time.thread_time`` is
the work itself, whatever else loads the machine.

Two figures per round, each over a window of 100 steps after 5 warm-up steps (the window holds the work done every
10, 50 and 100 steps: the weight-growth sample, the weights check, Rollback's snapshot):

- inside the guard: the CPU time in ``guard.step`` less the optimizer's own ``step`` and ``zero_grad`` (timed inside
  it), as a share of the bare step's CPU time in the same round: what the suite adds;
- the whole guarded step against the bare step (both loops alternate, the order turns every round).

Target: inside the guard <= 5% of a bare step (``overhead.py``'s target for the Trainer's hooks on this model).

Usage::

    python benchmarks/overhead_guard.py             # 5 rounds (a minute or two)
    python benchmarks/overhead_guard.py --rounds 9
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import MLP  # noqa: E402  (the same model as the Trainer's overhead benchmark)

from lightning_overflow import Guard, default_callbacks  # noqa: E402

TARGET = 0.05
WARMUP, WINDOW = 5, 100


class TimedOptimizer:
    """The optimizer as the guard calls it, with the CPU time of its own ``step`` and ``zero_grad`` added up (the
    guard looks through it to the torch optimizer, as through Fabric's wrapper)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer
        self.seconds = 0.0

    def step(self, closure: Any = None) -> Any:
        start = time.thread_time()
        try:
            return self._optimizer.step(closure)
        finally:
            self.seconds += time.thread_time() - start

    def zero_grad(self, set_to_none: bool = True) -> None:
        start = time.thread_time()
        self._optimizer.zero_grad(set_to_none=set_to_none)
        self.seconds += time.thread_time() - start

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)


def run(guarded: bool, root: Path) -> tuple[float, float]:
    """One plain-loop run; returns (CPU seconds a step over the window, CPU seconds a step inside the guard)."""
    torch.manual_seed(0)
    model = MLP(samples=64 * (WARMUP + WINDOW))
    net: nn.Module = model.net
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
    timed = TimedOptimizer(optimizer)
    guard = Guard(net, timed, callbacks=default_callbacks(), default_root_dir=root) if guarded else None
    x_all, y_all = model.data.tensors
    inside = 0.0
    start = 0.0
    for step in range(WARMUP + WINDOW):
        if step == WARMUP:
            start, inside, timed.seconds = time.thread_time(), 0.0, 0.0
        batch = slice(64 * step, 64 * step + 64)
        loss = F.mse_loss(net(x_all[batch]), y_all[batch])
        loss.backward()
        if guard is None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            begin = time.thread_time()
            guard.step(loss)
            inside += time.thread_time() - begin
    total = time.thread_time() - start
    if guard is not None:
        guard.close()
    return total / WINDOW, (inside - timed.seconds) / WINDOW


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1 (got {args.rounds})")
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning_overflow").setLevel(logging.ERROR)
    params = sum(p.numel() for p in MLP(samples=64).net.parameters())
    print(f"torch {torch.__version__}, CPU, 1 thread, Python {sys.version.split()[0]}; MLP {params / 1e6:.2f}M "
          f"parameters, {args.rounds} rounds x {WINDOW} steps")  # fmt: skip
    shares, ratios, bare_ms, inside_us = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        run(False, Path(tmp))  # warm every code path once
        run(True, Path(tmp))
        for round_index in range(args.rounds):
            order = (False, True) if round_index % 2 == 0 else (True, False)
            results = {guarded: run(guarded, Path(tmp)) for guarded in order}
            bare, _ = results[False]
            whole, inside = results[True]
            shares.append(inside / bare)
            ratios.append(whole / bare)
            bare_ms.append(1000 * bare)
            inside_us.append(1e6 * inside)
            print(f"  round {round_index + 1}: bare {1000 * bare:.2f} ms CPU a step, guarded {1000 * whole:.2f} ms "
                  f"({whole / bare:.3f}x), inside the guard {1e6 * inside:.0f} us ({inside / bare:.4f})",
                  flush=True)  # fmt: skip
    share = statistics.median(shares)
    print(f"bare step: {statistics.median(bare_ms):.2f} ms CPU; inside the guard: "
          f"{statistics.median(inside_us):.0f} us a step ({min(inside_us):.0f}-{max(inside_us):.0f})")  # fmt: skip
    print(f"whole guarded step: {statistics.median(ratios):.3f}x the bare step ({min(ratios):.3f}-{max(ratios):.3f})")
    met = share <= TARGET
    print(f"inside the guard: {share:.4f} of a bare step ({min(shares):.4f}-{max(shares):.4f})  target <= {TARGET} "
          f"{'PASS' if met else 'FAIL'}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
