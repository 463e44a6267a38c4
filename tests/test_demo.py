"""The main job: ``python -m lightning_overflow demo`` diverges bare and completes protected."""

from __future__ import annotations

import io
import math
import subprocess
import sys
from pathlib import Path

import pytest
from pytorch_lightning.callbacks import TQDMProgressBar
from pytorch_lightning.loggers import CSVLogger

from lightning_overflow import read_journal
from lightning_overflow.cli import main
from lightning_overflow.demo.run import _trainer, run_demo

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # two real training runs: slow on a shared machine


def test_demo_prints_the_comparison_and_writes_the_dashboard(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The overflow happens at the edge of the FP32 range, so the step it strikes depends on the CPU's rounding (124
    on the CI machine, 150 on an AVX-512 Xeon): the unprotected run ends NaN, stopped 20 steps later or still running
    at step 160; the protected run finishes, whatever the CPU."""
    unprotected, protected = run_demo(steps=160, out=tmp_path)
    printed = capsys.readouterr().out.splitlines()

    assert math.isnan(unprotected.train_loss) and math.isnan(unprotected.val_loss) and not unprotected.stopped_by
    # GradNormMonitor only: nothing acts; the journal says only that the fit ended with NaN weights.
    assert unprotected.events == {"nonfinite_at_end": 1} and 20 <= unprotected.steps <= 160
    assert protected.steps == 160 and math.isfinite(protected.val_loss) and not protected.stopped_by
    assert protected.events["skip"] == protected.events["nonfinite"] >= 1
    assert protected.events["rollback"] >= 1 and protected.events["backoff"] >= 1

    stopped = unprotected.steps < 160
    table = {
        "": ["unprotected", "protected"],
        "how it ended": ["NaN, stopped" if stopped else "NaN at the end", "finished"],
        "steps completed": [str(unprotected.steps), "160"],
        "final train loss (last 20)": ["nan", f"{protected.train_loss:.3f}"],  # NaN too if it skipped in the last 20
        "final validation loss": ["nan", f"{protected.val_loss:.3f}"],
        "skipped steps": ["0", str(protected.events["skip"])],
        "loss / grad spikes": ["0", str(protected.events.get("spike", 0))],
        "LR backoffs": ["0", str(protected.events["backoff"])],
        "rollbacks": ["0", str(protected.events["rollback"])],
        "wall time": [f"{unprotected.wall_s:.0f} s", f"{protected.wall_s:.0f} s"],
    }
    intro = ("lightning_overflow demo: a byte-level transformer on the standard library's source, Adam lr=0.02, "
             f"160 steps, run bare (GradNormMonitor only) and with default_callbacks(); output in {tmp_path.resolve()}")
    title = "byte transformer, Adam lr=0.02: unprotected vs default_callbacks()"
    redraw = (f"redraw:    python -m lightning_overflow report {tmp_path / 'unprotected'} {tmp_path / 'protected'} "
              f"--title '{title}' --out {tmp_path / 'dashboard.png'}")
    # Captured, stdout is no terminal: no progress bar between the lines.
    assert printed[:3] == [intro, "A run whose loss stays NaN for 20 steps is stopped there: its weights are lost.", ""]
    rows, tail = printed[3 : 3 + len(table)], printed[3 + len(table) :]
    assert [row.split() for row in rows] == [(name + " " + " ".join(cells)).split() for name, cells in table.items()]
    assert len({len(row) for row in rows}) == 1  # aligned: the values right-justified in their columns
    assert tail == ["", f"dashboard: {tmp_path / 'dashboard.png'}", redraw,  # no "... stopped: <error>" line
                    f"journal:   python -m lightning_overflow journal {tmp_path / 'protected'}"]
    assert (tmp_path / "dashboard.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "protected" / "overflow_events.jsonl").exists()
    assert [e["kind"] for e in read_journal(tmp_path / "unprotected" / "overflow_events.jsonl")] == ["nonfinite_at_end"]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("stdout", "bar"), [(io.StringIO(), False), (_Terminal(), True)])
def test_the_progress_bar_shows_in_a_terminal_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   stdout: io.StringIO, bar: bool) -> None:
    """A CI log or a batch job's output file gets the demo's lines, not a redrawn bar (142 KB of it in 500 steps)."""
    monkeypatch.setattr(sys, "stdout", stdout)
    trainer = _trainer(5, "cpu", CSVLogger(str(tmp_path)), [])
    assert isinstance(trainer.progress_bar_callback, TQDMProgressBar) is bar
    assert (trainer.progress_bar_callback is None) is not bar


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
