"""One corrupt sample in the data: its features are around 1e30, and the squared error of its batch is inf.

A regression dataset of 1024 samples, one of which was corrupted (every feature 1e30, as a bad sensor read or a
broken decode would give). Its batch comes back once an epoch.

Run ``python examples/corrupt_sample.py`` (``--fast`` for CI). What you will see:

- unprotected: the first time the corrupt batch comes, its loss is inf, the gradients NaN, and the weights NaN for
  good.
- protected (``NonFiniteDetector()``, ``action="skip"``): that optimizer step is skipped once an epoch, nothing else
  changes (an isolated non-finite step is not divergence: the learning rate is not touched). The first skip's
  journal entry carries the diagnosis: the first non-finite value appeared in ``mse_loss`` in ``training_step``,
  the batch holds values up to 1e+30, persistent (the replay reproduces it: the data, not the hardware), and the
  hint starts with the data. Training ends with about the loss of a run on the clean data (within about 10%: the
  63 good samples of the skipped batch are missed once an epoch).

The last line printed is ``RESULT {...}``, a JSON summary for scripts and tests.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_overflow import NonFiniteDetector, read_journal

logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", message=".*(does not have many workers|LeafSpec|GPU available).*")

CORRUPT = 617  # the index of the corrupt sample (batch 9 of 16 in each epoch)


def dataset(corrupt: bool, samples: int = 1024) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 8, generator=gen)
    y = x @ torch.randn(8, 1, generator=gen) + 0.1 * torch.randn(samples, 1, generator=gen)
    if corrupt:
        x = x.clone()
        x[CORRUPT] = 1e30
    return TensorDataset(x, y)


class Regression(pl.LightningModule):
    def __init__(self, corrupt: bool) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        self.data = dataset(corrupt)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=2e-2)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=64)


def clean_loss(model: Regression) -> float:
    """The mean squared error on the clean data (the corrupt sample left out)."""
    x, y = dataset(corrupt=False).tensors
    keep = torch.arange(len(x)) != CORRUPT
    with torch.no_grad():
        return float(nn.functional.mse_loss(model.net(x[keep]), y[keep]))


def fit(corrupt: bool, epochs: int, root: Path, callbacks: list[pl.Callback]) -> Regression:
    pl.seed_everything(0, verbose=False)
    model = Regression(corrupt)
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                         callbacks=callbacks)  # fmt: skip
    trainer.fit(model)
    return model


def finite(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="fewer epochs (CI)")
    args = parser.parse_args()
    epochs = 4 if args.fast else 8
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        bare = fit(True, epochs, root / "bare", [])
        print(f"unprotected: weights finite after {epochs} epochs = {finite(bare)}")
        detector = NonFiniteDetector()
        safe = fit(True, epochs, root / "protected", [detector])
        events = list(read_journal(root / "protected" / "overflow_events.jsonl"))
        clean = fit(False, epochs, root / "clean", [])
    first = events[0]
    diagnosis = first["details"]["diagnosis"]
    print(f"protected:   {detector.skipped_steps} steps skipped (one an epoch); the first one said:")
    print(f"  {first['message']}")
    print(f"  HINT: {diagnosis['hint']}")
    result = {
        "example": "corrupt_sample",
        "unprotected": {"weights_finite": finite(bare)},
        "protected": {
            "weights_finite": finite(safe),
            "skipped": detector.skipped_steps,
            "verdict": diagnosis["verdict"],
            "op": diagnosis["origin"]["op"] if diagnosis["origin"] else None,
            "batch_magnitude": diagnosis["replays"][0]["batch_magnitude"],
            "loss": clean_loss(safe),
        },
        "clean": {"loss": clean_loss(clean)},
    }
    print(f"final loss on the clean data: protected {result['protected']['loss']:.4g}, run on clean data "
          f"{result['clean']['loss']:.4g}")  # fmt: skip
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
