"""A fault-injecting file layer for the store's I/O seam (`kvstore.fileio`).

`FaultyIO` performs every operation for real, so the process reads back what it wrote as it would
through a page cache, and it keeps a model of what a disk holds after a power loss: per file, the
bytes as of its last successful fsync and the changes made since; per directory, the entries
created, renamed, unlinked or removed since its last fsync. `power_loss()` rewrites the real files
to one state such a disk can come back in: each unsynced write kept, dropped, or replaced by
garbage sectors, and the unsynced directory changes of each directory undone (all of them, or all
after a random prefix, as a journal would keep them).

Faults on cue, by operation index (every call through the seam counts; `log` names them):
- `fail(n, err)`: operation n raises OSError(err). A failed write lands in part; a failed fsync
  drops the writes it was to make durable (as Linux does after a writeback error), so an fsync that
  later succeeds on the same data proves nothing: the data must be written again. `sticky=True`
  keeps a full disk full (or a broken disk broken) until `heal()`.
- `crash_at_sync(k)`: power fails just before the k-th fsync; that call and all later ones raise
  `Crash`, so no cleanup code runs; then call `power_loss()` and open the store afresh.
- `kill_at(n)`: SIGKILL this process before operation n (a write is torn: half of it lands).
- `crash_at_op(n)`: the same in process: operation n and all later ones raise `Crash`; then
  `process_death()` closes what the dead process held and keeps the unsynced state, so recovery
  runs on a page cache that still has to reach the disk (and `power_loss()` may follow).
- `hook(n, fn)`: run fn() before operation n (to interleave another store call at that point).

SQLite does its own I/O, outside the seam: the index is taken as durable at each commit (WAL with
synchronous=FULL fsyncs the log before COMMIT returns) and as rolled back when a crash interrupts a
transaction, which is what SQLite's recovery guarantees. Deleting the index or its `-wal` file is
tested separately, by deleting them.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kvstore.fileio import PosixIO

SECTOR = 512
SYNCS = ("fsync", "fsync_dir")
# operations that need free space: what ENOSPC can hit
SPACE = ("create", "allocate", "pwrite", "fsync", "truncate", "fsync_dir", "mkdir", "rename", "lock")


class Crash(BaseException):
    """The simulated machine lost power (a BaseException: no `except Exception` cleanup runs)."""


@dataclass
class Change:
    offset: int
    data: bytes | None  # None: the file's size became `offset` (truncate, fallocate)
    lost: bool = False  # an fsync failed after it: the kernel dropped it


@dataclass
class FileModel:
    durable: bytes
    pending: list[Change] = field(default_factory=list)


@dataclass
class DirOp:
    kind: str  # create, mkdir, unlink, rmdir, rename
    path: str
    src: str | None = None  # rename: where it came from
    saved: FileModel | None = None  # unlink: the file; rename: the file it replaced


class FaultyIO(PosixIO):
    def __init__(self, *, track: bool = True, seed: int = 0):
        self.track, self.rng = track, random.Random(seed)
        self.log: list[tuple[str, str]] = []
        self.files: dict[str, FileModel] = {}
        self.dirops: list[DirOp] = []
        self.fds: dict[int, str] = {}
        self.locks: set[int] = set()
        self.n_syncs = 0
        self.down = False
        self._fail: dict[int, tuple[int, bool]] = {}
        self._sticky: int | None = None
        self._crash_sync: int | None = None
        self._crash_op: int | None = None
        self._kill: int | None = None
        self._hooks: dict[int, Callable[[], None]] = {}
        self.on_kill: Callable[[int, str, str], None] | None = None
        self._mutex = threading.RLock()

    # -- cues ------------------------------------------------------------------------------------
    def fail(self, n: int, err: int = errno.EIO, *, sticky: bool = False) -> "FaultyIO":
        self._fail[n] = (err, sticky)
        return self

    def heal(self) -> None:
        self._sticky = None

    def crash_at_sync(self, k: int) -> "FaultyIO":
        self._crash_sync = k
        return self

    def kill_at(self, n: int) -> "FaultyIO":
        self._kill = n
        return self

    def crash_at_op(self, n: int) -> "FaultyIO":
        self._crash_op = n
        return self

    def hook(self, n: int, fn: Callable[[], None]) -> "FaultyIO":
        self._hooks[n] = fn
        return self

    @property
    def syncs(self) -> list[int]:
        """Operation indices of the fsyncs so far."""
        return [i for i, (name, _) in enumerate(self.log) if name in SYNCS]

    # -- the cue check, run before each operation --------------------------------------------------
    def _op(self, name: str, path, torn: Callable[[], None] | None = None) -> int | None:
        """Count the operation; returns an errno to fail it with, or None to do it."""
        with self._mutex:
            if self.down:
                raise Crash()
            n = len(self.log)
            self.log.append((name, os.fspath(path) if path is not None else ""))
            hook = self._hooks.pop(n, None)
            if n == self._crash_op:
                self.down = True
                raise Crash()
            if name in SYNCS:
                if self._crash_sync == self.n_syncs:
                    self.down = True
                    raise Crash()
                self.n_syncs += 1
            if n == self._kill:
                if self.on_kill is not None:
                    self.on_kill(n, name, self.log[-1][1])
                if torn is not None:
                    torn()
                os.kill(os.getpid(), signal.SIGKILL)
            if n in self._fail:
                err, sticky = self._fail.pop(n)
                if sticky:
                    self._sticky = err
                return err
            if self._sticky is not None and (self._sticky != errno.ENOSPC or name in SPACE):
                return self._sticky
        if hook is not None:
            hook()
        return None

    def _gate(self, name: str, path) -> None:
        """`_op`, raising the cued error, for the operations that have nothing to undo on failure."""
        if (err := self._op(name, path)) is not None:
            self._raise(err, path)

    @staticmethod
    def _raise(err: int, path) -> None:
        raise OSError(err, os.strerror(err), os.fspath(path) if path is not None else None)

    # -- the model -------------------------------------------------------------------------------
    def _model(self, path: str) -> FileModel:
        m = self.files.get(path)
        if m is None:
            m = FileModel(Path(path).read_bytes() if os.path.isfile(path) else b"")
            self.files[path] = m
        return m

    def _change(self, fd: int, change: Change) -> None:
        if self.track:
            with self._mutex:
                self._model(self.fds[fd]).pending.append(change)

    def _dirop(self, op: DirOp) -> None:
        if self.track:
            with self._mutex:
                self.dirops.append(op)

    # -- files -------------------------------------------------------------------------------------
    def open(self, path: Path, *, create: bool = False) -> int:
        key = os.fspath(path)
        new = create and not os.path.lexists(key)
        self._gate("create" if create else "open", key)
        if self.track and new:
            self.files[key] = FileModel(b"")
            self._dirop(DirOp("create", key))
        elif self.track:
            self._model(key)
        fd = super().open(path, create=create)
        self.fds[fd] = key
        return fd

    def open_read(self, path: Path) -> int:
        self._gate("open_read", path)
        fd = super().open_read(path)
        self.fds[fd] = os.fspath(path)
        return fd

    def close(self, fd: int) -> None:
        err = self._op("close", self.fds.get(fd))
        path = self.fds.pop(fd, None)
        super().close(fd)  # the descriptor is gone even when close reports an error
        if err is not None:
            self._raise(err, path)

    def size(self, fd: int) -> int:
        self._gate("size", self.fds.get(fd))
        return super().size(fd)

    def allocate(self, fd: int, offset: int, length: int) -> None:
        self._gate("allocate", self.fds.get(fd))
        before = os.fstat(fd).st_size
        super().allocate(fd, offset, length)
        if offset + length > before:
            self._change(fd, Change(offset + length, None))

    def pwrite(self, fd: int, data, offset: int) -> None:
        data = bytes(memoryview(data).cast("B"))
        half = data[: len(data) // 2 // SECTOR * SECTOR or len(data) // 2]

        def torn() -> None:
            super(FaultyIO, self).pwrite(fd, half, offset)

        if (err := self._op("pwrite", self.fds.get(fd), torn)) is not None:
            part = data[: self.rng.randrange(len(data) + 1) // SECTOR * SECTOR]
            super().pwrite(fd, part, offset)  # a failing write may land in part
            if part:
                self._change(fd, Change(offset, part))
            self._raise(err, self.fds.get(fd))
        super().pwrite(fd, data, offset)
        self._change(fd, Change(offset, data))

    def pread_into(self, fd: int, buf, offset: int) -> int:
        self._gate("pread", self.fds.get(fd))
        return super().pread_into(fd, buf, offset)

    def pread_direct_into(self, fd: int, buf, offset: int) -> int:
        self._gate("pread", self.fds.get(fd))
        return super().pread_direct_into(fd, buf, offset)

    def fsync(self, fd: int) -> None:
        path = self.fds.get(fd)
        if (err := self._op("fsync", path)) is not None:
            if self.track and path in self.files:
                for change in self.files[path].pending:
                    change.lost = True
            self._raise(err, path)
        super().fsync(fd)
        if self.track and path in self.files:
            with self._mutex:
                m = self.files[path]
                m.durable = replay(m.durable, [c for c in m.pending if not c.lost], "keep", self.rng)
                m.pending = []

    def fsync_files(self, fds: list[int], started=lambda: None) -> None:
        """As many fsyncs, each an operation (the model has no file system to sync at once)."""
        started()
        for fd in fds:
            self.fsync(fd)

    def truncate(self, fd: int, length: int) -> None:
        self._gate("truncate", self.fds.get(fd))
        super().truncate(fd, length)
        self._change(fd, Change(length, None))

    # -- names -------------------------------------------------------------------------------------
    def exists(self, path: Path) -> bool:
        self._gate("exists", path)
        return super().exists(path)

    def is_dir(self, path: Path) -> bool:
        self._gate("is_dir", path)
        return super().is_dir(path)

    def file_size(self, path: Path) -> int:
        self._gate("stat", path)
        return super().file_size(path)

    def listdir(self, path: Path) -> list[Path]:
        self._gate("listdir", path)
        return super().listdir(path)

    def sizes(self, path: Path) -> list[tuple[str, int]]:
        self._gate("listdir", path)
        return super().sizes(path)

    def fsync_dir(self, path: Path) -> None:
        self._gate("fsync_dir", path)
        super().fsync_dir(path)
        key = os.fspath(path)
        with self._mutex:
            self.dirops = [op for op in self.dirops if os.path.dirname(op.path) != key]

    def mkdir(self, path: Path) -> bool:
        if os.path.isdir(path):
            return super().mkdir(path)  # nothing to create: the call only looks
        if not os.path.isdir(path.parent):
            self.mkdir(path.parent)
        self._gate("mkdir", path)
        created = super().mkdir(path)
        if created:
            self._dirop(DirOp("mkdir", os.fspath(path)))
        return created

    def rename(self, src: Path, dst: Path) -> None:
        s, d = os.fspath(src), os.fspath(dst)
        self._gate("rename", d)
        if self.track:
            moved = self._model(s)
            replaced = self.files.pop(d, None) if os.path.lexists(d) else None
            if replaced is None and os.path.isfile(d):
                replaced = FileModel(Path(d).read_bytes())
        super().rename(src, dst)
        if self.track:
            self.files.pop(s, None)
            self.files[d] = moved
            self._dirop(DirOp("rename", d, src=s, saved=replaced))

    def unlink(self, path: Path) -> None:
        key = os.fspath(path)
        self._gate("unlink", key)
        if not os.path.lexists(key):
            return
        saved = self._model(key) if self.track else None
        super().unlink(path)
        if self.track:
            self.files.pop(key, None)
            self._dirop(DirOp("unlink", key, saved=saved))

    def rmdir(self, path: Path) -> None:
        self._gate("rmdir", path)
        existed = os.path.isdir(path)
        super().rmdir(path)
        if existed:
            self._dirop(DirOp("rmdir", os.fspath(path)))

    def lock(self, path: Path, *, shared: bool = False, wait: bool = False) -> int:
        key = os.fspath(path)
        new = not os.path.lexists(key)
        self._gate("lock", key)
        if self.track and new:
            self.files[key] = FileModel(b"")
            self._dirop(DirOp("create", key))
        elif self.track:
            self._model(key)
        fd = super().lock(path, shared=shared, wait=wait)
        self.locks.add(fd)
        self.fds[fd] = key
        return fd

    def unlock(self, fd: int) -> None:
        err = self._op("unlock", self.fds.get(fd))
        self.locks.discard(fd)
        self.fds.pop(fd, None)
        super().unlock(fd)
        if err is not None:
            self._raise(err, None)

    # -- power loss ----------------------------------------------------------------------------------
    def power_loss(self, data: str = "random", dirs: str = "random") -> dict[str, int]:
        """Rewrite the real files to a state the disk may hold after losing power now.

        data: keep | drop | garble | random (per unsynced write); dirs: keep | undo | random (per
        directory, keep a random prefix of its unsynced changes). Returns counts of what was undone.
        Every descriptor opened through the layer is closed (the processes died with the machine);
        afterwards everything on disk counts as durable, and the layer works again (a reboot).
        """
        assert self.track, "power_loss needs a layer made with track=True"
        self.process_death()
        undone = self._undo_dirops(dirs)
        changed = 0
        for path, m in self.files.items():
            if not os.path.isdir(os.path.dirname(path)) or os.path.isdir(path):
                continue
            content = replay(m.durable, m.pending, data, self.rng)
            if not os.path.isfile(path) or Path(path).read_bytes() != content:
                Path(path).write_bytes(content)
                changed += 1
        self.files, self.dirops = {}, []
        return {"dir_changes_undone": undone, "files_changed": changed}

    def process_death(self) -> None:
        """The process that used the layer is gone: its descriptors and locks close, the cues are
        cleared, and what it wrote stays in the (simulated) page cache, synced or not."""
        for fd in set(self.fds) | self.locks:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds, self.locks = {}, set()
        self.down, self._crash_sync, self._crash_op, self._sticky, self._fail, self._kill = (
            False, None, None, None, {}, None)

    def _undo_dirops(self, mode: str) -> int:
        by_dir: dict[str, list[int]] = {}
        for i, op in enumerate(self.dirops):
            by_dir.setdefault(os.path.dirname(op.path), []).append(i)
        undo: set[int] = set()
        for indices in by_dir.values():
            keep = {"keep": len(indices), "undo": 0}.get(mode, None)
            if keep is None:
                keep = self.rng.randint(0, len(indices))
            undo.update(indices[keep:])
        for i in sorted(undo, reverse=True):
            self._undo(self.dirops[i])
        return len(undo)

    def _undo(self, op: DirOp) -> None:
        if not os.path.isdir(os.path.dirname(op.path)):
            return  # its directory is gone for good (removed, and that removal was synced)
        if op.kind == "create":
            if os.path.lexists(op.path) and not os.path.isdir(op.path):
                os.unlink(op.path)
            self.files.pop(op.path, None)
        elif op.kind == "mkdir":
            shutil.rmtree(op.path, ignore_errors=True)
            prefix = op.path + os.sep
            self.files = {p: m for p, m in self.files.items() if not p.startswith(prefix)}
        elif op.kind == "unlink":
            self.files[op.path] = op.saved or FileModel(b"")
            Path(op.path).touch()
        elif op.kind == "rmdir":
            os.makedirs(op.path, exist_ok=True)
        elif op.kind == "rename":
            if os.path.lexists(op.path):
                os.replace(op.path, op.src)
            moved = self.files.pop(op.path, None)
            if moved is not None:
                self.files[op.src] = moved
            if op.saved is not None:
                self.files[op.path] = op.saved
                Path(op.path).touch()


def replay(durable: bytes, changes: list[Change], mode: str, rng: random.Random) -> bytes:
    """The bytes of a file after a crash: `durable` plus each change kept, dropped or garbled."""
    content = bytearray(durable)
    for c in changes:
        how = "drop" if c.lost else (rng.choice(("keep", "drop", "garble")) if mode == "random" else mode)
        if c.data is None:  # a size change
            if how != "drop":
                del content[c.offset:]
                content.extend(bytes(c.offset - len(content)))
            continue
        if how == "drop":
            continue
        end = c.offset + len(c.data)
        if len(content) < end:
            content.extend(bytes(end - len(content)))
        if how == "keep":
            content[c.offset:end] = c.data
        else:  # whole sectors of garbage where the write went
            lo, hi = c.offset // SECTOR * SECTOR, min(len(content), -(-end // SECTOR) * SECTOR)
            content[lo:hi] = rng.randbytes(hi - lo)
    return bytes(content)
