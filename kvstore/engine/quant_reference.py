"""The quantized matrix product in torch ops, operation for operation the native kernel's
(native/qgemm.h states the arithmetic): the oracle the tests hold the kernel to (`torch.equal`),
and the path that runs where the kernel cannot (KVSTORE_NATIVE=0, a CPU without AVX2, CUDA).

Integer block sums are computed as float32 products of small integers, which is exact (every term
and partial sum stays below 2**24), so any matmul order gives them; the float32 steps after them are
elementwise torch ops in the kernel's order. Slow (a Python loop over the blocks), but the same bits.
"""

from __future__ import annotations

import torch

from .quant import BLOCK, Packed

ROWS_AT_ONCE = 64  # activation rows per slice: bounds the [T, rows, n_blocks] block sums in memory


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x `[T, cols]` -> (p `[T, nb, 32]` integer-valued float32, dx `[T, nb]`, s `[T, nb]`, sx `[T, nb]`):
    dx = amax / 127, p = round-half-even(x * (1 / dx)) (0 where dx is 0 or subnormal), s = sum p, sx = dx * s; a
    block holding NaN or an infinity gets p = 0, s = 0 and dx = sx = NaN."""
    T, cols = x.shape
    blocks = x.float().reshape(T, cols // BLOCK, BLOCK)
    finite = torch.isfinite(blocks).all(dim=-1)  # [T, nb]
    blocks = torch.where(finite[..., None], blocks, torch.zeros_like(blocks))
    amax = blocks.abs().amax(dim=-1)
    dx = amax / torch.full_like(amax, 127.0)  # tensor / tensor: a true division, never a reciprocal product
    normal = dx >= torch.finfo(torch.float32).tiny  # a subnormal dx's reciprocal can overflow: p = 0
    inv = torch.where(normal, torch.ones_like(dx) / dx, torch.zeros_like(dx))
    p = torch.round(blocks * inv[..., None])
    s = p.sum(dim=-1)
    dx = torch.where(finite, dx, torch.full_like(dx, float("nan")))
    return p, dx, s, dx * s


def qgemm(w: Packed, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
    """x `[T, cols]` (bfloat16 or float32) @ w.T (+ add: `[rows]` or `[T, rows]`) -> `[T, rows]` in x's dtype."""
    out = [_rows(w, x[a:a + ROWS_AT_ONCE], None if add is None or add.dim() == 1 else add[a:a + ROWS_AT_ONCE], add)
           for a in range(0, x.shape[0], ROWS_AT_ONCE)]
    return torch.cat(out) if out else x.new_empty(0, w.rows)


def _rows(w: Packed, x: torch.Tensor, add_rows: torch.Tensor | None, add: torch.Tensor | None) -> torch.Tensor:
    d, m, q = w.unpack()  # [rows, nb], [rows, nb] | None, [rows, nb, 32]
    values = q.float() - 8 if w.kind == "Q4_0" else q.float()
    p, dx, _, sx = quantize_activations(x)
    isum = torch.einsum("tbk,rbk->trb", p, values)  # exact integers
    acc = torch.zeros(x.shape[0], w.rows)
    for b in range(isum.shape[-1]):
        scale = d[None, :, b] * dx[:, b, None]  # [T, rows]
        acc = acc + isum[:, :, b] * scale
        if m is not None:
            acc = acc + m[None, :, b] * sx[:, b, None]
    if add is not None:
        acc = (add_rows if add_rows is not None else add).float() + acc
    return acc.to(x.dtype)
