"""Reading a large range that is not in the page cache: straight from the disk into its destination.

A restore reads every layer file of a session. When the files are in the page cache (a session
closed a moment ago) a plain `pread` copies them at memory speed; when they are not (a new process,
a machine after a restart, pages dropped under memory pressure) the kernel's readahead reads them
through the page cache in pieces, 30 files at once, and that took 30-60 ms for the 47 MB of a
2,048-token session where direct I/O (O_DIRECT, the disk's DMA into the destination memory) took
13-15 ms (AMD EPYC Zen 3, KVM, ext4 on virtio, median of 15 after dropping the pages).

- `cached_pages(fd, offset, nbytes)`: pages of the range in the page cache, from `cachestat` (Linux
  6.5+); None where the kernel cannot say, and then every read stays a plain one.
- `pread_direct(fd, bufs, offset)`: fill `bufs` (one buffer, or several filled in order) with
  direct I/O, which needs the file offset, the length and the memory to be multiples of ALIGN.
  Buffers that all are go in one request; otherwise each buffer whose memory sits at the same
  place modulo ALIGN as its file offset (a session's cache and its own files: both token-major from
  aligned starts) gets its aligned middle straight in and only the partial blocks at its ends
  through a bounce buffer (a huge page per thread), and the others go all through it. Where the
  engine's memory is small pages (free pages reported to a host: `straight_in`), everything goes
  through the bounce buffer, which the disk fills faster than small pages. Neighbours go together: the
  straight parts that follow each other in one request, and the bounced parts that follow each
  other in one read of the bounce buffer (2 MiB) while they fit it. A session of many turns has
  many small extents in each layer file (a reply's checkpoints, 1 to 21 tokens each): read one by
  one, a served 2,500-token conversation's 30 files took 480 direct reads and 73 ms, together 30
  (one a file, `segments.read_extents_into` reading the gaps between extents) and 39 ms (medians of
  5, files dropped from the page cache; AMD EPYC, Zen 1 kind, KVM, ext4 on virtio). Raises OSError (EINVAL) where the file system refuses direct
  I/O: the caller reads plainly instead.
- `preadv_all(fd, views, offset)`: fill byte views in order with preadv (plain or direct reads
  alike), resumed after short reads; `views_of(bufs)` makes them. `gap(n)`: n bytes of scratch
  memory that a read may fill with what lies between the ranges wanted (read and dropped), so
  that one read covers ranges near each other.

What is read this way does not enter the page cache: the next open of the same session reads it
from the disk again, in the same 13-15 ms (a plain read would be 5-6 ms then). Asking the kernel to
cache it afterwards (POSIX_FADV_WILLNEED) would read the disk a second time and cost about 10 ms
of its time for 47 MB, taken from the decode that follows a restore; as in a database with direct
I/O, the process's own memory (the engine's pool of resident sessions) is the cache that counts.

This module imports nothing of kvstore but `pages`: `fileio` builds its I/O seam on it.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import threading

import numpy as np

from .pages import HUGE_PAGE, free_pages_reported, huge_pages

ALIGN = 4096  # direct I/O alignment: the largest logical block of the disks we meet (512 or 4096)
BOUNCE = HUGE_PAGE  # bytes of the bounce buffer (per thread): one huge page where the system has them
# A buffer smaller than this goes through the bounce buffer even where it could go straight in: with
# its neighbours there it costs a copy, where a read of its own costs a request
STRAIGHT_MIN = 64 << 10
# direct reads in flight at once, in the whole process: the disks measured serve about four at their
# full speed, and a restore runs more helpers than that (`store.extents.READ_THREADS`), so that while
# four wait on the disk the others copy and verify what they read; without the bound every helper
# reads at once, all of them finish together, and the disk idles while they all copy
DEPTH = 4
_in_flight = threading.BoundedSemaphore(DEPTH)
CACHESTAT = 451  # the syscall's number, the same on every Linux architecture we run on (6.5+)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)
IOV_MAX = 1024  # buffers one preadv may take (Linux's UIO_MAXIOV)


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


@functools.lru_cache(maxsize=1)
def _syscall():
    """libc's syscall(), called with the GIL held (a cachestat takes microseconds: giving the GIL
    up and taking it back among the restore's reading threads cost more), or None where there is
    none to call (not Linux)."""
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        fn = ctypes.PyDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn


_no_cachestat = threading.Event()  # set once the kernel answered ENOSYS: not asked again


def cached_pages(fd: int, offset: int, nbytes: int) -> int | None:
    """Pages of [offset, offset + nbytes) of the file in the page cache; None where unknown (a kernel
    before 6.5, not Linux, a file system that does not say)."""
    call = _syscall()
    if call is None or _no_cachestat.is_set() or nbytes <= 0:
        return None
    rng, stat = _Range(offset, nbytes), _Stat()
    if call(ctypes.c_long(CACHESTAT), ctypes.c_int(fd), ctypes.byref(rng), ctypes.byref(stat), ctypes.c_uint(0)) != 0:
        if ctypes.get_errno() == 38:  # ENOSYS
            _no_cachestat.set()
        return None
    return stat.nr_cache


def pages_in(offset: int, nbytes: int) -> int:
    """How many pages [offset, offset + nbytes) touches."""
    page = mmap.PAGESIZE
    return (offset + nbytes - 1) // page - offset // page + 1


_local = threading.local()


def _bounce() -> np.ndarray:
    """This thread's page-aligned bounce buffer (BOUNCE bytes): a huge page where the system has
    them (`pages.huge_pages`), else small pages; written once when made, so that no read faults it in."""
    buf = getattr(_local, "bounce", None)
    if buf is None:
        buf = huge_pages(BOUNCE)
        _local.huge = buf is not None
        if buf is None:  # private and anonymous: page-aligned
            buf = np.frombuffer(mmap.mmap(-1, BOUNCE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), np.uint8)
        buf[::mmap.PAGESIZE] = 0
        _local.bounce = buf
    return buf


def prepare_thread() -> None:
    """Make this thread's bounce buffer now, so that its first direct read does not wait for it."""
    _bounce()


def straight_in() -> bool:
    """Whether the aligned middle of a large destination is read straight into it (else the whole
    read goes through this thread's bounce buffer and is copied out). Straight, except where free
    pages are reported to a host (`pages.free_pages_reported`) and the bounce buffer is a huge page:
    the engine's long-lived memory (a restored cache's) is small pages there, and a direct read into
    small pages gives the disk one 4 KiB piece of memory per page, a 2 MiB huge page one piece (the
    virtio disk there takes 254 pieces a request). 47 MB in 30 files out of the page cache (a
    2,048-token session's layer files), read on 4 threads: 13-15 ms into huge pages, 45-51 ms into
    small ones, 23-27 ms plainly through the page cache as one 47 MB file (medians of 7-9; AMD EPYC,
    Zen 1 kind, KVM, ext4 on virtio). Restores of that session there, this way with four reads in
    flight (`DEPTH`) against straight in before (`python -m benchmarks.ab 3b18469 --case restore:2048
    --case restore-fresh:2048 --reps 5`, processes alternated): into the memory of the session closed
    before, 22.8 ms (22.3-25.3) against 53.7 (49.4-55.6); into fresh memory, 32.0 (31.5-33.0) against
    44.6 (39.4-45.3); the same bytes. Where free pages are not reported, a thread whose reads all
    go straight in makes no bounce buffer."""
    if not free_pages_reported():
        return True
    _bounce()
    return not _local.huge


def _copy_out(dest: memoryview, scratch: np.ndarray, at: int, n: int) -> None:
    """dest[:n] = scratch[at:at + n], with the GIL released for large copies (numpy's), so the other
    reading threads go on meanwhile."""
    np.copyto(np.frombuffer(dest, np.uint8, n), scratch[at:at + n])


def gap(n: int) -> memoryview:
    """n bytes of this thread's scratch memory, to read and drop what lies between two ranges a read
    wants (several gaps of one read may share them)."""
    buf = getattr(_local, "gap", None)
    if buf is None or len(buf) < n:
        buf = _local.gap = memoryview(bytearray(max(n, 64 << 10)))
    return buf[:n]


def views_of(bufs) -> list[memoryview]:
    """A writable buffer, or a list of them, as byte views."""
    return [memoryview(b).cast("B") for b in (bufs if isinstance(bufs, (list, tuple)) else [bufs])]


def preadv_all(fd: int, views: list[memoryview], offset: int) -> int:
    """Fill `views` in order from `offset` (one preadv each time, resumed after a short read) until
    they are full or the file ends; the bytes read."""
    rest = [v for v in views if len(v)]
    total, i = 0, 0  # rest[i] is the first view not yet full
    while i < len(rest):
        n = os.preadv(fd, rest[i:i + IOV_MAX], offset + total)
        if n == 0:
            break
        total += n
        while i < len(rest) and n >= len(rest[i]):  # skip the views filled, cut into the one partly filled
            n -= len(rest[i])
            i += 1
        if n:
            rest[i] = rest[i][n:]
    return total


def _read_disk(dfd: int, views: list[memoryview], offset: int) -> int:
    """`preadv_all` of a direct read, as one of the DEPTH in flight."""
    with _in_flight:
        return preadv_all(dfd, views, offset)


def _bounced(dfd: int, dest: memoryview, offset: int) -> int:
    """Fill `dest` (any memory) from `offset` (any) through the bounce buffer; the bytes filled."""
    buf = _bounce()
    scratch = memoryview(buf)
    done = 0
    while done < len(dest):
        pos = offset + done
        start = pos - pos % ALIGN
        want = min(len(dest) - done, BOUNCE - (pos - start))
        span = -(-(pos - start + want) // ALIGN) * ALIGN  # whole blocks covering the wanted bytes
        got = _read_disk(dfd, [scratch[:span]], start) - (pos - start)
        if got <= 0:
            break
        got = min(got, want)
        _copy_out(dest[done:], buf, pos - start, got)
        done += got
        if got < want:  # the end of the file
            break
    return done


def _address(view: memoryview) -> int:
    return np.frombuffer(view, np.uint8).ctypes.data if len(view) else 0


def pread_direct(fd: int, bufs, offset: int) -> int:
    """`bufs` (a writable buffer, or a list of them filled in order) from `offset` of the file `fd`
    with direct I/O; the bytes read (short at the end of the file). OSError where direct I/O is
    refused. Buffers that are all aligned (memory and length), from an aligned offset, are one read
    where reads go straight in (`straight_in`); otherwise as `_pieces` cuts them, in as few reads as
    it allows (`_read_pieces`)."""
    views = views_of(bufs)
    straight = straight_in()
    dfd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECT | CLOEXEC)  # the same file, opened for direct I/O
    try:
        if straight and offset % ALIGN == 0 and all(len(v) % ALIGN == 0 and _address(v) % ALIGN == 0 for v in views):
            return _read_disk(dfd, views, offset)
        return _read_pieces(dfd, _pieces(views, offset, straight))
    finally:
        os.close(dfd)


def _pieces(views: list[memoryview], offset: int, straight: bool = True) -> list[tuple[int, memoryview, bool]]:
    """The views, filled in order from `offset`, as (file offset, view, straight) pieces in file
    order: where `straight`, a view whose memory sits at the same place modulo ALIGN as its file
    offset (and that spans STRAIGHT_MIN bytes at least) gives its aligned middle as a straight piece
    and its partial ends as bounced ones; any other view is one bounced piece."""
    pieces, pos = [], offset
    for v in views:
        n = len(v)
        if straight and n >= STRAIGHT_MIN and (_address(v) - pos) % ALIGN == 0:
            head = -pos % ALIGN  # bytes before the first aligned file offset
            body = (n - head) // ALIGN * ALIGN
            pieces += [(pos, v[:head], False), (pos + head, v[head:head + body], True),
                       (pos + head + body, v[head + body:], False)]
        else:
            pieces.append((pos, v, False))
        pos += n
    return [p for p in pieces if len(p[1])]


def _read_pieces(dfd: int, pieces: list[tuple[int, memoryview, bool]]) -> int:
    """Fill `pieces` (`_pieces`'): straight pieces next to each other in one preadv straight into
    their memory; bounced pieces next to each other in one read through the bounce buffer while
    they fit it (a restore's small extents, the ends of the large ones and the gaps between them:
    one read where there was one each; a piece larger than the buffer goes through it in parts).
    Returns the bytes filled from the first piece on, up to the first one the file's end cut short."""
    total, i = 0, 0
    while i < len(pieces):
        start, _, straight = pieces[i]
        j = i + 1
        window = start - start % ALIGN  # a bounced group's first block in the bounce buffer
        while j < len(pieces) and pieces[j][2] == straight and (
                straight or pieces[j][0] + len(pieces[j][1]) - window <= BOUNCE):
            j += 1
        group = pieces[i:j]
        if straight:
            got = _read_disk(dfd, [p[1] for p in group], start)
        else:
            got = _bounced(dfd, group[0][1], start) if len(group) == 1 else _bounced_together(dfd, group, window)
        want = sum(len(p[1]) for p in group)
        total += got
        if got < want:  # the end of the file
            break
        i = j
    return total


def _bounced_together(dfd: int, pieces: list[tuple[int, memoryview, bool]], window: int) -> int:
    """Pieces that follow each other in the file, all within BOUNCE bytes of `window` (aligned),
    read in one direct read into the bounce buffer and copied out; the bytes filled (short where the
    file ends)."""
    buf = _bounce()
    scratch = memoryview(buf)
    end = pieces[-1][0] + len(pieces[-1][1])
    span = -(-(end - window) // ALIGN) * ALIGN  # whole blocks covering the pieces
    have = window + _read_disk(dfd, [scratch[:span]], window)  # the file's bytes up to here are in the buffer
    done = 0
    for pos, view, _ in pieces:
        n = max(0, min(len(view), have - pos))
        _copy_out(view, buf, pos - window, n)
        done += n
        if n < len(view):
            break
    return done
