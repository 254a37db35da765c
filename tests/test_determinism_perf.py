"""The speed paths of the Llama forward keep contract C1's premise.

The logits of a forward over positions [pos, pos+T) may depend only on the token ids, pos, T, the
cache contents before pos and the thread count: not on the cache's capacity, on how far the rotary
table has grown, or on what ran before. Single-token steps take other kernels than chunks
(matrix-vector products, no mask) and stay close to a full forward.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.testing import assert_close

import kvstore
from kvstore import KVCache, SamplerSettings, Sequence
from kvstore.engine.models.llama import ROPE_BLOCK

ARCHS = ["llama-gqa", "qwen2-bias", "llama3-rope"]


def greedy(model, prompt, *, chunk=8, n=10, cache=None):
    seq = Sequence(model, cache, chunk_size=chunk)
    list(seq.extend(prompt))
    return torch.stack([e.logits for e in seq.generate(SamplerSettings(), seed=0, max_new_tokens=n)])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ARCHS)
def test_logits_do_not_depend_on_cache_capacity_or_rope_table_length(tiny, name, dtype):
    m = tiny(name)
    prompt = m.ids(37, seed=3)
    fresh = kvstore.load_model(m.folder, dtype=dtype)
    reference = greedy(fresh, prompt)
    grown = kvstore.load_model(m.folder, dtype=dtype)
    grown.net.rope(0, 3000)  # a rotary table far longer than this run needs
    big = grown.new_cache(capacity=2048)
    assert torch.equal(greedy(grown, prompt, cache=big), reference)
    assert torch.equal(greedy(fresh, prompt), reference), "a second run in the same process"


@pytest.mark.parametrize("name", ARCHS)
def test_rotary_table_holds_each_angles_exact_cos_and_sin_rounded_once(tiny, name):
    """Every entry of the rotary table is the float32 rounding of the exact cos (sin) of its angle,
    the float32 product position x inverse frequency. No library's float32 approximation: MKL's
    (torch's on the CPU) took another code path for part of a long tensor in some processes, so the
    table, and the bits a continued session decoded, changed from process to process."""
    net = kvstore.load_model(tiny(name).folder, dtype="float32").net
    n = 2 * ROPE_BLOCK + 5  # two whole blocks and a third
    cos, sin = net.rope(0, n)  # [n, 1, hd] each: cos | cos, -sin | sin
    inv = net.inv_freq.tolist()
    half = len(inv)
    angles = [[float(np.float32(p) * np.float32(f)) for f in inv] for p in range(n)]
    exact_cos = torch.tensor([[math.cos(a) for a in row] for row in angles], dtype=torch.float64).float()
    exact_sin = torch.tensor([[math.sin(a) for a in row] for row in angles], dtype=torch.float64).float()
    assert torch.equal(cos[:, 0, :half], exact_cos) and torch.equal(cos[:, 0, half:], exact_cos)
    assert torch.equal(sin[:, 0, :half], -exact_sin) and torch.equal(sin[:, 0, half:], exact_sin)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("cut", [1, 9, 16, 17, 30])
def test_resume_from_cloned_state_is_bit_identical(tiny, dtype, cut):
    m = tiny("llama-gqa")
    model = kvstore.load_model(m.folder, dtype=dtype)
    prompt = m.ids(40, seed=5)
    live = Sequence(model, chunk_size=8)
    list(live.extend(prompt[:cut]))
    state = [t.clone() for t in live.cache.state()]
    list(live.extend(prompt[cut:]))
    expected = [e.logits for e in live.generate(SamplerSettings(), seed=0, max_new_tokens=12)]
    resumed = Sequence(model, KVCache.from_state(state), tokens=prompt[:cut], chunk_size=8)
    list(resumed.extend(prompt[cut:]))
    got = [e.logits for e in resumed.generate(SamplerSettings(), seed=0, max_new_tokens=12)]
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


@pytest.mark.parametrize("name", ARCHS)
def test_single_token_steps_match_a_full_forward(tiny, name):
    m = tiny(name)
    model = kvstore.load_model(m.folder, dtype="float32")
    ids = m.ids(24, seed=1)
    cache = model.new_cache()
    model.forward(ids[:5], 0, cache)
    steps = [model.forward([t], p, cache)[0] for p, t in enumerate(ids[5:], start=5)]
    assert_close(torch.stack(steps), model.logits(ids)[5:], rtol=1e-4, atol=1e-4)
