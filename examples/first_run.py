"""The README's four lines on a model of your own, whose data holds one corrupt sample.

A regression of 1024 samples in batches of 64, unshuffled; sample 707 (batch 11, row 3) has a NaN feature, as a
broken sensor read or a bad decode would give. Run ``python examples/first_run.py`` (``--out DIR`` for the logs,
default ``./first_run_logs``). What you will see, besides Lightning's own lines: the fit ends with what happened in
plain words, one line,

    lightning_overflow: what happened in this fit (the details: python -m lightning_overflow journal ...):
      - 10 steps skipped: batch 11 of each epoch holds NaN in row 3 (epochs 0-9): a data fault; check the data

and ``python -m lightning_overflow journal first_run_logs`` lists the journal; ``python -m lightning_overflow report
first_run_logs/lightning_logs/version_0`` draws the run.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_overflow import default_callbacks

CORRUPT = 11 * 64 + 3  # batch 11, row 3


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> DataLoader:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(1024, 8, generator=gen)
        y = x @ torch.randn(8, 1, generator=gen)
        x[CORRUPT, 2] = float("nan")
        return DataLoader(TensorDataset(x, y), batch_size=64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("first_run_logs"), help="where the logs go")
    args = parser.parse_args()
    pl.seed_everything(0, verbose=False)
    model = Regression()
    # The README's lines:
    trainer = pl.Trainer(max_epochs=10, callbacks=default_callbacks(), default_root_dir=args.out)
    trainer.fit(model)


if __name__ == "__main__":
    main()
