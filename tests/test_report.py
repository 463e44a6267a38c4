"""The report command: a PNG dashboard from a run's metrics and journal, and clear errors for bad run folders."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import fit
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger

from lightning_overflow import GradNormMonitor, NonFiniteDetector, OverflowWarning
from lightning_overflow.cli import main
from lightning_overflow.report import ReportError, load_run
from lightning_overflow.testing import Fault, FaultInjector, TinyRegressor


def small_run(tmp_path: Path, logger_cls: type = CSVLogger) -> Path:
    logger = logger_cls(str(tmp_path), name="run")
    fit(TinyRegressor(), [GradNormMonitor(), NonFiniteDetector(), FaultInjector(Fault(5, "nan_loss"))], max_steps=20,
        logger=logger, log_every_n_steps=1)
    return Path(logger.log_dir)


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_renders_a_dashboard_png_and_prints_the_events(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = small_run(tmp_path)
    out = tmp_path / "dash.png"
    assert main(["report", str(run_dir), "--out", str(out)]) == 0
    assert png_size(out) == (650, 850)
    printed = capsys.readouterr().out
    assert "1 nonfinite, 1 skip" in printed and "step      5  skip" in printed and f"dashboard: {out}" in printed
    from PIL import Image

    pixels = Image.open(out).convert("L").getextrema()
    assert pixels[0] < 100 and pixels[1] > 200  # not blank


def test_reads_tensorboard_event_files(tmp_path: Path) -> None:
    run = load_run(small_run(tmp_path, TensorBoardLogger))
    assert len(run.metrics["grad_norm/total"]) == 20 and [e["kind"] for e in run.events] == ["nonfinite", "skip"]


def test_two_runs_side_by_side(tmp_path: Path) -> None:
    first, second = small_run(tmp_path / "a"), small_run(tmp_path / "b")
    out = tmp_path / "both.png"
    assert main(["report", str(first), str(second), "--out", str(out)]) == 0
    assert png_size(out) == (1300, 850)


def test_missing_and_empty_directories_are_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert f"report: run directory '{tmp_path / 'nope'}' does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReportError, match="holds no metrics.csv, TensorBoard event file or overflow_events.jsonl"):
        load_run(tmp_path / "empty")


def test_a_run_without_our_metrics_is_named(tmp_path: Path) -> None:
    logger = CSVLogger(str(tmp_path), name="plain")
    fit(TinyRegressor(), [], max_steps=-1, max_epochs=1, logger=logger, log_every_n_steps=1, limit_val_batches=1)
    with pytest.raises(ReportError, match=r"none of lightning_overflow's .* add GradNormMonitor"):
        load_run(logger.log_dir)


def test_a_corrupt_journal_line_is_skipped_with_a_warning(tmp_path: Path) -> None:
    run_dir = small_run(tmp_path)
    journal = run_dir / "overflow_events.jsonl"
    lines = journal.read_text().splitlines()
    journal.write_text(lines[0] + "\n{not json\n" + lines[1] + "\n")
    with pytest.warns(OverflowWarning, match=r"overflow_events.jsonl:2: skipped a corrupt journal line"):
        run = load_run(run_dir)
    assert [e["kind"] for e in run.events] == ["nonfinite", "skip"]
    assert main(["report", str(run_dir), "--out", str(tmp_path / "x.png")]) == 0
