"""How far the LR schedulers end behind the fit.

Lightning steps a scheduler of ``interval="step"`` once per optimizer step (``frequency`` allowing). A rollback
returns it with the weights to the count of its snapshot, and a skipped step holds it, while the fit's step count
goes on: a schedule sized to the fit (a ``OneCycleLR`` over ``estimated_stepping_batches``, a warm-up and its decay)
then ends short of its end. :class:`ScheduleLag` counts the steps the loop gave each scheduler and compares them
with how far the scheduler got. A scheduler of ``interval="epoch"`` steps as each epoch ends, which a rollback does
not live again either: the epochs a restore took it back are counted as they happen.

A ``ReduceLROnPlateau`` steps on a watched value, after a batch or as an epoch ends, outside every batch's hooks:
:meth:`ScheduleLag.plateau_steps` finds those steps, with the value each was given, so that a trial's candidates
step theirs on the same values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl

from lightning_overflow import _compat

__all__ = ["ScheduleLag", "scheduler_count"]


def scheduler_count(config: Any) -> int:
    """How many times a scheduler has stepped (plateau schedulers are stepped by the loop after the batch: 0)."""
    return 0 if config.reduce_on_plateau else _steps_taken(config.scheduler)


def _counts(trainer: pl.Trainer, count: Callable[[Any], int] = scheduler_count) -> list[int]:
    """``count`` of each of the trainer's schedulers."""
    return [count(config) for config in trainer.lr_scheduler_configs]


def _plateau_count(config: Any) -> int:
    return _steps_taken(config.scheduler) if config.reduce_on_plateau else 0


def _on_the_batch(trainer: pl.Trainer, config: Any) -> bool:
    """A plateau scheduler that steps after a batch on what the training loop logged (not on a validation metric)."""
    return bool(config.reduce_on_plateau and config.interval == "step" and config.monitor
                and _compat.logged_in_training(trainer, config.monitor))  # fmt: skip


def _steps_taken(scheduler: Any) -> int:
    """A scheduler's ``last_epoch``; a ``ChainedScheduler`` keeps none (torch 2.13) and steps its schedulers
    together: its first one's."""
    count = getattr(scheduler, "last_epoch", None)
    if count is None:
        chained = getattr(scheduler, "_schedulers", None)
        return _steps_taken(chained[0]) if chained else 0
    return int(count)


class ScheduleLag:
    """The steps the loop gave each scheduler since the fit began, against the steps it took."""

    def __init__(self) -> None:
        self._start: list[tuple[Any, int]] = []
        self._first_step = 0
        self._given: list[int] = []
        self._marks: list[int] = []  # each scheduler's count when the batch began
        self._seen: list[int] = []  # each scheduler's count when last looked at
        self._rewound: list[int] = []  # epochs a restore took each epoch-interval scheduler back
        self._plateaus: list[int] = []  # each plateau scheduler's own count when last looked at (others: 0)
        self._batch_values: list[Any] = []  # what a step-interval plateau on a training metric will step on

    def start(self, trainer: pl.Trainer) -> None:
        """At the fit's start (after a checkpoint's state is loaded): each scheduler and its count."""
        self._start = [(config.scheduler, scheduler_count(config)) for config in trainer.lr_scheduler_configs]
        self._given = [0] * len(self._start)
        self._first_step = int(trainer.global_step)
        self._seen = [count for _, count in self._start]
        self._rewound = [0] * len(self._start)
        self.mark_plateaus(trainer)

    def begin_batch(self, trainer: pl.Trainer) -> None:
        counts = _counts(trainer)
        if not trainer.lightning_module.automatic_optimization:
            self._given_between(counts)
        self._marks = self._seen = counts

    def _given_between(self, counts: list[int]) -> None:
        """Under manual optimization the module steps its schedulers itself, in its batches or between them (in
        ``on_train_epoch_end``): the steps it made since they were last looked at are given too."""
        for index, (count, seen) in enumerate(zip(counts[: len(self._given)], self._seen)):
            self._given[index] += max(count - seen, 0)
        self._seen = counts

    def end_batch(self, trainer: pl.Trainer) -> list[int]:
        """At the end of the batch, before a skip's hold puts the schedules back: how often the loop stepped each
        scheduler in this batch (counted towards what it gave)."""
        self._seen = _counts(trainer)
        steps = [count - mark for count, mark in zip(self._seen, self._marks)]
        for index, count in enumerate(steps[: len(self._given)]):
            self._given[index] += count
        return steps

    def restored(self, trainer: pl.Trainer) -> None:
        """The schedulers were just restored from a snapshot: an epoch-interval one taken back is behind by as many
        of its steps (the loop steps it as epochs end, and goes on from the epoch it is in). Under manual
        optimization every step the module gave is counted (:meth:`_given_between`): a rewind shows as missed."""
        counts = _counts(trainer)
        by_epoch = trainer.lightning_module.automatic_optimization
        for index, (config, seen, count) in enumerate(zip(trainer.lr_scheduler_configs, self._seen, counts)):
            if index < len(self._rewound) and by_epoch and config.interval == "epoch" and count < seen:
                self._rewound[index] += seen - count
        self._seen = counts

    def mark_plateaus(self, trainer: pl.Trainer, values: bool = False) -> None:
        """At the batch's end (after its restores, if any): each plateau scheduler's count, from which the next
        :meth:`plateau_steps` counts, and, with ``values`` (a trial's candidates will step on them), the value a
        step-interval one on a training metric is about to step on (Lightning computes its metrics to give it)."""
        configs = trainer.lr_scheduler_configs
        self._plateaus = _counts(trainer, _plateau_count)
        self._batch_values = [
            trainer.callback_metrics.get(config.monitor) if values and _on_the_batch(trainer, config) else None
            for config in configs
        ]

    def plateau_steps(self, trainer: pl.Trainer) -> list[list[float]]:
        """The steps each plateau scheduler took since it was last marked, as the values it watched: Lightning steps
        one on its ``monitor`` in ``callback_metrics``, after the batch (and its validation, if one ran) or after the
        epoch's end. Read here, at the next batch's start, but for a step-interval one on a training metric, read
        at the batch's end: the epoch's end replaces a metric logged ``on_epoch`` by its mean, which the step did not
        see. Empty for the others, and for one whose value is not there (a plain loop passes its own)."""
        counts = _counts(trainer, _plateau_count)
        steps: list[list[float]] = []
        for index, (config, count, seen) in enumerate(zip(trainer.lr_scheduler_configs, counts, self._plateaus)):
            value = None
            if count > seen and config.monitor:
                held = self._batch_values[index] if index < len(self._batch_values) else None
                value = held if held is not None else trainer.callback_metrics.get(config.monitor)
            steps.append([] if value is None else [float(value)] * (count - seen))
        self._plateaus = counts
        return steps

    def behind(self, trainer: pl.Trainer) -> list[tuple[str, int, str]]:
        """Each scheduler that ends behind what the loop gave it: ``(its class, how far, unit)``, in the fit's steps
        (``"step"``: its own steps times the fit's steps per step it was given, ``frequency`` of them or more where an
        epoch's end cuts the count short) or epochs (``"epoch"``); under manual optimization in the steps the
        module's own code gave it (``"call"``). A scheduler swapped in since the fit began
        (``StochasticWeightAveraging``'s) is not compared."""
        found = []
        manual = not trainer.lightning_module.automatic_optimization
        if manual:  # a step the module made after the last batch (as the last epoch ended)
            self._given_between(_counts(trainer))
        elapsed = int(trainer.global_step) - self._first_step
        for (scheduler, start), given, rewound, config in zip(
            self._start, self._given, self._rewound, trainer.lr_scheduler_configs
        ):
            if config.scheduler is not scheduler or config.reduce_on_plateau:
                continue
            missed = given - (scheduler_count(config) - start)
            if manual:
                lag, unit = missed, "call"
            elif config.interval == "step":
                lag, unit = (round(missed * elapsed / given) if given else missed), "step"
            else:
                lag, unit = rewound * config.frequency, "epoch"
            if lag > 0:
                found.append((type(scheduler).__name__, lag, unit))
        return found
