"""An InfoNCE (contrastive) loss written with a raw ``exp(sim / tau)``: it overflows once the similarities grow.

The loss is the textbook formula ``-log(exp(s_ii / tau) / sum_j exp(s_ij / tau))`` at ``tau = 0.1`` on unnormalised
embeddings. Training makes the embeddings longer, the similarities pass 8.9 and ``exp(s / 0.1)`` passes the FP32
limit (exp overflows above 88.7): the loss becomes inf / inf = NaN.

Run ``python examples/infonce_exp.py`` (``--fast`` for CI). What you will see:

- unprotected: after some healthy steps the loss turns NaN and NaN spreads into every weight.
- protected (``NonFiniteDetector(action="raise")``): the run stops at that step with a ``NonFiniteError`` whose
  diagnosis names the op: the first non-finite value appeared in the forward pass in ``training_step`` (outside
  every module), op ``exp``, from inputs above 88.7; persistent; HINT: compute the log of a sum of exponentials with
  ``torch.logsumexp`` or subtract the max (``F.cross_entropy`` on the logits ``sim / tau`` does both).
- with the hint applied (``F.cross_entropy(sim / tau, targets)``, the same maths): the run trains to the end with
  a finite loss.

The last line printed is ``RESULT {...}``, a JSON summary for scripts and tests.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
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

TAU = 0.1


class Contrastive(pl.LightningModule):
    """An encoder trained to match two noisy views of the same point; ``stable`` picks the form of the loss."""

    def __init__(self, stable: bool = False, samples: int = 1024) -> None:
        super().__init__()
        self.stable = stable
        self.encoder = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
        gen = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(samples, 32, generator=gen))
        self.losses: list[float] = []

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        (x,) = batch
        a = self.encoder(x + 0.1 * torch.randn_like(x))  # two noisy views of each point
        b = self.encoder(x + 0.1 * torch.randn_like(x))
        sim = a @ b.T  # unnormalised: grows with the embeddings' length
        if self.stable:
            loss = nn.functional.cross_entropy(sim / TAU, torch.arange(len(x)))
        else:
            loss = -torch.log(torch.exp(sim.diagonal() / TAU) / torch.exp(sim / TAU).sum(dim=1)).mean()
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)

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
    model = Contrastive()
    trainer(steps, root, []).fit(model)
    first_nan = next((i for i, v in enumerate(model.losses) if not math.isfinite(v)), None)
    return {"weights_finite": finite(model), "first_nonfinite_step": first_nan}


def protected(steps: int, root: str) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    try:
        trainer(steps, root, [NonFiniteDetector(action="raise")]).fit(Contrastive())
    except NonFiniteError as error:
        print(f"\nprotected run stopped:\n  {error}\n")
        origin = error.diagnosis.origin
        return {
            "raised": True,
            "step": error.step,
            "verdict": error.diagnosis.verdict,
            "op": origin.op if origin else None,
            "module": origin.module if origin else None,
            "direction": origin.direction if origin else None,
            "input_magnitude": origin.input_magnitude if origin else None,
            "hint_logsumexp": "torch.logsumexp" in error.hint,
        }
    return {"raised": False}


def with_the_hint_applied(steps: int, root: str) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    model = Contrastive(stable=True)
    detector = NonFiniteDetector(action="raise")
    trainer(steps, root, [detector]).fit(model)
    return {
        "weights_finite": finite(model),
        "final_loss": model.losses[-1],
        "nonfinite_events": detector.nonfinite_events,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="fewer steps (CI)")
    args = parser.parse_args()
    steps = 40 if args.fast else 150
    with tempfile.TemporaryDirectory() as root:
        bare = unprotected(steps, root)
        print(f"unprotected: first non-finite loss at step {bare['first_nonfinite_step']}; weights finite at the end = "
              f"{bare['weights_finite']}")  # fmt: skip
        safe = protected(steps, root)
        fixed = with_the_hint_applied(steps, root)
    print(f"protected:   stopped at step {safe.get('step')}: op {safe.get('op')} in training_step, "
          f"{safe.get('verdict')}")  # fmt: skip
    print(f"hint applied (F.cross_entropy on sim / tau): {steps} steps, final loss {fixed['final_loss']:.4g}, weights "
          f"finite = {fixed['weights_finite']}")  # fmt: skip
    result = {"example": "infonce_exp", "unprotected": bare, "protected": safe, "hint_applied": fixed}
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
