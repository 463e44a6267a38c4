"""The public surface: explicit ``__all__`` kept in step with the modules, the exception hierarchy."""

from __future__ import annotations

import ast
import importlib
import inspect
import pickle
import re
from pathlib import Path

import pytest

import lightning_overflow
from lightning_overflow import DivergenceError, NonFiniteError, OverflowWarning, RollbackError, policy
from lightning_overflow.policy import REMOVED_SETTINGS

MODULES = ["lightning_overflow", "lightning_overflow.numerics", "lightning_overflow.testing",
           "lightning_overflow.callbacks", "lightning_overflow.exceptions", "lightning_overflow.events",
           "lightning_overflow.diagnosis", "lightning_overflow.report", "lightning_overflow.guard"]


@pytest.mark.parametrize("name", MODULES)
def test_all_lists_exactly_the_public_names(name: str) -> None:
    module = importlib.import_module(name)
    assert len(set(module.__all__)) == len(module.__all__)
    for exported in module.__all__:
        assert hasattr(module, exported), exported
    defined_here = {
        n for n, v in vars(module).items()
        if not n.startswith("_") and callable(v) and getattr(v, "__module__", None) == name
    }
    assert defined_here <= set(module.__all__)


@pytest.mark.parametrize("name", ["lightning_overflow.callbacks", "lightning_overflow.exceptions"])
def test_the_package_reexports_every_callback_and_error(name: str) -> None:
    assert set(importlib.import_module(name).__all__) <= set(lightning_overflow.__all__)


def test_the_plain_loop_entry_is_public_and_loaded_on_first_use() -> None:
    assert "Guard" in lightning_overflow.__all__
    from lightning_overflow.guard import Guard

    assert lightning_overflow.Guard is Guard
    assert {"step", "close", "end_epoch", "state_dict", "save_checkpoint"} <= set(dir(Guard))


def test_exception_hierarchy() -> None:
    assert issubclass(NonFiniteError, FloatingPointError)
    assert issubclass(DivergenceError, RuntimeError) and issubclass(RollbackError, RuntimeError)
    assert issubclass(OverflowWarning, UserWarning)


def test_errors_keep_their_fields_across_processes() -> None:
    error = NonFiniteError("msg", kind="loss", step=3, ranks=[1], hint="h")
    clone = pickle.loads(pickle.dumps(error))
    assert (str(clone), clone.kind, clone.step, clone.ranks, clone.hint) == ("msg", "loss", 3, [1], "h")
    div = pickle.loads(pickle.dumps(DivergenceError("d", step=5, history=[{"step": 1}])))
    assert (div.step, div.history) == (5, [{"step": 1}])


def test_numerics_do_not_import_lightning() -> None:
    for path in Path(lightning_overflow.__file__).parent.joinpath("numerics").glob("*.py"):
        tree = ast.parse(path.read_text())
        imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        leaves = ("lightning_overflow.numerics", "lightning_overflow._validation", "lightning_overflow.exceptions")
        assert not [m for m in imported if "lightning" in m and not m.startswith(leaves)], path


def test_version() -> None:
    assert lightning_overflow.__version__ == "0.1.0"


def test_fault_arguments_are_checked() -> None:
    from lightning_overflow.testing import Fault, FaultInjector, TinyRegressor

    with pytest.raises(ValueError, match=r"'kind' must be one of 'nan_loss', .* \(got 'nan'\)"):
        Fault(1, "nan")
    with pytest.raises(TypeError, match=r"'rank' must be an int or None \(got True\)"):
        Fault(1, "nan_loss", rank=True)
    with pytest.raises(ValueError, match=r"'factor' must be a finite number \(got inf\)"):
        Fault(1, "loss_spike", factor=float("inf"))
    with pytest.raises(TypeError, match=r"'faults' must be Fault instances"):
        FaultInjector("nan_loss")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'optimizer' must be one of 'adam', 'adamw', 'sgd' \(got 'adma'\)"):
        TinyRegressor(optimizer="adma")
    import pytorch_lightning as pl

    trainer = pl.Trainer(max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, callbacks=[FaultInjector(Fault(0, "nan_grad", parameter="nope"))])
    with pytest.raises(ValueError, match=r"'parameter' must name a parameter of the model \(got 'nope'"):
        trainer.fit(TinyRegressor())


@pytest.mark.parametrize(
    ("owner", "name"), [(owner, name) for owner, names in REMOVED_SETTINGS.items() for name in names]
)
def test_a_setting_of_an_earlier_release_is_refused_with_the_value_it_now_has(owner: str, name: str) -> None:
    cls = getattr(lightning_overflow, owner)
    constant = REMOVED_SETTINGS[owner][name]
    with pytest.raises(TypeError) as info:
        cls(**{name: 1})
    if owner == "TrialConfig":  # a dataclass: Python's own message, and the value on the class
        assert str(info.value) == f"TrialConfig.__init__() got an unexpected keyword argument {name!r}"
        assert getattr(cls, name) == getattr(policy, constant)
        return
    settings = ", ".join(repr(p) for p in inspect.signature(cls).parameters if p != "removed")
    if constant is None:
        why = "the option was removed with its feature (see lightning_overflow.policy)"
    else:
        value = getattr(policy, constant)
        assert getattr(cls, name) == value  # the class reads the policy's value, written once
        why = f"the value is fixed at {value!r} (lightning_overflow.policy.{constant})"
    assert str(info.value) == f"{owner}({name}=1): {name!r} is no longer a setting: {why}. The settings are: {settings}"


def test_an_unknown_keyword_is_refused_with_the_settings() -> None:
    with pytest.raises(TypeError) as info:
        lightning_overflow.LRBackoff(factr=0.5)
    assert str(info.value) == (
        "LRBackoff(factr=0.5): 'factr' is not a setting. The settings are: 'factor', 'triggers', 'cooldown', "
        "'min_scale', 'regrow_after', 'trial'"
    )


def test_docs_policy_lists_every_fixed_value_with_its_value_and_former_setting() -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "policy.md").read_text(encoding="utf-8")
    rows = {m[0]: m[1:] for m in re.findall(r"^\| `([A-Z_]+)` \| ([^|]+) \| `(\w+)` \| `(\w+)` \|$", doc, re.M)}
    expected = {
        constant: (repr(getattr(policy, constant)), owner, setting)
        for owner, names in REMOVED_SETTINGS.items()
        for setting, constant in names.items()
        if constant is not None
    }
    assert {name: (value.strip(), owner, setting) for name, (value, owner, setting) in rows.items()} == expected
