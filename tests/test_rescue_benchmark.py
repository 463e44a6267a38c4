"""The rescue benchmark runs, scores and reports one small scenario (benchmarks/rescue.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import rescue  # noqa: E402
from rescue_scenarios import FAULT_STEP, HARD, HARD_HELD_OUT, HELD_OUT, SCENARIOS, SETS, scenario  # noqa: E402

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


def made(name: str, method: str, seed: int, final_eval: float, **fields: Any) -> rescue.Run:
    """A hand-made run of ``name`` that ended at ``final_eval``."""
    family = scenario(name).family
    return rescue.Run(name, family, method, seed, 400, steps=400, final_eval=final_eval,
                      ended_finite=math.isfinite(final_eval), **fields)  # fmt: skip


def trial(kept: bool, false_alarm: bool, extra_steps: int) -> dict[str, Any]:
    """A journal's ``trial`` event, of a trial of two remedies."""
    details = {"signal": "loss_divergence", "opened_at": 152, "rung": 1, "snapshot_step": 100,
               "lr_factors": [0.5, 0.125], "kept": kept, "kept_lr_factor": 0.5 if kept else None,
               "false_alarm": false_alarm, "steps": extra_steps // 2, "extra_steps": extra_steps}  # fmt: skip
    return {"step": 173, "kind": "trial", "source": "lightning_overflow", "message": "a trial", "details": details}


def test_trial_counts_sum_up_the_trial_events_of_a_journal() -> None:
    journal = [
        {"step": 150, "kind": "spike", "message": "a spike", "details": {}},
        trial(kept=False, false_alarm=True, extra_steps=40),
        {"step": 200, "kind": "rollback", "message": "a rollback", "details": {"kept": True, "extra_steps": 99}},
        trial(kept=True, false_alarm=False, extra_steps=24),
        trial(kept=False, false_alarm=False, extra_steps=16),
    ]
    assert rescue.trial_counts(journal) == rescue.TrialCounts(trials=3, remedies_kept=1, false_alarms=1, extra_steps=80)
    assert rescue.trial_counts([]) == (0, 0, 0, 0)


def test_the_trial_table_sums_the_trials_per_method() -> None:
    runs = [
        made("noise_labels", "unprotected", 0, 0.3),
        made("noise_labels", rescue.OURS, 0, 0.3, trials=2, remedies_kept=1, false_alarms=1, extra_steps=60),
        made("noise_labels", rescue.OURS, 1, 0.3, trials=1, false_alarms=1, extra_steps=40),
    ]
    results = rescue.Results(runs, {}, {}, ["noise_labels"], ["unprotected", rescue.OURS], [0, 1])
    assert rescue.trial_table(results).splitlines() == [
        "| method | trials | kept | false alarms | extra steps (share of steps) |",
        "| --- | --- | --- | --- | --- |",
        "| unprotected | 0 | 0 | 0 | 0 (0.0%) |",
        "| `default_callbacks()` | 3 | 1 | 2 | 100 (12.5%) |",
    ]


def harmless_results(ours: dict[int, float], bare: dict[int, float]) -> rescue.Results:
    runs = [made("data_shift", "unprotected", seed, value) for seed, value in bare.items()]
    runs += [made("data_shift", rescue.OURS, seed, value) for seed, value in ours.items()]
    return rescue.Results(runs, {}, {}, ["data_shift"], ["unprotected", rescue.OURS], sorted(bare))


def test_the_harmless_target_passes_within_tolerance_seed_by_seed() -> None:
    results = harmless_results(ours={0: 1.05, 1: 1.5}, bare={0: 1.0, 1: 2.0})
    assert rescue.harmless_target(results) == (True, (
        "harmless runs left alone: default_callbacks() within 1.05x of the unprotected final eval on 2/2 "
        "(scenario, seed) of data_shift"
    ))  # fmt: skip
    assert rescue.harmless_table(results).splitlines()[2:] == [
        "| data_shift | 0 | 1 | 1.050x |",
        "| data_shift | 1 | 2 | 0.750x |",
    ]


def test_the_harmless_target_fails_on_a_run_moved_beyond_tolerance_or_left_non_finite() -> None:
    results = harmless_results(ours={0: 1.2, 1: math.nan, 2: 2.0}, bare={0: 1.0, 1: 2.0, 2: 2.0})
    assert rescue.harmless_target(results) == (False, (
        "harmless runs left alone: default_callbacks() within 1.05x of the unprotected final eval on 1/3 "
        "(scenario, seed) of data_shift; beyond on: data_shift seed 0 (1.200x), data_shift seed 1 (nan)"
    ))  # fmt: skip


def test_the_harmless_target_skips_a_seed_whose_unprotected_run_ended_non_finite_saying_so() -> None:
    results = harmless_results(ours={0: 1.0, 1: 1.0}, bare={0: 1.0, 1: math.inf})
    assert rescue.harmless_target(results) == (True, (
        "harmless runs left alone: default_callbacks() within 1.05x of the unprotected final eval on 1/1 "
        "(scenario, seed) of data_shift; skipped, the unprotected run ended non-finite: data_shift seed 1"
    ))  # fmt: skip
    assert rescue.harmless_table(results).splitlines()[3] == "| data_shift | 1 | inf | 1 |"
    no_harmless = rescue.Results([], {}, {}, ["nan_weight"], [rescue.OURS], [0])
    assert rescue.harmless_target(no_harmless) == (False, "harmless runs left alone: no harmless scenario ran")


def test_bit_identity_is_not_asked_of_a_stable_run_that_kept_a_remedy() -> None:
    runs = [
        made("healthy", "unprotected", 0, 0.25, digest="a"),
        made("healthy", rescue.BIT_IDENTICAL, 0, 0.25, digest="a"),
        made("healthy", "unprotected", 1, 0.25, digest="b"),
        made("healthy", rescue.BIT_IDENTICAL, 1, 0.24, digest="c", trials=1, remedies_kept=1),
    ]
    results = rescue.Results(runs, {}, {}, ["healthy"], ["unprotected", rescue.OURS], [0, 1])
    identity = [check for check in rescue.targets(results) if check[1].startswith("stable LR bit-identical")]
    assert identity == [(True, (
        "stable LR bit-identical: default_callbacks(clip=None) vs unprotected on 1/1 (scenario, seed) of healthy where "
        "it kept no trial's remedy; kept a remedy (not compared): healthy seed 1"
    ))]  # fmt: skip


def test_the_catalogues_hold_together() -> None:
    names = [name for catalogue in SETS.values() for name in catalogue]
    assert len(names) == len(set(names))  # no name in two sets
    for spec in [*SCENARIOS.values(), *HELD_OUT.values(), *HARD.values(), *HARD_HELD_OUT.values()]:
        assert scenario(spec.reference).family == spec.family, spec.name
        assert not spec.harmless or (spec.description.endswith("(harmless)") and not spec.faults), spec.name
    harmless = {name for name, spec in SCENARIOS.items() if spec.harmless}
    assert harmless == {"data_shift", "hinge_at_zero", "healthy", "small_batch", "task_switch_3x", "noise_labels",
                        "input_spikes_adam", "warm_restarts", "rising_noise"}  # fmt: skip
    assert all(SCENARIOS[name].reference == name for name in harmless)
    quick = {spec.name for spec in rescue.select(None, quick=True)}
    assert {"hinge_at_zero", "data_shift", "noise_labels"} <= quick
    held_out = rescue.select(None, quick=False, held_out=True)
    assert all(spec.name in HELD_OUT and spec.in_matrix for spec in held_out) and len(held_out) == 22
    results = rescue.Results([], {}, {}, [spec.name for spec in held_out], [rescue.OURS], [0])
    assert (rescue.target_share(results), rescue.target_share(dataclasses.replace(results, scenarios=["nan_weight"]))) \
        == (0.85, 0.90)


def test_the_hard_sets_hold_a_scenario_of_each_class_and_a_harmless_twin_of_each() -> None:
    hard = {spec.name for spec in rescue.select(None, quick=False, set_name="hard")}
    assert hard == {
        "targets_grow_3x", "wide_sgd_lr6x",  # a lasting disturbance that needs clipping
        "wide_adam_lr5x", "transformer_lr25x",  # a learning rate too high that never overflows
        "deep10_init_x1.6", "tanh_rnn_gain2",  # gradients out of scale from the first step
        "periodic_spikes_every40_x50",  # periodic input spikes under SGD
        "targets_grow_3x_fit", "wide_sgd_lr1x", "deep10_kaiming", "tanh_rnn_healthy", "slow_starter",  # the twins
    }  # fmt: skip
    assert {name for name in hard if scenario(name).harmless} == {
        "targets_grow_3x_fit", "deep10_kaiming", "tanh_rnn_healthy", "slow_starter"
    }
    held_out = rescue.select(None, quick=False, set_name="hard-held-out")
    assert all(spec.name in HARD_HELD_OUT and spec.in_matrix for spec in held_out) and len(held_out) == 14
    assert {spec.family for spec in held_out} - {"mlp_sgd"} <= {scenario(name).family for name in hard} | {
        "targets_grow_2.5x_slowly", "slow_starter_6_layers"
    }
    assert rescue.target_share(rescue.Results([], {}, {}, [spec.name for spec in held_out], [rescue.OURS], [0])) == 0.85
    assert rescue.select(None, quick=False, set_name="held-out") == rescue.select(None, quick=False, held_out=True)
    with pytest.raises(ValueError, match=r"^'set' must be one of 'matrix', 'held-out', 'hard', 'hard-held-out' "):
        rescue.select(None, quick=False, set_name="nope")
