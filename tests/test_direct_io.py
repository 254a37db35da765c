"""Reading past the page cache (`kvstore.direct_io`, `fileio.PosixIO.uncached` / `pread_direct_into`):
a restore whose layer files are not in the page cache reads them with direct I/O.

A direct read returns exactly the bytes a plain read does, wherever the destination sits and
whatever the offset and length (aligned middle straight in, ends through the bounce buffer, or all
of it bounced, as where the engine's memory is small pages: then the disk writes into the bounce
buffer only, a huge page), and pieces near each other in few reads (a conversation's many small extents of
one layer file: two); a range the page cache mostly lacks is `uncached`, one it mostly holds is
not; a session restored
from evicted files continues exactly (trace equal to an uninterrupted run) and its damaged bytes are
still caught; where direct I/O is refused the read is a plain one. A restore asks the page cache per
layer file and reads on READ_THREADS helpers when its first layer file is out of it; in it, the
restore reads every layer plainly on as many helpers as cores, and is exact even where later layer
files were evicted.
"""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
import torch

import kvstore
import store_harness as H
from kvstore import direct_io, fileio
from kvstore.errors import CorruptData
from kvstore.store import extents

ALIGN = direct_io.ALIGN


def write_file(path, nbytes: int, seed: int = 0) -> bytes:
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, data, 0)
        os.fsync(fd)  # clean pages: the kernel may drop them (`evict`)
    finally:
        os.close(fd)
    return data


def evict(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def direct_io_works(folder) -> bool:
    probe = folder / "probe"
    write_file(probe, 2 * ALIGN)
    try:
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
        try:
            os.preadv(fd, [memoryview(offset_buffer(ALIGN, 0))], 0)  # some file systems refuse only the read
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        return False
    finally:
        probe.unlink()
    return True


@pytest.fixture
def big_file(tmp_path):
    if not direct_io_works(tmp_path):
        pytest.skip("this file system refuses direct I/O")
    path = tmp_path / "data"
    return path, write_file(path, 3 * direct_io.BOUNCE + 12345)  # several bounce buffers, an odd end


@pytest.fixture(params=[True, False], ids=["straight", "all-bounced"])
def straight(request, monkeypatch):
    """Both ways of reading: aligned middles straight into their memory, or everything through the
    bounce buffer (where the engine's memory is small pages: `direct_io.straight_in`)."""
    monkeypatch.setattr(direct_io, "straight_in", lambda: request.param)
    return request.param


def offset_buffer(nbytes: int, misalign: int) -> np.ndarray:
    """nbytes of writable memory starting `misalign` bytes past a page boundary."""
    whole = np.frombuffer(bytearray(nbytes + 2 * ALIGN), np.uint8)
    start = -whole.ctypes.data % ALIGN + misalign
    return whole[start:start + nbytes]


@pytest.mark.parametrize("offset, nbytes, misalign", [
    (0, 64 << 10, 0),                        # aligned everything: straight in
    (768 * 5, 768 * 300, 768 * 5 % ALIGN),   # token rows: memory and file agree modulo ALIGN
    (768 * 5, 768 * 300, 0),                 # they do not: all through the bounce buffer
    (100, 3 * direct_io.BOUNCE, 100),        # longer than the bounce buffer, head and tail partial
    (777, 3 * direct_io.BOUNCE + 5, 3),      # bounced in several pieces
    (12, 1000, 12),                          # under two blocks
])
def test_a_direct_read_returns_the_bytes_of_a_plain_read(big_file, offset, nbytes, misalign, straight):
    path, data = big_file
    out = offset_buffer(nbytes, misalign)
    out[:] = 0xAB
    with open(path, "rb") as f:
        assert direct_io.pread_direct(f.fileno(), out, offset) == nbytes
    assert out.tobytes() == data[offset:offset + nbytes]


@pytest.mark.parametrize("left, congruent", [(1000, False), (1000, True), (30, True)])
def test_a_direct_read_past_the_end_of_the_file_is_short(big_file, left, congruent, straight):
    """All through the bounce buffer, or straight in where memory and file offset agree (30 bytes
    left: the file ends inside the partial block before the aligned middle)."""
    path, data = big_file
    start = len(data) - left
    out = offset_buffer(3 * ALIGN, start % ALIGN if congruent else (start + 1) % ALIGN)
    with open(path, "rb") as f:
        assert direct_io.pread_direct(f.fileno(), out, start) == left
    assert out[:left].tobytes() == data[start:]


def test_a_range_out_of_the_page_cache_is_uncached_and_one_in_it_is_not(big_file):
    """`uncached`: worth a direct read (partly out, and not small); `in_page_cache`: every page in."""
    path, data = big_file
    fd = os.open(path, os.O_RDONLY)
    try:
        if direct_io.cached_pages(fd, 0, len(data)) is None:
            pytest.skip("this kernel cannot say what is in the page cache (cachestat: Linux 6.5+)")
        io = fileio.PosixIO()
        os.pread(fd, len(data), 0)
        assert not io.uncached(fd, 0, len(data)) and io.in_page_cache(fd, 0, len(data))
        evict(path)
        assert io.uncached(fd, 0, len(data)) and not io.in_page_cache(fd, 0, len(data))
        assert not io.uncached(fd, 0, fileio.DIRECT_MIN - 1)  # small reads stay plain
        os.pread(fd, ALIGN, 0)  # the first page back: the rest is still out
        assert io.in_page_cache(fd, 0, ALIGN) and not io.in_page_cache(fd, 0, len(data))
        assert io.uncached(fd, 0, len(data))
        os.pread(fd, len(data), 0)
        quarter = len(data) // 4 // ALIGN * ALIGN
        os.posix_fadvise(fd, len(data) - quarter, 0, os.POSIX_FADV_DONTNEED)  # a quarter out: mostly cached, read plainly
        assert not io.uncached(fd, 0, len(data)) and not io.in_page_cache(fd, 0, len(data))
    finally:
        os.close(fd)


@pytest.fixture
def every_read_direct(monkeypatch):
    """Reads of any size past a cold page cache go direct; the direct reads made, counted."""
    monkeypatch.setattr(fileio, "DIRECT_MIN", 0)
    calls = []
    real = fileio.PosixIO.pread_direct_into
    monkeypatch.setattr(fileio.PosixIO, "pread_direct_into",
                        lambda self, fd, buf, offset: (calls.append(offset), real(self, fd, buf, offset))[1])
    return calls


def evicted_session(tmp_path, model, reference):
    """A session closed after a third of the reference's tokens, its layer files out of the page cache."""
    if not direct_io_works(tmp_path):
        pytest.skip("this file system refuses direct I/O")
    store = kvstore.open_store(tmp_path / "home")
    s = store.new("s", model, seed=5, chunk_size=16, checkpoint_every=4)
    s.append_text(H.DOCUMENT)
    trace = tmp_path / "t.jsonl"
    list(s.generate(N_NEW // 3, trace=trace, stop_at_eos=False))
    live = [t.clone() for t in s.seq.cache.state()]
    s.close()
    files = sorted((tmp_path / "home" / "sessions").rglob("layer-*.kv"))
    for f in files:
        evict(f)
    with open(files[0], "rb") as f:
        if direct_io.cached_pages(f.fileno(), 0, os.path.getsize(files[0])) is None:
            pytest.skip("this kernel cannot say what is in the page cache (cachestat: Linux 6.5+)")
    return store, trace, live, files


N_NEW = 30


@pytest.fixture(scope="module")
def reference(tmp_path_factory, model):
    tmp = tmp_path_factory.mktemp("reference")
    trace = tmp / "reference.jsonl"
    tokens = H.reference_run(tmp / "home", model, "ref", N_NEW, trace)
    return tokens, H.by_position(H.read_trace(trace))


def test_a_session_restored_from_evicted_files_continues_exactly(tmp_path, model, reference, every_read_direct, straight):
    store, trace, live, files = evicted_session(tmp_path, model, reference)
    with store.open("s", model) as s:
        assert len(every_read_direct) >= len(files)  # every layer file read past the page cache
        assert all(torch.equal(a, b) for a, b in zip(live, s.seq.cache.state()))
        list(s.generate(N_NEW - N_NEW // 3, trace=trace, stop_at_eos=False))
        H.assert_matches(reference, s.tokens, H.read_trace(trace))


@pytest.fixture
def reading(monkeypatch):
    """How a restore reads: the helpers each call asks for, and the page-cache questions per file."""
    seen = {"threads": [], "asked": []}
    real_map = extents.parallel_map
    monkeypatch.setattr(extents, "parallel_map",
                        lambda fn, items, threads: (seen["threads"].append(threads), real_map(fn, items, threads))[1])
    real_uncached = fileio.PosixIO.uncached
    monkeypatch.setattr(fileio.PosixIO, "uncached",
                        lambda self, fd, offset, n: (seen["asked"].append(fd), real_uncached(self, fd, offset, n))[1])
    return seen


def test_a_cold_restore_asks_per_layer_file_and_reads_on_more_helpers_than_cores(tmp_path, model, reference,
                                                                                every_read_direct, reading):
    """Reads from the disk wait on it: READ_THREADS helpers keep more of them in flight."""
    store, _, live, files = evicted_session(tmp_path, model, reference)
    with store.open("s", model) as s:
        assert all(torch.equal(a, b) for a, b in zip(live, s.seq.cache.state()))
    assert reading["threads"] == [extents.READ_THREADS]
    assert len(reading["asked"]) == len(files)
    assert len(every_read_direct) >= len(files)


def test_a_warm_restore_reads_plainly_on_as_many_helpers_as_cores(tmp_path, model, reference, every_read_direct,
                                                                  reading):
    """Files in the page cache: the CPU's work, asked about once (the first layer file), no direct read."""
    store, _, live, files = evicted_session(tmp_path, model, reference)
    for f in files:
        f.read_bytes()  # back in the page cache
    with store.open("s", model) as s:
        assert all(torch.equal(a, b) for a, b in zip(live, s.seq.cache.state()))
    assert reading["threads"] == [min(extents.CORES, extents.READ_THREADS)]
    assert reading["asked"] == [] and every_read_direct == []


def test_layers_out_of_the_page_cache_behind_a_cached_first_one_still_restore_exactly(tmp_path, model, reference,
                                                                                    every_read_direct):
    """The question is asked of the first layer file only; the others, evicted, are read plainly
    (from the disk through the page cache), every checksum verified."""
    store, trace, live, files = evicted_session(tmp_path, model, reference)
    files[0].read_bytes()
    with store.open("s", model) as s:
        assert every_read_direct == []
        assert all(torch.equal(a, b) for a, b in zip(live, s.seq.cache.state()))
        list(s.generate(N_NEW - N_NEW // 3, trace=trace, stop_at_eos=False))
        H.assert_matches(reference, s.tokens, H.read_trace(trace))


def test_a_flipped_byte_is_caught_on_the_direct_path(tmp_path, model, reference, every_read_direct):
    store, _, _, files = evicted_session(tmp_path, model, reference)
    fd = os.open(files[-1], os.O_RDWR)
    try:
        byte = os.pread(fd, 1, 100)
        os.pwrite(fd, bytes([byte[0] ^ 0x10]), 100)
        os.fsync(fd)
    finally:
        os.close(fd)
    evict(files[-1])
    with pytest.raises(CorruptData, match=f"layer {len(files) - 1}.*checksum mismatch"):
        store.open("s", model)
    assert every_read_direct


def test_where_direct_io_is_refused_the_read_is_a_plain_one(tmp_path, model, reference, every_read_direct,
                                                            monkeypatch):
    store, trace, live, _ = evicted_session(tmp_path, model, reference)

    def refuse(fd, buf, offset):
        raise OSError(errno.EINVAL, "direct I/O not supported")

    monkeypatch.setattr(direct_io, "pread_direct", refuse)
    with store.open("s", model) as s:
        assert every_read_direct  # asked for, refused, read plainly
        assert all(torch.equal(a, b) for a, b in zip(live, s.seq.cache.state()))


@pytest.mark.parametrize("sizes, misalign", [
    ([4 * ALIGN, 8 * ALIGN, ALIGN], 0),   # all aligned: one direct read
    ([768 * 16, 768 * 48, 768 * 7], 0),   # token rows: the first two aligned, the last not
    ([1000, 5000, 123], 17),              # nothing aligned: each through the bounce buffer
])
@pytest.mark.parametrize("direct", [True, False])
def test_a_list_of_buffers_is_filled_in_order(big_file, sizes, misalign, direct, straight):
    path, data = big_file
    whole = offset_buffer(sum(sizes), misalign)
    bufs, at = [], 0
    for n in sizes:  # pieces of one allocation, one after the other
        bufs.append(whole[at:at + n])
        at += n
    offset = 3 * ALIGN if misalign == 0 else 999
    with open(path, "rb") as f:
        read = direct_io.pread_direct if direct else fileio.PosixIO().pread_into
        assert read(f.fileno(), bufs, offset) == sum(sizes)
    assert b"".join(b.tobytes() for b in bufs) == data[offset:offset + sum(sizes)]


@pytest.mark.parametrize("direct", [True, False])
def test_a_list_of_buffers_cut_by_the_end_of_the_file_is_filled_up_to_it(big_file, direct, straight):
    path, data = big_file
    sizes = [1000, 5000, 123]
    bufs = [offset_buffer(n, 17) for n in sizes]
    start = len(data) - 3000  # the file ends inside the second buffer
    with open(path, "rb") as f:
        read = direct_io.pread_direct if direct else fileio.PosixIO().pread_into
        assert read(f.fileno(), bufs, start) == 3000
    assert bufs[0].tobytes() + bufs[1][:2000].tobytes() == data[start:]


@pytest.fixture
def preadv_calls(monkeypatch):
    """Every preadv this process makes, counted."""
    calls = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, views, offset: (calls.append(offset), real(fd, views, offset))[1])
    return calls


def test_a_layer_file_of_many_small_extents_is_read_in_two_direct_reads(big_file, every_read_direct, preadv_calls,
                                                                        straight):
    """A conversation's layer file: a long prompt's extent, then a reply's checkpoints of a few tokens
    each, every extent from a page boundary. One read covers them all (the bytes between them read
    and dropped); in it, the long extent's aligned middle goes straight into the cache's memory and
    everything else through one fill of the bounce buffer: two reads of the disk, where one per
    extent took 17 and more. All through the bounce buffer (it holds them all): one."""
    from kvstore.store import segments

    path, data = big_file
    token = 768  # bytes of one position in one layer file: token rows
    lengths = [2319, 16, 3, 21, 1, 21, 1, 21, 1, 21, 1, 21, 1, 21, 1, 18, 1]
    offsets, at = [], 0
    for n in lengths:
        offsets.append(at)
        at = -(-(at + n * token) // ALIGN) * ALIGN  # the next extent from the next page boundary
    cache = offset_buffer(sum(lengths) * token, 0)  # the cache's rows: the extents one after the other
    reads, row = [], 0
    for offset, n in zip(offsets, lengths):
        reads.append(segments.ExtentRead(offset, cache[row:row + n * token], f"extent at {offset}"))
        row += n * token
    evict(path)
    segments.read_extents_into(path, reads)
    assert len(every_read_direct) == 1 and len(preadv_calls) == (2 if straight else 1)
    for r in reads:
        assert r.data.tobytes() == data[r.offset:r.offset + r.data.nbytes]


def test_more_buffers_than_one_preadv_takes(big_file):
    path, data = big_file
    bufs = [np.zeros(10, np.uint8) for _ in range(direct_io.IOV_MAX + 5)]
    with open(path, "rb") as f:
        assert fileio.PosixIO().pread_into(f.fileno(), bufs, 7) == 10 * len(bufs)
    assert b"".join(b.tobytes() for b in bufs) == data[7:7 + 10 * len(bufs)]


@pytest.mark.parametrize("reported", [False, True])
def test_reads_go_straight_in_unless_the_engines_memory_is_small_pages(monkeypatch, reported):
    """Where free pages are reported to a host, the engine's long-lived memory (a restored cache's)
    is small pages (`engine.buffers.lasting_pages`), and the disk fills a huge page faster than
    small ones: reads go through the bounce buffer there, when it is a huge page."""
    from kvstore import pages

    monkeypatch.setattr(direct_io, "free_pages_reported", lambda: reported)
    bounce = direct_io._bounce()
    assert len(bounce) == direct_io.BOUNCE and bounce.ctypes.data % ALIGN == 0
    huge = direct_io._local.huge
    assert huge == (pages.huge_pages(pages.HUGE_PAGE) is not None)
    if huge:
        assert bounce.ctypes.data % pages.HUGE_PAGE == 0  # one huge page: one piece of memory for the disk
    assert direct_io.straight_in() is not (reported and huge)


def test_all_bounced_the_disk_writes_into_the_bounce_buffer_only(big_file, monkeypatch):
    """Aligned memory and offsets that a straight read would fill in one request: with straight reads
    off, every request's memory lies in the bounce buffer (its 2 MiB at most), and the bytes arrive."""
    monkeypatch.setattr(direct_io, "straight_in", lambda: False)
    path, data = big_file
    targets = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, views, offset: (
        targets.extend(np.frombuffer(v, np.uint8).ctypes.data for v in views), real(fd, views, offset))[1])
    out = offset_buffer(2 * direct_io.BOUNCE + 8 * ALIGN, 0)
    with open(path, "rb") as f:
        assert direct_io.pread_direct(f.fileno(), out, 4 * ALIGN) == len(out)
    assert out.tobytes() == data[4 * ALIGN:4 * ALIGN + len(out)]
    bounce = direct_io._bounce().ctypes.data
    assert len(targets) == 3 and all(t == bounce for t in targets)


def test_no_more_than_depth_direct_reads_are_in_flight_at_once(big_file, monkeypatch, straight):
    """A restore's helpers outnumber the reads the disk takes at once (`extents.READ_THREADS`): the
    others copy and verify meanwhile. At most DEPTH of them wait on the disk together, and more
    than one does."""
    import threading
    import time

    path, data = big_file
    lock, now, most = threading.Lock(), [0], [0]
    real = os.preadv

    def slow(fd, views, offset):
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        time.sleep(0.02)
        try:
            return real(fd, views, offset)
        finally:
            with lock:
                now[0] -= 1

    monkeypatch.setattr(os, "preadv", slow)
    outs = [offset_buffer(64 << 10, 0) for _ in range(3 * direct_io.DEPTH)]

    def read(out):
        with open(path, "rb") as f:
            assert direct_io.pread_direct(f.fileno(), out, 8 * ALIGN) == len(out)

    threads = [threading.Thread(target=read, args=(out,)) for out in outs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 1 < most[0] <= direct_io.DEPTH
    assert all(out.tobytes() == data[8 * ALIGN:8 * ALIGN + (64 << 10)] for out in outs)
