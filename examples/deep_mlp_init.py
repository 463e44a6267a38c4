"""A deep MLP with a too-large initialisation: the activations grow layer after layer until they overflow.

36 linear layers of width 128 with ReLU, weights drawn from N(0, 0.5) (``kaiming_normal_`` would use
std = sqrt(2 / 128) = 0.125): every layer multiplies the activations by about 3.5, so they reach 1e21 at the output
and the squared error of the very first batch is inf; its gradients are inf/NaN.

Run ``python examples/deep_mlp_init.py`` (``--fast`` for CI). What you will see:

- unprotected: the first optimizer step writes NaN into the weights; the run goes on training NaN.
- protected (``NonFiniteDetector(action="raise")``): training stops at step 0 with a ``NonFiniteError`` whose
  diagnosis replays the batch and says where and why: the first non-finite value appeared in the forward pass, in
  ``mse_loss`` in ``training_step``, from network outputs of magnitude ~1e21, because the activations grew about
  3.5x per layer through all 37 layers (``net.0`` -> ``net.72``); persistent (the replay reproduces it); HINT:
  initialise with std = gain / sqrt(fan_in) or add normalisation.

The last line printed is ``RESULT {...}``, a JSON summary for scripts and tests.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import warnings
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_overflow import NonFiniteDetector, NonFiniteError

logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", message=".*(does not have many workers|LeafSpec|GPU available).*")


class DeepMLP(pl.LightningModule):
    """``depth`` Linear + ReLU layers initialised from N(0, ``std``), on a fixed regression problem."""

    def __init__(self, depth: int = 36, width: int = 128, std: float = 0.5, samples: int = 512) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth):
            linear = nn.Linear(width, width)
            nn.init.normal_(linear.weight, 0.0, std)
            nn.init.zeros_(linear.bias)
            layers += [linear, nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, 1))
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(samples, width, generator=gen)
        self.data = TensorDataset(x, x[:, :4].sum(dim=1, keepdim=True))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=64)


def trainer(steps: int, root: str, callbacks: list[pl.Callback]) -> pl.Trainer:
    return pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                      callbacks=callbacks)  # fmt: skip


def finite(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def unprotected(steps: int, root: str) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    model = DeepMLP()
    trainer(steps, root, []).fit(model)
    return {"weights_finite": finite(model)}


def protected(steps: int, root: str) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    model = DeepMLP()
    try:
        trainer(steps, root, [NonFiniteDetector(action="raise")]).fit(model)
    except NonFiniteError as error:
        print(f"\nprotected run stopped:\n  {error}\n")
        diagnosis = error.diagnosis
        origin, growth = diagnosis.origin, diagnosis.replays[0].trace.growth
        return {
            "raised": True,
            "step": error.step,
            "verdict": diagnosis.verdict,
            "direction": origin.direction if origin else None,
            "op": origin.op if origin else None,
            "growth_layers": growth.layers if growth else 0,
            "growth_factor": round(growth.factor, 2) if growth else None,
            "hint_names_initialisation": "initialis" in error.hint,
        }
    return {"raised": False}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="fewer steps (CI)")
    args = parser.parse_args()
    steps = 3 if args.fast else 20
    with tempfile.TemporaryDirectory() as root:
        bare = unprotected(steps, root)
        print(f"unprotected: weights finite after {steps} steps = {bare['weights_finite']}")
        safe = protected(steps, root)
    print(f"protected:   stopped at step {safe.get('step')} with a {safe.get('verdict')} diagnosis; the activations "
          f"grew {safe.get('growth_factor')}x per layer through {safe.get('growth_layers')} layers")  # fmt: skip
    print("RESULT " + json.dumps({"example": "deep_mlp_init", "unprotected": bare, "protected": safe}))


if __name__ == "__main__":
    main()
