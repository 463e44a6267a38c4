"""How far the LR schedulers end behind the fit.

Lightning steps a scheduler of ``interval="step"`` once per optimizer step (``frequency`` allowing). A rollback
returns it with the weights to the count of its snapshot, and a skipped step holds it, while the fit's step count
goes on: a schedule sized to the fit (a ``OneCycleLR`` over ``estimated_stepping_batches``, a warm-up and its decay)
then ends short of its end. :class:`ScheduleLag` counts the steps the loop gave each scheduler and compares them
with how far the scheduler got. A scheduler of ``interval="epoch"`` steps as each epoch ends, which a rollback does
not live again either: the epochs a restore took it back are counted as they happen.
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
        self._seen: list[int] = []  # each scheduler's count when last looked at
        self._rewound: list[int] = []  # epochs a restore took each epoch-interval scheduler back

    def start(self, trainer: pl.Trainer) -> None:
        """At the fit's start (after a checkpoint's state is loaded): each scheduler and its count."""
        self._start = [(config.scheduler, scheduler_count(config)) for config in trainer.lr_scheduler_configs]
        self._given = [0] * len(self._start)
        self._seen = [count for _, count in self._start]
        self._rewound = [0] * len(self._start)

    def begin_batch(self, trainer: pl.Trainer) -> None:
        self._marks = self._seen = [scheduler_count(config) for config in trainer.lr_scheduler_configs]

    def end_batch(self, trainer: pl.Trainer) -> list[int]:
        """At the end of the batch, before a skip's hold puts the schedules back: how often the loop stepped each
        scheduler in this batch (counted towards what it gave)."""
        self._seen = [scheduler_count(config) for config in trainer.lr_scheduler_configs]
        steps = [count - mark for count, mark in zip(self._seen, self._marks)]
        for index, count in enumerate(steps[: len(self._given)]):
            self._given[index] += count
        return steps

    def restored(self, trainer: pl.Trainer) -> None:
        """The schedulers were just restored from a snapshot: an epoch-interval one taken back is behind by as many
        epochs (the loop steps it as epochs end, and goes on from the epoch it is in)."""
        counts = [scheduler_count(config) for config in trainer.lr_scheduler_configs]
        for index, (config, seen, count) in enumerate(zip(trainer.lr_scheduler_configs, self._seen, counts)):
            if index < len(self._rewound) and config.interval == "epoch" and count < seen:
                self._rewound[index] += seen - count
        self._seen = counts

    def behind(self, trainer: pl.Trainer) -> list[tuple[str, int, str]]:
        """Each scheduler that ends behind what the loop gave it: ``(its class, how far, "step" or "epoch")``. A
        scheduler swapped in since the fit began (``StochasticWeightAveraging``'s) is not compared."""
        found = []
        for (scheduler, start), given, rewound, config in zip(
            self._start, self._given, self._rewound, trainer.lr_scheduler_configs
        ):
            if config.scheduler is not scheduler or config.reduce_on_plateau:
                continue
            by_step = config.interval == "step"
            lag, unit = (given - (scheduler_count(config) - start), "step") if by_step else (rewound, "epoch")
            if lag > 0:
                found.append((type(scheduler).__name__, lag, unit))
        return found
