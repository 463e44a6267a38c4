"""The package loads its public names on first use: the pure-torch numerics import without Lightning."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import lightning_overflow

ROOT = Path(lightning_overflow.__file__).resolve().parent.parent
LIGHTNING = ("pytorch_lightning", "lightning", "lightning_fabric")


def run_fresh(code: str) -> str:
    """Run ``code`` in a new interpreter that imports this checkout of the package; return its stdout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize(
    "module", ["lightning_overflow", "lightning_overflow.numerics", "lightning_overflow._validation",
               "lightning_overflow.exceptions"]
)
def test_importing_leaves_lightning_unloaded(module: str) -> None:
    out = run_fresh(
        f"""
        import sys
        import {module}
        assert {module}.__file__.startswith({str(ROOT)!r}), {module}.__file__
        print(sorted(m for m in sys.modules if m.split(".")[0] in {LIGHTNING!r}))
        """
    )
    assert out.strip() == "[]"


def test_numerics_import_as_a_plain_pytorch_loop_would() -> None:
    run_fresh(
        "import lightning_overflow.numerics, sys; "
        "assert 'pytorch_lightning' not in sys.modules and 'lightning' not in sys.modules"
    )


def test_every_public_name_resolves_in_a_fresh_interpreter() -> None:
    out = run_fresh(
        """
        import sys
        import lightning_overflow
        import lightning_overflow.numerics
        assert "pytorch_lightning" not in sys.modules
        for name in lightning_overflow.__all__:
            value = getattr(lightning_overflow, name)
            origin = value if isinstance(value, str) else value.__module__
            print(name, origin)
        assert "pytorch_lightning" in sys.modules  # the callbacks were loaded on demand
        """
    )
    resolved = dict(line.split() for line in out.splitlines())
    assert list(resolved) == lightning_overflow.__all__
    assert resolved["__version__"] == lightning_overflow.__version__
    assert all(v.startswith("lightning_overflow.") for k, v in resolved.items() if k != "__version__")


def test_star_import_gives_every_public_name() -> None:
    out = run_fresh(
        """
        from lightning_overflow import *
        import lightning_overflow
        missing = [n for n in lightning_overflow.__all__ if n not in globals()]
        print(missing)
        """
    )
    assert out.strip() == "[]"


def test_the_lazy_names_are_the_real_objects() -> None:
    from lightning_overflow.callbacks.auto_clip import AutoClip
    from lightning_overflow.exceptions import NonFiniteError

    assert lightning_overflow.AutoClip is AutoClip
    assert lightning_overflow.NonFiniteError is NonFiniteError


def test_dir_lists_every_public_name_and_unknown_names_raise() -> None:
    assert set(lightning_overflow.__all__) <= set(dir(lightning_overflow))
    with pytest.raises(AttributeError) as info:
        lightning_overflow.NoSuchCallback  # noqa: B018
    assert str(info.value) == "module 'lightning_overflow' has no attribute 'NoSuchCallback'"


def test_type_checkers_see_the_same_names_as_users() -> None:
    # The names imported under ``if TYPE_CHECKING:`` must be exactly the lazy ones, or a type checker and the
    # interpreter would disagree about the package.
    tree = ast.parse(Path(lightning_overflow.__file__).read_text())
    guarded = next(
        node for node in tree.body
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
    )
    typed = {alias.asname or alias.name for node in guarded.body if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert typed == set(lightning_overflow.__all__) - {"__version__"}
