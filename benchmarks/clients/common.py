"""Shared plumbing of the real-client lane: one row = one training run of a real library, captured and classified."""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

SUITE_DIR = os.path.dirname(os.path.abspath(__import__("lightning_overflow").__file__))
_LOGGERS = ("", "pytorch_lightning", "lightning.pytorch", "lightning", "lightning_overflow")


@dataclass
class Outcome:
    """What a library's train function hands back."""

    metric: float
    weights: dict[str, torch.Tensor]
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Row:
    lib: str
    case: str
    mode: str
    ended: str = "finished"  # finished | raised <Type>: <msg> | finished, NaN weights
    exc_type: str | None = None
    exc_text: str | None = None
    exc_in_suite: bool = False  # a traceback frame inside lightning_overflow/
    metric: float = float("nan")
    weights: dict[str, torch.Tensor] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    summary: list[str] = field(default_factory=list)
    wall: float = float("nan")

    @property
    def ok(self) -> bool:
        return self.ended == "finished" and math.isfinite(self.metric)


class _Grab(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001
            return
        if msg.startswith("lightning_overflow:") and msg not in self.lines:
            self.lines.append(msg)


def quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("pytorch_lightning", "lightning.pytorch", "lightning", "lightning_fabric", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("lightning_overflow").setLevel(logging.INFO)  # the suite's own logger, apart from Lightning's


# The frames of NonFiniteDetector's training_step (its call of the module's own, through answered_call).
_PASS_THROUGH = ("training_step", "answered_call", "<lambda>")


def _passed_through(frame: traceback.FrameSummary) -> bool:
    return frame.name in _PASS_THROUGH and frame.filename.endswith(os.path.join("callbacks", "nonfinite_detector.py"))


def run_row(lib: str, case: str, mode: str, fn: Callable[[], Outcome], log_path: str) -> Row:
    """Run ``fn`` with its console output sent to ``log_path``; never raises."""
    row = Row(lib, case, mode)
    grab = _Grab()
    loggers = [logging.getLogger(n) for n in _LOGGERS]
    for lg in loggers:
        lg.addHandler(grab)
    out = io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            res = fn()
        row.metric, row.weights, row.extra = float(res.metric), res.weights, res.extra
        if any(not torch.isfinite(t).all() for t in res.weights.values() if t.is_floating_point()):
            row.ended = "finished, non-finite weights"
    except BaseException as e:  # noqa: BLE001  (a row must never take the lane down)
        if isinstance(e, KeyboardInterrupt):
            raise
        row.exc_type = type(e).__name__
        row.exc_text = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        frames = traceback.extract_tb(e.__traceback__)
        # NonFiniteDetector's training_step stands in for the module's during a fit: what the module raised and it
        # let through is the module's error, not the suite's.
        row.exc_in_suite = any(f.filename.startswith(SUITE_DIR) and not _passed_through(f) for f in frames)
        row.ended = f"raised {row.exc_type}"
        with open(log_path, "a") as f:
            f.write(f"\n==== {lib} / {case} / {mode}: traceback\n")
            traceback.print_exception(e, file=f)
    finally:
        row.wall = time.perf_counter() - t0
        for lg in loggers:
            lg.removeHandler(grab)
        with open(log_path, "a") as f:
            f.write(f"\n==== {lib} / {case} / {mode}: console\n{out.getvalue()}")
    row.summary = grab.lines
    return row


def resume_outcome(straight: dict[str, torch.Tensor], resumed: dict[str, torch.Tensor], metric: float,
                   straight_metric: float, step: int, name: str) -> tuple[Outcome, str]:
    """A fit resumed from a checkpoint against the same fit uninterrupted: it works when the weights are identical,
    or its ``metric`` (``name``, lower is better) is within 1.5x the uninterrupted one's (a library that re-seeds its
    data order on resume, bare as well)."""
    d = max_abs_diff(straight, resumed)
    ok = d is not None and (d == 0.0 or metric <= 1.5 * straight_metric)
    detail = (f"resumed from epoch 1 to step {step}; weights vs uninterrupted: "
              f"{'bit-identical' if d == 0.0 else f'max |dw| {d:.3g}'}; {name} {metric:.4g} vs {straight_metric:.4g}")
    return Outcome(metric, resumed, {"resume_ok": ok}), detail


def max_abs_diff(a: dict[str, torch.Tensor] | None, b: dict[str, torch.Tensor] | None) -> float | None:
    """0.0 when bit-identical (NaN equal to NaN), inf when they do not match in keys/shapes, None if one is missing."""
    if a is None or b is None:
        return None
    if a.keys() != b.keys():
        return math.inf
    worst = 0.0
    for k in a:
        x, y = a[k], b[k]
        if x.shape != y.shape:
            return math.inf
        if not x.is_floating_point():
            worst = max(worst, 0.0 if torch.equal(x, y) else math.inf)
            continue
        same = (x == y) | (torch.isnan(x) & torch.isnan(y))
        if bool(same.all()):
            continue
        d = (x.double() - y.double()).abs()
        d = torch.where(same, torch.zeros_like(d), d)
        worst = max(worst, float(torch.nan_to_num(d, nan=math.inf).max()))
    return worst


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().cpu() for k, v in module.state_dict().items()}


def seed(s: int = 0) -> None:
    import random

    import numpy as np

    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)
