"""Attention over the KV cache, shared by every architecture: one mask builder, one `attend`.

Queries arrive token-major (`[T, heads, head_dim]`) and keys and values as cache rows
(`[T, 2 (K, V), kv_heads, head_dim]`), the layouts the projections produce and the cache stores.
`attend` writes the rows into the cache (`put`, the one write path) and attends over positions
0..pos+T-1, choosing in one place:
- the native kernel (`native.attention()`: the attention of query rows over a paged cache, read in
  place through the cache's block table) for bfloat16 caches on CPUs that run it, for every row, a
  decode step's or a prefill chunk's (`native_rows` says where it applies);
- elsewhere (float32 and float16 caches, other CPUs, KVSTORE_NATIVE=0, shapes the kernel does not
  take, a forward without a cache) `one_query` (torch, float32) for a single query on the CPU and
  `F.scaled_dot_product_attention` for chunks, whose mask (and kernel) depends on (pos, T) alone.
The choice depends on the dtype, the shapes and the process's settled choice alone; the paths round
differently.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from . import native
from .cache import KVCache

Mask = tuple["torch.Tensor | None", bool]  # (additive mask or None, is_causal)
ONE_TOKEN: Mask = (None, False)  # a single query attends to every cached position: no mask


def causal_mask(pos: int, T: int, dtype: torch.dtype, device) -> Mask:
    """(additive mask, is_causal) for queries at pos..pos+T-1 over keys 0..pos+T-1.

    A float mask (0 / -inf) goes straight into the attention kernel; a boolean one would be converted
    again in every layer."""
    if T == 1:
        return ONE_TOKEN
    if pos == 0:
        return None, True
    return torch.full((T, pos + T), float("-inf"), dtype=dtype, device=device).triu_(pos + 1), False


def attend(q: torch.Tensor, kv: torch.Tensor, cache: KVCache | None, layer: int, pos: int, mask: Mask) -> torch.Tensor:
    """q `[T, n_heads, hd]`, kv `[T, 2, n_kv_heads, hd]` (cache rows) -> attention output `[T, n_heads * hd]`.

    Where the native kernel takes this cache (`native_rows`), every query row, a decode step's or a
    prefill chunk's, goes through it, reading the cache in place through its block table: each row's
    bits then depend on its own query and the K/V before it alone, so a token computes alike in a
    chunk of any size or alone (the model's `row_invariant`), and it is faster than SDPA here."""
    T, n_heads, hd = q.shape
    kernel = native_rows(q, cache)
    if kernel is not None:
        cache.put(layer, pos, kv)
        pool, table = cache.blocks(layer)
        return kernel(q, pool, table, one_sequence(T), positions_after(pos, T)).view(T, n_heads * hd)
    if cache is not None:
        k_all, v_all = cache.write(layer, pos, kv)  # [1, n_kv, pos+T, hd] each
    else:
        assert pos == 0, "without a cache, a forward starts at position 0"
        k_all, v_all = kv.permute(1, 2, 0, 3).unbind(0)  # [n_kv, T, hd] each
        k_all, v_all = k_all.unsqueeze(0), v_all.unsqueeze(0)
    if T == 1 and q.device.type == "cpu":
        return one_query(q[0], k_all[0], v_all[0]).view(1, n_heads * hd)
    o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k_all, v_all, attn_mask=mask[0],
                                       is_causal=mask[1], enable_gqa=k_all.shape[1] != n_heads)
    return o[0].transpose(0, 1).reshape(T, n_heads * hd)  # [1, n_heads, T, hd] -> [T, n_heads hd]


class Batch:
    """The items of one forward (`rows.Item`s, their `Span`s) as attention sees them in every layer:
    each item's causal mask (made when first needed: the native kernel needs none) and, where the
    native kernel reads their caches in one shared paged pool (a server's), what its call takes
    besides q, made once per forward at its first layer (after that layer's writes have given every
    item its blocks): the block tables `[S, width]`, each row's sequence and length, and each new
    row's slot in the pool. Every later layer then writes all the
    items' K/V rows with one copy and calls the kernel with the same tensors, instead of doing that
    work per item and per layer (8 sessions of 512 tokens: 6 of a step's 22 ms, AMD EPYC Zen 3)."""

    def __init__(self, items, spans, dtype: torch.dtype, device):
        self.items, self.spans, self.dtype, self.device = items, spans, dtype, device
        self._masks: list[Mask] | None = None
        self.kernel_args: tuple[torch.Tensor, ...] | None = None  # (slots, table, row_seq, row_len)
        self._shared: tuple | None | bool = False  # shared_pool's answer (False: not asked yet)

    @property
    def masks(self) -> list[Mask]:
        if self._masks is None:
            self._masks = [causal_mask(it.pos, s.rows, self.dtype, self.device) for it, s in zip(self.items, self.spans)]
        return self._masks

    def shared_pool(self, q: torch.Tensor):
        """(the native kernel, the pool) where every item's cache lies in one paged pool the kernel
        reads, else None (items go one by one). The same for every layer: asked once."""
        if self._shared is False:
            self._shared = self._find_shared(q)
        return self._shared

    def _find_shared(self, q: torch.Tensor):
        caches = [it.cache for it in self.items]
        pool = getattr(caches[0], "pool", None)
        kernel = native_rows(q, caches[0]) if len(self.items) > 1 and pool is not None else None
        if kernel is None or any(getattr(c, "pool", None) is not pool for c in caches):
            return None
        return kernel, pool

    def put(self, layer: int, kv: torch.Tensor, pool, last_layer: bool) -> tuple[torch.Tensor, ...]:
        """Write every item's K/V rows of `layer` (kv `[R, 2, n_kv, hd]`) into its blocks; the kernel's
        (table, row_seq, row_len). The first and last layers go through each cache's `put` (the first
        takes and unshares blocks, the last makes the positions valid), the others in one copy."""
        if self.kernel_args is None or last_layer:
            for it, s in zip(self.items, self.spans):
                it.cache.put(layer, it.pos, kv[s.start:s.end])
        else:
            pool.flat(layer).index_copy_(0, self.kernel_args[0], kv)
        if self.kernel_args is None:
            self.kernel_args = self._kernel_args()
        return self.kernel_args[1:]

    def _kernel_args(self, slots: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        caches = [it.cache for it in self.items]
        if slots is None:
            slots = torch.cat([c.rows(it.pos, it.pos + s.rows) for c, it, s in zip(caches, self.items, self.spans)])
        tables = [c.table for c in caches]
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)  # [S, width]
        row_seq = torch.repeat_interleave(torch.arange(len(caches), dtype=torch.int32),
                                          torch.tensor([s.rows for s in self.spans]))
        row_len = torch.cat([positions_after(it.pos, s.rows) for it, s in zip(self.items, self.spans)])
        return slots, table, row_seq, row_len

    def layer_args(self, n_heads: int) -> tuple | None:
        """For a forward that runs its whole layer stack in one native call (`native.layers()`): every
        item's new positions claimed in its cache (`claim`), and what the call reads the caches with:
        (each layer's pool, each row's slot `[R]`, the block tables `[S, width]`, row_seq `[R]`, row_len
        `[R]`); after the call, `written()`. None where the native attention does not read these
        caches (then the layers run one by one): one item's cache, or every item's in one paged pool."""
        caches = [it.cache for it in self.items]
        if any(c is None for c in caches) or native_for(caches[0], n_heads) is None:
            return None
        if len(caches) == 1:
            (it,), (s,) = self.items, self.spans
            slots = it.cache.claim(it.pos, it.pos + s.rows)
            return it.cache.pools(), slots, it.cache.blocks(0)[1], one_sequence(s.rows), positions_after(it.pos, s.rows)
        pool = getattr(caches[0], "pool", None)
        if pool is None or any(getattr(c, "pool", None) is not pool for c in caches):
            return None
        slots = torch.cat([c.claim(it.pos, it.pos + s.rows) for c, it, s in zip(caches, self.items, self.spans)])
        _, table, row_seq, row_len = self._kernel_args(slots)
        return pool.layers, slots, table, row_seq, row_len

    def written(self) -> None:
        """Every item's new positions hold K/V in every layer (what the last layer's `put` says)."""
        for it, s in zip(self.items, self.spans):
            it.cache.length = it.pos + s.rows


def attend_items(q: torch.Tensor, kv: torch.Tensor, batch: Batch, layer: int, n_layers: int) -> torch.Tensor:
    """`attend` for the stacked rows of several sequences (a `Batch`): q `[R, n_heads, hd]`, kv `[R, 2,
    n_kv, hd]` -> `[R, n_heads * hd]`. Sequences whose caches share one paged pool (a server's) go
    through the native kernel in one call, each row through its own sequence's block table, which
    gives each row the bits of its sequence's own call; others, one by one."""
    shared = batch.shared_pool(q)
    if shared is None:
        parts = [attend(q[s.start:s.end], kv[s.start:s.end], it.cache, layer, it.pos, m)
                 for it, s, m in zip(batch.items, batch.spans, batch.masks)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)
    kernel, pool = shared
    table, row_seq, row_len = batch.put(layer, kv, pool, layer == n_layers - 1)
    return kernel(q, pool.layers[layer], table, row_seq, row_len).view(q.shape[0], -1)


@lru_cache(maxsize=8)
def one_sequence(T: int) -> torch.Tensor:
    """row_seq of T rows of the one sequence of a cache's block view: int32 zeros `[T]`. Cached: every
    layer of a forward asks for the same one (read only: never write into it)."""
    with torch.inference_mode(False):
        return torch.zeros(T, dtype=torch.int32)


@lru_cache(maxsize=8)
def positions_after(pos: int, T: int) -> torch.Tensor:
    """row_len of queries at pos..pos+T-1 (causal): pos+1..pos+T, int32 `[T]`. Cached like
    `one_sequence` (read only)."""
    with torch.inference_mode(False):
        return torch.arange(pos + 1, pos + T + 1, dtype=torch.int32)


NATIVE_MAX_GROUP = 24  # query heads per KV head the native kernel takes (native/attention_rows.h's kTileQueries)


def native_rows(q: torch.Tensor, cache: KVCache | None):
    """The native kernel where it takes these queries over this cache (bfloat16 on the CPU, head
    dimension a multiple of 16, at most NATIVE_MAX_GROUP query heads per KV head), else None."""
    if q.dtype is not torch.bfloat16 or q.device.type != "cpu":
        return None
    return native_for(cache, q.shape[1])


def native_for(cache: KVCache | None, n_heads: int):
    """`native_rows` for bfloat16 CPU queries of n_heads heads."""
    if cache is None or cache.dtype is not torch.bfloat16 or cache.device.type != "cpu":
        return None
    if cache.head_dim % 16 or n_heads % cache.n_kv_heads or n_heads // cache.n_kv_heads > NATIVE_MAX_GROUP:
        return None
    return native.attention()


def one_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A decode step's attention on the CPU: q `[n_heads, hd]`, k and v `[n_kv_heads, L, hd]` ->
    `[n_heads, hd]`, in float32 (scores, softmax, weighted sum), query head h reading KV head
    h // (n_heads / n_kv_heads) as SDPA's grouped-query mode does. For one query this is several
    times faster than SDPA's flash kernel on the CPU, which made most of a decode step at long
    contexts; it depends on the positions' K/V only (not on the cache's capacity)."""
    n_kv, _, hd = k.shape
    grouped = q.view(n_kv, -1, hd).float()  # [n_kv, group, hd]
    scores = torch.bmm(grouped, k.float().transpose(1, 2)).mul_(hd ** -0.5)  # [n_kv, group, L]
    out = torch.bmm(torch.softmax(scores, dim=-1), v.float())  # [n_kv, group, hd]
    return out.to(q.dtype).view(-1, hd)
