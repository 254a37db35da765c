"""Files that must survive a crash, for every layer: the store's I/O seam and the one atomic write.

- `io`: every file operation the store performs goes through it. It forwards to a backend, plain
  POSIX calls (`PosixIO`) unless a test swaps in another with `use(backend)`: the fault-injecting
  layer in `tests/faults.py` counts the operations, drops or garbles unsynced writes, undoes
  unsynced directory changes and fails the Nth call with ENOSPC or EIO. So everything the store
  does to files is here: create, reserve, write, read, fsync (files and directories), truncate,
  rename, unlink, list, stat, remove a tree, and the writer lock. ENOSPC from any of the writing
  calls (the sync's included) becomes `StoreFull` (`reraise_full`), so a full disk is an exception
  and never a SIGBUS (nothing is written through a mapping). A large read the page cache lacks can go straight
  from the disk (`uncached`, `pread_direct_into`: `direct_io`).
- `atomic_write(path)`: a new file all or nothing (temp file beside it, fsync, rename, fsync of
  the folder). Everything that writes a file whole uses it: the store's small files and blobs
  (`write_durable`), archives, and the engine's pulled models, converted weights, fingerprint
  cache and native library, which pass `ops=PLAIN` (their files are not the store's, and the fault
  tests count the store's operations only).

This module sits below the engine and the store: it imports nothing of kvstore but its errors and
`direct_io` (reads past the page cache).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import os
import platform
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from . import direct_io
from .errors import StoreFull

CLOEXEC = getattr(os, "O_CLOEXEC", 0)
DIRECT_MIN = 64 << 10  # reads smaller than this go through the page cache even when it lacks them


def fsync_path(path, flags: int = 0) -> None:
    """fsync a file or directory by name. Plain, not through the seam: also for files that are not
    the store's (pulled models, the converted-weights cache, the benchmarks' peer files)."""
    fd = os.open(path, os.O_RDONLY | CLOEXEC | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class PosixIO:
    """Plain file operations. Methods take and return file descriptors and paths."""

    # -- files -------------------------------------------------------------------------------------
    def open(self, path: Path, *, create: bool = False) -> int:
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        return os.open(path, flags | CLOEXEC, 0o644)

    def open_read(self, path: Path) -> int:
        return os.open(path, os.O_RDONLY | CLOEXEC)

    def close(self, fd: int) -> None:
        os.close(fd)

    def size(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def device(self, fd: int) -> int:
        """The file system the file is on (`st_dev`): one syncfs covers the files of one device."""
        return os.fstat(fd).st_dev

    def allocate(self, fd: int, offset: int, length: int) -> None:
        if length > 0:
            os.posix_fallocate(fd, offset, length)

    def pwrite(self, fd: int, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        while view:
            n = os.pwrite(fd, view, offset)
            view, offset = view[n:], offset + n

    def pread_into(self, fd: int, buf, offset: int) -> int:
        """Fill the writable buffer (or a list of them, in order: one preadv) from offset; returns
        the bytes read (short at end of file)."""
        return direct_io.preadv_all(fd, direct_io.views_of(buf), offset)

    def uncached(self, fd: int, offset: int, nbytes: int) -> bool:
        """Whether [offset, offset + nbytes) is worth reading with `pread_direct_into`: at least
        DIRECT_MIN bytes, and known to be mostly outside the page cache, more than half of its pages
        (`direct_io.cached_pages`: Linux 6.5+; elsewhere always False). A range mostly in it reads
        faster plainly: its cached pages are copied, only the others come from the disk, where a
        direct read takes them all from there (a served conversation's 30 layer files with a quarter
        of their pages dropped, as the system's reclaim leaves them: 20-22 ms plainly, 38-39 ms
        direct; AMD EPYC, Zen 1 kind, KVM). $KVSTORE_DIRECT_IO=0 makes it always False."""
        if nbytes < DIRECT_MIN or os.environ.get("KVSTORE_DIRECT_IO") == "0":
            return False
        cached = direct_io.cached_pages(fd, offset, nbytes)
        return cached is not None and 2 * cached < direct_io.pages_in(offset, nbytes)

    def in_page_cache(self, fd: int, offset: int, nbytes: int) -> bool:
        """Whether the page cache is known to hold every page of [offset, offset + nbytes): False
        where the system cannot say (`direct_io.cached_pages`)."""
        cached = direct_io.cached_pages(fd, offset, nbytes)
        return cached is not None and cached >= direct_io.pages_in(offset, nbytes)

    def pread_direct_into(self, fd: int, buf, offset: int) -> int:
        """`pread_into` from the disk straight into `buf` (or a list of buffers), past the page cache
        (`direct_io`): a cold session's 30 layer files in 13-15 ms where plain reads took 30-60. A
        plain read where the file system refuses direct I/O."""
        try:
            return direct_io.pread_direct(fd, buf, offset)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOENT):  # ENOENT: no /proc
                raise
            # the plain read itself, not `self.pread_into`: a backend that counts operations saw one
            return direct_io.preadv_all(fd, direct_io.views_of(buf), offset)

    def pread(self, fd: int, length: int, offset: int) -> bytearray:
        """Up to `length` bytes from offset (fewer at end of file), read in place: no copy after."""
        buf = bytearray(length)
        del buf[self.pread_into(fd, buf, offset):]
        return buf

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def fsync_files(self, fds: list[int], started: Callable[[], None] = lambda: None) -> None:
        """Make every write to these files durable: what `fsync` of each does, in one `syncfs` where
        that is as safe (`syncfs_applies`): it commits the file system's journal once, where each
        fsync commits it again (a checkpoint's 30 layer files: 6.2 ms of fsyncs, 2.3 ms with one
        syncfs; AMD EPYC Zen 3, KVM, ext4 on virtio). It also writes back whatever else is dirty in
        that file system, and fails on a writeback error of any file of it since these were opened: so
        only while little else is dirty (SYNCFS_MAX_DIRTY), lest another process's big write (an
        export, a copy) hold up every checkpoint until it reaches the disk. `started()` is called
        just before the first call that waits for the disk (a caller on another thread goes on then)."""
        if len(fds) > 1 and syncfs_applies(fds[0]) and dirty_bytes() <= SYNCFS_MAX_DIRTY:
            started()
            if _libc().syncfs(fds[0]) != 0:
                e = ctypes.get_errno()
                raise OSError(e, os.strerror(e))
            return
        started()
        for fd in fds:
            self.fsync(fd)

    def truncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def read_file(self, path: Path) -> bytearray:
        fd = self.open_read(path)
        try:
            return self.pread(fd, self.size(fd), 0)
        finally:
            self.close(fd)

    # -- names -------------------------------------------------------------------------------------
    def exists(self, path: Path) -> bool:
        return os.path.lexists(path)

    def is_dir(self, path: Path) -> bool:
        return os.path.isdir(path)

    def file_size(self, path: Path) -> int:
        return os.stat(path).st_size

    def listdir(self, path: Path) -> list[Path]:
        """The entries of a directory, sorted; empty when it does not exist."""
        try:
            return [path / name for name in sorted(os.listdir(path))]
        except (FileNotFoundError, NotADirectoryError):
            return []

    def sizes(self, path: Path) -> list[tuple[str, int]]:
        """(name, size) of each entry of a directory, sorted by name; empty when it does not exist.
        Without a path object made per entry: a session's open checks its 30 layer files' sizes this
        way (`segments.truncate_uncommitted`), 0.3 ms faster than listing them and asking one by one."""
        try:
            with os.scandir(path) as entries:
                return sorted((e.name, e.stat().st_size) for e in entries)
        except (FileNotFoundError, NotADirectoryError):
            return []

    def fsync_dir(self, path: Path) -> None:
        fsync_path(path, getattr(os, "O_DIRECTORY", 0))

    def mkdir(self, path: Path) -> bool:
        """Create a directory (and missing parents, outermost first); True if it was created."""
        if self.is_dir(path):
            return False
        if not self.is_dir(path.parent):
            self.mkdir(path.parent)
        try:
            os.mkdir(path)
        except FileExistsError:
            return False
        return True

    def rename(self, src: Path, dst: Path) -> None:
        os.replace(src, dst)

    def unlink(self, path: Path) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def rmdir(self, path: Path) -> None:
        try:
            os.rmdir(path)
        except FileNotFoundError:
            pass

    def rmtree(self, path: Path) -> None:
        """Remove a directory and everything in it (no symlink is followed), one call per entry."""
        for entry in self.listdir(path):
            if self.is_dir(entry) and not os.path.islink(entry):
                self.rmtree(entry)
            else:
                self.unlink(entry)
        self.rmdir(path)

    # -- the writer lock ---------------------------------------------------------------------------
    def lock(self, path: Path, *, shared: bool = False, wait: bool = False) -> int:
        """Open (creating) `path` and flock it, exclusive unless `shared`; without `wait` a lock held
        elsewhere raises BlockingIOError at once."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB))
        except BaseException:
            os.close(fd)
            raise
        return fd

    def unlock(self, fd: int) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


# file systems whose syncfs makes every file's data and metadata durable as fsync does (ext4, XFS,
# Btrfs: a journal or log commit and a cache flush); elsewhere (network, FUSE, overlay, tmpfs and
# the rest) each file is fsynced
SYNCFS_FILE_SYSTEMS = {0xEF53: "ext4", 0x58465342: "xfs", 0x9123683E: "btrfs"}
SYNCFS_REPORTS_ERRORS = (5, 8)  # Linux from 5.8 on: syncfs returns writeback errors (earlier: 0 regardless)
SYNCFS_MAX_DIRTY = 64 << 20  # bytes dirty or under writeback, system-wide, above which each file is fsynced


def dirty_bytes() -> int:
    """Bytes of the page cache not yet on disk (dirty or being written back), from /proc/meminfo;
    unknown (no such file) counts as too many."""
    try:
        with open("/proc/meminfo", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return 1 << 62
    return sum(int(line.split()[1]) * 1024 for line in lines if line.startswith((b"Dirty:", b"Writeback:")))


@functools.lru_cache(maxsize=1)
def _libc():
    """This process's C library with syncfs and fstatfs declared, or None where it lacks them."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syncfs.argtypes = [ctypes.c_int]
        libc.fstatfs.argtypes = [ctypes.c_int, ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    return libc


@functools.lru_cache(maxsize=1)
def _kernel_reports_syncfs_errors() -> bool:
    if platform.system() != "Linux":
        return False
    try:
        major, minor = (int(x) for x in platform.release().split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= SYNCFS_REPORTS_ERRORS


def syncfs_applies(fd: int) -> bool:
    """Whether one syncfs makes the file `fd` durable as its fsync would, errors reported: Linux 5.8 or
    later, and a local file system in SYNCFS_FILE_SYSTEMS. $KVSTORE_SYNCFS=0 turns it off."""
    if os.environ.get("KVSTORE_SYNCFS") == "0" or not _kernel_reports_syncfs_errors():
        return False
    libc = _libc()
    if libc is None:
        return False
    buf = ctypes.create_string_buffer(256)  # struct statfs: f_type, a long, comes first
    if libc.fstatfs(fd, buf) != 0:
        return False
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF in SYNCFS_FILE_SYSTEMS


class Seam:
    """What the store calls: forwards every operation to the current backend."""

    def __init__(self, backend: PosixIO):
        self.backend = backend

    def __getattr__(self, name: str):
        return getattr(self.backend, name)


io = Seam(PosixIO())
PLAIN = PosixIO()  # plain calls, never swapped: for files that are not the store's


@contextmanager
def use(backend: PosixIO) -> Iterator[PosixIO]:
    """Route the store's file operations through `backend` for the duration (tests)."""
    before, io.backend = io.backend, backend
    try:
        yield backend
    finally:
        io.backend = before


def close_all(fds: list[int]) -> None:
    """Close every descriptor; the first error is raised once all are closed."""
    error = None
    for fd in fds:
        try:
            io.close(fd)
        except OSError as e:
            error = error or e
    if error is not None:
        raise error


def make_dir(path: Path) -> None:
    """Create a directory (and missing parents) durably: each new one is fsynced into its parent."""
    if io.is_dir(path):
        return
    make_dir(path.parent)
    if io.mkdir(path):
        io.fsync_dir(path.parent)


def temp_in_use(path: Path, ops=io) -> bool:
    """Is a writer still writing this temp file (it holds the file's flock)?"""
    try:
        fd = ops.lock(path)
    except BlockingIOError:
        return True
    except FileNotFoundError:  # renamed into place or removed meanwhile
        return True
    ops.unlock(fd)
    return False


def reraise_full(e: OSError, what: str) -> None:
    """Turn ENOSPC/EDQUOT into StoreFull; let other errors through."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        raise StoreFull(f"{what}: the disk is full; the last checkpoint is intact. "
                        "Free some space (kvstore gc, kvstore rm) and try again") from e
    raise e


class FolderNotSynced(OSError):
    """`atomic_write` put the file in place, but the folder's fsync failed: a power loss could undo it."""


@dataclass
class Temp:
    """The file `atomic_write` yields: fill it through `fd` (open for reading and writing, flocked)
    or by its `path`."""
    path: Path
    fd: int


def temp_path(path: Path) -> Path:
    """Where `atomic_write` writes `path` first: `.NAME.PID.tmp` beside it."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def is_temp_of(candidate: Path, name: str) -> bool:
    """Is `candidate` an `atomic_write` temp file of a file called `name` (any writer's)?"""
    head, dot, pid = candidate.name.removesuffix(".tmp").rpartition(".")
    return candidate.name.endswith(".tmp") and dot == "." and pid.isdigit() and head == f".{name}"


@contextmanager
def atomic_write(path: Path, *, ops=io, clean: bool = False, sync_by_path: bool = False) -> Iterator[Temp]:
    """Write `path` all or nothing: yields a `Temp` beside it to fill; on a clean exit the temp file
    is fsynced, renamed over `path` and the folder fsynced. On any error (also one from the body)
    the temp file is removed, `path` is left as it was, and the error propagates; only a failed sync
    of the folder after the rename comes as an OSError naming `path` that says so.

    The temp file is flocked while it is written, so `temp_in_use` can tell a live writer's from one
    a crash left behind (a pid in the name cannot: pids are reused, after a reboot above all);
    `clean` removes those left behind for `path` first. `sync_by_path`: the body may replace the
    file under its name (a linker does), so it is fsynced by name, not through `fd`. `ops`: the
    store's seam (`io`, the default) or `PLAIN`."""
    folder = path.parent
    tmp = temp_path(path)
    if clean:
        for candidate in ops.listdir(folder):
            if is_temp_of(candidate, path.name) and candidate != tmp and not temp_in_use(candidate, ops):
                ops.unlink(candidate)
    try:
        fd = ops.lock(tmp)
    except BaseException:
        ops.unlink(tmp)
        raise
    try:
        ops.truncate(fd, 0)
        yield Temp(tmp, fd)
        if sync_by_path:
            synced = ops.open_read(tmp)
            try:
                ops.fsync(synced)
            finally:
                ops.close(synced)
        else:
            ops.fsync(fd)
    except BaseException:
        try:
            ops.unlock(fd)
        finally:
            ops.unlink(tmp)
        raise
    ops.unlock(fd)
    try:
        ops.rename(tmp, path)
    except BaseException:
        ops.unlink(tmp)
        raise
    try:
        ops.fsync_dir(folder)
    except OSError as e:
        raise FolderNotSynced(e.errno, f"{path.name} was written, but syncing its folder failed ({e.strerror}): a "
                              "power loss could still undo it; write it again to be sure", str(path)) from e


def write_durable(path: Path, data: bytes) -> None:
    """A new file through the seam (`atomic_write`), its space reserved first: ENOSPC is StoreFull."""
    try:
        with atomic_write(path) as temp:
            io.allocate(temp.fd, 0, len(data))
            io.pwrite(temp.fd, data, 0)
    except OSError as e:
        reraise_full(e, f"writing {path.name}")
