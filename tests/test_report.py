"""The report command: the dashboard of real runs, the loss chosen deliberately, labels, markers and outcomes."""

from __future__ import annotations

import csv
import json
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from conftest import fit
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger
from torch import Tensor, nn

from lightning_overflow import GradNormMonitor, NonFiniteDetector, OverflowWarning
from lightning_overflow.cli import main
from lightning_overflow.report import (
    EVENT_MARKERS,
    ReportError,
    choose_loss_key,
    choose_val_key,
    default_labels,
    draw,
    event_markers,
    load_run,
    run_outcome,
    sparse_logging_warning,
)
from lightning_overflow.report import figure as report_figure
from lightning_overflow.report.figure import NONFINITE_LABEL
from lightning_overflow.testing import Fault, FaultInjector, TinyRegressor

NAN = float("nan")


class LoggingRegressor(TinyRegressor):
    """TinyRegressor that logs its training loss the way many modules do: ``train/loss``."""

    key = "train/loss"

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log(self.key, loss)
        return loss


class PlainRegressor(LoggingRegressor):
    """A user's own module: logs ``train_loss`` and nothing else."""

    key = "train_loss"


def small_run(tmp_path: Path, logger_cls: type = CSVLogger, model: TinyRegressor | None = None,
              log_every_n_steps: int = 1) -> Path:
    logger = logger_cls(str(tmp_path), name="run")
    fit(model or TinyRegressor(), [GradNormMonitor(), NonFiniteDetector(), FaultInjector(Fault(5, "nan_loss"))],
        max_steps=20, logger=logger, log_every_n_steps=log_every_n_steps)
    return Path(logger.log_dir)


def write_run(folder: Path, rows: dict[str, list[tuple[int, float]]], events: Sequence[dict[str, Any]] = ()) -> Path:
    """A run folder as CSVLogger writes it: ``metrics.csv`` (one row per step and key) and the journal."""
    folder.mkdir(parents=True, exist_ok=True)
    keys = sorted(rows)
    with open(folder / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["epoch", *keys, "step"])
        writer.writeheader()
        for key, series in rows.items():
            for step, value in series:
                writer.writerow({"epoch": 0, "step": step, key: value})
    if events:
        lines = [json.dumps({"rank": 0, "source": "NonFiniteDetector", "message": "", **e}) for e in events]
        (folder / "overflow_events.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def steps(values: list[float], start: int = 0) -> list[tuple[int, float]]:
    return [(start + i, v) for i, v in enumerate(values)]


def panels(fig: Any) -> dict[str, Any]:
    return {ax.get_label(): ax for ax in fig.axes}


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every figure the report command draws, kept for inspection."""
    figures: list[Any] = []
    real_draw = report_figure.draw

    def keep(runs: Sequence[Any], title: str | None = None) -> Any:
        figures.append(real_draw(runs, title))
        return figures[-1]

    monkeypatch.setattr(report_figure, "draw", keep)
    return figures


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


# ---- real runs ---------------------------------------------------------------------------------------------------


def test_renders_a_dashboard_png_and_prints_the_events(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       drawn: list[Any]) -> None:
    run_dir = small_run(tmp_path, model=LoggingRegressor())
    out = tmp_path / "dash.png"
    assert main(["report", str(run_dir), "--out", str(out)]) == 0
    # No LRBackoff: no LR scale panel, and a row less: 1.2 + 1.3 * (3.2 + 1.1 + 1.8 + 1.8) inches at 100 dpi
    assert [ax.get_label() for ax in drawn[0].axes] == ["loss", "events", "gradient norm", "skipped steps", "headroom"]
    assert png_size(out) == (1300, 1147)
    printed, err = capsys.readouterr()
    assert err == ""  # logged every step: no warning
    assert f"run/version_0 ({run_dir / 'metrics.csv'}): finished at step 19\n" in printed
    assert "  panels: loss = train/loss; gradient norm = grad_norm/total; skipped steps = overflow/skipped_steps;" \
        in printed
    assert "not logged: validation loss, clip threshold, LR scale\n" in printed
    assert "  events: 1 nonfinite, 1 skip\n" in printed and "  step      5  skip " in printed
    assert printed.endswith(f"dashboard: {out}\n")
    from PIL import Image

    pixels = Image.open(out).convert("L").getextrema()
    assert pixels[0] < 100 and pixels[1] > 200  # not blank


def test_a_real_run_logging_train_slash_loss_draws_that_and_not_the_headroom(tmp_path: Path) -> None:
    run = load_run(small_run(tmp_path, model=LoggingRegressor()))
    assert "overflow/headroom_loss_decades" in run.metrics and run.panels["loss"] == "train/loss"
    fig = draw([run])
    loss = panels(fig)["loss"]
    assert [line.get_label() for line in loss.get_legend().get_lines()] == ["run/version_0: train/loss"]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["skipped step", NONFINITE_LABEL]
    # the injected NaN reaches the gradients, not the logged loss: step 5 is a hollow marker on the top edge
    grad = panels(fig)["gradient norm"]
    assert not [line for line in loss.lines if line.get_markerfacecolor() == "none"]
    top = [line for line in grad.lines if line.get_marker() == "o" and line.get_markerfacecolor() == "none"]
    assert [list(line.get_xdata()) for line in top] == [[5]] and list(top[0].get_ydata()) == [1.0]


def test_reads_tensorboard_event_files(tmp_path: Path) -> None:
    run = load_run(small_run(tmp_path, TensorBoardLogger))
    assert len(run.metrics["grad_norm/total"]) == 20 and [e["kind"] for e in run.events] == ["nonfinite", "skip"]
    assert run.source == run.path and run.panels["loss"] is None


def tensorboardx_writer() -> type:
    return pytest.importorskip("tensorboardX").SummaryWriter


def torch_writer() -> type:
    from torch.utils.tensorboard import SummaryWriter  # what Lightning's TensorBoardLogger writes with

    return SummaryWriter


@pytest.mark.parametrize("writer", [tensorboardx_writer, torch_writer])
def test_reads_event_files_of_either_writer_and_not_its_hparams_folder(
        writer: Any, tmp_path: Path, drawn: list[Any], capsys: pytest.CaptureFixture[str]) -> None:
    # neuralforecast's default logger, without the tensorboard package, writes with tensorboardX.
    with writer()(str(tmp_path / "run")) as events:
        for step, (norm, loss) in enumerate([(3.0, 4.0), (25.0, 2.0), (0.5, 1.0)]):
            events.add_scalar("grad_norm/total", norm, step)
            events.add_scalar("train_loss", loss, step)
        events.add_hparams({"lr": 0.1}, {"hp/loss": 1.0})  # its own event file, in a folder below the run's
    run = load_run(tmp_path / "run")
    assert run.source == tmp_path / "run" and run.events == []
    assert run.metrics == {"grad_norm/total": [(0, 3.0), (1, 25.0), (2, 0.5)],
                           "train_loss": [(0, 4.0), (1, 2.0), (2, 1.0)]}
    assert main(["report", str(tmp_path / "run"), "--out", str(tmp_path / "x.png")]) == 0
    assert [ax.get_label() for ax in drawn[0].axes] == ["loss", "events", "gradient norm"]
    assert capsys.readouterr().err == ""


def test_without_tensorboard_the_error_names_the_pip_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = small_run(tmp_path, TensorBoardLogger)
    monkeypatch.setitem(sys.modules, "tensorboard.backend.event_processing.event_accumulator", None)
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(run_dir)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lightning-overflow report: error: '{run_dir}' holds TensorBoard event files "
                          "(events.out.tfevents.*), and reading them needs the 'tensorboard' package, which cannot "
                          "be imported (")
    assert err.endswith('): pip install "lightning-overflow[plot]"\n')


def test_without_matplotlib_the_error_names_the_pip_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(tmp_path)])  # refused before the run is read
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("lightning-overflow report: error: drawing the dashboard needs matplotlib, which cannot be "
                          "imported (")
    assert err.endswith('): pip install "lightning-overflow[plot]"\n')


def test_the_plot_extra_installs_what_report_reads_and_draws_with() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11
    extras = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    names = {extra: {re.split(r"[\[<>=!~;, ]", r, maxsplit=1)[0].lower() for r in requirements}
             for extra, requirements in extras.items()}
    assert {"matplotlib", "tensorboard"} <= names["plot"]  # the README's demo installs .[plot], then runs report
    assert {"tensorboard", "tensorboardx"} <= names["test"]  # both writers are read in the tests


def test_a_clean_run_is_drawn_without_events(tmp_path: Path, drawn: list[Any],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    logger = CSVLogger(str(tmp_path), name="clean")
    fit(LoggingRegressor(), [GradNormMonitor(), NonFiniteDetector()], max_steps=6, logger=logger, log_every_n_steps=1)
    run_dir = Path(logger.log_dir)
    assert not (run_dir / "overflow_events.jsonl").exists()  # a fit writes its journal with its first event
    for journal in ("none", "empty"):
        if journal == "empty":
            (run_dir / "overflow_events.jsonl").write_text("")
        assert main(["report", str(run_dir), "--out", str(tmp_path / f"{journal}.png")]) == 0
        out, err = capsys.readouterr()
        assert (err, out.splitlines()[-2:]) == ("", ["  events: none", f"dashboard: {tmp_path / f'{journal}.png'}"])
        assert png_size(tmp_path / f"{journal}.png")[0] == 1300
    assert [t.get_text() for t in panels(drawn[-1])["events"].texts] == ["finished at step 5  |  no events"]


def test_two_runs_are_overlaid_with_their_labels(tmp_path: Path, drawn: list[Any],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    first = small_run(tmp_path / "a", model=LoggingRegressor())
    second = small_run(tmp_path / "b", model=LoggingRegressor())
    out = tmp_path / "both.png"
    assert main(["report", f"bare={first}", f"suite={second}", "--out", str(out), "--title", "bare vs suite"]) == 0
    assert png_size(out) == (1300, 1225)  # one lane more: 1.2 + 1.3 * (3.2 + 1.7 + 1.8 + 1.8) inches
    fig = drawn[0]
    assert fig.get_suptitle() == "bare vs suite"
    assert [t.get_text() for t in panels(fig)["events"].get_yticklabels()] == ["bare", "suite"]
    legend = panels(fig)["loss"].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["bare: train/loss", "suite: train/loss"]
    printed = capsys.readouterr().out
    assert f"bare ({first / 'metrics.csv'}): finished at step 19" in printed
    assert f"suite ({second / 'metrics.csv'}): finished at step 19" in printed


def test_missing_and_empty_directories_are_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(tmp_path / "nope")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err == f"lightning-overflow report: error: run directory '{tmp_path / 'nope'}' does not exist\n"
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "overflow_events.jsonl").write_text('{"step": 1, "kind": "skip"}\n')  # a journal alone
    with pytest.raises(ReportError, match=r"holds no metrics.csv and no TensorBoard event file \(events.out.tfevents"):
        load_run(tmp_path / "empty")


def test_a_run_without_our_metrics_is_drawn_from_its_own_loss_and_one_without_a_loss_is_named(tmp_path: Path) -> None:
    logger = CSVLogger(str(tmp_path), name="plain")
    fit(TinyRegressor(), [], max_steps=-1, max_epochs=1, logger=logger, log_every_n_steps=1, limit_val_batches=1)
    baseline = load_run(logger.log_dir)  # a user's unprotected run, to draw beside the protected one
    assert (baseline.panels["loss"], baseline.panels["validation loss"], baseline.events) == (None, "val_loss", [])
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.csv").write_text("step,accuracy\n0,0.5\n")
    with pytest.raises(ReportError) as caught:
        load_run(other)
    assert str(caught.value) == (
        f"run directory '{other}' has metrics but no training loss and none of lightning_overflow's (keys found: "
        "accuracy): pass --loss-key KEY, or add GradNormMonitor (and the other callbacks) to the Trainer's "
        "callbacks"
    )


def test_a_plain_run_is_drawn_from_its_loss_alone_and_beside_a_protected_one(
        tmp_path: Path, drawn: list[Any], capsys: pytest.CaptureFixture[str]) -> None:
    logger = CSVLogger(str(tmp_path / "logs"), name="plain")
    fit(PlainRegressor(), [], max_steps=20, logger=logger, log_every_n_steps=1)  # no callback of the suite
    plain = Path(logger.log_dir)
    suite = small_run(tmp_path / "suite", model=LoggingRegressor())
    # The experiment's folder is given: the run is the version read below it, and named after it.
    assert main(["report", str(tmp_path / "logs" / "plain"), "--out", str(tmp_path / "plain.png")]) == 0
    assert [ax.get_label() for ax in drawn[0].axes] == ["loss", "events"]  # the panels it has data for
    assert png_size(tmp_path / "plain.png") == (1300, 679)  # 1.2 + 1.3 * (3.2 + 1.1) inches
    summary = (f"plain/version_0 ({plain / 'metrics.csv'}): finished at step 19\n"
               "  panels: loss = train_loss; not logged: validation loss, gradient norm, clip threshold, LR scale, "
               "skipped steps, headroom\n"
               "  events: none\n")
    assert capsys.readouterr() == (summary + f"dashboard: {tmp_path / 'plain.png'}\n", "")

    assert main(["report", str(plain), str(suite), "--out", str(tmp_path / "both.png")]) == 0
    fig = drawn[1]
    assert [ax.get_label() for ax in fig.axes] == ["loss", "events", "gradient norm", "skipped steps", "headroom"]
    assert [t.get_text() for t in panels(fig)["loss"].get_legend().get_texts()] == [
        "plain/version_0: train_loss", "run/version_0: train/loss"]
    assert [t.get_text() for t in panels(fig)["events"].texts] == [
        "finished at step 19  |  no events", "finished at step 19  |  1 skip"]
    assert fig.get_suptitle() == "plain/version_0 vs run/version_0"
    assert capsys.readouterr().out.startswith(summary)


def test_a_run_logged_less_often_than_its_events_is_warned_about(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = small_run(tmp_path, model=LoggingRegressor(), log_every_n_steps=5)  # logged at 4, 9, 14, 19
    assert main(["report", str(run_dir), "--out", str(tmp_path / "x.png")]) == 0
    assert capsys.readouterr().err == (
        "lightning-overflow report: warning: run/version_0: metrics were logged every 5 steps, but its one event "
        "happened at a step that was not logged (step 5), so the dashboard draws its effect up to 4 steps late. "
        "Log every step with Trainer(log_every_n_steps=1).\n"
    )


def test_the_logging_interval_that_fits_a_long_run(tmp_path: Path) -> None:
    events = [{"step": 57, "kind": "backoff"}, {"step": 10049, "kind": "skip"}, {"step": 10100, "kind": "skip"}]
    every_50 = load_run(write_run(tmp_path / "a", {"train_loss": [(s, 1.0) for s in range(49, 20000, 50)]}, events))
    assert sparse_logging_warning(every_50) == (
        "a: metrics were logged every 50 steps, but 2 of its 3 events happened at steps that were not logged (the "
        "first at step 57), so the dashboard draws their effect up to 49 steps late. Log every step with "
        "Trainer(log_every_n_steps=1), or at least every 40 steps for a run of 20000 steps: "
        "Trainer(log_every_n_steps=40)."
    )
    # 500 steps across the picture's width: a grid of 40 steps in 20,000 does not show
    every_40 = load_run(write_run(tmp_path / "b", {"train_loss": [(s, 1.0) for s in range(39, 20000, 40)]}, events))
    assert sparse_logging_warning(every_40) is None


def test_a_corrupt_journal_line_is_skipped_with_a_warning(tmp_path: Path) -> None:
    run_dir = small_run(tmp_path)
    journal = run_dir / "overflow_events.jsonl"
    lines = journal.read_text().splitlines()
    journal.write_text(lines[0] + "\n{not json\n" + lines[1] + "\n")
    with pytest.warns(OverflowWarning, match=r"overflow_events.jsonl:2: skipped a corrupt journal line"):
        run = load_run(run_dir)
    assert [e["kind"] for e in run.events] == ["nonfinite", "skip"]
    with pytest.warns(OverflowWarning, match="corrupt journal line"):
        assert main(["report", str(run_dir), "--out", str(tmp_path / "x.png")]) == 0


# ---- which series each panel draws -------------------------------------------------------------------------------


@pytest.mark.parametrize(("keys", "expected"), [
    (["train/loss", "overflow/headroom_decades/loss", "grad_norm/total"], "train/loss"),
    (["overflow/headroom_loss_decades", "loss", "val_loss"], "loss"),
    (["train_loss_step", "train_loss_epoch", "val_loss"], "train_loss_step"),
    (["train_loss", "train_loss_step", "loss"], "train_loss"),
    (["my_mse_loss", "train_ce_loss", "val/loss"], "train_ce_loss"),
    (["val_loss", "test_loss", "overflow/headroom_decades", "clip/threshold"], None),
    (["grad_norm/total", "overflow/headroom_decades/loss", "overflow/headroom_loss_decades"], None),
])
def test_the_training_loss_is_the_modules_never_the_suites(keys: list[str], expected: str | None) -> None:
    assert choose_loss_key(keys) == expected


@pytest.mark.parametrize(("keys", "expected"), [
    (["train_loss", "val_loss", "val/loss"], "val_loss"),
    (["train/loss", "val/loss"], "val/loss"),
    (["train_loss", "val_ce_loss"], "val_ce_loss"),
    (["train_loss", "test_loss"], None),
])
def test_the_validation_loss_is_chosen_by_name(keys: list[str], expected: str | None) -> None:
    assert choose_val_key(keys) == expected


def test_loss_and_val_keys_can_be_named_and_a_missing_one_is_an_error(tmp_path: Path) -> None:
    folder = write_run(tmp_path / "r", {"grad_norm/total": steps([1.0, 2.0]), "mse": steps([3.0, 2.0]),
                                        "val_mse": [(1, 2.5)], "train_loss": steps([9.0, 9.0])})
    run = load_run(folder, loss_key="mse", val_key="val_mse")
    assert (run.panels["loss"], run.panels["validation loss"]) == ("mse", "val_mse")
    with pytest.raises(ReportError) as err:
        load_run(folder, loss_key="loss")
    assert str(err.value) == (f"the loss key 'loss' was not logged in '{folder}' "
                              "(keys found: grad_norm/total, mse, train_loss, val_mse)")


@pytest.mark.parametrize("names", [
    ("overflow/headroom_loss_decades", "overflow/headroom_grad_decades", "overflow/headroom_activation_decades"),
    ("overflow/headroom_decades/loss", "overflow/headroom_decades/grad", "overflow/headroom_decades/activation"),
])
def test_headroom_parts_under_the_new_and_the_old_names(tmp_path: Path, names: tuple[str, str, str]) -> None:
    rows = {"grad_norm/total": steps([1.0]), "overflow/headroom_decades": [(0, 30.0)]}
    rows.update({name: [(0, 30.0 + i)] for i, name in enumerate(names)})
    run = load_run(write_run(tmp_path / "r", rows))
    assert [run.panels[f"headroom ({p})"] for p in ("loss", "grad", "activation")] == list(names)
    headroom = panels(draw([run]))["headroom"]
    assert sorted(float(line.get_ydata()[0]) for line in headroom.lines) == [30.0, 30.0, 31.0, 32.0]


def test_a_run_without_any_loss_says_which_keys_it_has(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = {"grad_norm/total": steps([1.0, 2.0]), "overflow/headroom_decades/loss": [(0, 38.0)]}
    folder = write_run(tmp_path / "r", rows)
    assert main(["report", str(folder), "--out", str(tmp_path / "x.png")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == ("  no training loss chosen: none of the keys logged reads as one (keys found: grad_norm/total, "
                        "overflow/headroom_decades/loss); pass --loss-key KEY")


# ---- labels ------------------------------------------------------------------------------------------------------


def test_default_labels_name_the_experiment_and_version_and_stay_unique(tmp_path: Path) -> None:
    assert default_labels([tmp_path / "baseline" / "version_0", tmp_path / "overflow_demo" / "protected"]) == [
        "baseline/version_0", "protected"]
    assert default_labels([tmp_path / "lightning_logs" / "version_0", tmp_path / "lightning_logs" / "version_1"]) == [
        "lightning_logs/version_0", "lightning_logs/version_1"]
    assert default_labels([tmp_path / "a" / "run" / "version_0", tmp_path / "b" / "run" / "version_0",
                           tmp_path / "c" / "other"]) == ["a/run/version_0", "b/run/version_0", "other"]
    assert default_labels([tmp_path / "version_3x"]) == ["version_3x"]


def test_labels_from_the_option_and_from_name_equals_dir(tmp_path: Path, drawn: list[Any]) -> None:
    rows = {"grad_norm/total": steps([1.0, 2.0]), "train_loss": steps([2.0, 1.0])}
    first, second = write_run(tmp_path / "x" / "version_0", rows), write_run(tmp_path / "y" / "version_0", rows)
    for argv, labels in (([str(first), str(second)], ["x/version_0", "y/version_0"]),
                         ([str(first), str(second), "--labels", "lr 1e-3, lr 1e-2"], ["lr 1e-3", "lr 1e-2"]),
                         ([f"small={first}", str(second)], ["small", "y/version_0"])):
        assert main(["report", *argv, "--out", str(tmp_path / "l.png")]) == 0
        assert [t.get_text() for t in panels(drawn[-1])["events"].get_yticklabels()] == labels
        assert drawn[-1].get_suptitle() == " vs ".join(labels)


# ---- markers and outcomes ----------------------------------------------------------------------------------------


def test_journal_events_map_to_one_marker_each() -> None:
    events = [{"step": 3, "kind": "nonfinite"}, {"step": 3, "kind": "skip"}, {"step": 4, "kind": "nonfinite"},
              {"step": 5, "kind": "clip"}, {"step": 6, "kind": "spike"}, {"step": 6, "kind": "backoff"},
              {"step": 7, "kind": "rollback"}, {"step": 8, "kind": "regrowth"}, {"step": 9, "kind": "snapshot_refused"},
              {"step": 10, "kind": "rebaseline"}, {"step": 11, "kind": "abort"}]
    drawn = [(m.step, m.kind, m.spec.marker, m.spec.colour, m.spec.label) for m in event_markers(events)]
    assert drawn == [
        (3, "skip", "v", "tab:orange", "skipped step"),
        (4, "nonfinite", "x", "black", "non-finite step, not skipped"),
        (6, "spike", "^", "tab:purple", "loss / gradient spike"),
        (6, "backoff", "s", "tab:brown", "LR backoff"),
        (7, "rollback", "D", "deeppink", "rollback"),
        (8, "regrowth", "P", "goldenrod", "LR regrowth"),
        (9, "snapshot_refused", "h", "silver", "other event (see the journal)"),
        (11, "abort", "X", "red", "abort (run stopped)"),
    ]
    specs = list(EVENT_MARKERS.values())
    assert len({s.marker for s in specs}) == len(specs) and len({s.colour for s in specs}) == len(specs)


def test_a_suspicion_is_drawn_as_tried_or_acted_on_only_where_the_suite_answered_it() -> None:
    """A suspicion that opened a trial, came while one ran, or was answered at once (a backoff, a rollback) is drawn
    apart from one that was only told (no trial could run, or the fit ended first)."""
    events = [{"step": 10, "kind": "no_progress"}, {"step": 20, "kind": "loss_trend"},
              {"step": 50, "kind": "trial", "details": {"opened_at": 10, "kept": False}},
              {"step": 60, "kind": "loss_divergence"}, {"step": 60, "kind": "backoff"},
              {"step": 70, "kind": "weight_growth"},
              {"step": 71, "kind": "rollback", "details": {"trigger_step": 70}},
              {"step": 90, "kind": "no_progress"}, {"step": 95, "kind": "ending"}]
    drawn = [(m.step, m.kind, m.spec.label) for m in event_markers(events)]
    assert drawn == [
        (10, "suspicion", "suspicion, tried or acted on"), (20, "suspicion", "suspicion, tried or acted on"),
        (50, "trial_reverted", "trial: run kept as it was"),
        (60, "suspicion", "suspicion, tried or acted on"), (60, "backoff", "LR backoff"),
        (70, "suspicion", "suspicion, tried or acted on"), (71, "rollback", "rollback"),
        (90, "suspicion_told", "suspicion, told only"), (95, "ending", "ended poorly (the summary says how)"),
    ]


def test_every_panel_marks_an_event_with_the_same_marker(tmp_path: Path) -> None:
    rows = {"train_loss": steps([2.0, 1.9, 1.8, 1.7]), "grad_norm/total": steps([1.0, 1.1, 1.2, 1.3]),
            "overflow/lr_scale": steps([1.0, 1.0, 0.5, 0.5]), "overflow/skipped_steps": steps([0, 0, 1, 1])}
    run = load_run(write_run(tmp_path / "r", rows, [{"step": 2, "kind": "rollback", "source": "Rollback"}]))
    fig = draw([run])
    for name in ("loss", "events", "gradient norm", "LR scale", "skipped steps"):
        marks = [line for line in panels(fig)[name].lines if line.get_marker() == "D"]
        assert [list(line.get_xdata()) for line in marks] == [[2]], name
        assert marks[0].get_color() == "deeppink"
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["rollback"]
    assert [float(y) for y in panels(fig)["LR scale"].lines[-1].get_ydata()] == [0.5]  # on the curve, at step 2


def test_the_loss_goes_log_scale_only_when_it_spans_decades(tmp_path: Path) -> None:
    grad = {"grad_norm/total": steps([1.0] * 3)}
    calm = load_run(write_run(tmp_path / "calm", {"train_loss": steps([3.0, 2.0, 1.5]), **grad}))
    wild = load_run(write_run(tmp_path / "wild", {"train_loss": steps([3.0, 2e4, 1.5]), **grad}))
    assert panels(draw([calm]))["loss"].get_yscale() == "linear"
    assert panels(draw([calm, wild]))["loss"].get_yscale() == "log"


def test_a_run_that_logs_a_validation_loss_only_draws_it_in_the_loss_panel(tmp_path: Path) -> None:
    """The panel was left empty (the text named val_loss), and matplotlib warned of a legend without artists."""
    run = load_run(write_run(tmp_path / "val", {"val_loss": steps([3.0, 2.0, 1.5]),
                                                "grad_norm/total": steps([1.0] * 3)}))  # fmt: skip
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = panels(draw([run]))["loss"]
    assert [line.get_label() for line in loss.get_lines()] == ["val: val_loss (validation)"]
    assert list(loss.get_lines()[0].get_ydata()) == [3.0, 2.0, 1.5]


def test_how_each_run_ended(tmp_path: Path) -> None:
    grad = {"grad_norm/total": steps([1.0] * 10)}
    finished = load_run(write_run(tmp_path / "f", {**grad, "train_loss": steps([2.0] * 10)}))
    nan_tail = load_run(write_run(tmp_path / "n", {"grad_norm/total": steps([1.0] * 6),
                                                   "train_loss": steps([2.0, 2.0, 2.0, NAN, NAN, NAN])}))
    diverged = load_run(write_run(tmp_path / "d", {**grad, "train_loss": steps([2.0] * 10)}, [
        {"step": 4, "kind": "rollback", "source": "Rollback"},
        {"step": 9, "kind": "abort", "source": "Rollback", "details": {"rollbacks": [{"step": 4}]}}]))
    raised = load_run(write_run(tmp_path / "r", {"grad_norm/total": steps([1.0] * 5)}, [
        {"step": 4, "kind": "nonfinite", "details": {"where": "loss"}}]))
    exited = load_run(write_run(tmp_path / "e", {"grad_norm/total": steps([1.0] * 5)}, [
        {"step": 4, "kind": "exit_restore", "source": "Rollback", "details": {"error": "KeyboardInterrupt"}}]))
    short = load_run(write_run(tmp_path / "s", {"grad_norm/total": steps([1.0] * 5), "train_loss": steps([1.0] * 5)}))
    # Logged every 4 steps: its last logged step may trail its last step by 3.
    sparse = load_run(write_run(tmp_path / "l", {"train_loss": [(3, 2.0), (7, 1.0)], "val_loss": [(8, 1.0)]}))
    outcomes = [run_outcome(r, 9) for r in (finished, nan_tail, diverged, raised, exited, short, sparse)]
    texts = [(o.kind, o.text) for o in outcomes]
    assert texts == [
        ("finished", "finished at step 9"),
        ("nonfinite", "stopped at step 5: loss NaN since step 3"),
        ("aborted", "stopped at step 9: DivergenceError raised by Rollback"),
        ("raised", "stopped at step 4: NonFiniteError (non-finite loss, not skipped)"),
        ("raised", "stopped at step 4: KeyboardInterrupt raised"),
        ("ended", "ended at step 4, before the others (nothing journaled about why)"),
        ("finished", "finished at step 8"),
    ]
    assert run_outcome(sparse, 13).text == "ended at step 8, before the others (nothing journaled about why)"
    lanes = panels(draw([finished, nan_tail, diverged]))["events"]
    assert [t.get_text() for t in lanes.texts] == [
        "finished at step 9  |  no events",
        "stopped at step 5: loss NaN since step 3  |  no events",
        "stopped at step 9: DivergenceError raised by Rollback  |  1 rollback, 1 abort",
    ]
    assert math.isnan(nan_tail.metrics["train_loss"][-1][1])
