"""BufferPool: memory already written to, kept for the next user instead of given back.

Fresh memory costs a page fault per 4 KiB page when first written; on this kind of VM that makes
filling 47 MB of fresh pages take 40 ms against 8 ms for pages written before. A pool holds released
flat buffers (numpy arrays or torch tensors: anything with `nbytes`) and hands out the smallest
that fits. It holds at most `limit` bytes: the oldest go first, and one larger than the limit is not
kept; a buffer given twice is held once (handing it out twice would make two users share memory).
`borrow(nbytes)` takes one that fits or makes a new one with the pool's `new`. `clear()` gives
everything back to the allocator, and so to the OS. Thread-safe.

`huge_pages(nbytes)` (`kvstore.pages`) makes such a long-lived buffer from an anonymous mapping whose
whole 2 MiB pages are advised for transparent huge pages (Linux, THP in `always` or `madvise` mode),
so a first write into fresh memory faults once per 2 MiB instead of once per 4 KiB: reading 47 MB into
fresh memory took 40 ms, into huge pages 5 ms (AMD EPYC Zen 5, KVM). Only whole huge pages inside
the buffer are advised, so a buffer never occupies more than its size; where huge pages cannot
apply (small buffers, no THP) it returns None and the caller takes ordinary memory.

`small_pages(nbytes)` is the opposite: a long-lived buffer advised against huge pages, which
`lasting_pages(nbytes)` (the choice for session caches and the paged KV pool) takes instead of huge
pages on a system where `free_pages_reported()` (`kvstore.pages`): a virtio balloon there reports
free memory to the host (free page reporting, in blocks of 2 MiB), which takes it back, so a fresh
huge page is faulted in from the host. That took 10-20 ms a page: 64 MiB of fresh huge pages
380-640 ms to first write, of 4 KiB pages 25 ms (Intel Xeon with AMX, KVM), and a decode step of 8
sessions whose caches crossed into new huge pages of all 30 layers at once took 0.6 s instead of
15 ms.

`HugeArena` hands out pieces of such buffers to long-lived tensors too small for whole huge pages of
their own (a model's weight matrices, 0.2 to 30 MB each): reading weights from huge pages takes a
TLB miss per 2 MiB instead of per 4 KiB (AMD EPYC Zen 3, KVM: a decode step's quantized products 4
to 10 % faster). A chunk's memory goes back once the arena has moved on to the next chunk and the last
piece cut from it is dropped; pages of a chunk never written take no memory.

`populate(address, nbytes)` faults the pages of a range in, writable, in one call
(madvise MADV_POPULATE_WRITE, Linux 5.14+; their bytes unchanged), before a decode step writes them:
first writes inside a step cost far more per page than the same pages faulted in together. A
single-session decode step at 1,024 positions (SmolLM2, Intel Xeon with AMX, KVM, small pages
because free pages are reported) spent 114-227 us copying its K/V rows into the cache, about 37 us
a fresh page (30 layers cross into a new 4 KiB page every 5.3 tokens); with each layer's next 64
positions populated in one call, the copies took 2-3 us and the calls 14 us a step, amortized.
Where the call is missing (an older kernel, another OS), it does nothing from then on.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from typing import Callable

import numpy as np

from ..pages import HUGE_PAGE, free_pages_reported, huge_pages

PAGE = mmap.PAGESIZE
MADV_POPULATE_WRITE = 23  # <linux/mman.h>, Linux 5.14+


class _Populate:
    """madvise(MADV_POPULATE_WRITE) through libc, or nothing once it has failed (see `populate`)."""

    def __init__(self):
        self.works = os.name == "posix"
        self._madvise = None

    def __call__(self, address: int, nbytes: int) -> bool:
        if not self.works or nbytes <= 0:
            return False
        if self._madvise is None:
            try:
                madvise = ctypes.CDLL(None, use_errno=True).madvise
            except (OSError, AttributeError):
                self.works = False
                return False
            madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
            self._madvise = madvise
        start = address // PAGE * PAGE  # whole pages: each holds a byte of the range, so it is mapped
        end = -(-(address + nbytes) // PAGE) * PAGE
        if self._madvise(start, end - start, MADV_POPULATE_WRITE) != 0:
            if ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS, errno.EPERM):  # a kernel without it
                self.works = False
            return False  # else (a signal, no memory now): the step's own writes fault the pages in
        return True


populate = _Populate()


class BufferPool:
    def __init__(self, limit: int, new: Callable[[int], object]):
        self.limit = limit
        self.new = new  # nbytes -> a new flat buffer of that size
        self._free: list = []  # oldest first
        self._sizes: list[int] = []  # their nbytes, side by side (a tensor's nbytes is a slow attribute)
        self._ids: set[int] = set()  # id() of each held buffer: held ones stay alive, so ids are unique
        self._held = 0
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        return self._held

    def take(self, nbytes: int):
        """The smallest held buffer of at least nbytes (no longer held), or None (the oldest of equals)."""
        with self._lock:
            best = -1
            for i, size in enumerate(self._sizes):
                if size >= nbytes and (best < 0 or size < self._sizes[best]):
                    best = i
            return None if best < 0 else self._drop(best)

    def _drop(self, i: int):
        buf, size = self._free.pop(i), self._sizes.pop(i)
        self._ids.discard(id(buf))
        self._held -= size
        return buf

    def borrow(self, nbytes: int):
        """A buffer of at least nbytes: a held one (`take`), else a new one; `give` it back when done."""
        buf = self.take(nbytes)
        return buf if buf is not None else self.new(nbytes)

    def give(self, *bufs) -> None:
        with self._lock:
            for buf in bufs:
                size = buf.nbytes
                if size == 0 or size > self.limit or id(buf) in self._ids:
                    continue
                self._free.append(buf)
                self._sizes.append(size)
                self._ids.add(id(buf))
                self._held += size
            while self._held > self.limit:
                self._drop(0)

    def clear(self) -> None:
        with self._lock:
            self._free, self._sizes, self._ids, self._held = [], [], set(), 0


def bytes_of(t: "torch.Tensor") -> np.ndarray:
    """A contiguous CPU tensor's bytes as a uint8 array (no copy)."""
    import torch

    assert t.is_contiguous() and t.device.type == "cpu"
    return t.reshape(-1).view(torch.uint8).numpy()


def small_pages(nbytes: int) -> np.ndarray:
    """A new flat uint8 array of nbytes (zeros) in an anonymous mapping advised against huge pages
    (where the system has the advice: else as it maps memory); pages never written take no memory."""
    region = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_NOHUGEPAGE", None)
    if advice is not None:
        try:
            region.madvise(advice)
        except OSError:  # a kernel without transparent huge pages: small pages anyway
            pass
    return np.frombuffer(region, np.uint8)[:nbytes]  # keeps `region` mapped as long as any view of it lives


def lasting_pages(nbytes: int) -> np.ndarray | None:
    """A new flat uint8 array for memory that lives long (a cache buffer, a pool's layer): huge pages
    (`huge_pages`), except where `free_pages_reported()` makes fresh ones slow: small pages there
    (`small_pages`). None where neither applies (under 2 MiB, no THP): the caller allocates as usual."""
    if nbytes >= HUGE_PAGE and free_pages_reported():
        return small_pages(nbytes)
    return huge_pages(nbytes)


class HugeArena:
    """`take(nbytes)`: a flat uint8 CPU tensor cut from a huge-page chunk (64-byte aligned), or None
    where huge pages do not apply (under `least` bytes, no THP) and the caller allocates as usual.
    Chunks are `chunk` bytes (or one piece's size, rounded to huge pages, when larger); the tail a
    piece does not fit in is left unused. Thread-safe."""

    def __init__(self, chunk: int = 32 << 20, least: int = 64 << 10):
        self.chunk, self.least = chunk, least
        self._free: "torch.Tensor | None" = None  # what is left of the current chunk
        self._lock = threading.Lock()

    def take(self, nbytes: int):
        import torch

        if nbytes < self.least:
            return None
        with self._lock:
            if self._free is None or self._free.numel() < nbytes:
                size = max(self.chunk, -(-nbytes // HUGE_PAGE) * HUGE_PAGE)
                with torch.inference_mode(False):  # pieces outlive any forward
                    flat = huge_pages(size)
                    if flat is None:
                        return None
                    self._free = torch.from_numpy(flat)
            piece, used = self._free[:nbytes], -(-nbytes // 64) * 64
            self._free = self._free[used:] if used < self._free.numel() else None
            return piece
