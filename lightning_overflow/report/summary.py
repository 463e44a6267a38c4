"""The printed summary of a run: how it ended, which series each panel shows, and its events."""

from __future__ import annotations

from collections import Counter

from lightning_overflow.report.outcome import Outcome, run_outcome
from lightning_overflow.report.runs import PANEL_NAMES, Run

__all__ = ["MAX_EVENT_LINES", "MAX_MESSAGE", "summarise"]

MAX_EVENT_LINES = 20
MAX_MESSAGE = 150  # characters of an event's message on its line; the journal keeps it whole


def summarise(run: Run, outcome: Outcome | None = None) -> str:
    """Text summary of ``run``: its outcome, the key each panel draws, event counts and the first events.

    Args:
        run: a run from :func:`~lightning_overflow.report.runs.load_run`.
        outcome: how it ended, judged beside the other runs shown (default: judged alone).
    """
    outcome = outcome or run_outcome(run)
    lines = [f"{run.label} ({run.source or run.path}): {outcome.text}"]
    if run.panels.get("loss") is None:
        lines.append(
            "  no training loss chosen: none of the keys logged reads as one (keys found: "
            f"{', '.join(sorted(run.metrics))}); pass --loss-key KEY"
        )
    shown = [f"{name} = {run.panels[name]}" for name in PANEL_NAMES if run.panels.get(name)]
    absent = [name for name in PANEL_NAMES if not run.panels.get(name) and not name.startswith("headroom (")]
    lines.append("  panels: " + "; ".join(shown) + (f"; not logged: {', '.join(absent)}" if absent else ""))
    counts = Counter(e["kind"] for e in run.events)
    lines.append("  events: " + (", ".join(f"{n} {k}" for k, n in counts.most_common()) or "none"))
    for event in run.events[:MAX_EVENT_LINES]:
        message = str(event.get("message", ""))
        if len(message) > MAX_MESSAGE:
            message = message[: MAX_MESSAGE - 3] + "..."
        lines.append(f"  step {event['step']:>6}  {event['kind']:<10} {message}")
    if len(run.events) > MAX_EVENT_LINES:
        lines.append(f"  ... {len(run.events) - MAX_EVENT_LINES} more in the journal under {run.path}")
    return "\n".join(lines)
