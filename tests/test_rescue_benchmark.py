"""The rescue benchmark runs, scores and reports one small scenario (benchmarks/rescue.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import rescue  # noqa: E402
from rescue_scenarios import FAULT_STEP, scenario  # noqa: E402

STEPS = FAULT_STEP + 10


@pytest.fixture(scope="module")
def results() -> Iterator[rescue.Results]:
    # One intra-op thread, as the benchmark's own processes use: on two shared cores, tiny ops spread over threads
    # cost ten times the CPU. Restored afterwards (the setting is process-wide).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield rescue.run_matrix([scenario("nan_weight")], ["unprotected", "NonFiniteDetector()"], seeds=[0], steps=STEPS)
    finally:
        torch.set_num_threads(threads)


def test_records_what_each_run_did(results: rescue.Results) -> None:
    assert [(r.scenario, r.method, r.seed) for r in results.runs] == [
        ("nan_weight", "unprotected", 0),
        ("nan_weight", "NonFiniteDetector()", 0),
        ("mlp_sgd_lr1x", "unprotected", 0),  # the family's reference, trained for the same budget
    ]
    bare, detector, reference = results.runs
    assert (bare.max_steps, bare.steps, bare.raised, bare.journal, bare.events) == (STEPS, STEPS, None, {}, [])
    assert not bare.ended_finite and math.isnan(bare.final_eval) and not bare.within_reference
    assert detector.journal and detector.events[0]["step"] == FAULT_STEP  # the NaN weight seen at its own step
    assert detector.events[0]["source"] == "NonFiniteDetector"
    assert detector.raised is None or detector.raised.startswith(("NonFiniteError: ", "DivergenceError: "))
    assert reference.ended_finite and reference.steps == STEPS and reference.ratio == 1.0 and reference.within_reference
    assert results.references == {"mlp_sgd": reference.final_eval}
    assert results.reference_runs == {"mlp_sgd": "mlp_sgd_lr1x"}
    assert len(reference.digest) == 64 and reference.digest != bare.digest


def test_renders_the_tables_targets_and_picture(results: rescue.Results, tmp_path: Path) -> None:
    reference = results.references["mlp_sgd"]
    table = rescue.scenario_table(results, "nan_weight").splitlines()
    assert table[0] == "### nan_weight: FaultInjector writes NaN into net.0.weight before step 150"
    assert table[2] == (f"reference: {reference:.4g}, the best of `mlp_sgd_lr1x` unprotected over the seeds "
                        f"({reference:.4g}); within reference: at most {1.5 * reference:.4g}")  # fmt: skip
    assert table[4:7] == ["| method | seed 0 |", "| --- | --- |", "| unprotected | nan ✗ |"]
    assert table[7].startswith("| NonFiniteDetector() | ") and len(table) == 8
    summary = rescue.summary_table(results).splitlines()
    assert summary[:3] == [
        "| method | ended finite | within reference | raised |",
        "| --- | --- | --- | --- |",
        "| unprotected | 0/1 | 0/1 | 0 |",
    ]
    assert rescue.targets(results) == [(False, "default_callbacks() did not run: no target can be checked")]
    picture = tmp_path / "rescue.png"
    rescue.plot(results, picture)
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_saved_results_load_back_to_the_same_report(results: rescue.Results, tmp_path: Path) -> None:
    saved = tmp_path / "rescue.json"
    saved.write_text(json.dumps(rescue.to_json(results, {"wall_s": 1.0})))
    loaded, meta = rescue.load(saved)
    assert meta == {"wall_s": 1.0}
    assert (loaded.scenarios, loaded.methods, loaded.seeds) == (["nan_weight"], results.methods, [0])
    assert rescue.report(loaded) == rescue.report(results)


def test_a_peer_that_is_not_installed_is_skipped_with_a_line() -> None:
    absent = rescue.Method("absent", requires=("no_such_module_here",), install="pip install absent", peer=True)
    assert rescue.missing(absent) == ["no_such_module_here"]
    assert rescue.missing(rescue.METHODS["unprotected"]) == []


def test_unknown_names_are_refused() -> None:
    with pytest.raises(ValueError, match=r"^'method' must be one of 'unprotected', .* \(got 'clip'\)$"):
        rescue.run_one("nan_weight", "clip", 0)
    with pytest.raises(ValueError, match=r"^'scenario' must be one of 'mlp_sgd_lr1x', .* \(got 'nope'\)$"):
        rescue.run_one("nope", "unprotected", 0)


def test_a_negative_first_seed_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        rescue.main(["--first-seed", "-1"])
    assert "'--first-seed' must be >= 0 (got -1)" in capsys.readouterr().err


def test_the_peer_target_fails_saying_so_when_no_peer_ran(results: rescue.Results) -> None:
    ours = [dataclasses.replace(r, method=rescue.OURS) for r in results.runs if r.method == "NonFiniteDetector()"]
    alone = rescue.Results(ours + [r for r in results.runs if r.method == "unprotected"], {}, {}, results.scenarios,
                           [rescue.OURS], results.seeds, [])  # fmt: skip
    rescue.score(alone)
    assert (False, "default_callbacks() within reference on more runs than every peer: no peer ran") in rescue.targets(
        alone
    )
