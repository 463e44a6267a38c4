"""Event records and the journal: every skip, detection and remedy as one JSON line.

Each fit has its own journal, next to its logger's metrics (:mod:`lightning_overflow.loggers` says where for each
logger); every line carries the fit's ``run`` id, so fits that append to one file (no logger) are told apart.
Decisions are identical on every rank, so rank 0 alone writes them; the ranks that observed a per-rank fault are
listed in the event itself.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from lightning_utilities.core.rank_zero import WarningCache as _RankZeroWarningCache
from lightning_utilities.core.rank_zero import rank_zero_warn

from lightning_overflow.exceptions import OverflowWarning

__all__ = ["JOURNAL_NAME", "Event", "log", "Journal", "MetricBuffer", "WarningCache", "find_journals", "read_journal"]

JOURNAL_NAME = "overflow_events.jsonl"

log = logging.getLogger("lightning_overflow")
"""The suite's console: each action and the fit's summary, at INFO, on rank 0. A logger of its own, not a child of
Lightning's: quieting Lightning (``logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)``, a library's
switch for it such as pytorch-tabular's ``suppress_lightning_logger``) leaves what the suite did said;
``logging.getLogger("lightning_overflow")`` sets it. Set up as Lightning sets up its own: INFO, and a handler of its
own (standard error) unless the root logger has one."""
if log.level == logging.NOTSET:
    log.setLevel(logging.INFO)
if not logging.getLogger().hasHandlers() and not log.handlers:
    log.addHandler(logging.StreamHandler())
    log.propagate = False


@dataclass(frozen=True)
class Event:
    """One thing that happened to the run.

    Attributes:
        step: the ``global_step`` of the optimizer step concerned.
        kind: what happened; ``docs/journal.md`` lists every kind with its details.
        rank: the lowest rank that observed it (0 for what every rank observes, such as all-reduced gradients).
        source: the callback that recorded it.
        message: a sentence for a person.
        details: the facts behind the message (JSON-serialisable).
        epoch: ``trainer.current_epoch``.
        time: when it was recorded (seconds since the epoch).
        run: the fit it belongs to (its :class:`Journal` stamps it; empty until recorded).
    """

    step: int
    kind: str
    rank: int
    source: str
    message: str
    details: dict[str, Any] = field(default_factory=dict)
    epoch: int = 0
    time: float = field(default_factory=time.time)
    run: str = ""

    def to_json(self) -> str:
        return json.dumps(_jsonable(asdict(self)), sort_keys=False, allow_nan=False)


def _jsonable(value: Any) -> Any:
    # JSON has no inf/NaN; keep them readable as strings rather than producing invalid JSON.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


class Journal:
    """Appends events to a JSON-lines file and keeps counts by kind.

    Args:
        path: the file to append to, or ``None`` to keep events in memory only.
        write: whether this process writes (rank 0 does; the others only count).
        run: the id of the fit, stamped on every event it records (default: none).

    Attributes:
        uploaded: how many events the last upload of the file held (``None``: never uploaded).
    """

    def __init__(self, path: str | os.PathLike[str] | None, write: bool = True, run: str = "") -> None:
        self.path = Path(path) if path is not None else None
        self.write = write
        self.run = run
        self.events: list[Event] = []
        self.counts: Counter[str] = Counter()
        self.uploaded: int | None = None
        self._published = 0

    def record(self, event: Event) -> None:
        if self.run and not event.run:
            event = replace(event, run=self.run)
        self.events.append(event)
        self.counts[event.kind] += 1
        if self.path is None or not self.write:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # One write() per line: O_APPEND keeps concurrent writers from interleaving lines.
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(event.to_json() + "\n")
        except OSError as error:  # a full disk or a path that cannot be one: the run goes on, the events in memory
            self.write = False
            log.warning(f"lightning_overflow: the journal could not be written to {self.path} ({error}); it is not "
                        "written again in this fit, and its events stay in the fit summary and the callbacks' counts")

    def unpublished(self) -> list[Event]:
        """The events recorded since the last call (for dashboards that show them as they happen)."""
        new = self.events[self._published :]
        self._published = len(self.events)
        return new

    def summary(self) -> str:
        """``"3 skip, 1 nonfinite"`` style, most frequent first; empty when nothing happened."""
        return ", ".join(f"{n} {kind}" for kind, n in self.counts.most_common())


def find_journals(path: str | os.PathLike[str]) -> list[Path]:
    """The journals at ``path``: the file itself, or every ``overflow_events.jsonl`` under a folder (a logger's run
    folder, its version folder, or a tree of runs), in path order."""
    path = Path(path)
    if path.is_dir():
        return sorted(path.rglob(JOURNAL_NAME))
    return [path] if path.exists() else []


def read_journal(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Yield the events of a journal: its file, or the folder that holds it (``lightning_logs/version_0``, or any
    folder above it with one journal in it). A corrupt line is skipped with an :class:`OverflowWarning` naming it.

    Raises:
        FileNotFoundError: no journal at ``path``.
        ValueError: the folder holds several journals (the message lists them: pass one).
    """
    found = find_journals(path)
    if not found:
        raise FileNotFoundError(f"no journal ({JOURNAL_NAME}) at or under '{path}'")
    if len(found) > 1:
        listed = ", ".join(f"'{f}'" for f in found)
        raise ValueError(f"'{path}' holds {len(found)} journals ({listed}): pass the one to read")
    with open(found[0], encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError as err:
                warnings.warn(f"{found[0]}:{number}: skipped a corrupt journal line ({err})", OverflowWarning,
                              stacklevel=2)  # fmt: skip
                continue
            if not isinstance(event, dict) or "step" not in event or "kind" not in event:
                warnings.warn(f"{found[0]}:{number}: skipped a line that is not an event", OverflowWarning,
                              stacklevel=2)  # fmt: skip
                continue
            yield event


class WarningCache(_RankZeroWarningCache):
    """Shows each warning once per key, on global rank zero only (Lightning's ``rank_zero_warn``), so a fault that
    repeats every step, or on every rank, warns once. :meth:`clear` at the start of a fit: once per run."""

    def warn(self, key: str, message: str) -> None:  # type: ignore[override]
        if key in self:
            return
        self.add(key)
        rank_zero_warn(message, category=OverflowWarning, stacklevel=4)


class MetricBuffer:
    """Metrics queued by every suite callback during a batch, sent once per step (with Lightning's own logging call
    where Lightning logs the step: see ``HealthBoard.flush``).

    Loggers write a row (CSV) or a history entry (W&B) per call: one call per logging step keeps them whole.
    """

    def __init__(self) -> None:
        self._by_step: dict[int, dict[str, float]] = {}

    def add(self, metrics: dict[str, float], step: int) -> None:
        if metrics:
            self._by_step.setdefault(step, {}).update(metrics)

    def drain(self) -> list[tuple[int, dict[str, float]]]:
        """The queued ``(step, metrics)`` in step order; the buffer is empty afterwards."""
        queued = sorted(self._by_step.items())
        self._by_step = {}
        return queued

    def clear(self) -> None:
        self._by_step = {}
