"""The demo's corpus: the Python standard library's own source, which ships with every Python install."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import Dataset

__all__ = ["ByteWindows", "stdlib_corpus"]


def stdlib_corpus(max_bytes: int = 2_000_000) -> bytes:
    """Up to ``max_bytes`` of the standard library's ``.py`` files, in a fixed order (sorted paths)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    corpus = b"".join(chunks)[:max_bytes]
    if len(corpus) < 10_000:
        raise RuntimeError(f"found only {len(corpus)} bytes of Python source under {root}{os.sep}")
    return corpus


class ByteWindows(Dataset[tuple[Tensor, Tensor]]):
    """Next-byte prediction windows: input ``corpus[i:i+n]``, target ``corpus[i+1:i+n+1]``, at a fixed stride."""

    def __init__(self, corpus: bytes, context: int = 64, stride: int = 61) -> None:
        self.data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()
        self.context = context
        self.stride = stride
        self.count = (len(self.data) - context - 1) // stride

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = index * self.stride
        window = self.data[start : start + self.context + 1]
        return window[:-1], window[1:]
