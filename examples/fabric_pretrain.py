"""A litgpt-style pretraining loop under Lightning Fabric, kept alive by ``Guard``.

A small GPT (2 pre-norm blocks whose attention uses a naive ``exp`` softmax, no max subtracted, as many hand-written
attentions do) learns the next byte of the Python standard library's source (no download), the way litgpt's
``pretrain`` loop trains: ``fabric.setup(model, optimizer)``, AdamW with weight decay and betas (0.9, 0.95), a linear
warm-up into a cosine schedule, gradient accumulation over 2 micro-batches under ``fabric.no_backward_sync``,
``fabric.backward``. The peak learning rate, 0.05, is about twice what this model trains at: shortly after the
warm-up the attention scores pass 88, ``exp`` overflows and the loss is NaN.

The guard takes the place of ``optimizer.step(); scheduler.step(); optimizer.zero_grad()``:
``guard.step(losses, batch=batches)`` after the accumulation window, with the micro-batches' losses and the
micro-batches (read only if the step is inf/NaN, to tell a data fault apart).

Run ``python examples/fabric_pretrain.py`` (``--fast`` for CI). What you will see:

- unprotected: the loss turns NaN a few steps after the warm-up; every later step is NaN.
- protected: the non-finite steps are skipped; as they keep coming on clean batches, the learning rate is halved and
  the run restored to its last snapshot verified finite, and it trains on to the end with a finite loss close to a
  run started at the stable rate.

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

import torch
from lightning.fabric import Fabric
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_overflow import Guard, default_callbacks
from lightning_overflow.demo.data import ByteWindows, stdlib_corpus
from lightning_overflow.demo.model import Block

logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", message=".*(does not have many workers|LeafSpec).*")

CONTEXT, MICRO_BATCH, ACCUMULATE, WARMUP = 64, 16, 2, 20


class GPT(nn.Module):
    """Byte embeddings, learned positions, pre-norm blocks with a naive softmax, a final norm and an untied head."""

    def __init__(self, dim: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.position = nn.Parameter(torch.randn(CONTEXT, dim) * 0.02)
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(layers)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 256)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.norm(self.blocks(self.embed(tokens) + self.position[: tokens.shape[1]])))


def lr_lambda(steps: int) -> Any:
    """litgpt's schedule: linear warm-up, then cosine down to 10% of the peak."""

    def factor(step: int) -> float:
        if step < WARMUP:
            return (step + 1) / WARMUP
        progress = min(1.0, (step - WARMUP) / max(1, steps - WARMUP))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def pretrain(steps: int, lr: float, protected: bool, root: Path) -> dict[str, Any]:
    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
    fabric.seed_everything(1337, verbose=False)
    with fabric.init_module():
        model = GPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    model, optimizer = fabric.setup(model, optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(steps))
    data = ByteWindows(stdlib_corpus(400_000), context=CONTEXT)
    loader = fabric.setup_dataloaders(
        DataLoader(data, batch_size=MICRO_BATCH, shuffle=True, generator=torch.Generator().manual_seed(0))
    )
    guard = None
    if protected:
        guard = Guard(model, optimizer, scheduler, default_callbacks(snapshot_every_n_steps=10), default_root_dir=root)
    losses: list[Tensor] = []
    batches: list[tuple[Tensor, Tensor]] = []
    history: list[float] = []
    skipped, rolled_back, backed_off = [], [], []
    iterator = iter(loader)
    for iter_num in range(steps * ACCUMULATE):
        x, y = next(iterator)
        accumulating = (iter_num + 1) % ACCUMULATE != 0
        with fabric.no_backward_sync(model, enabled=accumulating):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            fabric.backward(loss / ACCUMULATE)
        losses.append(loss.detach())
        batches.append((x, y))
        if accumulating:
            continue
        history.append(float(torch.stack(losses).mean()))
        if guard is None:
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        else:
            outcome = guard.step(losses, batch=batches)  # the window's micro-batch losses, as computed, and batches
            if outcome.skipped:
                skipped.append(outcome.step)
            if outcome.rolled_back:
                rolled_back.append(outcome.step)
            if outcome.backed_off:
                backed_off.append(outcome.step)
        losses, batches = [], []
    if guard is not None:
        guard.close()
    tail = history[-10:]
    first_nan = next((i for i, v in enumerate(history) if not math.isfinite(v)), None)
    return {
        "final_loss": sum(tail) / len(tail) if all(map(math.isfinite, tail)) else float("nan"),
        "first_nan_step": first_nan,
        "weights_finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
        "skipped": skipped,
        "backed_off": backed_off,
        "rolled_back": rolled_back,
        "lr_end": float(optimizer.param_groups[0]["lr"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="120 optimizer steps instead of 400")
    args = parser.parse_args()
    steps = 120 if args.fast else 400
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        unprotected = pretrain(steps, 0.05, protected=False, root=Path(tmp))
        stable = pretrain(steps, 0.025, protected=False, root=Path(tmp))
        protected = pretrain(steps, 0.05, protected=True, root=Path(tmp) / "protected")
    print(f"unprotected (peak LR 0.05): first NaN at step {unprotected['first_nan_step']}, "
          f"final loss {unprotected['final_loss']}")  # fmt: skip
    print(f"stable (peak LR 0.025): final loss {stable['final_loss']:.3f}")
    print(f"protected (peak LR 0.05): final loss {protected['final_loss']:.3f}; skipped {protected['skipped']}, "
          f"backed off at {protected['backed_off']}, rolled back at {protected['rolled_back']}")  # fmt: skip
    print("RESULT " + json.dumps({"example": "fabric_pretrain", "unprotected": unprotected, "stable": stable,
                                  "protected": protected}))  # fmt: skip


if __name__ == "__main__":
    main()
