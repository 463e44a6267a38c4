"""The dashboard: one PNG of a run (or several side by side) from its logged metrics and event journal.

Reads ``metrics.csv`` (CSVLogger) or TensorBoard event files (when the ``tensorboard`` package is installed) and
``overflow_events.jsonl``; draws the loss, ``grad_norm/total`` with the clip threshold, the LR scale, and every
event on the time axis. Needs matplotlib (``pip install lightning-overflow[plot]``).
"""

from __future__ import annotations

import csv
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_overflow.events import JOURNAL_NAME, read_journal

__all__ = ["EVENT_STYLES", "ReportError", "Run", "load_run", "render", "summarise"]

Series = list[tuple[int, float]]

EVENT_STYLES: dict[str, tuple[str, str]] = {
    # kind: (colour, marker)
    "skip": ("tab:orange", "v"),
    "nonfinite": ("tab:red", "x"),
    "spike": ("tab:purple", "^"),
    "backoff": ("tab:brown", "s"),
    "regrowth": ("tab:green", "P"),
    "rollback": ("black", "D"),
    "abort": ("red", "*"),
}

OUR_KEYS = ("grad_norm/total", "overflow/")


class ReportError(Exception):
    """A run directory that cannot be reported on; the message says why and what to do."""


@dataclass
class Run:
    """What a run logged: metric series by key and the journal's events."""

    label: str
    path: Path
    metrics: dict[str, Series] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)

    def series(self, *candidates: str) -> tuple[str, Series] | None:
        """The first logged key among ``candidates`` (exact, or the first key containing it)."""
        for name in candidates:
            if name in self.metrics:
                return name, self.metrics[name]
        for name in candidates:
            for key in sorted(self.metrics):
                if name in key:
                    return key, self.metrics[key]
        return None


def load_run(path: str | Path, label: str | None = None) -> Run:
    """Read a run directory (a logger's version folder, or any folder above one).

    Raises:
        ReportError: the directory is missing or empty, or holds none of the suite's metrics.
    """
    root = Path(path)
    if not root.is_dir():
        raise ReportError(f"run directory '{root}' does not exist")
    run = Run(label or root.name, root)
    csv_files = sorted(root.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime)
    if csv_files:
        run.metrics = _read_csv(csv_files[-1])
    else:
        run.metrics = _read_tensorboard(root)
    journals = sorted(root.rglob(JOURNAL_NAME), key=lambda p: p.stat().st_mtime)
    if journals:
        run.events = list(read_journal(journals[-1]))
    if not run.metrics and not run.events:
        raise ReportError(
            f"run directory '{root}' holds no metrics.csv, TensorBoard event file or {JOURNAL_NAME}: point at the "
            "folder a CSVLogger or TensorBoardLogger wrote (e.g. lightning_logs/version_0)"
        )
    if run.metrics and not any(key.startswith(OUR_KEYS) for key in run.metrics):
        raise ReportError(
            f"run directory '{root}' has metrics but none of lightning_overflow's (grad_norm/total, overflow/...): "
            "add GradNormMonitor (and the other callbacks) to the Trainer's callbacks"
        )
    return run


def _read_csv(path: Path) -> dict[str, Series]:
    metrics: dict[str, Series] = {}
    with open(path, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            step = int(float(row.get("step") or 0))
            for key, value in row.items():
                if key in ("step", "epoch") or value in (None, ""):
                    continue
                try:
                    metrics.setdefault(key, []).append((step, float(value)))
                except ValueError:
                    continue
    return metrics


def _read_tensorboard(root: Path) -> dict[str, Series]:
    files = sorted(root.rglob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
    if not files:
        return {}
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as err:
        raise ReportError(f"'{root}' holds TensorBoard event files: install the 'tensorboard' package to read them") from err
    accumulator = EventAccumulator(str(files[-1].parent), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def summarise(run: Run) -> str:
    """Text summary: counts by kind and the first lines of the journal."""
    counts = Counter(e["kind"] for e in run.events)
    lines = [f"{run.label}: " + (", ".join(f"{n} {k}" for k, n in counts.most_common()) or "no events")]
    for event in run.events[:20]:
        lines.append(f"  step {event['step']:>6}  {event['kind']:<10} {event.get('message', '')}")
    if len(run.events) > 20:
        lines.append(f"  ... {len(run.events) - 20} more in {run.path}")
    return "\n".join(lines)


def render(runs: Sequence[Run], out: str | Path, title: str = "lightning_overflow") -> Path:
    """Draw the dashboard of ``runs`` (one column each) into the PNG ``out``; return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = ("loss", "gradient norm", "LR scale")
    fig, axes = plt.subplots(len(panels), len(runs), figsize=(6.5 * len(runs), 8.5), squeeze=False, sharex="all")
    for column, run in enumerate(runs):
        top = axes[0][column]
        top.set_title(run.label)
        _plot_loss(top, run)
        _plot_grad_norm(axes[1][column], run)
        _plot_lr_scale(axes[2][column], run)
        for row, name in enumerate(panels):
            axes[row][column].set_ylabel(name)
            _mark_events(axes[row][column], run, legend=row == 0)
        axes[-1][column].set_xlabel("step")
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _finite(series: Series) -> tuple[list[int], list[float]]:
    points = [(s, v) for s, v in series if math.isfinite(v)]
    return [s for s, _ in points], [v for _, v in points]


def _plot_loss(ax: Any, run: Run) -> None:
    found = run.series("train_loss", "loss_step", "loss")
    if found is None:
        ax.text(0.5, 0.5, "no loss logged", ha="center", transform=ax.transAxes)
        return
    key, series = found
    ax.plot(*_finite(series), lw=1, label=key)
    diverged = [s for s, v in series if not math.isfinite(v)]
    if diverged:
        ax.axvline(diverged[0], color="red", ls="--", lw=1, label=f"first non-finite loss (step {diverged[0]})")


def _plot_grad_norm(ax: Any, run: Run) -> None:
    for key, style in (("grad_norm/total", "-"), ("clip/threshold", "--")):
        found = run.series(key)
        if found is not None and _finite(found[1])[0]:
            ax.plot(*_finite(found[1]), style, lw=1, label=found[0])
    if ax.lines:
        ax.set_yscale("log")
        ax.legend(loc="upper left", fontsize=7)


def _plot_lr_scale(ax: Any, run: Run) -> None:
    found = run.series("overflow/lr_scale")
    if found is None:
        ax.text(0.5, 0.5, "no LR scale logged (no LRBackoff)", ha="center", transform=ax.transAxes)
    else:
        ax.step(*_finite(found[1]), where="post", lw=1, label=found[0])
    ax.set_ylim(bottom=0, top=1.1)


def _mark_events(ax: Any, run: Run, legend: bool) -> None:
    seen: set[str] = set()
    for event in run.events:
        kind = event["kind"]
        colour, _ = EVENT_STYLES.get(kind, ("grey", "o"))
        ax.axvline(event["step"], color=colour, alpha=0.5, lw=0.8, label=kind if kind not in seen else None)
        seen.add(kind)
    if legend and (seen or ax.lines):
        ax.legend(loc="upper right", fontsize=7)
