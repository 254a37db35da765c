"""One token's matrix-vector products: `matvec(w, x, b)` = w @ x (+ b), `add_matvec(x, w, y, b)` =
x + w @ y (+ b), for vectors `[in]` -> `[out]` (the decode step and any one-row forward).

bfloat16 weights on the CPU take the native kernel when this process has it (`kvstore.native`);
every other product takes torch.mv / addmv. Which one runs depends on the weight's dtype and device
and on the process's settled choice alone, never on what ran before (contract C1's premise).
"""

from __future__ import annotations

import torch

from . import native


def matvec(w: torch.Tensor, x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    op = _native(w)
    if op is not None:
        return op(w, x, b)
    return torch.mv(w, x) if b is None else torch.addmv(b, w, x)


def add_matvec(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """The residual step of one token: one kernel where there is no bias."""
    op = _native(w)
    if op is not None:
        return op(w, y, x) if b is None else x + op(w, y, b)
    return torch.addmv(x, w, y) if b is None else x + torch.addmv(b, w, y)


def _native(w: torch.Tensor):
    if w.dtype is not torch.bfloat16 or w.device.type != "cpu":
        return None
    return native.gemv_bf16()
