"""The dashboard: one picture of one or more runs from their logged metrics and event journals.

Reads ``metrics.csv`` (CSVLogger) or TensorBoard event files (with the ``tensorboard`` package) and
``overflow_events.jsonl``. Run it as ``python -m lightning_overflow report RUN_DIR [RUN_DIR ...]``; needs
matplotlib (``pip install lightning-overflow[plot]``).

Example:
    >>> from lightning_overflow.report import choose_loss_key
    >>> choose_loss_key(["train/loss", "overflow/headroom_decades/loss"])
    'train/loss'
"""

from lightning_overflow.report.cadence import logging_interval, sparse_logging_warning
from lightning_overflow.report.figure import draw, render
from lightning_overflow.report.keys import choose_loss_key, choose_val_key, is_suite_key
from lightning_overflow.report.markers import EVENT_MARKERS, Marker, MarkerSpec, event_markers
from lightning_overflow.report.outcome import Outcome, run_outcome
from lightning_overflow.report.runs import ReportError, Run, default_labels, load_run
from lightning_overflow.report.summary import summarise

__all__ = [
    "EVENT_MARKERS",
    "Marker",
    "MarkerSpec",
    "Outcome",
    "ReportError",
    "Run",
    "choose_loss_key",
    "choose_val_key",
    "default_labels",
    "draw",
    "event_markers",
    "is_suite_key",
    "load_run",
    "logging_interval",
    "render",
    "run_outcome",
    "sparse_logging_warning",
    "summarise",
]
