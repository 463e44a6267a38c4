"""How each journal event is drawn: one marker shape and colour per kind, the same in every panel.

The colours are kept apart from the run colours (:data:`RUN_COLOURS`), so a marker never reads as a run.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from lightning_overflow.fit_summary import answered_at

__all__ = [
    "EVENT_MARKERS",
    "FINDING_KINDS",
    "HIDDEN_KINDS",
    "OTHER_MARKER",
    "RUN_COLOURS",
    "SUSPICION_KINDS",
    "Marker",
    "MarkerSpec",
    "event_markers",
]

RUN_COLOURS = ("tab:blue", "tab:green", "tab:gray", "tab:cyan", "tab:olive", "navy")


@dataclass(frozen=True)
class MarkerSpec:
    """The look of one kind of event.

    Attributes:
        label: the legend text.
        marker: a matplotlib marker.
        colour: a matplotlib colour.
        size: the marker size in points.
    """

    label: str
    marker: str
    colour: str
    size: float = 8.0


@dataclass(frozen=True)
class Marker:
    """One event to draw: where (``step``), what (``kind``) and how (``spec``); a trial also spans the steps it ran
    (``since``: the step it opened at)."""

    step: int
    kind: str
    spec: MarkerSpec
    since: int | None = None


EVENT_MARKERS: dict[str, MarkerSpec] = {
    "skip": MarkerSpec("skipped step", "v", "tab:orange"),
    "nonfinite": MarkerSpec("non-finite step, not skipped", "x", "black"),
    "data_fault": MarkerSpec("bad data, not skipped", "d", "teal"),
    "nonfinite_at_end": MarkerSpec("ended with inf/NaN state", ">", "darkred", 10.0),
    "ending": MarkerSpec("ended poorly (the summary says how)", "<", "darkviolet", 10.0),
    "spike": MarkerSpec("loss / gradient spike", "^", "tab:purple"),
    "backoff": MarkerSpec("LR backoff", "s", "tab:brown"),
    "regrowth": MarkerSpec("LR regrowth", "P", "goldenrod"),
    "rollback": MarkerSpec("rollback", "D", "deeppink"),
    "suspicion": MarkerSpec("suspicion, tried or acted on", "o", "tab:olive", 7.0),
    "suspicion_told": MarkerSpec("suspicion, told only", "8", "darkkhaki", 6.0),
    "trial_kept": MarkerSpec("trial: remedy kept", "*", "tab:red", 12.0),
    "trial_reverted": MarkerSpec("trial: run kept as it was", "H", "tab:green", 9.0),
    "update_bound": MarkerSpec("updates bounded (backoffs undone)", "p", "tab:cyan", 10.0),
    "abort": MarkerSpec("abort (run stopped)", "X", "red", 12.0),
}
OTHER_MARKER = MarkerSpec("other event (see the journal)", "h", "silver", 7.0)
# Routine kinds: clipping shows in the gradient-norm panel, a re-baseline only restarts statistics, an undo is the
# data shift's or the update bound's own marker.
HIDDEN_KINDS = frozenset({"clip", "rebaseline", "undo"})
SUSPICION_KINDS = frozenset({"loss_divergence", "loss_trend", "loss_plateau", "no_progress", "weight_growth"})
"""The detectors' findings that open trials, drawn with one marker (the journal tells them apart); one that opened no
trial (trials off, one under way, or the fit ending) with another."""
FINDING_KINDS = frozenset({"nonfinite", "data_fault"})
"""Detections drawn as their skip when the step was skipped."""


def event_markers(events: Iterable[Mapping[str, Any]]) -> list[Marker]:
    """The markers of a journal's ``events``, in journal order.

    A ``nonfinite`` or ``data_fault`` detection at a step that was skipped is drawn once, as the skip; a detection that was not
    skipped (the run went on, or raised) keeps its own marker. Clips and re-baselines are not drawn. A trial is drawn
    at its verdict as kept (a remedy replaced the run) or reverted (the run went on as it was).

    Example:
        >>> [(m.step, m.kind, m.spec.marker) for m in event_markers(
        ...     [{"step": 5, "kind": "nonfinite"}, {"step": 5, "kind": "skip"}, {"step": 9, "kind": "rollback"}])]
        [(5, 'skip', 'v'), (9, 'rollback', 'D')]
    """
    events = list(events)
    skipped = {int(e["step"]) for e in events if e["kind"] == "skip"}
    by_kind: dict[str, list[Mapping[str, Any]]] = {}
    for event in events:
        by_kind.setdefault(str(event["kind"]), []).append(event)
    markers = []
    for event in events:
        kind, step = str(event["kind"]), int(event["step"])
        if kind in HIDDEN_KINDS or (kind in FINDING_KINDS and step in skipped):
            continue
        since = None
        if kind in SUSPICION_KINDS:
            kind = "suspicion" if answered_at(step, by_kind) else "suspicion_told"
        elif kind == "trial":
            details = event.get("details", {})
            kind = "trial_kept" if details.get("kept") else "trial_reverted"
            since = int(details.get("opened_at", step))
        markers.append(Marker(step, kind, EVENT_MARKERS.get(kind, OTHER_MARKER), since))
    return markers
