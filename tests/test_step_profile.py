"""The step profile runs and prints where the suite's time goes (benchmarks/step_profile.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import step_profile


def test_the_profile_names_every_hook_the_norms_and_the_read(capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    try:
        assert step_profile.main(["--steps", "3"]) == 0
    finally:
        torch.set_num_threads(threads)  # the script sets the process-wide thread count
    from lightning_overflow.callbacks._base import SuiteCallback
    from lightning_overflow.health import StepHealth

    # The clocks are taken off again: the package's classes are the whole process's.
    assert SuiteCallback.__dict__["on_before_optimizer_step"].__qualname__ == "SuiteCallback.on_before_optimizer_step"
    assert StepHealth.__dict__["_read"].__qualname__ == "StepHealth._read"
    out = capsys.readouterr().out
    assert "time inside the suite's hooks:" in out
    for row in ("hook  on_before_optimizer_step", "hook  on_train_batch_end", "board the record: gradient norms",
                "board the step's one host read", "stage AutoClip._judge", "norms, first", "sum, second"):
        assert row in out


def test_the_profile_refuses_a_step_count_below_one(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        step_profile.main(["--steps", "0"])
    assert "--steps must be at least 1 (got 0)" in capsys.readouterr().err
