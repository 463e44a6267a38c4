"""A fit in plain words: one line per finding, from the journal's events.

Each line says what happened, where (steps, the batch within its epoch and its sample rows when the diagnosis found
them), what the suite did, and what to try. Findings are counted, not journal lines: a skip and the detection that
caused it are one finding, and a data fault that recurs every epoch is one line. The same lines end a fit on the
console and head ``python -m lightning_overflow journal RUN_DIR``.

Pure: events in, text out (events as :func:`~lightning_overflow.events.read_journal` yields them).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_overflow.policy import NO_PROGRESS_LEVEL, REGROWTH, SCHEDULED, at_floor

__all__ = ["DEAD_SHARE", "ENDING_BLOCK", "ENDING_RATIO", "ENDING_START", "LossEnding", "answered_at", "ending_words",
           "left_alone", "named", "opened_because", "plain_lines", "schedule_behind", "stalled_ending"]

Event = Mapping[str, Any]

ENDING_BLOCK = 40  # finite losses whose median is one loss level: shorter stretches scatter too much to compare
ENDING_START = 5  # the first finite losses, whose median is where the run started
ENDING_RATIO = 10.0  # a run whose last loss level is this many times its best has lost most of what it learnt
DEAD_SHARE = 0.5  # parameter tensors without any gradient, as a share of those the optimizer steps: a dead network
START_NORMS = 25  # the gradient norms of the fit's first steps: the first one's, and those it is measured against
START_OUT_OF_SCALE = 100.0
"""A fit's first gradient norm this many times the median of the next ones' came from an initialisation out of
scale, where the loss did not come down with the gradients (its median over those steps at least
``START_LOSS_KEPT`` of the first step's): measured, tanh RNNs whose recurrent matrix is drawn at 2x and 2.5x orthogonal
start at 420x and 22,000x (their first update saturates the state, and they end 17x to 38x above the same RNN drawn
right, whatever clips them) and a ReLU RNN over long sequences at 150x; every other scenario of the rescue benchmark,
faults and learning rates up to 40x included, at 7x or less. A problem solved in its first steps (a linear regression
under LBFGS) has its gradients fall as far, and its loss with them."""
START_LOSS_KEPT = 0.1
MAX_STEPS = 6  # steps listed in a line before "..."
SIGNAL_WORDS = {
    "nonfinite_persistent": "steps that kept failing",
    "nonfinite_burst": "a burst of non-finite steps",
    "nonfinite_state": "non-finite weights or optimizer state",
    "nonfinite": "a non-finite step",
    "replica_mismatch": "replicas whose weights differed",
    "loss_spike": "a loss spike",
}
SUSPICION_WORDS = {
    "loss_divergence": "the loss rose far above its best and stayed there",
    "loss_trend": "the loss kept rising",
    "no_progress": "the loss stalled short of half its start",
    "weight_growth": "the weights kept growing while the loss did not fall",
    "scaler_collapse": "the GradScaler's scale collapsed",
    SCHEDULED: "a scheduled check",
    REGROWTH: "a return towards the scheduled learning rate",
}
_WORDS = {**SIGNAL_WORDS, **SUSPICION_WORDS}


def opened_because(kind: str, step: int) -> str:
    """Why a trial opened, in words that keep the signal's name: ``"because the loss kept rising (loss_trend at step
    30)"``."""
    if kind == SCHEDULED:
        return f"as a scheduled check at step {step}"
    if kind == REGROWTH:
        return f"to test a higher learning rate at step {step}"
    return f"because {SUSPICION_WORDS.get(kind, 'the state was suspected')} ({kind} at step {step})"


def named(kind: str) -> str:
    """A signal's words and its name: ``"non-finite weights or optimizer state (nonfinite_state)"``."""
    return f"{_WORDS[kind]} ({kind})" if kind in _WORDS else kind


@dataclass
class LossEnding:
    """Where the training loss ended against its best and against where it started, fed step by step.

    Every level is a median, which a few spikes do not move: the best is the lowest median of ``ENDING_BLOCK``
    consecutive finite losses (blocks counted from the fit's first loss), the last is the median of the last
    ``ENDING_BLOCK`` finite losses, the start the median of the first ``ENDING_START``. The start is what a run that
    went wrong within its first block is measured against: such a run never had a good block to call its best.
    O(1) a step: a value appended to two short lists, and a median of ``ENDING_BLOCK`` values once a block.
    :meth:`event_details` says whether the run ended far above either, or on a stretch of inf/NaN losses.

    Also fed how many of the step's gradient tensors were exactly 0 (``silent``): a network where most of them got no
    gradient at all on each of the last ``ENDING_BLOCK`` steps while some still had one (the loss still asks for a
    change that most of the network cannot make), after a step where most did, has died (ReLU units whose
    outputs are 0 for every input pass nothing back: measured, a 10-layer ReLU net drawn at 2.2x Kaiming's scale and
    restored at a lower rate ended with 17 of its 22 tensors silent, predicting a constant at 10x the loss of one drawn
    right, with a finite loss far below where it started). A run frozen by design never had its tensors alive.
    """

    best: float = math.inf
    best_step: int = -1  # the last step of the best block
    best_from: int = -1  # its first step
    start: float = math.nan
    start_step: int = -1  # the last step of the start's losses
    nonfinite_tail: int = 0  # inf/NaN losses in a row at the end
    nonfinite_from: int = -1  # the step of the first of them
    _block: list[float] = field(default_factory=list)
    _block_from: int = -1
    _recent: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=ENDING_BLOCK))
    _first: list[float] = field(default_factory=list)
    silent_tail: int = 0  # steps in a row, at the end, where most gradient tensors were exactly 0
    silent_from: int = -1  # the first of them
    silent: tuple[int, int] = (0, 0)  # (tensors without gradient, tensors) at the last step
    silent_names: tuple[str, ...] = ()  # some of them, at the last step
    _lived: bool = False  # a step where most tensors had a gradient
    start_norms: list[float] = field(default_factory=list)  # the finite gradient norms of steps 0 to START_NORMS - 1
    start_losses: list[float] = field(default_factory=list)  # the losses of the same steps
    _norm_step: int = -1  # the step of the last of them

    def add(self, step: int, loss: float | None, silent: tuple[int, int] | None = None, names: Sequence[str] = (),
            norm: float = math.nan) -> None:  # fmt: skip
        """Take one step's loss (``None``: none was seen, as under a Pyro plan's own backward) and, where known,
        ``(gradient tensors exactly 0, tensors)`` with some of their ``names``, and its total gradient ``norm`` (kept
        for the fit's first ``START_NORMS`` steps, from step 0: a resumed fit has no start of its own; one a step, the
        first evaluation's, where an optimizer such as LBFGS evaluates its closure several times a step)."""
        if (step < START_NORMS and step > self._norm_step and math.isfinite(norm) and loss is not None
                and math.isfinite(loss) and (step == 0 or self.start_norms)):  # fmt: skip
            self.start_norms.append(norm)
            self.start_losses.append(loss)
            self._norm_step = step
        if silent is not None and silent[1] > 0:
            if silent[0] < DEAD_SHARE * silent[1]:
                self._lived, self.silent_tail = True, 0
            elif silent[0] == silent[1]:
                self.silent_tail = 0  # no gradient anywhere: nothing to learn on this batch (a hinge loss at 0)
            elif self._lived:
                self.silent_from = step if self.silent_tail == 0 else self.silent_from
                self.silent_tail += 1
                self.silent, self.silent_names = silent, tuple(names)
        if loss is None:
            return
        if not math.isfinite(loss):
            if self.nonfinite_tail == 0:
                self.nonfinite_from = step
            self.nonfinite_tail += 1
            return
        self.nonfinite_tail = 0
        self._recent.append((step, loss))
        if len(self._first) < ENDING_START:
            self._first.append(loss)
            if len(self._first) == ENDING_START:
                self.start, self.start_step = statistics.median(self._first), step
        if not self._block:
            self._block_from = step
        self._block.append(loss)
        if len(self._block) < ENDING_BLOCK:
            return
        level = statistics.median(self._block)
        if level < self.best:
            self.best, self.best_step, self.best_from = level, step, self._block_from
        self._block = []

    def replace_from(self, first: int, losses: Sequence[float]) -> None:
        """The losses taken in from step ``first`` on were those of a run a trial's remedy replaced: the remedy's
        ``losses`` on the same batches, one a step, stand in their place (a non-finite one leaves its step out).
        Without it, a fit that ends within ``ENDING_BLOCK`` steps of a kept remedy is judged on the run it left: the
        median of the abandoned divergence said the loss "ended far above its best" of a run that ended well."""
        kept = [(step, loss) for step, loss in self._recent if step < first]
        self._recent.clear()
        self._recent.extend(kept)
        self._recent.extend((first + i, loss) for i, loss in enumerate(losses) if math.isfinite(loss))
        if losses and math.isfinite(losses[-1]):
            self.nonfinite_tail = 0

    @property
    def last(self) -> float:
        """The median of the last ``ENDING_BLOCK`` finite losses (``nan`` until there are that many)."""
        if len(self._recent) < ENDING_BLOCK:
            return math.nan
        return statistics.median(loss for _, loss in self._recent)

    @property
    def last_step(self) -> int:
        return self._recent[-1][0] if self._recent else -1

    @property
    def last_from(self) -> int:
        """The step of the first of the last ``ENDING_BLOCK`` finite losses (``-1`` before any)."""
        return self._recent[0][0] if self._recent else -1

    def event_details(self) -> dict[str, Any] | None:
        """The facts of an ``ending`` event, ``None`` when there is nothing to tell: the last ``ENDING_BLOCK`` losses
        or more were all inf/NaN (``"nonfinite_steps"``), or the last level is ``ENDING_RATIO`` times the best or more
        (``"against": "best"``), or ``ENDING_RATIO`` times the start or more where the best is no lower than that
        (``"against": "start"``). Only a positive level is a baseline: the ratio of two signed losses means nothing,
        and a loss that sat at exactly 0 (a hinge) has no ratio to it."""
        if self.nonfinite_tail >= ENDING_BLOCK:
            return {"nonfinite_steps": self.nonfinite_tail, "nonfinite_from": self.nonfinite_from,
                    "last_finite_step": self.last_step, "block": ENDING_BLOCK}  # fmt: skip
        if self.silent_tail >= ENDING_BLOCK:
            return {"silent_tensors": self.silent[0], "tensors": self.silent[1], "silent_steps": self.silent_tail,
                    "silent_from": self.silent_from, "names": list(self.silent_names),
                    "block": ENDING_BLOCK}  # fmt: skip
        last = self.last
        if not math.isfinite(last):
            return None
        facts = {"last": last, "last_from": self.last_from, "last_step": self.last_step, "block": ENDING_BLOCK}
        if self.best > 0 and math.isfinite(self.best) and last >= ENDING_RATIO * self.best and not (
            self.start > 0 and self.start < self.best
        ):
            return {**facts, "against": "best", "best": self.best, "best_from": self.best_from,
                    "best_step": self.best_step, "ratio": last / self.best}  # fmt: skip
        if self.start > 0 and last >= ENDING_RATIO * self.start:
            return {**facts, "against": "start", "start": self.start, "start_steps": ENDING_START,
                    "start_step": self.start_step, "ratio": last / self.start}  # fmt: skip
        return None

    def start_out_of_scale(self) -> dict[str, Any] | None:
        """The facts of an ``ending`` event for a fit whose first gradient norm was ``START_OUT_OF_SCALE`` times the
        median of the next ones' or more (at least ten of them with a finite loss) while its loss kept
        ``START_LOSS_KEPT`` of the first step's, ``None`` otherwise: told where no other ending is
        (:meth:`event_details`, :func:`stalled_ending`)."""
        first, after = self.start_norms[:1], self.start_norms[1:]
        if not first or len(after) < 10:
            return None
        typical = statistics.median(after)
        if not (typical > 0 and first[0] >= START_OUT_OF_SCALE * typical):
            return None
        if statistics.median(self.start_losses[1:]) < START_LOSS_KEPT * self.start_losses[0]:
            return None  # the loss came down with the gradients: a problem solved, not a model out of scale
        return {"start_norm": first[0], "typical_norm": typical, "norm_steps": len(after),
                "scale_ratio": first[0] / typical}


def stalled_ending(events: Iterable[Event], ending: LossEnding) -> dict[str, Any] | None:
    """The facts of an ``ending`` event for a run suspected of not learning whose trial found no better rate (and no
    later trial kept a remedy), and whose loss never came below ``NO_PROGRESS_LEVEL`` of its start: it did not come
    down far, and not for want of a lower rate. ``None`` otherwise (a run that came down and went back up, as to a
    harder task, learned: its trial was that of a relapse)."""
    trials = [e for e in events if e["kind"] == "trial"]
    tied = [e for e in trials if _tied_stall(e)]
    if not tied or any(e["details"].get("kept") and e["step"] > tied[-1]["step"] for e in trials):
        return None
    last, start = ending.last, ending.start
    if not (math.isfinite(last) and start > 0 and min(last, ending.best) >= NO_PROGRESS_LEVEL * start):
        return None
    return {"against": "start", "stalled": True, "last": last, "last_from": ending.last_from,
            "last_step": ending.last_step, "start": start, "start_steps": ENDING_START, "start_step": ending.start_step,
            "ratio": last / start, "trial_step": tied[-1]["details"].get("opened_at", tied[-1]["step"]),
            "block": ENDING_BLOCK}  # fmt: skip


def _tied_stall(trial: Event) -> bool:
    """Whether a ``trial`` event is that of a run suspected of not learning whose lower rates did no better: no false
    alarm as others are, since such a run may not be learning all the same (a lower rate is not its cure). A trial
    the fit's end cut short is none: too few batches to tell."""
    details = trial["details"]
    return details.get("signal") == "no_progress" and bool(details.get("false_alarm")) and not _cut_short(trial)


def _cut_short(trial: Event) -> bool:
    """Whether the fit ended before a ``trial`` ran its steps (its verdict then rests on fewer batches)."""
    details = trial["details"]
    planned = details.get("planned_steps")
    return planned is not None and int(details.get("steps", planned)) < int(planned)


def ending_words(facts: Mapping[str, Any]) -> str:
    """The facts of an ``ending`` event in words: how far above its best (or its start) the training loss ended, and
    the two levels with the steps they are the medians of."""
    if "nonfinite_steps" in facts:
        count, first = int(facts["nonfinite_steps"]), int(facts["nonfinite_from"])
        return f"the training loss was inf/NaN on each of the fit's last {count} steps (from step {first} on)"
    if "silent_tensors" in facts:
        names = ", ".join(facts.get("names") or [])
        return (f"the network died: {facts['silent_tensors']} of its {facts['tensors']} parameter tensors got no "
                f"gradient at all on each of the fit's last {facts['silent_steps']} steps (from step "
                f"{facts['silent_from']} on; they had one before){f', among them {names}' if names else ''}: units "
                "whose outputs are 0 for every input (a dead ReLU layer) pass nothing back")
    if "start_norm" in facts:
        return (f"the fit's first step had a gradient norm of {_number(facts['start_norm'])}, "
                f"{facts['scale_ratio']:.3g}x the median of the {facts['norm_steps']} steps after it "
                f"({_number(facts['typical_norm'])}): the model was drawn out of scale (a recurrent matrix, or "
                "layers, drawn too large), or its first updates grew the weights of normalised layers, whose "
                "gradients shrink as they grow (a learning rate too high)")
    last = f"median {_number(facts['last'])} over steps {facts.get('last_from', '?')}-{facts['last_step']}"
    if facts.get("stalled"):
        return (f"the training loss ended at {facts['ratio']:.2g}x where it started ({last}, "
                f"{_number(facts['start'])} over its first {facts['start_steps']} steps), never below half of it, "
                f"and a lower learning rate did no better (the trial of the stall at step {facts['trial_step']})")
    if facts.get("against") == "start":
        return (f"the training loss ended {_ratio(facts['ratio'])} above where it started ({last}, "
                f"{_number(facts['start'])} over its first {facts['start_steps']} steps)")  # fmt: skip
    best = f"{_number(facts['best'])} over steps {facts.get('best_from', '?')}-{facts['best_step']}"
    return f"the training loss ended {_ratio(facts['ratio'])} above its best ({last}, {best})"


def behind_a_restore(events: Iterable[Event], last_step: int) -> tuple[str, dict[str, Any]] | None:
    """The fit ended closer to its last rollback's snapshot than to the step the rollback was made at: the weights
    returned hold less training than the run had then. A certain fault restores without a verdict, so this is said
    in plain words (the message and the facts of a ``behind`` event); ``None`` when the fit trained past it. A
    remedy a trial kept trained from the snapshot while the trial ran (the trial event's ``steps``): its steps count
    as training the weights hold."""
    events = list(events)
    restores = [e for e in events if e["kind"] == "rollback" and e["details"].get("snapshot_step") is not None]
    if not restores:
        return None
    last = restores[-1]
    made, target = int(last["step"]), int(last["details"]["snapshot_step"])
    remedy = 0
    if last["details"].get("source") == "trial":
        trained = [int(e["details"].get("steps") or 0) for e in events
                   if e["kind"] == "trial" and int(e["step"]) == made]  # fmt: skip
        remedy = trained[-1] if trained else 0
    lost, after = made - target - remedy, last_step - made
    if lost <= 0 or after >= lost:
        return None
    origin = "the state the fit started from" if target == last["details"].get("fit_start") else f"step {target}"
    reason = str(last["details"].get("reason", ""))
    because = f" (after {_words(reason)})" if reason else ""
    if remedy:
        message = (
            f"the fit ended {_count(after, 'step')} after the trial at step {made} kept a remedy that restarted from "
            f"{origin}{because}: the weights returned hold the training up to step {target}, the remedy's "
            f"{_count(remedy, 'step')} at a lower learning rate and {_count(after, 'step')} since; the "
            f"{_count(lost + remedy, 'step')} the run had trained past step {target} are not in them"
        )
    else:
        message = (
            f"the fit ended {_count(after, 'step')} after the rollback at step {made} to {origin}{because}: the "
            f"weights returned hold the training up to step {target} and {_count(after, 'step')} since; the "
            f"{_count(lost, 'step')} before the rollback are not in them"
        )
    facts = {"rollback_step": made, "snapshot_step": target, "lost_steps": lost, "steps_after": after}
    return message, {**facts, "remedy_steps": remedy} if remedy else facts


def schedule_behind(events: Iterable[Event], lag: Sequence[tuple[str, int, str]], last_step: int
                    ) -> tuple[str, dict[str, Any]] | None:  # fmt: skip
    """The LR schedulers ended behind the fit (``lag``: each one's class, how far behind and in what, ``"step"``,
    ``"epoch"`` or ``"call"``, from :class:`~lightning_overflow.schedule_lag.ScheduleLag`) after a rollback: the
    message and the facts of a ``schedule_behind`` event; ``None`` without a rollback (a skipped step's hold alone is
    the skip's own)."""
    if not lag or not any(e["kind"] == "rollback" for e in events):
        return None
    steps, epochs, calls = (max((n for _, n, u in lag if u == unit), default=0) for unit in ("step", "epoch", "call"))
    which = ", ".join(f"{name} by {_count(n, unit) if unit != 'call' else f'{n} of its steps'}"
                      for name, n, unit in lag)  # fmt: skip
    more = " and ".join(f"{n} more {unit}{'s' if n > 1 else ''}"
                        for n, unit in ((steps, "step"), (epochs, "epoch")) if n)  # fmt: skip
    if calls:
        more = " and ".join(filter(None, [more, f"until your code has stepped it {_times(calls)} more"]))
    if steps:
        stood = (f"a rollback returns it with the weights and a skipped step holds it while the fit's step count goes "
                 f"on, so at step {last_step} it stood where step {last_step - steps} would have left it")  # fmt: skip
    elif epochs:
        stood = "a rollback returns it with the weights while the fit's epoch count goes on"
    else:
        stood = "a rollback returns it with the weights, while your code steps it as the fit goes on"
    message = (
        f"the learning-rate schedule ended behind the fit ({which}): {stood}; a schedule sized to the fit (a "
        f"OneCycleLR, a warm-up and its decay) has not reached its end: train {more} to finish it"
    )
    schedulers = [{"scheduler": name, "behind": n, **({"unit": unit} if unit != "step" else {})}
                  for name, n, unit in lag]  # fmt: skip
    return message, {"schedulers": schedulers, "behind": steps or epochs or calls}


def plain_lines(events: Iterable[Event]) -> list[str]:
    """One line per finding, in the order the findings began; empty when nothing happened."""
    events = list(events)
    by_kind: dict[str, list[Event]] = {}
    for event in events:
        by_kind.setdefault(str(event["kind"]), []).append(event)
    found: list[tuple[int, str]] = []
    used: set[str] = set()
    position = {id(e): i for i, e in enumerate(events)}
    for kinds, describe in _DESCRIBERS:
        # In the journal's order, whatever their kinds: the last one is how it ended (a backoff after an undo).
        picked = sorted((e for k in kinds for e in by_kind.get(k, [])), key=lambda e: position[id(e)])
        used.update(kinds)
        if picked:
            for line in describe(picked, by_kind):
                found.append((min(int(e["step"]) for e in picked), line))
    # Suspicions left alone for want of a remedy: told by the fit's left_alone event, or by one made here.
    journaled = by_kind.get("left_alone", [])
    alone = None if journaled else left_alone(events)
    if alone is not None:
        found.append((alone[1]["steps"][0], alone[0]))
    told = {int(s) for e in journaled for s in e["details"].get("steps", ())} | set(alone[1]["steps"] if alone else ())
    for kind, picked in by_kind.items():
        unanswered = [e for e in picked if not _answered(e, by_kind)
                      and not (kind in SUSPICION_WORDS and int(e["step"]) in told)]  # fmt: skip
        if kind not in used and kind not in _SILENT and unanswered:
            found.append((int(unanswered[0]["step"]), _generic(kind, unanswered)))
    return [line for _, line in sorted(found, key=lambda item: item[0])]


# ---- the findings -------------------------------------------------------------------------------------------------
def _data_faults(faults: list[Event], by_kind: dict[str, list[Event]]) -> list[str]:
    skipped_steps = {int(e["step"]) for e in by_kind.get("skip", [])}
    skipped = [e for e in faults if int(e["step"]) in skipped_steps]
    if not skipped:  # seen without a skip (a headroom warning): the steps went ahead
        where = _where(faults)
        return [f"{where[0].upper()}{where[1:]} (the step went ahead): a data fault; check the data"]
    # A batch seen by the headroom check only (its loss stayed finite) is not among the skipped steps.
    ahead = [e for e in faults if int(e["step"]) not in skipped_steps]
    batches = "batch" if len(ahead) == 1 else "batches"
    more = f"; {len(ahead)} more such {batches} went ahead ({_at(ahead)}: the loss stayed finite)" if ahead else ""
    if any("values up to" in str(e["details"].get("data", "")) for e in faults):  # huge values, not only NaN
        # Huge values can leave the loss finite: such a batch trains, and is looked at only where the headroom
        # samples a step (NonFiniteDetector's headroom_every_n_steps).
        more += ("; a batch of such values whose loss stays finite is looked at only on the steps the headroom "
                 "samples, so more may have gone ahead")  # fmt: skip
    steps = _count(len({int(e["step"]) for e in skipped}), "step")
    return [f"{steps} skipped: {_where(skipped)}{_faulted(skipped)}{more}: a data fault; check the data"]


def _where(faults: list[Event]) -> str:
    """Where the data faults were: the batch, its epochs, the steps; the first one's rows."""
    first = faults[0]
    details = first["details"]
    batches = {e["details"].get("batch") for e in faults}
    epochs = [int(e.get("epoch", 0)) for e in faults]
    texts = {_without_batch(str(e["details"].get("data", ""))) for e in faults}
    once_an_epoch = len(faults) > 1 and sorted(epochs) == list(range(epochs[0], epochs[0] + len(faults)))
    what = _without_batch(str(details.get("data", ""))) or "holds inf/NaN or values beyond 1e15"
    if len(faults) == 1:
        where = f"batch {details.get('batch')} of epoch {epochs[0]} (step {first['step']}) {what}"
    elif len(batches) == 1 and len(set(epochs)) == 1:  # one batch, the step of each optimizer (manual optimization)
        where = f"batch {details.get('batch')} of epoch {epochs[0]} ({_at(faults)}) {what}"
    elif len(batches) == 1 and len(texts) == 1 and once_an_epoch:
        where = f"batch {details.get('batch')} of each epoch {what} (epochs {epochs[0]}-{epochs[-1]})"
    elif len(batches) == 1 and len(texts) == 1:
        where = f"batch {details.get('batch')} {what} (epochs {_list(sorted(set(epochs)))})"
    else:
        recurs = (f"once an epoch in epochs {epochs[0]}-{epochs[-1]}, in a different batch each time (shuffled)"
                  if once_an_epoch and len(batches) > 1 else f"at {_at(faults)}")  # fmt: skip
        where = (f"batches hold inf/NaN or values beyond 1e15 {recurs}; the first, batch {details.get('batch')} of "
                 f"epoch {epochs[0]} (step {first['step']}), {what}")  # fmt: skip
    return where


def _nonfinite(found: list[Event], by_kind: dict[str, list[Event]]) -> list[str]:
    lines = []
    for where, words in (("loss", "the loss was inf/NaN"), ("grad", "the gradients held inf/NaN or overflowed"),
                         ("weight", "the weights held inf/NaN"), ("optimizer_state", "the optimizer state held inf/NaN")):  # fmt: skip
        picked = [e for e in found if e["details"].get("where") == where]
        if not picked:
            continue
        skipped = _skipped(picked, by_kind)
        done = f"{_count(skipped, 'step')} skipped" if skipped else f"{_count(len(picked), 'step')} found"
        verdicts = Counter(str((e["details"].get("diagnosis") or {}).get("verdict", "")) for e in picked)
        why = _diagnosis_words(picked, verdicts)
        lines.append(f"{done}: {words} at {_at(picked)}{_faulted(picked)}{why}")
    return lines


def _below_one(factor: float) -> str:
    """A factor below 1 to three significant digits, or to as many as it takes not to read as 1.

    Example:
        >>> _below_one(0.25), _below_one(0.99962)
        ('0.25', '0.9996')
    """
    for digits in (3, 4, 5, 6):
        text = f"{factor:.{digits}g}"
        if factor >= 1 or float(text) < 1:
            return text
    return text


def _faulted(events: list[Event]) -> str:
    """How many of the steps broke before they had a loss (the module raised on the bad values, or cut its loss from
    the graph), which the detector answered as inf/NaN losses: empty when none did."""
    told = Counter(str(e["details"]["faulted"]) for e in events if e["details"].get("faulted"))
    if not told:
        return ""
    how, count = told.most_common(1)[0]
    if len(events) == 1:
        return f" ({how}, answered as an inf/NaN loss)"
    which = "on each" if count == len(events) else f"on {count} of them"
    return f" ({how} {which}, answered as inf/NaN losses)"


def _diagnosis_words(picked: list[Event], verdicts: Counter[str]) -> str:
    parts = []
    for verdict, words in (("persistent", "reproduced on replay: the data or the model"),
                           ("transient", "not reproduced on replay: a hardware fault, a nondeterministic kernel or a "
                                         "race")):  # fmt: skip
        if verdicts.get(verdict):
            share = "" if verdicts[verdict] == len(picked) else f"{verdicts[verdict]} of {len(picked)} "
            parts.append(share + words)
    origin = next((d["origin"] for e in picked if (d := e["details"].get("diagnosis") or {}).get("origin")), None)
    if origin:
        module = origin.get("module")
        # Named as the diagnosis names it: outside every module, the code that computed the loss (training_step, or
        # a plain loop's loss_fn); "" is the root module.
        where = (origin.get("outside") or "training_step") if module is None else (module or "the root module")
        parts.append(f"first in {where} ({origin.get('op')}, {origin.get('direction')} pass)")
    hint = next((d["hint"] for e in picked if (d := e["details"].get("diagnosis") or {}).get("hint")), "")
    text = f" ({'; '.join(parts)})" if parts else ""
    return f"{text}; try: {hint}" if hint else text


def _spikes(spikes: list[Event], by_kind: dict[str, list[Event]]) -> list[str]:
    steps = sorted({int(e["step"]) for e in spikes})
    clipped = {int(e["step"]) for e in by_kind.get("clip", [])} & set(steps)
    skipped = {int(e["step"]) for e in by_kind.get("skip", [])} & set(steps)
    done = []
    if clipped:
        done.append(f"{len(clipped)} clipped by AutoClip")
    if skipped:
        done.append(f"{len(skipped)} skipped")
    left = len(steps) - len(clipped | skipped)
    if left:
        done.append(f"{left} left alone (a spike alone is no divergence)")
    return [f"{_count(len(steps), 'loss or gradient spike')} at {_at(spikes)}: {', '.join(done)}"]


def _clips(found: list[Event], by_kind: dict[str, list[Event]]) -> list[str]:
    """The clips: the deepest journaled one by one (``clip``), and the fit's count of all of them (``clips``, at its
    end); those at a spike's step are told by the spike's line."""
    spiking = {int(e["step"]) for e in by_kind.get("spike", [])}
    clips = [e for e in found if e["kind"] == "clip"]
    alone = [e for e in clips if int(e["step"]) not in spiking]
    totals = [e for e in found if e["kind"] == "clips"]
    if totals:
        total = sum(int(e["details"].get("clipped", 0)) for e in totals) - (len(clips) - len(alone))
    else:
        total = len(alone) + sum(int(e["details"].get("not_journaled", 0) or 0) for e in alone)
    if total <= 0:
        return []
    if not alone:  # none deep enough to journal: say how far they went
        smallest = min(float(e["details"].get("smallest_coef", 1.0)) for e in totals)
        return [f"{_count(total, 'step')} clipped by AutoClip (the gradient norm above its threshold; the deepest "
                f"clip scaled the gradients by {_below_one(smallest)})"]  # fmt: skip
    # An agc threshold is a ratio of norms per unit, not a norm: its clips have no "x the threshold" to tell.
    ratios = [float(e["details"]["grad_norm"]) / float(e["details"]["threshold"]) for e in alone
              if e["details"].get("mode") != "agc" and _finite(e["details"].get("grad_norm"))
              and _finite(e["details"].get("threshold"))]  # fmt: skip
    most = f", up to {max(ratios):.3g}x its clip threshold" if ratios else ""
    # Only the deeper clips are journaled one by one (CLIP_EVENT_BELOW): where there were more, those are named so.
    where = f", the deepest at {_at(alone)}" if total > len(alone) else f" at {_at(alone)}"
    return [f"{_count(total, 'step')} clipped by AutoClip{where} (the gradient norm an outlier{most})"]


def _rebaselines(found: list[Event], by_kind: dict[str, list[Event]]) -> list[str]:
    lines = []
    for source in sorted({str(e["source"]) for e in found}):
        for what, words in (("grad_norm", "gradient-norm"), ("loss", "loss")):
            picked = [e for e in found if e["source"] == source and e["details"].get("what", "grad_norm") == what]
            if picked:
                lines.append(f"{source} started its {words} statistics afresh {_times(len(picked))} ({_at(picked)}): "
                             f"the {words.replace('-', ' ')} moved to a new level and stayed there")  # fmt: skip
    return lines


def _trials(trials: list[Event], by_kind: dict[str, list[Event]]) -> list[str]:
    kept = [e for e in trials if e["details"].get("kept")]
    false = [e for e in trials if e["details"].get("false_alarm")]
    # A trial that a certain fault ended before its verdict has no comparisons; the fault's answer is told apart.
    reshaped = [e for e in trials if e["details"].get("layout_change")]
    faulted = [e for e in trials if not e["details"].get("kept") and "comparisons" not in e["details"]
               and e not in reshaped]  # fmt: skip
    other = len(trials) - len(kept) - len(false) - len(faulted) - len([e for e in reshaped if e not in kept])
    extra = sum(int(e["details"].get("extra_steps", 0) or 0) for e in trials)
    signals = Counter(_words(str(e["details"].get("signal"))) for e in trials)
    why = "; ".join(f"{words} ({n}x)" if n > 1 else words for words, n in signals.items())
    outcome = []
    if kept:
        steps = ", ".join(f"step {e['step']}: learning rate x{e['details'].get('kept_lr_factor'):g}"
                          + (f" from the snapshot of step {e['details']['snapshot_step']}"
                             if e["details"].get("snapshot_step") is not None else "")
                          for e in kept[:MAX_STEPS])  # fmt: skip
        outcome.append(f"{len(kept)} kept the remedy ({steps})")
    stalled = [e for e in false if _tied_stall(e)]
    short = [e for e in false if _cut_short(e)]
    if stalled:
        outcome.append(f"{len(stalled)} where a lower learning rate did no better (the run went on untouched)")
    if short:
        outcome.append(f"{len(short)} cut short by the fit's end, nothing better found in the steps it had (the run "
                       "went on untouched)")
    if len(false) > len(stalled) + len(short):
        n = len(false) - len(stalled) - len(short)
        outcome.append(f"{n} false alarm{'s' if n > 1 else ''} (the run went on untouched)")
    if faulted:
        outcome.append(f"{len(faulted)} ended by a certain fault before a verdict (answered at once)")
    if reshaped:
        outcome.append(f"{len(reshaped)} ended before a verdict when the model's parameters changed (as pruning "
                       "does): the state on the side no longer fitted the model")
    if other:  # a follow-up or a scheduled check that kept the run as it was; the fit's end may have cut it short
        cut = sum(_cut_short(e) for e in trials if e not in kept and e not in false and e not in faulted
                  and e not in reshaped)  # fmt: skip
        if other - cut:
            outcome.append(f"{other - cut} kept the run as it was (the remedy was no better)")
        if cut:
            outcome.append(f"{cut} kept the run as it was, cut short by the fit's end (too few steps to tell)")
    # A follow-up (rung 2 and on) tries the same suspicion again at a lower rate: one suspicion, several trials.
    suspicions = sum(str(e["details"].get("signal")) not in (SCHEDULED, REGROWTH) and e["details"].get("rung", 1) == 1
                     for e in trials)  # fmt: skip
    follow_ups = sum(int(e["details"].get("rung", 1)) > 1 for e in trials)
    tested = [f"{_count(suspicions, 'suspicion')}"] if suspicions else []
    if follow_ups:
        tested.append(_count(follow_ups, "lower-rate follow-up"))
    for kind, words in ((SCHEDULED, "scheduled check"), (REGROWTH, "higher-rate test")):
        if n := sum(str(e["details"].get("signal")) == kind for e in trials):
            tested.append(_count(n, words))
    return [f"{' and '.join(tested)} tried against doing nothing on the same unseen batches ({why}): "
            f"{', '.join(outcome)}; the trials cost {extra} extra steps of compute"]  # fmt: skip


def _learning_rate(changes: list[Event], by_kind: dict[str, list[Event]]) -> list[str]:
    lines = []
    for index in sorted({int(e["details"].get("optimizer", 0)) for e in changes}):
        own = [e for e in changes if int(e["details"].get("optimizer", 0)) == index]
        backoffs = [e for e in own if e["kind"] == "backoff"]
        last = own[-1]
        scale = float(last["details"].get("scale", 1.0))
        lrs = last["details"].get("lrs") or []
        which = f" of optimizer {index}" if len({int(e["details"].get("optimizer", 0)) for e in changes}) > 1 else ""
        count = f"{_times(len(backoffs))} ({_at(backoffs)})" if backoffs else ""
        back = [f"learning rate{which} backed off {count}".rstrip()] if backoffs else [f"learning rate{which} changed"]
        if any(e["kind"] == "regrowth" for e in own):
            back.append(f"regrown {_times(sum(e['kind'] == 'regrowth' for e in own))}")
        if any(e["kind"] == "undo" for e in own):
            back.append(f"taken back {_times(sum(e['kind'] == 'undo' for e in own))}")
        # A rollback at or after that change put the schedule back to its snapshot's step: the rates the run went on
        # with are those the rollback found once it was done.
        when = last["step"]
        restarts = [r for r in by_kind.get("rollback", []) if int(r["step"]) >= int(when)]
        if restarts:
            rates = restarts[-1]["details"].get("lrs") or []
            lrs, when = (rates[index] if index < len(rates) else []), restarts[-1]["step"]
        if scale < 1:
            now = f" ({_lrs(lrs)} at step {when})" if lrs else ""
            floor = ", its floor (min_scale): no backoff went lower" if _at_floor(last["details"]) else ""
            ending = f"ends at {scale:g}x its schedule{now}{floor}: consider starting at {scale:g}x the learning rate"
        else:
            ending = f"is back to its schedule from step {last['step']}"
        lines.append(f"{', '.join(back)}; it {ending}")
    return lines


def _rollbacks(rollbacks: list[Event], by_kind: dict[str, list[Event]]) -> list[str]:
    parts = []
    for e in rollbacks[:MAX_STEPS]:
        details = e["details"]
        reason = str(details.get("reason", ""))
        target = details.get("snapshot_step")
        start = " (where the fit started)" if target is not None and target == details.get("fit_start") else ""
        parts.append(f"at step {e['step']} to the snapshot of step {target}{start}"
                     + (f" after {_words(reason)}" if reason else ""))  # fmt: skip
    more = f"; +{len(rollbacks) - MAX_STEPS} more" if len(rollbacks) > MAX_STEPS else ""
    left = rollbacks[-1]["details"].get("budget_left")
    budget = f" ({left} more allowed at this learning rate)" if left is not None else ""
    return [f"rolled back {_times(len(rollbacks))}{budget}: {'; '.join(parts)}{more}"]


def _endings(endings: list[Event], by_kind: dict[str, list[Event]]) -> list[str]:
    acted = any(by_kind.get(k) for k in ("skip", "backoff", "rollback", "clip"))
    last = endings[-1]
    details = last.get("details") or {}
    message = ending_words(details) if _ending_facts(details) else str(last["message"])
    after = ", after what the suite did above" if acted else ""
    if details.get("stalled"):
        # Only lower rates were tried: a rate far too low ties as well, unless the run showed its rate was high.
        higher = "" if any(by_kind.get(k) for k in ("skip", "backoff", "rollback")) else (
            ", or try a higher learning rate (only lower ones were tried: at a rate far too low they tie as well)")
        return [f"{message}: a rate too high is not why it stalled; if it should come down further, look at the "
                f"model, its initialisation or the data{higher}"]  # fmt: skip
    if "start_norm" in details:
        return [f"{message}. A run that starts so can end far above what the same model drawn right reaches: compare "
                "its loss with such a run's, and draw the weights smaller (std = gain / sqrt(fan_in); an orthogonal "
                "recurrent matrix of gain 1), or lower the learning rate or warm it up"]
    if "silent_tensors" in details:
        return [f"{message}{after}: it learns no more, and its weights are not worth keeping; try a lower learning "
                "rate, a smaller initialisation (std = gain / sqrt(fan_in)) or a normalisation layer between the "
                "layers"]
    return [f"{message}{after}: look at the loss curve before using these weights; if the data did not change, try a "
            f"lower learning rate"]


def _ending_facts(details: Mapping[str, Any]) -> bool:
    """Whether an ``ending`` event's details hold what :func:`ending_words` needs (older journals' do not all)."""
    if "nonfinite_steps" in details:
        return "nonfinite_from" in details
    if "silent_tensors" in details:
        return all(key in details for key in ("tensors", "silent_steps", "silent_from"))
    if "start_norm" in details:
        return all(key in details for key in ("typical_norm", "norm_steps", "scale_ratio"))
    if details.get("stalled"):
        return all(key in details for key in ("last", "last_step", "ratio", "start", "start_steps", "trial_step"))
    needed = ("last", "last_step", "ratio", "start", "start_steps") if details.get("against") == "start" else (
        "last", "last_step", "ratio", "best", "best_step")  # fmt: skip
    return all(key in details for key in needed)


def left_alone(events: Iterable[Event]) -> tuple[str, dict[str, Any]] | None:
    """Suspicions that nothing answered because the suite had nothing left to answer with: the learning rate was
    already at its floor (a ``backoff`` or ``undo`` event whose details hold the ``floor``), or the rollback budget
    was spent (a ``rollback`` whose ``budget_left`` was 0). Such a run was left to go on as it was, and it is said
    in plain words (the message and the facts of a ``left_alone`` event); ``None`` when there are none."""
    events = list(events)
    by_kind: dict[str, list[Event]] = {}
    for event in events:
        by_kind.setdefault(str(event["kind"]), []).append(event)
    alone: list[tuple[Event, str, Event]] = []  # (the suspicion, why nothing answered it, the event that says why)
    for index, event in enumerate(events):
        if event["kind"] not in SUSPICION_WORDS or event["kind"] in (SCHEDULED, REGROWTH) or _answered(event, by_kind):
            continue
        before = [e for e in events[:index] if e["kind"] in ("backoff", "undo", "rollback")]
        rate = next((e for e in reversed(before) if e["kind"] in ("backoff", "undo")), None)
        restore = next((e for e in reversed(before) if e["kind"] == "rollback"), None)
        if rate is not None and _at_floor(rate["details"]):
            alone.append((event, "lr_floor", rate))
        elif restore is not None and restore["details"].get("budget_left") == 0:
            alone.append((event, "rollback_budget", restore))
    if not alone:
        return None
    steps = [int(e["step"]) for e, _, _ in alone]
    signals = list(dict.fromkeys(str(e["kind"]) for e, _, _ in alone))
    _, why, cause = alone[-1]
    whats = "; ".join(_words(kind) for kind in signals)
    count = _count(len(alone), "suspicion")
    if why == "lr_floor":
        scale = float(cause["details"].get("scale", math.nan))
        reason = (f"the learning rate was already at its floor ({scale:g}x its schedule), the lowest LRBackoff may "
                  f"set; try starting at a lower learning rate")  # fmt: skip
        facts: dict[str, Any] = {"why": why, "scale": scale, "floor": cause["details"].get("floor")}
    else:
        reason = (f"Rollback had spent its budget (its last allowed rollback was at step {cause['step']}); try a "
                  f"lower learning rate, or more rollbacks (Rollback(max_rollbacks=...))")  # fmt: skip
        facts = {"why": why, "rollback_step": int(cause["step"])}
    message = f"{count} left alone at {_at([e for e, _, _ in alone])} ({whats}): {reason}"
    return message, {**facts, "steps": steps, "signals": signals}


def _at_floor(details: Mapping[str, Any]) -> bool:
    floor, scale = details.get("floor"), details.get("scale")
    return _finite(floor) and _finite(scale) and at_floor(float(scale), float(floor))


def _left_alone(found: list[Event], by_kind: dict[str, list[Event]]) -> list[str]:
    return [str(found[-1]["message"]).removeprefix("lightning_overflow: ")]


def _aborts(aborts: list[Event], by_kind: dict[str, list[Event]]) -> list[str]:
    last = aborts[-1]
    message = str(last.get("message", "")).removeprefix(f"{last.get('source')}: ")
    return [f"the suite stopped the fit at step {last['step']} ({last.get('source')}): {message}"]


def _generic(kind: str, events: list[Event]) -> str:
    message = str(events[0].get("message", "")).rstrip(".")
    for prefix in ("lightning_overflow: ",) + tuple(f"{e.get('source')}: " for e in events[:1]):
        message = message.removeprefix(prefix)
    more = f" ({_times(len(events))}, {_at(events)})" if len(events) > 1 else ""
    # A suspicion no trial, backoff or rollback answered (none could run, or none acts on it at once): said so.
    told = "; told only, nothing was done about it" if kind in SUSPICION_WORDS else ""
    return f"{message}{more}{told}"


_DESCRIBERS: tuple[tuple[tuple[str, ...], Callable[[list[Event], dict[str, list[Event]]], list[str]]], ...] = (
    (("data_fault",), _data_faults),
    (("nonfinite",), _nonfinite),
    (("spike",), _spikes),
    (("clip", "clips"), _clips),
    (("rebaseline",), _rebaselines),
    (("trial",), _trials),
    (("backoff", "regrowth", "undo"), _learning_rate),
    (("rollback",), _rollbacks),
    (("left_alone",), _left_alone),
    (("ending",), _endings),
    (("abort",), _aborts),
)
# Told by another finding's line: a skip by its cause's; a suspicion by its trial's, a remedy's or its own message.
_SILENT = {"skip"}


# ---- words --------------------------------------------------------------------------------------------------------
def _words(signal: str) -> str:
    return _WORDS.get(signal) or signal.replace("_", " ")


def _answered(event: Event, by_kind: Mapping[str, list[Event]]) -> bool:
    """Whether a suspicion's event is told by the line of what answered it."""
    return event["kind"] in SUSPICION_WORDS and answered_at(int(event["step"]), by_kind)


def answered_at(step: int, by_kind: Mapping[str, list[Event]]) -> bool:
    """Whether the suite answered a suspicion raised at ``step`` (``by_kind``: the journal's events by kind): a trial
    opened by it or under way when it came, whose verdict it waited for, or a remedy taken at once for it (a backoff
    or undo at that step, a rollback it triggered)."""
    opened = [(e.get("details", {}).get("opened_at"), int(e["step"])) for e in by_kind.get("trial", [])]
    return (
        any(start is not None and int(start) <= step <= end for start, end in opened)
        or any(e.get("details", {}).get("trigger_step") == step for e in by_kind.get("rollback", []))
        or any(int(e["step"]) == step for k in ("backoff", "undo") for e in by_kind.get(k, []))
    )


def _skipped(found: list[Event], by_kind: dict[str, list[Event]]) -> int:
    steps = {int(e["step"]) for e in found}
    return len(steps & {int(e["step"]) for e in by_kind.get("skip", [])})


def _without_batch(text: str) -> str:
    """``"batch 11 holds NaN in row 3"`` -> ``"holds NaN in row 3"`` (the batch is said apart)."""
    _, sep, tail = text.partition(" holds ")
    return f"holds {tail}" if sep else text


def _at(events: Sequence[Event]) -> str:
    """``"step 3"`` or ``"steps 3, 5"``."""
    steps = sorted({int(e["step"]) for e in events})
    return f"step{'s' if len(steps) > 1 else ''} {_list(steps)}"


def _list(values: Sequence[int]) -> str:
    shown = ", ".join(map(str, values[:MAX_STEPS]))
    return shown + (f", ... ({len(values)} in all)" if len(values) > MAX_STEPS else "")


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _times(n: int) -> str:
    return "once" if n == 1 else "twice" if n == 2 else f"{n} times"


def _lrs(lrs: Sequence[Any]) -> str:
    values = sorted({float(v) for v in lrs})
    return ", ".join(f"{v:.3g}" for v in values)


def _number(value: Any) -> str:
    """A loss level, 4 significant digits, exponents written short: ``0.1234``, ``1.5e6``."""
    return _short_exponent(f"{float(value):.4g}")


def _ratio(value: Any) -> str:
    """How many times: ``"12.3x"``, ``"3.2e5x"``."""
    value = float(value)
    return _short_exponent(f"{value:.3g}" if value < 1e4 else f"{value:.2g}") + "x"


def _short_exponent(text: str) -> str:
    mantissa, sep, exponent = text.partition("e")
    return f"{mantissa}e{int(exponent)}" if sep else text


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
