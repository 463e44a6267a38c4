"""A run as the dashboard sees it: its metric series (CSV or TensorBoard), its journal, and the key of each panel."""

from __future__ import annotations

import csv
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_overflow.events import JOURNAL_NAME, read_journal
from lightning_overflow.report.keys import (
    CLIP_KEY,
    GRAD_NORM_KEY,
    HEADROOM_KEY,
    HEADROOM_PARTS,
    LR_SCALE_KEY,
    SKIPPED_KEY,
    SUITE_PREFIXES,
    choose_loss_key,
    choose_val_key,
    headroom_part_key,
)

__all__ = ["INSTALL_PLOT", "PANEL_NAMES", "ReportError", "Run", "Series", "default_labels", "load_run"]

Series = list[tuple[int, float]]

PANEL_NAMES = (
    "loss", "validation loss", "gradient norm", "clip threshold", "LR scale", "skipped steps", "headroom",
    *(f"headroom ({part})" for part in HEADROOM_PARTS),
)  # fmt: skip
TENSORBOARD_GLOB = "events.out.tfevents.*"
INSTALL_PLOT = 'pip install "lightning-overflow[plot]"'  # matplotlib and tensorboard: all that `report` needs
_VERSION_DIR = re.compile(r"version_\d+")


class ReportError(Exception):
    """A run directory that cannot be reported on; the message says why and what to do."""


@dataclass
class Run:
    """What a run logged.

    Attributes:
        label: the run's name in the picture and the summary.
        path: the run directory given.
        source: the metrics file read (``metrics.csv`` or the TensorBoard event file's folder).
        metrics: series by key, ``[(step, value), ...]`` in step order, one value per step (the last logged).
        events: the journal's events, in journal order (empty without a journal).
        panels: the key each panel draws (``PANEL_NAMES``), ``None`` where the run logged none.
    """

    label: str
    path: Path
    source: Path | None = None
    metrics: dict[str, Series] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    panels: dict[str, str | None] = field(default_factory=dict)

    def panel(self, name: str) -> Series:
        """The series the panel ``name`` draws (empty where none was logged)."""
        key = self.panels.get(name)
        return self.metrics.get(key, []) if key is not None else []

    @property
    def folder(self) -> Path:
        """The folder of the run read: the one holding its metrics (``path`` or a folder below it)."""
        if self.source is None:
            return self.path
        return self.source.parent if self.source.is_file() else self.source

    @property
    def last_step(self) -> int:
        """The last step anything was logged or journaled at (-1 for nothing)."""
        steps = [s[-1][0] for s in self.metrics.values() if s] + [int(e["step"]) for e in self.events]
        return max(steps, default=-1)


def load_run(path: str | Path, label: str | None = None, loss_key: str | None = None,
             val_key: str | None = None) -> Run:
    """Read a run directory: a logger's folder for one run (``lightning_logs/version_0``) or any folder above one.

    Args:
        path: the directory; the newest ``metrics.csv`` below it is read, else its TensorBoard event files.
        label: the run's name (default: its folder's, see :func:`default_labels`).
        loss_key: the training loss to draw (default: chosen by
            :func:`~lightning_overflow.report.keys.choose_loss_key`).
        val_key: the validation loss to draw (default: chosen by
            :func:`~lightning_overflow.report.keys.choose_val_key`).

    Raises:
        ReportError: the path is missing or a file, holds no metrics that can be read, none of the suite's
            metrics, or not the ``loss_key`` / ``val_key`` asked for.
    """
    root = Path(path)
    if not root.exists():
        raise ReportError(f"run directory '{root}' does not exist")
    if not root.is_dir():
        raise ReportError(
            f"'{root}' is a file, not a run directory: a run directory is the folder a logger wrote for one run "
            f"(e.g. lightning_logs/version_0), holding its metrics.csv or TensorBoard event files"
        )
    run = Run(label or "", root)
    csv_files = sorted(root.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime)
    if csv_files:
        run.source, run.metrics = csv_files[-1], _read_csv(csv_files[-1])
    else:
        run.source, run.metrics = _read_tensorboard(root)
    if run.source is None:
        raise ReportError(
            f"run directory '{root}' holds no metrics.csv and no TensorBoard event file ({TENSORBOARD_GLOB}): point "
            "at the folder a CSVLogger or TensorBoardLogger wrote (e.g. lightning_logs/version_0); W&B and MLflow "
            "keep their metrics in their own stores, so add one of those loggers beside them"
        )
    if not run.metrics:
        raise ReportError(f"'{run.source}' holds no metric values (the run logged nothing yet)")
    ours = any(key.startswith(SUITE_PREFIXES) for key in run.metrics)
    keys = run.metrics.keys()
    if not ours and loss_key is None and val_key is None and choose_loss_key(keys) is choose_val_key(keys) is None:
        # A run without the suite (a baseline) is drawn from its own loss; one without any loss draws nothing.
        raise ReportError(
            f"run directory '{root}' has metrics but no training loss and none of lightning_overflow's "
            f"(keys found: {', '.join(sorted(run.metrics))}): pass --loss-key KEY, or add GradNormMonitor (and the "
            "other callbacks) to the Trainer's callbacks"
        )
    journals = sorted(root.rglob(JOURNAL_NAME), key=lambda p: p.stat().st_mtime)
    if journals:
        run.events = list(read_journal(journals[-1]))
    run.panels = _panels(run, loss_key, val_key)
    run.label = label or default_labels([run.folder])[0]
    return run


def _panels(run: Run, loss_key: str | None, val_key: str | None) -> dict[str, str | None]:
    keys = run.metrics.keys()
    for name, asked in (("loss", loss_key), ("validation loss", val_key)):
        if asked is not None and asked not in keys:
            raise ReportError(
                f"the {name} key {asked!r} was not logged in '{run.path}' (keys found: {', '.join(sorted(keys))})"
            )
    panels: dict[str, str | None] = {
        "loss": loss_key or choose_loss_key(keys),
        "validation loss": val_key or choose_val_key(keys),
        "gradient norm": GRAD_NORM_KEY,
        "clip threshold": CLIP_KEY,
        "LR scale": LR_SCALE_KEY,
        "skipped steps": SKIPPED_KEY,
        "headroom": HEADROOM_KEY,
        **{f"headroom ({part})": headroom_part_key(keys, part) for part in HEADROOM_PARTS},
    }
    return {name: key if key in keys else None for name, key in panels.items()}


def default_labels(paths: Sequence[str | Path]) -> list[str]:
    """Names for runs: each folder's name, with its experiment's for a ``version_N`` folder; lengthened until unique.

    Example:
        >>> default_labels(["logs/protected/version_0", "lightning_logs/version_3", "overflow_demo/protected"])
        ['protected/version_0', 'lightning_logs/version_3', 'protected']
        >>> default_labels(["a/run", "b/run", "c/other"])
        ['a/run', 'b/run', 'other']
    """
    parts = [list(Path(path).resolve().parts[1:]) or ["/"] for path in paths]
    # A version folder alone (version_0) names nothing: keep the experiment above it (protected/version_0).
    depth = [2 if len(names) > 1 and _VERSION_DIR.fullmatch(names[-1]) else 1 for names in parts]
    while True:
        labels = ["/".join(names[-d:]) for names, d in zip(parts, depth)]
        clashing = [i for i, label in enumerate(labels) if labels.count(label) > 1 and depth[i] < len(parts[i])]
        if not clashing:
            return labels
        for i in clashing:
            depth[i] += 1


def _put(metrics: dict[str, dict[int, float]], key: str, step: int, value: float) -> None:
    metrics.setdefault(key, {})[step] = value  # the last value logged at a step wins


def _sorted(metrics: dict[str, dict[int, float]]) -> dict[str, Series]:
    return {key: sorted(by_step.items()) for key, by_step in metrics.items()}


def _read_csv(path: Path) -> dict[str, Series]:
    metrics: dict[str, dict[int, float]] = {}
    with open(path, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            try:
                step = int(float(row.get("step") or 0))
            except ValueError:
                continue
            for key, value in row.items():
                if key in (None, "step", "epoch") or value in (None, ""):
                    continue
                try:
                    number = float(value)
                except ValueError:
                    continue
                _put(metrics, key, step, number)
    return _sorted(metrics)


def _read_tensorboard(root: Path) -> tuple[Path | None, dict[str, Series]]:
    files = sorted(root.rglob(TENSORBOARD_GLOB), key=lambda p: p.stat().st_mtime)
    if not files:
        return None, {}
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as err:  # also a tensorboard that is there but cannot be imported (its protobuf, say)
        raise ReportError(
            f"'{root}' holds TensorBoard event files ({TENSORBOARD_GLOB}), and reading them needs the 'tensorboard' "
            f"package, which cannot be imported ({err}): {INSTALL_PLOT}"
        ) from err
    # A writer's add_hparams puts its own event file in a folder below the run's (tensorboardX, torch's SummaryWriter):
    # the run is the newest folder of event files that is not inside another.
    folders = {f.parent for f in files}
    folder = next(f.parent for f in reversed(files) if not any(up in folders for up in f.parent.parents))
    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    accumulator.Reload()
    metrics: dict[str, dict[int, float]] = {}
    for tag in accumulator.Tags()["scalars"]:
        for scalar in accumulator.Scalars(tag):
            _put(metrics, tag, int(scalar.step), float(scalar.value))
    return folder, _sorted(metrics)

