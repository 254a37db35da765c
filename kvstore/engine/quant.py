"""Block-quantized weight matrices (GGUF's Q4_0, Q4_1, Q8_0), kept as stored and packed for the kernels.

- `Blocks`: a matrix in GGUF's own layout, `raw` uint8 `[rows, n_blocks * block_bytes]` (each block:
  an fp16 scale d, for Q4_1 an fp16 minimum m, then 32 quants; Q4 packs element j in the low nibble
  and j+16 in the high nibble of byte j). Rows are independent, so row permutations (`map_rows`) and
  row concatenation (`cat_rows`) work on the bytes as they are. `from_gguf` takes a reader's tensor
  without copying a block; `quantize_q8_0` makes Q8_0 from a dense matrix (a safetensors model
  quantized on load); `dequantize` gives the values GGUF's own dequantizer gives.
- `Packed`: the same blocks rearranged for the kernels (native/qgemm.h states the layout: rows
  in groups of 16, per group and block one record of 4-byte slices with the 16 rows side by side, then
  their scales). `pack(blocks)` makes it (on the CPU in huge pages: `WEIGHT_MEMORY`); `embed(ids)` reads rows back (an embedding table kept
  quantized); `unpack()` gives quants and scales per block for the reference arithmetic.

Which kinds run as stored is `KINDS`; other GGUF types (K-quants, F16) are dequantized by the loader.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from .buffers import HugeArena

BLOCK = 32  # elements per block
LANES = 16  # rows per packed group
KINDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}  # name -> the kernels' code
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
QUANT_BYTES = {"Q4_0": 256, "Q4_1": 256, "Q8_0": 512}  # per record: 16 rows' quants of one block
HAS_MIN = {"Q4_0": False, "Q4_1": True, "Q8_0": False}
WEIGHT_MEMORY = HugeArena()  # where packed matrices live on the CPU: huge pages where the system has them


def record_bytes(kind: str) -> int:
    return QUANT_BYTES[kind] + 32 + (32 if HAS_MIN[kind] else 0)


@dataclass(frozen=True)
class Blocks:
    kind: str
    raw: torch.Tensor  # uint8 [rows, n_blocks * BLOCK_BYTES[kind]]
    cols: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.raw.shape[0], self.cols)

    @property
    def n_blocks(self) -> int:
        return self.cols // BLOCK

    def to(self, device) -> "Blocks":
        return Blocks(self.kind, self.raw.to(device), self.cols)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Blocks":
        """The same matrix with its rows rearranged by `fn` (which sees `[rows, ...]` and moves rows only)."""
        return Blocks(self.kind, fn(self.raw).contiguous(), self.cols)

    def fields(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(d float32 [rows, nb], m float32 [rows, nb] or None, quants [rows, nb, 32] int16 as values
        q: Q4 0..15 in element order, Q8_0 -128..127)."""
        rows, nb = self.raw.shape[0], self.n_blocks
        blocks = self.raw.view(rows, nb, BLOCK_BYTES[self.kind])
        d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0].float()
        m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0].float() if HAS_MIN[self.kind] else None
        start = 4 if HAS_MIN[self.kind] else 2
        qs = blocks[..., start:]
        if self.kind == "Q8_0":
            return d, m, qs.contiguous().view(torch.int8).to(torch.int16)
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # [rows, nb, 32]: low nibbles, then high ones
        return d, m, q.to(torch.int16)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values as GGUF defines them (float32 math, then `dtype`): `[rows, cols]`."""
        return dequantize_fields(self.kind, *self.fields()).reshape(self.raw.shape[0], self.cols).to(dtype)


def from_gguf(tensor) -> Blocks | None:
    """A GGUF reader tensor of a kind in `KINDS` as Blocks (a copy: the reader's map is read-only);
    None for other kinds."""
    kind = tensor.tensor_type.name
    if kind not in KINDS or len(tensor.shape) != 2:
        return None
    cols, rows = (int(n) for n in tensor.shape)
    data = np.array(tensor.data, copy=True).reshape(rows, -1)
    return Blocks(kind, torch.from_numpy(data), cols)


def cat_rows(parts: Sequence[Blocks]) -> Blocks:
    kinds = {p.kind for p in parts}
    assert len(kinds) == 1 and len({p.cols for p in parts}) == 1, "only blocks of one kind and width stack"
    return Blocks(parts[0].kind, torch.cat([p.raw for p in parts]), parts[0].cols)


def quantize_q8_0(w: torch.Tensor) -> Blocks:
    """A dense `[rows, cols]` matrix as Q8_0 (cols a multiple of 32), as llama.cpp's quantizer (and
    gguf-py's) makes it: per block d = amax / 127 (float32; stored as fp16), q = round(x * (1 / d)),
    halves rounded away from zero."""
    rows, cols = w.shape
    x = w.detach().float().reshape(rows, cols // BLOCK, BLOCK)
    d = x.abs().amax(dim=-1) / 127
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    scaled = x * inv[..., None]
    whole = scaled.abs().floor()
    q = (torch.sign(scaled) * (whole + torch.floor(2 * (scaled.abs() - whole)))).to(torch.int8)
    raw = torch.cat([d.to(torch.float16)[..., None].view(torch.uint8), q.view(torch.uint8)], dim=-1)
    return Blocks("Q8_0", raw.reshape(rows, -1).contiguous(), cols)


@dataclass(frozen=True)
class Packed:
    kind: str
    rows: int
    cols: int
    data: torch.Tensor  # uint8 [groups, n_blocks, record_bytes(kind)]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def unpack(self, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """`Blocks.fields` of the rows `ids` (all rows when None), read back from the packed records."""
        rows = torch.arange(self.rows) if ids is None else ids.reshape(-1).to(torch.long)
        group, lane = rows // LANES, rows % LANES
        records = self.data[group]  # [n, nb, record]
        n, nb, qb = rows.shape[0], self.data.shape[1], QUANT_BYTES[self.kind]
        slices = records[..., :qb].view(n, nb, qb // 64, LANES, 4)  # [n, nb, slice, lane, 4 bytes]
        mine = slices[torch.arange(n), :, :, lane]  # [n, nb, slice, 4]
        scales = records[..., qb:].contiguous().view(torch.float16).view(n, nb, -1, LANES)  # [n, nb, d|m, lane]
        picked = scales[torch.arange(n), :, :, lane].float()  # [n, nb, d|m]
        d = picked[..., 0]
        m = picked[..., 1] if HAS_MIN[self.kind] else None
        if self.kind == "Q8_0":
            q = (mine.reshape(n, nb, BLOCK) ^ 0x80).view(torch.int8).to(torch.int16)
        else:
            bytes_ = mine.reshape(n, nb, BLOCK // 2)  # GGUF's 16 bytes of the block, in order
            q = torch.cat([bytes_ & 0x0F, bytes_ >> 4], dim=-1).to(torch.int16)
        return d, m, q

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` `[T]` dequantized (GGUF's values, float32 math) -> `[T, cols]` in `dtype`."""
        d, m, q = self.unpack(ids)
        return dequantize_fields(self.kind, d, m, q).reshape(-1, self.cols).to(dtype)


def dequantize_fields(kind: str, d: torch.Tensor, m: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """Values `[..., nb, 32]` (float32) from `fields`/`unpack`'s scales and quants."""
    if kind == "Q4_0":
        return (q.float() - 8) * d[..., None]
    if kind == "Q4_1":
        return q.float() * d[..., None] + m[..., None]
    return q.float() * d[..., None]


def pack(blocks: Blocks) -> Packed:
    """Blocks -> the kernels' layout (rows padded with zeros to a multiple of 16)."""
    kind, (rows, cols), nb = blocks.kind, blocks.shape, blocks.n_blocks
    groups = -(-rows // LANES)
    raw = blocks.raw.view(rows, nb, BLOCK_BYTES[kind])
    if groups * LANES != rows:
        raw = torch.cat([raw, raw.new_zeros(groups * LANES - rows, nb, BLOCK_BYTES[kind])])
    # [groups, lane, nb, bytes] -> [groups, nb, lane, bytes]: a record's rows side by side
    per_group = raw.view(groups, LANES, nb, BLOCK_BYTES[kind]).transpose(1, 2)
    start = 4 if HAS_MIN[kind] else 2
    quants = per_group[..., start:]  # [groups, nb, lane, 16 or 32]
    if kind == "Q8_0":
        quants = quants ^ 0x80  # unsigned for vpdpbusd: the kernel subtracts 128 * sum(p)
    n_slices = quants.shape[-1] // 4
    # [groups, nb, lane, slice, 4] -> [groups, nb, slice, lane, 4]: slice k holds bytes 4k..4k+3 of every row
    slices = quants.reshape(groups, nb, LANES, n_slices, 4).transpose(2, 3).reshape(groups, nb, -1)
    scales = [per_group[..., 0:2]]  # [groups, nb, lane, 2 bytes of fp16]
    if HAS_MIN[kind]:
        scales.append(per_group[..., 2:4])
    parts = [slices] + [s.reshape(groups, nb, -1) for s in scales]
    piece = WEIGHT_MEMORY.take(groups * nb * record_bytes(kind)) if raw.device.type == "cpu" else None
    if piece is None:
        record = torch.cat(parts, dim=-1).contiguous()
    else:  # [groups, nb, record bytes] in huge pages
        record = torch.cat(parts, dim=-1, out=piece.view(groups, nb, record_bytes(kind)))
    assert record.shape[-1] == record_bytes(kind)
    return Packed(kind, rows, cols, record)


def fuse(parts: Sequence["torch.Tensor | Blocks"], dtype: torch.dtype) -> "torch.Tensor | Blocks":
    """Matrices stacked by rows (Q|K|V, gate|up): Blocks when every part is Blocks of one kind, else a
    dense matrix in `dtype` (a part of another kind is dequantized)."""
    if all(isinstance(p, Blocks) for p in parts) and len({p.kind for p in parts}) == 1:
        return cat_rows(parts)
    return torch.cat([dense(p, dtype) for p in parts])


def packed(w):
    """Blocks -> Packed (the kernels' layout); anything else (a dense tensor, None) as it is."""
    return pack(w) if isinstance(w, Blocks) else w


def dense(w, dtype: torch.dtype):
    """Blocks -> their values as a dense tensor in `dtype`; anything else as it is."""
    return w.dequantize(dtype).to(w.raw.device) if isinstance(w, Blocks) else w
