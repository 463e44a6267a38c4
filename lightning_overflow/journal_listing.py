"""A journal for a person: ``python -m lightning_overflow journal RUN_DIR``.

Each fit in the journal gets its findings in plain words (:mod:`lightning_overflow.fit_summary`), then its events
grouped: events of one kind whose messages differ only in their numbers (the step, a loss) are one group, shown once
with the steps it happened at, what to try first, then the first message whole.

Pure: events in, lines out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from lightning_overflow.fit_summary import plain_lines

__all__ = ["NOTHING_TO_REPORT", "journal_lines"]

# A run without events (an empty journal, or none: a fit writes its journal with its first event) is good news.
NOTHING_TO_REPORT = (
    "the suite recorded no event: nothing to report (no step skipped, clipped, backed off or rolled back)"
)

_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?", re.IGNORECASE)
MAX_STEPS = 8


def journal_lines(events: Iterable[Mapping[str, Any]]) -> list[str]:
    """The listing of a journal's events, fit by fit, in the order the fits were written."""
    runs: dict[str, list[Mapping[str, Any]]] = {}
    for event in events:
        runs.setdefault(str(event.get("run", "")), []).append(event)
    lines: list[str] = []
    for run, fit in runs.items():
        steps = [int(e["step"]) for e in fit]
        name = f"fit {run}" if run else "fit"
        lines.append(f"{name}: {len(fit)} events, steps {min(steps)}-{max(steps)}")
        lines.append("  in plain words:")
        lines.extend(f"    - {line}" for line in plain_lines(fit) or ["nothing to report"])
        lines.append("  events, grouped:")
        for group in _groups(fit):
            lines.extend(_group_lines(group))
        lines.append("")
    return lines[:-1] if lines else [NOTHING_TO_REPORT]


def _groups(fit: list[Mapping[str, Any]]) -> list[list[Mapping[str, Any]]]:
    groups: dict[tuple[str, str, str], list[Mapping[str, Any]]] = {}
    for event in fit:
        key = (str(event["kind"]), str(event.get("source", "")), _NUMBER.sub("#", str(event.get("message", ""))))
        groups.setdefault(key, []).append(event)
    return list(groups.values())


def _group_lines(group: list[Mapping[str, Any]]) -> list[str]:
    first = group[0]
    steps = sorted({int(e["step"]) for e in group})
    shown = ", ".join(map(str, steps[:MAX_STEPS])) + (f", ... ({len(steps)} in all)" if len(steps) > MAX_STEPS else "")
    times = "once" if len(group) == 1 else f"{len(group)} times"
    lines = [
        f"    {first['kind']} ({first.get('source', '')}), {times}, at step{'s' if len(steps) > 1 else ''} {shown}"
    ]
    hint = _hint(first)
    if hint:
        lines.append(f"      try: {hint}")
    lines.append(f"      {first.get('message', '')}")
    if len(group) > 1:
        lines.append(f"      (the other {len(group) - 1} differ only in their numbers)")
    return lines


def _hint(event: Mapping[str, Any]) -> str:
    details = event.get("details") or {}
    diagnosis = details.get("diagnosis") or {}
    if diagnosis.get("hint"):
        return str(diagnosis["hint"])
    return _own_hint(str(event.get("message", "")))


def _own_hint(message: str) -> str:
    """The message's own ``HINT: ...`` (to its end), not one inside a message it quotes in parentheses (a rollback
    quotes the detector's finding, hint included).

    Example:
        >>> _own_hint("Rollback: restored (Detector: grew. HINT: a lower rate.). Counted.")
        ''
        >>> _own_hint("Detector: grew. HINT: a lower rate.")
        'a lower rate'
    """
    depth = 0
    for i, char in enumerate(message):
        if char == "(":
            depth += 1
        elif char == ")":
            depth = max(depth - 1, 0)
        elif depth == 0 and message.startswith("HINT: ", i):
            return message[i + len("HINT: "):].rstrip(".")
    return ""
