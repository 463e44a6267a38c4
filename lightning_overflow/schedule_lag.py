"""How far the LR schedulers end behind the fit.

Lightning steps a scheduler of ``interval="step"`` once per optimizer step (``frequency`` allowing). A rollback
returns it with the weights to the count of its snapshot, and a skipped step holds it, while the fit's step count
goes on: a schedule sized to the fit (a ``OneCycleLR`` over ``estimated_stepping_batches``, a warm-up and its decay)
then ends short of its end. :class:`ScheduleLag` counts the steps the loop gave each scheduler and compares them
with how far the scheduler got.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl

__all__ = ["ScheduleLag", "scheduler_count"]


def scheduler_count(config: Any) -> int:
    """How many times a scheduler has stepped (plateau schedulers are stepped by the loop after the batch: 0)."""
    if config.reduce_on_plateau:
        return 0
    return int(getattr(config.scheduler, "last_epoch", 0))


class ScheduleLag:
    """The steps the loop gave each scheduler since the fit began, against the steps it took."""

    def __init__(self) -> None:
        self._start: list[tuple[Any, int]] = []
        self._given: list[int] = []
        self._marks: list[int] = []  # each scheduler's count when the batch began

    def start(self, trainer: pl.Trainer) -> None:
        """At the fit's start (after a checkpoint's state is loaded): each scheduler and its count."""
        self._start = [(config.scheduler, scheduler_count(config)) for config in trainer.lr_scheduler_configs]
        self._given = [0] * len(self._start)

    def begin_batch(self, trainer: pl.Trainer) -> None:
        self._marks = [scheduler_count(config) for config in trainer.lr_scheduler_configs]

    def end_batch(self, trainer: pl.Trainer) -> list[int]:
        """At the end of the batch, before a skip's hold puts the schedules back: how often the loop stepped each
        scheduler in this batch (counted towards what it gave)."""
        steps = [scheduler_count(config) - mark for config, mark in zip(trainer.lr_scheduler_configs, self._marks)]
        for index, count in enumerate(steps[: len(self._given)]):
            self._given[index] += count
        return steps

    def behind(self, trainer: pl.Trainer) -> list[tuple[str, int]]:
        """Each step-interval scheduler that ends behind the steps the loop gave it: ``(its class, steps behind)``.
        A scheduler swapped in since the fit began (``StochasticWeightAveraging``'s) is not compared."""
        found = []
        for (scheduler, start), given, config in zip(self._start, self._given, trainer.lr_scheduler_configs):
            if config.scheduler is not scheduler or config.interval != "step" or config.reduce_on_plateau:
                continue
            lag = given - (scheduler_count(config) - start)
            if lag > 0:
                found.append((type(scheduler).__name__, lag))
        return found
