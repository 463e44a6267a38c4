"""A small byte-level transformer whose attention uses a naive softmax: ``exp(s) / sum(exp(s))``.

That is the numerically fragile form many hand-written attention and contrastive losses use (no max subtracted):
it is exact while the scores stay moderate and overflows to ``inf / inf = NaN`` once a too-high learning rate lets
them grow past about 88.
"""

from __future__ import annotations

import math
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

__all__ = ["ByteTransformer"]


class NaiveSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        weights = scores.exp() * causal  # naive: no max subtracted
        weights = weights / weights.sum(-1, keepdim=True)
        return self.out((weights @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = NaiveSelfAttention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ByteTransformer(pl.LightningModule):
    """Next-byte language model on the standard library's source.

    Args:
        train_data, val_data: :class:`~lightning_overflow.demo.data.ByteWindows`.
        lr: Adam's learning rate (no warm-up).
        dim, heads, layers, context: model size.
        batch_size: windows per batch.
    """

    def __init__(
        self,
        train_data: Dataset[Any],
        val_data: Dataset[Any],
        lr: float = 3e-3,
        dim: int = 64,
        heads: int = 4,
        layers: int = 2,
        context: int = 64,
        batch_size: int = 32,
    ) -> None:
        super().__init__()
        self.train_data, self.val_data = train_data, val_data
        self.lr, self.batch_size = lr, batch_size
        self.embed = nn.Embedding(256, dim)
        self.position = nn.Parameter(torch.randn(context, dim) * 0.02)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 256)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        return self.head(self.norm(self.blocks(x)))

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        tokens, targets = batch
        return nn.functional.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        gen = torch.Generator().manual_seed(0)
        return DataLoader(self.train_data, batch_size=self.batch_size, shuffle=True, generator=gen)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_data, batch_size=128)
