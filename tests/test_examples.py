"""The examples: each runs with ``--fast``, fails unprotected and is rescued or precisely diagnosed protected.

Every example prints a last line ``RESULT {json}``; the examples run two at a time in subprocesses (one per core),
once for the module, and each test asserts on its example's summary.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NAMES = (
    "deep_mlp_init",
    "infonce_exp",
    "large_batch_high_lr",
    "corrupt_sample",
    "rnn_long_sequences",
    "gan_discriminator",
    "plain_loop",
    "fabric_pretrain",
)


def run_example(name: str) -> dict[str, Any]:
    # Two examples at a time, one thread each: more threads than cores would spin and slow both down.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), "--fast"],
        capture_output=True, text=True, timeout=240, cwd=EXAMPLES.parent, env=env,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise AssertionError(f"{name} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["example"] == name
    return result


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, Any]]:
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(NAMES, pool.map(run_example, NAMES)))


def test_the_six_classic_failures_and_the_loops_without_a_trainer_are_there() -> None:
    assert set(NAMES) <= {p.stem for p in EXAMPLES.glob("*.py")}


def test_deep_mlp_init(results: dict[str, dict[str, Any]]) -> None:
    result = results["deep_mlp_init"]
    assert result["unprotected"]["weights_finite"] is False
    safe = result["protected"]
    assert safe["raised"] and (safe["step"], safe["verdict"], safe["direction"]) == (0, "persistent", "forward")
    assert safe["growth_layers"] >= 30 and 3 < safe["growth_factor"] < 4.5
    assert safe["hint_names_initialisation"]


def test_infonce_exp(results: dict[str, dict[str, Any]]) -> None:
    result = results["infonce_exp"]
    assert result["unprotected"]["weights_finite"] is False
    step = result["unprotected"]["first_nonfinite_step"]
    assert step is not None and step > 0  # it trained healthily before
    safe = result["protected"]
    assert (safe["step"], safe["op"], safe["module"], safe["direction"]) == (step, "exp", None, "forward")
    assert safe["verdict"] == "persistent" and safe["input_magnitude"] > 88.7 and safe["hint_logsumexp"]
    fixed = result["hint_applied"]
    assert fixed["weights_finite"] and fixed["nonfinite_events"] == 0


def test_large_batch_high_lr(results: dict[str, dict[str, Any]]) -> None:
    result = results["large_batch_high_lr"]
    assert result["unprotected"]["weights_finite"] is False
    safe = result["protected"]
    assert safe["weights_finite"] and safe["backoffs"] >= 1 and safe["rollbacks"] >= 1 and safe["lr_scale"] < 1
    assert safe["final_loss"] < safe["initial_loss"] / 10


def test_corrupt_sample(results: dict[str, dict[str, Any]]) -> None:
    result = results["corrupt_sample"]
    assert result["unprotected"]["weights_finite"] is False
    safe = result["protected"]
    assert safe["weights_finite"] and safe["skipped"] == 4  # once an epoch, four epochs
    assert (safe["verdict"], safe["op"]) == ("persistent", "mse_loss")
    assert safe["batch_magnitude"] == pytest.approx(1e30)
    assert safe["loss"] == pytest.approx(result["clean"]["loss"], rel=0.2)


def test_rnn_long_sequences(results: dict[str, dict[str, Any]]) -> None:
    result = results["rnn_long_sequences"]
    assert result["unprotected"]["weights_finite"] is False
    safe = result["protected"]
    assert safe["weights_finite"] and safe["nonfinite_events"] == 0 and safe["clipped_steps"] > 0
    assert safe["last_epoch_loss"] < safe["first_epoch_loss"]


def test_gan_discriminator(results: dict[str, dict[str, Any]]) -> None:
    result = results["gan_discriminator"]
    assert result["unprotected"]["weights_finite"] is False
    safe = result["protected"]
    assert safe["weights_finite"] and safe["skipped"] > 0 and safe["optimizers"] == [1]
    assert safe["replayed"] is False and "manual optimization" in safe["reason"]
    stable = result["stable"]
    assert stable["weights_finite"] and stable["skipped"] == 0


def test_plain_loop(results: dict[str, dict[str, Any]]) -> None:
    result = results["plain_loop"]
    assert result["unprotected"]["weights_finite"] is False
    safe, stepping = result["protected"], result["train_step"]
    assert safe["weights_finite"] and safe["skipped_steps"] == [9, 25, 41]  # the corrupt batch, once an epoch
    assert safe["loss"] == pytest.approx(safe["clean_run_loss"], rel=0.1)
    assert "a plain loop's step is not replayed" in safe["first_skip"]
    assert safe["first_skip"].endswith("Batch 9 holds values up to 1e+30 in row 41: a data fault.")  # handed over
    # The guard that runs each step holds the batch: the same steps, the same weights, and the row named.
    assert stepping["skipped_steps"] == safe["skipped_steps"] and stepping["loss"] == safe["loss"]
    assert "batch 9 holds values up to 1e+30 in row 41" in stepping["first_skip"]
    assert "in loss_fn (outside every module), op mse_loss" in stepping["first_skip"]
    assert "Persistent: the replay of this batch on the same weights reproduces it" in stepping["first_skip"]


def test_fabric_pretrain(results: dict[str, dict[str, Any]]) -> None:
    result = results["fabric_pretrain"]
    bare = result["unprotected"]
    assert bare["first_nan_step"] is not None and bare["weights_finite"] is False
    safe, stable = result["protected"], result["stable"]
    assert safe["weights_finite"] and safe["skipped"] and safe["backed_off"] and safe["rolled_back"]
    assert safe["final_loss"] < 1.2 * stable["final_loss"]
