"""A session's KV as stored: its ordered extent references, and reading them back verified.

An `ExtentRef` says: the first `n_tokens` of extent `extent_id` sit at positions
[start, start + n_tokens) of the session. Its bytes are in the raw per-layer files of its segment,
or, once packed, in a blob. `read_layers` returns the per-layer raw bytes of the whole extent after
checking every checksum, so a flipped or missing byte is a `CorruptData` naming the session, the
file, the layer and the extent, never garbage tokens; `read_layers_unlocked` does the same for
readers that do not hold the lock of the extent's owner, which a pack may overtake.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from sqlalchemy import Connection, bindparam, select
from sqlalchemy.orm import Session as DB

from ..errors import CorruptData
from ..fileio import close_all, io
from . import blobs, codec, segments
from .index import BlobRow, ExtentBlobRow, ExtentRow, SegmentRow, SessionExtentRow
from .workers import parallel_map


@dataclass
class ExtentRef:
    start: int
    n_tokens: int  # tokens of the extent used by this session (a prefix of it)
    extent_id: int
    segment_id: str
    offset: int
    extent_tokens: int
    checksums: list[str]
    token_bytes: int
    blob: BlobRow | None

    @property
    def raw_size(self) -> int:
        """Bytes of one layer of the whole extent."""
        return self.extent_tokens * self.token_bytes


def kv_bytes(ref: ExtentRef) -> int:
    """Raw KV bytes of the whole extent, every layer: the unit of progress for jobs over extents."""
    return ref.raw_size * len(ref.checksums)


_se, _ex, _seg, _blob = SessionExtentRow, ExtentRow, SegmentRow, BlobRow
EXTENTS = (select(_se.start, _se.n_tokens, _ex.id, _ex.segment_id, _ex.offset, _ex.n_tokens, _ex.checksums,
                  _seg.token_bytes, _blob.hash, _blob.frames, _blob.size, _blob.file_checksum)
           .join(ExtentRow, _se.extent_id == _ex.id)
           .join(SegmentRow, _ex.segment_id == _seg.id)
           .outerjoin(ExtentBlobRow, ExtentBlobRow.extent_id == _ex.id)
           .outerjoin(BlobRow, _blob.hash == ExtentBlobRow.blob_hash)
           .where(_se.session_id == bindparam("session_id"))
           .order_by(_se.start))  # made once: building it cost as much as running it


def session_extents(db: DB | Connection, session_id: str) -> list[ExtentRef]:
    """The session's extents in order (columns, not ORM objects: an ORM session or a connection)."""
    rows = db.execute(EXTENTS, {"session_id": session_id})
    return [ExtentRef(start, used, extent_id, segment_id, offset, n_tokens, list(checksums), token_bytes,
                      None if digest is None else BlobRow(hash=digest, frames=frames, size=size, file_checksum=fcs))
            for (start, used, extent_id, segment_id, offset, n_tokens, checksums, token_bytes,
                 digest, frames, size, fcs) in rows]


def extent_label(session: str, extent_id: int) -> str:
    """How errors about an extent begin: "session 'doc', extent 7"."""
    return f"session {session!r}, extent {extent_id}"


def read_layers(ref: ExtentRef, home: Path, itemsize: int, *, session: str) -> list[np.ndarray]:
    """Verified raw bytes of every layer of the extent (the whole extent, not just the used prefix)."""
    what = extent_label(session, ref.extent_id)
    if ref.blob is None:  # each layer verified as it is read
        directory = home / "sessions" / ref.segment_id
        return [segments.read_extent(directory, i, ref.offset, ref.raw_size, what=f"{what}, layer {i}",
                                     checksum=expected) for i, expected in enumerate(ref.checksums)]
    b = ref.blob
    layers = blobs.unpack(home / "blobs", b.hash, b.frames, b.file_checksum, ref.raw_size, itemsize,
                          ref.token_bytes, what=what)
    for i, (data, expected) in enumerate(zip(layers, ref.checksums)):
        segments.verify(data, expected, what=f"{what} (blob), layer {i}")
    return layers


def read_layers_unlocked(store, ref: ExtentRef, itemsize: int, *, session: str) -> list[np.ndarray]:
    """`read_layers` for a reader without the lock of the session that owns the extent (verify,
    export; pack, for the extents a fork shares with its parent). A pack in another process may have
    moved the extent into a blob, and freed its raw file, since `ref` was read from the index: the
    bytes are then read from that blob. Damage is still CorruptData."""
    try:
        return read_layers(ref, store.home, itemsize, session=session)
    except CorruptData:
        if ref.blob is not None:
            raise
        with store.db() as db:
            blob = db.scalar(select(BlobRow).join(ExtentBlobRow, ExtentBlobRow.blob_hash == BlobRow.hash)
                             .where(ExtentBlobRow.extent_id == ref.extent_id))
        if blob is None:
            raise
        return read_layers(replace(ref, blob=blob), store.home, itemsize, session=session)


# helpers reading the layers of a run from the disk: more than the 2 cores of the machines measured,
# because a cold restore waits on the disk: 4 read a 8,191-token session (188 MB) from disk in
# 99-114 ms where 2 took 122-129 (p10 of 20, two runs; AMD EPYC Zen 5, 2 cores, load 9-10); a
# cold 2k open 27.8 ms with 4, 30.6 with 2 (median of 12 alternated; Intel Xeon with AMX, KVM). Twice
# the reads the disk takes at once (`direct_io.DEPTH`): the helpers whose reads are done copy and
# verify while the others wait on the disk. With 4, all four read at once, finished together and
# copied while the disk idled (a third of a cold 2k open); 8 with 4 reads in flight opened it in
# 22.4-23.8 ms against 27.5-27.8 (through the bounce buffer), 31-39 against 40-45 straight into
# small pages (medians of 6; AMD EPYC, Zen 1 kind, KVM)
READ_THREADS = 8
# from the page cache a read is the CPU's work, and helpers beyond the cores only wait for the GIL
# between their calls: a warm 2k open (47 MB) took 6.0 ms with 2 helpers, 7.3 with 4 (median of 40
# alternated; Intel Xeon with AMX, 2 cores); on AMD EPYC Zen 5, 2, 3 and 4 were equal in the noise
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def load_into(cache, refs: list[ExtentRef], home: Path, *, session: str) -> None:
    """Append every referenced extent to `cache` (empty on entry), checksums verified.

    On a CPU cache, runs of whole extents, raw or packed, are read or inflated straight into the
    cache's memory, one task per layer over the whole run (helpers take the layers as they come
    free: READ_THREADS where the files are read from the disk, one per core where the page cache
    holds them); partial ones (a fork's last) and CUDA caches go through a buffer. A paged cache
    (`engine.paged`) first takes the leading extents that other sequences of its pool hold in memory
    as read (shared blocks: those bytes were verified when they were read), and remembers what it
    read for the next ones.

    Not done: mapping a warm session's layer files into the cache's memory (each layer's extents
    mapped privately over the start of its buffer, hashed in place) instead of reading them. It was
    faster: a 2,048-token session's 30 layers mapped, hashed and unmapped on 2 threads in 5.5-5.7 ms
    against 6.9 ms read and hashed (medians of 60, alternated; Intel Xeon with AMX, KVM). But the
    cache would then read the page cache's pages, not the bytes verified: a page the system drops
    under memory pressure comes back from the disk unchecked, and a file cut short under an open
    session kills the process (SIGBUS) where a read reports it. Checksums verified at open guard
    what attention reads only when the cache holds its own copy of the bytes verified.
    """
    itemsize = cache.dtype.itemsize
    run: list[ExtentRef] = []
    every = refs
    if hasattr(cache, "adopt_extents"):  # a paged cache shares what other sessions read of these extents
        refs = refs[cache.adopt_extents(refs):]
    pos = cache.length
    for ref in refs:
        if ref.start != pos:
            raise CorruptData(f"session {session!r}: the index has a gap in its KV at position {pos}")
        pos += ref.n_tokens
        if ref.n_tokens == ref.extent_tokens and cache.device.type == "cpu":
            run.append(ref)
            continue
        _read_direct(cache, run, home, session)
        run = []
        import torch  # here: gc, pack and verify use this module without a model, and never load torch

        used = ref.n_tokens * ref.token_bytes
        layers = read_layers(ref, home, itemsize, session=session)
        # bytes -> [n_tokens, 2, n_kv_heads, head_dim] in the cache's dtype
        cache.load(ref.start, [torch.from_numpy(d[:used]).view(cache.dtype).view(ref.n_tokens, *cache.token_shape)
                               for d in layers])
    _read_direct(cache, run, home, session)
    if hasattr(cache, "register_extents"):
        cache.register_extents(every)


def _read_direct(cache, run: list[ExtentRef], home: Path, session: str) -> None:
    """Read (raw) or inflate (packed) a run of consecutive whole extents into the cache, each layer's
    share in one task."""
    if not run:
        return
    end = run[-1].start + run[-1].n_tokens
    cache.reserve(end)
    blob_files: dict[str, int] = {}  # each blob of the run open once, its layers read by the tasks
    try:
        for ref in run:
            if ref.blob is not None and ref.blob.hash not in blob_files:
                blob_files[ref.blob.hash] = blobs.open_blob(home / "blobs", ref.blob.hash,
                                                            what=f"session {session!r}, extent {ref.extent_id}")
        # each layer's bytes of the run in the cache's memory, as uint8 views made here: torch calls in
        # the workers would contend for the GIL (measured: 2k tokens, 120 views, 13 ms of the workers' time)
        with cache.filling(end, raw=True) as rows:
            _fill(rows, cache.dtype.itemsize, run, home, session, blob_files)
    finally:
        close_all(list(blob_files.values()))


def _fill(dest: list[np.ndarray], itemsize: int, run: list[ExtentRef], home: Path, session: str,
          blob_files: dict[str, int]) -> None:
    """Each layer's share of the run (`dest`: its bytes), in one task per layer: read, or read from
    its blob and inflated, then verified. A packed layer's payload is read into a small buffer of
    the task's, reused for each extent: it is inflated while it sits in the CPU's cache, and no
    memory the size of the blobs is touched (fresh memory for 32 MB of blob bodies made the first
    open after a pack a third slower; AMD EPYC Zen 3, KVM)."""
    first = run[0].start
    payload_bytes = max((ref.blob.frames[i][1] for ref in run if ref.blob is not None
                         for i in range(len(ref.blob.frames))), default=0)
    packed = [ref for ref in run if ref.blob is not None]
    by_segment: dict[str, list[ExtentRef]] = {}  # raw extents per segment: one open of each layer file
    for ref in run:
        if ref.blob is None:
            by_segment.setdefault(ref.segment_id, []).append(ref)
    # each segment's layer paths made once here, not per layer in the tasks: Python in the tasks
    # holds the GIL the other readers wait for (a warm 2k open: 8.4 ms with 4 helpers, 6.3 without it)
    raw = [(segments.layer_paths(home / "sessions" / segment, len(dest)), refs) for segment, refs in by_segment.items()]

    def target(layer: int, ref: ExtentRef) -> np.ndarray:  # the extent's share of the layer's bytes (a view)
        a = (ref.start - first) * ref.token_bytes
        return dest[layer][a:a + ref.n_tokens * ref.token_bytes]

    def one(layer: int) -> None:
        payload = blobs.PAYLOADS.borrow(payload_bytes) if payload_bytes else None
        try:
            for ref in packed:
                what = (f"session {session!r}, extent {ref.extent_id}, layer {layer} "
                        f"(blob {blobs.blob_path(Path('blobs'), ref.blob.hash).as_posix()})")
                data = blobs.read_payload(blob_files[ref.blob.hash], ref.blob.frames, layer, payload, what=what)
                out = target(layer, ref)
                codec.unpack_frame(data, ref.raw_size, itemsize, ref.token_bytes, what=what, out=out)
                segments.verify(out, ref.checksums[layer], what=what)
        finally:
            if payload is not None:
                blobs.PAYLOADS.give(payload)
        for paths, refs in raw:  # each verified as soon as it is read
            segments.read_extents_into(paths[layer], [
                segments.ExtentRead(ref.offset, target(layer, ref), f"session {session!r}, extent {ref.extent_id}, "
                                    f"layer {layer}", ref.checksums[layer]) for ref in refs], cached=cached)

    cached = not packed and all(_cached(paths[0], refs) for paths, refs in raw)
    parallel_map(one, list(range(len(dest))), threads=min(CORES, READ_THREADS) if cached else READ_THREADS)


def _cached(path: Path, refs: list[ExtentRef]) -> bool:
    """Whether the page cache is known to hold all that `refs` take of one layer file (the first: a
    checkpoint writes every layer's share at once, and a warm open reads them all): then the tasks
    read every layer plainly, without asking the system again per layer (30 asks took 0.8 ms of a
    warm 2k open's 4.7 ms of reading on 2 helpers). False when the file cannot be opened (the
    reading task reports that)."""
    start = min(ref.offset for ref in refs)
    end = max(ref.offset + ref.n_tokens * ref.token_bytes for ref in refs)
    try:
        fd = io.open_read(path)
    except OSError:
        return False
    try:
        return io.in_page_cache(fd, start, end - start)
    finally:
        io.close(fd)
