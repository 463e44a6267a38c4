"""The dashboard figure: the runs overlaid panel by panel, every journal event as its own marker.

Top to bottom: the training (and validation) loss of every run on one axis; one lane per run with its events and
how it ended; gradient norm with the clip threshold and the LR scale; cumulative skipped steps and the headroom
to the FP32 limit. A panel none of the runs logged a series for is left out (a plain run draws its loss and its
lane). Needs matplotlib (``pip install lightning-overflow[plot]``); no pyplot state is touched.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_overflow.report.keys import HEADROOM_PARTS
from lightning_overflow.report.markers import (
    EVENT_MARKERS,
    OTHER_MARKER,
    RUN_COLOURS,
    Marker,
    MarkerSpec,
    event_markers,
)
from lightning_overflow.report.outcome import Outcome, run_outcome
from lightning_overflow.report.runs import Run, Series

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["NONFINITE_LABEL", "PANEL_LABELS", "draw", "render"]

NONFINITE_LABEL = "inf/NaN value (drawn on the top edge)"
PANEL_LABELS = ("loss", "events", "gradient norm", "LR scale", "skipped steps", "headroom")
# The runs' series (``Run.panels``) each panel draws: a panel none of the runs has a point for is left out.
_PANEL_SERIES = {
    "loss": ("loss", "validation loss"),
    "gradient norm": ("gradient norm", "clip threshold"),
    "LR scale": ("LR scale",),
    "skipped steps": ("skipped steps",),
    "headroom": ("headroom", *(f"headroom ({part})" for part in HEADROOM_PARTS)),
}
# Heights in units of 1.3 inches (plus 1.2 inches of title and legend): the loss over the event lanes over rows of
# two panels.
_LOSS_HEIGHT, _ROW_HEIGHT, _INCHES_PER_UNIT, _MARGIN_INCHES = 3.2, 1.8, 1.3, 1.2
_HEADROOM_STYLES = {"loss": ":", "grad": "--", "activation": "-."}
_STOPPED = "tab:red"


@dataclass(frozen=True)
class _Look:
    """How one run is drawn."""

    run: Run
    colour: str
    width: float
    markers: list[Marker]
    outcome: Outcome


def draw(runs: Sequence[Run], title: str | None = None) -> Figure:
    """The dashboard of ``runs`` as a matplotlib ``Figure``, 13 inches wide and as tall as its panels.

    Each panel's axes carries its name as its label (:data:`PANEL_LABELS`, ``ax.get_label()``). The event lanes are
    always drawn; another panel only when some run logged a series for it.

    Args:
        runs: the runs, overlaid in every panel in this order (colours in
            :data:`~lightning_overflow.report.markers.RUN_COLOURS`).
        title: the figure's title (default: the runs' labels joined by "vs").

    Raises:
        ValueError: ``runs`` is empty.
    """
    if not runs:
        raise ValueError("'runs' must hold at least one run (got none)")
    last_of_all = max(run.last_step for run in runs)
    looks = [
        _Look(run, RUN_COLOURS[i % len(RUN_COLOURS)], _width(i, len(runs)), event_markers(run.events),
              run_outcome(run, last_of_all))
        for i, run in enumerate(runs)
    ]
    shown = [name for name in PANEL_LABELS
             if name == "events" or any(run.panel(series) for run in runs for series in _PANEL_SERIES[name])]
    fig, axes = _layout(shown, len(runs))
    drawers = {"loss": _loss_panel, "events": _lanes_panel, "gradient norm": _grad_panel, "LR scale": _lr_panel,
               "skipped steps": _skipped_panel, "headroom": _headroom_panel}
    for name, ax in axes.items():
        drawers[name](ax, looks)
    first = next(iter(axes.values()))  # every other panel shares its step axis
    first.set_xlim(-0.01 * max(last_of_all, 1), max(last_of_all, 1) * 1.01)
    first.xaxis.get_major_locator().set_params(integer=True)
    handles = _event_legend(looks)
    if handles:
        fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 5), fontsize=9,
                   title="events (the same marker in every panel)", title_fontsize=9)
    fig.suptitle(title or " vs ".join(run.label for run in runs), fontsize=13)
    return fig


def _layout(shown: list[str], count: int) -> tuple[Figure, dict[str, Axes]]:
    """The figure and the axes of the ``shown`` panels for ``count`` runs: the loss and the lanes across the whole
    width, the other panels two to a row (a last one alone across the row)."""
    from matplotlib.figure import Figure

    wide = [name for name in ("loss", "events") if name in shown]
    paired = [name for name in shown if name not in wide]
    rows = [[name] for name in wide] + [paired[i : i + 2] for i in range(0, len(paired), 2)]
    lanes_height = 0.5 + 0.6 * count
    heights = [{"loss": _LOSS_HEIGHT, "events": lanes_height}.get(row[0], _ROW_HEIGHT) for row in rows]
    fig = Figure(figsize=(13, _MARGIN_INCHES + _INCHES_PER_UNIT * sum(heights)), layout="constrained")
    grid = fig.add_gridspec(len(rows), 2, height_ratios=heights)
    axes: dict[str, Axes] = {}
    for r, row in enumerate(rows):
        for c, name in enumerate(row):
            where = grid[r, :] if len(row) == 1 else grid[r, c]
            axes[name] = fig.add_subplot(where, sharex=next(iter(axes.values()), None), label=name)
    for name in rows[-1]:
        axes[name].set_xlabel("optimizer step")
    return fig, axes


def render(runs: Sequence[Run], out: str | Path, title: str | None = None) -> Path:
    """Draw the dashboard of ``runs`` (see :func:`draw`) into the file ``out`` at 100 dpi; return its path."""
    out = Path(out)
    draw(runs, title).savefig(out, dpi=100)
    return out


def _width(index: int, count: int) -> float:
    # Earlier runs are drawn wider, so where runs coincide (the same seed before a fault) each stays visible.
    return 1.2 + 2.4 * (count - 1 - index) / max(count - 1, 1)


def _finite(series: Series) -> tuple[list[int], list[float]]:
    points = [(s, v) for s, v in series if math.isfinite(v)]
    return [s for s, _ in points], [v for _, v in points]


def _nonfinite_on_top(ax: Axes, series: Series, colour: str) -> None:
    steps = [s for s, v in series if not math.isfinite(v)]
    if steps:
        ax.plot(steps, [1.0] * len(steps), ls="", marker="o", ms=6, mfc="none", mec=colour, mew=1.5,
                transform=ax.get_xaxis_transform(), clip_on=False, zorder=6)


def _value_at(steps: list[int], values: list[float], step: int, stepwise: bool) -> float:
    """The curve's value at ``step``: interpolated, or for a step curve the last value logged at or before it."""
    if not stepwise:
        import numpy as np

        return float(np.interp(step, steps, values))
    return values[max(bisect.bisect_right(steps, step) - 1, 0)]


def _mark(ax: Axes, series: Series, markers: list[Marker], stepwise: bool = False) -> None:
    """Draw ``markers`` on the curve of ``series`` (on the top edge where the run has no finite value)."""
    steps, values = _finite(series)
    by_kind: dict[str, list[int]] = {}
    for marker in markers:
        by_kind.setdefault(marker.kind, []).append(marker.step)
    for kind, at in by_kind.items():
        style = _marker_style(EVENT_MARKERS.get(kind, OTHER_MARKER))
        if steps:
            ax.plot(at, [_value_at(steps, values, s, stepwise) for s in at], **style)
        else:
            ax.plot(at, [1.0] * len(at), transform=ax.get_xaxis_transform(), clip_on=False, **style)


def _loss_panel(ax: Axes, looks: list[_Look]) -> None:
    finite: list[float] = []
    for look in looks:
        run, colour = look.run, look.colour
        key, series = run.panels["loss"], run.panel("loss")
        if key is not None:  # a run may log a validation loss only
            ax.plot(*_finite(series), color=colour, lw=look.width, label=f"{run.label}: {key}")
            finite += _finite(series)[1]
            _nonfinite_on_top(ax, series, colour)
            _mark(ax, series, look.markers)
            for marker in look.markers:  # the steps a trial ran, shaded in its verdict's colour
                if marker.since is not None:
                    ax.axvspan(marker.since, marker.step, color=marker.spec.colour, alpha=0.08, lw=0)
        val_key, val = run.panels["validation loss"], run.panel("validation loss")
        if val_key is not None:
            ax.plot(*_finite(val), color=colour, lw=1.3, ls="--", marker="o", ms=6,
                    label=f"{run.label}: {val_key} (validation)")
            finite += _finite(val)[1]
            _nonfinite_on_top(ax, val, colour)
    ax.set_title("loss", loc="left", fontsize=10)
    if finite and min(finite) > 0 and max(finite) / min(finite) >= 30:
        ax.set_yscale("log")  # a divergence spans decades; the healthy runs would be a flat line beside it
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize=9)
    ax.grid(alpha=0.3)


def _story(markers: list[Marker]) -> str:
    """``"4 skip, 1 backoff, 2 rollback"``: the journal's own names, short enough for one line."""
    counts = Counter(m.kind for m in markers)
    return ", ".join(f"{n} {kind}" for kind, n in counts.items()) or "no events"


def _marker_style(spec: MarkerSpec) -> dict[str, Any]:
    from matplotlib.lines import Line2D

    # A white edge sets filled markers off the curves; a line-only marker ("x") is all edge, so keeps its colour.
    edge = "white" if spec.marker in Line2D.filled_markers else spec.colour
    return {"ls": "", "marker": spec.marker, "color": spec.colour, "ms": spec.size, "mec": edge, "mew": 0.6,
            "zorder": 7}


def _lanes_panel(ax: Axes, looks: list[_Look]) -> None:
    for lane, look in enumerate(looks):
        run, colour, outcome = look.run, look.colour, look.outcome
        first = min((s[0][0] for s in run.metrics.values() if s), default=0)
        ax.hlines(lane, first, outcome.step, color=colour, lw=7, alpha=0.3)
        ax.plot([outcome.step], [lane], marker="|", ms=22, mew=3, color=colour)
        # One row per kind inside the lane: events of several kinds at the same steps stay apart.
        present = {m.kind for m in look.markers}
        kinds = [k for k in EVENT_MARKERS if k in present] + sorted(present - EVENT_MARKERS.keys())
        gap = min(0.22, 0.6 / max(len(kinds) - 1, 1))
        for row, kind in enumerate(kinds):
            spec = EVENT_MARKERS.get(kind, OTHER_MARKER)
            at = [m.step for m in look.markers if m.kind == kind]
            y = lane + (row - (len(kinds) - 1) / 2) * gap
            ax.plot(at, [y] * len(at), **_marker_style(spec))
        text = ax.text(first, lane - 0.42, f"{outcome.text}  |  {_story(look.markers)}", fontsize=9, va="bottom",
                       color="black" if outcome.kind == "finished" else _STOPPED, clip_on=True)
        text.set_in_layout(False)  # a long sentence is cut at the panel's edge instead of squeezing the figure
    ax.set_ylim(len(looks) - 0.55, -1.0)
    ax.set_yticks(range(len(looks)), [look.run.label for look in looks])
    for label, look in zip(ax.get_yticklabels(), looks):
        label.set_color(look.colour)
    ax.set_title("events and how each run ended", loc="left", fontsize=10)
    ax.grid(axis="x", alpha=0.3)


def _grad_panel(ax: Axes, looks: list[_Look]) -> None:
    clipped = False
    for look in looks:
        series = look.run.panel("gradient norm")
        if _finite(series)[0]:
            ax.plot(*_finite(series), color=look.colour, lw=look.width * 0.8)
        _nonfinite_on_top(ax, series, look.colour)
        _mark(ax, series, look.markers)
        threshold = look.run.panel("clip threshold")
        if _finite(threshold)[0]:
            ax.plot(*_finite(threshold), color=look.colour, lw=1, ls="--", alpha=0.8)
            clipped = True
    ax.set_title("gradient norm" + (" (solid) and clip threshold (dashed)" if clipped else ""), loc="left",
                 fontsize=10)
    if any(line.get_ydata().size and min(line.get_ydata()) > 0 for line in ax.lines):
        ax.set_yscale("log")
    ax.grid(alpha=0.3)


def _step_panel(ax: Axes, looks: list[_Look], panel: str, title: str) -> None:
    for look in looks:
        series = look.run.panel(panel)
        if _finite(series)[0]:
            ax.step(*_finite(series), where="post", color=look.colour, lw=look.width * 0.8)
            _mark(ax, series, look.markers, stepwise=True)
    ax.set_title(title, loc="left", fontsize=10)
    ax.grid(alpha=0.3)


def _lr_panel(ax: Axes, looks: list[_Look]) -> None:
    _step_panel(ax, looks, "LR scale", "LR scale (1 = as configured)")
    ax.set_ylim(0, 1.1)


def _skipped_panel(ax: Axes, looks: list[_Look]) -> None:
    _step_panel(ax, looks, "skipped steps", "skipped steps (cumulative)")
    ax.set_ylim(bottom=0)
    ax.yaxis.get_major_locator().set_params(integer=True)


def _headroom_panel(ax: Axes, looks: list[_Look]) -> None:
    parts_drawn: set[str] = set()
    for look in looks:
        overall = _finite(look.run.panel("headroom"))
        if overall[0]:
            ax.plot(*overall, color=look.colour, lw=look.width * 0.8, marker="o", ms=4)
        for part, style in _HEADROOM_STYLES.items():
            series = _finite(look.run.panel(f"headroom ({part})"))
            if series[0]:
                ax.plot(*series, color=look.colour, lw=0.9, ls=style, marker=".", alpha=0.8)
                parts_drawn.add(part)
    ax.set_title("headroom: decades below the FP32 limit of 3.4e38 (0 = overflow)", loc="left", fontsize=10)
    ax.set_ylim(bottom=0)
    if parts_drawn:
        from matplotlib.lines import Line2D

        handles = [Line2D([], [], color="dimgray", marker="o", ms=4, label="smallest")]
        handles += [Line2D([], [], color="dimgray", ls=style, label=part)
                    for part, style in _HEADROOM_STYLES.items() if part in parts_drawn]
        ax.legend(handles=handles, loc="lower left", fontsize=8, ncol=len(handles))
    ax.grid(alpha=0.3)


def _event_legend(looks: list[_Look]) -> list[Any]:
    from matplotlib.lines import Line2D

    present = {m.kind for look in looks for m in look.markers}
    specs = [spec for kind, spec in EVENT_MARKERS.items() if kind in present]
    if present - EVENT_MARKERS.keys():
        specs.append(OTHER_MARKER)
    handles: list[Any] = [
        Line2D([], [], ls="", marker=spec.marker, color=spec.colour, ms=spec.size, label=spec.label) for spec in specs
    ]
    series = [look.run.panel(name) for look in looks for name in ("loss", "validation loss", "gradient norm")]
    if any(not math.isfinite(v) for s in series for _, v in s):
        handles.append(Line2D([], [], ls="", marker="o", mfc="none", mec="dimgray", mew=1.5, label=NONFINITE_LABEL))
    return handles
