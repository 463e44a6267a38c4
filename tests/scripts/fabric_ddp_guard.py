"""A Fabric loop under ``strategy="ddp"`` on 2 CPU processes (Fabric relaunches this script for rank 1) with
``Guard``, each rank on its own half of the data: a NaN loss on rank 1 at step 3, a NaN weight on rank 1 at step 6;
or (``raises``) the guard runs each step (``train_step``) and the loss function raises on rank 1's NaN batch at step 3,
as a likelihood that checks its arguments does. Writes ``rank<r>.json`` (each step's outcome, the parameters' digest,
their finiteness).

Usage: ``python fabric_ddp_guard.py OUT_DIR [raises]``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_overflow import Guard, default_callbacks
from lightning_overflow.testing import regression_data


def loss_fn(net: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    output = net(batch[0])
    torch.distributions.Normal(output, 1.0, validate_args=True)  # raises on a NaN mean
    return nn.functional.mse_loss(output, batch[1])


def train(fabric: Fabric, out: Path, raises: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1))
    model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))
    rank = fabric.global_rank
    x, y = regression_data(n_samples=64).tensors
    x, y = x[rank::2], y[rank::2]
    runs = {"loss_fn": loss_fn, "backward": fabric.backward} if raises else {}
    guard = Guard(model, optimizer, callbacks=default_callbacks(snapshot_every_n_steps=4), default_root_dir=out,
                  **runs)  # type: ignore[arg-type]
    outcomes = []
    for step in range(12):
        if raises:
            batch = slice((step % 4) * 8, (step % 4) * 8 + 8)
            inputs = x[batch].clone()
            if step == 3 and rank == 1:
                inputs[2, 0] = float("nan")
            outcome = guard.train_step((inputs, y[batch]))
            outcomes.append([outcome.step, outcome.skipped, outcome.rolled_back, [e.kind for e in outcome.events]])
            continue
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
    fabric.barrier()  # both reports are written before either process ends
    torch.distributed.destroy_process_group()
    # No interpreter teardown: there the DDP reducer's destructor joins gloo's threads while one of them waits for
    # the GIL it holds ("terminate called without an active exception" now and then, and exit code -6).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch(train, Path(sys.argv[1]), sys.argv[2:] == ["raises"])
