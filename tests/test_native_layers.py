"""The native layer stack (`native.layers()`, kvstore/engine/native/layers.cpp): a Llama forward's
layers in one call give the bits of Python's loop over the same kernels (hidden states, logits and
every K/V byte) for one sequence in a contiguous cache (prompt chunks, then decode tokens) and for a
batch of sequences in a paged pool (chunks beside decode tokens, forks sharing blocks until they write
them). It runs only where it computes what the loop computes: block-quantized weights without biases,
bfloat16, on the CPU; elsewhere the loop runs, as before."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

import kvstore
from conftest import threads
from engine_models import Q
from kvstore.engine import native
from kvstore.engine.rows import Item
from native_paths import avx2_everywhere, require_both

needs_stack = pytest.mark.skipif(native.layers() is None, reason=f"this process runs {native.layers_status()}")


@contextmanager
def python_loop(model):
    """The model's forward through Python's loop over the layers (the stack left unused)."""
    stack, model.net._stack = model.net._stack, None
    try:
        yield
    finally:
        model.net._stack = stack


@pytest.fixture
def stack_calls(monkeypatch):
    """How many forwards ran the native stack."""
    calls = []
    real = native.layers

    def counted():
        op = real()
        return None if op is None else (lambda *a: calls.append(1) or op(*a))

    monkeypatch.setattr(native, "layers", counted)
    return calls


def one_sequence(model, ids: list[int], prompt: int):
    """Feed `ids[:prompt]` in chunks of 5, then the rest one by one: every hidden state, the logits of
    the last, every K/V byte."""
    cache = model.new_cache()
    hidden = [model.feed(ids[a:min(a + 5, prompt)], a, cache) for a in range(0, prompt, 5)]
    hidden += [model.feed(ids[p:p + 1], p, cache) for p in range(prompt, len(ids))]
    return torch.stack(hidden), model.head(hidden[-1]), cache.state()


CASES = {  # name: (tiny model, GGUF type or None for the HF folder, weights)
    "q4_1-stored": ("llama-gqa", Q.Q4_1, "stored"),
    "q8_0-stored-one-kv-head": ("llama3-rope", Q.Q8_0, "stored"),
    "q8_0-on-load": ("llama-gqa", None, "q8_0"),
}


def load(tiny, case):
    name, qtype, weights = CASES[case]
    m = tiny(name)
    return m, kvstore.load_model(m.folder if qtype is None else m.gguf(qtype)[0], dtype="bfloat16", weights=weights)


@needs_stack
@pytest.mark.parametrize("case", list(CASES))
def test_one_sequence_computes_alike_in_one_call_and_in_the_loop(tiny, case, stack_calls):
    m, model = load(tiny, case)
    ids = m.ids(60, seed=3)
    ours = one_sequence(model, ids, prompt=41)
    assert len(stack_calls) == 9 + 19  # every forward: 9 chunks, 19 tokens
    with python_loop(model):
        loop = one_sequence(model, ids, prompt=41)
    assert len(stack_calls) == 28
    assert torch.equal(ours[0], loop[0]) and torch.equal(ours[1], loop[1])
    assert all(torch.equal(a, b) for a, b in zip(ours[2], loop[2]))


def paged_batch(model, m, steps: int = 12):
    """Five sequences of different lengths in one paged pool and two forks of them (sharing their
    blocks), fed together for `steps` forwards, some reading chunks of 5 while others decode: the
    logits of every step, and every sequence's K/V."""
    cfg = model.config
    pool = kvstore.BlockPool.for_budget(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, dtype=model.dtype,
                                        budget_bytes=8 << 20)
    caches, pos = [], []
    for j, n in enumerate([3, 17, 40, 16, 29]):
        cache = kvstore.PagedCache(pool)
        model.feed(m.ids(n, seed=j), 0, cache)
        caches.append(cache)
        pos.append(n)
    for parent, at in ((2, 21), (3, 16)):  # a fork in the middle of a block, one at a block's end
        caches.append(caches[parent].copy_prefix(at))
        pos.append(at)
    logits = []
    for step in range(steps):
        items = []
        for j, cache in enumerate(caches):
            rows = 5 if (step + j) % 3 == 0 else 1
            items.append(Item(torch.tensor(m.ids(rows, seed=100 * step + j)), pos[j], cache))
        logits.append(model.head(model.net.feed_rows(items)))
        for j, it in enumerate(items):
            pos[j] += it.ids.shape[0]
    return torch.stack(logits), [c.state() for c in caches]


@needs_stack
@pytest.mark.parametrize("case", ["q4_1-stored", "q8_0-stored-one-kv-head"])
def test_a_paged_batch_computes_alike_in_one_call_and_in_the_loop(tiny, case, stack_calls):
    m, model = load(tiny, case)
    with torch.inference_mode():
        ours = paged_batch(model, m)
        assert len(stack_calls) == 5 + 12  # the five prompts, then every step of the batch
        with python_loop(model):
            loop = paged_batch(model, m)
    assert torch.equal(ours[0], loop[0])
    for j, (a, b) in enumerate(zip(ours[1], loop[1])):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"sequence {j}: K/V"


@needs_stack
def test_the_real_model_decodes_alike_in_one_call_and_in_the_loop(smollm2_path, stack_calls):
    model = kvstore.load_model(smollm2_path, dtype="bfloat16")
    ids = model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 12)
    ours = one_sequence(model, ids, prompt=len(ids) - 16)
    assert stack_calls
    with python_loop(model):
        loop = one_sequence(model, ids, prompt=len(ids) - 16)
    assert torch.equal(ours[0], loop[0]) and torch.equal(ours[1], loop[1])
    assert all(torch.equal(a, b) for a, b in zip(ours[2], loop[2]))


@pytest.mark.parametrize("name, qtype, dtype, weights, runs", [
    ("llama-gqa", Q.Q4_1, "bfloat16", "stored", True),
    ("llama-gqa", Q.Q4_1, "bfloat16", "dense", False),  # bfloat16 matrices: gemv and torch's products
    ("llama-gqa", Q.Q4_1, "float32", "stored", False),  # float32 activations: torch's norms and attention
    ("qwen2-bias", Q.Q8_0, "bfloat16", "stored", False),  # biases, added outside the products
])
def test_the_stack_runs_only_where_it_computes_what_the_loop_does(tiny, stack_calls, name, qtype, dtype, weights, runs):
    m = tiny(name)
    model = kvstore.load_model(m.gguf(qtype)[0], dtype=dtype, weights=weights)
    assert (model.net._stack is not None) == runs
    model.feed(m.ids(9), 0, model.new_cache())
    assert bool(stack_calls) == (runs and native.layers() is not None)


def test_loading_a_model_the_stack_serves_settles_it_so_no_forward_builds_it(tiny, monkeypatch):
    """The layer stack's library is built (the first time on a machine: seconds) while the model
    loads, like the other kernels, not inside its first forward: a first prefill took 7.0 s where
    1.7 s computed it."""
    m = tiny("llama-gqa")
    monkeypatch.setattr(native, "_layers", None)
    kvstore.load_model(m.gguf(Q.Q4_1)[0], dtype="float32", weights="stored")  # no stack: left unsettled
    assert native._layers is None
    model = kvstore.load_model(m.gguf(Q.Q4_1)[0], dtype="bfloat16", weights="stored")
    assert model.net._stack is not None and native._layers is not None


def test_the_stack_stands_down_with_the_kernels_it_calls(monkeypatch):
    monkeypatch.setattr(native, "_layers", None)
    monkeypatch.setattr(native, "_attention", (None, "torch's attention (KVSTORE_NATIVE=0)"))
    assert native.layers() is None
    assert native.layers_status() == native.STOOD_DOWN
    assert native.STOOD_DOWN == "Python's loop over the layers (a kernel library it calls is not in use)"
    monkeypatch.setattr(native, "_layers", None)
    monkeypatch.setenv(native.ENV, "0")
    monkeypatch.setattr(native, "_attention", None)
    for choice in ("_choice", "_quant_choice"):
        monkeypatch.setattr(native, choice, None)
    assert native.layers() is None


def long_chunks(model, ids: list[int], chunk: int):
    """Feed `ids` in chunks of `chunk` rows but the last 6 (from 48 rows qgemm takes AMX where the CPU
    has it; a chunk of more rows than one attention tile lays its K/V out first), then those 6 one by
    one: every hidden state, the last logits, every K/V byte."""
    cache = model.new_cache()
    prompt = len(ids) - 6
    hidden = [model.feed(ids[a:min(a + chunk, prompt)], a, cache)[-1:] for a in range(0, prompt, chunk)]
    hidden += [model.feed(ids[p:p + 1], p, cache) for p in range(prompt, len(ids))]
    return torch.cat(hidden), model.head(hidden[-1]), cache.state()


@needs_stack
@pytest.mark.parametrize("case", ["q4_1-stored", "q8_0-stored-one-kv-head"])
def test_the_stack_keeps_the_bits_whatever_the_thread_count(tiny, case, stack_calls):
    """The stack shares each step among the threads of one parallel region (rows, row groups,
    attention units); which thread computes what never changes a bit: 1, 2 or 3 threads, the loop's."""
    m, model = load(tiny, case)
    ids = m.ids(140, seed=5)
    runs = {}
    for n in (1, 2, 3):
        with threads(n):
            runs[n] = long_chunks(model, ids, chunk=64)
    assert len(stack_calls) == 3 * (3 + 6)
    with python_loop(model):
        loop = long_chunks(model, ids, chunk=64)
    for n, ours in runs.items():
        assert torch.equal(ours[0], loop[0]) and torch.equal(ours[1], loop[1]), f"{n} threads"
        assert all(torch.equal(a, b) for a, b in zip(ours[2], loop[2])), f"{n} threads: K/V"
    with threads(3):
        many = paged_batch(model, m, steps=4)
    with threads(1):
        one = paged_batch(model, m, steps=4)
    assert torch.equal(many[0], one[0])
    assert all(torch.equal(x, y) for a, b in zip(many[1], one[1]) for x, y in zip(a, b))


@needs_stack
def test_the_stack_refuses_weights_that_do_not_fit_its_layers(tiny):
    m, model = load(tiny, "q4_1-stored")
    weights, meta, norms = model.net._stack
    cfg = model.config
    pool = kvstore.BlockPool.for_budget(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, dtype=model.dtype,
                                        budget_bytes=1 << 20)
    cache = kvstore.PagedCache(pool)
    model.feed(m.ids(4), 0, cache)  # the pool's arguments, as a forward makes them
    swapped, swapped_meta = list(weights), list(meta)  # layer 0's wqkv and wo change places
    swapped[0:2], swapped_meta[0:6] = weights[1::-1], meta[3:6] + meta[0:3]
    cos, sin = model.net.rope(4, 1)
    x = torch.zeros(1, cfg.hidden_size, dtype=torch.bfloat16)
    args = (cache.pools(), torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.int32),
            torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), cfg.n_heads, 1e-5)
    with pytest.raises(RuntimeError, match="llama_layers: layer 0's weight 0 is"):
        native.layers()(x, swapped, swapped_meta, norms, cos, sin, *args)


@needs_stack
def test_a_model_on_the_avx2_steps_computes_the_bits_of_the_avx512_ones(tiny, stack_calls):
    """The attention and the bfloat16 ops on the steps a CPU without AVX512 runs (native_paths), in the
    stack and in Python's loop, for one sequence and for a paged batch, and a model on bfloat16
    weights (the products by gemv): every hidden state, logit and K/V byte as on the AVX512 steps.
    A session made on one kind of CPU continues on the other with these bits."""
    require_both()
    m, model = load(tiny, "q4_1-stored")
    ids = m.ids(60, seed=3)
    dense = kvstore.load_model(m.folder, dtype="bfloat16", weights="dense")

    def everything():
        with torch.inference_mode():
            out = [one_sequence(model, ids, prompt=41), paged_batch(model, m, steps=6)]
            with python_loop(model):
                out.append(one_sequence(model, ids, prompt=41))
        return out + [one_sequence(dense, ids, prompt=41)]

    avx512 = everything()
    calls = len(stack_calls)
    with avx2_everywhere():
        avx2 = everything()
    assert calls and len(stack_calls) == 2 * calls
    for name, a, b in zip(("stack", "paged batch", "loop", "bfloat16 weights"), avx2, avx512):
        assert torch.equal(a[0], b[0]), name
        if name != "paged batch":
            assert torch.equal(a[1], b[1]), name
        states = zip(a[1], b[1]) if name == "paged batch" else [(a[2], b[2])]
        assert all(torch.equal(x, y) for sa, sb in states for x, y in zip(sa, sb)), f"{name}: K/V"
