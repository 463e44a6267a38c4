"""Quickstart: a NaN in one step's loss, without and with the suite.

Run ``python examples/quickstart.py``. You will see the unprotected run end with NaN weights, and the protected run
skip the poisoned step (weights finite), with the event journal saying what happened and where.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import pytorch_lightning as pl
import torch

from lightning_overflow import GradNormMonitor, NonFiniteDetector, read_journal
from lightning_overflow.testing import Fault, FaultInjector, TinyRegressor


def run(protected: bool, steps: int, root: Path) -> tuple[bool, pl.Trainer]:
    pl.seed_everything(0, verbose=False)
    model = TinyRegressor()
    callbacks: list[pl.Callback] = [FaultInjector(Fault(step=steps // 2, kind="nan_loss"))]
    if protected:
        callbacks += [GradNormMonitor(), NonFiniteDetector(action="skip")]
    trainer = pl.Trainer(max_steps=steps, callbacks=callbacks, default_root_dir=root, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model)
    return all(bool(torch.isfinite(p).all()) for p in model.parameters()), trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        bare_ok, _ = run(False, args.steps, Path(tmp) / "bare")
        safe_ok, _ = run(True, args.steps, Path(tmp) / "protected")
        print(f"unprotected: weights finite = {bare_ok}")
        print(f"protected:   weights finite = {safe_ok}")
        for event in read_journal(Path(tmp) / "protected" / "overflow_events.jsonl"):
            print(f"  step {event['step']:>3} {event['kind']:<9} {event['message']}")


if __name__ == "__main__":
    main()
