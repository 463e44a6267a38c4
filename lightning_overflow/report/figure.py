"""The dashboard figure: the runs overlaid panel by panel, every journal event as its own marker.

Top to bottom: the training (and validation) loss of every run on one axis; one lane per run with its events and
how it ended; gradient norm with the clip threshold and the LR scale; cumulative skipped steps and the headroom
to the FP32 limit. Needs matplotlib (``pip install lightning-overflow[plot]``); no pyplot state is touched.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_overflow.report.markers import EVENT_MARKERS, OTHER_MARKER, RUN_COLOURS, Marker, event_markers
from lightning_overflow.report.outcome import Outcome, run_outcome
from lightning_overflow.report.runs import Run, Series

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["NONFINITE_LABEL", "draw", "render"]

NONFINITE_LABEL = "inf/NaN value (drawn on the top edge)"
_HEADROOM_STYLES = {"loss": ":", "grad": "--", "activation": "-."}
_STOPPED = "tab:red"


def draw(runs: Sequence[Run], title: str | None = None) -> Figure:
    """The dashboard of ``runs`` as a matplotlib ``Figure`` (13 x 11.5 inches).

    Args:
        runs: the runs, overlaid in every panel in this order (colours in
            :data:`~lightning_overflow.report.markers.RUN_COLOURS`).
        title: the figure's title (default: the runs' labels).
    """
    from matplotlib.figure import Figure

    if not runs:
        raise ValueError("'runs' must hold at least one run (got none)")
    last_of_all = max(run.last_step for run in runs)
    outcomes = [run_outcome(run, last_of_all) for run in runs]
    markers = [event_markers(run.events) for run in runs]
    colours = [RUN_COLOURS[i % len(RUN_COLOURS)] for i in range(len(runs))]
    fig = Figure(figsize=(13, 11.5), layout="constrained")
    grid = fig.add_gridspec(4, 2, height_ratios=[3.2, 0.5 + 0.45 * len(runs), 1.8, 1.8])
    loss = fig.add_subplot(grid[0, :])
    lanes = fig.add_subplot(grid[1, :], sharex=loss)
    grad, lr = fig.add_subplot(grid[2, 0], sharex=loss), fig.add_subplot(grid[2, 1], sharex=loss)
    skipped, headroom = fig.add_subplot(grid[3, 0], sharex=loss), fig.add_subplot(grid[3, 1], sharex=loss)
    for ax, name in ((loss, "loss"), (lanes, "events"), (grad, "gradient norm"), (lr, "LR scale"),
                     (skipped, "skipped steps"), (headroom, "headroom")):
        ax.set_label(name)  # so that a reader of the figure finds each panel by name
    _loss_panel(loss, runs, colours, markers)
    _lanes_panel(lanes, runs, colours, markers, outcomes)
    _grad_panel(grad, runs, colours, markers)
    _line_panel(lr, runs, colours, markers, "LR scale", "LR scale (1 = as configured)",
                "not logged: no LRBackoff in these runs")
    _line_panel(skipped, runs, colours, markers, "skipped steps", "skipped steps (cumulative)",
                "not logged: no NonFiniteDetector in these runs")
    _headroom_panel(headroom, runs, colours)
    lr.set_ylim(0, 1.1)
    skipped.set_ylim(bottom=0)
    skipped.yaxis.get_major_locator().set_params(integer=True)
    loss.set_xlim(-0.01 * max(last_of_all, 1), max(last_of_all, 1) * 1.01)
    loss.xaxis.get_major_locator().set_params(integer=True)
    for ax in (skipped, headroom):
        ax.set_xlabel("optimizer step")
    handles = _event_legend(markers, runs)
    if handles:
        fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 5), fontsize=9,
                   title="events (the same marker in every panel)", title_fontsize=9)
    fig.suptitle(title or " vs ".join(run.label for run in runs), fontsize=13)
    return fig


def render(runs: Sequence[Run], out: str | Path, title: str | None = None) -> Path:
    """Draw the dashboard of ``runs`` (see :func:`draw`) into the file ``out`` at 100 dpi; return its path."""
    out = Path(out)
    draw(runs, title).savefig(out, dpi=100)
    return out


def _finite(series: Series) -> tuple[list[int], list[float]]:
    points = [(s, v) for s, v in series if math.isfinite(v)]
    return [s for s, _ in points], [v for _, v in points]


def _nonfinite_on_top(ax: Axes, series: Series, colour: str) -> None:
    steps = [s for s, v in series if not math.isfinite(v)]
    if steps:
        ax.plot(steps, [1.0] * len(steps), ls="", marker="o", ms=6, mfc="none", mec=colour, mew=1.5,
                transform=ax.get_xaxis_transform(), clip_on=False, zorder=6)


def _mark(ax: Axes, series: Series, markers: list[Marker]) -> None:
    """Draw ``markers`` on the curve of ``series`` (on the top edge where the run has no finite value)."""
    import numpy as np

    steps, values = _finite(series)
    by_kind: dict[str, list[int]] = {}
    for marker in markers:
        by_kind.setdefault(marker.kind, []).append(marker.step)
    for kind, at in by_kind.items():
        spec = EVENT_MARKERS.get(kind, OTHER_MARKER)
        style: dict[str, Any] = {"ls": "", "marker": spec.marker, "color": spec.colour, "ms": spec.size,
                                 "mec": "white", "mew": 0.6, "zorder": 7}
        if steps:
            ax.plot(at, np.interp(at, steps, values), **style)
        else:
            ax.plot(at, [1.0] * len(at), transform=ax.get_xaxis_transform(), clip_on=False, **style)


def _note(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="dimgray", fontsize=9)


def _loss_panel(ax: Axes, runs: Sequence[Run], colours: list[str], markers: list[list[Marker]]) -> None:
    finite: list[float] = []
    for run, colour, marks in zip(runs, colours, markers):
        key, series = run.panels["loss"], run.panel("loss")
        if key is None:
            continue
        ax.plot(*_finite(series), color=colour, lw=1.3, label=f"{run.label}: {key}")
        finite += _finite(series)[1]
        _nonfinite_on_top(ax, series, colour)
        _mark(ax, series, marks)
        val_key, val = run.panels["validation loss"], run.panel("validation loss")
        if val_key is not None and _finite(val)[0]:
            ax.plot(*_finite(val), color=colour, lw=1.3, ls="--", marker="o", ms=5,
                    label=f"{run.label}: {val_key} (validation)")
            finite += _finite(val)[1]
            _nonfinite_on_top(ax, val, colour)
    ax.set_title("loss", loc="left", fontsize=10)
    if not ax.lines:
        _note(ax, "no training loss chosen in any run: pass --loss-key KEY (the summary lists the keys found)")
        return
    if finite and min(finite) > 0 and max(finite) / min(finite) >= 30:
        ax.set_yscale("log")  # a divergence spans decades; a healthy run's loss would be a flat line beside it
    ax.legend(loc="upper right", fontsize=9)
    ax.grid(alpha=0.3)


def _lanes_panel(ax: Axes, runs: Sequence[Run], colours: list[str], markers: list[list[Marker]],
                 outcomes: list[Outcome]) -> None:
    for lane, (run, colour, marks, outcome) in enumerate(zip(runs, colours, markers, outcomes)):
        first = min((s[0][0] for s in run.metrics.values() if s), default=0)
        ax.hlines(lane, first, outcome.step, color=colour, lw=7, alpha=0.3)
        ax.plot([outcome.step], [lane], marker="|", ms=22, mew=3, color=colour)
        for kind in dict.fromkeys(m.kind for m in marks):
            spec = EVENT_MARKERS.get(kind, OTHER_MARKER)
            at = [m.step for m in marks if m.kind == kind]
            ax.plot(at, [lane] * len(at), ls="", marker=spec.marker, color=spec.colour, ms=spec.size, mec="white",
                    mew=0.6, zorder=7)
        counts = Counter(m.kind for m in marks)
        story = ", ".join(f"{n} {EVENT_MARKERS.get(k, OTHER_MARKER).label}" for k, n in counts.items())
        ax.text(first, lane - 0.3, f"{outcome.text}" + (f"  |  {story}" if story else "  |  no events"),
                fontsize=9, va="bottom", color="black" if outcome.kind == "finished" else _STOPPED)
    ax.set_ylim(len(runs) - 0.5, -0.85)
    ax.set_yticks(range(len(runs)), [run.label for run in runs])
    for label, colour in zip(ax.get_yticklabels(), colours):
        label.set_color(colour)
    ax.set_title("events and how each run ended", loc="left", fontsize=10)
    ax.grid(axis="x", alpha=0.3)


def _grad_panel(ax: Axes, runs: Sequence[Run], colours: list[str], markers: list[list[Marker]]) -> None:
    clipped = False
    for run, colour, marks in zip(runs, colours, markers):
        series = run.panel("gradient norm")
        if _finite(series)[0]:
            ax.plot(*_finite(series), color=colour, lw=1)
        _nonfinite_on_top(ax, series, colour)
        _mark(ax, series, marks)
        threshold = run.panel("clip threshold")
        if _finite(threshold)[0]:
            ax.plot(*_finite(threshold), color=colour, lw=1, ls="--", alpha=0.8)
            clipped = True
    ax.set_title("gradient norm" + (" (solid) and clip threshold (dashed)" if clipped else ""), loc="left",
                 fontsize=10)
    if any(line.get_ydata().size and min(line.get_ydata()) > 0 for line in ax.lines):
        ax.set_yscale("log")
    ax.grid(alpha=0.3)


def _line_panel(ax: Axes, runs: Sequence[Run], colours: list[str], markers: list[list[Marker]], panel: str,
                title: str, missing: str) -> None:
    for run, colour, marks in zip(runs, colours, markers):
        series = run.panel(panel)
        if _finite(series)[0]:
            ax.step(*_finite(series), where="post", color=colour, lw=1.3)
            _mark(ax, series, marks)
    ax.set_title(title, loc="left", fontsize=10)
    if not ax.lines:
        _note(ax, missing)
    ax.grid(alpha=0.3)


def _headroom_panel(ax: Axes, runs: Sequence[Run], colours: list[str]) -> None:
    parts_drawn: list[str] = []
    for run, colour in zip(runs, colours):
        if _finite(run.panel("headroom"))[0]:
            ax.plot(*_finite(run.panel("headroom")), color=colour, lw=1.3, marker="o", ms=4)
        for part, style in _HEADROOM_STYLES.items():
            series = run.panel(f"headroom ({part})")
            if _finite(series)[0]:
                ax.plot(*_finite(series), color=colour, lw=0.9, ls=style, marker=".", alpha=0.8)
                parts_drawn.append(part)
    ax.set_title("headroom: decades below the FP32 limit (3.4e38)", loc="left", fontsize=10)
    if not ax.lines:
        _note(ax, "not logged: NonFiniteDetector samples it every headroom_every_n_steps")
        return
    ax.set_ylim(bottom=0)
    if parts_drawn:
        from matplotlib.lines import Line2D

        handles = [Line2D([], [], color="dimgray", marker="o", ms=4, label="smallest")]
        handles += [Line2D([], [], color="dimgray", ls=_HEADROOM_STYLES[p], label=p)
                    for p in _HEADROOM_STYLES if p in parts_drawn]
        ax.legend(handles=handles, loc="lower left", fontsize=8, ncol=len(handles))
    ax.grid(alpha=0.3)


def _event_legend(markers: list[list[Marker]], runs: Sequence[Run]) -> list[Any]:
    from matplotlib.lines import Line2D

    present = {m.kind for marks in markers for m in marks}
    handles: list[Any] = [
        Line2D([], [], ls="", marker=spec.marker, color=spec.colour, ms=spec.size, label=spec.label)
        for kind, spec in EVENT_MARKERS.items()
        if kind in present
    ]
    if present - EVENT_MARKERS.keys():
        spec = OTHER_MARKER
        handles.append(Line2D([], [], ls="", marker=spec.marker, color=spec.colour, ms=spec.size, label=spec.label))
    if any(not math.isfinite(v) for run in runs for name in ("loss", "gradient norm") for _, v in run.panel(name)):
        handles.append(Line2D([], [], ls="", marker="o", mfc="none", mec="dimgray", mew=1.5, label=NONFINITE_LABEL))
    return handles
