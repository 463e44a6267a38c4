"""Rescue benchmark: do the runs survive? Divergence scenarios x protection methods x seeds, side by side.

Every scenario of ``rescue_scenarios.py`` (tiny models, seconds per run on a CPU) is trained by every method, for
every seed, and judged by its final evaluation on clean held-out data:

- **ended finite**: the final evaluation loss is finite;
- **within reference**: the final evaluation is at most 1.5x the family's reference, the best final evaluation over
  the seeds of the same model trained unprotected, at the stable LR, without the fault (each scenario names its
  reference run). A run that raised is judged on the model it left;
- **raised**: ``trainer.fit`` raised (type and the first line of the message are kept);
- steps completed, and the counts of skip / backoff / rollback / abort events from the suite's journal
  (``overflow_events.jsonl`` in the run's log directory);
- the trials: a suspicion of divergence opens a trial, where the run as it is and remedies (the last verified
  snapshot at lower learning rates) train side by side on the same batches. From the journal's ``trial`` events: how
  many ran, how many kept a remedy, how many were false alarms, and the extra optimizer steps they cost.

Some scenarios are harmless: nothing needed doing (a change of task, a stretch of noise labels, input spikes that
Adam takes in, warm restarts, rising label noise, a hinge loss at 0, a healthy schedule, small batches). Each is its
own reference, and each method's run is also compared with the unprotected run of the same seed.

Methods: ``unprotected``; ``Trainer(gradient_clip_val=1.0)`` (under manual optimization, where Lightning refuses
that argument, the module calls ``self.clip_gradients`` with the same value before each step); ZClip's Lightning
callback (PyPI ``zclip``, defaults); ARC's Lightning callback (PyPI ``arc-training``,
``arc.api.integrations.LightningCallback``, defaults, quiet); ``NonFiniteDetector()``; ``AutoClip()``;
``default_callbacks()``. ``default_callbacks(clip=None)`` also runs on the stable scenarios, for the check that
the detectors, backoff and rollback leave a healthy run bit-identical.

It prints a markdown table per scenario, the summary (method | ended finite | within reference | raised), the
trials (method | trials | kept | false alarms | extra steps, and their share of the steps), the harmless runs (per
scenario and seed, each method's final evaluation over the unprotected run's) and the targets as PASS/FAIL lines:

1. ``default_callbacks()`` is within reference on at least 90% of the runs (85% on the held-out matrix), and on more
   runs than every peer;
2. it never raises on a (scenario, seed) that some peer finishes within reference;
3. it is never worse than ``NonFiniteDetector()`` or ``AutoClip()`` alone (where either is within reference on a
   run, so is the composition);
4. a stable LR is unchanged: ``default_callbacks(clip=None)`` ends bit-identical to the unprotected run on every
   stable scenario and seed where it kept no trial's remedy (a kept remedy changes the run on purpose: those runs
   are listed, not failed), and ``default_callbacks()`` and ``AutoClip()`` end within 1.02x of its evaluation;
5. harmless runs are left alone: on every harmless scenario, seed by seed, ``default_callbacks()`` ends within 1.05x
   of the unprotected run's final evaluation (a pair whose unprotected run ended non-finite is skipped, saying so).

``--held-out`` runs the held-out matrix (``HELD_OUT`` of ``rescue_scenarios.py``) instead: the same families at
other magnitudes (other learning rates, spike and poison factors, fault steps, epoch lengths), each scored against
its family's reference, to check that what passes the matrix was not tuned to its exact numbers.

The peers are optional, listed in the ``bench`` extra and installed with
``pip install --no-deps zclip arc-training scipy`` (``--no-deps`` keeps their own pins out of the environment; they
are never dependencies of the package). A peer that is not installed is skipped with a line saying so.

Run (from the repository root; the package must be importable, e.g. ``pip install -e .`` or ``PYTHONPATH=.``):

    python benchmarks/rescue.py --quick --workers 2    # one seed, ten scenarios, half the steps: 74 runs, ~20 s
                                                       # of CPU (40 s wall on 2 idle cores)
    python benchmarks/rescue.py --workers 2 --json rescue.json --png rescue.png
                                                       # 34 scenarios x 7 methods x 3 seeds + references: 753 runs,
                                                       # ~5.5 min of CPU (3 min wall on 2 idle cores)
    python benchmarks/rescue.py --held-out --workers 2  # the held-out matrix, 22 scenarios x 7 methods x 3 seeds +
                                                       # references: 489 runs, ~3.5 min of CPU (2 min wall on 2 idle
                                                       # cores); with --quick: 52 runs, 35 s wall
    python benchmarks/rescue.py --set hard --workers 2   # the hard matrix (HARD of rescue_scenarios.py): the
                                                       # classes of runs the suite still lost and their harmless
                                                       # twins; --set hard-held-out: the same at other magnitudes
    python benchmarks/rescue.py --scenarios nan_weight,hinge_at_zero --methods "unprotected,default_callbacks()"
    python benchmarks/rescue.py --workers 2 --first-seed 3 --methods "default_callbacks()"   # seeds 3-5, ours only
    python benchmarks/rescue.py --report rescue.json --png rescue.png    # print and draw saved results again
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import logging
import math
import os
import platform
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import pytorch_lightning as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # rescue_scenarios beside this file, however it is run

from rescue_scenarios import HARD_HELD_OUT, HELD_OUT, SCENARIOS, SETS, Benchmarked, Scenario, scenario  # noqa: E402

from lightning_overflow import AutoClip, NonFiniteDetector, TrialConfig, default_callbacks, read_journal  # noqa: E402
from lightning_overflow.testing import FaultInjector  # noqa: E402

WITHIN = 1.5  # "within reference": final evaluation at most this many times the reference
STABLE_TOLERANCE = 1.02  # AutoClip may move a stable run's final evaluation by at most this factor
HARMLESS_TOLERANCE = 1.05  # default_callbacks() may move a harmless run's final evaluation by at most this factor
TARGET_SHARE = 0.90  # default_callbacks() within reference on at least this share of the runs
HELD_OUT_SHARE = 0.85  # the same on the held-out matrix, whose magnitudes nothing was tuned on
SEEDS = (0, 1, 2)
JOURNAL_KINDS = ("skip", "backoff", "rollback", "abort")
OURS = "default_callbacks()"
PARTS = ("NonFiniteDetector()", "AutoClip()")
BIT_IDENTICAL = "default_callbacks(clip=None)"  # run on stable scenarios only
# Variants of the suite's trials, run on request (--methods): frozen trials, suspicions acted on at once, and the
# opt-in scheduled trials.
FROZEN = 'default_callbacks(trial=TrialConfig(mode="frozen"))'
AT_ONCE = "default_callbacks(trial=None)"
SCHEDULED_TRIALS = "default_callbacks(trial=TrialConfig(every_n_steps=100))"
MAX_EVENTS = 40  # journal events kept per run in the JSON (skips are only counted)


# ---- methods --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Method:
    """A way to protect a run: the callbacks it adds and the Trainer arguments it sets.

    Attributes:
        name: the key, as printed.
        callbacks: a fresh list of callbacks for one run.
        clip_val: ``gradient_clip_val`` (the module clips by hand under manual optimization).
        requires: the modules it imports (a peer is skipped when one is missing), with the install line.
        peer: a method from outside the suite.
    """

    name: str
    callbacks: Callable[[], list[Any]] = list
    clip_val: float | None = None
    requires: tuple[str, ...] = ()
    install: str = ""
    peer: bool = False


def _zclip() -> list[Any]:
    from zclip import ZClipLightningCallback

    return [ZClipLightningCallback()]


def _arc() -> list[Any]:
    from arc.api.integrations import LightningCallback

    return [LightningCallback(verbose=False)]


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("unprotected", peer=True),
        Method("gradient_clip_val=1.0", clip_val=1.0, peer=True),
        Method("ZClip", _zclip, requires=("zclip", "lightning"), install="pip install --no-deps zclip", peer=True),
        Method("ARC", _arc, requires=("arc", "scipy"), install="pip install --no-deps arc-training scipy", peer=True),
        Method("NonFiniteDetector()", lambda: [NonFiniteDetector()]),
        Method("AutoClip()", lambda: [AutoClip()]),
        Method(OURS, default_callbacks),
        Method(BIT_IDENTICAL, lambda: default_callbacks(clip=None)),
        Method(FROZEN, lambda: default_callbacks(trial=TrialConfig(mode="frozen"))),
        Method(AT_ONCE, lambda: default_callbacks(trial=None)),
        Method(SCHEDULED_TRIALS, lambda: default_callbacks(trial=TrialConfig(every_n_steps=100))),
    )
}
MATRIX_METHODS = tuple(name for name in METHODS if name not in (BIT_IDENTICAL, FROZEN, AT_ONCE, SCHEDULED_TRIALS))


def missing(method: Method) -> list[str]:
    """The modules ``method`` needs that are not installed."""
    return [module for module in method.requires if importlib.util.find_spec(module) is None]


# ---- one run --------------------------------------------------------------------------------------------------------
@dataclass
class Run:
    """What one (scenario, method, seed) run did. ``ratio`` and ``within_reference`` are set once the family's
    reference is known. ``trials``, ``remedies_kept``, ``false_alarms`` and ``extra_steps`` sum up the journal's
    trials (:func:`trial_counts`)."""

    scenario: str
    family: str
    method: str
    seed: int
    max_steps: int
    steps: int = 0
    final_eval: float = math.nan
    ended_finite: bool = False
    raised: str | None = None
    journal: dict[str, int] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    trials: int = 0
    remedies_kept: int = 0
    false_alarms: int = 0
    extra_steps: int = 0
    digest: str = ""
    wall_s: float = 0.0
    cpu_s: float = 0.0
    ratio: float = math.nan
    within_reference: bool = False


def quiet() -> None:
    """Keep a run's console to what the benchmark prints: the journal holds what happened."""
    for name in ("pytorch_lightning", "lightning.pytorch", "lightning.fabric", "lightning_fabric", "arc",
                 "lightning_overflow"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.simplefilter("ignore")


def configure_process() -> None:
    """One thread per run (runs go in parallel in processes instead) and denormals flushed (a CPU run can be
    several times slower without it). Process-wide and lasting, so only the benchmark's own processes call it:
    :func:`main` and each worker, never :func:`run_one` (a test calling it would change every later test)."""
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    quiet()


def weights_digest(module: torch.nn.Module) -> str:
    """SHA-256 of every tensor of the module's state, in order: equal digests mean bit-identical weights."""
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class TrialCounts(NamedTuple):
    """What a run's trials did: how many ran, how many kept a remedy, how many were false alarms (the suspicion
    was not confirmed), and the extra optimizer steps of compute they cost."""

    trials: int
    remedies_kept: int
    false_alarms: int
    extra_steps: int


def trial_counts(events: Iterable[Mapping[str, Any]]) -> TrialCounts:
    """Sum up the ``trial`` events of a journal; the other events are ignored."""
    details = [e.get("details") or {} for e in events if e["kind"] == "trial"]
    return TrialCounts(
        len(details),
        sum(bool(d.get("kept")) for d in details),
        sum(bool(d.get("false_alarm")) for d in details),
        sum(int(d.get("extra_steps", 0)) for d in details),
    )


def _journal(log_dir: Path) -> list[dict[str, Any]]:
    path = log_dir / "overflow_events.jsonl"
    return list(read_journal(path)) if path.exists() else []


def _record_journal(run: Run, events: Sequence[dict[str, Any]]) -> None:
    """Keep what the journal says: the count of each kind, the events worth reading (skips are only counted), and
    the trials' sums."""
    run.journal = dict(Counter(str(e["kind"]) for e in events))
    run.events = [
        {"step": e["step"], "kind": e["kind"], "source": e.get("source", ""), "message": str(e.get("message"))[:400]}
        for e in events
        if e["kind"] != "skip"
    ][:MAX_EVENTS]
    run.trials, run.remedies_kept, run.false_alarms, run.extra_steps = trial_counts(events)


def run_one(scenario_name: str, method_name: str, seed: int, steps: int | None = None) -> Run:
    """Train ``scenario_name`` protected by ``method_name`` with ``seed`` for ``steps`` (default: the scenario's).

    Raises:
        ValueError: an unknown scenario or method.
    """
    spec, method = scenario(scenario_name), _method(method_name)
    budget = spec.steps if steps is None else steps
    run = Run(spec.name, spec.family, method.name, seed, budget)
    start_wall, start_cpu = time.perf_counter(), time.process_time()
    model: Benchmarked = spec.build(seed)
    callbacks = method.callbacks()
    if spec.faults:
        callbacks.append(FaultInjector(*spec.faults))
    trainer_clip = None
    if method.clip_val is not None:
        if model.automatic_optimization:
            trainer_clip = method.clip_val
        else:
            model.clip_manually = method.clip_val
    with tempfile.TemporaryDirectory(prefix="rescue-") as root:
        trainer = pl.Trainer(
            max_steps=budget, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root,
            gradient_clip_val=trainer_clip, callbacks=callbacks,
        )  # fmt: skip
        try:
            trainer.fit(model)
        except Exception as error:  # a run that raises is a result, whatever the error
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
            run.raised = f"{type(error).__name__}: {first_line}"[:300]
        _record_journal(run, _journal(Path(trainer.log_dir or root)))
    run.wall_s, run.cpu_s = time.perf_counter() - start_wall, time.process_time() - start_cpu
    run.steps = int(trainer.global_step)
    run.final_eval = model.evaluation_loss()
    run.ended_finite = math.isfinite(run.final_eval)
    run.digest = weights_digest(model)
    return run


def _method(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"'method' must be one of {', '.join(map(repr, METHODS))} (got {name!r})")
    return METHODS[name]


def _run_task(task: tuple[str, str, int, int | None]) -> Run:
    return run_one(*task)


# ---- the matrix -----------------------------------------------------------------------------------------------------
@dataclass
class Results:
    """The runs of a matrix, the references of its families, and what was left out."""

    runs: list[Run]
    references: dict[str, float]  # family -> best unprotected final evaluation of its reference scenario
    reference_runs: dict[str, str]  # family -> the reference scenario
    scenarios: list[str]
    methods: list[str]
    seeds: list[int]
    skipped: list[str] = field(default_factory=list)

    def matrix_runs(self, method: str | None = None) -> list[Run]:
        """The runs of the matrix proper (not the reference-only scenarios nor the bit-identity runs)."""
        return [
            r for r in self.runs
            if r.scenario in self.scenarios and r.method in self.methods and (method is None or r.method == method)
        ]  # fmt: skip

    def get(self, scenario_name: str, method: str, seed: int) -> Run | None:
        for r in self.runs:
            if (r.scenario, r.method, r.seed) == (scenario_name, method, seed):
                return r
        return None


def plan(scenarios: Sequence[Scenario], methods: Sequence[str], seeds: Sequence[int], steps: Callable[[Scenario], int]
         ) -> list[tuple[str, str, int, int | None]]:  # fmt: skip
    """Every run the matrix needs, each once: the cells, the references, the bit-identity runs, and the unprotected
    runs that harmless scenarios compare with."""
    tasks: dict[tuple[str, str, int], int] = {}
    for spec in scenarios:
        for seed in seeds:
            for method in methods:
                tasks[(spec.name, method, seed)] = steps(spec)
            reference = scenario(spec.reference)
            tasks.setdefault((reference.name, "unprotected", seed), steps(reference))
            if spec.stable or spec.harmless:
                tasks[(spec.name, "unprotected", seed)] = steps(spec)
            if spec.stable:
                tasks[(spec.name, BIT_IDENTICAL, seed)] = steps(spec)
    # Longest first, so that the last worker to finish does not start a long run alone.
    ordered = sorted(tasks.items(), key=lambda item: -scenario(item[0][0]).steps)
    return [(name, method, seed, budget) for (name, method, seed), budget in ordered]


def run_matrix(scenarios: Sequence[Scenario], methods: Sequence[str], seeds: Sequence[int], quick: bool = False,
               workers: int = 1, steps: int | None = None, progress: Callable[[str], None] | None = None
               ) -> Results:  # fmt: skip
    """Run the matrix (in ``workers`` processes) and score every run against its family's reference.

    Args:
        scenarios, methods, seeds: the matrix; a method whose peer is not installed is left out, saying so.
        quick: half of every scenario's step budget.
        workers: processes running runs in parallel.
        steps: one step budget for every scenario (and reference) instead of their own.
        progress: called with a line per finished run.
    """
    available, skipped = [], []
    for name in methods:
        absent = missing(_method(name))
        if absent:
            skipped.append(f"skipped {name}: {', '.join(absent)} not installed ({_method(name).install})")
        else:
            available.append(name)
    def budget(spec: Scenario) -> int:
        if steps is not None:
            return steps
        return max(1, spec.steps // 2) if quick else spec.steps

    tasks = plan(scenarios, available, seeds, budget)
    runs: list[Run] = []
    if workers <= 1:
        for task in tasks:
            runs.append(_run_task(task))
            if progress:
                progress(_progress_line(runs[-1], len(runs), len(tasks)))
    else:
        import multiprocessing

        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no inherited threads or RNG state
        with ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=configure_process) as pool:
            for run in pool.map(_run_task, tasks, chunksize=1):
                runs.append(run)
                if progress:
                    progress(_progress_line(run, len(runs), len(tasks)))
    results = Results(runs, {}, {}, [s.name for s in scenarios], available, list(seeds), skipped)
    score(results)
    return results


def _progress_line(run: Run, done: int, total: int) -> str:
    outcome = "raised" if run.raised else ("finite" if run.ended_finite else "non-finite")
    return (f"[{done}/{total}] {run.scenario} | {run.method} | seed {run.seed}: eval {run.final_eval:.4g} "
            f"({outcome}, {run.wall_s:.1f}s)")  # fmt: skip


def score(results: Results) -> None:
    """Fill in the references and every run's ratio to its family's reference."""
    for run in results.runs:
        results.reference_runs[run.family] = scenario(run.scenario).reference
    for family, name in results.reference_runs.items():
        values = [r.final_eval for r in results.runs if r.scenario == name and r.method == "unprotected"]
        finite = [v for v in values if math.isfinite(v)]
        results.references[family] = min(finite) if finite else math.nan
    for run in results.runs:
        reference = results.references.get(run.family, math.nan)
        run.ratio = run.final_eval / reference if run.ended_finite and reference > 0 else math.nan
        run.within_reference = run.ended_finite and run.final_eval <= WITHIN * reference


# ---- report ---------------------------------------------------------------------------------------------------------
def _cell(run: Run | None) -> str:
    if run is None:
        return "-"
    mark = "✓" if run.within_reference else "✗"
    text = f"{run.final_eval:.3g} ({run.ratio:.2f}x) {mark}" if run.ended_finite else f"{run.final_eval} {mark}"
    counts = [f"{kind} {run.journal[kind]}" for kind in JOURNAL_KINDS if run.journal.get(kind)]
    if run.trials:
        counts.append(f"trial {run.trials}" + (f" ({run.remedies_kept} kept)" if run.remedies_kept else ""))
    if counts:
        text += f" · {', '.join(counts)}"
    if run.raised:
        text += f" · **{run.raised.split(':')[0]}** at step {run.steps}"
    return text


def scenario_table(results: Results, name: str) -> str:
    """The markdown table of one scenario: a row per method, a column per seed."""
    spec = scenario(name)
    reference, reference_run = results.references.get(spec.family, math.nan), results.reference_runs.get(spec.family)
    seeds = [results.get(str(reference_run), "unprotected", seed) for seed in results.seeds]
    values = ", ".join(f"{r.final_eval:.4g}" for r in seeds if r is not None)
    lines = [
        f"### {name}: {spec.description}",
        "",
        f"reference: {reference:.4g}, the best of `{reference_run}` unprotected over the seeds ({values}); within "
        f"reference: at most {WITHIN * reference:.4g}",
        "",
        "| method | " + " | ".join(f"seed {s}" for s in results.seeds) + " |",
        "| --- | " + " | ".join("---" for _ in results.seeds) + " |",
    ]
    methods = list(results.methods) + ([BIT_IDENTICAL] if spec.stable else [])
    for method in methods:
        cells = [_cell(results.get(name, method, seed)) for seed in results.seeds]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary_rows(results: Results) -> list[tuple[str, int, int, int, int]]:
    """``(method, ended finite, within reference, raised, runs)`` per method of the matrix."""
    rows = []
    for method in results.methods:
        runs = results.matrix_runs(method)
        rows.append((
            method,
            sum(r.ended_finite for r in runs),
            sum(r.within_reference for r in runs),
            sum(r.raised is not None for r in runs),
            len(runs),
        ))  # fmt: skip
    return rows


def summary_table(results: Results) -> str:
    lines = ["| method | ended finite | within reference | raised |", "| --- | --- | --- | --- |"]
    for method, finite, within, raised, total in summary_rows(results):
        lines.append(f"| {_label(method)} | {finite}/{total} | {within}/{total} | {raised} |")
    return "\n".join(lines)


def _label(method: str) -> str:
    return method if method in ("unprotected", "ZClip", "ARC") else f"`{method}`"


def trial_rows(results: Results) -> list[tuple[str, int, int, int, int, int]]:
    """``(method, trials, remedies kept, false alarms, extra steps, steps)`` per method of the matrix."""
    rows = []
    for method in results.methods:
        runs = results.matrix_runs(method)
        rows.append((
            method,
            sum(r.trials for r in runs),
            sum(r.remedies_kept for r in runs),
            sum(r.false_alarms for r in runs),
            sum(r.extra_steps for r in runs),
            sum(r.steps for r in runs),
        ))  # fmt: skip
    return rows


def trial_table(results: Results) -> str:
    lines = [
        "| method | trials | kept | false alarms | extra steps (share of steps) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for method, trials, kept, false_alarms, extra, steps in trial_rows(results):
        share = f"{extra / steps:.1%}" if steps else "-"
        lines.append(f"| {_label(method)} | {trials} | {kept} | {false_alarms} | {extra} ({share}) |")
    return "\n".join(lines)


def _harmless(results: Results) -> list[str]:
    return [name for name in results.scenarios if scenario(name).harmless]


def _ratio_text(run: Run | None, bare: Run) -> str:
    """``run``'s final evaluation as a ratio to the unprotected run's, as printed."""
    if run is None:
        return "-"
    if not (run.ended_finite and bare.ended_finite and bare.final_eval > 0):
        return f"{run.final_eval:.4g}"  # no ratio: the value itself (nan, inf, or over a non-finite reference)
    return f"{run.final_eval / bare.final_eval:.3f}x"


def harmless_table(results: Results) -> str:
    """Per harmless scenario and seed: the unprotected final evaluation, and each method's as a ratio to it."""
    stable = any(scenario(name).stable for name in _harmless(results))
    methods = [m for m in results.methods if m != "unprotected"] + ([BIT_IDENTICAL] if stable else [])
    lines = [
        "| scenario | seed | unprotected | " + " | ".join(map(_label, methods)) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in methods) + " |",
    ]
    for name in _harmless(results):
        for seed in results.seeds:
            bare = results.get(name, "unprotected", seed)
            if bare is None:
                continue
            cells = [_ratio_text(results.get(name, method, seed), bare) for method in methods]
            lines.append(f"| {name} | {seed} | {bare.final_eval:.4g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


Check = tuple[bool | None, str]  # (passed; None: nothing to check in this matrix, the line that says what was measured)


def _where(ok: bool, line: str, label: str, cases: Sequence[str]) -> Check:
    return ok, line + (f"; {label}: {', '.join(cases)}" if cases else "")


def targets(results: Results) -> list[Check]:
    """The targets, each as ``(passed, line)``; a target whose methods did not run fails, saying why."""
    if OURS not in results.methods:
        return [(False, f"{OURS} did not run: no target can be checked")]
    ours = {(r.scenario, r.seed): r for r in results.matrix_runs(OURS)}
    return [
        *_share_and_peers(results, ours),
        _raises_where_a_peer_rescues(results, ours),
        *[_never_worse_than(results, ours, part) for part in PARTS],
        *_stable_checks(results),
        harmless_target(results),
        _far_off_endings_said(ours),
    ]


FAR_OFF = 10.0
"""A finite ending this many times the family's reference or more is far off: the run must say so at its end."""
SAID = ("ending", "left_alone", "behind", "nonfinite_at_end", "stopped")
"""The journal's kinds that say at a fit's end that it did not end well."""


def _far_off_endings_said(ours: dict[tuple[str, int], Run]) -> Check:
    far = [r for r in ours.values() if r.ended_finite and not r.raised and r.ratio >= FAR_OFF]
    unsaid = [f"{r.scenario} seed {r.seed} ({r.ratio:.3g}x)" for r in far if not any(r.journal.get(k) for k in SAID)]
    line = f"far-off endings said: {OURS} said so on {len(far) - len(unsaid)}/{len(far)} finite runs {FAR_OFF:g}x " \
           "their reference or more"
    return _where(not unsaid, line, "unsaid", unsaid) if far else (None, line)


def target_share(results: Results) -> float:
    """The share target of the matrix: a held-out one's is lower (see :data:`HELD_OUT_SHARE`)."""
    held_out = bool(results.scenarios) and all(name in HELD_OUT or name in HARD_HELD_OUT for name in results.scenarios)
    return HELD_OUT_SHARE if held_out else TARGET_SHARE


def _share_and_peers(results: Results, ours: dict[tuple[str, int], Run]) -> list[Check]:
    within = sum(r.within_reference for r in ours.values())
    share = within / len(ours) if ours else 0.0
    counts = {m: sum(r.within_reference for r in results.matrix_runs(m)) for m in results.methods if METHODS[m].peer}
    goal = target_share(results)
    share_check: Check = (
        share >= goal,
        f"{OURS} within reference on {within}/{len(ours)} runs ({share:.0%}; target >= {goal:.0%})",
    )
    if not counts:
        return [share_check, (False, f"{OURS} within reference on more runs than every peer: no peer ran")]
    listed = ", ".join(f"{m} {n}" for m, n in counts.items())
    return [
        share_check,
        _where(all(n < within for n in counts.values()),
               f"{OURS} within reference on more runs ({within}) than every peer ({listed})",
               "not more than", [m for m, n in counts.items() if n >= within]),
    ]  # fmt: skip


def _raises_where_a_peer_rescues(results: Results, ours: dict[tuple[str, int], Run]) -> Check:
    rescued = {(r.scenario, r.seed) for r in results.runs if METHODS[r.method].peer and r.within_reference}
    raised = sorted(f"{name} seed {seed}" for (name, seed), r in ours.items() if r.raised and (name, seed) in rescued)
    return _where(not raised, f"{OURS} never raises where a peer finishes within reference", "raised on", raised)


def _never_worse_than(results: Results, ours: dict[tuple[str, int], Run], part: str) -> Check:
    if part not in results.methods:
        return False, f"{OURS} never worse than {part} alone: {part} did not run"
    worse = sorted(
        f"{r.scenario} seed {r.seed}" for r in results.matrix_runs(part)
        if r.within_reference and not ours[(r.scenario, r.seed)].within_reference
    )  # fmt: skip
    return _where(not worse, f"{OURS} never worse than {part} alone", "worse on", worse)


StablePair = tuple[str, int, Run, Run]  # (scenario, seed, the unprotected run, the default_callbacks(clip=None) run)


def _stable_checks(results: Results) -> list[Check]:
    stable = [name for name in results.scenarios if scenario(name).stable]
    if not stable:
        return [(None, "a stable LR is unchanged: not checked, no stable scenario in this matrix")]
    pairs: list[StablePair] = []
    for name in stable:
        for seed in results.seeds:
            bare, lean = results.get(name, "unprotected", seed), results.get(name, BIT_IDENTICAL, seed)
            if bare is not None and lean is not None:
                pairs.append((name, seed, bare, lean))
    return [_bit_identical(pairs, stable), *_within_stable_tolerance(results, pairs)]


def _bit_identical(pairs: Sequence[StablePair], stable: Sequence[str]) -> Check:
    """Bit-identical where no trial's remedy was kept: a kept remedy changes the run on purpose (listed, not
    failed)."""
    kept = [f"{name} seed {seed}" for name, seed, _, lean in pairs if lean.remedies_kept]
    compared = [(name, seed, bare, lean) for name, seed, bare, lean in pairs if not lean.remedies_kept]
    differ = [f"{name} seed {seed}" for name, seed, bare, lean in compared if bare.digest != lean.digest]
    line = (f"stable LR bit-identical: {BIT_IDENTICAL} vs unprotected on {len(compared) - len(differ)}/"
            f"{len(compared)} (scenario, seed) of {', '.join(stable)} where it kept no trial's remedy")  # fmt: skip
    if kept:
        line += f"; kept a remedy (not compared): {', '.join(kept)}"
    return _where(bool(compared) and not differ, line, "differ", differ)


def _within_stable_tolerance(results: Results, pairs: Sequence[StablePair]) -> list[Check]:
    checks = []
    for method in (OURS, "AutoClip()"):
        if method not in results.methods:
            continue
        beyond = []
        for name, seed, bare, _ in pairs:
            run = results.get(name, method, seed)
            if run is None or not (run.ended_finite and run.final_eval <= STABLE_TOLERANCE * bare.final_eval):
                ratio = run.final_eval / bare.final_eval if run else math.nan
                beyond.append(f"{name} seed {seed} ({ratio:.3f}x)")
        checks.append(_where(not beyond, f"stable LR within {STABLE_TOLERANCE}x final eval with {method}",
                             "beyond on", beyond))  # fmt: skip
    return checks


def harmless_target(results: Results) -> Check:
    """``default_callbacks()`` leaves harmless runs alone: on every harmless scenario, seed by seed, it ends within
    :data:`HARMLESS_TOLERANCE` x of the unprotected run's final evaluation. A pair whose unprotected run ended
    non-finite has nothing to compare with: it is skipped, saying so."""
    harmless = _harmless(results)
    if not harmless:
        return False, "harmless runs left alone: no harmless scenario ran"
    beyond, skipped, compared = [], [], 0
    for name in harmless:
        for seed in results.seeds:
            bare, ours = results.get(name, "unprotected", seed), results.get(name, OURS, seed)
            if bare is None or ours is None:
                continue
            if not bare.ended_finite:
                skipped.append(f"{name} seed {seed}")
                continue
            compared += 1
            if not (ours.ended_finite and ours.final_eval <= HARMLESS_TOLERANCE * bare.final_eval):
                beyond.append(f"{name} seed {seed} ({_ratio_text(ours, bare)})")
    line = (f"harmless runs left alone: {OURS} within {HARMLESS_TOLERANCE}x of the unprotected final eval on "
            f"{compared - len(beyond)}/{compared} (scenario, seed) of {', '.join(harmless)}")  # fmt: skip
    ok, line = _where(compared > 0 and not beyond, line, "beyond on", beyond)
    if skipped:
        line += f"; skipped, the unprotected run ended non-finite: {', '.join(skipped)}"
    return ok, line


def report(results: Results) -> str:
    """The whole printed report: skipped peers, the tables, the summaries and the targets."""
    parts = [*results.skipped, ""] if results.skipped else []
    parts += [scenario_table(results, name) + "\n" for name in results.scenarios]
    parts += ["## Summary", "", summary_table(results), "", "## Trials", "", trial_table(results), ""]
    if _harmless(results):
        legend = f"final eval / the unprotected one (same scenario and seed); target: {OURS} <= {HARMLESS_TOLERANCE}x"
        parts += ["## Harmless runs", "", legend, "", harmless_table(results), ""]
    parts += ["## Targets", ""]
    parts += [f"{'SKIP' if ok is None else 'PASS' if ok else 'FAIL'}: {line}" for ok, line in targets(results)]
    return "\n".join(parts)


def to_json(results: Results, meta: dict[str, Any]) -> dict[str, Any]:
    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    return clean({
        "meta": meta,
        "references": {f: {"scenario": results.reference_runs[f], "value": v} for f, v in results.references.items()},
        "summary": [dict(zip(("method", "ended_finite", "within_reference", "raised", "runs"), row))
                    for row in summary_rows(results)],
        "trials": [dict(zip(("method", "trials", "remedies_kept", "false_alarms", "extra_steps", "steps"), row))
                   for row in trial_rows(results)],
        "targets": [{"passed": ok, "line": line} for ok, line in targets(results)],
        "skipped": results.skipped,
        "runs": [asdict(r) for r in results.runs],
    })  # fmt: skip


def load(path: str | os.PathLike[str]) -> tuple[Results, dict[str, Any]]:
    """The results and metadata that ``--json`` wrote to ``path``, scored again."""
    saved = json.loads(Path(path).read_text())
    runs = []
    for fields in saved["runs"]:
        run = Run(**fields)
        run.final_eval, run.ratio = float(run.final_eval), float(run.ratio)  # "nan" / "inf" were written as text
        runs.append(run)
    meta = saved["meta"]
    ran = {r.scenario for r in runs if r.method != "unprotected"}  # a reference-only scenario runs unprotected only
    scenarios = [name for catalogue in SETS.values() for name in catalogue if name in ran]
    methods = [m for m in MATRIX_METHODS if any(r.method == m for r in runs)]
    seeds = sorted({r.seed for r in runs})
    results = Results(runs, {}, {}, scenarios, methods, seeds, list(saved.get("skipped", [])))
    score(results)
    return results, meta


def plot(results: Results, path: str | os.PathLike[str]) -> None:
    """A heat map of final evaluation / reference: a row per scenario, a block of seed cells per method. Black is a
    non-finite evaluation, R marks a run that raised, grey a run that is missing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.patches import Patch

    bounds = [0.0, 1.1, WITHIN, 3.0, 10.0, 1e2, 1e4, 1e8, 1e30]
    cmap = ListedColormap(["#1a9850", "#91cf60", "#fee08b", "#fdae61", "#f46d43", "#d73027", "#a50026", "#67001f"])
    norm = BoundaryNorm(bounds, cmap.N)
    seeds, methods, names = results.seeds, results.methods, results.scenarios
    width = len(seeds) + 1  # a white column between methods
    image = np.ones((len(names), len(methods) * width - 1, 4))
    fig, ax = plt.subplots(figsize=(2.6 + 0.45 * len(methods) * width, 1.4 + 0.32 * len(names)))
    for i, name in enumerate(names):
        for j, method in enumerate(methods):
            for k, seed in enumerate(seeds):
                run, column = results.get(name, method, seed), j * width + k
                if run is None:
                    image[i, column] = (0.8, 0.8, 0.8, 1.0)
                    continue
                ratio = run.ratio if math.isfinite(run.ratio) else (math.inf if run.ended_finite else math.nan)
                image[i, column] = (0, 0, 0, 1) if math.isnan(ratio) else cmap(norm(min(ratio, 1e29)))
                if run.raised:
                    dark = not run.ended_finite or ratio > 10
                    ax.text(column, i, "R", ha="center", va="center", fontsize=7, fontweight="bold",
                            color="white" if dark else "black")  # fmt: skip
    ax.imshow(image, aspect="auto", interpolation="nearest")
    ax.set_xticks([c + 0.5 for c in range(image.shape[1] - 1)], minor=True)  # thin white lines between the cells
    ax.set_yticks([r + 0.5 for r in range(len(names) - 1)], minor=True)
    ax.grid(which="minor", color="white", linewidth=0.6)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_xticks([j * width + (len(seeds) - 1) / 2 for j in range(len(methods))], methods, fontsize=8,
                  rotation=25, ha="right")  # fmt: skip
    ax.tick_params(which="both", length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    bar = fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax, ticks=bounds[:-1], fraction=0.03, pad=0.01)
    bar.ax.set_yticklabels(["0", "1.1", f"{WITHIN}: within reference below", "3", "10", "1e2", "1e4", "1e8"],
                           fontsize=7)  # fmt: skip
    bar.set_label("final evaluation / reference", fontsize=8)
    fig.legend(handles=[Patch(color="black", label="non-finite evaluation"), Patch(color="white", label="R: raised")],
               loc="lower left", ncol=2, fontsize=7, frameon=False)  # fmt: skip
    within = {m: sum(r.within_reference for r in results.matrix_runs(m)) for m in methods}
    total = len(names) * len(seeds)
    ax.set_title(f"Rescue benchmark: final evaluation / reference ({len(seeds)} seed(s) per method, left to right)\n"
                 + "within reference: " + ", ".join(f"{m} {n}/{total}" for m, n in within.items()), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ---- command line ---------------------------------------------------------------------------------------------------
def select(names: str | None, quick: bool, held_out: bool = False, set_name: str | None = None) -> list[Scenario]:
    """The scenarios of the matrix: ``names`` (comma-separated, from any catalogue), or else the quick subset or
    all of a catalogue: the set called ``set_name`` (a key of :data:`SETS`), :data:`HELD_OUT` with ``held_out``,
    and :data:`SCENARIOS` otherwise."""
    if names:
        return [scenario(n.strip()) for n in names.split(",") if n.strip()]
    if set_name is not None and set_name not in SETS:
        raise ValueError(f"'set' must be one of {', '.join(map(repr, SETS))} (got {set_name!r})")
    catalogue = SETS[set_name] if set_name is not None else HELD_OUT if held_out else SCENARIOS
    return [s for s in catalogue.values() if s.in_matrix and (s.quick or not quick)]


def _methods(names: str | None) -> list[str]:
    if not names:
        return list(MATRIX_METHODS)
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    for name in chosen:
        _method(name)
    return chosen


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one seed, the quick scenarios, half the steps")
    parser.add_argument("--held-out", action="store_true",
                        help="the held-out matrix: the same families at other magnitudes (share target 85%%)")
    parser.add_argument("--set", default=None, choices=list(SETS),
                        help="a named matrix: matrix (the default), held-out (as --held-out), hard (the classes of "
                        "runs the suite still lost, with harmless twins), hard-held-out (the same at other magnitudes)")
    parser.add_argument("--workers", type=int, default=1, help="runs in parallel processes (default 1)")
    parser.add_argument("--seeds", type=int, default=None, help="number of seeds (default 3, 1 with --quick)")
    parser.add_argument("--first-seed", type=int, default=0, help="the first seed; the others follow it (default 0)")
    parser.add_argument("--scenarios", default=None, help="comma-separated scenario names (default: all)")
    parser.add_argument("--methods", default=None, help="comma-separated method names (default: all)")
    parser.add_argument("--steps", type=int, default=None, help="one step budget for every scenario (a smoke test)")
    parser.add_argument("--json", default=None, help="write the results as JSON there")
    parser.add_argument("--png", default=None, help="draw the heat map there")
    parser.add_argument("--progress", action="store_true", help="print a line per finished run (to stderr)")
    parser.add_argument("--report", default=None, help="print and draw the results saved by --json there; run nothing")
    args = parser.parse_args(None if argv is None else list(argv))
    if args.workers < 1:
        parser.error(f"'--workers' must be >= 1 (got {args.workers})")
    if args.first_seed < 0:
        parser.error(f"'--first-seed' must be >= 0 (got {args.first_seed})")
    if args.report:
        results, meta = load(args.report)
        print(report(results) + "\n\n" + _footer(meta))
        if args.png:
            plot(results, args.png)
        return 0
    configure_process()
    count = args.seeds or (1 if args.quick else len(SEEDS))
    seeds = list(range(args.first_seed, args.first_seed + count))
    scenarios, methods = select(args.scenarios, args.quick, args.held_out, args.set), _methods(args.methods)
    start = time.perf_counter()
    progress = (lambda line: print(line, file=sys.stderr, flush=True)) if args.progress else None
    results = run_matrix(scenarios, methods, seeds, quick=args.quick, workers=args.workers, steps=args.steps,
                         progress=progress)  # fmt: skip
    meta = {
        "command": "python benchmarks/rescue.py " + " ".join(sys.argv[1:] if argv is None else list(argv)),
        "quick": args.quick,
        "held_out": args.held_out,
        "set": args.set,
        "workers": args.workers,
        "wall_s": round(time.perf_counter() - start, 1),
        "run_cpu_s": round(sum(r.cpu_s for r in results.runs), 1),
        "runs": len(results.runs),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU(s), {platform.platform()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pytorch_lightning": pl.__version__,
        "peers": {name: _version(name) for name in ("zclip", "arc-training")},
    }
    print(report(results) + "\n\n" + _footer(meta))
    if args.json:
        Path(args.json).write_text(json.dumps(to_json(results, meta), indent=1))
    if args.png:
        plot(results, args.png)
    return 0


def _footer(meta: dict[str, Any]) -> str:
    peers = ", ".join(f"{name} {version}" for name, version in meta["peers"].items() if version) or "no peers"
    return (f"{meta['runs']} runs in {meta['wall_s']:.0f} s wall ({meta['run_cpu_s']:.0f} s of CPU in the runs, "
            f"{meta['workers']} worker(s)); {meta['machine']}; torch {meta['torch']}, pytorch_lightning "
            f"{meta['pytorch_lightning']}, {peers}")  # fmt: skip


def _version(distribution: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
