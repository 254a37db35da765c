"""The store's one I/O seam: every file operation it performs goes through `io` here.

Tests swap `io` for a fault-injecting layer (drop unsynced writes, fail the Nth call with ENOSPC
or EIO); users get plain POSIX calls. ENOSPC from `allocate` or `pwrite` becomes `StoreFull`, so a
full disk is an exception and never a SIGBUS (space is reserved before bytes are written).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from .errors import StoreFull


class PosixIO:
    """Plain file operations. Methods take and return file descriptors and paths."""

    def open(self, path: Path, *, create: bool = False) -> int:
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        return os.open(path, flags | getattr(os, "O_CLOEXEC", 0), 0o644)

    def open_read(self, path: Path) -> int:
        return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))

    def close(self, fd: int) -> None:
        os.close(fd)

    def size(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def allocate(self, fd: int, offset: int, length: int) -> None:
        if length > 0:
            os.posix_fallocate(fd, offset, length)

    def pwrite(self, fd: int, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        while view:
            n = os.pwrite(fd, view, offset)
            view, offset = view[n:], offset + n

    def pread_into(self, fd: int, buf, offset: int) -> int:
        """Fill the writable buffer from offset; returns the bytes read (short at end of file)."""
        view, total = memoryview(buf).cast("B"), 0
        while total < len(view):
            n = os.preadv(fd, [view[total:]], offset + total)
            if n == 0:
                break
            total += n
        return total

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def fsync_dir(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def truncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def mkdir(self, path: Path) -> bool:
        """Create a directory (and parents); True if it was created."""
        if path.is_dir():
            return False
        path.mkdir(parents=True, exist_ok=True)
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

    def read_file(self, path: Path) -> bytes:
        with open(path, "rb") as f:
            return f.read()


io: PosixIO = PosixIO()


def reraise_full(e: OSError, what: str) -> None:
    """Turn ENOSPC/EDQUOT into StoreFull; let other errors through."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        raise StoreFull(f"{what}: the disk is full; the last checkpoint is intact. "
                        "Free some space (kvstore gc, kvstore rm) and try again") from e
    raise e


def write_durable(path: Path, data: bytes) -> None:
    """Write a new file via a temp name, fsync it, rename it into place, fsync the directory."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = io.open(tmp, create=True)
    try:
        try:
            io.truncate(fd, 0)
            io.allocate(fd, 0, len(data))
            io.pwrite(fd, data, 0)
            io.fsync(fd)
        except OSError as e:
            io.close(fd)
            fd = -1
            io.unlink(tmp)
            reraise_full(e, f"writing {path.name}")
    finally:
        if fd >= 0:
            io.close(fd)
    io.rename(tmp, path)
    io.fsync_dir(path.parent)
