"""A decode step's attention (`attention.one_query`, the CPU path for a single query) against
PyTorch's own SDPA: the same attention (close: another order of the sums), grouped-query heads
mapped alike, and bits that depend on the positions' K/V only, not on the cache's capacity."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from kvstore.engine.attention import one_query


def cache_views(L: int, capacity: int, n_kv: int, hd: int, dtype, seed: int = 0):
    """K and V as the cache hands them out: `[n_kv, L, hd]` views of a token-major buffer."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(L, 2, n_kv, hd, generator=g).to(dtype)
    buf = torch.zeros(capacity, 2, n_kv, hd, dtype=dtype)
    buf[:L] = rows
    return buf[:L, 0].transpose(0, 1), buf[:L, 1].transpose(0, 1)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("n_heads,n_kv", [(9, 3), (4, 4), (8, 2)])
def test_one_query_is_sdpa_with_grouped_heads(dtype, tol, n_heads, n_kv):
    hd, L = 64, 300
    k, v = cache_views(L, 512, n_kv, hd, dtype)
    q = torch.randn(n_heads, hd, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = F.scaled_dot_product_attention(q.unsqueeze(0).unsqueeze(2), k.unsqueeze(0), v.unsqueeze(0),
                                              enable_gqa=n_heads != n_kv)[0, :, 0]
    assert_close(one_query(q, k, v).float(), expected.float(), rtol=tol, atol=tol)


def test_one_query_does_not_depend_on_the_cache_capacity():
    q = torch.randn(9, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    small = one_query(q, *cache_views(200, 256, 3, 64, torch.bfloat16))
    large = one_query(q, *cache_views(200, 4096, 3, 64, torch.bfloat16))
    assert torch.equal(small, large)
