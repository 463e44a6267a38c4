"""How a run ended, read from its journal and the last step of its metrics."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from lightning_overflow.report.cadence import logging_interval
from lightning_overflow.report.runs import Run

__all__ = ["ABORT_ERRORS", "Outcome", "run_outcome"]

# The error each callback raises after journaling an ``abort``.
ABORT_ERRORS = {"LRBackoff": "DivergenceError", "Rollback": "DivergenceError", "NonFiniteDetector": "NonFiniteError"}

OutcomeKind = Literal["finished", "aborted", "raised", "nonfinite", "ended"]


@dataclass(frozen=True)
class Outcome:
    """The end of a run.

    Attributes:
        kind: ``"finished"`` (as far as any run shown got, loss finite), ``"aborted"`` (a callback journaled an
            ``abort`` and raised), ``"raised"`` (an error stopped the fit: a non-finite step that was not skipped,
            or the error a ``Rollback`` journaled on the way out), ``"nonfinite"`` (the loss was still inf/NaN at
            the end), ``"ended"`` (earlier than the other runs by more than its logging interval, with nothing
            journaled about why).
        step: the last step the run logged or journaled.
        text: a sentence for a person, e.g. ``"stopped at step 143: loss NaN since step 124"``.
    """

    kind: OutcomeKind
    step: int
    text: str


def run_outcome(run: Run, last_of_all: int | None = None) -> Outcome:
    """How ``run`` ended; ``last_of_all`` is the last step of the longest run shown beside it.

    Example:
        >>> from pathlib import Path
        >>> run = Run("a", Path("a"), metrics={"train_loss": [(0, 2.0), (1, float("nan")), (2, float("nan"))]},
        ...           panels={"loss": "train_loss"})
        >>> run_outcome(run).text
        'stopped at step 2: loss NaN since step 1'
    """
    last = run.last_step
    aborts = [e for e in run.events if e["kind"] == "abort"]
    if aborts:
        source = aborts[-1].get("source", "a callback")
        return Outcome("aborted", last, f"stopped at step {last}: {_error_of(aborts[-1])} raised by {source}")
    exits = [e for e in run.events if e["kind"] == "exit_restore" and _details(e).get("error")]
    if exits:
        return Outcome("raised", last, f"stopped at step {last}: {_details(exits[-1])['error']} raised")
    unskipped = _unskipped_nonfinite(run)
    last_metric = max((s[-1][0] for s in run.metrics.values() if s), default=-1)
    if unskipped is not None and int(unskipped["step"]) >= last_metric:
        where = _details(unskipped).get("where", "value")
        return Outcome("raised", last, f"stopped at step {last}: NonFiniteError (non-finite {where}, not skipped)")
    name = "loss" if run.panels.get("loss") else "gradient norm"
    series = run.panel(name)
    tail = _nonfinite_tail(series)
    if tail:
        what = "NaN" if all(math.isnan(v) for _, v in tail) else "inf/NaN"
        return Outcome("nonfinite", last, f"stopped at step {last}: {name} {what} since step {tail[0][0]}")
    # A run's last logged step trails its last step by up to its logging interval (an epoch's end logs one later).
    if last_of_all is not None and last_of_all - last > logging_interval(run):
        return Outcome("ended", last, f"ended at step {last}, before the others (nothing journaled about why)")
    return Outcome("finished", last, f"finished at step {last}")


def _details(event: dict[str, Any]) -> dict[str, Any]:
    details = event.get("details")
    return details if isinstance(details, dict) else {}


def _error_of(abort: dict[str, Any]) -> str:
    details = _details(abort)
    if details.get("error"):
        return str(details["error"])
    source = str(abort.get("source", ""))
    if source == "Rollback" and "rollbacks" not in details:
        return "RollbackError"  # no snapshot verified finite was left to restore
    return ABORT_ERRORS.get(source, "an error")


def _unskipped_nonfinite(run: Run) -> dict[str, Any] | None:
    skipped = {int(e["step"]) for e in run.events if e["kind"] == "skip"}
    found = [e for e in run.events if e["kind"] in ("nonfinite", "data_fault") and int(e["step"]) not in skipped]
    return found[-1] if found else None


def _nonfinite_tail(series: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The non-finite points at the end of ``series``, in step order (empty when its last value is finite)."""
    end = len(series)
    while end > 0 and not math.isfinite(series[end - 1][1]):
        end -= 1
    return series[end:]
