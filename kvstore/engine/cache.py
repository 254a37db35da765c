"""KVCache: the per-layer key/value tensors of one sequence, the thing kvstore persists.

Layout per layer, token-major: `[capacity, 2 (K, V), n_kv_heads, head_dim]` in the model's dtype on
the model's device. Token-major makes a checkpoint's new range one contiguous block (exactly what
`state()` returns and the store writes), and a slice `[:length]` has the same strides whatever the
capacity, so attention reads identical views before and after a resume. Capacity grows in fixed
steps; `length` counts the positions whose K/V are valid in every layer. `blocks(layer)` views a
layer as a paged pool (blocks of BLOCK tokens, in order) for kernels that read through block tables.

On the CPU a cache's memory comes from, and goes back to, `POOL` (a `buffers.BufferPool`): memory
written before fills several times faster than fresh pages. `release()` hands a cache's buffers to
the next cache of the process (the next fork opened, the next question asked), much as llama.cpp
restores into the KV buffer its context already holds.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch

from ..errors import InvalidArgument
from .buffers import BufferPool, bytes_of, lasting_pages, populate

GROW_STEP = 256  # capacity is a multiple of this many tokens
BLOCK = GROW_STEP  # tokens per block of `blocks`' paged view
HEADROOM = 1024  # room a restored cache gets beyond its tokens: the next ones do not copy it all (see `with_room`)
POPULATE_AHEAD = 64  # positions whose pages `claim` faults in ahead of the writes (buffers.populate)


def with_room(n_tokens: int) -> int:
    """The capacity for a cache rebuilt with n_tokens that will go on growing (a resume, a fork).

    Growing copies every layer; without room, the first new token after a restore would copy the
    whole cache it just read (188 MB at 8k tokens for SmolLM2). Untouched capacity costs no memory
    on the CPU (pages are only mapped when written)."""
    return n_tokens + HEADROOM


def _new_buffer(nbytes: int) -> torch.Tensor:
    """A flat uint8 CPU buffer that is a normal tensor even when a forward (under inference mode)
    grows a cache: pooled memory outlives that forward, and its next user may write it anywhere.
    Large ones are made of huge pages where the system has them (`buffers.lasting_pages`): filling
    fresh memory (a new process's first restore) then costs little more than filling reused memory.
    Not where free pages are reported to a host (`buffers.free_pages_reported`), which makes fresh
    huge pages the slow ones: a new process opened a 2k-token session in 96-281 ms from huge pages,
    32-34 ms from small ones (Intel Xeon with AMX, KVM)."""
    with torch.inference_mode(False):
        buf = lasting_pages(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8) if buf is None else torch.from_numpy(buf)


POOL = BufferPool(limit=512 << 20, new=_new_buffer)  # flat uint8 CPU tensors
VIEWS_KEPT = 4  # typed views a pooled buffer remembers (`pooled_view`): a cache's shapes are few


def pooled_view(flat: torch.Tensor, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """`flat[:nbytes]` (a pooled buffer) as a `shape` tensor of `dtype`, made once per buffer and
    shape and handed to each cache that borrows the buffer after: a restore's new cache views 30
    buffers, and the three torch calls a view took each time were about 0.45 ms of a warm 2k open
    (7 % of it: the open's 47 MB read had pushed the interpreter out of the CPU's caches). The views
    are made outside inference mode, as the buffers are (`_new_buffer`)."""
    views = flat.__dict__.setdefault("kv_views", {})
    key = (nbytes, dtype, shape)
    view = views.get(key)
    if view is None:
        if len(views) >= VIEWS_KEPT:
            views.clear()
        with torch.inference_mode(False):
            view = views[key] = flat[:nbytes].view(dtype).view(shape)
    return view


def pooled_bytes(flat: torch.Tensor) -> np.ndarray:
    """A pooled buffer's bytes as a uint8 array (no copy), made once per buffer: what a restore reads
    its files into (`KVCache.filling(raw=True)`)."""
    raw = flat.__dict__.get("kv_bytes")
    if raw is None:
        raw = flat.__dict__["kv_bytes"] = flat.numpy()
    return raw


def populate_rows(layers: list[torch.Tensor], start: int, end: int) -> None:
    """Rows start..end-1 (along the first dimension) of each CPU tensor in `layers` faulted in, one
    call a tensor (`buffers.populate`): a cache's positions, a pool's blocks."""
    for t in layers:
        row = t[0].numel() * t.element_size()
        populate(t.data_ptr() + start * row, (end - start) * row)


class KVCache:
    STATE_COPIES = False  # `state` returns views of the buffers (a PagedCache's are copies)

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, *, dtype: torch.dtype,
                 device: torch.device | str = "cpu", capacity: int = 0):
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self._flat: list[torch.Tensor | None] = [None] * n_layers  # each layer's pooled buffer (CPU)
        capacity = -(-capacity // GROW_STEP) * GROW_STEP  # what `reserve` would give an empty cache
        self.layers: list[torch.Tensor] = [self._empty(capacity, i) for i in range(n_layers)]
        self.length = 0
        self._populated = 0  # positions 0.._populated-1 sit in pages faulted in (or written) in every layer
        self._table = torch.zeros(1, 0, dtype=torch.int32, device=self.device)  # `blocks`' table, by capacity
        self._pools: tuple[torch.Tensor, list[torch.Tensor]] | None = None  # (layers[0] they view, `pools`)

    @property
    def capacity(self) -> int:
        return self.layers[0].shape[0] if self.layers else 0

    @property
    def token_shape(self) -> tuple[int, int, int]:
        """Shape of one token's K/V in one layer: (2, n_kv_heads, head_dim)."""
        return (2, self.n_kv_heads, self.head_dim)

    def _empty(self, capacity: int, layer: int | None = None) -> torch.Tensor:
        """`[capacity, 2, n_kv_heads, head_dim]`; on the CPU a view of a pooled buffer (see `POOL`),
        recorded as `layer`'s."""
        shape = (capacity, *self.token_shape)
        if self.device.type != "cpu" or layer is None or capacity == 0:
            return torch.empty(shape, dtype=self.dtype, device=self.device)
        nbytes = capacity * self.token_shape[0] * self.n_kv_heads * self.head_dim * self.dtype.itemsize
        flat = self._flat[layer] = POOL.borrow(nbytes)
        return pooled_view(flat, nbytes, self.dtype, shape)

    def release(self) -> None:
        """Hand the memory to the next cache (`POOL`) and forget every position. Views taken from
        this cache before must not be used afterwards: their memory will hold another cache's K/V."""
        for i, flat in enumerate(self._flat):
            if flat is not None:
                POOL.give(flat)
            self._flat[i] = None
        self.layers = [self._empty(0) for _ in range(self.n_layers)]
        self.length = 0
        self._populated = 0

    def reserve(self, n_tokens: int) -> None:
        """Make room for `n_tokens` positions in total (keeps the valid prefix)."""
        if n_tokens <= self.capacity:
            return
        new_capacity = max(n_tokens, 2 * self.capacity)
        new_capacity = -(-new_capacity // GROW_STEP) * GROW_STEP
        for i, old in enumerate(self.layers):
            old_flat = self._flat[i]
            grown = self._empty(new_capacity, i)
            grown[: self.length].copy_(old[: self.length])
            self.layers[i] = grown
            if old_flat is not None:
                POOL.give(old_flat)
        self._populated = self.length

    def make_room(self, n_tokens: int) -> None:
        """Room for `n_tokens` positions, about to be written, in one step (a prefill's). Growing as
        the chunks come copies the cache at each doubling, and the first token generated after a
        prefill that filled the capacity copies all of it: after 2,048 positions read in chunks of 512
        (SmolLM2, Intel Xeon with AMX) the first decode step's forward took 18-31 ms against 7-8 ms
        for the next ones; with the room made at once, 8-12 ms. The caller adds the room that the
        tokens after them need (`with_room`)."""
        self.reserve(n_tokens)

    def put(self, layer: int, pos: int, kv: torch.Tensor) -> None:
        """The one write path of a forward: K/V rows `[T, 2, n_kv_heads, head_dim]` at positions
        pos..pos+T-1 of `layer`, one copy. Writing the last layer makes the positions valid
        (`length` becomes pos+T): the model writes every layer of a token, in order."""
        end = pos + kv.shape[0]
        self.layers[layer][pos:end].copy_(kv)
        if layer == self.n_layers - 1:
            self.length = end

    def write(self, layer: int, pos: int, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`put`, then K and V of positions 0..pos+T-1 as `[1, n_kv_heads, pos+T, head_dim]` views."""
        self.put(layer, pos, kv)
        buf, end = self.layers[layer], pos + kv.shape[0]
        # [end, n_kv, hd] -> [1, n_kv, end, hd]
        return buf[:end, 0].transpose(0, 1).unsqueeze(0), buf[:end, 1].transpose(0, 1).unsqueeze(0)

    def blocks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`layer` as a paged pool for kernels that read through block tables: the buffer viewed as
        `[capacity / BLOCK, BLOCK, 2, n_kv_heads, head_dim]` and its table `[1, capacity / BLOCK]`
        int32 (0, 1, 2, ...: blocks in order), one sequence."""
        buf = self.layers[layer]
        n = buf.shape[0] // BLOCK
        if self._table.shape[1] != n:
            self._table = torch.arange(n, dtype=torch.int32, device=self.device)[None]
        return buf.view(n, BLOCK, *self.token_shape), self._table

    def claim(self, pos: int, end: int) -> torch.Tensor:
        """Positions pos..end-1 made writable in every layer (room for them): their rows in each
        layer's `blocks` pool viewed flat, `[capacity, 2, n_kv_heads, head_dim]` (int64 `[end - pos]`),
        for a forward that writes every layer's rows itself (`put`'s copies, all at once); it sets
        `length = end` afterwards, as the last layer's `put` would. On the CPU the pages of the
        positions up to POPULATE_AHEAD past `end` are faulted in first, in one call a layer
        (`buffers.populate`): a decode step's own first writes into fresh pages cost it about 3 %."""
        self.reserve(end)
        if end > self._populated and self.device.type == "cpu":
            self._populate(max(pos, self.length, self._populated), min(self.capacity, end + POPULATE_AHEAD))
        return torch.arange(pos, end, dtype=torch.int64, device=self.device)

    def _populate(self, start: int, end: int) -> None:
        """Positions start..end-1 faulted in, in every layer."""
        populate_rows(self.layers, start, end)
        self._populated = end

    def pools(self) -> list[torch.Tensor]:
        """Every layer's `blocks` pool (their one table: `blocks(0)[1]`), made again when the buffers change."""
        if self._pools is None or self._pools[0] is not self.layers[0]:
            self._pools = (self.layers[0], [self.blocks(i)[0] for i in range(self.n_layers)])
        return self._pools[1]

    @contextmanager
    def filling(self, end: int, *, raw: bool = False) -> Iterator[list[torch.Tensor] | list[np.ndarray]]:
        """The restore path that writes in place: yields per layer the `[end - length, 2, n_kv_heads,
        head_dim]` rows of positions length..end-1, to be filled (a store reading its files straight
        into them); they count once the block exits without an error. raw: each layer's rows as
        their bytes (a uint8 array, no copy) instead."""
        start = self.length
        self.reserve(end)
        if raw and self.device.type == "cpu" and all(f is not None for f in self._flat):
            row = math.prod(self.token_shape) * self.dtype.itemsize  # bytes per position, from the buffer's start
            yield [pooled_bytes(f)[start * row:end * row] for f in self._flat]
        else:
            yield [bytes_of(buf[start:end]) if raw else buf[start:end] for buf in self.layers]
        self.length = end

    def trim(self, n: int) -> None:
        """Forget every position from `n` on."""
        if n < 0:
            raise InvalidArgument(f"cannot trim to {n} tokens")
        self.length = min(self.length, n)

    def state(self, start: int = 0, end: int | None = None) -> list[torch.Tensor]:
        """Per layer, the K/V of positions start..end-1 as `[end-start, 2, n_kv_heads, head_dim]` views."""
        end = self.length if end is None else end
        assert 0 <= start <= end <= self.length, (start, end, self.length)
        return [buf[start:end] for buf in self.layers]

    def load(self, start: int, layers: list[torch.Tensor]) -> None:
        """Copy per-layer `[T, 2, n_kv_heads, head_dim]` tensors in at positions start..start+T-1."""
        assert start == self.length, "ranges load in order"
        n = layers[0].shape[0]
        self.reserve(start + n)
        for buf, part in zip(self.layers, layers):
            buf[start:start + n].copy_(part, non_blocking=False)
        self.length = start + n

    def copy_prefix(self, n: int) -> "KVCache":
        """A new cache holding this one's first n positions (copied), with room to grow (a fork's)."""
        cache = KVCache(self.n_layers, self.n_kv_heads, self.head_dim, dtype=self.dtype, device=self.device,
                        capacity=with_room(n))
        if n:
            cache.load(0, self.state(0, n))
        return cache

    @classmethod
    def from_state(cls, layers: list[torch.Tensor], *, device: torch.device | str | None = None) -> "KVCache":
        first = layers[0]
        _, _, n_kv, hd = first.shape
        cache = cls(len(layers), n_kv, hd, dtype=first.dtype, device=device or first.device, capacity=first.shape[0])
        cache.load(0, layers)
        return cache
