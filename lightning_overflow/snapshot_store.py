"""Where rollback snapshots are kept: a ring of host buffers in memory, and checksummed files on any filesystem.

Memory (:class:`SnapshotRing`). The last ``keep`` snapshots, each a host copy of the training state. The first
snapshot allocates the buffers of all ``keep`` (the others filled with the same copy, which touches their pages), and
every later snapshot is copied into buffers already there: the oldest snapshot's once the ring is full. So no
snapshot after the first allocates host memory, and a copy into memory already touched runs about three times as fast
as into fresh pages. A snapshot is only taken of a state verified finite, so the buffers are overwritten by a good
state only.

Files (:class:`SnapshotFiles`, :func:`save_snapshot`, :func:`load_snapshot`). Each file is one ``torch.save`` record,
readable with ``torch.load(weights_only=True)``::

    {"format": "lightning_overflow.snapshot", "version": 2, "step": 12, "sha256": "<hex>", "payload": {...}}

``sha256`` is a digest of the step and the payload's content (every tensor's dtype, shape and bytes, every plain
value, every key, in order). :func:`load_snapshot` recomputes it: a file whose bytes changed after it was written (one
float overwritten, which ``torch.load`` itself does not notice) is refused with :class:`SnapshotError`. Paths go
through fsspec, the way Lightning's own ``ModelCheckpoint`` writes (``get_filesystem``): a local directory, or
``s3://``, ``gs://``, ``memory://`` and any other protocol fsspec knows. A file is written under a hidden temporary
name in the same directory (flushed to disk on a local filesystem) and then moved over its final name, so a crash
leaves either no file or a complete previous one; a temporary file left by a killed process never looks like a
snapshot (:func:`temporary_target` recognises it for cleaning).

Several ranks. A snapshot on one rank may hold only that rank's part of the state (FSDP2's shards, or the DDP
rank's share of a split snapshot, its other tensors ``meta`` placeholders): each rank then writes its own file into
its own folder, ``<dirpath>/rank=<r>/`` (:meth:`SnapshotFiles.for_rank`), under the same name, so the list of files a
checkpoint keeps is the same on every rank. A placeholder is stored as what it is (a ``meta`` tensor: dtype and
shape, no bytes), and its digest covers exactly that.

Example:
    >>> ring = SnapshotRing(keep=2)
    >>> for step in (2, 4, 6):
    ...     _ = ring.take(step, {"w": torch.full((3,), float(step))}, extras={})
    >>> ring.steps
    [4, 6]
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning_fabric.utilities.cloud_io import get_filesystem
from torch import Tensor

from lightning_overflow.numerics.snapshots import SnapshotError, held_nbytes, synchronize, take_snapshot

__all__ = [
    "SNAPSHOT_FORMAT",
    "SNAPSHOT_NAME",
    "Snapshot",
    "SnapshotError",
    "SnapshotFiles",
    "SnapshotRing",
    "content_digest",
    "load_snapshot",
    "save_snapshot",
    "snapshot_name",
    "temporary_path",
    "temporary_target",
]

SNAPSHOT_FORMAT = "lightning_overflow.snapshot"
SNAPSHOT_NAME = "rollback-step={step}.pt"
_VERSION = 2  # 2: with a content digest
_SNAPSHOT_FILE = re.compile(re.escape(SNAPSHOT_NAME).replace(re.escape("{step}"), r"\d+"))  # any step
_TEMPORARY = re.compile(r"\.(?P<name>.+)\.tmp-\d+")  # the names temporary_path gives


# ---- memory -----------------------------------------------------------------------------------------------------
@dataclass
class Snapshot:
    """One rollback target.

    Attributes:
        step: the ``global_step`` it was taken at.
        state: the host copy of the training state, or ``None`` for a file not read yet (one listed by a checkpoint
            written before a restart).
        extras: what the suite's callbacks keep beside it (primitives).
        file: its file name in the snapshot directory, once written (or listed).
        owners: for a snapshot split across DDP ranks, the rank that holds each split tensor, by its path (see
            :func:`~lightning_overflow.training_state.split_snapshot`); empty when this rank holds every tensor.
    """

    step: int
    state: dict[str, Any] | None
    extras: dict[str, Any] = field(default_factory=dict)
    file: str | None = None
    owners: dict[str, int] = field(default_factory=dict)


class SnapshotRing:
    """The last ``keep`` snapshots in host memory, oldest first; the oldest's buffers hold the next one.

    Args:
        keep: how many snapshots to keep (at least 1).
    """

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.snapshots: list[Snapshot] = []
        self._spares: list[Any] = []  # buffers that hold no snapshot (yet, or any more), for the next ones

    @property
    def steps(self) -> list[int]:
        return [snapshot.step for snapshot in self.snapshots]

    @property
    def nbytes(self) -> int:
        """Host bytes held by the ring: its snapshots and the buffers ready for the next ones (placeholders cost
        none)."""
        held = [s.state for s in self.snapshots if s.state is not None] + self._spares
        return sum(held_nbytes(state) for state in held)

    def take(
        self,
        step: int,
        state: Any,
        extras: dict[str, Any],
        held: list[bool] | None = None,
        owners: dict[str, int] | None = None,
    ) -> Snapshot:
        """Copy ``state`` (live tensors) into the ring as the newest snapshot; a snapshot of the same step is
        replaced. Asynchronous on a GPU (see :func:`~lightning_overflow.numerics.snapshots.take_snapshot`).

        Args:
            held: which tensors this rank keeps (the others become placeholders); default all.
            owners: who keeps each split tensor (stored on the snapshot for the restore).
        """
        if len(self.snapshots) >= self.keep:
            reuse = self.snapshots.pop(0).state
        else:
            reuse = self._spares.pop() if self._spares else None
        snapshot = Snapshot(step, take_snapshot(state, reuse, held), extras, owners=dict(owners or {}))
        for replaced in [s for s in self.snapshots if s.step == step]:
            self.discard(replaced)
        self.snapshots.append(snapshot)
        while len(self.snapshots) + len(self._spares) < self.keep:  # the first snapshot: the ring's other buffers
            self._spares.append(take_snapshot(state, None, held))
        return snapshot

    def discard(self, snapshot: Snapshot) -> None:
        """Drop ``snapshot``; its buffers hold the next one."""
        kept = [s for s in self.snapshots if s is not snapshot]
        if len(kept) < len(self.snapshots) and snapshot.state is not None:
            self._spares.append(snapshot.state)
        self.snapshots = kept

    def clear(self) -> None:
        self.snapshots = []
        self._spares = []


# ---- files ------------------------------------------------------------------------------------------------------
def snapshot_name(step: int) -> str:
    """The file name of the snapshot of ``step``: ``rollback-step=<step>.pt``."""
    return SNAPSHOT_NAME.format(step=int(step))


class SnapshotFiles:
    """A directory of snapshot files, local or remote (any fsspec URL).

    Args:
        dirpath: the directory (created when needed).

    Example:
        >>> files = SnapshotFiles("memory://doc-snapshots")
        >>> files.problem()
        ''
        >>> digest = files.write(snapshot_name(3), {"w": torch.ones(2)}, step=3)
        >>> digest == content_digest(3, {"w": torch.ones(2)}), files.read(snapshot_name(3))[0]
        (True, 3)
        >>> files.remove(snapshot_name(3))
    """

    def __init__(self, dirpath: str | os.PathLike[str]) -> None:
        self.dirpath = os.fspath(dirpath)

    @property
    def fs(self) -> Any:
        """The fsspec filesystem of :attr:`dirpath` (looked up on use: the store pickles as its path)."""
        return get_filesystem(self.dirpath)

    def __repr__(self) -> str:
        return f"SnapshotFiles({self.dirpath!r})"

    def path(self, name: str) -> str:
        return _join(self.fs, self.dirpath, name)

    def for_rank(self, rank: int) -> SnapshotFiles:
        """The folder of one rank's files, ``<dirpath>/rank=<rank>``, for snapshots each rank holds a part of.

        Example:
            >>> SnapshotFiles("memory://runs").for_rank(1).dirpath
            'memory://runs/rank=1'
        """
        return SnapshotFiles(_join(self.fs, self.dirpath, f"rank={int(rank)}"))

    def problem(self) -> str:
        """Why snapshots cannot be written to this directory, or ``""``: it is a file, lies under a file, or a probe
        file cannot be written and removed there. Creates the directory."""
        if self.fs.isfile(self.dirpath):
            return "it is an existing file"
        if isinstance(self.fs, LocalFileSystem):
            for parent in Path(self.dirpath).absolute().parents:
                if parent.is_file():
                    return f"it lies under the file {parent}"
        probe = self.path(f".rollback-probe.tmp-{os.getpid()}")
        try:
            self.fs.makedirs(self.dirpath, exist_ok=True)
            with self.fs.open(probe, "wb") as f:
                f.write(b"probe")
            self.fs.rm(probe)
        except Exception as err:  # permission, read-only filesystem, credentials: all mean "cannot write here"
            return f"it cannot be written ({type(err).__name__}: {err})"
        return ""

    def write(self, name: str, payload: Any, *, step: int) -> str:
        """Write a snapshot file atomically (see :func:`save_snapshot`); its content digest."""
        return _save(payload, self.path(name), step)

    def read(self, name: str) -> tuple[int, Any]:
        """Read and verify a snapshot file (see :func:`load_snapshot`)."""
        return load_snapshot(self.path(name))

    def read_checked(
        self, name: str, step: int, check: Callable[[Any], str], digest: str | None = None
    ) -> tuple[Any, dict[str, Any], str]:
        """Read a snapshot file and verify it: readable, its digest (``digest``, where given: the one this file had
        when it was written, so that a file another run wrote over it is refused), its step, then ``check(payload)``
        (``""`` when the payload's state is usable, else why not). Never raises: the file is untrusted, and whatever
        it holds, the caller must go on (every rank reaches the same collective after this).

        Returns:
            ``(state, rest, "")``, or ``(None, rest, why it cannot be used)``; ``rest`` is the payload without its
            state (``extras`` and whatever else was written beside it), ``{}`` when it cannot be read.
        """
        rest: dict[str, Any] = {}
        try:
            found, payload, written = _load(self.path(name))
            state, rest = payload["state"], {k: v for k, v in payload.items() if k != "state"}
            if digest is not None and written != digest:
                problem = (f"it is not the file this run wrote for step {step} (sha256 {digest[:16]}... then, "
                           f"{written[:16]}... now): another run wrote over it")  # fmt: skip
            else:
                problem = f"it holds the snapshot of step {found}, not {step}" if found != step else check(payload)
        except Exception as err:  # a bad pickle, a missing key, a tensor where a dict belongs: all mean "unusable"
            return None, rest, str(err) if isinstance(err, SnapshotError) else f"{type(err).__name__}: {err}"
        return (None if problem else state), rest, problem

    def remove(self, name: str) -> None:
        """Remove a file if it is there (a missing file, or one that cannot be removed, is no error)."""
        with contextlib.suppress(Exception):
            path = self.path(name)
            if self.fs.exists(path):
                self.fs.rm(path)

    def remove_temporaries(self) -> list[str]:
        """Remove the temporary files a killed process left for snapshot files; their names."""
        if not self.fs.isdir(self.dirpath):
            return []
        removed = []
        for entry in self.fs.ls(self.dirpath, detail=False):
            name = _split(str(entry).rstrip("/"))[1]
            target = temporary_target(name)
            if target is not None and _SNAPSHOT_FILE.fullmatch(target):
                self.remove(name)
                removed.append(name)
        return removed


def temporary_path(path: str | os.PathLike[str]) -> str:
    """Where :func:`save_snapshot` writes before the move: a hidden name beside ``path`` that never looks like a
    snapshot.

    Example:
        >>> temporary_path("memory://runs/rollback-step=12.pt").startswith("memory://runs/.rollback-step=12.pt.tmp-")
        True
    """
    head, name = _split(os.fspath(path))
    return f"{head}.{name}.tmp-{os.getpid()}"


def temporary_target(path: str | os.PathLike[str]) -> str | None:
    """The file name that a temporary file of :func:`save_snapshot` was written for, or ``None`` when ``path`` is
    not one (the inverse of :func:`temporary_path`, for any process id).

    Example:
        >>> temporary_target("/runs/.rollback-step=12.pt.tmp-4242")
        'rollback-step=12.pt'
        >>> temporary_target("/runs/rollback-step=12.pt") is None
        True
    """
    match = _TEMPORARY.fullmatch(_split(os.fspath(path))[1])
    return None if match is None else match["name"]


def save_snapshot(payload: Any, path: str | os.PathLike[str], *, step: int) -> str:
    """Write a snapshot file: a temporary file beside ``path``, flushed to disk (locally), then moved over ``path``.

    A crash at any point leaves either no file at ``path`` or a previous complete one (the move is a rename on a
    local filesystem). On an error the temporary file is removed; after a hard kill it stays behind under its hidden
    name (:func:`temporary_path`), which no loader takes for a snapshot.

    Args:
        payload: what to save: primitives and tensors only, so that ``torch.load(weights_only=True)`` reads it.
        path: the file to write: a local path or an fsspec URL.
        step: the training step the snapshot belongs to, stored beside the payload and in its digest.

    Returns:
        ``path`` as a string.
    """
    _save(payload, path, step)
    return os.fspath(path)


def _save(payload: Any, path: str | os.PathLike[str], step: int) -> str:
    """:func:`save_snapshot`; the content digest written."""
    path = os.fspath(path)
    unloadable = _not_weights_only(payload)
    if unloadable:
        raise SnapshotError(
            f"the snapshot of step {step} holds {unloadable}, which torch.load(weights_only=True) refuses: written, "
            f"it could never be read back. HINT: return tensors, numbers, strings and lists or dicts of them from "
            f"get_extra_state (e.g. torch.from_numpy(array) instead of a NumPy array)"
        )
    fs = get_filesystem(path)
    tmp = temporary_path(path)
    synchronize()  # the host reads the buffers now: pending device-to-host copies must be done
    digest = content_digest(int(step), payload)
    record = {"format": SNAPSHOT_FORMAT, "version": _VERSION, "step": int(step), "sha256": digest, "payload": payload}
    head = _split(path)[0].rstrip("/" + os.sep)
    if head:
        fs.makedirs(head, exist_ok=True)
    try:
        with fs.open(tmp, "wb") as f:
            torch.save(record, f)
            if isinstance(fs, LocalFileSystem):
                f.flush()
                os.fsync(f.fileno())
        fs.mv(tmp, path)
    except BaseException:
        with contextlib.suppress(Exception):
            if fs.exists(tmp):
                fs.rm(tmp)
        raise
    if isinstance(fs, LocalFileSystem) and head:
        _fsync_directory(head)
    return digest


def load_snapshot(path: str | os.PathLike[str]) -> tuple[int, Any]:
    """Read a snapshot written by :func:`save_snapshot` onto the CPU (``torch.load(weights_only=True)``) and verify
    its digest.

    Returns:
        ``(step, payload)``.

    Raises:
        SnapshotError: the file is missing, truncated, unreadable, not a snapshot of this format and version, or its
            content does not match its digest.
    """
    step, payload, _ = _load(path)
    return step, payload


def _load(path: str | os.PathLike[str]) -> tuple[int, Any, str]:
    """:func:`load_snapshot`, and the digest its content matched."""
    path = os.fspath(path)
    try:
        with get_filesystem(path).open(path, "rb") as f:
            record = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated zip, bad pickle, missing file: all mean "not usable"
        raise SnapshotError(f"{path} is not a readable snapshot ({type(err).__name__}: {err})") from err
    if not isinstance(record, dict) or record.get("format") != SNAPSHOT_FORMAT or "payload" not in record:
        raise SnapshotError(f"{path} is not a {SNAPSHOT_FORMAT} file")
    step = record.get("step")
    if record.get("version") != _VERSION or not isinstance(step, int) or not isinstance(record.get("sha256"), str):
        version = record.get("version")
        raise SnapshotError(f"{path} has an unsupported version, no step or no digest (version {version!r})")
    digest = content_digest(step, record["payload"])
    if digest != record["sha256"]:
        raise SnapshotError(
            f"{path} does not match its checksum (sha256 {record['sha256'][:16]}... written, {digest[:16]}... read): "
            f"its bytes changed after it was written"
        )
    return step, record["payload"], digest


_LOADABLE = (Tensor, int, float, bool, complex, str, bytes, type(None), torch.Size, torch.dtype, torch.device)


def _not_weights_only(node: Any, path: str = "payload") -> str:
    """What in ``node`` ``torch.load(weights_only=True)`` would refuse, as ``"a numpy.ndarray at payload[...]"``
    (``""`` when nothing): checked before a snapshot is written, so that a file is never written that no restart can
    read."""
    if isinstance(node, _LOADABLE):
        return ""
    if isinstance(node, Mapping):
        for key, value in node.items():
            if not isinstance(key, (str, int, float, bool, type(None))):
                return f"a key of type {type(key).__module__}.{type(key).__qualname__} in {path}"
            found = _not_weights_only(value, f"{path}[{key!r}]")
            if found:
                return found
        return ""
    if isinstance(node, (list, tuple)):
        for index, value in enumerate(node):
            found = _not_weights_only(value, f"{path}[{index}]")
            if found:
                return found
        return ""
    return f"a {type(node).__module__}.{type(node).__qualname__} at {path}"


def content_digest(step: int, payload: Any) -> str:
    """The sha256 of a snapshot's step and content: every key, plain value, and tensor dtype, shape and bytes, in
    order. Equal for a payload and what ``torch.load`` reads back from its file.

    Example:
        >>> a = content_digest(1, {"w": torch.zeros(2)})
        >>> a == content_digest(1, {"w": torch.zeros(2)}), a == content_digest(1, {"w": torch.tensor([0.0, 1e-45])})
        (True, False)
    """
    digest = hashlib.sha256(f"step={int(step)};".encode())
    _feed(digest, payload)
    return digest.hexdigest()


# ---- internals --------------------------------------------------------------------------------------------------
def _feed(digest: Any, node: Any) -> None:
    if isinstance(node, Tensor) and node.device.type == "meta":  # a placeholder: its layout is all there is
        digest.update(f"placeholder {node.dtype} {tuple(node.shape)};".encode())
    elif isinstance(node, Tensor):
        tensor = node.detach()
        if tensor.layout != torch.strided:
            tensor = tensor.to_dense()
        tensor = tensor.cpu().contiguous()
        digest.update(f"tensor {tensor.dtype} {tuple(tensor.shape)};".encode())
        digest.update(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
    elif isinstance(node, Mapping):
        digest.update(f"map {len(node)};".encode())
        for key, value in node.items():
            digest.update(f"key {key!r};".encode())
            _feed(digest, value)
    elif isinstance(node, (list, tuple)):
        digest.update(f"{type(node).__name__} {len(node)};".encode())
        for value in node:
            _feed(digest, value)
    else:
        digest.update(f"{type(node).__name__} {node!r};".encode())


def _split(path: str) -> tuple[str, str]:
    """``(directory with its trailing separator, file name)``, for local paths and URLs alike."""
    cut = max(path.rfind("/"), path.rfind(os.sep)) + 1
    return path[:cut], path[cut:]


def _join(fs: Any, directory: str, name: str) -> str:
    if isinstance(fs, LocalFileSystem):
        return os.path.join(directory, name)
    return f"{directory.rstrip('/')}/{name}"


def _fsync_directory(directory: str) -> None:
    """Make the rename itself durable (POSIX); a no-op where directories cannot be opened."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
