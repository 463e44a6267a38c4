"""Snapshots in host memory: copies on both sides, in-place restore, param groups added later, finiteness."""

from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_overflow.numerics.norms import tensor_norms
from lightning_overflow.numerics.snapshots import (
    SnapshotError,
    clone_state,
    group_sizes,
    held_nbytes,
    is_placeholder,
    local_state,
    named_state_tensors,
    nonfinite_flag,
    nonfinite_indices,
    nonfinite_paths,
    nonfinite_suspect,
    partition_by_size,
    restore_optimizer_,
    restore_state_,
    state_difference,
    state_matches,
    state_nbytes,
    state_tensors,
    take_snapshot,
    without_placeholders,
)
from lightning_overflow.training_state import nonfinite_parts


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


def _sparse_sgd_step(embedding: torch.nn.Embedding, optimizer: torch.optim.Optimizer, rows: list[int],
                     value: float = 1.0) -> None:  # fmt: skip
    (embedding(torch.tensor(rows)).sum() * value).backward()
    optimizer.step()
    optimizer.zero_grad()


def test_a_sparse_momentum_is_restored_in_place_and_checked_by_its_values() -> None:
    """SGD's momentum of a sparse gradient is a sparse tensor: copied into a detached alias, the restore changed the
    alias only (the NaN stayed in the optimizer); and the state check's ``amin`` does not run on it."""
    embedding = torch.nn.Embedding(10, 3, sparse=True)
    optimizer = torch.optim.SGD(embedding.parameters(), lr=0.1, momentum=0.9)
    _sparse_sgd_step(embedding, optimizer, [1, 2])
    snapshot = take_snapshot(optimizer.state_dict())
    kept = optimizer.state[embedding.weight]["momentum_buffer"].to_dense().clone()
    _sparse_sgd_step(embedding, optimizer, [2, 5], value=float("nan"))
    live = optimizer.state[embedding.weight]["momentum_buffer"]
    assert live.is_sparse and not torch.isfinite(live.to_dense()).all()
    assert nonfinite_parts({}, [optimizer.state_dict()]) == ([], ["state.0.momentum_buffer"])
    restore_optimizer_(optimizer, snapshot)
    assert torch.equal(optimizer.state[embedding.weight]["momentum_buffer"].to_dense(), kept)
    assert nonfinite_parts({}, [optimizer.state_dict()]) == ([], [])


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
def test_nonfinite_paths_agree_with_the_training_state_check(
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
    assert nonfinite_parts(dict(zip(labels, tensors)), [])[0] == expected


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


# ---- param groups added during a fit ----------------------------------------------------------------------------
def _two_layer_sgd() -> tuple[torch.nn.Linear, torch.nn.Linear, torch.optim.Optimizer]:
    torch.manual_seed(0)
    head, backbone = torch.nn.Linear(3, 1), torch.nn.Linear(3, 3)
    optimizer = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
    return head, backbone, optimizer


def _sgd_step(head: torch.nn.Linear, backbone: torch.nn.Linear, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    head(backbone(torch.randn(4, 3))).square().mean().backward()
    optimizer.step()


def test_restore_optimizer_keeps_a_param_group_added_after_the_snapshot() -> None:
    """What BackboneFinetuning does: a group added at an epoch. The snapshot's group comes back bit for bit, the new
    group stays with its hyperparameters, its parameters without state (as when it was added)."""
    head, backbone, optimizer = _two_layer_sgd()
    _sgd_step(head, backbone, optimizer)
    snapshot = take_snapshot(optimizer.state_dict())
    expected = clone_state(optimizer.state_dict())
    optimizer.add_param_group({"params": list(backbone.parameters()), "lr": 0.01})
    for _ in range(2):
        _sgd_step(head, backbone, optimizer)
    optimizer.param_groups[0]["lr"] = 0.5
    assert group_sizes(optimizer.param_groups) == [2, 2] and len(optimizer.state) == 4

    restore_optimizer_(optimizer, snapshot)
    live = optimizer.state_dict()
    assert group_sizes(live["param_groups"]) == [2, 2]
    assert live["param_groups"][0] == expected["param_groups"][0]
    assert [g["lr"] for g in optimizer.param_groups] == [0.1, 0.01]
    assert sorted(live["state"]) == [0, 1]  # the backbone's parameters have no state again
    for index in (0, 1):
        assert torch.equal(live["state"][index]["momentum_buffer"], expected["state"][index]["momentum_buffer"])
        live_buffer, saved_buffer = live["state"][index]["momentum_buffer"], snapshot["state"][index]["momentum_buffer"]
        assert live_buffer.data_ptr() != saved_buffer.data_ptr()
    _sgd_step(head, backbone, optimizer)  # and it steps on
    assert sorted(optimizer.state_dict()["state"]) == [0, 1, 2, 3]


def test_restore_optimizer_refuses_another_layout_and_changes_nothing() -> None:
    head, backbone, optimizer = _two_layer_sgd()
    _sgd_step(head, backbone, optimizer)
    snapshot = take_snapshot(optimizer.state_dict())
    other = torch.optim.SGD([{"params": [head.weight]}, {"params": [head.bias]}], lr=0.1, momentum=0.9)
    _sgd_step(head, backbone, other)
    before = clone_state(other.state_dict())
    with pytest.raises(SnapshotError, match=r"^param groups of \[2\] parameters in the snapshot, \[1, 1\] in the "):
        restore_optimizer_(other, snapshot)
    after = other.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for index, values in before["state"].items():
        assert torch.equal(after["state"][index]["momentum_buffer"], values["momentum_buffer"])


def test_state_difference_names_the_first_place() -> None:
    assert state_difference({"a": torch.zeros(2)}, {"a": torch.ones(2)}) == ""
    assert state_difference({"a": {"b": torch.zeros(2)}}, {"a": {"b": torch.zeros(2, dtype=torch.float64)}}) == (
        "a.b: live (2,) torch.float32 vs snapshot (2,) torch.float64"
    )
    assert state_difference({"a": torch.zeros(1)}, {"c": torch.zeros(1)}) == (
        "<root>: keys differ (missing ['a'], unexpected ['c'])"
    )


def test_named_state_tensors_walk_nested_extra_state() -> None:
    state = {"w": torch.ones(1), "m._extra_state": {"calls": 3, "ema": torch.zeros(2)}, "opt": [(torch.ones(1),)]}
    assert [path for path, _ in named_state_tensors(state, "x")] == ["x.w", "x.m._extra_state.ema", "x.opt.0.0"]


def test_numerics_snapshots_do_no_file_io() -> None:
    """Files are the snapshot store's: the numerics module neither imports os, pathlib nor io, nor calls
    torch.save / torch.load / open."""
    import ast

    from lightning_overflow.numerics import snapshots

    tree = ast.parse(Path(snapshots.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not imported & {"os", "pathlib", "io", "shutil", "tempfile"}
    calls = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert not calls & {"torch.save", "torch.load", "open"}


# ---- split snapshots (DDP) and shards (FSDP2) -------------------------------------------------------------------
def test_partition_by_size_is_balanced_and_deterministic() -> None:
    assert partition_by_size([10, 3, 7, 2], 2) == [0, 1, 1, 0]  # 10 | 7, then 3 to the lighter (7), 2 to 10's
    assert partition_by_size([5, 5, 5, 5], 2) == [0, 1, 0, 1]  # ties: the lowest rank first
    assert partition_by_size([4, 1], 3) == [0, 1]  # more ranks than tensors: some own nothing
    assert partition_by_size([], 4) == []
    with pytest.raises(ValueError, match=r"^'parts' must be at least 1 \(got 0\)$"):
        partition_by_size([1], 0)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 10_000), max_size=40), st.integers(1, 9))
def test_partition_by_size_bounds_the_largest_share(sizes: list[int], parts: int) -> None:
    owners = partition_by_size(sizes, parts)
    loads = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(parts)]
    assert all(0 <= o < parts for o in owners) and sum(loads) == sum(sizes)
    assert max(loads) <= sum(sizes) / parts + max(sizes, default=0)


def test_a_partial_snapshot_holds_placeholders_and_restores_only_what_it_holds() -> None:
    model, optimizer = _adam_after_steps(steps=2)
    state = {"model": model.state_dict(), "optimizers": [optimizer.state_dict()]}
    tensors = state_tensors(state)
    held = [i % 2 == 0 for i in range(len(tensors))]
    snapshot = take_snapshot(state, held=held)
    kept = state_tensors(snapshot)
    assert [not is_placeholder(t) for t in kept] == held
    assert all(t.shape == u.shape and t.dtype == u.dtype for t, u in zip(kept, tensors))
    assert held_nbytes(snapshot) == sum(t.numel() * t.element_size() for t, h in zip(tensors, held) if h)
    assert len(state_tensors(without_placeholders(snapshot))) == sum(held)
    before = [t.clone() for t in tensors]
    with torch.no_grad():
        for t in tensors:
            t.add_(1)
    restore_state_(state, snapshot)  # the held tensors come back; the placeholders' tensors are left alone
    for t, old, h in zip(state_tensors(state), before, held):
        assert torch.equal(t, old if h else old + 1)


@pytest.fixture
def one_rank_group() -> Any:
    """A gloo process group of one rank in this process, for DTensors; destroyed afterwards."""
    import torch.distributed as dist

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def test_a_sharded_optimizer_restored_from_a_snapshot_of_another_shape_keeps_dtensor_moments(
    one_rank_group: Any,
) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    first = model[0].weight
    assert isinstance(first, DTensor)
    first.grad = torch.ones_like(first)  # only the first parameter steps: the others get no state
    optimizer.step()
    snapshot = take_snapshot(local_state(optimizer.state_dict()))
    assert type(snapshot["state"][0]["exp_avg"]) is torch.Tensor  # the local shard, a plain host tensor
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()  # now every parameter has state: the snapshot has another shape
    restore_optimizer_(optimizer, snapshot)
    assert list(optimizer.state) == [first]
    moment = optimizer.state[first]["exp_avg"]
    assert isinstance(moment, DTensor) and moment.placements == first.placements
    assert torch.equal(moment.to_local(), snapshot["state"][0]["exp_avg"])
    assert moment.to_local().data_ptr() != snapshot["state"][0]["exp_avg"].data_ptr()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()  # DTensor parameters with DTensor moments: the optimizer runs on
    assert optimizer.state[first]["step"].item() == 2.0


# ---- the first look of a state check ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_the_first_look_never_misses_inf_or_nan(dtype: torch.dtype, bad: float) -> None:
    tensors = [torch.ones(5, dtype=dtype), torch.ones(3, dtype=dtype)]
    tensors[1][2] = bad
    assert nonfinite_suspect(tensors).item() == nonfinite_flag(tensors).item() == 1.0


def test_the_first_look_is_raised_by_finite_values_only_past_the_range_of_their_sum() -> None:
    assert nonfinite_suspect([torch.full((1000,), 1e30), torch.full((3,), -1e30)]).item() == 0.0
    assert nonfinite_suspect([torch.full((3,), 6e4, dtype=torch.float16)]).item() == 0.0  # summed in float32
    huge = [torch.full((1000,), 1e36)]  # sums to 1e39: a suspect that the max-abs check clears
    assert (nonfinite_suspect(huge).item(), nonfinite_flag(huge).item()) == (1.0, 0.0)
    # Integer tensors and (with scalars=False) step counters are not looked at, as by nonfinite_flag.
    assert nonfinite_suspect([torch.tensor(float("nan"))], scalars=False).item() == 0.0
    assert nonfinite_suspect([torch.tensor([1, 2])]).item() == 0.0
    meta = nonfinite_suspect([torch.empty(4, device="meta")])  # no host read: meta tensors have no values
    assert meta.device.type == "meta"
