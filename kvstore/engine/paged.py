"""Paged KV memory: many sequences' caches in fixed-size blocks of one pool (vLLM's PagedAttention
layout, on the CPU), under a memory budget.

- `BlockPool(model shape, n_blocks, block_tokens)`: per layer one tensor `[n_blocks, block_tokens,
  2, n_kv_heads, head_dim]`; blocks are handed out and reference-counted (forks share the blocks of
  their common prefix). When too few are free, `on_full(needed)` is asked to free some (a server
  evicts idle sessions: they are checkpointed, eviction writes nothing); if it cannot, `PoolFull`.
- `PagedCache(pool)`: one sequence's cache through its block table (position p lives in block
  `table[p // block_tokens]`, slot `p % block_tokens`), speaking KVCache's protocol (`write`,
  `reserve`, `filling`, `load`, `state`, `trim`, `release`, `length`), so a session, the store's
  restore and the model use it as they use a `KVCache`. `copy_prefix(n)` is a fork's cache: the
  full blocks of the first n positions shared, the partial one copied. Sequences restored from the
  same stored extents (forks of one document) share those extents' blocks too: the pool remembers
  which blocks hold which extent's rows as read from disk (`register_extents`), and a restore takes
  them instead of reading them again (`adopt_extents`). A write into a shared block copies it first,
  and a write into a block that held an extent's rows makes it forget them (a trimmed position fed
  again must not change another sequence's bytes).

Paging changes no bit: attention reads exactly the rows a contiguous cache holds, in the same
layout (`gather`: `[L, 2, n_kv, hd]`, the strides of `KVCache.layers[i][:L]`), and the native
attention kernel reads them in place through the block table (`blocks`).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Callable, Iterator

import numpy as np
import torch

from ..errors import PoolFull, PoolTooSmall
from .buffers import bytes_of, lasting_pages
from .cache import POOL, populate_rows

BLOCK_TOKENS = 16  # positions per block: a multiple of the attention kernel's key group
# A sequence takes its blocks in runs of this many, next to each other in the pool, while the pool has
# room to spare (a quarter of it stays free): sessions decoding in one step would otherwise take turns
# at the free blocks, one block each, and each read its cache in 16-position pieces scattered over the
# pool. A batched decode step of 8 sessions at 512 positions (AMD EPYC Zen 4): with blocks taken one at
# a time in turns, 1.09-1.11x the time of contiguous caches, in runs of 4 blocks 1.02-1.03x; 8 sessions
# grown from 256 to 512 positions in one step each, 0.94-0.96x the step's time of one block at a time
# (runs of 8: no better).
RUN_BLOCKS = 4


class BlockPool:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, *, dtype: torch.dtype, n_blocks: int,
                 block_tokens: int = BLOCK_TOKENS, device: torch.device | str = "cpu"):
        if n_blocks < 1:
            raise PoolFull("the KV memory budget holds no block; give it more memory")
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.dtype, self.device, self.block_tokens, self.n_blocks = dtype, torch.device(device), block_tokens, n_blocks
        shape = (n_blocks, block_tokens, 2, n_kv_heads, head_dim)
        with torch.inference_mode(False):  # written by forwards under inference mode, read across them
            self.layers = [self._layer_memory(shape) for _ in range(n_layers)]
        self.refs = [0] * n_blocks
        self.free_ids = list(range(n_blocks - 1, -1, -1))  # a stack: the lowest ids first
        # blocks whose pages are faulted in (`alloc` does it once in a block's life: buffers.populate)
        self.populated = bytearray(n_blocks) if self.device.type == "cpu" else bytearray(b"\x01" * n_blocks)
        # blocks that hold a stored extent's rows as read from disk: (extent id, block of the extent)
        # -> block, and back; a sequence restored from the same extents shares them (`adopt_extents`)
        self.extent_blocks: dict[tuple[int, int], int] = {}
        self.keys_of: dict[int, list[tuple[int, int]]] = {}
        self.on_full: Callable[[int], None] | None = None  # asked to free blocks when too few are left

    def _layer_memory(self, shape: tuple[int, ...]) -> torch.Tensor:
        """One layer's blocks. On the CPU in huge pages where the system has them (`buffers.lasting_pages`:
        attention reads a session's blocks with a TLB miss per 2 MiB, not per 4 KiB; on an AMD EPYC
        Zen 3 VM attention over a cold cache ran about 10 % faster), except where free pages are
        reported to a host (`buffers.free_pages_reported`): there a fresh huge page took 10-20 ms to
        fault, and sequences growing in one decode step cross into new pages of every layer at once,
        so that step stalled (8 sessions at 512 positions: 0.6 s against 15 ms), again each time the
        pool grew into pages not written before. There (Intel Xeon with AMX, KVM) the step's median
        from small pages was 1.00-1.04x that from huge ones (five alternated runs). Pages never
        written take no memory either way."""
        if self.device.type != "cpu":
            return torch.empty(shape, dtype=self.dtype, device=self.device)
        buf = lasting_pages(math.prod(shape) * self.dtype.itemsize)
        if buf is None:
            return torch.empty(shape, dtype=self.dtype, device=self.device)
        return torch.from_numpy(buf).view(self.dtype).view(shape)

    @classmethod
    def for_budget(cls, n_layers: int, n_kv_heads: int, head_dim: int, *, dtype: torch.dtype, budget_bytes: int,
                   block_tokens: int = BLOCK_TOKENS, device="cpu") -> "BlockPool":
        per_block = n_layers * block_tokens * 2 * n_kv_heads * head_dim * dtype.itemsize
        return cls(n_layers, n_kv_heads, head_dim, dtype=dtype, n_blocks=budget_bytes // per_block,
                   block_tokens=block_tokens, device=device)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block, every layer."""
        return self.n_layers * self.layers[0][0].numel() * self.dtype.itemsize

    @property
    def used(self) -> int:
        return self.n_blocks - len(self.free_ids)

    def alloc(self, n: int, have: int = 0, spare: int = 0) -> list[int]:
        """n more blocks for a sequence that holds `have`, and up to `spare` more after them where a
        quarter of the pool stays free (never evicting for them); in ascending order."""
        if have + n > self.n_blocks:
            raise PoolTooSmall(f"{(have + n) * self.block_tokens:,} tokens of KV do not fit the KV memory "
                               f"({self.n_blocks * self.block_tokens:,} tokens, {self.n_blocks * self.block_bytes / 2**20:,.0f} "
                               "MiB) even alone; give it more memory (kvstore serve --kv-memory) or use less context")
        if n > len(self.free_ids) and self.on_full is not None:
            self.on_full(n - len(self.free_ids))
        if n > len(self.free_ids):
            raise PoolFull(f"the KV memory ({self.n_blocks * self.block_bytes / 2**20:,.0f} MiB) is held by sequences "
                           f"in use: {len(self.free_ids):,} blocks free, {n:,} needed; retry when they are done, or "
                           "give it more memory (kvstore serve --kv-memory)")
        n += max(0, min(spare, len(self.free_ids) - n - self.n_blocks // 4))
        ids = sorted(self.free_ids.pop() for _ in range(n))
        for i in ids:
            self.refs[i] = 1
        self._populate([i for i in ids if not self.populated[i]])
        return ids

    def _populate(self, ids: list[int]) -> None:
        """The pages of blocks never used before faulted in, every layer, a run of consecutive blocks
        in one call a layer (`buffers.populate`): before the forward that first writes them, where
        each fresh page costs a decode step far more. Once per block: the pool keeps its memory."""
        a = 0
        while a < len(ids):
            b = a + 1
            while b < len(ids) and ids[b] == ids[b - 1] + 1:
                b += 1
            populate_rows(self.layers, ids[a], ids[b - 1] + 1)
            for i in ids[a:b]:
                self.populated[i] = 1
            a = b

    def share(self, ids: list[int]) -> None:
        for i in ids:
            self.refs[i] += 1

    def free(self, ids: list[int]) -> None:
        for i in reversed(ids):  # a sequence's blocks come back in its order (the stack's top: its first)
            self.refs[i] -= 1
            if self.refs[i] == 0:
                self.forget(i)
                self.free_ids.append(i)

    def forget(self, block: int) -> None:
        """The block's rows will change (or it is free): no extent is found in it any more."""
        for key in self.keys_of.pop(block, ()):
            del self.extent_blocks[key]

    def flat(self, layer: int) -> torch.Tensor:
        """Layer `layer` as rows `[n_blocks * block_tokens, 2, n_kv, hd]` (a view)."""
        return self.layers[layer].view(-1, 2, self.n_kv_heads, self.head_dim)


def _shown(rows: torch.Tensor, raw: bool) -> torch.Tensor | np.ndarray:
    """`filling`'s rows as given, or their bytes (raw)."""
    return bytes_of(rows) if raw else rows


class PagedCache:
    STATE_COPIES = True  # `state` returns copies, not views of the blocks (KVCache's are views)

    def __init__(self, pool: BlockPool, capacity: int = 0):
        self.pool = pool
        self.n_layers, self.n_kv_heads, self.head_dim = pool.n_layers, pool.n_kv_heads, pool.head_dim
        self.dtype, self.device = pool.dtype, pool.device
        self.table: list[int] = []
        self._rows: torch.Tensor | None = None  # flat row index of every position the table covers
        self._table: torch.Tensor | None = None  # the table as the kernel takes it
        self.length = 0
        self.reserve(capacity)

    @property
    def capacity(self) -> int:
        return len(self.table) * self.pool.block_tokens

    @property
    def token_shape(self) -> tuple[int, int, int]:
        return (2, self.n_kv_heads, self.head_dim)

    def rows(self, start: int, end: int) -> torch.Tensor:
        """Flat pool row of each position start..end-1 (int64 `[end - start]`, on the pool's device)."""
        if self._rows is None or self._rows.shape[0] < self.capacity:
            bs = self.pool.block_tokens
            blocks = torch.tensor(self.table, dtype=torch.int64, device=self.device)
            self._rows = (blocks[:, None] * bs + torch.arange(bs, device=self.device)).reshape(-1)  # [blocks * bs]
        return self._rows[start:end]

    def reserve(self, n_tokens: int) -> None:
        """Blocks for `n_tokens` positions in total, and up to a multiple of `RUN_BLOCKS` blocks where
        the pool has room to spare (`BlockPool.alloc`)."""
        need = -(-n_tokens // self.pool.block_tokens) - len(self.table)
        if need > 0:
            spare = -(len(self.table) + need) % RUN_BLOCKS
            self.table += self.pool.alloc(need, have=len(self.table), spare=spare)
            self._rows = self._table = None

    def make_room(self, n_tokens: int) -> None:
        """Nothing: a paged cache grows a block at a time without copying, and blocks taken ahead of
        the writes would hold the shared pool's memory for nothing (`KVCache.make_room`)."""

    def _unshared(self, start: int, end: int) -> bool:
        """Whether no other cache shares a block of positions start..end-1."""
        bs = self.pool.block_tokens
        return all(self.pool.refs[self.table[b]] == 1 for b in range(start // bs, -(-end // bs)))

    def _own(self, start: int, end: int) -> None:
        """Copy-on-write: the blocks of positions start..end-1 that another cache shares become this
        cache's own copies before they are written."""
        bs = self.pool.block_tokens
        for b in range(start // bs, -(-end // bs)):
            old = self.table[b]
            if self.pool.refs[old] == 1:
                self.pool.forget(old)  # its own: written in place, it no longer holds an extent's rows
            else:
                (new,) = self.pool.alloc(1)
                for layer in self.pool.layers:
                    layer[new].copy_(layer[old])
                self.pool.free([old])
                self.table[b] = new
                self._rows = self._table = None

    def put(self, layer: int, pos: int, kv: torch.Tensor) -> None:
        """KVCache.put: rows `[T, 2, n_kv, hd]` at pos..pos+T-1 of `layer`, into their blocks."""
        end = pos + kv.shape[0]
        if layer == 0:
            self.reserve(end)
            self._own(pos, end)
        self.pool.flat(layer).index_copy_(0, self.rows(pos, end), kv)
        if layer == self.n_layers - 1:
            self.length = end

    def claim(self, pos: int, end: int) -> torch.Tensor:
        """KVCache.claim: blocks for positions pos..end-1, made this cache's own (as the first layer's
        `put` makes them), and their flat pool rows (int64 `[end - pos]`)."""
        self.reserve(end)
        self._own(pos, end)
        return self.rows(pos, end)

    def pools(self) -> list[torch.Tensor]:
        """KVCache.pools: the pool's layers."""
        return self.pool.layers

    def blocks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """KVCache.blocks: the pool's `layer` `[n_blocks, block_tokens, 2, n_kv, hd]` and this cache's
        block table `[1, n]` int32, for the native attention, which reads the rows where they are."""
        if self._table is None:
            self._table = torch.tensor(self.table, dtype=torch.int32)[None]
        return self.pool.layers[layer], self._table

    def write(self, layer: int, pos: int, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`put`, then K and V of positions 0..pos+T-1 as `[1, n_kv, pos+T, hd]` (gathered: a copy,
        laid out as a contiguous cache's)."""
        self.put(layer, pos, kv)
        end = pos + kv.shape[0]
        rows = self.gather(layer, end)  # [end, 2, n_kv, hd]
        return rows[:, 0].transpose(0, 1).unsqueeze(0), rows[:, 1].transpose(0, 1).unsqueeze(0)

    def gather(self, layer: int, end: int, start: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
        """Positions start..end-1 of `layer` as contiguous rows `[end - start, 2, n_kv, hd]` (a copy;
        into `out` when given)."""
        return torch.index_select(self.pool.flat(layer), 0, self.rows(start, end), out=out)

    @contextmanager
    def filling(self, end: int, *, raw: bool = False) -> Iterator[list[torch.Tensor] | list[np.ndarray]]:
        """KVCache.filling: per layer rows `[end - length, 2, n_kv, hd]` to fill, valid when the block
        exits without an error: the blocks' own rows where positions length..end-1 sit in one run
        of pool rows that no other cache shares (a restore into a pool that is not cut up: its
        blocks come in ascending order), else a reused buffer copied into the blocks. Read in
        place, a 2,461-token session (its files in the page cache) was restored into a fresh pool in
        8.9-9.6 ms against 20.5-21.1 through the buffer (medians of 25, alternated 3 times; SmolLM2,
        Intel Xeon with AMX, 2 threads)."""
        start = self.length
        self.reserve(end)
        rows = self.rows(start, end)
        if end > start and int(rows[-1]) - int(rows[0]) == end - start - 1 and self._unshared(start, end):
            self._own(start, end)  # only forgets what the blocks held: their rows change
            first = int(rows[0])
            yield [_shown(self.pool.flat(i)[first:first + end - start], raw) for i in range(self.n_layers)]
            self.length = end
            return
        per_layer = (end - start) * 2 * self.n_kv_heads * self.head_dim * self.dtype.itemsize
        buffers = [POOL.borrow(per_layer) for _ in range(self.n_layers)]
        try:
            rows = [b[:per_layer].view(self.dtype).view(end - start, *self.token_shape) for b in buffers]
            yield [_shown(r, raw) for r in rows]
            self._own(start, end)
            for i, r in enumerate(rows):
                self.pool.flat(i).index_copy_(0, self.rows(start, end), r)
            self.length = end
        finally:
            POOL.give(*buffers)

    def load(self, start: int, layers: list[torch.Tensor]) -> None:
        assert start == self.length, "ranges load in order"
        end = start + layers[0].shape[0]
        self.reserve(end)
        self._own(start, end)
        for i, part in enumerate(layers):
            self.pool.flat(i).index_copy_(0, self.rows(start, end), part.to(self.device))
        self.length = end

    def state(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """The K/V of positions start..end-1, every layer in one tensor `[n_layers, end - start, 2,
        n_kv, hd]` (iterated, per layer as KVCache's list): copies of their own (`STATE_COPIES`), which a
        checkpoint committed behind the caller need not copy again."""
        end = self.length if end is None else end
        assert 0 <= start <= end <= self.length, (start, end, self.length)
        out = torch.empty((self.n_layers, end - start, 2, self.n_kv_heads, self.head_dim), dtype=self.dtype,
                          device=self.device)
        for i in range(self.n_layers):
            self.gather(i, end, start, out=out[i])
        return out

    def trim(self, n: int) -> None:
        self.length = min(self.length, max(n, 0))

    def adopt_extents(self, refs) -> int:
        """Restoring into an empty cache: take the leading stored extents whose rows other sequences
        hold in the pool already (read from disk and unchanged since), sharing their blocks; returns
        how many of `refs` (the store's `ExtentRef`s, in order) it took. Whole blocks only: an
        extent counts when its start and the rows used are multiples of the block size."""
        assert self.length == 0 and not self.table, "extents are adopted into an empty cache"
        bs, taken, blocks = self.pool.block_tokens, 0, []
        for ref in refs:
            if ref.start != len(blocks) * bs or ref.n_tokens % bs:
                break
            held = [self.pool.extent_blocks.get((ref.extent_id, j)) for j in range(ref.n_tokens // bs)]
            if None in held:
                break
            blocks += held
            taken += 1
        self.pool.share(blocks)
        self.table, self.length, self._rows, self._table = blocks, len(blocks) * bs, None, None
        return taken

    def register_extents(self, refs) -> None:
        """The rows of `refs` were read from disk into this cache: other sequences restored from the
        same extents may share their whole blocks."""
        bs = self.pool.block_tokens
        for ref in refs:
            if ref.start % bs or ref.start + ref.n_tokens > self.length:
                continue
            for j in range(ref.n_tokens // bs):
                key, block = (ref.extent_id, j), self.table[ref.start // bs + j]
                if key not in self.pool.extent_blocks:
                    self.pool.extent_blocks[key] = block
                    self.pool.keys_of.setdefault(block, []).append(key)

    def copy_prefix(self, n: int) -> "PagedCache":
        """A new cache holding this one's first n positions: whole blocks shared, the last one copied."""
        assert 0 <= n <= self.length
        bs = self.pool.block_tokens
        child = PagedCache(self.pool)
        shared = self.table[:n // bs]
        self.pool.share(shared)
        child.table, child.length = list(shared), len(shared) * bs
        if n % bs:
            child.load(len(shared) * bs, [self.gather(i, n, len(shared) * bs) for i in range(self.n_layers)])
        child.length = n
        return child

    def release(self) -> None:
        self.pool.free(self.table)
        self.table, self._rows, self._table, self.length = [], None, None, 0
