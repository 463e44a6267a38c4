"""A Fabric loop under ``strategy="ddp"`` on 2 CPU processes (Fabric relaunches this script for rank 1) with
``Guard``, each rank on its own half of the data: a NaN loss on rank 1 at step 3, a NaN weight on rank 1 at step 6.
Writes ``rank<r>.json`` (each step's outcome, the parameters' digest, their finiteness).

Usage: ``python fabric_ddp_guard.py OUT_DIR``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_overflow import Guard, default_callbacks
from lightning_overflow.testing import regression_data


def train(fabric: Fabric, out: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1))
    model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))
    rank = fabric.global_rank
    x, y = regression_data(n_samples=64).tensors
    x, y = x[rank::2], y[rank::2]
    guard = Guard(model, optimizer, callbacks=default_callbacks(snapshot_every_n_steps=4), default_root_dir=out)
    outcomes = []
    for step in range(12):
        if step == 6 and rank == 1:
            with torch.no_grad():
                next(model.parameters()).view(-1)[0] = float("nan")
        batch = slice((step % 4) * 8, (step % 4) * 8 + 8)
        loss = nn.functional.mse_loss(model(x[batch]), y[batch])
        if step == 3 and rank == 1:
            loss = loss * float("nan")
        fabric.backward(loss)
        outcome = guard.step(loss)
        outcomes.append([outcome.step, outcome.skipped, outcome.rolled_back, [e.kind for e in outcome.events]])
    guard.close()
    params = [p.detach() for p in model.parameters()]
    report = {
        "outcomes": outcomes,
        "digest": hashlib.sha256(b"".join(p.numpy().tobytes() for p in params)).hexdigest(),
        "finite": all(bool(torch.isfinite(p).all()) for p in params),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch(train, Path(sys.argv[1]))
