"""Fit under ``strategy="ddp"`` (Lightning relaunches this script for rank 1) and write ``rank<r>.json``.

Usage: ``python ddp_subprocess_fit.py OUT_DIR SCENARIO`` with SCENARIO ``rollback`` (a NaN weight on rank 1 once) or
``exhausted`` (NaN weights on rank 1 at every step: the rollback budget runs out and the run must stop on every
rank with DivergenceError, leaving finite weights for OnExceptionCheckpoint).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import OnExceptionCheckpoint

from lightning_overflow import default_callbacks
from lightning_overflow.testing import Fault, FaultInjector, TinyRegressor


def digest(module: torch.nn.Module) -> str:
    return hashlib.sha256(b"".join(v.detach().numpy().tobytes() for v in module.state_dict().values())).hexdigest()


def main() -> None:
    out, scenario = Path(sys.argv[1]), sys.argv[2]
    steps = range(6, 40) if scenario == "exhausted" else [6]
    faults = FaultInjector(*[Fault(s, "nan_weight", rank=1) for s in steps])
    suite = default_callbacks(snapshot_every_n_steps=2, max_rollbacks=2)
    pl.seed_everything(0, verbose=False)
    model = TinyRegressor()
    trainer = pl.Trainer(max_steps=20, accelerator="cpu", devices=2, strategy="ddp", logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=True,
                         default_root_dir=out, callbacks=[*suite, faults, OnExceptionCheckpoint(out / "on_exception")])
    error = None
    try:
        trainer.fit(model)
    except Exception as caught:
        error = f"{type(caught).__name__}: {caught}"
    rollback = suite[-1]
    report = {
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "digest": digest(model),
        "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
        "rollbacks": rollback.rollbacks,
        "history": rollback.history,
        "error": error,
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report, default=str))


if __name__ == "__main__":
    main()
