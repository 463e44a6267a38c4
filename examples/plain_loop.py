"""The suite in a plain PyTorch loop: ``Guard(model, optimizer)`` and ``guard.step(loss)``, no Trainer.

A regression of 1024 samples, one of which is corrupt (every feature 1e30, as a bad sensor read would give): its
batch's squared error is inf once an epoch. The loop is the one everybody writes (forward, backward, step), with
``optimizer.step(); scheduler.step(); optimizer.zero_grad()`` replaced by ``guard.step(loss, batch=batch)``.

Run ``python examples/plain_loop.py`` (``--fast`` for CI). What you will see:

- unprotected: the first time the corrupt batch comes, the gradients are NaN and so are the weights, for good.
- protected: that step is skipped once an epoch (a true no-op: weights, AdamW's moments and the schedule unchanged),
  ``guard.step`` says so in what it returns, and the run ends with about the loss of a run on clean data. At the end
  the guard prints what happened and writes the journal (``python -m lightning_overflow journal <folder>``).

- protected, the guard running each step (``Guard(..., loss_fn=...)``, ``guard.train_step(batch)``): the same
  steps skipped, and since the guard holds the batch it replays the first one and names the corrupt row (a suspicion
  would be tried against doing nothing, as under the Trainer).

The last line printed is ``RESULT {...}``, a JSON summary for scripts and tests.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path
from typing import Any

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


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def train(
    epochs: int, protected: bool, root: Path, corrupt: bool = True, train_step: bool = False
) -> tuple[nn.Module, list[int], str]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=16 * epochs)
    loader = DataLoader(dataset(corrupt), batch_size=64)
    skipped: list[int] = []
    said = ""  # what the guard said of the first skipped step
    guard = None
    if protected:
        guard = Guard(model, optimizer, scheduler, default_callbacks(), default_root_dir=root,
                      loss_fn=loss_fn if train_step else None)  # fmt: skip
    for _ in range(epochs):
        for batch in loader:
            if guard is not None and train_step:
                outcome = guard.train_step(batch)  # forward, backward, then what guard.step does
            else:
                loss = loss_fn(model, batch)
                loss.backward()
                if guard is None:  # the loop as it was
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                    continue
                # Judges the step, then steps (or skips) the optimizer and the scheduler; the batch is read only
                # if the step is inf/NaN, to tell a data fault apart.
                outcome = guard.step(loss, batch=batch)
            if outcome.skipped:
                skipped.append(outcome.step)
                said = said or outcome.events[0].message
        if guard is not None:
            guard.end_epoch()
    if guard is not None:
        guard.close()  # the fit summary, the journal
    return model, skipped, said


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="3 epochs instead of 10")
    args = parser.parse_args()
    epochs = 3 if args.fast else 10
    with tempfile.TemporaryDirectory() as tmp:
        bare, _, _ = train(epochs, protected=False, root=Path(tmp))
        reference, _, _ = train(epochs, protected=False, root=Path(tmp), corrupt=False)
        finite = lambda m: all(bool(torch.isfinite(p).all()) for p in m.parameters())  # noqa: E731
        result: dict[str, Any] = {"example": "plain_loop", "unprotected": {"weights_finite": finite(bare)}}
        for key, runs_steps in (("protected", False), ("train_step", True)):
            model, skipped, said = train(epochs, protected=True, root=Path(tmp) / key, train_step=runs_steps)
            result[key] = {"weights_finite": finite(model), "skipped_steps": skipped, "loss": clean_loss(model),
                           "clean_run_loss": clean_loss(reference), "first_skip": said}  # fmt: skip
    print(f"unprotected: weights finite {result['unprotected']['weights_finite']}")
    for key, how in (("protected", "guard.step(loss, batch=batch)"), ("train_step", "guard.train_step(batch)")):
        run = result[key]
        print(f"protected, {how}: skipped steps {run['skipped_steps']}; loss {run['loss']:.4f} (a run on clean data: "
              f"{run['clean_run_loss']:.4f})\n  the first skip: {run['first_skip']}")  # fmt: skip
        assert math.isfinite(run["loss"])
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
