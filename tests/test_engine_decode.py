"""Incremental decoding through the KV cache, and the engine-level form of contract C1.

Cached decoding equals a full recomputation (assert_close: another kernel split may round
differently); the same run twice is bit-identical; a chunked prefill interrupted anywhere and
resumed from `KVCache.from_state(cache.state())` continues with exactly the tokens and the logits
bits (`torch.equal`) of the run that never stopped, in float32 and in bfloat16.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import kvstore
from kvstore import KVCache, SamplerSettings, Sequence
from kvstore.engine.cache import HEADROOM
from kvstore.engine.sequence import chunk_bounds

pytestmark = pytest.mark.usefixtures("one_thread")
ARCHS = ["llama-gqa", "qwen2-bias", "llama3-rope", "linear-rope", "gpt2"]
SAMPLED = SamplerSettings(temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.1)


@pytest.fixture(scope="module")
def loaded(tiny):
    """`loaded(name, dtype)` -> our model of the tiny HF folder, loaded once per module."""
    cache = {}

    def get(name, dtype="float32"):
        if (name, dtype) not in cache:
            cache[name, dtype] = kvstore.load_model(tiny(name).folder, dtype=dtype)
        return cache[name, dtype]

    return get


def run(model, prompt, *, chunk_size=8, settings=SAMPLED, seed=7, n=12):
    """Prefill `prompt` and sample `n` tokens: (tokens, stacked logits)."""
    seq = Sequence(model, chunk_size=chunk_size)
    list(seq.extend(prompt))
    events = list(seq.generate(settings, seed=seed, max_new_tokens=n))
    return [e.token for e in events], torch.stack([e.logits for e in events])


@pytest.mark.parametrize("name", ARCHS)
def test_token_by_token_decode_matches_full_forward(loaded, tiny, name):
    model = loaded(name)
    ids = tiny(name).ids(40)
    full = model.logits(ids)
    cache = model.new_cache()
    rows = [model.forward(ids[:16], 0, cache, last_only=False)]
    for p in range(16, len(ids)):
        rows.append(model.forward(ids[p:p + 1], p, cache))
    assert cache.length == len(ids)
    assert_close(torch.cat(rows), full)


@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.parametrize("chunk", [1, 3, 7, 16])
def test_chunked_prefill_matches_full_forward(loaded, tiny, name, chunk):
    model = loaded(name)
    ids = tiny(name).ids(37)
    cache = model.new_cache()
    rows = [model.forward(ids[a:a + chunk], a, cache, last_only=False) for a in range(0, len(ids), chunk)]
    assert_close(torch.cat(rows), model.logits(ids))


@pytest.mark.parametrize("chunk", [1, 5, 512])
def test_sequence_prefill_feeds_every_token_and_keeps_the_last_ones_state(loaded, tiny, chunk):
    """Contract C2 (as kvstore amends it): after a prefill the cache holds every token and `hidden`
    the last one's final state, from which the next logits come without another pass."""
    model = loaded("llama-gqa")
    ids = tiny("llama-gqa").ids(23)
    seq = Sequence(model, chunk_size=chunk)
    lengths = list(seq.extend(ids))
    assert lengths[-1] == seq.cache.length == len(ids)
    assert all(b % chunk == 0 for b in lengths[:-1])
    assert seq.pending == [] and seq.hidden.shape == (model.config.hidden_size,)
    assert_close(seq.next_logits(), model.logits(ids)[-1])
    assert seq.cache.length == len(ids)  # nothing was fed again


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.parametrize("T", [1, 5])  # the decode step, a chunk
def test_logits_from_a_stored_state_are_the_forwards_bit_for_bit(loaded, tiny, name, dtype, T):
    """The state goes to the index as bytes and comes back in other memory: `head` of it gives the
    bits the live forward gave."""
    from kvstore.commit import hidden_bytes

    model = loaded(name, dtype)
    ids = tiny(name).ids(16 + T)
    live, kept = model.new_cache(), model.new_cache()
    model.forward(ids[:16], 0, live)
    model.forward(ids[:16], 0, kept)
    expected = model.forward(ids[16:], 16, live, last_only=True)[0]
    stored = hidden_bytes(model.feed(ids[16:], 16, kept))
    assert len(stored) == model.hidden_bytes
    again = torch.frombuffer(bytearray(stored), dtype=model.dtype).clone()
    assert torch.equal(model.head(again), expected)
    assert all(torch.equal(a, b) for a, b in zip(live.state(), kept.state()))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_resume_from_a_fed_state_samples_at_once_and_bit_identically(loaded, tiny, dtype):
    """Mid-generation checkpoints are taken once the last sampled token is fed: the resumed
    sequence computes its first logits from the state alone."""
    model = loaded("llama-gqa", dtype)
    prompt = tiny("llama-gqa").ids(19)
    tokens, logits = run(model, prompt, n=10)
    live = Sequence(model, chunk_size=8)
    list(live.extend(prompt))
    list(live.generate(SAMPLED, seed=7, max_new_tokens=4))
    live.feed()  # what a checkpoint after 4 tokens does
    state, hidden = [t.clone() for t in live.cache.state()], live.hidden.clone()

    resumed = Sequence(model, KVCache.from_state(state), live.tokens, chunk_size=8, hidden=hidden)
    fed = []
    real_feed = model.net.feed
    model.net.feed = lambda ids, pos, cache: fed.append(pos) or real_feed(ids, pos, cache)
    try:
        events = list(resumed.generate(SAMPLED, seed=7, max_new_tokens=6))
    finally:
        del model.net.feed
    assert fed == list(range(len(prompt) + 4, len(prompt) + 9))  # the first token needed no feed
    assert [e.token for e in events] == tokens[4:]
    assert torch.equal(torch.stack([e.logits for e in events]), logits[4:])


def test_a_full_cache_without_the_last_state_feeds_the_last_token_again(loaded, tiny):
    """A cache built elsewhere (`KVCache.from_state`) with no state: the last token is fed once more."""
    model = loaded("llama-gqa")
    ids = tiny("llama-gqa").ids(12)
    seq = Sequence(model)
    list(seq.extend(ids))
    rebuilt = Sequence(model, KVCache.from_state([t.clone() for t in seq.cache.state()]), ids)
    assert_close(rebuilt.next_logits(), seq.next_logits())
    assert rebuilt.cache.length == len(ids) and rebuilt.hidden is not None


def test_chunk_boundaries_are_multiples_of_the_chunk_size_in_absolute_positions():
    assert chunk_bounds(13, 40, 8) == [(13, 16), (16, 24), (24, 32), (32, 40)]
    assert chunk_bounds(0, 5, 8) == [(0, 5)]
    assert chunk_bounds(7, 7, 8) == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ARCHS)
def test_the_same_run_twice_is_bit_identical(loaded, tiny, name, dtype):
    model = loaded(name, dtype)
    prompt = tiny(name).ids(30)
    tokens_a, logits_a = run(model, prompt)
    tokens_b, logits_b = run(model, prompt)
    assert tokens_a == tokens_b
    assert torch.equal(logits_a, logits_b)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["llama-gqa", "gpt2"])
@pytest.mark.parametrize("stop_after", [0, 1, 3])
def test_interrupted_chunked_prefill_resumes_bit_identically(loaded, tiny, name, dtype, stop_after):
    model = loaded(name, dtype)
    prompt = tiny(name).ids(45)
    tokens, logits = run(model, prompt, chunk_size=8)

    first = Sequence(model, chunk_size=8)
    prefill = first.extend(prompt)
    for _ in range(stop_after):  # the process "dies" after this many chunks
        next(prefill)
    saved_tokens = list(first.tokens[:first.cache.length])
    state = [t.clone() for t in first.cache.state()]
    del first, prefill

    restarted = kvstore.load_model(tiny(name).folder, dtype=dtype)  # a new process loads the model afresh
    resumed = Sequence(restarted, KVCache.from_state(state), saved_tokens, chunk_size=8)
    list(resumed.extend(prompt[len(saved_tokens):]))
    events = list(resumed.generate(SAMPLED, seed=7, max_new_tokens=len(tokens)))
    assert [e.token for e in events] == tokens
    assert torch.equal(torch.stack([e.logits for e in events]), logits)


def test_resume_is_bit_identical_with_the_default_thread_count(loaded, tiny):
    """The other tests here run on one thread (steady timing); sessions run on two or more."""
    torch.set_num_threads(2)  # the one_thread fixture restores the count afterwards
    model = loaded("llama-gqa", "bfloat16")
    prompt = tiny("llama-gqa").ids(40)
    tokens, logits = run(model, prompt, chunk_size=16)
    first = Sequence(model, chunk_size=16)
    next(first.extend(prompt))  # one chunk of 16, then the process "dies"
    state = [t.clone() for t in first.cache.state()]
    resumed = Sequence(model, KVCache.from_state(state), prompt[:16], chunk_size=16)
    list(resumed.extend(prompt[16:]))
    events = list(resumed.generate(SAMPLED, seed=7, max_new_tokens=len(tokens)))
    assert [e.token for e in events] == tokens
    assert torch.equal(torch.stack([e.logits for e in events]), logits)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_resume_with_a_pending_token_then_a_new_turn_is_bit_identical(loaded, tiny, dtype):
    """Contract C2: at the end of a generation call the checkpoint holds K/V of t0..t(n-1) and the
    sampled tn, not yet fed."""
    model = loaded("qwen2-bias", dtype)
    m = tiny("qwen2-bias")
    prompt, turn = m.ids(20, seed=1), m.ids(9, seed=2)

    live = Sequence(model, chunk_size=8)
    list(live.extend(prompt))
    list(live.generate(SAMPLED, seed=3, max_new_tokens=5))
    assert len(live.pending) == 1  # the last sampled token
    state = [t.clone() for t in live.cache.state()]
    checkpoint = list(live.tokens)
    list(live.extend(turn))
    expected = list(live.generate(SAMPLED, seed=3, max_new_tokens=8))

    resumed = Sequence(model, KVCache.from_state(state), checkpoint, chunk_size=8)
    list(resumed.extend(turn))
    got = list(resumed.generate(SAMPLED, seed=3, max_new_tokens=8))
    assert [e.token for e in got] == [e.token for e in expected]
    assert [e.position for e in got] == [e.position for e in expected]
    assert torch.equal(torch.stack([e.logits for e in got]), torch.stack([e.logits for e in expected]))


def test_trimmed_cache_refed_on_the_same_boundaries_gives_the_same_bits(loaded, tiny):
    model = loaded("llama3-rope", "bfloat16")
    ids = tiny("llama3-rope").ids(24)
    cache = model.new_cache()
    model.forward(ids[:16], 0, cache)
    before = model.forward(ids[16:], 16, cache, last_only=False)
    cache.trim(16)
    assert cache.length == 16
    assert torch.equal(model.forward(ids[16:], 16, cache, last_only=False), before)


def test_cache_state_is_token_major_in_the_model_dtype(loaded, tiny):
    model = loaded("llama-gqa", "bfloat16")
    seq = Sequence(model)
    list(seq.extend(tiny("llama-gqa").ids(11)))
    state = seq.cache.state()
    c = model.config
    assert len(state) == c.n_layers
    assert all(t.shape == (11, 2, c.n_kv_heads, c.head_dim) and t.dtype == torch.bfloat16 for t in state)
    assert [t.shape[0] for t in seq.cache.state(4, 10)] == [6] * c.n_layers
    copy = KVCache.from_state(state)
    assert copy.length == 11 and all(torch.equal(a, b) for a, b in zip(copy.state(), state))


def test_cache_growth_keeps_the_valid_prefix(loaded, tiny):
    model = loaded("gpt2")
    ids = tiny("gpt2").ids(20)
    cache = model.new_cache()
    model.forward(ids[:10], 0, cache)
    before = [t.clone() for t in cache.state()]
    cache.reserve(cache.capacity + 1)
    assert all(torch.equal(a, b) for a, b in zip(cache.state(), before))


def test_a_prefill_makes_room_at_once_so_the_tokens_after_it_copy_nothing(loaded, tiny):
    """A prompt read in chunks gets room for all of it and HEADROOM tokens more before its first chunk
    (`KVCache.make_room`). Grown as the chunks came, a cache whose prompt ended at its capacity (512
    tokens here) was copied whole by the first generated token."""
    model = loaded("llama-long", "bfloat16")  # a context of 2,048 positions
    seq = Sequence(model, chunk_size=128)
    list(seq.extend(tiny("llama-long").ids(512)))
    assert seq.cache.capacity >= 512 + HEADROOM
    where = [layer.data_ptr() for layer in seq.cache.layers]
    list(seq.generate(SamplerSettings(), seed=0, max_new_tokens=20))
    assert seq.cache.length == 531 and [layer.data_ptr() for layer in seq.cache.layers] == where


def test_generation_stops_on_a_stop_id_and_says_why(loaded, tiny):
    model = loaded("llama-gqa")
    prompt = tiny("llama-gqa").ids(10)
    greedy = SamplerSettings()
    tokens, _ = run(model, prompt, settings=greedy, n=6)
    seq = Sequence(model)
    list(seq.extend(prompt))
    events = list(seq.generate(greedy, seed=0, max_new_tokens=6, stop_ids=[tokens[2]]))
    assert [e.token for e in events] == tokens[:tokens.index(tokens[2]) + 1]
    assert seq.stop_reason == "eos"


def test_generation_stops_at_max_tokens_or_when_told(loaded, tiny):
    model = loaded("llama-gqa")
    seq = Sequence(model)
    list(seq.extend(tiny("llama-gqa").ids(10)))
    assert len(list(seq.generate(SAMPLED, seed=1, max_new_tokens=4))) == 4
    assert seq.stop_reason == "length"
    events = list(seq.generate(SAMPLED, seed=1, max_new_tokens=10, should_stop=lambda new: len(new) == 2))
    assert len(events) == 2 and seq.stop_reason == "stop"


def test_generation_stops_at_the_end_of_the_context(loaded, tiny):
    model = loaded("gpt2")  # 128 learned positions
    seq = Sequence(model, chunk_size=64)
    list(seq.extend(tiny("gpt2").ids(125)))
    events = list(seq.generate(SAMPLED, seed=1, max_new_tokens=10))
    assert [e.position for e in events] == [125, 126, 127]
    assert seq.stop_reason == "context"


def test_positions_in_token_events_are_absolute(loaded, tiny):
    model = loaded("llama-gqa")
    seq = Sequence(model)
    list(seq.extend(tiny("llama-gqa").ids(17)))
    assert [e.position for e in seq.generate(SAMPLED, seed=1, max_new_tokens=3)] == [17, 18, 19]


def test_bad_token_ids_and_overlong_input_are_refused(loaded, tiny):
    model = loaded("gpt2")
    seq = Sequence(model)
    with pytest.raises(kvstore.errors.ModelError, match="token ids"):
        list(seq.extend([model.config.vocab_size]))
    with pytest.raises(kvstore.errors.ModelError, match="context"):
        list(seq.extend([5] * (model.config.max_context + 1)))
    with pytest.raises(kvstore.errors.ModelError, match="nothing to feed"):
        Sequence(model).next_logits()
    with pytest.raises(kvstore.errors.ModelError, match="chunk size"):
        Sequence(model, chunk_size=0)
