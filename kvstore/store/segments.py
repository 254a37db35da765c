"""Per-layer KV files of one segment: `sessions/<segment>/layer-NNN.kv`, append-only, token-major.

Each file holds raw `[tokens, 2, n_kv_heads, head_dim]` elements of one layer. An extent is the
same token range in every layer file, at the same page-aligned offset (C5: new bytes never share a
page with committed ones). `start_append` writes with pwrite, and starts the fsync of the files
(`fileio.PosixIO.fsync_files`: one syncfs where that is as safe) and of the directory when it
created files on the syncing thread; the caller may prepare its index rows meanwhile, and commits
the extent once `Appending.finish` says it is durable (`append` does both at once). A group commit
writes the extents of several sessions (`write_extent`) and starts one sync for all of them
(`start_sync`).

A full disk is StoreFull with nothing committed, from the write itself (the file systems we run on
reserve the space of a buffered write when it is made) or, where space is only found at writeback,
from the sync, which undoes the append. The bytes are never written through a mapping, so no SIGBUS
can come of it; hence no posix_fallocate first: it cost each checkpoint 30 more calls, and on ext4
the conversion of the reserved (unwritten) extents at writeback, about 0.2 ms of CPU per checkpoint
in all (30 layer files of 12 KiB, Intel Xeon with AMX, KVM).
`read_extents_into` reads extents and verifies their per-layer checksums. All file calls go
through `fileio.io`.
"""

from __future__ import annotations

import mmap
import re
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from .. import direct_io
from ..errors import CorruptData
from ..fileio import close_all, io, reraise_full
from . import codec
from .workers import serial

if TYPE_CHECKING:
    import torch

PAGE = mmap.PAGESIZE
# Extents of a layer file less than this many bytes apart are read in one request, the bytes between
# them read and dropped (each extent begins at a page boundary: those of a reply's checkpoints, a few
# tokens each, lie a fraction of a page apart). Reading up to 64 KiB more costs less than a request
# of its own, which from the disk is a round trip.
NEAR = 64 << 10
LAYER_FILE = re.compile(r"layer-(\d{3,})\.kv")


def layer_path(directory: Path, layer: int) -> Path:
    return directory / f"layer-{layer:03d}.kv"


@lru_cache(maxsize=256)
def layer_paths(directory: Path, n_layers: int) -> tuple[Path, ...]:
    """The paths of a segment's first n_layers layer files (made once per segment: a checkpoint
    names every one of them)."""
    return tuple(layer_path(directory, i) for i in range(n_layers))


def align(n: int) -> int:
    return -(-n // PAGE) * PAGE


def as_bytes(t: "torch.Tensor") -> np.ndarray:
    """A contiguous CPU tensor's bytes as a uint8 array (no copy)."""
    from ..engine.buffers import bytes_of  # here, not at the top: the index-only commands (list, show, rm, ...) never load torch

    return bytes_of(t)


def layer_bytes(layers) -> list[np.ndarray]:
    """Each layer's bytes as a uint8 array (no copy): from a list of per-layer CPU tensors, or from
    one `[n_layers, T, 2, n_kv, hd]` CPU tensor at once (a checkpoint's rows copied together: one
    conversion, where a list costs one per layer)."""
    import torch

    if isinstance(layers, torch.Tensor):
        return list(as_bytes(layers.contiguous()).reshape(layers.shape[0], -1))
    return [as_bytes(t.contiguous()) for t in layers]


@dataclass
class Written:
    offset: int
    n_tokens: int
    checksums: list[str]
    end: int  # committed_end once this extent is committed


def append(directory: Path, committed_end: int, layers, *, names_synced: bool = False) -> Written:
    """Write one extent (per layer `[T, 2, n_kv, hd]` CPU tensors, or all layers as one tensor:
    `layer_bytes`) durably after `committed_end` (`start_append`, then `Appending.finish`)."""
    return start_append(directory, committed_end, layers, names_synced=names_synced).finish()


def start_append(directory: Path, committed_end: int, layers, *, names_synced: bool = False) -> "Appending":
    """Write one extent (per layer `[T, 2, n_kv, hd]` CPU tensors, or all layers as one tensor:
    `layer_bytes`) after `committed_end` and start
    making it durable on the syncing thread; the caller may prepare its index rows meanwhile, and
    must call `finish` (which waits for the sync) before it commits the extent.

    The directory and its parent are fsynced when this call creates files, and also whenever the
    caller has not yet made the names durable itself (`names_synced`): files found on disk may
    have been created by a writer that died before its directory fsync.
    """
    appending = write_extent(directory, committed_end, layers, names_synced=names_synced)
    start_sync([appending])
    return appending


def write_extent(directory: Path, committed_end: int, layers, *, names_synced: bool = False) -> "Appending":
    """`start_append` without the sync: the extent written, not yet durable. The caller starts its
    sync (`start_sync`, which takes the extents of several sessions at once: a group commit) or
    abandons it. On a failed write nothing is left of it (StoreFull when the disk is full)."""
    offset = align(committed_end)
    data = layer_bytes(layers)
    length = data[0].nbytes
    checksums = [codec.checksum(d) for d in data]
    fds: list[int] = []
    opened: list[Path] = []
    made: list[Path] = []  # files this call created
    backend = io.backend  # the same backend for every call of this append (a checkpoint runs 60 of them)
    try:
        created = backend.mkdir(directory)
        for path, d in zip(layer_paths(directory, len(data)), data):
            fd = _open_existing(backend, path) if names_synced else None  # this writer made and synced every name
            if fd is None:
                if not backend.exists(path):
                    made.append(path)
                fd = backend.open(path, create=True)
            fds.append(fd)
            opened.append(path)
            backend.pwrite(fd, d, offset)
    except OSError as e:
        _undo(fds, opened, made, committed_end)
        reraise_full(e, f"writing KV to {directory.name}")
    return Appending(Written(offset, len(layers[0]), checksums, offset + length), directory, fds, opened, made,
                     committed_end, names=bool(created or made or not names_synced))


def start_sync(appendings: list["Appending"]) -> None:
    """Start making these written extents durable on the syncing thread (`_sync`): one sync of the
    file system for all of them where that is as safe, so the checkpoints of several sessions
    committed together (`commit.commit_group`) wait for the disk once. Returns once the sync waits
    for the disk (`_start_sync`); each extent's `finish` waits for it to end."""
    if not appendings:
        return
    syncing = _start_sync(appendings)
    for a in appendings:
        a.syncing = syncing


def _open_existing(backend, path: Path) -> int | None:
    try:
        return backend.open(path)
    except FileNotFoundError:  # removed since (its extents packed, `pack.free_packed_segment`): made again
        return None


def _start_sync(appendings: list["Appending"]) -> Future:
    """`_sync` on the syncing thread, returning once it waits for the disk: left to compete for the
    GIL and the cores with this thread's next Python, it could start late, after the work it was to
    overlap. In this thread once the interpreter is shutting down (a session closed at exit: no new
    work is taken then); its outcome in the future all the same."""
    waiting = threading.Event()
    try:
        syncing = serial(SYNCER).submit(_sync, appendings, waiting.set)
    except RuntimeError:
        syncing = Future()
        try:
            _sync(appendings)
        except OSError as e:
            syncing.set_exception(e)
        else:
            syncing.set_result(None)
        return syncing
    waiting.wait()
    return syncing


def _sync(appendings: list["Appending"], started: Callable[[], None] = lambda: None) -> None:
    """The extents' layer files' data (`fileio.PosixIO.fsync_files`: one syncfs per file system where
    that is as safe), then the names of the directories whose names may not be durable yet, and
    their parent; `started()` once the first call waits for the disk (or this fails before)."""
    try:
        if len(appendings) == 1:
            io.fsync_files(appendings[0].fds, started)
        else:
            by_device: dict[int, list[int]] = {}
            for a in appendings:
                by_device.setdefault(io.device(a.fds[0]), []).extend(a.fds)
            for fds in by_device.values():
                io.fsync_files(fds, started)
        named = [a.directory for a in appendings if a.names]
        for directory in named:
            io.fsync_dir(directory)
        for parent in dict.fromkeys(d.parent for d in named):
            io.fsync_dir(parent)
    finally:
        started()


@dataclass
class Appending:
    """An extent written to its layer files (`write_extent`), their sync under way once started
    (`start_sync`)."""

    written: Written
    directory: Path
    fds: list[int]
    opened: list[Path]
    made: list[Path]
    committed_end: int
    names: bool  # the directory's names must be made durable too (files made, or found unsynced)
    syncing: Future | None = None

    def finish(self) -> Written:
        """Wait until the extent is durable and close its files; on a failed sync, undo what was
        written (StoreFull when the disk is full) as a failed write would."""
        assert self.syncing is not None, "start_sync first"
        try:
            self.syncing.result()
            fds, self.fds = self.fds, []
            close_all(fds)
        except OSError as e:
            fds, self.fds = self.fds, []  # closed once: a later `abandon` must not close numbers reused since
            _undo(fds, self.opened, self.made, self.committed_end)
            reraise_full(e, f"writing KV to {self.directory.name}")
        return self.written

    def abandon(self) -> None:
        """The caller will not commit the extent (its transaction failed): wait for the sync and close
        the files. The bytes stay past the committed end, as a killed writer's would, until an open
        truncates them (`truncate_uncommitted`)."""
        try:
            if self.syncing is not None:
                self.syncing.result()
        except OSError:
            pass
        try:
            fds, self.fds = self.fds, []
            close_all(fds)
        except OSError:
            pass


# One thread per process makes the layer files durable while the caller goes on (the sync is a wait
# on the disk: the GIL is released).
SYNCER = "kvstore-sync"


def _undo(fds: list[int], opened: list[Path], made: list[Path], committed_end: int) -> None:
    """After a failed append: remove the files it created, cut the others back to their committed
    end. Best effort: the error that made the append fail is the one reported."""
    try:
        close_all(fds)
    except OSError:
        pass
    for path in opened:
        try:
            if path in made:
                io.unlink(path)
                continue
            fd = io.open(path)
            try:
                if io.size(fd) > committed_end:
                    io.truncate(fd, committed_end)
            finally:
                io.close(fd)
        except OSError:
            pass


def truncate_uncommitted(directory: Path, committed_end: int) -> None:
    """Drop bytes a killed writer left after the last committed extent (recovery on open)."""
    for name, size in io.sizes(directory):
        if name.endswith(".tmp"):
            io.unlink(directory / name)
        elif size > committed_end and LAYER_FILE.fullmatch(name):
            path = directory / name
            fd = io.open(path)
            try:
                if io.size(fd) > committed_end:
                    io.truncate(fd, committed_end)
                    io.fsync(fd)
            finally:
                io.close(fd)


@dataclass
class ExtentRead:
    """One layer of one extent to read: `data` (a writable uint8 array) filled from `offset`, then
    checked against `checksum` when one is given; `what` names the extent in errors."""

    offset: int
    data: np.ndarray
    what: str
    checksum: str | None = None


def read_extent(directory: Path, layer: int, offset: int, nbytes: int, *, what: str,
                checksum: str | None = None) -> np.ndarray:
    """The raw bytes of one layer of an extent, checked against `checksum` when given; CorruptData
    if the file is missing or short, or the bytes are not what was written."""
    data = np.empty(nbytes, dtype=np.uint8)
    read_extents_into(layer_path(directory, layer), [ExtentRead(offset, data, what, checksum)])
    return data


def read_extents_into(path: Path, reads: list[ExtentRead], *, cached: bool = False) -> None:
    """Fill each read's `data` from one layer file (`layer_path`'s), opened once (reads that follow
    each other in the file in one call), and check each one's checksum. CorruptData names the
    extent and the file when the file is missing, short or truncated, or the bytes are not what was
    written. When the page cache lacks part of what the reads cover, they come straight from the
    disk (`fileio.PosixIO.pread_direct_into`); `cached`: the caller found them in the page cache
    just before, so plain reads without asking again. A restore calls this once per layer on its
    reading threads, so it does little besides the calls that release the GIL."""
    try:
        fd = io.open_read(path)
    except FileNotFoundError:
        raise CorruptData(f"{reads[0].what}: file {path.name} is missing; the session cannot be restored "
                          "(restore it from an export, or delete it)") from None
    try:
        size = io.size(fd)
        start = min(r.offset for r in reads)
        uncached = not cached and io.uncached(fd, start, max(r.offset + r.data.nbytes for r in reads) - start)
        read = io.pread_direct_into if uncached else io.pread_into
        for run in _near(reads):  # one read for extents near each other in the file, the gaps read and dropped
            end = run[-1].offset + run[-1].data.nbytes
            if size < end:
                cut = next(r for r in run if size < r.offset + r.data.nbytes)
                raise CorruptData(f"{cut.what}: file {path.name} is truncated ({size} bytes, the extent needs "
                                  f"{cut.offset + cut.data.nbytes}); the session cannot be restored")
            bufs, pos = [], run[0].offset
            for r in run:
                if r.offset > pos:
                    bufs.append(direct_io.gap(r.offset - pos))
                bufs.append(r.data)
                pos = r.offset + r.data.nbytes
            if read(fd, bufs, run[0].offset) != end - run[0].offset:
                raise CorruptData(f"{run[0].what}: short read from {path.name}")
            for r in run:
                if r.checksum is not None and codec.checksum(r.data) != r.checksum:  # the message only when needed
                    verify(r.data, r.checksum, what=f"{r.what} ({path.parent.name}/{path.name})")
    finally:
        io.close(fd)


def _near(reads: list[ExtentRead]) -> list[list[ExtentRead]]:
    """`reads` in runs whose file ranges follow each other, in order, less than NEAR bytes apart."""
    runs: list[list[ExtentRead]] = []
    for r in reads:
        if runs and 0 <= r.offset - (runs[-1][-1].offset + runs[-1][-1].data.nbytes) < NEAR:
            runs[-1].append(r)
        else:
            runs.append([r])
    return runs


def verify(data: np.ndarray, expected: str, *, what: str) -> None:
    actual = codec.checksum(data)
    if actual != expected:
        raise CorruptData(f"{what}: checksum mismatch (stored {expected}, read {actual}); the bytes on disk "
                          "were damaged. Run `kvstore verify` and restore the session from an export or a fork")
