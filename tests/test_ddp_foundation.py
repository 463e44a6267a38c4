"""DDP with 2 CPU processes: per-rank faults lead to identical decisions on both ranks, and nothing hangs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from conftest import BatchNormGAN
from ddp_utils import run_ddp

from lightning_overflow import GradNormMonitor, NonFiniteDetector, Rollback, default_callbacks
from lightning_overflow.testing import Fault, FaultInjector, TinyRegressor

pytestmark = [pytest.mark.ddp, pytest.mark.timeout(180)]


def test_nan_loss_on_rank_1_only_is_skipped_on_both_ranks(tmp_path: Path) -> None:
    detector = NonFiniteDetector()
    reports = run_ddp(TinyRegressor(), [GradNormMonitor(), detector, FaultInjector(Fault(3, "nan_loss", rank=1))], tmp_path)
    assert [r["error"] for r in reports] == [None, None]
    assert reports[0]["digest"] == reports[1]["digest"]
    assert all(r["finite"] and r["global_step"] == 6 for r in reports)
    assert reports[0]["states"] == reports[1]["states"]
    assert '"skipped_steps": 1' in reports[0]["states"][1]
    events = (tmp_path / "overflow_events.jsonl").read_text().splitlines()
    assert len(events) == 2 and '"rank": 1' in events[0] and '"ranks": [1]' in events[0]


def test_action_raise_stops_every_rank_with_the_same_error(tmp_path: Path) -> None:
    faults = FaultInjector(Fault(2, "inf_loss", rank=1))
    reports = run_ddp(TinyRegressor(), [NonFiniteDetector(action="raise"), faults], tmp_path)
    for report in reports:
        assert report["error"]["type"] == "NonFiniteError"
        assert report["error"]["attrs"]["step"] == 2 and report["error"]["attrs"]["ranks"] == [1]
        assert "the loss was inf/NaN at step 2 (epoch 0) on rank(s) 1" in report["error"]["message"]


@pytest.mark.parametrize("rank", [0, 1])
def test_nonfinite_weight_on_one_rank_is_found_and_named_by_every_rank(tmp_path: Path, rank: int) -> None:
    """The names of the tensors were the rank's own: the rank whose weights were finite raised an error naming
    none (``parameters=[]``), and rank 0 writes the journal and the checkpoints. Every rank names them alike."""
    faults = FaultInjector(Fault(4, "nan_weight", rank=rank))
    reports = run_ddp(TinyRegressor(), [NonFiniteDetector(check_weights_every_n_steps=2), faults], tmp_path)
    for report in reports:
        assert report["error"]["type"] == "NonFiniteError"
        attrs = report["error"]["attrs"]
        assert attrs["kind"] == "weight" and attrs["ranks"] == [rank] and attrs["parameters"] == ["net.0.weight"]
        assert f"contained inf/NaN in net.0.weight at step 4 (epoch 1) on rank(s) {rank}." in report["error"]["message"]


def test_a_rollback_for_nonfinite_weights_on_one_rank_leaves_every_ranks_callbacks_alike(tmp_path: Path) -> None:
    """LRBackoff keeps the reason of each backoff in its state: it named the parameter on rank 1 only."""
    from lightning_overflow import LRBackoff

    faults = FaultInjector(Fault(3, "nan_weight", rank=1))
    callbacks = [NonFiniteDetector(), LRBackoff(), Rollback(every_n_steps=2), faults]
    reports = run_ddp(TinyRegressor(), callbacks, tmp_path)
    assert [r["error"] for r in reports] == [None, None] and reports[0]["digest"] == reports[1]["digest"]
    assert reports[0]["states"] == reports[1]["states"]
    assert "inf/NaN in net.0.weight at step 3" in next(s for s in reports[0]["states"] if s.startswith("LRBackoff"))


class PerturbOnRank(pl.Callback):
    """Adds 1e-3 to one weight on one rank at the start of one batch: the replicas silently disagree."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            with torch.no_grad():
                pl_module.net[0].weight.view(-1)[3] += 1e-3


def test_a_replica_whose_weights_drift_is_named_and_rolled_back(tmp_path: Path) -> None:
    detector = NonFiniteDetector(check_replicas_every_n_steps=1)
    rollback = Rollback(every_n_steps=2)
    reports = run_ddp(TinyRegressor(), [detector, rollback, PerturbOnRank(5, rank=1)], tmp_path, max_steps=8)
    assert [r["error"] for r in reports] == [None, None]
    assert reports[0]["digest"] == reports[1]["digest"], "every rank back to the same weights"
    events = [json.loads(line) for line in (tmp_path / "overflow_events.jsonl").read_text().splitlines()]
    (mismatch,) = [e for e in events if e["kind"] == "replica_mismatch"]
    assert mismatch["step"] == 5 and mismatch["details"]["ranks"] == [1]
    assert mismatch["details"]["parameters"] == ["net.0.weight"]
    (rolled,) = [e for e in events if e["kind"] == "rollback"]
    assert rolled["details"]["reason"] == "replica_mismatch" and rolled["details"]["snapshot_step"] == 4


def test_a_snapshot_is_refused_when_the_replicas_disagree_and_every_rank_returns_to_the_last_one(
    tmp_path: Path,
) -> None:
    # No parity check of NonFiniteDetector's: Rollback's own comparison at the snapshot of step 6 finds the drift.
    rollback = Rollback(every_n_steps=3)
    reports = run_ddp(TinyRegressor(), [NonFiniteDetector(), rollback, PerturbOnRank(5, rank=1)], tmp_path,
                      max_steps=8)  # fmt: skip
    assert [r["error"] for r in reports] == [None, None]
    assert reports[0]["digest"] == reports[1]["digest"], "every rank back to the same weights"
    events = [json.loads(line) for line in (tmp_path / "overflow_events.jsonl").read_text().splitlines()]
    (refused,) = [e for e in events if e["kind"] == "snapshot_refused"]
    assert refused["step"] == 6 and refused["rank"] == 1 and refused["details"]["ranks"] == [1]
    assert refused["message"] == (
        "Rollback: the weights of rank(s) 1 differ from the other replicas' at step 6; this state is no rollback target"
    )
    (rolled,) = [e for e in events if e["kind"] == "rollback"]
    assert rolled["details"]["reason"] == "replica_mismatch" and rolled["details"]["snapshot_step"] == 3
    for report in reports:  # the same decision on both ranks
        history = json.loads(report["states"][1].split(":", 1)[1])["history"]
        assert [(h["step"], h["reason"], h["trigger_step"], h["snapshot_step"]) for h in history] == [
            (6, "replica_mismatch", 6, 3)
        ]


def test_a_gan_whose_batch_holds_nan_on_one_rank_skips_the_discriminators_step_on_both_and_nothing_else(
    tmp_path: Path,
) -> None:
    """Manual optimization under DDP: one rank's discriminator writes NaN into its BatchNorm statistics before its step
    is skipped; both ranks skip that step, that rank puts its statistics back, and nothing else happens (no backoff,
    no rollback): every weight and statistic finite at the end on both ranks."""
    reports = run_ddp(BatchNormGAN(), default_callbacks(), tmp_path, max_steps=24,
                      strategy="ddp_fork_find_unused_parameters_true")  # fmt: skip
    assert [r["error"] for r in reports] == [None, None]
    assert all(r["finite"] and r["global_step"] == 24 for r in reports)
    assert reports[0]["states"] == reports[1]["states"]
    events = [json.loads(line) for line in (tmp_path / "overflow_events.jsonl").read_text().splitlines()]
    kinds = [(e["step"], e["kind"]) for e in events]
    skipped = [step for step, kind in kinds if kind == "skip"]
    # One a epoch (2 batches of 2 optimizer steps on each rank), each the discriminator's (the first of its batch).
    assert len(skipped) == 6 and all(step % 2 == 0 for step in skipped)
    assert {kind for _, kind in kinds} == {"data_fault", "skip"}  # the batch holds the NaN, on one rank
    faults = [e for e in events if e["kind"] == "data_fault"]
    assert all(len(e["details"]["ranks"]) == 1 and e["details"]["data_ranks"] == e["details"]["ranks"] for e in faults)
