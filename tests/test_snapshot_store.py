"""The snapshot store: the ring of host buffers, checksummed atomic files on any fsspec filesystem, dirpath checks."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_bit_identical, fit, make_trainer, weights
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem
from pytorch_lightning.callbacks import ModelCheckpoint

from lightning_overflow._compat import Callback
from lightning_overflow.callbacks.nonfinite_detector import NonFiniteDetector
from lightning_overflow.callbacks.rollback import Rollback
from lightning_overflow.numerics.snapshots import state_matches, take_snapshot
from lightning_overflow.snapshot_store import (
    SnapshotError,
    SnapshotFiles,
    SnapshotRing,
    content_digest,
    load_snapshot,
    save_snapshot,
    snapshot_name,
    temporary_path,
    temporary_target,
)
from lightning_overflow.testing import Fault, FaultInjector, TinyRegressor

RESUME = pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")


def _adam_after_steps(steps: int = 2) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(8, 3)).square().mean().backward()
        optimizer.step()
    return model, optimizer


@pytest.fixture
def memory_fs() -> Any:
    """The process-wide fsspec memory filesystem, emptied before and after the test."""
    MemoryFileSystem.store.clear()
    MemoryFileSystem.pseudo_dirs[:] = [""]
    yield MemoryFileSystem()
    MemoryFileSystem.store.clear()
    MemoryFileSystem.pseudo_dirs[:] = [""]


# ---- the ring ---------------------------------------------------------------------------------------------------
def test_ring_keeps_the_last_snapshots_and_reuses_the_oldest_buffers() -> None:
    ring = SnapshotRing(keep=2)
    first = ring.take(2, {"w": torch.full((3,), 2.0)}, extras={"a": 1})
    second = ring.take(4, {"w": torch.full((3,), 4.0)}, extras={})
    buffer = first.state["w"]  # type: ignore[index]
    third = ring.take(6, {"w": torch.full((3,), 6.0)}, extras={})
    assert ring.steps == [4, 6] and ring.snapshots == [second, third]
    assert third.state["w"] is buffer  # type: ignore[index]  # the oldest's buffer holds the newest state
    assert torch.equal(buffer, torch.full((3,), 6.0))
    again = ring.take(6, {"w": torch.full((3,), 7.0)}, extras={})
    assert ring.steps == [6] and ring.snapshots == [again]  # the same step replaces; step 4 gave its buffers
    ring.discard(again)
    assert ring.steps == []


def test_the_first_snapshot_takes_the_rings_memory_and_no_later_one_allocates() -> None:
    ring = SnapshotRing(keep=3)
    state = {"w": torch.zeros(1000), "b": torch.zeros(10)}
    ring.take(0, state, extras={})
    assert ring.steps == [0] and ring.nbytes == 3 * 4 * 1010  # the buffers of all three, touched once
    states = [*ring._spares, ring.snapshots[0].state]
    buffers = {t.data_ptr() for state in states for t in state.values()}  # type: ignore[union-attr]
    for step in range(1, 8):
        state["w"].fill_(float(step))
        taken = ring.take(step, state, extras={})
        assert {t.data_ptr() for t in taken.state.values()} <= buffers  # type: ignore[union-attr]
        assert torch.equal(taken.state["w"], torch.full((1000,), float(step)))  # type: ignore[index]
    assert ring.steps == [5, 6, 7] and ring.nbytes == 3 * 4 * 1010
    ring.discard(ring.snapshots[0])  # its buffers hold the next snapshot
    assert ring.nbytes == 3 * 4 * 1010
    assert {t.data_ptr() for t in ring.take(8, state, {}).state.values()} <= buffers  # type: ignore[union-attr]


# ---- files ------------------------------------------------------------------------------------------------------
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
    payload = {"state": snapshot, "extras": {"LRBackoff": {"scale": 0.5}}}
    path = save_snapshot(payload, tmp_path / "s.pt", step=12)
    assert path == str(tmp_path / "s.pt")
    raw = torch.load(path, weights_only=True)
    assert raw["format"] == "lightning_overflow.snapshot" and raw["version"] == 2 and raw["step"] == 12
    assert raw["sha256"] == content_digest(12, payload) and len(raw["sha256"]) == 64
    assert raw["payload"]["extras"] == {"LRBackoff": {"scale": 0.5}}
    step, loaded = load_snapshot(path)
    assert step == 12
    assert state_matches(model.state_dict(), loaded["state"]["model"])
    for key, value in loaded["state"]["model"].items():
        assert torch.equal(value, snapshot["model"][key])
    assert loaded["state"]["schedulers"] == snapshot["schedulers"]
    assert os.listdir(tmp_path) == ["s.pt"]


def test_one_overwritten_float_is_refused_by_the_checksum(tmp_path: Path) -> None:
    """torch.load reads a file with one float changed without complaint; the digest does not match it."""
    path = tmp_path / "s.pt"
    save_snapshot({"w": torch.arange(16.0)}, path, step=3)
    data = bytearray(path.read_bytes())
    at = data.find(struct.pack("<f", 5.0))
    assert data.find(struct.pack("<f", 5.0), at + 1) == -1  # the one place that float is stored
    data[at : at + 4] = struct.pack("<f", 7.0)
    path.write_bytes(bytes(data))
    raw = torch.load(path, weights_only=True)  # the control: nothing notices the change...
    assert raw["payload"]["w"][5].item() == 7.0
    with pytest.raises(SnapshotError) as info:  # ...but the digest does
        load_snapshot(path)
    assert str(info.value).startswith(f"{path} does not match its checksum (sha256 {raw['sha256'][:16]}... written, ")
    assert str(info.value).endswith("... read): its bytes changed after it was written")


def test_digest_covers_keys_values_dtypes_and_the_step() -> None:
    base = content_digest(1, {"w": torch.zeros(2), "lr": 0.1})
    assert base == content_digest(1, {"w": torch.zeros(2), "lr": 0.1})
    for other in (
        content_digest(2, {"w": torch.zeros(2), "lr": 0.1}),
        content_digest(1, {"v": torch.zeros(2), "lr": 0.1}),
        content_digest(1, {"w": torch.zeros(2), "lr": 0.2}),
        content_digest(1, {"w": torch.zeros(2, dtype=torch.float64), "lr": 0.1}),
        content_digest(1, {"w": torch.zeros(1, 2), "lr": 0.1}),
        content_digest(1, {"w": torch.tensor([0.0, -0.0]), "lr": 0.1}),  # the bits, not the values
    ):
        assert other != base


class SimulatedCrash(BaseException):
    """Stands for the process dying between the temporary write and the move."""


def test_crash_before_the_move_leaves_the_previous_file_intact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "s.pt"
    save_snapshot({"w": torch.ones(3)}, path, step=1)
    seen: list[str] = []

    def crash(fs: Any, src: str, dst: str, **kwargs: Any) -> None:
        seen.append(Path(src).name)
        assert Path(src).stat().st_size > 0  # the temporary file was written in full
        raise SimulatedCrash

    monkeypatch.setattr(LocalFileSystem, "mv", crash)
    with pytest.raises(SimulatedCrash):
        save_snapshot({"w": torch.full((3,), 2.0)}, path, step=2)
    monkeypatch.undo()
    assert seen == [Path(temporary_path(path)).name]
    step, payload = load_snapshot(path)
    assert step == 1 and torch.equal(payload["w"], torch.ones(3))
    assert os.listdir(tmp_path) == ["s.pt"]  # the temporary file was removed

    fresh = tmp_path / "fresh.pt"
    monkeypatch.setattr(LocalFileSystem, "mv", crash)
    with pytest.raises(SimulatedCrash):
        save_snapshot({"w": torch.ones(3)}, fresh, step=3)
    assert not fresh.exists()


def test_temporary_name_never_looks_like_a_snapshot() -> None:
    tmp = temporary_path("/runs/rollback-step=12.pt")
    assert tmp.startswith("/runs/.rollback-step=12.pt.tmp-") and not tmp.endswith(".pt")
    assert temporary_path("memory://snaps/s.pt") == f"memory://snaps/.s.pt.tmp-{os.getpid()}"


def test_temporary_target_inverts_temporary_path() -> None:
    assert temporary_target(temporary_path("/runs/rollback-step=12.pt")) == "rollback-step=12.pt"
    assert temporary_target("/runs/.s.pt.tmp-77") == "s.pt"  # any process id
    for name in ("rollback-step=12.pt", ".rollback-step=12.pt", ".s.pt.tmp-", ".s.pt.tmp-12x", "s.pt.tmp-12"):
        assert temporary_target(f"/runs/{name}") is None, name


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        ("truncate", "is not a readable snapshot (RuntimeError: "),
        ("garbage", "is not a readable snapshot ("),
        ("foreign", "is not a lightning_overflow.snapshot file"),
        ("version 1", "has an unsupported version, no step or no digest (version 1)"),
        ("missing", "is not a readable snapshot (FileNotFoundError: "),
    ],
)
def test_unusable_files_are_refused(tmp_path: Path, damage: str, problem: str) -> None:
    path = tmp_path / "s.pt"
    save_snapshot({"w": torch.ones(1000)}, path, step=4)
    if damage == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x00" * 64)
    elif damage == "foreign":
        torch.save({"state_dict": {"w": torch.ones(2)}}, path)
    elif damage == "version 1":  # the format before digests: no checksum to verify, so never trusted
        torch.save({"format": "lightning_overflow.snapshot", "version": 1, "step": 4, "payload": {}}, path)
    else:
        path.unlink()
    with pytest.raises(SnapshotError) as info:
        load_snapshot(path)
    assert str(info.value).startswith(f"{path} {problem}")


def test_files_on_the_memory_filesystem_touch_no_local_folder(
    memory_fs: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    files = SnapshotFiles("memory://snaps")
    assert files.problem() == ""
    files.write(snapshot_name(2), {"w": torch.ones(2)}, step=2)
    memory_fs.pipe("/snaps/.rollback-step=4.pt.tmp-99", b"partial")  # left by a killed writer
    memory_fs.pipe("/snaps/.notes.tmp-99", b"someone else's")
    assert sorted(memory_fs.ls("/snaps", detail=False)) == [
        "/snaps/.notes.tmp-99", "/snaps/.rollback-step=4.pt.tmp-99", "/snaps/rollback-step=2.pt"
    ]
    assert files.remove_temporaries() == [".rollback-step=4.pt.tmp-99"]
    step, payload = files.read(snapshot_name(2))
    assert step == 2 and torch.equal(payload["w"], torch.ones(2))
    files.remove(snapshot_name(2))
    files.remove(snapshot_name(2))  # a missing file is no error
    assert memory_fs.ls("/snaps", detail=False) == ["/snaps/.notes.tmp-99"]
    assert os.listdir(tmp_path) == []  # no local folder named "memory:"


# ---- dirpath checked at setup -----------------------------------------------------------------------------------
def _unwritable_directory(tmp_path: Path) -> Path:
    """A directory this process cannot write: a read-only one, or sysfs when running as root (which ignores the
    permission bits of ordinary directories)."""
    if os.geteuid() != 0:
        directory = tmp_path / "read-only"
        directory.mkdir()
        directory.chmod(0o500)
        return directory
    sysfs = Path("/sys")
    try:
        (sysfs / ".rollback-write-test").write_bytes(b"")
    except OSError:
        return sysfs
    pytest.skip("no directory this process cannot write")


@pytest.mark.parametrize("case", ["file", "under a file", "unwritable"])
def test_a_dirpath_that_cannot_hold_snapshots_fails_at_setup(tmp_path: Path, case: str) -> None:
    existing = tmp_path / "notes.txt"
    existing.write_text("not a directory")
    if case == "file":
        dirpath, problem = existing, "it is an existing file"
    elif case == "under a file":
        dirpath, problem = existing / "snaps", f"it lies under the file {existing}"
    else:
        dirpath = _unwritable_directory(tmp_path)
        problem = "it cannot be written ("
    rollback = Rollback(every_n_steps=2, dirpath=dirpath)  # the type is checked here, the place in setup
    trainer = make_trainer([rollback], max_steps=4)
    with pytest.raises(ValueError) as info:
        trainer.fit(TinyRegressor())
    assert str(info.value).startswith(
        f"'dirpath' must be a directory Rollback can write to (got {dirpath!r}: {problem}"
    )
    assert trainer.global_step == 0


# ---- Rollback's files -------------------------------------------------------------------------------------------
def _first_run(tmp_path: Path, dirpath: Any, max_steps: int = 4) -> Path:
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=max_steps, save_top_k=-1)
    fit(TinyRegressor(), [NonFiniteDetector(), Rollback(every_n_steps=2, dirpath=dirpath), checkpoints],
        max_steps=max_steps, enable_checkpointing=True)
    return tmp_path / "ckpt" / f"epoch=0-step={max_steps}.ckpt"


class WeightsAt(Callback):
    """Records the weights at the end of every batch (put it after Rollback)."""

    def __init__(self) -> None:
        self.at: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *_: Any) -> None:
        self.at[trainer.global_step] = weights(pl_module)


@RESUME
def test_memory_dirpath_serves_a_restart(memory_fs: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``dirpath="memory://snaps"`` goes through fsspec: no local ``memory:`` folder, and a new Trainer resumed
    from a checkpoint rolls back to a file written before the restart."""
    monkeypatch.chdir(tmp_path)
    ckpt = _first_run(tmp_path, "memory://snaps")
    assert sorted(memory_fs.ls("/snaps", detail=False)) == ["/snaps/rollback-step=2.pt", "/snaps/rollback-step=4.pt"]
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    _, payload = load_snapshot("memory://snaps/rollback-step=2.pt")
    rollback, probe = Rollback(every_n_steps=2, dirpath="memory://snaps"), WeightsAt()
    faults = FaultInjector(Fault(step=4, kind="nan_weight"), Fault(step=5, kind="nan_weight"))
    trainer = make_trainer([NonFiniteDetector(), rollback, probe, faults], max_steps=6)
    trainer.fit(TinyRegressor(), ckpt_path=ckpt)
    history = [(h["step"], h["snapshot_step"], h["source"]) for h in rollback.history]
    assert history == [(5, 4, "disk"), (6, 2, "disk")]  # the files the uninterrupted run's snapshots were
    assert_bit_identical(probe.at[6], dict(payload["state"]["model"]))
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "overflow_events.jsonl"]  # the journal; no "memory:" folder


@RESUME
def test_a_file_whose_bytes_changed_is_journaled_and_never_restored(tmp_path: Path) -> None:
    ckpt = _first_run(tmp_path, tmp_path / "snaps")
    path = tmp_path / "snaps" / snapshot_name(2)
    _, payload = load_snapshot(path)
    target = payload["state"]["model"]["net.0.weight"][0, 0].item()
    data = bytearray(path.read_bytes())
    at = data.find(struct.pack("<f", target))
    data[at : at + 4] = struct.pack("<f", target + 1.0)  # one float overwritten, still finite
    path.write_bytes(bytes(data))

    rollback = Rollback(every_n_steps=2, dirpath=tmp_path / "snaps")
    faults = FaultInjector(Fault(step=4, kind="nan_weight"), Fault(step=5, kind="nan_weight"))
    trainer = make_trainer([NonFiniteDetector(), rollback, faults], max_steps=8)
    trainer.fit(TinyRegressor(), ckpt_path=ckpt)
    # The second rollback would go one snapshot further back, to the file; it is refused and step 4 is used again.
    assert [(h["snapshot_step"], h["source"]) for h in rollback.history] == [(4, "disk"), (4, "disk")]
    unusable = [e for e in rollback.board(trainer).journal.events if e.kind == "snapshot_unusable"]
    assert len(unusable) == 1 and unusable[0].details["file"] == snapshot_name(2)
    assert unusable[0].message.startswith(f"Rollback: the snapshot file {path} cannot be used on rank(s) [0]: {path} ")
    assert "does not match its checksum" in unusable[0].message
    assert all(bool(torch.isfinite(t).all()) for t in weights(trainer.lightning_module).values())


def test_a_snapshot_that_no_weights_only_load_could_read_is_refused_when_written(tmp_path: Path) -> None:
    """A NumPy array in ``get_extra_state``: refused at once, naming where it is, instead of written and refused by
    the load after a restart, when it is needed."""
    import numpy as np

    payload = {"state": {"model": {"_extra_state": {"counts": np.arange(3)}}}}
    with pytest.raises(SnapshotError) as error:
        save_snapshot(payload, tmp_path / "s.pt", step=7)
    assert str(error.value) == (
        "the snapshot of step 7 holds a numpy.ndarray at payload['state']['model']['_extra_state']['counts'], which "
        "torch.load(weights_only=True) refuses: written, it could never be read back. HINT: return tensors, numbers, "
        "strings and lists or dicts of them from get_extra_state (e.g. torch.from_numpy(array) instead of a NumPy "
        "array)"
    )
    assert not list(tmp_path.iterdir())
