"""How often a run logged its metrics, and a warning when its events fell between the steps it logged.

Lightning logs every ``log_every_n_steps`` (50 by default). An event between two logged steps is drawn at its step,
but the curves show its effect only at the next logged step: an LR cut at step 50 shows at step 99.
"""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

from lightning_overflow.report.markers import event_markers
from lightning_overflow.report.runs import Run, Series

__all__ = ["DRAWN_STEPS", "fitting_interval", "logging_interval", "sparse_logging_warning"]

DRAWN_STEPS = 500
"""Steps the picture tells apart across its width (about 2 pixels each): a coarser logging grid shows."""


def _training_series(run: Run) -> Series:
    """The run's densest per-step curve: its training loss or its gradient norm."""
    return max(run.panel("loss"), run.panel("gradient norm"), key=len)


def logging_interval(run: Run) -> int:
    """The steps between two logged points of ``run``'s training curves (1 when it logged fewer than two).

    The most common gap, so that the start of a fit or a run cut short does not count.

    Example:
        >>> from pathlib import Path
        >>> run = Run("a", Path("a"), metrics={"loss": [(49, 2.0), (99, 1.5), (149, 1.2), (160, 1.1)]},
        ...           panels={"loss": "loss"})
        >>> logging_interval(run)
        50
    """
    series = _training_series(run)
    gaps = Counter(later[0] - earlier[0] for earlier, later in pairwise(series))
    return max(gaps, key=lambda gap: (gaps[gap], -gap)) if gaps else 1


def fitting_interval(steps: int) -> int:
    """The largest ``log_every_n_steps`` whose grid the picture of a ``steps``-step run does not show.

    Example:
        >>> fitting_interval(500), fitting_interval(20_000)
        (1, 40)
    """
    return max(1, steps // DRAWN_STEPS)


def sparse_logging_warning(run: Run, last_of_all: int | None = None) -> str | None:
    """A sentence for a person when ``run`` logged less often than its events happened, else ``None``.

    Args:
        run: a run from :func:`~lightning_overflow.report.runs.load_run`.
        last_of_all: the last step of the longest run drawn beside it (the picture's width; default: ``run``'s).

    Example:
        >>> from pathlib import Path
        >>> run = Run("suite", Path("suite"), metrics={"loss": [(49, 2.0), (99, 1.5), (149, 1.2)]},
        ...           events=[{"step": 57, "kind": "backoff"}], panels={"loss": "loss"})
        >>> print(sparse_logging_warning(run))  # doctest: +NORMALIZE_WHITESPACE
        suite: metrics were logged every 50 steps, but its one event happened at a step that was not logged
        (step 57), so the dashboard draws its effect up to 49 steps late. Log every step with
        Trainer(log_every_n_steps=1).
    """
    interval = logging_interval(run)
    steps = max(run.last_step, last_of_all if last_of_all is not None else -1) + 1
    fit = fitting_interval(steps)
    logged = {step for step, _ in _training_series(run)}
    events = event_markers(run.events)
    between = [marker.step for marker in events if marker.step not in logged]
    if interval <= fit or not between:
        return None
    if len(events) == 1:
        which = "its one event"
    elif len(between) == len(events):
        which = f"its {len(events)} events"
    else:
        which = f"{len(between)} of its {len(events)} events"
    if len(between) == 1:
        where, whose = f"at a step that was not logged (step {between[0]})", "its"
    else:
        where, whose = f"at steps that were not logged (the first at step {min(between)})", "their"
    fix = "Log every step with Trainer(log_every_n_steps=1)"
    if fit > 1:
        fix += f", or at least every {fit} steps for a run of {steps} steps: Trainer(log_every_n_steps={fit})"
    return (
        f"{run.label}: metrics were logged every {interval} steps, but {which} happened {where}, so the dashboard "
        f"draws {whose} effect up to {interval - 1} steps late. {fix}."
    )
