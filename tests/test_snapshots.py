"""Snapshots in host memory: copies on both sides, in-place restore, finiteness, atomic files."""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_overflow.health import nonfinite_labels
from lightning_overflow.numerics import snapshots
from lightning_overflow.numerics.norms import tensor_norms
from lightning_overflow.numerics.snapshots import (
    SnapshotError,
    clone_state,
    load_snapshot,
    nonfinite_flag,
    nonfinite_indices,
    nonfinite_paths,
    restore_optimizer_,
    restore_state_,
    save_snapshot,
    state_matches,
    state_nbytes,
    state_tensors,
    take_snapshot,
    temporary_path,
    temporary_target,
)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that NaN payloads compare equal too."""
    return t.detach().contiguous().view(-1).view(torch.uint8)


def _adam_after_steps(steps: int = 2) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(8, 3)).square().mean().backward()
        optimizer.step()
    return model, optimizer


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.randn(8, 3)).square().mean().backward()
    optimizer.step()


# ---- taking -----------------------------------------------------------------------------------------------------
def test_snapshot_is_a_copy_not_the_live_tensors() -> None:
    model, _ = _adam_after_steps()
    snapshot = take_snapshot(model.state_dict())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    for key, value in snapshot.items():
        assert torch.equal(value, before[key])
        assert value.data_ptr() != model.state_dict()[key].data_ptr()


def test_snapshot_keeps_nesting_plain_values_and_metadata() -> None:
    model, optimizer = _adam_after_steps()
    state = {"model": model.state_dict(), "optimizers": [optimizer.state_dict()], "note": ("a", 1, None)}
    snapshot = take_snapshot(state)
    assert isinstance(snapshot["model"], OrderedDict)
    assert snapshot["model"]._metadata == model.state_dict()._metadata
    assert snapshot["note"] == ("a", 1, None)
    assert snapshot["optimizers"][0]["param_groups"] == optimizer.state_dict()["param_groups"]
    assert snapshot["optimizers"][0]["param_groups"][0] is not optimizer.param_groups[0]


def test_reuse_overwrites_matching_buffers_and_allocates_the_rest() -> None:
    first = {"a": torch.ones(3), "b": torch.ones(2)}
    old = take_snapshot(first)
    new = take_snapshot({"a": torch.full((3,), 2.0), "b": torch.ones(5)}, reuse=old)
    assert new["a"] is old["a"]  # same position, shape, dtype: the buffer is reused
    assert torch.equal(new["a"], torch.full((3,), 2.0))
    assert new["b"] is not old["b"] and new["b"].shape == (5,)


def test_state_nbytes_counts_every_tensor() -> None:
    state = {"w": torch.zeros(4, 3), "opt": [{"m": torch.zeros(10, dtype=torch.float64), "step": 3}]}
    assert state_nbytes(state) == 4 * 3 * 4 + 10 * 8
    assert [tuple(t.shape) for t in state_tensors(state)] == [(4, 3), (10,)]


# ---- restoring --------------------------------------------------------------------------------------------------
def test_restore_in_place_is_bit_identical_and_keeps_the_live_tensors() -> None:
    model, _ = _adam_after_steps()
    snapshot = take_snapshot(model.state_dict())
    pointers = {k: v.data_ptr() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    model(torch.randn(8, 3))  # moves the BatchNorm running statistics too
    restore_state_(model.state_dict(), snapshot)
    for key, value in model.state_dict().items():
        assert torch.equal(value, snapshot[key]), key
        assert value.data_ptr() == pointers[key]  # copied into the live tensors


def test_restore_refuses_another_structure_and_copies_nothing() -> None:
    live = {"a": torch.zeros(2), "b": torch.zeros(3)}
    with pytest.raises(SnapshotError, match=r"b: live \(3,\) torch.float32 vs snapshot \(4,\)"):
        restore_state_(live, {"a": torch.ones(2), "b": torch.ones(4)})
    assert torch.equal(live["a"], torch.zeros(2))
    with pytest.raises(SnapshotError, match=r"keys differ \(missing \['b'\], unexpected \['c'\]\)"):
        restore_state_(live, {"a": torch.ones(2), "c": torch.ones(3)})
    assert not state_matches(live, {"a": torch.ones(2)})
    assert state_matches(live, {"a": torch.ones(2), "b": torch.ones(3)})


def test_optimizer_load_state_dict_aliases_and_restore_optimizer_does_not() -> None:
    """DESIGN fact 19: ``load_state_dict`` keeps CPU float tensors as they are; the next step then writes into them."""
    model, optimizer = _adam_after_steps()
    snapshot = take_snapshot(optimizer.state_dict())
    saved = clone_state(snapshot)

    optimizer.load_state_dict(snapshot)
    assert optimizer.state[next(model.parameters())]["exp_avg"] is snapshot["state"][0]["exp_avg"]

    model, optimizer = _adam_after_steps()
    snapshot = take_snapshot(optimizer.state_dict())
    restore_optimizer_(optimizer, snapshot)
    _step(model, optimizer)
    for index, values in snapshot["state"].items():
        for key, value in values.items():
            assert torch.equal(value, saved["state"][index][key]), (index, key)


def test_restore_optimizer_puts_back_moments_step_counts_and_hyperparameters() -> None:
    model, optimizer = _adam_after_steps()
    snapshot = take_snapshot(optimizer.state_dict())
    expected = clone_state(optimizer.state_dict())
    _step(model, optimizer)
    optimizer.param_groups[0]["lr"] = 0.5
    restore_optimizer_(optimizer, snapshot)
    live = optimizer.state_dict()
    assert live["param_groups"] == expected["param_groups"]
    for index, values in expected["state"].items():
        for key, value in values.items():
            assert torch.equal(live["state"][index][key], value), (index, key)
    assert live["state"][0]["step"].item() == 2.0


def test_restore_optimizer_loads_a_clone_when_the_state_has_another_shape() -> None:
    model, optimizer = _adam_after_steps(steps=0)
    snapshot = take_snapshot(optimizer.state_dict())  # no state yet: Adam creates it lazily
    _step(model, optimizer)
    restore_optimizer_(optimizer, snapshot)
    assert optimizer.state_dict()["state"] == {}

    model, optimizer = _adam_after_steps(steps=1)
    snapshot = take_snapshot(optimizer.state_dict())
    fresh = torch.optim.Adam(model.parameters(), lr=0.1)
    restore_optimizer_(fresh, snapshot)
    first = next(model.parameters())
    assert torch.equal(fresh.state[first]["exp_avg"], snapshot["state"][0]["exp_avg"])
    assert fresh.state[first]["exp_avg"].data_ptr() != snapshot["state"][0]["exp_avg"].data_ptr()


def test_restore_optimizer_sgd_momentum_buffers() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)

    def sgd_step() -> None:
        optimizer.zero_grad()
        model(torch.randn(4, 3)).sum().backward()
        optimizer.step()

    sgd_step()
    snapshot = take_snapshot(optimizer.state_dict())
    expected = clone_state(optimizer.state_dict())
    sgd_step()
    restore_optimizer_(optimizer, snapshot)
    for index, values in expected["state"].items():
        assert torch.equal(optimizer.state_dict()["state"][index]["momentum_buffer"], values["momentum_buffer"])


@settings(max_examples=25, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=3), min_size=1, max_size=5),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64]),
    poison=st.sampled_from([None, float("nan"), float("inf"), -float("inf")]),
)
def test_take_then_restore_round_trips_every_bit(
    shapes: list[list[int]], dtype: torch.dtype, poison: float | None
) -> None:
    gen = torch.Generator().manual_seed(0)
    live = {str(i): (torch.randn(shape, generator=gen) * 100).to(dtype) for i, shape in enumerate(shapes)}
    if poison is not None and dtype.is_floating_point:
        for t in live.values():
            if t.numel():
                t.view(-1)[0] = poison
    originals = {k: v.clone() for k, v in live.items()}
    snapshot = take_snapshot(live)
    for t in live.values():
        t.zero_()
    restore_state_(live, snapshot)
    for key, value in live.items():
        assert torch.equal(_bits(value), _bits(originals[key]))


# ---- finiteness -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("values", "flag"),
    [
        ([1.0, 2.0], 0.0),
        ([1.0, float("nan")], 1.0),
        ([float("inf"), 1.0], 1.0),
        ([-float("inf"), 1.0], 1.0),
        ([1e20, 1e20], 0.0),  # finite: only the squares of an L2 norm would overflow
        ([3e38, -3.4e38], 0.0),
        ([1e18, -1e18], 0.0),
    ],
)
def test_nonfinite_flag(values: list[float], flag: float) -> None:
    tensors = [torch.tensor([3.0, 4.0]), torch.tensor(values)]
    result = nonfinite_flag(tensors)
    assert result.dtype == torch.float64 and result.shape == ()
    assert result.item() == flag


def test_nonfinite_flag_ignores_integer_and_empty_tensors() -> None:
    assert nonfinite_flag([torch.tensor(7), torch.zeros(0), torch.tensor([1.0])]).item() == 0.0
    assert nonfinite_flag([]).item() == 0.0
    assert nonfinite_flag([torch.tensor([float("nan")], dtype=torch.bfloat16)]).item() == 1.0


def _adam_moments_after_huge_gradients() -> torch.Tensor:
    """Adam's ``exp_avg_sq`` after one step with gradients of 3e11: values near 9e19, all finite."""
    p = torch.nn.Parameter(torch.zeros(1000))
    optimizer = torch.optim.Adam([p])
    p.grad = torch.full((1000,), 3e11)
    optimizer.step()
    return optimizer.state[p]["exp_avg_sq"]


LARGE_BUT_FINITE = {
    "1000 x 1e18": lambda: torch.full((1000,), 1e18),
    "fp32 max": lambda: torch.tensor([3.4e38, -3.4e38, 1.0]),
    "fp16 max": lambda: torch.full((1000,), 65504.0, dtype=torch.float16),
    "bf16 1e38": lambda: torch.full((1000,), 1e38, dtype=torch.bfloat16),
    "float64 1e300": lambda: torch.full((10,), -1e300, dtype=torch.float64),
    "adam exp_avg_sq": _adam_moments_after_huge_gradients,
}


@pytest.mark.parametrize("name", sorted(LARGE_BUT_FINITE))
def test_large_finite_values_are_finite(name: str) -> None:
    """Finite values whose L2 norm overflows FP32 are no reason to refuse a state; one NaN or inf still is."""
    t = LARGE_BUT_FINITE[name]()
    assert torch.isfinite(t).all()
    assert nonfinite_flag([t]).item() == 0.0
    assert nonfinite_indices([t]) == [] and nonfinite_paths({"t": t}) == []
    for poison in (float("nan"), float("inf"), -float("inf")):
        bad = t.clone()
        bad.view(-1)[-1] = poison
        assert nonfinite_flag([t, bad]).item() == 1.0, poison
        assert nonfinite_indices([t, bad]) == [1] and nonfinite_paths({"t": t, "bad": bad}) == ["bad"]


def test_adam_moments_overflow_the_fp32_l2_norm() -> None:
    """Why the check reads the largest magnitude: the FP32 L2 norm of these healthy moments is inf."""
    moments = _adam_moments_after_huge_gradients()
    assert moments.max().item() == pytest.approx(9e19, rel=1e-6)
    assert math.isinf(tensor_norms([moments]).item())


def test_scalars_false_leaves_out_step_counters() -> None:
    model, optimizer = _adam_after_steps()
    first = model[0].weight
    optimizer.state[first]["step"].fill_(float("nan"))  # 0-d: a counter, not a value that can overflow
    state = optimizer.state_dict()
    assert nonfinite_flag(state_tensors(state), scalars=False).item() == 0.0
    assert nonfinite_paths(state, scalars=False) == []
    assert nonfinite_flag(state_tensors(state)).item() == 1.0
    assert nonfinite_paths(state) == ["state.0.step"]
    optimizer.state[first]["exp_avg"].view(-1)[0] = float("nan")
    assert nonfinite_paths(state, scalars=False) == ["state.0.exp_avg"]


def test_flag_moved_to_the_cpu_is_ready_to_read() -> None:
    flag = nonfinite_flag([torch.tensor([float("nan")])], device="cpu")
    assert flag.device.type == "cpu" and flag.item() == 1.0


@settings(max_examples=40, deadline=None)
@given(
    exponents=st.lists(st.integers(-10, 38), min_size=1, max_size=6),
    sizes=st.lists(st.integers(1, 2000), min_size=6, max_size=6),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    poison=st.lists(st.sampled_from([None, float("nan"), float("inf"), -float("inf")]), min_size=6, max_size=6),
)
def test_nonfinite_paths_agree_with_health_nonfinite_labels(
    exponents: list[int], sizes: list[int], dtype: torch.dtype, poison: list[float | None]
) -> None:
    """One rule across the suite: a tensor is non-finite when it holds inf or NaN, whatever its magnitude."""
    limit = torch.finfo(dtype).max
    tensors = []
    for i, exponent in enumerate(exponents):
        t = torch.full((sizes[i],), min(10.0**exponent, limit), dtype=dtype)
        if poison[i] is not None:
            t[sizes[i] // 2] = poison[i]
        tensors.append(t)
    labels = [f"t{i}" for i in range(len(tensors))]
    expected = [label for label, t in zip(labels, tensors) if not torch.isfinite(t).all()]
    assert nonfinite_paths(dict(zip(labels, tensors))) == expected
    assert nonfinite_labels(tensors, labels) == expected


def test_nonfinite_paths_name_the_tensors() -> None:
    model, optimizer = _adam_after_steps()
    with torch.no_grad():
        model[2].bias.fill_(float("nan"))
    optimizer.state[model[0].weight]["exp_avg_sq"].view(-1)[0] = float("inf")
    assert nonfinite_paths(model.state_dict()) == ["2.bias"]
    assert nonfinite_paths(optimizer.state_dict(), "opt") == ["opt.state.0.exp_avg_sq"]
    assert nonfinite_paths({"n": torch.tensor(3)}) == []


def test_hot_path_is_sync_free_on_meta_tensors() -> None:
    """``meta`` tensors have no values: any host read (``.item()``, ``bool(t)``) would raise here."""
    model = torch.nn.Linear(64, 64, device="meta")
    optimizer = torch.optim.Adam(model.parameters())
    state = {"model": model.state_dict(), "optimizers": [optimizer.state_dict()]}
    snapshot = take_snapshot(state)
    assert all(t.device.type == "meta" for t in state_tensors(snapshot))
    snapshot = take_snapshot(state, reuse=snapshot)
    restore_state_(model.state_dict(), snapshot["model"])
    flag = nonfinite_flag(state_tensors(state))
    assert flag.device.type == "meta"
    wide = torch.empty(3, dtype=torch.float64, device="meta")  # float64 takes its own path
    assert nonfinite_flag([wide, *state_tensors(state)], scalars=False).device.type == "meta"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_flag_moved_to_the_cpu_is_read_after_the_copy_landed() -> None:
    """A non-blocking device-to-host copy read at once can see the buffer before the copy lands: the flag's copy is
    queued behind large kernels here, and the expected value alternates so a reused buffer cannot pass for it."""
    busy = torch.randn(4096, 4096, device="cuda")
    for i in range(20):
        busy = torch.tanh(busy @ busy)  # milliseconds of queued work, values kept bounded
        t = torch.tensor([1.0, float("nan") if i % 2 else 2.0], device="cuda")
        assert nonfinite_flag([t], device="cpu").item() == float(i % 2), i


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_flag_stays_on_the_device() -> None:
    tensors = [torch.ones(3, device="cuda"), torch.tensor(2.0)]  # Adam keeps its step counter on the CPU
    assert nonfinite_flag(tensors).device.type == "cuda"
    assert nonfinite_flag(tensors, scalars=False).device.type == "cuda"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_snapshot_uses_pinned_buffers_and_round_trips() -> None:
    model = torch.nn.Linear(8, 8).cuda()
    snapshot = take_snapshot(model.state_dict())
    assert all(t.is_pinned() for t in snapshot.values())
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.fill_(float("nan"))
    restore_state_(model.state_dict(), snapshot)
    torch.cuda.synchronize()
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key])


# ---- disk -------------------------------------------------------------------------------------------------------
def test_saved_snapshot_loads_with_weights_only(tmp_path: Path) -> None:
    model, optimizer = _adam_after_steps()
    sched = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=10)
    state = {
        "model": model.state_dict(),
        "optimizers": [optimizer.state_dict()],
        "schedulers": [sched.state_dict()],
        "precision": {"scale": 65536.0, "_growth_tracker": 3},
    }
    snapshot = take_snapshot(state)
    path = save_snapshot({"state": snapshot, "extras": {"LRBackoff": {"scale": 0.5}}}, tmp_path / "s.pt", step=12)
    raw = torch.load(path, weights_only=True)
    assert raw["step"] == 12 and raw["payload"]["extras"] == {"LRBackoff": {"scale": 0.5}}
    step, payload = load_snapshot(path)
    assert step == 12
    assert state_matches(model.state_dict(), payload["state"]["model"])
    for key, value in payload["state"]["model"].items():
        assert torch.equal(value, snapshot["model"][key])
    assert payload["state"]["schedulers"] == snapshot["schedulers"]
    assert os.listdir(tmp_path) == ["s.pt"]


class SimulatedCrash(BaseException):
    """Stands for the process dying between the temporary write and the rename."""


def test_crash_before_rename_leaves_the_previous_file_intact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "s.pt"
    save_snapshot({"w": torch.ones(3)}, path, step=1)
    seen: list[str] = []

    def crash(src: str, dst: str) -> None:
        seen.append(Path(src).name)
        assert Path(src).stat().st_size > 0  # the temporary file was written in full
        raise SimulatedCrash

    monkeypatch.setattr(snapshots.os, "replace", crash)
    with pytest.raises(SimulatedCrash):
        save_snapshot({"w": torch.full((3,), 2.0)}, path, step=2)
    monkeypatch.undo()
    assert seen == [temporary_path(path).name]
    step, payload = load_snapshot(path)
    assert step == 1 and torch.equal(payload["w"], torch.ones(3))
    assert os.listdir(tmp_path) == ["s.pt"]

    fresh = tmp_path / "fresh.pt"
    monkeypatch.setattr(snapshots.os, "replace", crash)
    with pytest.raises(SimulatedCrash):
        save_snapshot({"w": torch.ones(3)}, fresh, step=3)
    assert not fresh.exists()


def test_temporary_name_never_looks_like_a_snapshot() -> None:
    tmp = temporary_path("/runs/rollback-step=12.pt")
    assert tmp.parent == Path("/runs")
    assert tmp.name.startswith(".rollback-step=12.pt.tmp-") and not tmp.name.endswith(".pt")


def test_temporary_target_inverts_temporary_path() -> None:
    assert temporary_target(temporary_path("/runs/rollback-step=12.pt")) == Path("/runs/rollback-step=12.pt")
    assert temporary_target("/runs/.s.pt.tmp-77") == Path("/runs/s.pt")  # any process id
    for name in ("rollback-step=12.pt", ".rollback-step=12.pt", ".s.pt.tmp-", ".s.pt.tmp-12x", "s.pt.tmp-12"):
        assert temporary_target(Path("/runs") / name) is None, name


@pytest.mark.parametrize("damage", ["truncate", "garbage", "foreign", "missing"])
def test_unusable_files_are_refused(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "s.pt"
    save_snapshot({"w": torch.ones(1000)}, path, step=4)
    if damage == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x00" * 64)
    elif damage == "foreign":
        torch.save({"state_dict": {"w": torch.ones(2)}}, path)
    else:
        path.unlink()
    with pytest.raises(SnapshotError, match="s.pt"):
        load_snapshot(path)
