"""Attention over the KV cache, shared by every architecture.

Queries, keys and values arrive token-major (`[T, heads, head_dim]`), the layout the projections
produce and the cache stores; `attend` writes K/V into the cache and runs
`F.scaled_dot_product_attention` (grouped-query heads included) over positions 0..pos+T-1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .cache import KVCache


def attention_mask(pos: int, T: int, device) -> tuple[torch.Tensor | None, bool]:
    """(mask, is_causal) for queries at pos..pos+T-1 attending to keys 0..pos+T-1."""
    if T == 1:
        return None, False
    if pos == 0:
        return None, True
    q = torch.arange(pos, pos + T, device=device)[:, None]
    return torch.arange(pos + T, device=device)[None, :] <= q, False  # [T, pos+T]


def causal_mask(pos: int, T: int, dtype: torch.dtype, device) -> tuple[torch.Tensor | None, bool]:
    """(additive mask, is_causal) for queries at pos..pos+T-1 over keys 0..pos+T-1; built once per forward.

    A float mask (0 / -inf) goes straight into the attention kernel; a boolean one would be converted
    again in every layer."""
    if T == 1:
        return None, False
    if pos == 0:
        return None, True
    return torch.full((T, pos + T), float("-inf"), dtype=dtype, device=device).triu_(pos + 1), False


def attend_rows(q: torch.Tensor, kv: torch.Tensor, cache: KVCache | None, layer: int, pos: int,
                mask: tuple[torch.Tensor | None, bool]) -> torch.Tensor:
    """q `[T, n_heads, hd]`, kv `[T, 2, n_kv_heads, hd]` (cache rows) -> attention output `[T, n_heads * hd]`."""
    T, n_heads, hd = q.shape
    if cache is not None:
        k_all, v_all = cache.write(layer, pos, kv)  # [1, n_kv, pos+T, hd]
    else:
        assert pos == 0, "without a cache, a forward starts at position 0"
        k_all, v_all = kv.permute(1, 2, 0, 3).unbind(0)  # [n_kv, T, hd] each
        k_all, v_all = k_all.unsqueeze(0), v_all.unsqueeze(0)
    o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k_all, v_all, attn_mask=mask[0],
                                       is_causal=mask[1], enable_gqa=k_all.shape[1] != n_heads)
    return o[0].transpose(0, 1).reshape(T, n_heads * hd)  # [1, n_heads, T, hd] -> [T, n_heads hd]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache | None, layer: int, pos: int,
           mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """q `[T, n_heads, hd]`, k/v `[T, n_kv_heads, hd]` -> attention output `[T, n_heads * hd]`."""
    T, n_heads, hd = q.shape
    if cache is not None:
        k_all, v_all = cache.update(layer, pos, k, v)  # [1, n_kv, pos+T, hd]
    else:
        assert pos == 0, "without a cache, a forward starts at position 0"
        k_all, v_all = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    q = q.transpose(0, 1).unsqueeze(0)  # [1, n_heads, T, hd]
    o = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, is_causal=causal,
                                       enable_gqa=k_all.shape[1] != n_heads)
    return o.squeeze(0).transpose(0, 1).reshape(T, n_heads * hd)
