"""The forward's row-wise operations, each decided in one place: kvstore's native kernel where this
process has one (`kvstore.native`), torch's ops otherwise.

- `matvec(w, x, b)` = w @ x (+ b) and `add_matvec(x, w, y, b)` = x + w @ y (+ b): one token's
  products, vectors `[in]` -> `[out]`. `linear(x, w, b)` and `add_linear(x, y, w, b)` are the same
  for rows `[T, in]` (one row takes the vector kernels); `project` is `linear` without that case
  (GPT-2's products, always the matrix kernel). `embed(ids, w)` reads embedding rows.
- Weights are dense tensors or `quant.Packed` block-quantized matrices. A packed one always takes the
  quantized product (`native.quant()`'s kernel, else `quant_reference`, the same bits), for any T:
  its rows never depend on the other rows, so a token computes alike alone, in a chunk or in a batch;
  a residual added to it (`add_*`) is fused into its one rounding.
- `rms_norm(x, weight2, eps)`: RMSNorm of rows `[..., hidden]` times the weight, float32 inside and
  rounded once; `weight2` is the weight twice over (`[2 hidden]`, see `_torch_rms_norm`).
  `vector_norm(like, eps)` is the same for one vector, for the decode loop.
- `swiglu(gate_up)`: silu(gate) * up, `[..., 2 ffn]` -> `[..., ffn]`.
- `rotate_(x, cos, sin)`: rotary embedding in place on `[T, heads, hd]` (or `[heads, hd]` with cos
  and sin `[1, hd]`), two halves per head (HF's layout), the sign of rotate_half folded into sin.

The native kernels take bfloat16 CPU tensors; float32, float16 and CUDA tensors always take torch's.
Which one runs depends on the dtype and device and on the process's settled choice alone, never on
what ran before (contract C1's premise); the two round differently (see kvstore.native).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from . import native, quant_reference
from .quant import KINDS, Packed

Weight = "torch.Tensor | Packed"


def qgemm(w: Packed, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
    """x `[T, in]` @ w.T (+ add: `[out]` or `[T, out]`), w block-quantized, in x's dtype."""
    k = native.quant() if x.is_cpu and x.dtype in (torch.bfloat16, torch.float32) else None
    if k is None:
        return quant_reference.qgemm(w, x, add)
    return k.qgemm(w.data, KINDS[w.kind], w.rows, w.cols, x, add, -1)


def linear(x: torch.Tensor, w: Weight, b: torch.Tensor | None = None) -> torch.Tensor:
    """x `[T, in]` @ w.T (+ b). One dense row takes the matrix-vector kernel (`matvec`: memory-bound;
    the generic matmul path is slower at T=1 here). Which kernel runs depends on T alone, never on history."""
    if isinstance(w, Packed):
        return qgemm(w, x, b)
    if x.shape[0] == 1:
        return matvec(w, x[0], b)[None]
    return F.linear(x, w, b)


def add_linear(x: torch.Tensor, y: torch.Tensor, w: Weight, b: torch.Tensor | None) -> torch.Tensor:
    """The residual step x + y @ w.T (+ b), fused into one kernel where there is no bias."""
    if isinstance(w, Packed):
        return qgemm(w, y, x) if b is None else x + qgemm(w, y, b)
    if x.shape[0] == 1:
        return add_matvec(x[0], w, y[0], b)[None]
    return torch.addmm(x, y, w.t()) if b is None else x + F.linear(y, w, b)


def rows_linear(x: torch.Tensor, w: Weight, b: torch.Tensor | None, spans) -> torch.Tensor:
    """`linear` of rows stacked from several items (`rows.Span`s): one product where each row is
    computed alone whatever the other rows (block-quantized weights), else item by item, as each
    item's own `linear` (a dense matrix product's bits may depend on how many rows it has)."""
    if isinstance(w, Packed) or len(spans) == 1:
        return linear(x, w, b)
    k = _native(w)
    if k is not None and b is None and x.shape[0] == len(spans):  # one row each: gemv's bits, one weight pass
        return k.gemv_rows(w, x, None)
    return torch.cat([linear(x[s.start:s.end], w, b) for s in spans])


def rows_add_linear(x: torch.Tensor, y: torch.Tensor, w: Weight, b: torch.Tensor | None, spans) -> torch.Tensor:
    """`add_linear` of stacked rows, as `rows_linear` decides."""
    if isinstance(w, Packed) or len(spans) == 1:
        return add_linear(x, y, w, b)
    k = _native(w)
    if k is not None and b is None and x.shape[0] == len(spans):
        return k.gemv_rows(w, y, x)
    return torch.cat([add_linear(x[s.start:s.end], y[s.start:s.end], w, b) for s in spans])


def project(x: torch.Tensor, w: Weight, b: torch.Tensor | None = None) -> torch.Tensor:
    """x `[T, in]` @ w.T (+ b) with the matrix kernel for every T (dense) or the quantized product."""
    return qgemm(w, x, b) if isinstance(w, Packed) else F.linear(x, w, b)


def embed(ids: torch.Tensor, w: Weight, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` `[T]` of an embedding table -> `[T, hidden]` in `dtype`."""
    if not isinstance(w, Packed):
        return F.embedding(ids, w)
    k = native.quant() if w.data.device.type == "cpu" and dtype in (torch.bfloat16, torch.float32) else None
    if k is None:
        return w.embed(ids, dtype)
    return k.qembed(w.data, KINDS[w.kind], w.rows, w.cols, ids, dtype)


def matvec(w: Weight, x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(w, Packed):
        return qgemm(w, x[None], b)[0]
    k = _native(w)
    if k is not None:
        return k.gemv(w, x, b)
    return torch.mv(w, x) if b is None else torch.addmv(b, w, x)


def add_matvec(x: torch.Tensor, w: Weight, y: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """The residual step of one token: one kernel where there is no bias."""
    if isinstance(w, Packed):
        return add_linear(x[None], y[None], w, b)[0]
    k = _native(w)
    if k is not None:
        return k.gemv(w, y, x) if b is None else x + k.gemv(w, y, b)
    return torch.addmv(x, w, y) if b is None else x + torch.addmv(b, w, y)


def rms_norm(x: torch.Tensor, weight2: torch.Tensor, eps: float) -> torch.Tensor:
    k = _native(x)
    return k.rms_norm(x, weight2, eps) if k is not None else _torch_rms_norm(x, weight2, eps)


def vector_norm(like: torch.Tensor, eps: float) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`norm(x, weight2)` for vectors shaped like `like`: the native kernel, or torch's with one buffer."""
    k = _native(like)
    if k is not None:
        return lambda x, weight2: k.rms_norm(x, weight2, eps)
    return _TorchVectorNorm(like, eps)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    k = _native(gate_up)
    if k is not None:
        return k.swiglu(gate_up)
    ffn = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :ffn]).mul_(gate_up[..., ffn:])


def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    k = _native(x)
    if k is not None:
        return k.rope_(x, cos, sin)
    swapped = x.roll(x.shape[-1] // 2, -1)  # cat(x2, x1), a copy (faster than cat or flip here)
    return x.mul_(cos).addcmul_(swapped, sin)


def _native(t: torch.Tensor):
    if t.dtype is not torch.bfloat16 or not t.is_cpu:
        return None
    return native.kernels()


def _torch_rms_norm(x: torch.Tensor, weight2: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm of [x, -x] is RMSNorm of x: the mean is zero and the variance is mean(x^2). PyTorch has
    a fused CPU kernel for layer_norm but composes rms_norm from seven ops (float copy, pow, mean, ...),
    1.7 ms against 0.7 ms for a 512-token chunk here."""
    hidden = x.shape[-1]
    both = torch.cat([x, x], -1)
    both[..., hidden:].neg_()
    return F.layer_norm(both, (2 * hidden,), weight2, None, eps)[..., :hidden]


class _TorchVectorNorm:
    """RMSNorm of one hidden vector through LayerNorm of [x, -x], with one reused buffer."""

    def __init__(self, like: torch.Tensor, eps: float):
        self.hidden, self.eps = like.shape[0], eps
        self.both = torch.empty(2 * self.hidden, dtype=like.dtype, device=like.device)
        self.lo, self.hi = self.both[:self.hidden], self.both[self.hidden:]

    def __call__(self, x: torch.Tensor, weight2: torch.Tensor) -> torch.Tensor:
        self.lo.copy_(x)
        torch.neg(x, out=self.hi)
        return F.layer_norm(self.both, (2 * self.hidden,), weight2, None, self.eps)[:self.hidden]
