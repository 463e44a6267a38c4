"""GPU proof: the suite on a real CUDA device, in one script (under 10 minutes on one GPU).

``python benchmarks/gpu_proof.py [--params 100e6] [--steps 50]`` checks and measures:

1. ``default_callbacks()`` for ``--steps`` steps with ``torch.cuda.set_sync_debug_mode("error")``: any
   device-to-host synchronisation raises, except the suite's documented one read per checked step
   (``distributed.read_packed``), which runs with the debug mode lifted and is counted. A healthy run must
   make exactly one such read per optimizer step, plus one per snapshot verification.
2. Real ``16-mixed`` (GradScaler): the scaler's calibration overflows at the start are left to the scaler
   (no ``nonfinite`` event, no backoff), and the run ends finite.
3. Per-step time of the suite against bare training on a GPT-like model of about ``--params`` parameters
   (interleaved rounds, medians, ratio).
4. Rollback's pinned host snapshot: take and restore times, and bytes held.

Prints one line per check (PASS/FAIL with the figures) and exits 1 if any check fails. Needs CUDA; on a machine
without it the script says so and exits 2.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_overflow.distributed as distributed
from lightning_overflow import default_callbacks, read_journal
from lightning_overflow.snapshot_store import SnapshotRing
from lightning_overflow.training_state import live_state, restore_


class GPT(pl.LightningModule):
    """A GPT-like stack of ``nn.TransformerEncoderLayer`` with a causal mask buffer holding ``-inf``."""

    def __init__(self, width: int, depth: int, vocab: int = 256, context: int = 128, batch: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, max(width // 64, 1), 4 * width, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, depth)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("mask", torch.triu(torch.full((context, context), float("-inf")), 1))
        self.context, self.batch, self.vocab = context, batch, vocab

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        logits = self.head(self.blocks(self.embed(tokens[:, :-1]), mask=self.mask, is_causal=True))
        return nn.functional.cross_entropy(logits.reshape(-1, self.vocab), tokens[:, 1:].reshape(-1))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=3e-4)

    def train_dataloader(self) -> DataLoader:
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, self.vocab, (self.batch * 64, self.context + 1), generator=gen)
        return DataLoader(TensorDataset(tokens), batch_size=self.batch, shuffle=False)


def gpt_of(params: float) -> GPT:
    width = 768 if params >= 50e6 else 512
    depth = max(1, round(params / (12 * width * width)))
    return GPT(width, depth)


def trainer(callbacks: list[Any], steps: int, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(accelerator="gpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, **kwargs)


class StepTimer(pl.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, *_: Any) -> None:
        torch.cuda.synchronize()
        self._start = time.perf_counter()

    def on_train_batch_end(self, *_: Any) -> None:
        torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._start)


def check_sync_free(args: argparse.Namespace, root: str) -> bool:
    reads = {"n": 0}
    original = distributed.read_packed

    def counted(packed: torch.Tensor, n_summed: int, world_size: int) -> list[float]:
        reads["n"] += 1
        torch.cuda.set_sync_debug_mode(0)
        try:
            return original(packed, n_summed, world_size)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    # Every read goes through distributed.read_packed; health holds its own name for it.
    distributed.read_packed = counted  # type: ignore[assignment]
    import lightning_overflow.health as health

    health.read_packed = counted  # type: ignore[assignment]
    suite = default_callbacks(snapshot_every_n_steps=args.steps + 1)  # the start snapshot only: one verification
    error = ""
    torch.cuda.set_sync_debug_mode("error")
    try:
        trainer(suite, args.steps, default_root_dir=root).fit(gpt_of(20e6))
    except RuntimeError as err:
        error = str(err).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode(0)
        distributed.read_packed = original  # type: ignore[assignment]
        health.read_packed = original  # type: ignore[assignment]
    expected = args.steps + 1
    ok = not error and reads["n"] <= expected
    print(f"{'PASS' if ok else 'FAIL'}: sync-free: {reads['n']} documented reads in {args.steps} steps "
          f"(at most {expected}){'; ' + error if error else ''}")
    return ok


def check_fp16(args: argparse.Namespace, root: str) -> bool:
    model = gpt_of(20e6)
    trainer(default_callbacks(), args.steps, default_root_dir=root, precision="16-mixed").fit(model)
    events = list(read_journal(f"{root}/overflow_events.jsonl")) if _exists(f"{root}/overflow_events.jsonl") else []
    escalated = [e for e in events if e["kind"] in ("nonfinite", "backoff", "rollback", "abort")]
    finite = all(torch.isfinite(p).all() for p in model.parameters())
    ok = finite and not escalated
    print(f"{'PASS' if ok else 'FAIL'}: 16-mixed: finite={finite}, escalations={[e['kind'] for e in escalated]}")
    return ok


def measure_overhead(args: argparse.Namespace, root: str) -> bool:
    results: dict[str, list[float]] = {"bare": [], "suite": []}
    for _ in range(args.rounds):
        for name in results:
            timer = StepTimer()
            callbacks = [timer] if name == "bare" else [*default_callbacks(), timer]
            trainer(callbacks, 12, default_root_dir=root).fit(gpt_of(args.params))
            results[name].append(statistics.median(timer.times[2:]))
    bare, suite = (statistics.median(v) for v in results.values())
    ok = suite / bare <= 1.02
    print(f"{'PASS' if ok else 'FAIL'}: overhead on a {args.params / 1e6:.0f}M GPT: bare {bare * 1e3:.1f} ms, "
          f"suite {suite * 1e3:.1f} ms, {suite / bare:.3f}x (target <= 1.02x)")
    return ok


def measure_snapshot(args: argparse.Namespace, root: str) -> bool:
    """Take (into pinned host buffers, reused) and restore (in place) the whole training state, as Rollback does."""
    model = gpt_of(args.params)
    fitted = trainer([], 2, default_root_dir=root)
    fitted.fit(model)
    ring = SnapshotRing(keep=2)
    takes, restores = [], []
    for step in range(6):
        torch.cuda.synchronize()
        start = time.perf_counter()
        snapshot = ring.take(step, live_state(fitted), {})
        torch.cuda.synchronize()
        takes.append(time.perf_counter() - start)
        start = time.perf_counter()
        restore_(fitted, snapshot.state)
        torch.cuda.synchronize()
        restores.append(time.perf_counter() - start)
    held = sum(t.numel() * t.element_size() for s in ring.snapshots for t in _tensors(s.state))
    pinned = all(t.is_pinned() for s in ring.snapshots for t in _tensors(s.state) if t.device.type == "cpu")
    print(f"INFO: snapshot of a {args.params / 1e6:.0f}M GPT with AdamW: take {statistics.median(takes[2:]) * 1e3:.1f} "
          f"ms, restore {statistics.median(restores[2:]) * 1e3:.1f} ms; keep=2 holds {held / 2**20:.0f} MiB of host "
          f"memory (pinned: {pinned})")
    return pinned


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []


def _exists(path: str) -> bool:
    import os

    return os.path.exists(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_proof: no CUDA device here; run this on a machine with a GPU", file=sys.stderr)
        return 2
    import tempfile

    checks = []
    for check in (check_sync_free, check_fp16, measure_overhead, measure_snapshot):
        with tempfile.TemporaryDirectory() as root:
            checks.append(check(args, root))
    return 0 if all(checks) else 1


if __name__ == "__main__":
    sys.exit(main())
