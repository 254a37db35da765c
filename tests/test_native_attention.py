"""The native attention over a paged KV cache (`native.attention()`, attention.cpp's
`attention_rows`): close to SDPA, and bits that depend on a row's own query, K/V and length alone
(torch.equal) whatever else changes: the other rows of the call (1, 3 or 7 of other lengths, decode
and prefill rows mixed), the thread count, the block size, the pool's size, where the blocks sit,
and whether a prefill runs in one call, in chunks or one position at a time. Slots past a
sequence's length and table entries past its blocks hold NaN and -1: never read. Bad input is
refused with a message that names it. Skips where this process has no native attention."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from kvstore.engine import native
from native_paths import on_path, require_both

pytestmark = pytest.mark.skipif(native.attention() is None, reason=f"no native attention: {native._attention[1]}")


def attention_rows(*args):
    return native.attention()(*args)


def sequences(lengths, n_kv=3, hd=64, seed=0):
    """K/V rows `[L, 2, n_kv, hd]` (bfloat16) of one sequence per length."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 2, n_kv, hd, generator=g).to(torch.bfloat16) for n in lengths]


def paged(seqs, block=256, spare=0, shuffle=None, width=None):
    """The sequences laid into one pool of `block`-token blocks: (pool, tables). `spare` unused blocks,
    blocks in a shuffled order (a seed) or in order, tables `width` entries wide (-1 past a sequence's
    blocks); free slots hold NaN."""
    counts = [math.ceil(s.shape[0] / block) for s in seqs]
    n_blocks = sum(counts) + spare
    where = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(shuffle)) if shuffle is not None \
        else torch.arange(n_blocks)
    pool = torch.full((n_blocks, block, *seqs[0].shape[1:]), float("nan"), dtype=torch.bfloat16)
    tables = torch.full((len(seqs), width or max(counts)), -1, dtype=torch.int32)
    taken = 0
    for i, s in enumerate(seqs):
        for b in range(counts[i]):
            rows = s[b * block:(b + 1) * block]
            pool[where[taken], :rows.shape[0]] = rows
            tables[i, b] = int(where[taken])
            taken += 1
    return pool, tables


def queries(n, n_heads=9, hd=64, seed=1):
    return torch.randn(n, n_heads, hd, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def run(q, pool, tables, seq, lens):
    return attention_rows(q, pool, tables, torch.tensor(seq, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32))


def sdpa(q, seqs, seq, lens):
    """Each row through SDPA in float32 (grouped-query heads, default scale)."""
    out = []
    for r in range(q.shape[0]):
        kv = seqs[seq[r]][:lens[r]].float()
        k, v = kv[:, 0].transpose(0, 1)[None], kv[:, 1].transpose(0, 1)[None]  # [1, n_kv, L, hd]
        out.append(F.scaled_dot_product_attention(q[r].float()[None, :, None], k, v, enable_gqa=True)[0, :, 0])
    return torch.stack(out)


@pytest.mark.parametrize("n_heads,n_kv,hd", [(9, 3, 64), (4, 4, 16), (8, 2, 32), (4, 1, 128), (12, 1, 48)])
def test_rows_are_sdpa_over_each_rows_positions(n_heads, n_kv, hd):
    lens = [1, 15, 16, 17, 255, 256, 257, 700, 1000]
    seqs = sequences([1000, 300], n_kv, hd)
    seq = [0] * 7 + [1, 0]
    lens = [min(n, seqs[s].shape[0]) for n, s in zip(lens, seq)]
    q = queries(len(lens), n_heads, hd)
    pool, tables = paged(seqs, block=32, spare=3, shuffle=4)
    out = run(q, pool, tables, seq, lens)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert_close(out.float(), sdpa(q, seqs, seq, lens), rtol=2e-2, atol=2e-2)


def test_a_prefill_chunk_is_causal_rows():
    seqs = sequences([600])
    pos, T = 500, 100
    q = queries(T)
    out = run(q, *paged(seqs), [0] * T, list(range(pos + 1, pos + T + 1)))
    mask = torch.full((T, pos + T), float("-inf")).triu_(pos + 1)
    kv = seqs[0].float()
    k, v = kv[:, 0].transpose(0, 1)[None], kv[:, 1].transpose(0, 1)[None]
    expected = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], k, v, attn_mask=mask, enable_gqa=True)
    assert_close(out.float(), expected[0].transpose(0, 1), rtol=2e-2, atol=2e-2)


def test_weights_in_bfloat16_keep_the_error_of_the_outputs_rounding():
    """The softmax weights go to the values rounded to bfloat16: against float64 the error stays
    that of rounding the output itself to bfloat16 (at most 2^-8 of the largest output here), decode
    rows and a prefill chunk alike."""
    seqs = [s * 3 for s in sequences([2000, 700], seed=5)]
    q = queries(40, seed=6) * 2
    seq, lens = [0] * 30 + [1] * 10, [*range(1971, 2001), 1, 2, 3, 16, 17, 255, 300, 511, 699, 700]
    out = run(q, *paged(seqs, block=64, shuffle=2), seq, lens).double()
    for r in range(len(seq)):
        kv = seqs[seq[r]][:lens[r]].double()
        for h in range(9):
            k, v = kv[:, 0, h // 3], kv[:, 1, h // 3]
            expected = torch.softmax(k @ q[r, h].double() / 8, 0) @ v
            assert (out[r, h] - expected).abs().max() <= 2 ** -8 * expected.abs().max(), (r, h)


LENGTHS = [3000, 1, 17, 256, 513, 900, 2048, 40]  # the row under test first, then others


@pytest.mark.parametrize("others", [0, 1, 3, 7])
def test_a_rows_bits_do_not_depend_on_the_other_rows(others):
    seqs = sequences(LENGTHS)
    pool, tables = paged(seqs, block=16, shuffle=0)
    q = queries(1 + others + 5, seed=2)
    alone = run(q[:1], pool, tables, [0], [3000])
    # the row among decode rows of other sequences, and after a prefill chunk of another (sequence 5)
    seq = [5] * 5 + list(range(1 + others))
    lens = list(range(896, 901)) + LENGTHS[:1 + others]
    mixed = run(torch.cat([q[1 + others:], q[:1 + others]]), pool, tables, seq, lens)
    assert torch.equal(mixed[5], alone[0])
    # and each of the others as it would come alone
    for i in range(1, 1 + others):
        assert torch.equal(mixed[5 + i], run(q[i:i + 1], pool, tables, [i], [LENGTHS[i]])[0])


def forks(prefix, tails, block=16):
    """Sequences prefix[:n] + tail (n, tail in `tails`) in one pool, as forks of one document hold it:
    the prefix's whole blocks once, shared by every table; each sequence's partial block and tail in
    blocks of its own. (pool, tables, the sequences)."""
    seqs = [torch.cat([prefix[:n], t]) for n, t in tails]
    own = [math.ceil((s.shape[0] - n // block * block) / block) for s, (n, _) in zip(seqs, tails)]
    shared = max(n for n, _ in tails) // block
    pool = torch.full((shared + sum(own), block, *prefix.shape[1:]), float("nan"), dtype=torch.bfloat16)
    pool[:shared] = prefix[:shared * block].view(shared, block, *prefix.shape[1:])
    tables = torch.full((len(seqs), max(n // block + o for (n, _), o in zip(tails, own))), -1, dtype=torch.int32)
    at = shared
    for i, (s, (n, _)) in enumerate(zip(seqs, tails)):
        first = n // block
        tables[i, :first] = torch.arange(first)
        for b in range(first, first + own[i]):
            rows = s[b * block:(b + 1) * block]
            pool[at, :rows.shape[0]] = rows
            tables[i, b] = at
            at += 1
    return pool, tables, seqs


def test_sequences_that_share_blocks_keep_each_rows_bits():
    """Forks of one document decoding in one call (a step of sessions that share a prefix in the KV
    pool): the partitions whose blocks they share are read once for all of them, and each row keeps
    the bits it gets alone over its own copy. Twelve sequences (more than one unit's rows), one that
    shares only the document's first 512 positions, one with a two-row chunk, one too short to share."""
    doc = sequences([1100], seed=7)[0]
    tails = [(1100, t) for t in sequences([40, 700, 5, 300, 1, 90, 64, 33, 500, 12], seed=8)]
    tails += [(512, sequences([900], seed=9)[0]), (200, sequences([30], seed=10)[0])]
    pool, tables, seqs = forks(doc, tails)
    seq = list(range(len(seqs))) + [1]  # sequence 1 also has the row before its last: a chunk of two
    lens = [s.shape[0] for s in seqs] + [seqs[1].shape[0] - 1]
    order = sorted(range(len(seq)), key=lambda r: (seq[r], lens[r]))  # a sequence's rows next to each other
    seq, lens = [seq[r] for r in order], [lens[r] for r in order]
    q = queries(len(seq), seed=11)
    together = run(q, pool, tables, seq, lens)
    own_pool, own_tables = paged(seqs, block=16, shuffle=3)
    for r in range(len(seq)):
        assert torch.equal(together[r], run(q[r:r + 1], own_pool, own_tables, [seq[r]], [lens[r]])[0]), r
    assert torch.equal(run(q, own_pool, own_tables, seq, lens), together)  # the same call, nothing shared


def test_bits_do_not_depend_on_block_size_pool_size_or_where_blocks_sit():
    seqs = sequences([2100, 700])
    q, seq, lens = queries(4, seed=3), [0, 1, 0, 0], [2100, 700, 1, 1500]
    first = run(q, *paged(seqs, block=256), seq, lens)
    for layout in (dict(block=16), dict(block=32, shuffle=1), dict(block=256, spare=9, shuffle=2, width=40),
                   dict(block=512, spare=1)):
        assert torch.equal(run(q, *paged(seqs, **layout), seq, lens), first), layout


def test_bits_do_not_depend_on_the_thread_count():
    """Nor on how a long row's partitions are cut into units: 5,000 positions (20 partitions) go in
    runs of 5 on one thread, of 2 on two, one by one on three."""
    seqs = sequences([5000, 300])
    pool, tables = paged(seqs, block=64, shuffle=5)
    q, seq, lens = queries(3, seed=4), [0, 1, 0], [5000, 300, 4097]
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(run(q, pool, tables, seq, lens))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_prefill_in_one_call_in_chunks_or_by_positions_is_the_same():
    seqs = sequences([1200])
    pool, tables = paged(seqs, block=16, shuffle=6)
    T = 1200
    q = queries(T, seed=5)
    lens = list(range(1, T + 1))
    whole = run(q, pool, tables, [0] * T, lens)
    chunks = torch.cat([run(q[s:s + 512], pool, tables, [0] * len(lens[s:s + 512]), lens[s:s + 512])
                        for s in range(0, T, 512)])
    assert torch.equal(chunks, whole)
    for p in (0, 15, 16, 255, 256, 511, 1199):  # a decode step at position p
        assert torch.equal(run(q[p:p + 1], pool, tables, [0], [p + 1])[0], whole[p])


def subnormal_heavy(seqs, q):
    """K, V and queries where subnormal float32 values arise: V's first 8 dimensions subnormal in
    bfloat16 (vdpbf16ps reads them as 0), K's and the queries' next 8 around 1e-20 (their products
    subnormal in float32), some of V large."""
    g = torch.Generator().manual_seed(11)
    out = []
    for s in seqs:
        s = s.float()
        s[:, 1, :, :8] = torch.randn(s.shape[0], s.shape[2], 8, generator=g) * 1e-39
        s[:, 0, :, 8:16] = torch.randn(s.shape[0], s.shape[2], 8, generator=g) * 1e-20
        s[::7, 1, :, 16:20] *= 1e30
        out.append(s.to(torch.bfloat16))
    q = q.float()
    q[..., 8:16] = torch.randn(*q.shape[:-1], 8, generator=g) * 1e-20
    return out, q.to(torch.bfloat16)


def test_bfloat16_dot_products_equal_fused_multiply_adds():
    """The scores and weighted values by vdpbf16ps (AVX512-BF16) and by float32 fused multiply-adds in
    the same order (the way of CPUs without it, and of Intel's, where it is faster) agree bit for bit,
    subnormal values and products included: the kernel reads and writes subnormals as 0, as vdpbf16ps
    does. Without that the subnormal V values here would reach the output. On CPUs without
    AVX512-BF16, the multiply-adds' side is checked alone."""
    dot = torch.ops.kvstore.attention_dot_bf16
    before = dot(True)
    has_bf16 = dot(True)  # the setting before this call: whether the first one took
    try:
        for subnormal in (False, True):
            seqs = sequences([1500, 40])
            q, seq, lens = queries(6, seed=7), [0, 0, 0, 1, 0, 0], [1500, 1, 700, 40, 1499, 1498]
            if subnormal:
                seqs, q = subnormal_heavy(seqs, q)
            pool, tables = paged(seqs, block=32, shuffle=8)
            dot(False)
            fma = run(q, pool, tables, seq, lens)
            if subnormal:  # the V dimensions read as 0: their outputs are 0, not subnormal
                assert torch.equal(fma[..., :8], torch.zeros_like(fma[..., :8]))
            if has_bf16:
                dot(True)
                assert torch.equal(run(q, pool, tables, seq, lens), fma), subnormal
    finally:
        dot(before)


@pytest.mark.parametrize("hd", [16, 32, 64, 128])
def test_the_avx2_steps_give_the_avx512_steps_bits(hd):
    """What a CPU with AVX2 alone runs (attention_steps_avx2.h), run here beside the AVX512 steps: the
    same bits for prefill chunks (K and V laid out once), decode rows (V read from the rows, every head
    scored at once), forks sharing blocks and subnormal values, against vdpbf16ps and against the
    AVX512 multiply-adds. Skips where the CPU has no AVX512 to compare with."""
    require_both("attention")
    dot = torch.ops.kvstore.attention_dot_bf16
    seqs = sequences([1500, 40, 300], hd=hd)
    q = queries(9, hd=hd, seed=7)
    if hd >= 32:  # (subnormal_heavy writes dimensions 0..19)
        seqs, q = subnormal_heavy(seqs, q)
    seq, lens = [0, 0, 0, 1, 0, 0, 2, 2, 1], [1500, 1, 700, 40, 1499, 1498, 300, 17, 33]
    pool, tables = paged(seqs, block=32, shuffle=8)
    doc = sequences([600], hd=hd, seed=12)[0]
    shared = forks(doc, [(600, t) for t in sequences([20, 3, 70], hd=hd, seed=13)])
    shared_q = queries(3, hd=hd, seed=14)

    def every_case():
        rows = [run(q[r:r + 1], pool, tables, [seq[r]], [lens[r]]) for r in range(len(seq))]  # decode rows alone
        return [run(q, pool, tables, seq, lens), *rows,
                run(shared_q, shared[0], shared[1], [0, 1, 2], [s.shape[0] for s in shared[2]])]

    before = dot(True)
    try:
        avx512 = {True: every_case()}
        dot(False)
        avx512[False] = every_case()
        with on_path("attention", "avx2"):
            avx2 = every_case()
    finally:
        dot(before)
    for way, outs in avx512.items():
        assert all(torch.equal(a, b) for a, b in zip(avx2, outs)), f"vdpbf16ps: {way}"
    assert torch.ops.kvstore.attention_isa() == "avx512"  # put back


def test_paths_the_cpu_lacks_or_that_do_not_exist_are_refused():
    isa = torch.ops.kvstore.attention_isa
    with pytest.raises(RuntimeError, match=re.escape("attention_isa: no path named 'sse4' (avx512, avx2, or '' for this CPU's best)")):
        isa("sse4")
    if isa() != "avx512":
        with pytest.raises(RuntimeError, match="this CPU lacks the avx512 path"):
            isa("avx512")
    assert isa() in ("avx512", "avx2")


def test_the_contiguous_cache_is_one_sequence_of_blocks_in_order():
    """A KVCache layer `[capacity, 2, n_kv, hd]` viewed as blocks of 256 with the table 0, 1, 2, ...:
    the bits of a row do not depend on the capacity."""
    from kvstore.engine.cache import KVCache

    rows = sequences([700])[0]
    q = queries(1, seed=6)
    out = []
    for capacity in (768, 4096):
        cache = KVCache(1, 3, 64, dtype=torch.bfloat16, capacity=capacity)
        cache.load(0, [rows])
        pool, table = cache.blocks(0)
        assert pool.shape == (capacity // 256, 256, 2, 3, 64) and table.tolist() == [list(range(capacity // 256))]
        out.append(run(q, pool, table, [0], [700]))
    assert torch.equal(out[0], out[1])
    assert torch.equal(out[0], run(q, *paged([rows], block=16, shuffle=7), [0], [700]))


def test_bad_input_is_refused_with_a_clear_error():
    seqs = sequences([100])
    pool, tables = paged(seqs, block=32)  # 4 blocks
    q = queries(1)
    one, seq, length = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), torch.tensor([100], dtype=torch.int32)
    cases = [
        ((q.float(), pool, tables, seq, length), "q must be a BFloat16 CPU tensor"),
        ((q, pool.float(), tables, seq, length), "the pool must be a BFloat16"),
        ((q, pool, tables.long(), seq, length), "the block tables must be a Int"),
        ((q[0], pool, tables, seq, length), "q must be a BFloat16 CPU tensor with 3 dimension"),
        ((q[..., :32], pool, tables, seq, length), "for queries of 32 dimensions"),
        ((queries(1, n_heads=8), pool, tables, seq, length), "8 query heads cannot share 3 KV heads"),
        ((q, pool, tables, seq, torch.tensor([129], dtype=torch.int32)), "attends to 129 positions; its table holds 1..128"),
        ((q, pool, tables, seq, torch.tensor([0], dtype=torch.int32)), "attends to 0 positions"),
        ((q, pool, tables, one + 1, length), "names sequence 1 of 1"),
        ((q, pool, tables, torch.zeros(2, dtype=torch.int32), length), "must hold 1 rows"),
        ((q, pool[:2], tables, seq, length), "block 2 is 2, outside the pool's 2 blocks"),
        ((q, pool.view(8, 16, 2, 3, 64)[:, :8], tables, seq, length), "the pool must be contiguous"),
        ((q, torch.zeros(4, 24, 2, 3, 64, dtype=torch.bfloat16), tables, seq, length), "block_tokens must be a multiple of 16"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=re.escape(message)):
            attention_rows(*args)


def test_native_attention_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(native, "_attention", None)
    monkeypatch.setenv(native.ENV, "0")
    assert native.attention() is None
    assert native._attention[1] == "torch's kernels (KVSTORE_NATIVE=0)"


def test_a_decode_step_reads_the_cache_through_the_kernel():
    """`attend` of one query over a bfloat16 cache is the kernel over the cache's block view (close to
    torch's `one_query`); a float32 cache takes `one_query`."""
    from kvstore.engine.attention import ONE_TOKEN, attend, native_rows, one_query
    from kvstore.engine.cache import KVCache

    rows = sequences([301])[0]
    q = queries(1, seed=9)
    cache = KVCache(2, 3, 64, dtype=torch.bfloat16, capacity=512)
    cache.load(0, [rows[:300], rows[:300]])
    out = attend(q, rows[300:], cache, 1, 300, ONE_TOKEN)  # [1, 9 * 64]
    assert torch.equal(out.view(1, 9, 64), run(q, *cache.blocks(1), [0], [301]))
    k, v = cache.layers[1][:301, 0].transpose(0, 1), cache.layers[1][:301, 1].transpose(0, 1)
    assert_close(out.view(9, 64).float(), one_query(q[0], k, v).float(), rtol=2e-2, atol=2e-2)
    assert native_rows(q.float(), KVCache(1, 3, 64, dtype=torch.float32)) is None


def test_a_models_prefill_and_decode_steps_take_the_kernel(tiny, monkeypatch):
    import kvstore

    model = kvstore.load_model(tiny("llama-gqa").folder, dtype="bfloat16")
    ids = tiny("llama-gqa").ids(24)
    calls = []
    kernel = native.attention()
    monkeypatch.setattr(native, "_attention", (lambda *a: calls.append(a[4].tolist()) or kernel(*a), "counted"))
    cache = model.new_cache()
    model.forward(ids[:20], 0, cache)
    steps = torch.cat([model.forward(ids[p:p + 1], p, cache) for p in range(20, 24)])
    n = model.config.n_layers
    assert calls == [list(range(1, 21))] * n + [[length] for length in range(21, 25) for _ in range(n)]
    monkeypatch.setattr(native, "_attention", (None, "torch (test)"))
    cache = model.new_cache()
    model.forward(ids[:20], 0, cache)
    torch_steps = torch.cat([model.forward(ids[p:p + 1], p, cache) for p in range(20, 24)])
    assert_close(steps, torch_steps, rtol=0.05, atol=0.15)  # as test_native allows the bfloat16 kernels vs torch's
