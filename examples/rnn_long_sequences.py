"""An RNN on long sequences with an expansive recurrent matrix: the hidden state and its gradients explode.

A ReLU RNN (hidden size 32) reads sequences of 100 steps; its recurrent matrix is orthogonal times 1.5, so each
step can stretch the hidden state by up to 1.5x. Backpropagation through time multiplies the gradient by the same
matrix a hundred times: the first gradient norms are in the thousands, and one plain SGD step makes the recurrent
matrix so large that the next forward pass overflows (Pascanu, Mikolov and Bengio, "On the difficulty of training
recurrent neural networks", ICML 2013, the origin of gradient clipping).

Run ``python examples/rnn_long_sequences.py`` (``--fast`` for CI). What you will see:

- unprotected: the loss jumps to about 1e10 at step 1 and is NaN from step 2; the weights end NaN.
- protected (``AutoClip(mode="fixed", max_norm=1.0)`` and ``NonFiniteDetector``): the gradients (norms in the
  thousands) are clipped to norm 1 on almost every step, the hidden state stays bounded, no step is non-finite,
  and the mean loss of the last epoch is below that of the first.

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
from torch.utils.data import DataLoader, TensorDataset

from lightning_overflow import AutoClip, NonFiniteDetector

logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", message=".*(does not have many workers|LeafSpec|GPU available).*")

LENGTH = 100
RADIUS = 1.5


class SequenceRegression(pl.LightningModule):
    """Predict the sum of the last 10 values of the first feature from the RNN's final hidden state."""

    def __init__(self, samples: int = 512) -> None:
        super().__init__()
        self.rnn = nn.RNN(4, 32, nonlinearity="relu", batch_first=True)
        self.head = nn.Linear(32, 1)
        with torch.no_grad():
            nn.init.orthogonal_(self.rnn.weight_hh_l0)
            self.rnn.weight_hh_l0.mul_(RADIUS)  # expansive: some directions grow 1.5x per step
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(samples, LENGTH, 4, generator=gen)
        self.data = TensorDataset(x, x[:, -10:, 0].sum(dim=1, keepdim=True))
        self.losses: list[float] = []
        self.hidden: list[float] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        out, _ = self.rnn(x)
        loss = nn.functional.mse_loss(self.head(out[:, -1]), y)
        self.losses.append(float(loss.detach()))
        self.hidden.append(float(out.detach().abs().amax()))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=32)


def fit(steps: int, root: Path, callbacks: list[pl.Callback]) -> SequenceRegression:
    pl.seed_everything(0, verbose=False)
    model = SequenceRegression()
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                         callbacks=callbacks)  # fmt: skip
    trainer.fit(model)
    return model


def finite(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="fewer steps (CI)")
    args = parser.parse_args()
    steps = 64 if args.fast else 192
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        bare = fit(steps, root / "bare", [])
        first_bad = next((i for i, v in enumerate(bare.losses) if not math.isfinite(v)), None)
        print(f"unprotected: losses {', '.join(f'{v:.3g}' for v in bare.losses[:4])} ...; first non-finite at step "
              f"{first_bad}; weights finite at the end = {finite(bare)}")  # fmt: skip
        clip, detector = AutoClip(mode="fixed", max_norm=1.0), NonFiniteDetector()
        safe = fit(steps, root / "protected", [detector, clip])
    epoch = 16  # batches per epoch: compare whole epochs, single batches are noisy
    first, last = mean(safe.losses[:epoch]), mean(safe.losses[-epoch:])
    print(f"protected:   mean loss of the first epoch {first:.4g}, of the last {last:.4g}; largest hidden value "
          f"{max(safe.hidden):.3g}; clipped steps {clip.clipped_steps} of {clip.steps}; non-finite steps "
          f"{detector.nonfinite_events}; weights finite = {finite(safe)}")
    result = {
        "example": "rnn_long_sequences",
        "unprotected": {"weights_finite": finite(bare), "first_nonfinite_step": first_bad},
        "protected": {
            "weights_finite": finite(safe),
            "nonfinite_events": detector.nonfinite_events,
            "clipped_steps": clip.clipped_steps,
            "first_epoch_loss": first,
            "last_epoch_loss": last,
            "largest_hidden": max(safe.hidden),
        },
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
