"""A large batch with a learning rate far too high: the loss explodes within a few steps and turns NaN.

An MLP regression trained with batches of 1024 and SGD with momentum 0.9 at LR 0.15, about eight times what this
model tolerates (0.02 trains well; large-batch recipes scale the LR with the batch, and past the stability limit the
loss grows geometrically).

Run ``python examples/large_batch_high_lr.py`` (``--fast`` for CI). What you will see:

- unprotected: the loss jumps from 34 to about 1e3 by step 5 and is NaN from step 8; the weights end NaN.
- protected (``NonFiniteDetector``, ``LossSpikeDetector(warmup=5)``, ``LRBackoff(factor=0.125)``,
  ``Rollback(every_n_steps=5)``): the spike at step 5 divides the LR by 8 and rolls back to the snapshot of step 5;
  the next step spikes again, so the second rollback to that snapshot goes one further back, to the state the fit
  started from. From there the run trains at the lower LR to a low loss (about 0.03 after 200 steps, 0.3 after
  the 60 of ``--fast``), all weights finite. The journal lines printed list each spike, backoff and rollback.
  (``factor=0.125`` because the LR is about 8x too high: with the default 0.5 it takes three backoffs, and the
  stretches in between train at an LR that is still too high.)

The last line printed is ``RESULT {...}``, a JSON summary for scripts and tests.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

from lightning_overflow import LossSpikeDetector, LRBackoff, NonFiniteDetector, Rollback, read_journal

logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", message=".*(does not have many workers|LeafSpec|GPU available).*")

BATCH = 1024
LR = 0.15


class Regression(pl.LightningModule):
    def __init__(self, samples: int = 8192) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 1))
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(samples, 32, generator=gen)
        y = x @ torch.randn(32, 1, generator=gen) + 0.1 * torch.randn(samples, 1, generator=gen)
        self.data = TensorDataset(x, y)
        self.losses: list[float] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        # Whole batches indexed at once: collating 1024 single samples would cost more than the step.
        return DataLoader(self.data, batch_size=None, sampler=BatchSampler(RandomSampler(self.data), BATCH, False))


def trainer(steps: int, root: Path, callbacks: list[pl.Callback]) -> pl.Trainer:
    return pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                      callbacks=callbacks)  # fmt: skip


def finite(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def tail_loss(losses: list[float]) -> float:
    """The mean loss of the last 10 steps (a single batch is noisy)."""
    return sum(losses[-10:]) / len(losses[-10:])


def unprotected(steps: int, root: Path) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    model = Regression()
    trainer(steps, root / "bare", []).fit(model)
    first_bad = next((i for i, v in enumerate(model.losses) if not math.isfinite(v)), None)
    return {"weights_finite": finite(model), "first_nonfinite_step": first_bad, "final_loss": model.losses[-1]}


def protected(steps: int, root: Path) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    model = Regression()
    backoff = LRBackoff(factor=0.125, cooldown=5)
    rollback = Rollback(every_n_steps=5, max_rollbacks=8)
    callbacks = [NonFiniteDetector(), LossSpikeDetector(warmup=5), backoff, rollback]
    trainer(steps, root / "protected", callbacks).fit(model)
    events = list(read_journal(root / "protected" / "overflow_events.jsonl"))
    for event in events:
        if event["kind"] in ("spike", "backoff", "rollback", "skip"):
            print(f"  step {event['step']:>3} {event['kind']:<8} {event['message'][:150]}")
    return {
        "weights_finite": finite(model),
        "initial_loss": model.losses[0],
        "final_loss": tail_loss(model.losses),
        "backoffs": sum(e["kind"] == "backoff" for e in events),
        "rollbacks": rollback.rollbacks,
        "lr_scale": model.optimizers().param_groups[0]["lr"] / LR,  # type: ignore[union-attr]
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="fewer steps (CI)")
    args = parser.parse_args()
    steps = 60 if args.fast else 200
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        bare = unprotected(steps, root)
        print(f"unprotected: first non-finite loss at step {bare['first_nonfinite_step']}; weights finite at the end = "
              f"{bare['weights_finite']}")  # fmt: skip
        print("protected:")
        safe = protected(steps, root)
    print(f"protected:   {safe['backoffs']} backoff(s), {safe['rollbacks']} rollbacks, LR now {safe['lr_scale']:.3g} x "
          f"the configured one; loss {safe['initial_loss']:.4g} -> {safe['final_loss']:.4g}; weights finite = "
          f"{safe['weights_finite']}")  # fmt: skip
    print("RESULT " + json.dumps({"example": "large_batch_high_lr", "unprotected": bare, "protected": safe}))


if __name__ == "__main__":
    main()
