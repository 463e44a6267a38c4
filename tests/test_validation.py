"""The argument checks: one grammar, exact messages, TypeError for a wrong type and ValueError for a wrong value."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lightning_overflow import AutoClip, GradNormMonitor, LRBackoff, Rollback, default_callbacks
from lightning_overflow._validation import (
    check_bool,
    check_choice,
    check_choices,
    check_float,
    check_int,
    check_names,
    check_norm_type,
    check_type,
)
from lightning_overflow.numerics import clip_grad_norm_, scale_lr
from lightning_overflow.testing import Fault, FaultInjector

KINDS = ("nonfinite", "loss_spike", "grad_spike")
LISTED = "'nonfinite', 'loss_spike', 'grad_spike'"
SIGNALS = (
    "'nonfinite', 'nonfinite_burst', 'nonfinite_persistent', 'nonfinite_state', 'scaler_collapse', 'loss_spike'"
    ", 'grad_spike', 'loss_divergence', 'loss_trend', 'no_progress', 'weight_growth'"
    ", 'replica_mismatch'"
)


def raises(call: Callable[[], Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error) as info:
        call()
    assert type(info.value) is error
    assert str(info.value) == message


# ---- scalars ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: check_bool("diagnose", 1), TypeError, "'diagnose' must be a bool (got 1)"),
        (lambda: check_bool("diagnose", None), TypeError, "'diagnose' must be a bool (got None)"),
        (lambda: check_int("burst_window", True), TypeError, "'burst_window' must be an int (got True)"),
        (lambda: check_int("keep", 1.0), TypeError, "'keep' must be an int (got 1.0)"),
        (lambda: check_int("keep", "2"), TypeError, "'keep' must be an int (got '2')"),
        (lambda: check_int("keep", None), TypeError, "'keep' must be an int (got None)"),
        (lambda: check_int("keep", 0, minimum=1), ValueError, "'keep' must be >= 1 (got 0)"),
        (lambda: check_int("keep", -1), ValueError, "'keep' must be >= 0 (got -1)"),
        (lambda: check_int("every", 2.5, optional=True), TypeError, "'every' must be an int or None (got 2.5)"),
        (lambda: check_int("every", 0, minimum=1, optional=True), ValueError, "'every' must be >= 1 (got 0)"),
        (lambda: check_float("factor", 1.5, low=0, high=1, low_open=True, high_open=True), ValueError,
         "'factor' must be in (0, 1) (got 1.5)"),
        (lambda: check_float("factor", 0, low=0, high=1, low_open=True, high_open=True), ValueError,
         "'factor' must be in (0, 1) (got 0)"),
        (lambda: check_float("factor", math.nan, low=0, high=1), ValueError, "'factor' must be in [0, 1] (got nan)"),
        (lambda: check_float("factor", "half"), TypeError, "'factor' must be a number (got 'half')"),
        (lambda: check_float("factor", True), TypeError, "'factor' must be a number (got True)"),
        (lambda: check_float("factor", torch.tensor(0.5)), TypeError, "'factor' must be a number (got tensor(0.5000))"),
        (lambda: check_float("min_lr", "1", optional=True), TypeError, "'min_lr' must be a number or None (got '1')"),
        (lambda: check_float("sigmas", 0, low=0, low_open=True), ValueError, "'sigmas' must be in (0, inf) (got 0)"),
        (lambda: check_float("sigmas", math.inf, low=0, low_open=True), ValueError,
         "'sigmas' must be in (0, inf) (got inf)"),
        (lambda: check_float("growth", 0.5, low=1), ValueError, "'growth' must be in [1, inf) (got 0.5)"),
        (lambda: check_float("max_norm", -1, low=0, low_open=True, high_open=False), ValueError,
         "'max_norm' must be in (0, inf] (got -1)"),
        (lambda: check_float("shift", -math.inf), ValueError, "'shift' must be a finite number (got -inf)"),
        (lambda: check_float("shift", math.nan), ValueError, "'shift' must be a finite number (got nan)"),
        (lambda: check_float("decades", 0, low=0, high=38.5318394, low_open=True), ValueError,
         "'decades' must be in (0, 38.5318] (got 0)"),
        (lambda: check_choice("action", "ignore", ("skip", "raise", "warn")), ValueError,
         "'action' must be one of 'skip', 'raise', 'warn' (got 'ignore')"),
        (lambda: check_choice("action", 1, ("skip", "raise", "warn")), TypeError,
         "'action' must be one of 'skip', 'raise', 'warn' (got 1)"),
        (lambda: check_choice("action", None, ("skip", "raise", "warn")), TypeError,
         "'action' must be one of 'skip', 'raise', 'warn' (got None)"),
        (lambda: check_norm_type(1), ValueError, "'norm_type' must be 2 or inf (got 1)"),
        (lambda: check_norm_type(-math.inf), ValueError, "'norm_type' must be 2 or inf (got -inf)"),
        (lambda: check_norm_type("l2"), ValueError, "'norm_type' must be 2 or inf (got 'l2')"),
        (lambda: check_norm_type("nan"), ValueError, "'norm_type' must be 2 or inf (got 'nan')"),
        (lambda: check_norm_type(None), TypeError, "'norm_type' must be 2 or inf (got None)"),
        (lambda: check_norm_type(True), TypeError, "'norm_type' must be 2 or inf (got True)"),
        (lambda: check_norm_type([2]), TypeError, "'norm_type' must be 2 or inf (got [2])"),
        (lambda: check_norm_type(1, name="ord"), ValueError, "'ord' must be 2 or inf (got 1)"),
        (lambda: check_type("dirpath", 3, (str, os.PathLike), "a path", optional=True), TypeError,
         "'dirpath' must be a path or None (got 3)"),
        (lambda: check_type("faults", "nan_loss", Fault, "Fault instances"), TypeError,
         "'faults' must be Fault instances (got 'nan_loss')"),
        (lambda: check_type("dtype", None, torch.dtype, "a torch.dtype"), TypeError,
         "'dtype' must be a torch.dtype (got None)"),
    ],
)
def test_scalar_checks_reject_with_exact_messages(call: Callable[[], Any], error: type[Exception], message: str) -> None:
    raises(call, error, message)


def test_scalar_checks_return_what_the_caller_keeps() -> None:
    assert check_bool("b", False) is False
    assert check_int("n", 3) == 3 and type(check_int("n", np.int64(3))) is int
    assert check_int("n", None, optional=True) is None
    assert check_float("x", 1) == 1.0 and type(check_float("x", 1)) is float
    assert type(check_float("x", np.float32(0.5))) is float
    assert check_float("x", None, optional=True) is None
    assert check_float("x", 0.0, low=0.0) == 0.0  # a finite end is included by default
    assert check_float("max_norm", math.inf, low=0.0, low_open=True, high_open=False) == math.inf
    assert check_choice("action", "warn", ("skip", "warn")) == "warn"
    assert check_norm_type(2) == 2.0 and check_norm_type("inf") == math.inf and check_norm_type(" 2 ") == 2.0
    path = Path("x")
    assert check_type("dirpath", path, (str, os.PathLike), "a path") is path
    assert check_type("dirpath", None, (str, os.PathLike), "a path", optional=True) is None


# ---- iterables --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (None, TypeError, f"'triggers' must be a collection of {LISTED} (got None)"),
        (7, TypeError, f"'triggers' must be a collection of {LISTED} (got 7)"),
        ("loss_spike", TypeError, f"'triggers' must be a collection of {LISTED} (got 'loss_spike')"),
        (b"loss_spike", TypeError, f"'triggers' must be a collection of {LISTED} (got b'loss_spike')"),
        ([], ValueError, f"'triggers' must be a non-empty collection of {LISTED} (got [])"),
        ((), ValueError, f"'triggers' must be a non-empty collection of {LISTED} (got ())"),
        (["loss_spike", "boom"], ValueError, f"'triggers' must be one of {LISTED} (got 'boom')"),
        (["loss_spike", 3], TypeError, f"'triggers' must be one of {LISTED} (got 3)"),
        ([None], TypeError, f"'triggers' must be one of {LISTED} (got None)"),
    ],
)
def test_check_choices_rejects(value: Any, error: type[Exception], message: str) -> None:
    raises(lambda: check_choices("triggers", value, KINDS), error, message)


def test_check_choices_names_the_items_as_told() -> None:
    raises(
        lambda: check_choices("triggers", 7, KINDS, what="signal kinds"),
        TypeError,
        "'triggers' must be a collection of signal kinds (got 7)",
    )
    raises(
        lambda: check_choices("triggers", [], KINDS, what="signal kinds"),
        ValueError,
        "'triggers' must be a non-empty collection of signal kinds (got [])",
    )


def test_check_choices_accepts_any_iterable_and_drops_repeats_in_order() -> None:
    assert check_choices("t", ["grad_spike", "nonfinite", "grad_spike"], KINDS) == ("grad_spike", "nonfinite")
    assert check_choices("t", (k for k in ["loss_spike"]), KINDS) == ("loss_spike",)
    assert check_choices("t", {"nonfinite"}, KINDS) == ("nonfinite",)
    assert check_choices("t", [], KINDS, allow_empty=True) == ()


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (None, TypeError, "'exclude' must be a sequence of parameter names (got None)"),
        (7, TypeError, "'exclude' must be a sequence of parameter names (got 7)"),
        ("head", TypeError, "'exclude' must be a sequence of parameter names (got 'head')"),
        (["head", 1], TypeError, "'exclude' must be a sequence of parameter names (got ['head', 1])"),
        ([None], TypeError, "'exclude' must be a sequence of parameter names (got [None])"),
    ],
)
def test_check_names_rejects(value: Any, error: type[Exception], message: str) -> None:
    raises(lambda: check_names("exclude", value, what="parameter names"), error, message)


def test_check_names_default_wording_and_empty() -> None:
    raises(lambda: check_names("keys", 7), TypeError, "'keys' must be a sequence of str (got 7)")
    raises(lambda: check_names("keys", [], allow_empty=False), ValueError, "'keys' must be a non-empty sequence of str (got [])")
    assert check_names("keys", []) == ()
    assert check_names("keys", ["a", "b", "a"]) == ("a", "b", "a")
    assert check_names("keys", (k for k in "ab")) == ("a", "b")


# ---- every public constructor and function, at construction -----------------------------------------------------
@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: AutoClip(mode="agc", exclude=None), TypeError, "'exclude' must be a sequence of parameter names (got None)"),
        (lambda: AutoClip(mode="agc", exclude=7), TypeError, "'exclude' must be a sequence of parameter names (got 7)"),
        (lambda: AutoClip(mode="agc", exclude=["head", 2]), TypeError,
         "'exclude' must be a sequence of parameter names (got ['head', 2])"),
        (lambda: AutoClip(mode=3), TypeError, "'mode' must be one of 'fixed', 'percentile', 'zscore', 'agc' (got 3)"),
        (lambda: AutoClip(exclude=["head"]), ValueError, "'exclude' applies to mode='agc' only (got mode='zscore')"),
        (lambda: LRBackoff(triggers=7), TypeError, "'triggers' must be a collection of signal kinds (got 7)"),
        (lambda: LRBackoff(triggers=None), TypeError, "'triggers' must be a collection of signal kinds (got None)"),
        (lambda: LRBackoff(triggers="loss_spike"), TypeError,
         "'triggers' must be a collection of signal kinds (got 'loss_spike')"),
        (lambda: LRBackoff(triggers=[]), ValueError, "'triggers' must be a non-empty collection of signal kinds (got [])"),
        (lambda: LRBackoff(triggers=["loss_spike", "typo"]), ValueError, f"'triggers' must be one of {SIGNALS} (got 'typo')"),
        (lambda: LRBackoff(triggers=[1]), TypeError, f"'triggers' must be one of {SIGNALS} (got 1)"),
        (lambda: Rollback(triggers="loss_spike"), TypeError,
         "'triggers' must be a collection of signal kinds (got 'loss_spike')"),
        (lambda: Rollback(triggers=7), TypeError, "'triggers' must be a collection of signal kinds (got 7)"),
        (lambda: Rollback(triggers=None), TypeError, "'triggers' must be a collection of signal kinds (got None)"),
        (lambda: Rollback(triggers=[]), ValueError, "'triggers' must be a non-empty collection of signal kinds (got [])"),
        (lambda: Rollback(triggers=[None]), TypeError, f"'triggers' must be one of {SIGNALS} (got None)"),
        (lambda: GradNormMonitor(norm_type=None), TypeError, "'norm_type' must be 2 or inf (got None)"),
        (lambda: GradNormMonitor(norm_type="l1"), ValueError, "'norm_type' must be 2 or inf (got 'l1')"),
        (lambda: default_callbacks(clip="fixed"), ValueError,
         "'clip' must be one of 'percentile', 'zscore', 'agc' (got 'fixed')"),
        (lambda: default_callbacks(clip=1), TypeError, "'clip' must be one of 'percentile', 'zscore', 'agc' (got 1)"),
        (lambda: default_callbacks(lr_factor=1.0), ValueError, "'lr_factor' must be in (0, 1) (got 1)"),
        (lambda: default_callbacks(snapshot_every_n_steps=0), ValueError, "'snapshot_every_n_steps' must be >= 1 (got 0)"),
        (lambda: default_callbacks(max_rollbacks=1.5), TypeError, "'max_rollbacks' must be an int (got 1.5)"),
        (lambda: default_callbacks(per_parameter_norms=1), TypeError, "'per_parameter_norms' must be a bool (got 1)"),
        (lambda: default_callbacks(rollback=None), TypeError, "'rollback' must be a bool (got None)"),
        (lambda: default_callbacks(dirpath=3), TypeError, "'dirpath' must be a path or None (got 3)"),
        (lambda: default_callbacks(dirpath=3, rollback=False), TypeError, "'dirpath' must be a path or None (got 3)"),
        (lambda: default_callbacks(dirpath="snaps", rollback=False), ValueError,
         "'dirpath' needs rollback=True: it is where Rollback writes its snapshots (got 'snaps')"),
        (lambda: Fault(1.5, "nan_loss"), TypeError, "'step' must be an int (got 1.5)"),
        (lambda: Fault(-1, "nan_loss"), ValueError, "'step' must be >= 0 (got -1)"),
        (lambda: Fault(1, None), TypeError,
         "'kind' must be one of 'nan_loss', 'inf_loss', 'loss_spike', 'nan_grad', 'inf_grad', 'nan_weight', "
         "'inf_weight', 'scale_weight' (got None)"),
        (lambda: Fault(1, "nan_loss", rank=True), TypeError, "'rank' must be an int or None (got True)"),
        (lambda: Fault(1, "nan_loss", rank=-1), ValueError, "'rank' must be >= 0 (got -1)"),
        (lambda: Fault(1, "nan_grad", parameter=0), TypeError, "'parameter' must be a parameter name or None (got 0)"),
        (lambda: Fault(1, "loss_spike", factor="10"), TypeError, "'factor' must be a number (got '10')"),
        (lambda: Fault(1, "loss_spike", factor=math.nan), ValueError, "'factor' must be a finite number (got nan)"),
        (lambda: Fault(1, "nan_loss", once=1), TypeError, "'once' must be a bool (got 1)"),
        (lambda: FaultInjector(Fault(1, "nan_loss"), "nan_loss"), TypeError,
         "'faults' must be Fault instances (got 'nan_loss')"),
        (lambda: clip_grad_norm_([torch.ones(2)], None), TypeError, "'max_norm' must be a number (got None)"),
        (lambda: scale_lr("sgd", 0.5), TypeError, "'optimizer' must be a torch.optim.Optimizer (got 'sgd')"),
        (lambda: scale_lr(_sgd(), 0.0), ValueError, "'factor' must be in (0, inf) (got 0)"),
        (lambda: scale_lr(_sgd(), math.inf), ValueError, "'factor' must be in (0, inf) (got inf)"),
        (lambda: scale_lr(_sgd(), 0.5, None), TypeError, "'schedulers' must be an iterable of LR schedulers (got None)"),
    ],
)
def test_public_arguments_are_checked_at_construction(
    call: Callable[[], Any], error: type[Exception], message: str
) -> None:
    raises(call, error, message)


def test_iterable_arguments_are_kept_as_tuples() -> None:
    assert AutoClip(mode="agc", exclude=["head"]).exclude == ("head",)
    assert LRBackoff(triggers=("loss_spike", "loss_spike", "grad_spike")).triggers == ("loss_spike", "grad_spike")
    assert Rollback(triggers=(k for k in ["nonfinite_state"])).triggers == ("nonfinite_state",)


def test_clip_grad_norm_allows_an_infinite_threshold() -> None:
    grads = [torch.tensor([7.0, 24.0])]
    total, coef = clip_grad_norm_(grads, math.inf)
    assert (total.item(), coef.item()) == (25.0, 1.0)
    assert grads[0].tolist() == [7.0, 24.0]


def _sgd() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
