"""The suite in a plain PyTorch loop: ``Guard(model, optimizer)`` and ``guard.step(loss)``, no Trainer.

A regression of 1024 samples, one of which is corrupt (every feature 1e30, as a bad sensor read would give): its
batch's squared error is inf once an epoch. The loop is the one everybody writes (forward, backward, step), with
``optimizer.step(); scheduler.step(); optimizer.zero_grad()`` replaced by ``guard.step(loss)``.

Run ``python examples/plain_loop.py`` (``--fast`` for CI). What you will see:

- unprotected: the first time the corrupt batch comes, the gradients are NaN and so are the weights, for good.
- protected: that step is skipped once an epoch (a true no-op: weights, AdamW's moments and the schedule unchanged),
  ``guard.step`` says so in what it returns, and the run ends with about the loss of a run on clean data. At the end
  the guard prints what happened and writes the journal (``python -m lightning_overflow journal <folder>``).

The last line printed is ``RESULT {...}``, a JSON summary for scripts and tests.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_overflow import Guard, default_callbacks

CORRUPT = 617  # the corrupt sample: batch 9 of 16 in each epoch


def dataset(corrupt: bool, samples: int = 1024) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 8, generator=gen)
    y = x @ torch.randn(8, 1, generator=gen) + 0.1 * torch.randn(samples, 1, generator=gen)
    if corrupt:
        x = x.clone()
        x[CORRUPT] = 1e30
    return TensorDataset(x, y)


def clean_loss(model: nn.Module) -> float:
    x, y = dataset(corrupt=False).tensors
    keep = torch.arange(len(x)) != CORRUPT
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(x[keep]), y[keep]))


def train(epochs: int, protected: bool, root: Path, corrupt: bool = True) -> tuple[nn.Module, list[int]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=16 * epochs)
    loader = DataLoader(dataset(corrupt), batch_size=64)
    skipped: list[int] = []
    guard = Guard(model, optimizer, scheduler, default_callbacks(), default_root_dir=root) if protected else None
    for _ in range(epochs):
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            if guard is None:  # the loop as it was
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                continue
            outcome = guard.step(loss)  # judges the step, then steps (or skips) the optimizer and the scheduler
            if outcome.skipped:
                skipped.append(outcome.step)
        if guard is not None:
            guard.end_epoch()
    if guard is not None:
        guard.close()  # the fit summary, the journal
    return model, skipped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="3 epochs instead of 10")
    args = parser.parse_args()
    epochs = 3 if args.fast else 10
    with tempfile.TemporaryDirectory() as tmp:
        bare, _ = train(epochs, protected=False, root=Path(tmp))
        reference, _ = train(epochs, protected=False, root=Path(tmp), corrupt=False)
        model, skipped = train(epochs, protected=True, root=Path(tmp) / "protected")
        finite = lambda m: all(bool(torch.isfinite(p).all()) for p in m.parameters())  # noqa: E731
        result = {
            "example": "plain_loop",
            "unprotected": {"weights_finite": finite(bare)},
            "protected": {
                "weights_finite": finite(model),
                "skipped_steps": skipped,
                "loss": clean_loss(model),
                "clean_run_loss": clean_loss(reference),
            },
        }
    print(f"unprotected: weights finite {result['unprotected']['weights_finite']}")
    loss, clean = result["protected"]["loss"], result["protected"]["clean_run_loss"]
    print(f"protected: skipped steps {skipped}; loss {loss:.4f} (a run on clean data: {clean:.4f})")
    assert math.isfinite(loss)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
