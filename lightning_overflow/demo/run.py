"""The demo: the same diverging run twice, bare and with ``default_callbacks()``, compared side by side."""

from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.loggers import CSVLogger
from torch.utils.data import Subset

from lightning_overflow.callbacks.grad_norm_monitor import GradNormMonitor
from lightning_overflow.composition import default_callbacks
from lightning_overflow.demo.data import ByteWindows, stdlib_corpus
from lightning_overflow.demo.model import ByteTransformer
from lightning_overflow.events import JOURNAL_NAME, read_journal
from lightning_overflow.report import load_run, render

__all__ = ["DEFAULT_LR", "RunResult", "run_demo"]

DEFAULT_LR = 2e-2  # about 7x what this model trains well at: it diverges bare within a few hundred steps


@dataclass
class RunResult:
    """What one run of the demo achieved."""

    label: str
    log_dir: Path
    steps: int
    train_loss: float
    val_loss: float
    events: dict[str, int]
    wall_s: float
    stopped_by: str = ""


def _data() -> tuple[ByteWindows, Subset[Any]]:
    corpus = stdlib_corpus()
    split = int(len(corpus) * 0.95)
    val = ByteWindows(corpus[split:])
    return ByteWindows(corpus[:split]), Subset(val, range(min(len(val), 512)))


class _LastLosses(pl.Callback):
    """The mean training loss of the last steps (NaN when the run diverged)."""

    def __init__(self, keep: int = 20) -> None:
        self.keep = keep
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *_: Any) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is not None:
            self.losses = [*self.losses[-self.keep + 1 :], float(loss)]

    @property
    def mean(self) -> float:
        return sum(self.losses) / len(self.losses) if self.losses else math.nan


class _StopWhenDead(pl.Callback):
    """Stop a run whose loss has been non-finite for ``patience`` consecutive steps: NaN weights never recover."""

    def __init__(self, patience: int = 20) -> None:
        self.patience = patience
        self.dead = 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *_: Any) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.dead = self.dead + 1 if loss is not None and not math.isfinite(float(loss)) else 0
        if self.dead >= self.patience:
            trainer.should_stop = True


def _trainer(steps: int, accelerator: str, logger: CSVLogger, callbacks: list[pl.Callback]) -> pl.Trainer:
    return pl.Trainer(
        max_steps=steps,
        accelerator=accelerator,
        devices=1,
        logger=logger,
        callbacks=callbacks,
        log_every_n_steps=1,  # the dashboard draws every event at the step it happened
        limit_val_batches=4,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_model_summary=False,
        # A progress bar redraws itself in a terminal; in a CI log or a batch job's file it is line after line.
        enable_progress_bar=sys.stdout.isatty(),
    )


def _run(label: str, protected: bool, steps: int, seed: int, out: Path, accelerator: str, lr: float) -> RunResult:
    pl.seed_everything(seed, verbose=False)
    train, val = _data()
    model = ByteTransformer(train, val, lr=lr)
    last = _LastLosses()
    suite = default_callbacks(snapshot_every_n_steps=25) if protected else [GradNormMonitor()]
    logger = CSVLogger(str(out), name=label, version="")
    trainer = _trainer(steps, accelerator, logger, [*suite, last, _StopWhenDead()])
    start = time.perf_counter()
    stopped_by = ""
    try:
        trainer.fit(model)
    except Exception as error:  # noqa: BLE001  # the suite's own verdict (DivergenceError...) is part of the comparison
        stopped_by = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
    wall = time.perf_counter() - start
    if not stopped_by:
        trainer.validate(model, verbose=False)  # also for a run stopped early: its validation loss is the verdict
    log_dir = Path(logger.log_dir)
    journal = log_dir / JOURNAL_NAME
    events: dict[str, int] = {}
    if journal.exists():
        for event in read_journal(journal):
            events[event["kind"]] = events.get(event["kind"], 0) + 1
    val_loss = trainer.callback_metrics.get("val_loss")
    return RunResult(
        label=label,
        log_dir=log_dir,
        steps=int(trainer.global_step),
        train_loss=last.mean,
        val_loss=float(val_loss) if val_loss is not None else math.nan,
        events=events,
        wall_s=wall,
        stopped_by=stopped_by,
    )


def _ending(result: RunResult, steps: int) -> str:
    """How a run ended, in a table cell: ``finished``, ``NaN, stopped``, ``NaN at the end`` or the error's class.
    The verdict is the validation loss after the run, NaN once the weights are: not the last 20 training losses, NaN
    also where they hold the losses of steps a protected run skipped before it recovered."""
    if result.stopped_by:
        return result.stopped_by.split(":", 1)[0]
    if not math.isfinite(result.val_loss):
        return "NaN, stopped" if result.steps < steps else "NaN at the end"
    return "finished"


def _table(results: list[RunResult], steps: int) -> str:
    rows = [
        ("how it ended", [_ending(r, steps) for r in results]),
        ("steps completed", [str(r.steps) for r in results]),
        ("final train loss (last 20)", [f"{r.train_loss:.3f}" for r in results]),
        ("final validation loss", [f"{r.val_loss:.3f}" for r in results]),
        ("skipped steps", [str(r.events.get("skip", 0)) for r in results]),
        ("loss / grad spikes", [str(r.events.get("spike", 0)) for r in results]),
        ("LR backoffs", [str(r.events.get("backoff", 0)) for r in results]),
        ("rollbacks", [str(r.events.get("rollback", 0)) for r in results]),
        ("wall time", [f"{r.wall_s:.0f} s" for r in results]),
    ]
    width = max(len(name) for name, _ in rows)
    cols = [max(len(r.label), *(len(v[i]) for _, v in rows)) for i, r in enumerate(results)]
    lines = [" " * width + "  " + "  ".join(r.label.rjust(c) for r, c in zip(results, cols))]
    lines += [name.ljust(width) + "  " + "  ".join(v.rjust(c) for v, c in zip(values, cols)) for name, values in rows]
    return "\n".join(lines)


def run_demo(steps: int = 500, seed: int = 0, out: Path = Path("overflow_demo"), accelerator: str = "cpu",
             lr: float | None = None) -> list[RunResult]:
    """Train the byte-level transformer bare and protected, print the comparison, write the dashboard."""
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(f"'steps' must be an int (got {type(steps).__name__})")
    if steps < 1:
        raise ValueError(f"'steps' must be >= 1 (got {steps})")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= 2**32 - 1:
        raise ValueError(f"'seed' must be an int in [0, {2**32 - 1}] (got {seed!r})")
    if lr is not None and not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise ValueError(f"'lr' must be a finite number > 0 or None (got {lr!r})")
    logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)
    logging.getLogger("lightning_overflow").setLevel(logging.INFO)  # the fit in plain words
    lr = DEFAULT_LR if lr is None else lr
    out = Path(out)
    print(f"lightning_overflow demo: a byte-level transformer on the standard library's source, Adam lr={lr:g}, "
          f"{steps} steps, run bare (GradNormMonitor only) and with default_callbacks(); output in {out.resolve()}")
    print("A run whose loss stays NaN for 20 steps is stopped there: its weights are lost.")
    results = [
        _run("unprotected", False, steps, seed, out, accelerator, lr),
        _run("protected", True, steps, seed, out, accelerator, lr),
    ]
    print()
    print(_table(results, steps))
    for result in results:
        if result.stopped_by:
            print(f"{result.label} stopped: {result.stopped_by}")
    title = f"byte transformer, Adam lr={lr:g}: unprotected vs default_callbacks()"
    picture = render([load_run(r.log_dir, r.label) for r in results], out / "dashboard.png", title=title)
    print(f"\ndashboard: {picture}")
    print(f"redraw:    python -m lightning_overflow report {' '.join(str(r.log_dir) for r in results)} "
          f"--title '{title}' --out {picture}")
    print(f"journal:   python -m lightning_overflow journal {results[1].log_dir}")
    return results
