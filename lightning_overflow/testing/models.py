"""Tiny Lightning models with their own data, for testing recovery paths in seconds on a CPU."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

__all__ = ["TinyGAN", "TinyRegressor", "regression_data"]

SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


def regression_data(n_samples: int = 64, in_features: int = 4, seed: int = 0, noise: float = 0.1) -> TensorDataset:
    """A fixed linear regression problem: ``y = x @ w + noise``, the same for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n_samples, in_features, generator=gen)
    w = torch.randn(in_features, 1, generator=gen)
    y = x @ w + noise * torch.randn(n_samples, 1, generator=gen)
    return TensorDataset(x, y)


class TinyRegressor(pl.LightningModule):
    """A two-layer MLP (193 parameters by default) that fits :func:`regression_data`.

    Args:
        hidden: width of the hidden layer.
        lr: learning rate.
        optimizer: ``"adam"``, ``"adamw"`` or ``"sgd"`` (with momentum 0.9 and weight decay 1e-4).
        scheduler: ``optimizer -> scheduler or Lightning scheduler dict``, or ``None``.
        batch_size, n_samples, seed: the data.
        dropout: dropout probability after the hidden layer (0 disables it).
        batch_norm: add a BatchNorm1d after the first layer.
    """

    def __init__(
        self,
        hidden: int = 32,
        lr: float = 0.01,
        optimizer: str = "adam",
        scheduler: SchedulerFactory | None = None,
        batch_size: int = 8,
        n_samples: int = 64,
        seed: int = 0,
        in_features: int = 4,
        dropout: float = 0.0,
        batch_norm: bool = False,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(in_features, hidden)]
        if batch_norm:
            layers.append(nn.BatchNorm1d(hidden))
        layers.append(nn.Tanh())
        if dropout:
            layers.append(nn.Dropout(dropout))
        layers.append(nn.Linear(hidden, 1))
        self.net = nn.Sequential(*layers)
        if optimizer not in ("adam", "adamw", "sgd"):
            raise ValueError(f"'optimizer' must be one of 'adam', 'adamw', 'sgd' (got {optimizer!r})")
        self.lr = lr
        self.optimizer_name = optimizer
        self.scheduler_factory = scheduler
        self.batch_size = batch_size
        self.data = regression_data(n_samples, in_features, seed)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "sgd":
            optimizer: torch.optim.Optimizer = torch.optim.SGD(
                self.parameters(), lr=self.lr, momentum=0.9, weight_decay=1e-4
            )
        elif self.optimizer_name == "adamw":
            optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        else:
            optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer)
        if not isinstance(scheduler, dict):
            scheduler = {"scheduler": scheduler, "interval": "step"}
        return {"optimizer": optimizer, "lr_scheduler": scheduler}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size * 2)


class TinyGAN(pl.LightningModule):
    """A small GAN under manual optimization: two optimizers, two steps per batch (``global_step`` grows by 2).

    Args:
        lr_g, lr_d: the generator's and the discriminator's learning rates.
        latent: size of the noise vector; the data are 2-D points.
    """

    def __init__(self, lr_g: float = 1e-3, lr_d: float = 1e-3, latent: int = 4, n_samples: int = 64) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.latent = latent
        self.generator = nn.Sequential(nn.Linear(latent, 16), nn.ReLU(), nn.Linear(16, 2))
        self.discriminator = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 1))
        self.lr_g, self.lr_d = lr_g, lr_d
        gen = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(n_samples, 2, generator=gen) * 0.5 + 1.0)
        self.noise_gen = torch.Generator().manual_seed(1)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        (real,) = batch
        opt_d, opt_g = self.optimizers()  # type: ignore[misc]
        z = torch.randn(real.shape[0], self.latent, generator=self.noise_gen)
        bce = nn.functional.binary_cross_entropy_with_logits
        fake = self.generator(z)
        d_loss = bce(self.discriminator(real), torch.ones(real.shape[0], 1)) + bce(
            self.discriminator(fake.detach()), torch.zeros(real.shape[0], 1)
        )
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        g_loss = bce(self.discriminator(fake), torch.ones(real.shape[0], 1))
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        return g_loss.detach()

    def configure_optimizers(self) -> Any:
        return (
            torch.optim.Adam(self.discriminator.parameters(), lr=self.lr_d),
            torch.optim.Adam(self.generator.parameters(), lr=self.lr_g),
        )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=16)
