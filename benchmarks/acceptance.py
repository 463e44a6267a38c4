"""The package's shape, measured: what a reader and a maintainer meet, against the targets of one engine with thin
adapters.

Prints, each with its target and PASS/FAIL:

- core lines: lines of the package's Python files, less ``report/``, ``demo/``, ``testing/`` and the CLI;
- public settings: the constructor parameters of the public callbacks and configs (``inspect.signature``);
- mutable module globals: module-level names bound to a mutable value (a dict, list, set, a weak dictionary, an
  object built by a call), and names rebound through ``global``; constants (numbers, strings, tuples, frozensets,
  compiled patterns, type aliases, ``__all__``) are not counted;
- Lightning methods replaced outside ``_compat.py``: an assignment to, or ``setattr`` of, an attribute that names a
  method of Lightning's ``Trainer``, ``LightningModule``, ``Callback`` or ``Logger`` (``trainer.save_checkpoint =
  ...``, ``logger.log_metrics = ...``, ``module.log = ...``, a hook set to ``None``);
- modules a healthy step passes through: the package's modules whose functions run during one healthy optimizer
  step of a small fit with ``default_callbacks()`` (``sys.setprofile``, from ``on_train_batch_start`` to the end of
  ``on_train_batch_end``), less the model's own (``lightning_overflow.testing``'s ``TinyRegressor``).

Run: ``python benchmarks/acceptance.py`` (a few seconds). Each finding is listed, so a change shows what it moved.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import sys
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_overflow"
OUTSIDE_CORE = ("report", "demo", "testing", "cli.py", "__main__.py")
TARGETS = {"core lines": 8000, "public settings": 40, "mutable module globals": 0, "replaced outside _compat": 0,
           "modules a healthy step passes through": 6}  # fmt: skip
PUBLIC = ("GradNormMonitor", "NonFiniteDetector", "LossSpikeDetector", "AutoClip", "LRBackoff", "Rollback",
          "TrialConfig")  # fmt: skip
_IMMUTABLE_CALLS = {"frozenset", "tuple", "compile", "TypeVar", "NewType", "namedtuple", "getLogger", "ContextVar",
                    "Literal", "cast", "field", "object"}  # fmt: skip


def python_files(core_only: bool) -> list[Path]:
    files = sorted(PACKAGE.rglob("*.py"))
    if not core_only:
        return files
    return [f for f in files if not any(part in OUTSIDE_CORE for part in f.relative_to(PACKAGE).parts)]


def core_lines() -> tuple[int, list[str]]:
    counts = [(len(f.read_text(encoding="utf-8").splitlines()), f) for f in python_files(core_only=True)]
    largest = [f"{n:5d}  {f.relative_to(ROOT)}" for n, f in sorted(counts, reverse=True)[:8]]
    return sum(n for n, _ in counts), largest


def public_settings() -> tuple[int, list[str]]:
    import lightning_overflow

    found = []
    for name in PUBLIC:
        params = [p for p in inspect.signature(getattr(lightning_overflow, name)).parameters.values()
                  if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]  # fmt: skip
        found.append((name, len(params)))
    return sum(n for _, n in found), [f"{n:3d}  {name}" for name, n in found]


def _mutable(value: ast.expr) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return name not in _IMMUTABLE_CALLS
    return False


_MUTATORS = {"append", "extend", "insert", "update", "setdefault", "pop", "popitem", "clear", "add", "discard",
             "remove", "appendleft", "__setitem__"}  # fmt: skip


def mutable_globals() -> tuple[int, list[str]]:
    """Module-level names the package's code changes after import: a container written to (an item or an attribute
    set, a method that mutates it called), an object built by a call whose methods are called, anywhere in its
    module, or a name rebound through ``global``. A table that is only read (a dict of words) is a constant."""
    found = []
    for path in python_files(core_only=False):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        where = path.relative_to(ROOT)
        bound: dict[str, int] = {}
        objects: set[str] = set()  # bound to an object built by a call: any method of it may change it
        for node in tree.body:
            targets: list[ast.expr] = []
            value: ast.expr | None = None
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            for target in targets:
                if isinstance(target, ast.Name) and value is not None and _mutable(value):
                    bound[target.id] = node.lineno
                    if isinstance(value, ast.Call):
                        objects.add(target.id)
        written: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                found += [f"{where}:{node.lineno}  global {name}" for name in node.names]
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                for target in getattr(node, "targets", None) or [getattr(node, "target", None)]:
                    if isinstance(target, (ast.Subscript, ast.Attribute)) and isinstance(target.value, ast.Name):
                        written.add(target.value.id)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value
                if isinstance(owner, ast.Name) and (node.func.attr in _MUTATORS or owner.id in objects):
                    written.add(owner.id)
        found += [f"{where}:{line}  {name}" for name, line in bound.items() if name in written]
    return len(found), found


def lightning_method_names() -> set[str]:
    import pytorch_lightning as pl

    names: set[str] = set()
    for cls in (pl.Trainer, pl.LightningModule, pl.Callback, pl.loggers.Logger):
        names |= {n for n, v in inspect.getmembers(cls) if callable(v) and not n.startswith("__")}
    return names


def replaced_outside_compat() -> tuple[int, list[str]]:
    methods = lightning_method_names()
    found = []
    for path in python_files(core_only=False):
        if path.name == "_compat.py" or "testing" in path.relative_to(PACKAGE).parts:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        where = path.relative_to(ROOT)
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Attribute) and target.attr in methods and not _is_self(target):
                        found.append(f"{where}:{node.lineno}  {ast.unparse(target)} = ...")
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setattr" and len(node.args) >= 2:
                name = node.args[1]
                if isinstance(name, ast.Constant) and name.value in methods:
                    found.append(f"{where}:{node.lineno}  setattr(..., {name.value!r}, ...)")
    return len(found), found


def _is_self(target: ast.Attribute) -> bool:
    return isinstance(target.value, ast.Name) and target.value.id in ("self", "cls")


def modules_of_a_healthy_step() -> tuple[int, list[str]]:
    import logging

    import pytorch_lightning as pl

    from lightning_overflow import default_callbacks
    from lightning_overflow.testing import TinyRegressor

    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning_overflow").setLevel(logging.ERROR)
    modules: set[str] = set()
    measured = 10  # a step well past the start: snapshots and warm-ups behind it

    def profile(frame: Any, event: str, _: Any) -> None:
        if event == "call":
            name = frame.f_globals.get("__name__", "")
            # The model trained is the user's code, wherever it lives (here the package's test doubles).
            if name.startswith("lightning_overflow") and not name.startswith("lightning_overflow.testing"):
                modules.add(name)

    class Window(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
            if trainer.global_step == measured:
                sys.setprofile(profile)

    class Close(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
            if trainer.global_step == measured + 1:
                sys.setprofile(None)

    trainer = pl.Trainer(max_steps=measured + 4, callbacks=[Window(), *default_callbacks(), Close()], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(TinyRegressor())
    sys.setprofile(None)
    return len(modules), sorted(modules)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="list every finding, not only the first few")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    measures = {
        "core lines": core_lines(),
        "public settings": public_settings(),
        "mutable module globals": mutable_globals(),
        "replaced outside _compat": replaced_outside_compat(),
        "modules a healthy step passes through": modules_of_a_healthy_step(),
    }
    met = 0
    for name, (value, details) in measures.items():
        target = TARGETS[name]
        verdict = "PASS" if value <= target else "FAIL"
        met += verdict == "PASS"
        print(f"{verdict}  {name}: {value} (target <= {target})")
        for line in details if args.list else details[:8]:
            print(f"        {line}")
        if not args.list and len(details) > 8:
            print(f"        ... {len(details) - 8} more (--list)")
    print(f"{met} of {len(measures)} targets met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
