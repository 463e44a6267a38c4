"""Where each fit's journal lives, and what the loggers show of it.

The one module that knows logger types. It tells them apart by class name (a subclass counts as its base), so no
tracking package is imported unless the user installed it, and both namespaces (``lightning.pytorch``,
``pytorch_lightning``) are served alike. The journal goes next to the first logger's metrics, the logger that
Lightning's own ``trainer.log_dir`` consults:

======================================  =================================================================
first logger                            journal (``overflow_events.jsonl``)
======================================  =================================================================
``CSVLogger``, ``TensorBoardLogger``    ``<log_dir>/``: the version folder
``MLFlowLogger``, file store            ``<save_dir>/<experiment_id>/<run_id>/``: the run's folder
``MLFlowLogger``, any other store       ``<default_root_dir>/overflow_journal/<run_id>/`` (sqlite, a server)
``WandbLogger``                         ``<save_dir>/wandb/<run>/files/``: the run's files (``experiment.dir``)
any other logger                        ``<save_dir>/``, or in memory only when it has none
no logger                               ``<default_root_dir>/``: one file, fits told apart by ``run``
======================================  =================================================================

Every line of the journal carries the fit's ``run`` id: the tracker's own (MLflow's run id, W&B's run id) where the
first logger is one, otherwise a fresh 12-digit hex id. At the end of a fit and on a fatal error the journal is
uploaded to every logger that keeps artifacts (MLflow: ``log_artifact``; W&B: ``save``). TensorBoard gets a
custom-scalars layout once per fit and the events as text summaries (``overflow/events``) at their steps.
"""

from __future__ import annotations

import re
import uuid
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_overflow import _compat
from lightning_overflow.events import JOURNAL_NAME, Event, Journal
from lightning_overflow.exceptions import OverflowWarning

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = [
    "EVENTS_TAG",
    "JOURNAL_FOLDER",
    "TENSORBOARD_LAYOUT",
    "StepMerge",
    "journal_location",
    "kind_of",
    "prepare_dashboards",
    "publish_events",
    "upload_journal",
]

JOURNAL_FOLDER = "overflow_journal"  # under default_root_dir, for trackers that keep no local run folder
EVENTS_TAG = "overflow/events"

_KINDS = ("CSVLogger", "TensorBoardLogger", "MLFlowLogger", "WandbLogger")


class StepMerge:
    """The suite's metrics of a step that Lightning logs, sent in Lightning's own ``log_metrics`` call of that step:
    one ``metrics.csv`` row, one history entry per step, whatever the logger.

    The suite queues its step's metrics at ``on_train_batch_end``; Lightning logs the batch just after, with the same
    step. For the fit, each logger's ``log_metrics`` is wrapped (an attribute of the instance over its class's
    method, removed by :meth:`uninstall`) so that Lightning's call of that step carries the held metrics too. A held
    step that Lightning did not log after all (a callback after the suite asked to stop) is sent on its own by
    :meth:`send_leftover`, at the next batch or the end of the fit.
    """

    def __init__(self) -> None:
        self._held: tuple[int, dict[str, float]] | None = None
        self._served: set[int] = set()  # ids of the loggers whose call of the held step carried it
        self._wrapped: list[Any] = []
        self._previous: dict[int, Any] = {}  # what each logger instance held as log_metrics before (None: nothing)
        self._told: set[str] = set()  # keys the module logs that the suite logs too, said once a fit

    def hold(self, loggers: Sequence[Any], step: int, metrics: dict[str, float]) -> None:
        """Keep ``metrics`` for Lightning's call of ``step`` on every logger."""
        self.install(loggers)
        if self._held is not None and self._held[0] != step:
            self.send_leftover()
        if self._held is None:
            self._held = (step, {})
        self._held[1].update(metrics)

    def install(self, loggers: Sequence[Any]) -> None:
        for logger in loggers:
            if any(logger is wrapped for wrapped in self._wrapped):
                continue
            merged = _MergedLogMetrics(self, logger, logger.log_metrics)
            self._previous[id(logger)] = _compat.replace_method(logger, "log_metrics", merged)
            self._wrapped.append(logger)

    def merge(self, logger: Any, metrics: dict[str, Any], step: int | None) -> dict[str, Any]:
        """``metrics`` of Lightning's call of ``step`` on ``logger``, with the held step's metrics when they are
        this logger's to carry."""
        held = self._held
        if held is None or step != held[0] or id(logger) in self._served:
            return metrics
        self._served.add(id(logger))
        if len(self._served) == len(self._wrapped):
            self._held, self._served = None, set()
        shared = sorted(key for key in held[1] if key in metrics and key not in self._told)
        if shared:  # the module logs a key of the suite's own: the loggers keep the module's value
            self._told.update(shared)
            warnings.warn(
                f"the module logs {', '.join(map(repr, shared))} at step {step}, a key the suite logs too: the loggers "
                "keep the module's value and the suite's is not logged; log yours under another name to see both",
                OverflowWarning, stacklevel=2,
            )  # fmt: skip
        return {**held[1], **metrics}

    def send_leftover(self) -> None:
        """Send a held step to the loggers whose call of it did not come, one call each."""
        held, self._held = self._held, None
        served, self._served = self._served, set()
        if held is None:
            return
        for logger in self._wrapped:
            if id(logger) not in served:
                vars(logger)["log_metrics"].__wrapped__(held[1], held[0])

    def uninstall(self) -> None:
        """Send what is held and give every logger its own ``log_metrics`` back."""
        self.send_leftover()
        for logger in self._wrapped:
            if isinstance(vars(logger).get("log_metrics"), _MergedLogMetrics):
                _compat.restore_method(logger, "log_metrics", self._previous.get(id(logger)))
        self._wrapped, self._previous, self._told = [], {}, set()


class _MergedLogMetrics:
    """A logger's ``log_metrics`` for the fit: Lightning's call, joined by the suite's held metrics of that step.

    Pickled or copied with its logger (a logger is a value users copy), it is the logger's own ``log_metrics``
    again: the copy shares nothing with the fit in progress.
    """

    __slots__ = ("__wrapped__", "_logger", "_merge")

    def __init__(self, merge: StepMerge, logger: Any, original: Any) -> None:
        self._merge, self._logger, self.__wrapped__ = merge, logger, original

    def __call__(self, metrics: dict[str, Any], step: int | None = None) -> Any:
        return self.__wrapped__(self._merge.merge(self._logger, metrics, step), step)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _own_log_metrics, (self._logger,)


def _own_log_metrics(logger: Any) -> Any:
    """The logger's class's ``log_metrics``, bound to it."""
    return type(logger).log_metrics.__get__(logger)


def _tags(*keys: str) -> list[str]:
    """TensorBoard matches a chart's tags as regexes from the tag's start: allow a logger ``prefix`` ("pre-")
    before the key and the ``_opt<i>`` suffix of models with several optimizers after it."""
    return [rf"(.*-)?{re.escape(key)}(_opt\d+)?$" for key in keys]


TENSORBOARD_LAYOUT: dict[str, dict[str, list[Any]]] = {
    "lightning_overflow": {
        "gradient norm and clip threshold": ["Multiline", _tags("grad_norm/total", "clip/threshold")],
        "skips, detections, spikes, rollbacks": [
            "Multiline",
            _tags("overflow/skipped_steps", "overflow/nonfinite_events", "overflow/spikes", "overflow/rollbacks"),
        ],
        "LR scale": ["Multiline", _tags("overflow/lr_scale")],
        "headroom (decades to the FP32 limit)": ["Multiline", [r"(.*-)?overflow/headroom(_[a-z]+)?_decades$"]],
    }
}
"""The custom-scalars layout written to every ``TensorBoardLogger`` once per fit (category -> chart -> tags)."""


def kind_of(logger: Any) -> str | None:
    """The logger type the suite knows ``logger`` as: ``"CSVLogger"``, ``"TensorBoardLogger"``, ``"MLFlowLogger"`` or
    ``"WandbLogger"`` (a subclass counts as its base), else ``None``.

    Example:
        >>> from pytorch_lightning.loggers import CSVLogger
        >>> class MyLogger(CSVLogger): ...
        >>> kind_of(MyLogger("/tmp/logs")), kind_of(object())
        ('CSVLogger', None)
    """
    names = {cls.__name__ for cls in type(logger).__mro__}
    return next((kind for kind in _KINDS if kind in names), None)


def journal_location(trainer: pl.Trainer) -> tuple[Path | None, str]:
    """This fit's journal file (``None``: kept in memory) and its ``run`` id.

    Every rank calls it together, in ``setup``: rank 0 asks the loggers (only its loggers hold the run: the others
    see a stand-in experiment), and one broadcast tells the other ranks.

    Example:
        >>> from pytorch_lightning import Trainer
        >>> path, run = journal_location(Trainer(logger=False, default_root_dir="/tmp/fit"))
        >>> str(path), len(run)
        ('/tmp/fit/overflow_events.jsonl', 12)
    """
    found = _locate(trainer) if trainer.global_rank == 0 else None
    folder, run = trainer.strategy.broadcast(found)
    return (None if folder is None else Path(folder) / JOURNAL_NAME), run


def _locate(trainer: pl.Trainer) -> tuple[str | None, str]:
    if not trainer.loggers:
        return str(trainer.default_root_dir), _fresh_id()
    logger = trainer.loggers[0]
    kind = kind_of(logger)
    if kind in ("CSVLogger", "TensorBoardLogger"):
        return str(logger.log_dir), _fresh_id()
    if kind == "MLFlowLogger":
        run_id = str(logger.run_id)
        if logger.save_dir is not None:  # a file store: <root>/<experiment_id>/<run_id>/ is the run's own folder
            return str(Path(logger.save_dir) / str(logger.experiment_id) / run_id), run_id
        return str(Path(trainer.default_root_dir) / JOURNAL_FOLDER / run_id), run_id
    if kind == "WandbLogger":
        run = logger.experiment
        return str(run.dir), str(run.id)
    save_dir = logger.save_dir
    return (None if save_dir is None else str(save_dir)), _fresh_id()


def _fresh_id() -> str:
    return uuid.uuid4().hex[:12]


def prepare_dashboards(trainer: pl.Trainer) -> None:
    """Write the custom-scalars layout (:data:`TENSORBOARD_LAYOUT`) to every ``TensorBoardLogger``; rank 0, once per
    fit."""
    if trainer.global_rank != 0:
        return
    for logger in trainer.loggers:
        if kind_of(logger) == "TensorBoardLogger":
            logger.experiment.add_custom_scalars(TENSORBOARD_LAYOUT)


def publish_events(trainer: pl.Trainer, events: Sequence[Event]) -> None:
    """Show ``events`` as text summaries (:data:`EVENTS_TAG`) in every ``TensorBoardLogger``; rank 0.

    Args:
        trainer: the fit's trainer.
        events: the events recorded since the last call; those of one step become one entry (a Markdown list) at
            that step. Empty on most steps: then nothing is asked of the loggers.
    """
    if not events or trainer.global_rank != 0:
        return
    writers = [logger.experiment for logger in trainer.loggers if kind_of(logger) == "TensorBoardLogger"]
    if not writers:
        return
    by_step: dict[int, list[str]] = {}
    for event in events:
        by_step.setdefault(event.step, []).append(f"- **{event.kind}**: {event.message}")
    for writer in writers:
        for step, lines in sorted(by_step.items()):
            writer.add_text(EVENTS_TAG, "\n".join(lines), global_step=step)


def upload_journal(trainer: pl.Trainer, journal: Journal) -> None:
    """Upload the journal file as an artifact of every logger that keeps them (MLflow, W&B); rank 0.

    Args:
        trainer: the fit's trainer (its loggers receive the file).
        journal: the fit's journal. Every suite callback calls this at the end of a fit and on a fatal error: the
            file is uploaded again only when events were recorded since the last upload (a callback that records
            one on its way out), and not at all when it does not exist (nothing happened).

    A tracker that refuses the file gives an :class:`~lightning_overflow.OverflowWarning` naming it and the error;
    the fit's own outcome stands.
    """
    path = journal.path
    if trainer.global_rank != 0 or path is None or not journal.write or journal.uploaded == len(journal.events):
        return
    if not path.is_file():
        return
    journal.uploaded = len(journal.events)
    for logger in trainer.loggers:
        kind = kind_of(logger)
        try:
            if kind == "MLFlowLogger":
                logger.experiment.log_artifact(logger.run_id, str(path))
            elif kind == "WandbLogger":
                logger.experiment.save(str(path), base_path=str(path.parent), policy="now")
        except Exception as err:  # a tracker that is down must not turn a finished (or failing) fit into another error
            warnings.warn(
                f"could not upload the journal {path} to {type(logger).__name__}: {type(err).__name__}: {err}",
                OverflowWarning,
                stacklevel=2,
            )
