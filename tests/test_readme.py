"""The README's usage snippet runs as written, on a model of the reader's own."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_overflow.testing import TinyRegressor

README = Path(__file__).resolve().parents[1] / "README.md"


def _usage_snippet() -> str:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Use\n") :]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)  # type: ignore[union-attr]


def test_the_usage_snippet_is_four_lines_and_trains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snippet = _usage_snippet()
    assert len([line for line in snippet.splitlines() if line.strip()]) == 4
    monkeypatch.chdir(tmp_path)  # the Trainer writes lightning_logs/ where it runs
    model = TinyRegressor()
    before = [p.detach().clone() for p in model.parameters()]
    namespace = {"model": model}
    exec(compile(snippet, str(README), "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer.current_epoch == 10 and trainer.global_step == 80  # 10 epochs of 8 batches
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert (tmp_path / "lightning_logs" / "version_0").is_dir()


def test_what_you_will_see_is_what_examples_first_run_prints(tmp_path: Path) -> None:
    """The console excerpt of the README's "What you will see" is the real end of ``examples/first_run.py``."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## What you will see\n") :]
    excerpt = re.search(r"```\n(.*?)```", section, re.DOTALL).group(1).splitlines()  # type: ignore[union-attr]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(README.parent / "examples" / "first_run.py"), "--out", "first_run_logs"],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    printed = [line for line in (done.stdout + done.stderr).splitlines() if not line.startswith("Epoch ")]
    assert printed[-len(excerpt) + 1 :] == excerpt[1:]
    assert excerpt[0] in done.stdout + done.stderr
