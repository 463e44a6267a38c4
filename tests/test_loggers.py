"""The suite with real loggers: each fit's journal lies in its own run, its events carry the run's id, trackers with
artifacts receive it, TensorBoard shows a layout and the events, and the metric keys arrive on file-based stores.

Every fit here: ``TinyRegressor``, ``default_callbacks()``, a NaN loss injected at step 3, 6 steps, offline.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
from conftest import make_trainer
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger

from lightning_overflow import OverflowWarning, default_callbacks
from lightning_overflow.events import JOURNAL_NAME, read_journal
from lightning_overflow.health import board_for
from lightning_overflow.loggers import EVENTS_TAG, JOURNAL_FOLDER, TENSORBOARD_LAYOUT, journal_location
from lightning_overflow.testing import Fault, FaultInjector, TinyRegressor

FAULT_STEP = 3
EXPECTED = [(FAULT_STEP, "nonfinite"), (FAULT_STEP, "skip")]
# What default_callbacks() logs on every step of a short fit (clip/threshold waits for ZClip's warm-up).
STEP_KEYS = {
    "grad_norm/total",
    "clip/coef",
    "overflow/skipped_steps",
    "overflow/nonfinite_events",
    "overflow/spikes",
    "overflow/lr_scale",
    "overflow/rollbacks",
    "overflow/headroom_decades",
}


def _fit(root: Path, logger: Any, **kwargs: Any) -> pl.Trainer:
    callbacks = [*default_callbacks(), FaultInjector(Fault(FAULT_STEP, "nan_loss"))]
    trainer = make_trainer(
        callbacks, logger=logger, default_root_dir=str(root), max_steps=6, log_every_n_steps=1, **kwargs
    )
    trainer.fit(TinyRegressor())
    return trainer


def _events(path: Path) -> list[dict[str, Any]]:
    return list(read_journal(path))


def _journal(trainer: pl.Trainer) -> Path:
    path = board_for(trainer).journal.path
    assert path is not None
    return path


def _assert_no_key_is_a_folder_of_another(keys: set[str]) -> None:
    for key in keys:
        assert not any(other.startswith(key + "/") for other in keys), key


# ---- no logger ---------------------------------------------------------------------------------------------------
def test_without_a_logger_fits_append_to_one_file_told_apart_by_their_run(tmp_path: Path) -> None:
    first, second = _fit(tmp_path, False), _fit(tmp_path, False)
    path = tmp_path / JOURNAL_NAME
    assert _journal(first) == _journal(second) == path
    events = _events(path)
    assert [(e["step"], e["kind"]) for e in events] == EXPECTED * 2
    runs = [e["run"] for e in events]
    assert runs[0] == runs[1] and runs[2] == runs[3] and runs[0] != runs[2]
    assert re.fullmatch(r"[0-9a-f]{12}", runs[0])
    assert runs[0] == board_for(first).journal.run and runs[2] == board_for(second).journal.run


def test_every_line_of_the_journal_names_its_run(tmp_path: Path) -> None:
    trainer = _fit(tmp_path, False)
    lines = [json.loads(line) for line in (tmp_path / JOURNAL_NAME).read_text().splitlines()]
    assert [line["run"] for line in lines] == [board_for(trainer).journal.run] * 2


# ---- CSV and TensorBoard -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("logger_class", [CSVLogger, TensorBoardLogger])
def test_csv_and_tensorboard_keep_each_journal_in_its_version_folder(tmp_path: Path, logger_class: type) -> None:
    trainers = [_fit(tmp_path, logger_class(tmp_path)) for _ in range(2)]
    runs = []
    for version, trainer in enumerate(trainers):
        path = tmp_path / "lightning_logs" / f"version_{version}" / JOURNAL_NAME
        assert _journal(trainer) == path
        events = _events(path)
        assert [(e["step"], e["kind"]) for e in events] == EXPECTED  # this fit's events only
        runs.append({e["run"] for e in events})
    assert len(runs[0]) == len(runs[1]) == 1 and runs[0] != runs[1]
    assert not (tmp_path / JOURNAL_NAME).exists() and not (tmp_path / "lightning_logs" / JOURNAL_NAME).exists()


def test_a_logger_of_the_unified_namespace_is_recognised_alike(tmp_path: Path) -> None:
    from lightning.pytorch.loggers import TensorBoardLogger as UnifiedTensorBoardLogger

    logger = UnifiedTensorBoardLogger(tmp_path)
    trainer = _fit(tmp_path, logger)
    journal = tmp_path / "lightning_logs" / "version_0" / JOURNAL_NAME
    assert _journal(trainer) == journal
    assert [(e["step"], e["kind"]) for e in _events(journal)] == EXPECTED
    assert _accumulator(logger.log_dir).Tags()["tensors"] == ["custom_scalars__config__", f"{EVENTS_TAG}/text_summary"]


def _accumulator(log_dir: str) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(log_dir, size_guidance={"tensors": 0, "scalars": 0})
    accumulator.Reload()
    return accumulator


def test_tensorboard_gets_the_layout_once_and_the_events_as_text_at_their_steps(tmp_path: Path) -> None:
    from tensorboard.plugins.custom_scalar import layout_pb2

    logger = TensorBoardLogger(tmp_path)
    _fit(tmp_path, logger)
    accumulator = _accumulator(logger.log_dir)

    (config,) = accumulator.Tensors("custom_scalars__config__")  # once per fit
    layout = layout_pb2.Layout.FromString(config.tensor_proto.string_val[0])
    charts = {chart.title: list(chart.multiline.tag) for category in layout.category for chart in category.chart}
    assert charts == {title: tags for title, (_, tags) in TENSORBOARD_LAYOUT["lightning_overflow"].items()}
    scalars = set(accumulator.Tags()["scalars"])
    shown = {
        title: sorted(t for t in scalars if any(re.match(tag, t) for tag in tags)) for title, tags in charts.items()
    }
    assert shown == {
        "gradient norm and clip threshold": ["clip/threshold", "grad_norm/total"],  # the warm-up's cap from step 3
        "skips, detections, spikes, rollbacks": [
            "overflow/nonfinite_events",
            "overflow/rollbacks",
            "overflow/skipped_steps",
            "overflow/spikes",
        ],
        "LR scale": ["overflow/lr_scale"],
        "headroom (decades to the FP32 limit)": [
            "overflow/headroom_activation_decades",
            "overflow/headroom_decades",
            "overflow/headroom_grad_decades",
            "overflow/headroom_loss_decades",
        ],
    }

    (text,) = accumulator.Tensors(f"{EVENTS_TAG}/text_summary")  # both events of step 3 in one entry
    assert text.step == FAULT_STEP
    lines = text.tensor_proto.string_val[0].decode().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(
        "- **nonfinite**: NonFiniteDetector: the loss was inf/NaN at step 3 (epoch 0) on rank(s) 0."
    )
    assert lines[1] == "- **skip**: skipped optimizer step 3: non-finite loss"


def test_tensorboard_gets_no_text_when_nothing_happened(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path)
    make_trainer(default_callbacks(), logger=logger, max_steps=4, log_every_n_steps=1).fit(TinyRegressor())
    tags = _accumulator(logger.log_dir).Tags()["tensors"]
    assert tags == ["custom_scalars__config__"]


# ---- MLflow ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sqlite_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One sqlite tracking store for the module: creating its schema costs seconds, a run in it does not. Each test
    uses its own experiment (``artifact_location`` is an experiment's)."""
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/m.db"


def _assert_mlflow_run(uri: str, logger: Any, journal: Path, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    run = client.get_run(logger.run_id)
    keys = set(run.data.metrics)
    assert STEP_KEYS <= keys
    _assert_no_key_is_a_folder_of_another(keys)
    history = sorted((m.step, m.value) for m in client.get_metric_history(logger.run_id, "overflow/skipped_steps"))
    assert history == [(0, 0.0), (1, 0.0), (2, 0.0), (3, 1.0), (4, 1.0), (5, 1.0)]  # step 3 skipped
    assert run.data.metrics["overflow/nonfinite_events"] == 1.0
    assert [a.path for a in client.list_artifacts(logger.run_id)] == [JOURNAL_NAME]
    uploaded = client.download_artifacts(logger.run_id, JOURNAL_NAME, str(tmp_path / "download"))
    assert Path(uploaded).read_text() == journal.read_text()
    events = _events(journal)
    assert [(e["step"], e["kind"]) for e in events] == EXPECTED
    assert {e["run"] for e in events} == {logger.run_id}


def test_mlflow_file_store_keeps_each_journal_in_its_run_and_uploads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("mlflow")
    from pytorch_lightning.loggers import MLFlowLogger

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses its file store unless told
    store = tmp_path / "mlruns"
    uri = f"file:{store}"
    loggers = [MLFlowLogger(tracking_uri=uri) for _ in range(2)]
    for logger in loggers:
        trainer = _fit(tmp_path, logger)  # two runs into one store: no NotADirectoryError, two journals
        journal = store / logger.experiment_id / logger.run_id / JOURNAL_NAME
        assert _journal(trainer) == journal
        _assert_mlflow_run(uri, logger, journal, tmp_path / logger.run_id)
    assert loggers[0].run_id != loggers[1].run_id
    assert not (store / JOURNAL_NAME).exists()
    from mlflow.tracking import MlflowClient

    # The journal beside meta.yaml leaves the store readable: both runs are listed, finished.
    runs = MlflowClient(uri).search_runs([loggers[0].experiment_id])
    assert sorted(r.info.run_id for r in runs) == sorted(logger.run_id for logger in loggers)
    assert {r.info.status for r in runs} == {"FINISHED"}


@pytest.mark.slow  # the first of these pays for the sqlite schema (about 10 s)
def test_mlflow_sqlite_keeps_the_journal_in_a_folder_of_its_run_and_uploads_it(tmp_path: Path, sqlite_uri: str) -> None:
    from pytorch_lightning.loggers import MLFlowLogger

    logger = MLFlowLogger("journal", tracking_uri=sqlite_uri, artifact_location=str(tmp_path / "artifacts"))
    trainer = _fit(tmp_path / "root", logger)
    journal = tmp_path / "root" / JOURNAL_FOLDER / logger.run_id / JOURNAL_NAME
    assert _journal(trainer) == journal
    _assert_mlflow_run(sqlite_uri, logger, journal, tmp_path)
    assert (tmp_path / "artifacts" / logger.run_id / "artifacts" / JOURNAL_NAME).is_file()


@pytest.mark.slow  # the first of these pays for the sqlite schema (about 10 s)
def test_a_fatal_error_uploads_the_journal_with_its_last_event(tmp_path: Path, sqlite_uri: str) -> None:
    from mlflow.tracking import MlflowClient
    from pytorch_lightning.loggers import MLFlowLogger

    from lightning_overflow import NonFiniteDetector, NonFiniteError

    logger = MLFlowLogger("fatal", tracking_uri=sqlite_uri, artifact_location=str(tmp_path / "artifacts"))
    trainer = make_trainer(
        [NonFiniteDetector(action="raise"), FaultInjector(Fault(FAULT_STEP, "nan_loss"))],
        logger=logger,
        default_root_dir=str(tmp_path),
    )
    with pytest.raises(NonFiniteError):
        trainer.fit(TinyRegressor())
    client = MlflowClient(sqlite_uri)
    uploaded = Path(client.download_artifacts(logger.run_id, JOURNAL_NAME, str(tmp_path / "download")))
    assert [(e["step"], e["kind"]) for e in _events(uploaded)] == [(FAULT_STEP, "nonfinite")]
    assert client.get_run(logger.run_id).info.status == "FAILED"


@pytest.mark.slow  # the first of these pays for the sqlite schema (about 10 s)
def test_an_upload_the_tracker_refuses_warns_and_the_fit_stands(tmp_path: Path, sqlite_uri: str) -> None:
    from pytorch_lightning.loggers import MLFlowLogger

    (tmp_path / "a_file").write_text("")  # the artifact store lies under a file: every upload fails
    logger = MLFlowLogger("refused", tracking_uri=sqlite_uri, artifact_location=str(tmp_path / "a_file" / "x"))
    with pytest.warns(OverflowWarning, match=r"could not upload the journal .*overflow_events.jsonl to MLFlowLogger: "):
        trainer = _fit(tmp_path, logger)
    assert trainer.global_step == 6
    assert [(e["step"], e["kind"]) for e in _events(_journal(trainer))] == EXPECTED


# ---- W&B ---------------------------------------------------------------------------------------------------------
def test_wandb_offline_keeps_the_journal_in_the_run_folder_and_saves_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wandb = pytest.importorskip("wandb")
    from pytorch_lightning.loggers import WandbLogger

    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off"}.items():
        monkeypatch.setenv(name, value)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    logger = WandbLogger(save_dir=str(tmp_path), offline=True)
    run = logger.experiment
    saved: list[tuple[tuple[Any, ...], dict[str, Any], Any]] = []
    save = run.save

    def recording_save(*args: Any, **kwargs: Any) -> Any:
        result = save(*args, **kwargs)
        saved.append((args, kwargs, result))
        return result

    monkeypatch.setattr(run, "save", recording_save)
    try:
        trainer = _fit(tmp_path, logger)
        journal = Path(run.dir) / JOURNAL_NAME
        assert _journal(trainer) == journal
        assert journal.parent.parent.parent == tmp_path / "wandb"  # <save_dir>/wandb/offline-run-.../files
        assert not (tmp_path / JOURNAL_NAME).exists()
        events = _events(journal)
        assert [(e["step"], e["kind"]) for e in events] == EXPECTED
        assert {e["run"] for e in events} == {run.id}
        assert saved == [((str(journal),), {"base_path": str(journal.parent), "policy": "now"}, [str(journal)])]
        summary = dict(run.summary)
        assert STEP_KEYS <= set(summary) and summary["overflow/skipped_steps"] == 1
    finally:
        wandb.finish()


# ---- DDP ---------------------------------------------------------------------------------------------------------
@pytest.mark.ddp
@pytest.mark.timeout(180)
def test_under_ddp_rank_zero_chooses_the_version_folder_and_alone_writes(tmp_path: Path) -> None:
    from ddp_utils import run_ddp

    callbacks = [*default_callbacks(), FaultInjector(Fault(FAULT_STEP, "nan_loss", rank=1))]
    reports = run_ddp(TinyRegressor(), callbacks, tmp_path, logger=CSVLogger(tmp_path), log_every_n_steps=1)
    assert [r["error"] for r in reports] == [None, None]
    assert sorted(p.name for p in (tmp_path / "lightning_logs").iterdir()) == ["version_0"]
    events = _events(tmp_path / "lightning_logs" / "version_0" / JOURNAL_NAME)
    assert [(e["step"], e["kind"]) for e in events] == EXPECTED
    assert len({e["run"] for e in events}) == 1


def test_journal_location_of_a_logger_without_a_folder_is_memory(tmp_path: Path) -> None:
    from conftest import MemoryLogger

    trainer = make_trainer(logger=MemoryLogger(), default_root_dir=str(tmp_path))
    path, run = journal_location(trainer)
    assert path is None and re.fullmatch(r"[0-9a-f]{12}", run)
    trainer = make_trainer(logger=MemoryLogger(str(tmp_path / "memory")))
    assert journal_location(trainer)[0] == tmp_path / "memory" / JOURNAL_NAME


class LoggingRegressor(TinyRegressor):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


def test_metrics_csv_has_one_row_per_logged_step(tmp_path: Path) -> None:
    """The suite's step metrics ride on Lightning's own ``log_metrics`` call of the step (every row carries the
    model's ``train_loss`` or Lightning's ``epoch``: the suite wrote no row of its own), and a value logged only on
    some steps (the clip coefficient, absent on a skipped step) is not carried to the next."""
    import csv

    logger = CSVLogger(str(tmp_path))
    faults = FaultInjector(Fault(9, "nan_loss"))
    trainer = make_trainer([*default_callbacks(), faults], max_steps=16, logger=logger, log_every_n_steps=1,
                           limit_val_batches=0)  # fmt: skip
    trainer.fit(LoggingRegressor())
    rows = list(csv.DictReader(open(Path(logger.log_dir) / "metrics.csv")))
    assert all(row["train_loss"] or row["epoch"] for row in rows)
    assert [int(row["step"]) for row in rows if row["grad_norm/total"]] == list(range(16))  # one row a step
    assert [int(row["step"]) for row in rows if row["train_loss"]] == list(range(16))
    by_step = {int(row["step"]): row for row in rows if row["grad_norm/total"]}
    assert by_step[8]["train_loss"] and by_step[8]["overflow/skipped_steps"] == "0.0"
    assert by_step[9]["clip/coef"] == "" and by_step[9]["overflow/skipped_steps"] == "1.0"
    # The logger is given its own log_metrics back when the fit ends.
    assert "log_metrics" not in vars(logger)


class CollidingRegressor(TinyRegressor):
    """A module that logs under keys the suite logs too (its own gradient norm, a count of its own)."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.log("grad_norm/total", 1000.0 + self.global_step)
        return super().training_step(batch, batch_idx)


def test_a_key_the_module_logs_too_keeps_the_modules_value_and_is_said_once(tmp_path: Path) -> None:
    """The suite's held metrics used to overwrite the module's of the same name in the loggers, while
    ``callback_metrics`` (what ``EarlyStopping`` reads) kept the module's: two numbers under one name, without a
    word."""
    import csv

    logger = CSVLogger(str(tmp_path))
    trainer = make_trainer(default_callbacks(), max_steps=6, logger=logger, log_every_n_steps=1, limit_val_batches=0)
    with pytest.warns(OverflowWarning) as said:
        trainer.fit(CollidingRegressor())
    rows = list(csv.DictReader(open(Path(logger.log_dir) / "metrics.csv")))
    assert [float(row["grad_norm/total"]) for row in rows if row["grad_norm/total"]] == [1000.0 + s for s in range(6)]
    told = [str(w.message) for w in said if "a key the suite logs too" in str(w.message)]
    assert told == [
        "the module logs 'grad_norm/total' at step 0, a key the suite logs too: the loggers keep the module's value "
        "and the suite's is not logged; log yours under another name to see both"
    ]


def test_a_journal_that_cannot_be_written_is_said_once_and_the_fit_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Its path is a directory here (a full disk or a read-only mount fails the same way): the first event's write
    raised ``IsADirectoryError`` out of the step it was about, where the fit without the suite finishes."""
    import logging

    (tmp_path / JOURNAL_NAME).mkdir()
    model = TinyRegressor()
    with caplog.at_level(logging.INFO, logger="lightning_overflow"):
        trainer = make_trainer([*default_callbacks(), FaultInjector(Fault(3, "nan_loss"), Fault(5, "nan_loss"))],
                               max_steps=8, default_root_dir=str(tmp_path))  # fmt: skip
        trainer.fit(model)
    assert trainer.global_step == 8
    assert [e.kind for e in board_for(trainer).journal.events][:2] == ["nonfinite", "skip"]
    said = [r.getMessage() for r in caplog.records if "journal could not be written" in r.getMessage()]
    summary = [r.getMessage() for r in caplog.records if "what happened in this fit" in r.getMessage()]
    assert summary and all("the details:" not in line for line in summary)  # no pointer to a journal not written
    assert len(said) == 1 and said[0].startswith(
        f"lightning_overflow: the journal could not be written to {tmp_path / JOURNAL_NAME} ([Errno 21] Is a directory"
    )
