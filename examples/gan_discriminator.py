"""A GAN whose discriminator overpowers the generator (manual optimization, two optimizers).

The discriminator learns a thousand times faster than the generator (Adam, LR 0.1 against 1e-4) and soon scores
the fakes at logits below -100. The losses are written the textbook way, ``-log(sigmoid(D(x)))``: ``sigmoid`` of
such a logit is 0 in FP32, ``log(0)`` is -inf, and the generator's loss and gradients turn inf/NaN.

Run ``python examples/gan_discriminator.py`` (``--fast`` for CI). What you will see:

- unprotected: at some batch the generator's loss is inf; its gradients are NaN, its weights NaN, and every fake
  (and then the discriminator) after them.
- protected (``NonFiniteDetector()``): each generator step whose loss is inf is skipped (optimizer 1 only: the
  discriminator keeps training), and every weight stays finite to the end. The journal says which optimizer, and
  its diagnosis says plainly that under manual optimization the step is not replayed (re-running training_step
  would step the other optimizer again) rather than guessing.
- with the stable form of the same losses (``F.logsigmoid``, what ``binary_cross_entropy_with_logits`` computes):
  the generator's loss stays finite (about the size of the logit) and nothing is skipped.

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

from lightning_overflow import NonFiniteDetector, read_journal

logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", message=".*(does not have many workers|LeafSpec|GPU available).*")


class GAN(pl.LightningModule):
    """Generator 8 -> 2, discriminator 2 -> 1; real points around (8, 8)."""

    def __init__(self, stable: bool = False, samples: int = 8192) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.stable = stable
        self.generator = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
        self.discriminator = nn.Sequential(nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
        gen = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(samples, 2, generator=gen) * 0.5 + 8.0)
        self.g_losses: list[float] = []

    def log_sigmoid(self, logits: Tensor) -> Tensor:
        return nn.functional.logsigmoid(logits) if self.stable else torch.log(torch.sigmoid(logits))

    def training_step(self, batch: list[Tensor], batch_idx: int) -> None:
        (real,) = batch
        opt_d, opt_g = self.optimizers()  # type: ignore[misc]
        fake = self.generator(torch.randn(len(real), 8))
        d_loss = -(self.log_sigmoid(self.discriminator(real)) + self.log_sigmoid(-self.discriminator(fake.detach())))
        opt_d.zero_grad()
        self.manual_backward(d_loss.mean())
        opt_d.step()
        g_loss = -self.log_sigmoid(self.discriminator(fake)).mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.g_losses.append(float(g_loss.detach()))

    def configure_optimizers(self) -> Any:
        return (
            torch.optim.Adam(self.discriminator.parameters(), lr=0.1),
            torch.optim.Adam(self.generator.parameters(), lr=1e-4),
        )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=64)


def fit(stable: bool, batches: int, root: Path, callbacks: list[pl.Callback]) -> GAN:
    pl.seed_everything(0, verbose=False)
    model = GAN(stable)
    trainer = pl.Trainer(max_steps=2 * batches, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=root, callbacks=callbacks)  # fmt: skip
    trainer.fit(model)
    return model


def finite(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="fewer batches (CI)")
    args = parser.parse_args()
    batches = 40 if args.fast else 150
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        bare = fit(False, batches, root / "bare", [])
        first_bad = next((i for i, v in enumerate(bare.g_losses) if not math.isfinite(v)), None)
        print(f"unprotected: generator loss first non-finite at batch {first_bad}; weights finite at the end = "
              f"{finite(bare)}")  # fmt: skip
        detector = NonFiniteDetector()
        safe = fit(False, batches, root / "protected", [detector])
        events = [e for e in read_journal(root / "protected" / "overflow_events.jsonl") if e["kind"] == "nonfinite"]
        stable_detector = NonFiniteDetector()
        stable = fit(True, batches, root / "stable", [stable_detector])
    first = events[0] if events else {"message": "", "details": {}}
    print(f"protected:   {detector.skipped_steps} generator steps skipped; weights finite = {finite(safe)}; the first:")
    print(f"  {first['message']}")
    print(f"stable form: {stable_detector.skipped_steps} steps skipped; last generator loss {stable.g_losses[-1]:.4g}")
    diagnosis = first["details"].get("diagnosis") or {}
    result = {
        "example": "gan_discriminator",
        "unprotected": {"weights_finite": finite(bare), "first_nonfinite_batch": first_bad},
        "protected": {
            "weights_finite": finite(safe),
            "skipped": detector.skipped_steps,
            "optimizers": sorted({e["details"]["optimizer"] for e in events}),
            "replayed": diagnosis.get("replayed"),
            "reason": diagnosis.get("reason", ""),
        },
        "stable": {"weights_finite": finite(stable), "skipped": stable_detector.skipped_steps,
                   "last_generator_loss": stable.g_losses[-1]},  # fmt: skip
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
