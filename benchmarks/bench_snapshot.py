"""Time to take and to restore a rollback snapshot, relative to one training step.

A snapshot is what ``Rollback`` does every ``every_n_steps`` steps: check the model and AdamW state for inf/NaN (a sum
of every tensor, step counters left out, one host read; the max-abs pass only for a suspect) and copy them into the
ring's host buffers, allocated with the first snapshot. A
restore copies them back in place. Both are compared with one full training step (forward, backward, AdamW update)
of the same model; medians over repeated runs, one process. A disk snapshot (temporary file, fsync, rename) is timed
once.

Then the host memory of ``keep`` snapshots per rank under DDP, by world size: each rank keeps the tensors it owns
(Rollback's split, balanced by bytes; step counters kept on every rank), so the bytes per rank fall as ``1/world``
and a node of 8 ranks holds about one copy per snapshot whatever the world size. The split is computed by the
function Rollback uses, and checked against a real partial snapshot for 2 ranks.

    python benchmarks/bench_snapshot.py            # a 6-layer transformer, about 20M parameters
    python benchmarks/bench_snapshot.py --quick    # about 1M parameters, fewer repeats (seconds)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from lightning_overflow.numerics.snapshots import (
    held_nbytes,
    named_state_tensors,
    restore_optimizer_,
    restore_state_,
    state_nbytes,
    take_snapshot,
)
from lightning_overflow.snapshot_store import save_snapshot
from lightning_overflow.training_state import check_state, snapshot_owners


def build(quick: bool) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    width, layers, tokens = (128, 4, 64) if quick else (512, 6, 256)
    layer = nn.TransformerEncoderLayer(width, nhead=8, dim_feedforward=4 * width, batch_first=True, dropout=0.0)
    model = nn.Sequential(nn.Embedding(1000, width), nn.TransformerEncoder(layer, layers), nn.Linear(width, 1000))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 1000, (8, tokens), generator=gen)
    y = torch.randint(0, 1000, (8, tokens), generator=gen)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()

    return model, optimizer, step


def interleaved_medians(fns: list[Callable[[], object]], repeats: int) -> list[float]:
    """Median seconds of each function, run in turn within every repeat, so that load on a shared machine hits
    them alike."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model and few repeats")
    args = parser.parse_args()
    torch.set_flush_denormal(True)  # denormals slow CPU steps several-fold and would flatter the ratios
    torch.manual_seed(0)
    repeats = 5 if args.quick else 11
    model, optimizer, step = build(args.quick)
    for _ in range(2):
        step()  # warm up; creates the AdamW moments

    def live() -> dict[str, object]:
        return {"model": model.state_dict(), "optimizers": [optimizer.state_dict()]}

    first_start = time.perf_counter()
    snapshot = take_snapshot(live())
    first = time.perf_counter() - first_start

    def check(state: dict[str, object]) -> None:
        """Rollback's verification before a state becomes a rollback target."""
        if not check_state(state["model"], state["optimizers"], None, "cpu").finite:  # type: ignore[arg-type]
            raise FloatingPointError("the benchmark state is not finite")

    def take() -> None:
        nonlocal snapshot
        state = live()
        check(state)
        snapshot = take_snapshot(state, reuse=snapshot)

    def check_only() -> None:
        check(live())

    def copy_only() -> None:
        nonlocal snapshot
        snapshot = take_snapshot(live(), reuse=snapshot)

    def restore() -> None:
        restore_state_(model.state_dict(), snapshot["model"])
        restore_optimizer_(optimizer, snapshot["optimizers"][0])

    t_step, t_take, t_copy, t_check, t_restore = interleaved_medians(
        [step, take, copy_only, check_only, restore], repeats
    )
    with tempfile.TemporaryDirectory() as tmp:
        disk_start = time.perf_counter()
        save_snapshot({"state": snapshot}, Path(tmp) / "rollback-step=0.pt", step=0)
        t_disk = time.perf_counter() - disk_start

    params = sum(p.numel() for p in model.parameters())
    mib = state_nbytes(live()) / 2**20
    print(f"model: {params / 1e6:.2f}M parameters; snapshot (weights + AdamW state): {mib:.1f} MiB of host memory")
    print(f"threads: {torch.get_num_threads()}; medians of {repeats} interleaved runs")
    print(f"{'':30}{'ms':>10}{'x step':>10}")
    rows = [
        ("training step", t_step),
        ("take snapshot (copy + check)", t_take),
        ("  of which the copy", t_copy),
        ("  of which the check", t_check),
        ("restore snapshot", t_restore),
        ("first copy (allocates)", first),
        ("disk snapshot (once)", t_disk),
    ]
    for name, seconds in rows:
        print(f"{name:30}{seconds * 1e3:10.2f}{seconds / t_step:10.3f}")
    print_bytes_per_rank(live(), keep=2)


def bytes_per_rank(state: dict[str, object], world_size: int) -> list[int]:
    """Host bytes of one snapshot on each rank of a DDP fit of ``world_size`` ranks (Rollback's split)."""
    owners = snapshot_owners(state, world_size, torch.device("cpu"))
    named = named_state_tensors(state)
    kept_everywhere = sum(t.numel() * t.element_size() for path, t in named if path not in owners)
    sizes = {path: t.numel() * t.element_size() for path, t in named}
    return [kept_everywhere + sum(sizes[p] for p, o in owners.items() if o == r) for r in range(world_size)]


def print_bytes_per_rank(state: dict[str, object], keep: int, ranks_per_node: int = 8) -> None:
    full = state_nbytes(state)
    owners = snapshot_owners(state, 2, torch.device("cpu"))
    held = [owners.get(path, 0) == 0 for path, _ in named_state_tensors(state)]
    measured = held_nbytes(take_snapshot(state, held=held))
    assert measured == bytes_per_rank(state, 2)[0], "the split's bytes differ from a real partial snapshot"
    print(f"\nhost memory of keep={keep} snapshots under DDP (one full copy: {full / 2**20:.1f} MiB)")
    node_label = f"MiB per node ({ranks_per_node} ranks a node)"
    print(f"{'ranks':>6}{'MiB per rank (max)':>20}{'x one copy':>12}{node_label:>32}")
    for world in (1, 2, 4, 8, 16, 64):
        per_rank = [keep * b for b in bytes_per_rank(state, world)]
        node = sum(sorted(per_rank, reverse=True)[:ranks_per_node])  # the node holding the largest parts
        print(f"{world:6d}{max(per_rank) / 2**20:20.2f}{max(per_rank) / (keep * full):12.3f}{node / 2**20:32.1f}")


if __name__ == "__main__":
    main()
