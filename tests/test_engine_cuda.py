"""The engine on a CUDA device (skipped without one): logits close to the CPU's, and decoding
deterministic and resumable bit for bit on the device (contract C1 on CUDA)."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import kvstore
from kvstore import KVCache, SamplerSettings, Sequence

pytestmark = pytest.mark.cuda
SAMPLED = SamplerSettings(temperature=0.8, top_p=0.9)


def generate(model, prompt, cache=None, tokens=(), n=10):
    seq = Sequence(model, cache, tokens, chunk_size=8)
    list(seq.extend(prompt))
    events = list(seq.generate(SAMPLED, seed=5, max_new_tokens=n))
    return seq, [e.token for e in events], torch.stack([e.logits for e in events])


@pytest.mark.parametrize("name", ["llama-gqa", "gpt2"])
def test_cuda_float32_logits_are_close_to_cpu(tiny, name):
    m = tiny(name)
    ids = m.ids(40)
    gpu = kvstore.load_model(m.folder, dtype="float32", device="cuda")
    assert gpu.new_cache().device.type == "cuda"
    got = gpu.logits(ids)
    assert got.device.type == "cpu" and got.dtype == torch.float32
    assert_close(got, m.reference_logits(ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_decoding_is_deterministic_and_resumes_bit_identically(tiny, dtype):
    m = tiny("llama-gqa")
    model = kvstore.load_model(m.folder, dtype=dtype, device="cuda")
    prompt = m.ids(30)
    live, tokens, logits = generate(model, prompt)
    _, tokens_again, logits_again = generate(model, prompt)
    assert tokens_again == tokens and torch.equal(logits_again, logits)

    half = Sequence(model, chunk_size=8)
    prefill = half.extend(prompt)
    next(prefill), next(prefill)  # stop after two chunks
    state = [t.to("cpu") for t in half.cache.state()]  # what the store would write
    saved = half.tokens[:half.cache.length]
    _, resumed_tokens, resumed_logits = generate(model, prompt[len(saved):],
                                                 KVCache.from_state(state, device="cuda"), saved)
    assert resumed_tokens == tokens and torch.equal(resumed_logits, logits)


def test_cuda_cache_restores_identical_bytes_on_the_cpu(tiny):
    m = tiny("qwen2-bias")
    gpu = kvstore.load_model(m.folder, dtype="bfloat16", device="cuda")
    seq = Sequence(gpu)
    list(seq.extend(m.ids(20)))
    moved = KVCache.from_state(seq.cache.state(), device="cpu")
    assert all(torch.equal(a.cpu(), b) for a, b in zip(seq.cache.state(), moved.state()))
