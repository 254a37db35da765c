"""Contract C9 at the engine: several sequences fed in one forward (`feed_rows`) give each the bits it
gets alone — the same final hidden states, logits and K/V — whatever its company (1, 3 or 7 others,
reading a chunk or decoding one token, at other lengths), for dense and block-quantized weights,
bfloat16 (native kernels) and float32 (torch's)."""

from __future__ import annotations

import pytest
import torch

import kvstore
from engine_models import Q

CASES = {  # name: (tiny model, GGUF type or None for the HF folder, dtype, weights)
    "dense-f32": ("llama-gqa", None, "float32", "dense"),
    "dense-bf16": ("llama-gqa", None, "bfloat16", "dense"),
    "stored-q4_1-bf16": ("llama-gqa", Q.Q4_1, "bfloat16", "stored"),
    "stored-q8_0-f32": ("qwen2-bias", Q.Q8_0, "float32", "stored"),
    "q8_0-on-load-bf16": ("llama3-rope", None, "bfloat16", "q8_0"),
}


def load(tiny, case):
    name, qtype, dtype, weights = CASES[case]
    m = tiny(name)
    path = m.folder if qtype is None else m.gguf(qtype)[0]
    return m, kvstore.load_model(path, dtype=dtype, weights=weights)


def prepared(model, m, length: int, seed: int):
    """A cache holding `length` tokens of a sequence (fed in chunks of 8), and its next 8 ids."""
    ids = m.ids(length + 8, seed=seed)
    cache = model.new_cache()
    for a in range(0, length, 8):
        model.feed(ids[a:min(a + 8, length)], a, cache)
    return cache, ids[length:]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("company", [0, 1, 3, 7])
@pytest.mark.parametrize("others", ["reading", "decoding"])
def test_a_sequence_computes_alike_alone_and_in_company(tiny, case, company, others):
    m, model = load(tiny, case)
    lengths = [20, 3, 41, 9, 0, 64, 17, 30][:company + 1]
    # item 0 decodes one token; the others decode too, or alternate a chunk of 8 (reading) and one token
    sizes = [1] + [8 if j % 2 and others == "reading" else 1 for j in range(1, company + 1)]
    alone, caches = [], []
    for j, (n, t) in enumerate(zip(lengths, sizes)):
        cache, nxt = prepared(model, m, n, seed=j)
        solo, _ = prepared(model, m, n, seed=j)
        ids = nxt[:t]
        alone.append(model.feed(ids, n, solo))
        caches.append((cache, ids, n, solo))
    together = model.feed_rows([(ids, n, cache) for cache, ids, n, _ in caches])
    for j, (cache, ids, n, solo) in enumerate(caches):
        assert torch.equal(together[j], alone[j]), f"item {j}"
        assert all(torch.equal(a, b) for a, b in zip(cache.state(), solo.state())), f"item {j}: K/V"
    assert torch.equal(model.head(together), torch.stack([model.head(h) for h in alone]))


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_a_row_invariant_model_computes_alike_however_tokens_are_fed(tiny, qtype):
    """Block-quantized weights, bfloat16, native kernels: prefill in chunks of 1, 5, 16 or all at once
    gives every K/V byte and the next logits alike (so any stored prefix is a cold run's)."""
    m = tiny("llama-gqa")
    model = kvstore.load_model(m.gguf(qtype)[0], dtype="bfloat16", weights="stored")
    if not model.row_invariant:
        pytest.skip("this process lacks a native kernel the row-invariant forward needs")
    dense = kvstore.load_model(m.gguf(qtype)[0], dtype="bfloat16", weights="dense")
    assert not dense.row_invariant
    ids = m.ids(37)
    runs = []
    for chunk in (1, 5, 16, 37):
        cache = model.new_cache()
        hidden = None
        for a in range(0, 37, chunk):
            hidden = model.feed(ids[a:a + chunk], a, cache)
        runs.append((cache.state(), model.head(hidden)))
    for states, logits in runs[1:]:
        assert torch.equal(logits, runs[0][1])
        assert all(torch.equal(a, b) for a, b in zip(states, runs[0][0]))
