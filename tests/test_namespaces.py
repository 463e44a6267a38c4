"""Both Lightning namespaces: callbacks run in either Trainer and LightningCLI configures them from YAML."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_overflow
from lightning_overflow import GradNormMonitor, NonFiniteDetector
from lightning_overflow.testing import Fault, FaultInjector, TinyRegressor


class UnifiedRegressor(L.LightningModule):
    """The same problem as TinyRegressor, written against ``lightning.pytorch``."""

    def __init__(self, lr: float = 0.01) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
        self.lr = lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        gen = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(64, 4, generator=gen), torch.randn(64, 1, generator=gen)), batch_size=8)


CALLBACK_CLASSES = [getattr(lightning_overflow, n) for n in lightning_overflow.__all__
                    if isinstance(getattr(lightning_overflow, n), type) and issubclass(getattr(lightning_overflow, n), pl.Callback)]


@pytest.mark.parametrize("cls", CALLBACK_CLASSES, ids=lambda c: c.__name__)
def test_every_callback_is_a_callback_of_both_namespaces(cls: type) -> None:
    assert issubclass(cls, pl.Callback) and issubclass(cls, L.Callback)


def test_unified_trainer_runs_the_suite() -> None:
    detector = NonFiniteDetector()
    trainer = L.Trainer(max_steps=6, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[GradNormMonitor(), detector, FaultInjector(Fault(2, "nan_loss"))])
    model = UnifiedRegressor()
    trainer.fit(model)
    assert detector.skipped_steps == 1 and all(torch.isfinite(p).all() for p in model.parameters())


CONFIG = """
trainer:
  max_steps: 4
  accelerator: cpu
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  callbacks:
    - class_path: lightning_overflow.NonFiniteDetector
      init_args:
        action: raise
        max_consecutive_skips: 5
    - class_path: lightning_overflow.GradNormMonitor
      init_args:
        norm_type: inf
        per_parameter: true
    - class_path: lightning_overflow.AutoClip
      init_args:
        mode: zscore
        z_threshold: 3.0
    - class_path: lightning_overflow.LRBackoff
      init_args:
        factor: 0.25
        triggers: [nonfinite_burst, loss_spike]
    - class_path: lightning_overflow.Rollback
      init_args:
        every_n_steps: 2
"""


@pytest.mark.parametrize("namespace", ["pytorch_lightning", "lightning.pytorch"])
def test_lightning_cli_configures_the_callbacks_from_yaml(namespace: str, tmp_path: Path) -> None:
    if namespace == "pytorch_lightning":
        from pytorch_lightning.cli import LightningCLI

        model_class: type = TinyRegressor
    else:
        from lightning.pytorch.cli import LightningCLI

        model_class = UnifiedRegressor
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG)
    cli = LightningCLI(model_class, run=False, args=["--config", str(config)], save_config_callback=None)
    ours = [cb for cb in cli.trainer.callbacks if type(cb).__module__.startswith("lightning_overflow")]
    assert [type(cb).__name__ for cb in ours] == ["NonFiniteDetector", "GradNormMonitor", "AutoClip", "LRBackoff", "Rollback"]
    assert ours[0].action == "raise" and ours[0].max_consecutive_skips == 5
    assert ours[1].norm_type == float("inf") and ours[1].per_parameter
    assert ours[2].mode == "zscore" and ours[2].z_threshold == 3.0
    assert ours[3].factor == 0.25 and tuple(ours[3].triggers) == ("nonfinite_burst", "loss_spike")
    assert ours[4].every_n_steps == 2
    cli.trainer.fit(cli.model)
    assert cli.trainer.global_step == 4


def test_lightning_cli_reports_a_bad_argument(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.replace("action: raise", "action: explode"))
    with pytest.raises(SystemExit):
        LightningCLI(UnifiedRegressor, run=False, args=["--config", str(config)], save_config_callback=None)
    error = capsys.readouterr().err
    assert "action" in error and "explode" in error


def test_the_cli_config_of_the_suite_builds_what_default_callbacks_builds(tmp_path: Path) -> None:
    """``examples/default_callbacks.yaml`` (a function cannot be a ``class_path``): the same callbacks, settings and
    decisions as ``default_callbacks()``, a NaN loss skipped and NaN weights rolled back at the same steps."""
    from lightning.pytorch.cli import LightningCLI

    from lightning_overflow import default_callbacks, read_journal

    config = Path(__file__).parents[1] / "examples" / "default_callbacks.yaml"
    faults = [Fault(3, "nan_loss"), Fault(6, "nan_weight")]
    runs = {}
    for how in ("cli", "function"):
        L.seed_everything(0, verbose=False)
        root = tmp_path / how
        args = ["--config", str(config), f"--trainer.default_root_dir={root}", "--trainer.max_steps=12",
                "--trainer.logger=false", "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false"]
        cli = LightningCLI(UnifiedRegressor, run=False, args=args, save_config_callback=None)
        ours = [cb for cb in cli.trainer.callbacks if type(cb).__module__.startswith("lightning_overflow")]
        if how == "function":
            cli.trainer.callbacks = [cb for cb in cli.trainer.callbacks if cb not in ours] + default_callbacks()
            ours = cli.trainer.callbacks[-6:]
        cli.trainer.callbacks.append(FaultInjector(*faults))
        cli.trainer.fit(cli.model)
        runs[how] = ([_settings(cb) for cb in ours], [p.detach().clone() for p in cli.model.parameters()],
                     [(e["step"], e["kind"]) for e in read_journal(root)])  # fmt: skip
    assert runs["cli"][0] == runs["function"][0]
    assert all(torch.equal(a, b) for a, b in zip(runs["cli"][1], runs["function"][1]))
    assert runs["cli"][2] == runs["function"][2] and ("rollback" in [k for _, k in runs["cli"][2]])


def _settings(callback: Any) -> tuple[str, dict[str, Any]]:
    """A callback's class and every constructor argument it keeps, as it keeps it."""
    names = [n for n in inspect.signature(type(callback).__init__).parameters if n != "self"]
    return type(callback).__name__, {n: getattr(callback, n) for n in names if hasattr(callback, n)}
