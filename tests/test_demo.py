"""The main job: ``python -m lightning_overflow demo`` diverges bare and completes protected."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_overflow.cli import main
from lightning_overflow.demo.run import run_demo

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # two real training runs: slow on a shared machine


def test_demo_prints_the_comparison_and_writes_the_dashboard(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    unprotected, protected = run_demo(steps=160, out=tmp_path)
    printed = capsys.readouterr().out
    assert "steps completed" in printed and "rollbacks" in printed and f"dashboard: {tmp_path / 'dashboard.png'}" in printed
    ending = next(line for line in printed.splitlines() if line.startswith("how it ended"))
    assert ending.split()[3:] == ["NaN,", "stopped", "finished"]
    assert (f"redraw:    python -m lightning_overflow report {tmp_path / 'unprotected'} {tmp_path / 'protected'} "
            f"--title 'byte transformer, Adam lr=0.02: unprotected vs default_callbacks()' "
            f"--out {tmp_path / 'dashboard.png'}") in printed
    assert unprotected.steps < 160 and math.isnan(unprotected.train_loss) and unprotected.events == {}
    assert protected.steps == 160 and math.isfinite(protected.val_loss) and not protected.stopped_by
    assert protected.events.get("rollback", 0) >= 1 and protected.events.get("backoff", 0) >= 1
    assert (tmp_path / "dashboard.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "protected" / "overflow_events.jsonl").exists()


def test_demo_rejects_bad_steps(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--steps", "many"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err == "lightning-overflow demo: error: argument --steps: must be an int >= 1 (got 'many')\n"
    with pytest.raises(SystemExit):
        main(["demo", "--steps", "0"])
    assert capsys.readouterr().err == "lightning-overflow demo: error: argument --steps: must be an int >= 1 (got 0)\n"


def test_run_demo_checks_its_arguments_before_training() -> None:
    with pytest.raises(ValueError, match=r"'steps' must be >= 1 \(got 0\)"):
        run_demo(steps=0)
    with pytest.raises(TypeError, match=r"'steps' must be an int \(got float\)"):
        run_demo(steps=5.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'lr' must be a finite number > 0 or None \(got -1.0\)"):
        run_demo(lr=-1.0)
    with pytest.raises(ValueError, match=r"'lr' must be a finite number > 0 or None \(got nan\)"):
        run_demo(lr=math.nan)
    with pytest.raises(ValueError, match=r"'seed' must be an int in \[0, 4294967295\] \(got -3\)"):
        run_demo(seed=-3)


def test_module_entry_point_lists_both_commands() -> None:
    out = subprocess.run([sys.executable, "-m", "lightning_overflow", "--help"], capture_output=True, text=True, check=True)
    assert "demo" in out.stdout and "report" in out.stdout
