"""The engine's batched steps on a CUDA device (skipped without one), contract C9 where the native
kernels do not run: each session's rows are computed apart inside the step's forward (its products,
its attention and its head row as alone), so a session's tokens and logits bits are the library's
alone on the same device, beside 1, 3 or 7 others reading or decoding, its KV in the paged memory
on the GPU. The model is as narrow as the other tests' and as wide as the real one (`llama-wide`),
where reductions over wider rows could be split differently by how many rows a kernel gets.

The HTTP test on CUDA (eviction and restore behind a small --kv-memory) is in test_serve_scale.py.
"""

from __future__ import annotations

import pytest
import torch

import kvstore
from test_paged import fed_together_and_alone
from test_serve_batching import job, library_trace, together

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module", params=["llama-gqa", "llama-wide"])
def cuda_model(request, tiny):
    return kvstore.load_model(tiny(request.param).folder, dtype="bfloat16", device="cuda")


@pytest.mark.parametrize("company", [1, 3, 7])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_every_session_in_a_cuda_step_replies_as_the_library_alone(tmp_path, cuda_model, company, sampling,
                                                                  monkeypatch):
    assert not cuda_model.row_invariant and cuda_model.kernels == "cuda"
    jobs = [job(j, sampling, 12) for j in range(company + 1)]
    events, steps = together(tmp_path, cuda_model, jobs, monkeypatch, kv_memory=16 * 2**20)
    for j in range(company + 1):
        assert events[f"j{j}"] == library_trace(tmp_path, cuda_model, j, sampling, 12), f"session s{j}"
    assert max(sessions for sessions, *_ in steps) == company + 1  # all of them in one forward, at times
    assert any(decode and prefill for _, decode, prefill, *_ in steps)  # decode tokens beside prompt chunks


def test_the_paged_memory_lives_on_the_gpu_and_changes_no_bit(cuda_model, tiny):
    """Sequences fed together through one pool on the GPU, each as alone in a contiguous cache."""
    c = cuda_model.config
    pool = kvstore.BlockPool(c.n_layers, c.n_kv_heads, c.head_dim, dtype=cuda_model.dtype, n_blocks=64,
                             device="cuda")
    assert pool.layers[0].device.type == "cuda"
    together, alone, pageds, flats = fed_together_and_alone(cuda_model, pool, tiny("llama-gqa"), [20, 3, 41, 9])
    together_logits = cuda_model.head(together)
    for j, (hidden, paged, flat) in enumerate(zip(alone, pageds, flats)):
        assert torch.equal(together_logits[j], cuda_model.head(hidden)), j
        assert all(torch.equal(a, b) for a, b in zip(paged.state(), flat.state())), j
