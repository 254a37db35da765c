"""The memory pools (kvstore.engine.buffers.BufferPool; the caches' kvstore.engine.cache.POOL): a closed session's or sequence's cache memory goes to the
next cache of the process, best fit, within the pool's limit; what that memory held before never
shows in a later cache (contract C1 over reused memory is in test_store_resume.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvstore
from kvstore.engine.buffers import HUGE_PAGE, PAGE, BufferPool, HugeArena, huge_pages, populate, small_pages
from kvstore.engine.cache import POOL, POPULATE_AHEAD, VIEWS_KEPT, KVCache
from memory_kit import thp_eligible


@pytest.fixture(autouse=True)
def empty_pool():
    POOL.clear()
    yield
    POOL.clear()


def buffers(pool: BufferPool) -> list[int]:
    return sorted(b.nbytes for b in pool._free)


@pytest.mark.parametrize("new", [lambda n: torch.empty(n, dtype=torch.uint8), lambda n: np.empty(n, np.uint8)],
                         ids=["torch", "numpy"])
def test_the_pool_hands_out_the_smallest_buffer_that_fits_and_keeps_within_its_limit(new):
    pool = BufferPool(limit=1000, new=new)
    for n in (100, 400, 300):
        pool.give(new(n))
    assert pool.take(250).nbytes == 300
    assert pool.take(500) is None
    assert pool.borrow(500).nbytes == 500 and buffers(pool) == [100, 400]  # a new one: none fits
    assert buffers(pool) == [100, 400]
    pool.give(new(2000))  # larger than the limit: not kept
    assert buffers(pool) == [100, 400]
    pool.give(new(700))  # over the limit together: the oldest go first
    assert buffers(pool) == [700] and pool.held == 700
    pool.give(pool._free[0])  # the same buffer twice is held once
    assert buffers(pool) == [700]
    pool.clear()
    assert pool.held == 0


def test_a_released_cache_gives_its_memory_to_the_next_one():
    cache = KVCache(3, 2, 8, dtype=torch.bfloat16, capacity=300)
    with cache.filling(10) as rows:
        rows[0][:] = 1
    used = {t.untyped_storage().data_ptr() for t in cache.layers}
    cache.release()
    assert cache.length == 0 and cache.capacity == 0 and POOL.held >= 3 * 300 * 2 * 2 * 8 * 2
    again = KVCache(3, 2, 8, dtype=torch.bfloat16, capacity=300)
    assert {t.untyped_storage().data_ptr() for t in again.layers} == used
    assert again.length == 0 and again.state()[0].shape == (0, 2, 2, 8)


def test_growing_a_cache_keeps_its_tokens_and_pools_the_old_memory():
    cache = KVCache(2, 1, 4, dtype=torch.float32, capacity=256)
    rows = torch.randn(200, 2, 1, 4)
    for layer in range(2):
        cache.write(layer, 0, rows)  # the last layer's write makes the positions valid
    assert cache.length == 200
    cache.reserve(600)
    assert cache.capacity >= 600 and all(torch.equal(s, rows) for s in cache.state())
    assert buffers(POOL) == [256 * 2 * 4 * 4] * 2


def test_closing_a_session_pools_its_memory_for_the_next_open(tmp_path, model):
    store = kvstore.open_store(tmp_path / "home")
    with store.new("a", model) as s:
        s.append_text("Once upon a time the cache was written to disk.")
        list(s.generate(4, stop_at_eos=False))
    assert POOL.held > 0
    store.fork("a", "b")
    with store.open("a", model) as a:  # a restored cache has room beyond its tokens: more than "a" grew to
        used = {t.untyped_storage().data_ptr() for t in a.seq.cache.layers}
    with store.open("b", model) as b:
        assert {t.untyped_storage().data_ptr() for t in b.seq.cache.layers} == used
        assert b.tokens == store.tokens("a")


def test_a_closed_sequence_keeps_its_tokens_and_recomputes_from_them(model):
    ids = model.tokenizer.encode("A sequence that is closed and then asked again.")
    seq = kvstore.Sequence(model, tokens=ids)
    first = seq.next_logits()
    seq.close()
    assert seq.tokens == ids and seq.cache.length == 0 and seq.pending == ids
    assert torch.equal(seq.next_logits(), first)


def test_memory_pooled_by_a_forward_is_ordinary_memory_for_its_next_user():
    """A cache that grows inside a forward (inference mode) pools buffers that later users write
    outside it (a fork's `load`, a test's `fill_`): they must not be inference tensors."""
    POOL.clear()
    cache = KVCache(2, 1, 4, dtype=torch.bfloat16, capacity=0)
    with torch.inference_mode():
        cache.reserve(300)
    cache.release()
    assert POOL.held > 0 and not any(buf.is_inference() for buf in POOL._free)
    for buf in POOL._free:
        buf.fill_(7)  # outside inference mode: allowed on ordinary tensors only


def test_a_pooled_buffer_keeps_its_views_for_the_next_cache_and_filling_gives_its_bytes_in_place():
    """A cache views each pooled buffer as its layer's shape once per buffer and shape: the next cache
    that borrows the buffer reuses the view (a warm open makes 30), ordinary tensors even when a
    forward (inference mode) made them. `filling(raw=True)` hands the rows to fill as the bytes of
    the cache's own memory."""
    with torch.inference_mode():
        cache = KVCache(2, 2, 8, dtype=torch.bfloat16, capacity=256)
    views = {id(t) for t in cache.layers}
    cache.release()
    again = KVCache(2, 2, 8, dtype=torch.bfloat16, capacity=256)
    assert {id(t) for t in again.layers} == views and not any(t.is_inference() for t in again.layers)
    kv = torch.randn(10, 2, 2, 8).to(torch.bfloat16)
    with again.filling(10, raw=True) as raw:
        assert all(r.dtype == np.uint8 and r.nbytes == kv.numel() * 2 for r in raw)
        for r in raw:
            r[:] = kv.view(torch.uint8).reshape(-1).numpy()
    assert again.length == 10 and all(torch.equal(s, kv) for s in again.state())
    again.release()
    wider = KVCache(2, 1, 8, dtype=torch.float32, capacity=256)  # the same bytes, another shape: other views
    assert not {id(t) for t in wider.layers} & views and wider.layers[0].shape == (256, 2, 1, 8)
    for flat in wider._flat:
        assert len(flat.kv_views) <= VIEWS_KEPT


def test_large_buffers_start_on_a_huge_page_and_occupy_no_more_than_their_size():
    """`buffers.huge_pages`: a buffer of 2 MiB or more starts on a 2 MiB boundary (its whole huge
    pages are advised, where the system has THP), reads as zeros, is writable to its last byte and
    stays mapped while any view of it lives; smaller ones are left to the ordinary allocator."""
    assert huge_pages(HUGE_PAGE - 1) is None
    nbytes = 2 * HUGE_PAGE + 12345
    buf = huge_pages(nbytes)
    if buf is None:
        pytest.skip("no transparent huge pages on this system")
    assert buf.nbytes == nbytes and buf.ctypes.data % HUGE_PAGE == 0
    assert not buf.any()
    tail = buf[-100:]
    del buf
    tail[:] = 7  # the mapping outlives the array it was cut from
    assert int(tail.sum()) == 700


@pytest.mark.parametrize("reported", [False, True])
def test_a_cache_on_huge_pages_holds_what_is_written_and_goes_back_to_the_pool(monkeypatch, reported):
    """Large cache buffers start on huge pages where the system has them, except where free pages are
    reported to a host (fresh huge pages are slow there): small pages then, which the kernel says,
    where it says. Either way they hold what is written and go back to the pool."""
    from kvstore.engine import buffers as buffers_module

    monkeypatch.setattr(buffers_module, "free_pages_reported", lambda: reported)
    POOL.clear()  # buffers made now, by the rule under test
    layer_bytes = 4096 * 2 * 4 * 64 * 2  # 4,096 positions of [2, 4, 64] bfloat16: 4 MiB a layer
    cache = KVCache(2, 4, 64, dtype=torch.bfloat16, capacity=4096)
    assert all(t.untyped_storage().nbytes() >= layer_bytes for t in cache.layers)
    if not reported and huge_pages(HUGE_PAGE) is not None:  # made of huge pages: each layer starts on one
        assert all(t.data_ptr() % HUGE_PAGE == 0 for t in cache.layers)
    if reported:
        eligible = [thp_eligible(t.data_ptr()) for t in cache.layers]
        assert eligible in ([False, False], [None, None])
    rows = torch.randn(3000, 2, 4, 64).to(torch.bfloat16)
    for layer in range(2):
        cache.write(layer, 0, rows)
    assert all(torch.equal(s, rows) for s in cache.state())
    cache.release()
    assert buffers(POOL) == [layer_bytes] * 2


def test_the_arena_cuts_aligned_pieces_that_never_overlap_and_leaves_small_ones_alone():
    """`buffers.HugeArena` (where packed weights live): pieces of at least `least` bytes come from
    huge-page chunks, 64-byte aligned, each its own bytes; a piece larger than a chunk gets a chunk of
    its own; smaller requests, or a system without THP, get None (the caller allocates as usual)."""
    if huge_pages(HUGE_PAGE) is None:
        pytest.skip("no transparent huge pages on this system")
    arena = HugeArena(chunk=HUGE_PAGE, least=1000)
    assert arena.take(999) is None
    sizes = [1000, 70_001, 300_000, 3 * HUGE_PAGE + 5, 1_000_000, 1_000_000]
    pieces = [arena.take(n) for n in sizes]
    assert [p.numel() for p in pieces] == sizes and all(p.data_ptr() % 64 == 0 for p in pieces)
    assert pieces[3].data_ptr() % HUGE_PAGE == 0  # larger than a chunk: a chunk of its own
    for i, p in enumerate(pieces):
        p.fill_(i + 1)
    assert all(bool((p == i + 1).all()) for i, p in enumerate(pieces))  # no piece wrote over another


def test_the_arena_falls_back_where_there_are_no_huge_pages(monkeypatch):
    import kvstore.engine.buffers as buffers

    monkeypatch.setattr(buffers, "huge_pages", lambda nbytes: None)
    assert HugeArena(least=1).take(1 << 20) is None


def resident(address: int, nbytes: int) -> list[bool]:
    """Whether each page of the range is in memory (mincore)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    start = address // PAGE * PAGE
    pages = -(-(address + nbytes - start) // PAGE)
    out = ctypes.create_string_buffer(pages)
    assert libc.mincore(start, pages * PAGE, out) == 0, ctypes.get_errno()
    return [bool(b & 1) for b in out.raw]


def populates() -> bool:
    probe = small_pages(1 << 16)
    return populate(probe.ctypes.data, probe.nbytes)


needs_populate = pytest.mark.skipif(not populates(), reason="this system has no madvise(MADV_POPULATE_WRITE)")


@needs_populate
def test_populate_faults_a_range_in_without_changing_a_byte():
    flat = small_pages(64 * PAGE)
    flat[5 * PAGE + 3] = 7  # one page written before
    assert resident(flat.ctypes.data, flat.nbytes).count(True) == 1
    assert populate(flat.ctypes.data + 2 * PAGE + 10, 20 * PAGE)  # a range not on page bounds
    assert resident(flat.ctypes.data, flat.nbytes) == [2 <= p <= 22 or p == 5 for p in range(64)]
    assert flat[5 * PAGE + 3] == 7 and int(flat.sum()) == 7


@needs_populate
def test_a_cache_faults_in_the_pages_of_its_next_positions_before_a_forward_writes_them(monkeypatch):
    """`claim` (the native layer stack's write path) populates each layer's pages up to POPULATE_AHEAD
    positions past the rows it claims: first writes inside a decode step cost it far more."""
    monkeypatch.setattr("kvstore.engine.buffers.free_pages_reported", lambda: True)  # small pages
    cache = KVCache(2, 4, 64, dtype=torch.bfloat16, capacity=8192)  # 4 MiB a layer, fresh
    row = 2 * 4 * 64 * 2
    for buf in cache.layers:
        assert not any(resident(buf.data_ptr(), buf.nbytes))
    cache.claim(0, 1)
    cache.length = 1
    ahead = 1 + POPULATE_AHEAD
    for buf in cache.layers:
        pages = resident(buf.data_ptr(), buf.nbytes)
        assert all(pages[:ahead * row // PAGE]) and not any(pages[-(-ahead * row // PAGE) + 1:])
    cache.claim(1, 2)  # inside what is populated: nothing more
    assert sum(resident(cache.layers[0].data_ptr(), cache.layers[0].nbytes)) == -(-ahead * row // PAGE)


@needs_populate
def test_a_block_pool_faults_in_each_block_once_when_it_is_first_handed_out(monkeypatch):
    monkeypatch.setattr("kvstore.engine.buffers.free_pages_reported", lambda: True)  # small pages
    pool = kvstore.BlockPool(2, 4, 64, dtype=torch.bfloat16, n_blocks=512, block_tokens=16)  # 8 MiB a layer
    block = 16 * 2 * 4 * 64 * 2
    ids = pool.alloc(3)
    for layer in pool.layers:
        pages = resident(layer.data_ptr(), layer.nbytes)
        in_blocks = [any(i * block <= p * PAGE < (i + 1) * block for i in ids) for p in range(len(pages))]
        assert pages == in_blocks
    assert [pool.populated[i] for i in range(5)] == [1 if i in ids else 0 for i in range(5)]
