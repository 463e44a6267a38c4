"""Bad command lines: one line on stderr, ``lightning-overflow <command>: error: ...``, exit status 2, no work done."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import fit
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger
from test_report import steps, write_run

import lightning_overflow.demo.run as demo_run
from lightning_overflow import GradNormMonitor, NonFiniteDetector
from lightning_overflow.cli import main
from lightning_overflow.journal_listing import NOTHING_TO_REPORT
from lightning_overflow.testing import TinyRegressor

DEMO = "lightning-overflow demo: error: "
REPORT = "lightning-overflow report: error: "
JOURNAL = "lightning-overflow journal: error: "


@pytest.fixture
def demo_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Stands in for the demo's training, recording what it would have been asked to do."""
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(demo_run, "run_demo", lambda **kwargs: calls.append(kwargs) or [])
    # The command flushes denormals process-wide; inside pytest that would stay set for every later test.
    monkeypatch.setattr(torch, "set_flush_denormal", lambda on: calls.append({"flush_denormal": on}) or True)
    return calls


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The stderr of a command line that must exit 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err


@pytest.mark.parametrize(("argv", "message"), [
    (["--lr", "-1"], "argument --lr: must be a finite number > 0 (got -1.0)"),
    (["--lr", "0"], "argument --lr: must be a finite number > 0 (got 0.0)"),
    (["--lr", "nan"], "argument --lr: must be a finite number > 0 (got nan)"),
    (["--lr", "inf"], "argument --lr: must be a finite number > 0 (got inf)"),
    (["--lr", "fast"], "argument --lr: must be a finite number > 0 (got 'fast')"),
    (["--steps", "0"], "argument --steps: must be an int >= 1 (got 0)"),
    (["--steps", "-5"], "argument --steps: must be an int >= 1 (got -5)"),
    (["--steps", "many"], "argument --steps: must be an int >= 1 (got 'many')"),
    (["--seed", "1.5"], "argument --seed: must be an int in [0, 4294967295] (got '1.5')"),
    (["--seed", "-1"], "argument --seed: must be an int in [0, 4294967295] (got -1)"),
    (["--accelerator", "tpu"],
     "argument --accelerator: must be one of 'auto', 'cpu', 'gpu', 'cuda', 'mps' (got 'tpu')"),
])
def test_demo_refuses_bad_numbers_before_any_training(argv: list[str], message: str, demo_calls: list[Any],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert refused(["demo", *argv], capsys) == DEMO + message + "\n"
    assert demo_calls == []


@pytest.mark.parametrize(("accelerator", "message"), [
    ("gpu", "'gpu' needs a CUDA or Apple MPS device and torch finds none; use --accelerator cpu"),
    ("cuda", "'cuda' needs a CUDA device and torch finds none; use --accelerator cpu"),
    ("mps", "'mps' needs an Apple MPS device and torch finds none; use --accelerator cpu"),
])
def test_demo_refuses_an_accelerator_that_is_not_there(
    accelerator: str, message: str, no_gpu: None, demo_calls: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    assert refused(["demo", "--accelerator", accelerator], capsys) == f"{DEMO}argument --accelerator: {message}\n"
    assert demo_calls == []


def test_demo_passes_good_arguments_on(monkeypatch: pytest.MonkeyPatch, demo_calls: list[dict[str, Any]]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert main(["demo", "--lr", "1e-3", "--steps", "3", "--seed", "7", "--accelerator", "gpu", "--out", "o"]) == 0
    assert demo_calls == [{"flush_denormal": True},
                          {"steps": 3, "seed": 7, "out": Path("o"), "accelerator": "gpu", "lr": 0.001}]
    assert main(["demo"]) == 0
    assert demo_calls[3] == {"steps": 500, "seed": 0, "out": Path("overflow_demo"), "accelerator": "cpu", "lr": None}


def test_demo_refuses_a_file_as_its_output_folder(tmp_path: Path, demo_calls: list[Any],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    taken = tmp_path / "notes.txt"
    taken.write_text("x")
    assert refused(["demo", "--out", str(taken)], capsys) == (
        f"{DEMO}argument --out: '{taken}' is a file; the demo writes its runs into a folder\n")
    assert demo_calls == []


def run_folder(tmp_path: Path, name: str = "run") -> Path:
    return write_run(tmp_path / name, {"grad_norm/total": steps([1.0, 2.0]), "train_loss": steps([2.0, 1.0])})


def test_report_on_a_file_says_what_a_run_directory_is(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# notes\n")
    assert refused(["report", str(readme)], capsys) == (
        f"{REPORT}'{readme}' is a file, not a run directory: a run directory is the folder a logger wrote for one "
        "run (e.g. lightning_logs/version_0), holding its metrics.csv or TensorBoard event files\n")


def test_report_on_a_missing_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert refused(["report", str(tmp_path / "gone")], capsys) == (
        f"{REPORT}run directory '{tmp_path / 'gone'}' does not exist\n")


def test_report_out_in_a_missing_folder_is_refused_and_not_created(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    run = run_folder(tmp_path)
    out = tmp_path / "missing" / "dir" / "x.png"
    assert refused(["report", str(run), "--out", str(out)], capsys) == (
        f"{REPORT}argument --out: the folder '{out.parent}' does not exist (got '{out}'); create it first\n")
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize(("name", "message"), [
    ("pictures", "'{out}' is a directory; name the picture to write (e.g. {out}/dashboard.png)"),
    ("dash.jpg", "must end in .png, .svg, .pdf (got '{out}')"),
])
def test_report_out_must_be_a_picture_file(tmp_path: Path, name: str, message: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "pictures").mkdir()
    out = tmp_path / name
    assert refused(["report", str(run_folder(tmp_path)), "--out", str(out)], capsys) == (
        f"{REPORT}argument --out: {message.format(out=out)}\n")


def test_report_on_a_folder_without_metrics_names_what_it_looked_for(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    wandb = tmp_path / "wandb" / "offline-run-20250101_000000-abc"
    (wandb / "files").mkdir(parents=True)
    (wandb / "files" / "wandb-summary.json").write_text('{"train_loss": 1.0}')
    (wandb / "run-abc.wandb").write_bytes(b"\x00")
    (tmp_path / "wandb" / "overflow_events.jsonl").write_text('{"step": 3, "kind": "skip"}\n')
    assert refused(["report", str(tmp_path / "wandb")], capsys) == (
        f"{REPORT}run directory '{tmp_path / 'wandb'}' holds no metrics.csv and no TensorBoard event file "
        "(events.out.tfevents.*): point at the folder a CSVLogger or TensorBoardLogger wrote (e.g. "
        "lightning_logs/version_0); W&B and MLflow keep their metrics in their own stores, so add one of those "
        "loggers beside them\n")


def test_report_on_a_metrics_file_without_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "metrics.csv").write_text("epoch,step\n")
    assert refused(["report", str(tmp_path / "r")], capsys) == (
        f"{REPORT}'{tmp_path / 'r' / 'metrics.csv'}' holds no metric values (the run logged nothing yet)\n")


def test_report_loss_key_that_was_not_logged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = run_folder(tmp_path)
    assert refused(["report", str(run), "--loss-key", "train/loss"], capsys) == (
        f"{REPORT}the loss key 'train/loss' was not logged in '{run}' (keys found: grad_norm/total, train_loss)\n")
    assert refused(["report", str(run), "--val-key", "val_loss"], capsys) == (
        f"{REPORT}the validation loss key 'val_loss' was not logged in '{run}' "
        "(keys found: grad_norm/total, train_loss)\n")


@pytest.mark.parametrize(("extra", "message"), [
    (["--labels", "a"], "argument --labels: 1 label(s) for 2 run directories"),
    (["--labels", "a,,b"], "argument --labels: must be comma-separated non-empty names (got 'a,,b')"),
    (["--labels", "a,a"], "two runs share a label (a, a): name them with --labels or NAME=DIR"),
])
def test_report_labels_must_match_the_runs(tmp_path: Path, extra: list[str], message: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    runs = [str(run_folder(tmp_path, "x")), str(run_folder(tmp_path, "y"))]
    assert refused(["report", *runs, *extra], capsys) == REPORT + message + "\n"


def test_report_labels_once_either_way(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    x, y = run_folder(tmp_path, "x"), run_folder(tmp_path, "y")
    assert refused(["report", f"a={x}", str(y), "--labels", "a,b"], capsys) == (
        f"{REPORT}argument --labels: give each run's label once, either as NAME=DIR or in --labels\n")
    assert refused(["report", f"={x}"], capsys) == (
        f"{REPORT}argument RUN_DIR: NAME=DIR needs both a name and a folder (got '={x}')\n")


@pytest.mark.parametrize("logger_cls", [CSVLogger, TensorBoardLogger])
def test_journal_of_a_clean_run_says_nothing_happened(logger_cls: type, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    logger = logger_cls(str(tmp_path / "logs"), name="clean")
    fit(TinyRegressor(), [GradNormMonitor(), NonFiniteDetector()], max_steps=4, logger=logger)
    run = Path(logger.log_dir)
    assert not list(tmp_path.rglob("overflow_events.jsonl"))  # a fit writes its journal with its first event
    capsys.readouterr()
    for given in (run, tmp_path / "logs"):  # the version folder, or the folder above its experiments
        assert main(["journal", str(given)]) == 0
        assert capsys.readouterr() == (f"{run}:\n{NOTHING_TO_REPORT}\n", "")
        assert main(["journal", str(given), "--json"]) == 0
        assert capsys.readouterr() == ("", f"lightning-overflow journal: {run}: {NOTHING_TO_REPORT}\n")  # no events
    (run / "overflow_events.jsonl").write_text("")  # an empty journal is a clean run too
    assert main(["journal", str(run)]) == 0
    assert capsys.readouterr() == (f"{run / 'overflow_events.jsonl'}:\n{NOTHING_TO_REPORT}\n", "")
    assert main(["journal", str(run), "--json"]) == 0
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("marker", ["hparams.yaml", "metrics.csv", "events.out.tfevents.1.host", "checkpoints/"])
def test_journal_knows_a_run_folder_by_any_file_lightning_writes(marker: str, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    folders = [tmp_path / "lightning_logs" / f"version_{v}" for v in (0, 1)]
    for folder in folders:
        folder.mkdir(parents=True)
        if marker.endswith("/"):
            (folder / marker).mkdir()
        else:
            (folder / marker).write_text("")
    assert main(["journal", str(tmp_path)]) == 0
    assert capsys.readouterr().out == "\n".join(f"{f}:\n{NOTHING_TO_REPORT}\n" for f in folders)


def test_journal_of_a_path_without_a_run_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert refused(["journal", str(tmp_path / "gone")], capsys) == (
        f"{JOURNAL}argument RUN_DIR: '{tmp_path / 'gone'}' does not exist\n")
    (tmp_path / "notes.txt").write_text("hparams.yaml\n")
    (tmp_path / "checkpoints").write_text("a file, not Lightning's folder")
    assert refused(["journal", str(tmp_path)], capsys) == (
        f"{JOURNAL}argument RUN_DIR: no journal (overflow_events.jsonl) at or under '{tmp_path}'\n")


def test_journal_of_a_file_that_is_not_one_is_refused_in_a_few_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It said "the suite recorded no event" of a metrics.csv (after a Python warning of two lines per line)."""
    csv = tmp_path / "metrics.csv"
    csv.write_text("step,loss\n" + "".join(f"{i},0.{i}\n" for i in range(6)))
    lines = refused(["journal", str(csv)], capsys).splitlines()
    assert lines[0] == (f"lightning-overflow journal: {csv}:1: skipped a corrupt journal line (Expecting value: "
                        "line 1 column 1 (char 0))")
    assert lines[3:] == [
        "lightning-overflow journal: ... and 4 more line(s) skipped",
        f"{JOURNAL}argument RUN_DIR: '{csv}' holds no event that can be read (7 line(s) skipped): it is not a "
        "journal, or it was cut off while its first event was written",
    ]


def test_journal_into_a_closed_pipe_stops_quietly(tmp_path: Path) -> None:
    import subprocess
    import sys

    journal = tmp_path / "overflow_events.jsonl"
    journal.write_text("".join(f'{{"step": {i}, "kind": "skip", "message": "step {i}"}}\n' for i in range(3000)))
    done = subprocess.run(f"{sys.executable} -m lightning_overflow journal --json {journal} | head -1", shell=True,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.stdout.startswith('{"step": 0, ') and "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr


def test_no_command_is_one_line_too(capsys: pytest.CaptureFixture[str]) -> None:
    assert refused([], capsys) == "lightning-overflow: error: the following arguments are required: command\n"
