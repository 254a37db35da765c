"""Paged KV memory (kvstore/engine/paged.py): paging changes no bit, forks share blocks, budgets hold.

- A sequence fed through a `PagedCache` (prefill chunks, then decode steps) gives the bits a
  contiguous `KVCache` gives: logits and every K/V byte, whatever blocks it got in the pool.
- `copy_prefix` shares whole blocks and copies the partial one; writing a trimmed position again in
  a shared block copies it first, so the other sequence's bytes never change.
- The store restores a session into a paged cache, and checkpoints from one, byte for byte.
- Sequences that grow in turns take their blocks in runs next to each other while the pool has room.
- A full pool asks `on_full` to free blocks, and says what to do when it cannot.
"""

from __future__ import annotations

import pytest
import torch

import kvstore
from engine_models import Q
from kvstore.engine.paged import RUN_BLOCKS, BlockPool, PagedCache
from kvstore.errors import PoolFull, PoolTooSmall
from memory_kit import thp_eligible


def pool_for(model, n_blocks: int = 64) -> BlockPool:
    c = model.config
    return BlockPool(c.n_layers, c.n_kv_heads, c.head_dim, dtype=model.dtype, n_blocks=n_blocks)


@pytest.fixture(scope="module", params=["dense-f32", "stored-bf16"])
def model(request, tiny):
    m = tiny("llama-gqa")
    if request.param == "dense-f32":
        return kvstore.load_model(m.folder, dtype="float32")
    return kvstore.load_model(m.gguf(Q.Q4_1)[0], dtype="bfloat16", weights="stored")


def run(model, cache, ids: list[int]) -> list[torch.Tensor]:
    """Prefill in chunks of 8 (20 tokens), then 10 decode steps: every logits row."""
    out = [model.forward(ids[a:min(a + 8, 20)], a, cache) for a in range(0, 20, 8)]
    return out + [model.forward(ids[p:p + 1], p, cache) for p in range(20, 30)]


def test_a_paged_sequence_computes_the_contiguous_ones_bits(model, tiny):
    ids = tiny("llama-gqa").ids(30)
    pool = pool_for(model)
    pool.alloc(5)  # the sequence's blocks do not start at 0, nor follow each other: others hold some
    paged, flat = PagedCache(pool), model.new_cache()
    for a, b in zip(run(model, paged, ids), run(model, flat, ids)):
        assert torch.equal(a, b)
    assert paged.length == flat.length == 30 and paged.table != list(range(len(paged.table)))
    assert all(torch.equal(a, b) for a, b in zip(paged.state(), flat.state()))
    assert all(torch.equal(a, b) for a, b in zip(paged.state(7, 23), flat.state(7, 23)))


def test_a_fork_shares_whole_blocks_and_a_write_into_a_shared_block_copies_it(model, tiny):
    ids = tiny("llama-gqa").ids(40)
    pool = pool_for(model)
    parent = PagedCache(pool)
    run(model, parent, ids)  # 30 positions: blocks [0,16) [16,30)
    before = pool.used
    child = parent.copy_prefix(20)
    assert child.table[0] == parent.table[0] and child.table[1] != parent.table[1]
    assert pool.used == before + len(child.table) - 1 and pool.refs[parent.table[0]] == 2  # its others: new
    assert all(torch.equal(a, b) for a, b in zip(child.state(), parent.state(0, 20)))
    kept = [s.clone() for s in parent.state()]
    child.trim(10)  # position 10 lies in the shared block: feeding it again must not touch the parent's
    model.forward(ids[10:11], 10, child)
    assert child.table[0] != parent.table[0] and pool.refs[parent.table[0]] == 1
    assert all(torch.equal(a, b) for a, b in zip(parent.state(), kept))
    child.release()
    parent.release()
    assert pool.used == 0


def test_the_store_restores_into_and_checkpoints_from_a_paged_cache(model, tiny, tmp_path):
    from kvstore.store.extents import load_into, session_extents

    ids = tiny("llama-gqa").ids(45)
    store = kvstore.open_store(tmp_path / "home")
    with store.new("s", model, seed=1, chunk_size=8) as s:
        s.append_tokens(ids)
        expected = s.seq.cache.state()
    with store.db() as db:
        refs = session_extents(db, store.row(db, "s").id)
    paged = PagedCache(pool_for(model))
    load_into(paged, refs, store.home, session="s")
    assert paged.length == 45 and all(torch.equal(a, b) for a, b in zip(paged.state(), expected))
    store.close()


def test_a_restore_fills_blocks_in_one_run_in_place_and_scattered_ones_through_a_buffer(model):
    """What a restore reads lands in the blocks either way; where its positions sit in one run of pool
    rows that no other cache shares, `filling` hands out those rows themselves (no second copy),
    else a buffer that is copied into the blocks."""
    pool = pool_for(model)
    c = model.config

    def fill(cache: PagedCache, n: int, seed: int) -> bool:
        data = torch.randn(n, 2, c.n_kv_heads, c.head_dim, generator=torch.Generator().manual_seed(seed))
        with cache.filling(n) as rows:
            in_place = rows[0].untyped_storage().data_ptr() == pool.layers[0].untyped_storage().data_ptr()
            for r in rows:
                r.copy_(data.to(r.dtype))
        assert cache.length == n and all(torch.equal(s, data.to(s.dtype)) for s in cache.state())
        return in_place

    assert fill(PagedCache(pool), 45, 1)  # a fresh pool: ascending blocks, one run
    taken = [pool.alloc(1)[0] for _ in range(8)]
    pool.free(taken[::2])  # free blocks with taken ones between them
    assert not fill(PagedCache(pool), 45, 2)


class PagedModel:
    """The model with its caches in `pool` (as `kvstore serve` hands its sessions one)."""

    def __init__(self, model, pool: BlockPool):
        self._model, self._pool = model, pool

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def new_cache(self, capacity: int = 0) -> PagedCache:  # blocks taken as positions are written
        return PagedCache(self._pool)


def test_an_automatic_checkpoint_of_a_paged_session_commits_its_own_copy_of_the_rows(model, tiny, tmp_path,
                                                                                   monkeypatch):
    """`state` copies a paged cache's rows out of the blocks, so the commit behind the caller takes
    those very tensors (no second copy); the blocks written over before it runs change nothing stored."""
    from kvstore import commit as commit_module

    handed, held, release = [], [], __import__("threading").Event()
    real_state, real_commit = PagedCache.state, commit_module.commit

    def recorded_state(self, *args, **kwargs):
        out = real_state(self, *args, **kwargs)
        handed.append(out)
        return out

    def held_commit(store_, session_id, name, head, change):
        if change.reason == "auto":
            held.append(change)
            assert release.wait(30), "the test never released the commit"
        return real_commit(store_, session_id, name, head, change)

    monkeypatch.setattr(PagedCache, "state", recorded_state)
    monkeypatch.setattr(commit_module, "commit", held_commit)
    pool = pool_for(model)
    store = kvstore.open_store(tmp_path / "home")
    with store.new("s", PagedModel(model, pool), seed=1, chunk_size=8, checkpoint_every=10 ** 6) as s:
        s.append_tokens(tiny("llama-gqa").ids(21))
        tokens = s.generate(20, stop_at_eos=False)
        for _ in range(6):  # six tokens decoded, none checkpointed yet
            next(tokens)
        committed = s.head.n_cached
        assert s.checkpoint("auto", wait=False)
        expected = real_state(s.seq.cache)  # every position, as the cache holds them now
        rows = s.seq.cache.rows(committed, s.seq.cache.length)  # the positions being committed
        for layer in range(pool.n_layers):  # written over in their blocks while the commit waits
            pool.flat(layer)[rows] = 7.0
        release.set()
        s.settle()
        assert held and held[0].kv_owned and held[0].kv is handed[-1]  # the rows of every layer, in one tensor
        tokens.close()  # its end checkpoint: nothing new to commit
    with store.open("s", model) as again:
        assert again.seq.cache.length == len(expected[0])
        assert all(torch.equal(a, b) for a, b in zip(again.seq.cache.state(), expected))
    store.close()


def test_sequences_growing_in_turns_take_blocks_in_runs_while_the_pool_has_room(model):
    """Sessions decoding in one step ask for a block each in turn: each gets RUN_BLOCKS of them next
    to each other (its cache read in runs, not in single blocks scattered over the pool), as long as a
    quarter of the pool stays free; then only the blocks asked for."""
    pool = pool_for(model, n_blocks=64)
    a, b = PagedCache(pool), PagedCache(pool)
    for end in range(1, 8 * pool.block_tokens + 1):  # one position more each, in turns
        a.reserve(end)
        b.reserve(end)
    for c in (a, b):
        assert len(c.table) == 8
        for r in range(0, 8, RUN_BLOCKS):
            assert c.table[r:r + RUN_BLOCKS] == list(range(c.table[r], c.table[r] + RUN_BLOCKS))
    a.release()
    again = PagedCache(pool, capacity=8 * pool.block_tokens)  # a's blocks, back in their order
    assert again.table == sorted(again.table)

    small = pool_for(model, n_blocks=8)
    got = [len(PagedCache(small, capacity=small.block_tokens).table) for _ in range(3)]
    assert got == [RUN_BLOCKS, 2, 1] and small.used == 7  # 2 of 8 stay free while blocks are spare


def test_a_full_pool_asks_for_room_then_says_what_to_do(model):
    pool = pool_for(model, n_blocks=4)
    freed = []
    holder = PagedCache(pool, capacity=3 * pool.block_tokens)

    def make_room(needed: int) -> None:
        freed.append(needed)
        holder.release()

    pool.on_full = make_room
    big = PagedCache(pool, capacity=4 * pool.block_tokens)  # needs 4, 1 free: holder is evicted
    assert freed == [3] and len(big.table) == 4
    with pytest.raises(PoolFull, match="in use.*--kv-memory"):
        PagedCache(pool, capacity=pool.block_tokens)
    with pytest.raises(PoolTooSmall, match="even alone"):
        PagedCache(pool, capacity=5 * pool.block_tokens)


def fed_together_and_alone(model, pool: BlockPool, tiny_model, lengths: list[int]):
    """Sequences of `lengths` tokens prefilled in chunks of 8, each into a paged cache of `pool` and a
    contiguous one; then their next tokens (8 for odd j, else 1) fed together through the paged caches
    (one `feed_rows`) and alone through the contiguous ones. (together `[n, hidden]`, alone
    `[hidden]` each, the paged caches, the contiguous ones)."""
    items, alone, flats = [], [], []
    for j, n in enumerate(lengths):
        ids = tiny_model.ids(n + 8, seed=j)
        paged, flat = PagedCache(pool), model.new_cache()
        for cache in (paged, flat):
            for a in range(0, n, 8):
                model.feed(ids[a:min(a + 8, n)], a, cache)
        new = ids[n:n + (8 if j % 2 else 1)]
        alone.append(model.feed(new, n, flat))
        items.append((new, n, paged))
        flats.append(flat)
    return model.feed_rows(items), alone, [paged for _, _, paged in items], flats


@pytest.mark.parametrize("company", [1, 3, 7])
def test_sequences_of_one_pool_fed_together_compute_as_each_alone(model, tiny, company):
    """A server's step: the sequences' rows in one forward, their attention in one kernel call over
    the shared pool (each row through its own block table); each gets the bits it gets alone."""
    together, alone, pageds, flats = fed_together_and_alone(model, pool_for(model, n_blocks=128), tiny("llama-gqa"),
                                                            [20, 3, 41, 9, 0, 64, 17, 30][:company + 1])
    for j, (hidden, paged, flat) in enumerate(zip(alone, pageds, flats)):
        assert torch.equal(together[j], hidden), j
        assert all(torch.equal(a, b) for a, b in zip(paged.state(), flat.state())), j


def test_a_fork_writing_into_a_shared_block_in_a_step_with_its_parent_copies_it_first(model, tiny):
    """In one batched step, a fork whose next position lies in a block it shares with its parent gets
    its own copy at the first layer, and every later layer writes there (the rows' slots are taken
    once per forward, after the first layer's writes): the parent's bytes stay as they were, and both
    get the bits they get alone."""
    ids = tiny("llama-gqa").ids(40)
    pool = pool_for(model)
    parent, flat_parent = PagedCache(pool), model.new_cache()
    run(model, parent, ids)  # 30 positions
    run(model, flat_parent, ids)
    child = parent.copy_prefix(20)
    child.trim(10)  # position 10 lies in block 0, shared with the parent
    flat_child = model.new_cache()
    flat_child.load(0, flat_parent.state(0, 10))
    shared = child.table[0]
    kept = [s.clone() for s in parent.state()]
    other = ids[33:36]  # the fork takes another way than the parent's tokens 10..12
    together = model.feed_rows([(ids[30:31], 30, parent), (other, 10, child)])
    assert child.table[0] != shared and parent.table[0] == shared
    assert torch.equal(together[0], model.feed(ids[30:31], 30, flat_parent))
    assert torch.equal(together[1], model.feed(other, 10, flat_child))
    assert all(torch.equal(a, b) for a, b in zip(parent.state(0, 30), kept))
    assert all(torch.equal(a, b) for a, b in zip(parent.state(), flat_parent.state()))
    assert all(torch.equal(a, b) for a, b in zip(child.state(), flat_child.state()))


def test_forks_restored_into_one_pool_share_their_documents_blocks(model, tiny, tmp_path):
    """Two forks of a document, opened from the store into one pool: the second takes the document's
    extents from the blocks the first read (no bytes read again, no blocks spent), with the bits of
    each opened alone; a write into a shared block leaves the other fork's bytes alone."""
    from kvstore.store.extents import load_into, session_extents

    m = tiny("llama-gqa")
    store = kvstore.open_store(tmp_path / "home")
    with store.new("doc", model, seed=1, chunk_size=16) as s:
        s.append_tokens(m.ids(64))
    for name, seed in (("a", 2), ("b", 3)):
        store.fork("doc", name)
        with store.open(name, model) as s:
            s.append_tokens(m.ids(9, seed=seed))
    pool = pool_for(model)

    def restored(name):
        with store.db() as db:
            refs = session_extents(db, store.row(db, name).id)
        cache = PagedCache(pool)
        load_into(cache, refs, store.home, session=name)
        with store.open(name, model) as s:
            assert all(torch.equal(x, y) for x, y in zip(cache.state(), s.seq.cache.state())), name
        return cache

    a = restored("a")
    used = pool.used
    b = restored("b")
    assert b.table[:4] == a.table[:4]  # the document's 64 positions: 4 blocks, shared
    assert pool.used == used + len(b.table) - 4 and len(b.table) > 4  # b's own 9 positions: blocks past them new
    kept = [x.clone() for x in a.state()]
    b.trim(30)
    model.forward(m.ids(1, seed=9), 30, b)  # into a shared block: b gets its own copy
    assert b.table[1] != a.table[1] and all(torch.equal(x, y) for x, y in zip(a.state(), kept))
    store.close()


@pytest.mark.parametrize("reported", [False, True])
def test_a_large_pool_sits_on_huge_pages_unless_free_pages_go_back_to_a_host(monkeypatch, reported):
    """A server-sized pool's layers start on huge pages (fewer TLB misses), except where a virtio
    balloon reports free pages to the host: there a fresh huge page faults slowly, and a step whose
    sequences crossed into new ones in every layer at once stalled for 0.6 s. The kernel says which
    mappings may take huge pages, where it says; blocks hold their rows either way."""
    from kvstore.engine import buffers

    monkeypatch.setattr(buffers, "free_pages_reported", lambda: reported)
    pool = BlockPool(2, 3, 64, dtype=torch.bfloat16, n_blocks=512)  # 3 MiB a layer
    cache = PagedCache(pool)
    rows = torch.randn(40, 2, 3, 64).to(torch.bfloat16)
    for layer in range(2):
        cache.put(layer, 0, rows)
    assert all(torch.equal(s, rows) for s in cache.state())
    if not reported and buffers.huge_pages(buffers.HUGE_PAGE) is None:
        pytest.skip("no transparent huge pages on this system")
    eligible = [thp_eligible(t.data_ptr()) for t in pool.layers]
    if None in eligible:
        pytest.skip("the kernel does not say which mappings may take huge pages (/proc/self/smaps)")
    assert eligible == [not reported, not reported]


def test_free_page_reporting_is_read_from_the_balloons_feature_bits(monkeypatch, tmp_path):
    from kvstore import pages

    monkeypatch.setattr(pages, "BALLOONS", tmp_path)
    for features, expected in [(None, False), ("0110000100", False), ("0110010100", True), ("011", False)]:
        pages.free_pages_reported.cache_clear()
        if features is not None:
            (tmp_path / "virtio3").mkdir(exist_ok=True)
            (tmp_path / "virtio3" / "features").write_text(features + "\n")
        assert pages.free_pages_reported() is expected, features
    pages.free_pages_reported.cache_clear()
