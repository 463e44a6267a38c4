"""``strategy="ddp"`` for real: Lightning relaunches a script per rank; every rank acts alike and nothing hangs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent / "scripts" / "ddp_subprocess_fit.py"

pytestmark = [pytest.mark.ddp, pytest.mark.slow, pytest.mark.timeout(300)]


def run(tmp_path: Path, scenario: str) -> list[dict]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), scenario], capture_output=True, text=True,
                          timeout=240, env=env, cwd=tmp_path, check=False)
    files = [tmp_path / f"rank{r}.json" for r in range(2)]
    assert all(f.exists() for f in files), done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(f.read_text()) for f in files]


def test_a_nan_weight_on_rank_1_rolls_back_both_ranks_identically(tmp_path: Path) -> None:
    reports = run(tmp_path, "rollback")
    assert [r["error"] for r in reports] == [None, None]
    assert reports[0]["digest"] == reports[1]["digest"]
    assert all(r["finite"] and r["global_step"] == 20 and r["rollbacks"] == 1 for r in reports)
    assert reports[0]["history"] == reports[1]["history"]


def test_an_exhausted_budget_stops_every_rank_and_leaves_finite_weights(tmp_path: Path) -> None:
    reports = run(tmp_path, "exhausted")
    for report in reports:
        assert report["error"].startswith("DivergenceError"), report["error"]
        assert report["finite"], "Rollback restores the last verified snapshot before the run exits"
    assert reports[0]["digest"] == reports[1]["digest"]
    checkpoint = torch.load(tmp_path / "on_exception" / "on_exception.ckpt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in checkpoint["state_dict"].values() if t.is_floating_point())
