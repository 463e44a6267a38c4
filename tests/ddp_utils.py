"""Run a fit under DDP with 2 CPU processes (gloo, fork) and collect what each rank saw from small JSON files."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch


class RankReport(pl.Callback):
    """Writes ``rank<r>.json`` with the facts a test asserts on: weights digest, step, LR, callback state, error."""

    def __init__(self, directory: Path, watch: list[Any]) -> None:
        self.directory = Path(directory)
        self.watch = watch
        self.lrs: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    def _write(self, trainer: pl.Trainer, pl_module: pl.LightningModule, error: BaseException | None) -> None:
        state = {k: v.detach().cpu() for k, v in pl_module.state_dict().items()}
        digest = hashlib.sha256(b"".join(v.numpy().tobytes() for v in state.values())).hexdigest()
        report = {
            "rank": trainer.global_rank,
            "global_step": trainer.global_step,
            "digest": digest,
            "finite": all(bool(torch.isfinite(v).all()) for v in state.values() if v.is_floating_point()),
            "lrs": self.lrs,
            "states": [type(cb).__name__ + ":" + json.dumps(_jsonable(cb.state_dict()), sort_keys=True) for cb in self.watch],
            "error": None if error is None else {"type": type(error).__name__, "message": str(error),
                                                 "attrs": _jsonable(getattr(error, "__dict__", {}))},
        }
        (self.directory / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write(trainer, pl_module, None)

    def watch_errors(self, callback: Any) -> None:
        """Workers run without Lightning's exception handling (no ``on_exception``): record errors at the source."""
        for hook in HOOKS:
            original = getattr(callback, hook, None)
            if original is None:
                continue

            def wrapped(trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, _original: Any = original) -> Any:
                try:
                    return _original(trainer, pl_module, *args)
                except Exception as error:
                    self._write(trainer, pl_module, error)
                    raise

            setattr(callback, hook, wrapped)


HOOKS = ("on_train_batch_start", "on_before_backward", "on_before_optimizer_step", "on_train_batch_end")


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return repr(value)


def run_ddp(model: pl.LightningModule, callbacks: list[Any], directory: Path, **kwargs: Any) -> list[dict[str, Any]]:
    """Fit on 2 forked CPU processes; return each rank's report (rank 0 first). An error in the workers is
    re-raised in this process by Lightning; the reports are read either way."""
    watch = [cb for cb in callbacks if hasattr(cb, "state_dict")]
    report = RankReport(directory, watch)
    for callback in watch:
        report.watch_errors(callback)
    options: dict[str, Any] = {
        "max_steps": 6,
        "accelerator": "cpu",
        "devices": 2,
        "strategy": "ddp_fork",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
        "default_root_dir": str(directory),
    }
    options.update(kwargs)
    trainer = pl.Trainer(callbacks=[*callbacks, report], **options)
    error: BaseException | None = None
    try:
        trainer.fit(model)
    except Exception as caught:  # the workers' exception, re-raised by the launcher
        error = caught
    reports = [json.loads((Path(directory) / f"rank{r}.json").read_text()) for r in range(2)]
    if error is not None and all(r["error"] is None for r in reports):
        raise error
    return reports
