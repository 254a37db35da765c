"""The exact prefix cache (contract C10): chained keys at chunk boundaries, the longest stored prefix
of a token list, a fork of it by reference, and answers built on it that equal a cold run bit for
bit; entries under a budget, least recently used evicted first, named sessions never.

The store-level tests run the library; the engine-level ones run the service's engine loop in this
process with a fake pipe (as tests/test_serve_engine.py does), comparing its token events
(position, id, sha256 of the float32 logits) with the library's cold run of the same request.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

import kvstore
from engine_models import Q
from kvstore.store.prefix import Identity, chain
from test_serve_engine import run_loop

CHUNK = 8
SAMPLING = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 0.9, "top_p": 0.95}}


@pytest.fixture(scope="module", params=["dense-f32", "stored-q8_0-bf16"])
def model(request, tiny):
    m = tiny("llama-gqa")
    if request.param == "dense-f32":
        return kvstore.load_model(m.folder)
    return kvstore.load_model(m.gguf(Q.Q8_0)[0], dtype="bfloat16", weights="stored")


@pytest.fixture(scope="module")
def ids(tiny):
    return tiny("llama-gqa").ids(80, seed=3)


def trace_of(path) -> list[tuple]:
    return [(d["position"], d["token"], d["logits_sha256"]) for d in map(json.loads, path.read_text().splitlines())]


# -- keys ---------------------------------------------------------------------------------------
def test_keys_chain_the_chunks_from_a_root_that_names_model_weights_dtype_kernels_and_chunking(model, ids):
    identity = Identity.of(model, CHUNK)
    keys = chain(identity.root(), ids, CHUNK, 20)
    assert [b for b, _ in keys] == [8, 16]  # boundaries up to 20 only
    second = hashlib.blake2b(bytes.fromhex(keys[0][1]) + np.asarray(ids[8:16], dtype="<i4").tobytes(), digest_size=16)
    assert keys[1][1] == second.hexdigest()
    assert chain(identity.root(), ids[:16] + [1, 2], CHUNK, 18) == keys  # the tokens after a boundary: no part
    changed = [ids[0] ^ 1] + ids[1:]
    assert all(a != b for a, b in zip(chain(identity.root(), changed, CHUNK, 16), keys))  # every later key moves
    for other in (Identity.of(model, 16), Identity(model.fingerprint, "float16", model.weights, model.kernels, CHUNK),
                  Identity(model.fingerprint, model.dtype_name, "q8_0", model.kernels, CHUNK),
                  Identity(model.fingerprint, model.dtype_name, model.weights, "cpu:torch-elsewhere", CHUNK)):
        assert chain(other.root(), ids, 8, 16)[0][1] != keys[0][1]


# -- lookup ---------------------------------------------------------------------------------------
def test_the_longest_prefix_is_found_at_whole_chunks_with_one_token_left_to_feed(tmp_path, model, ids):
    store = kvstore.open_store(tmp_path)
    assert store.find_prefix(model, ids[:40], CHUNK) is None  # nothing stored
    with store.new("doc", model, chunk_size=CHUNK) as s:
        s.append_tokens(ids[:21])  # chunks 0-8, 8-16 whole; 16-21 a partial one
    assert store.find_prefix(model, ids[:7], CHUNK) is None  # shorter than a chunk
    assert store.find_prefix(model, ids[:40], CHUNK).length == 16  # the partial chunk is not reused
    assert store.find_prefix(model, ids[:17], CHUNK).length == 16  # exactly at the boundary, one to feed
    assert store.find_prefix(model, ids[:16], CHUNK).length == 8  # the last token is always fed
    assert store.find_prefix(model, ids[:12] + [ids[12] ^ 1] + ids[13:40], CHUNK).length == 8  # differs in chunk 2
    assert store.find_prefix(model, ids[:40], 16) is None  # another chunking computes other bits
    assert store.find_prefix(model, ids[:40], CHUNK, scope="t1:") is None  # another tenant's names
    assert store.find_prefix(model, ids[:40], CHUNK, scope="do").name == "doc"


def test_kv_a_cold_run_computes_otherwise_is_no_prefix(tmp_path, model, ids):
    """Decoded tokens and a turn read after a partial chunk went through other kernel calls than a cold
    prefill of the same tokens: reused only where every row is computed alone (`row_invariant`)."""
    store = kvstore.open_store(tmp_path)
    with store.new("chat", model, chunk_size=CHUNK) as s:
        s.append_tokens(ids[:20])
        generated = list(s.generate(12))
        s.append_tokens(ids[40:60])
        tokens = list(s.tokens)
    hit = store.find_prefix(model, tokens + [5], CHUNK)
    assert hit.length == (len(tokens) // CHUNK * CHUNK if model.row_invariant else 16)
    assert len(generated) == 12


def test_a_prefix_fork_shares_the_source_extents_and_copies_no_byte(tmp_path, model, ids):
    store = kvstore.open_store(tmp_path)
    with store.new("doc", model, chunk_size=CHUNK) as s:
        s.append_tokens(ids[:30])
    prompt = ids[:30] + ids[50:60]
    hit = store.find_prefix(model, prompt, CHUNK)
    assert store.fork_prefix(hit, "warm", prompt, seed=5, temperature=0.5)
    info = store.info("warm")
    assert (info.n_tokens, info.n_cached, info.disk_bytes, info.parent, info.seed) == (25, 24, 0, "doc", 5)
    assert info.sampler["temperature"] == 0.5
    with store.engine.connect() as conn:
        from sqlalchemy import text
        rows = conn.execute(text("SELECT session_id, extent_id FROM session_extents")).all()
    assert {e for s, e in rows if s == store.session_id("warm")} <= {e for s, e in rows if s == store.session_id("doc")}
    store.delete("doc")  # the fork keeps what it shares
    with store.open("warm", model) as s:
        assert s.tokens == prompt[:25] and s.n_cached == 24
    assert store.verify() == {"warm": []}


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_a_reply_on_a_prefix_hit_is_the_cold_runs_bit_for_bit(tmp_path, model, ids, sampling):
    store = kvstore.open_store(tmp_path)
    with store.new("doc", model, chunk_size=CHUNK) as s:
        s.append_tokens(ids[:35])
        list(s.generate(6))  # a session that also decoded: only its cold-run positions are reused
    prompt = ids[:35] + ids[60:71]
    cold, warm = tmp_path / "cold.jsonl", tmp_path / "warm.jsonl"
    with store.new("cold", model, chunk_size=CHUNK, seed=11) as s:
        s.append_tokens(prompt)
        cold_ids = list(s.generate(10, trace=str(cold), **SAMPLING[sampling]))
    store.delete("cold")
    hit = store.find_prefix(model, prompt, CHUNK)
    assert hit.name == "doc" and hit.length == 32
    assert store.fork_prefix(hit, "warm", prompt, seed=11)
    with store.open("warm", model) as s:
        s.append_tokens(prompt[hit.length + 1:])
        warm_ids = list(s.generate(10, trace=str(warm), **SAMPLING[sampling]))
    assert warm_ids == cold_ids
    assert trace_of(warm) == trace_of(cold)


# -- entries -------------------------------------------------------------------------------------
def test_the_budget_evicts_the_least_recently_used_entries_and_never_a_named_session(tmp_path, model, ids):
    store = kvstore.open_store(tmp_path)
    for j in range(4):
        with store.new(f"e{j}", model, chunk_size=CHUNK) as s:
            s.append_tokens(ids[10 * j:10 * j + 17])
        if j < 3:
            store.retain_prefix(f"e{j}")  # e3 stays a named session
    entries, size = store.prefix_held()
    assert entries == 3 and size == 3 * store.info("e0").disk_bytes > 0
    hit = store.find_prefix(model, ids[:17], CHUNK)
    assert hit.name == "e0" and store.fork_prefix(hit, "e0-child", ids[:17])  # e0 just used: e1 is the oldest
    assert store.evict_prefix(size) == []
    assert store.evict_prefix(size - 1) == ["e1"]
    assert store.evict_prefix(0) == ["e2", "e0"]
    assert store.prefix_held() == (0, 0)
    assert sorted(store.names()) == ["e0-child", "e3"]
    with store.open("e0-child", model) as s:  # its source is gone, what it shares is not
        assert s.n_cached == 16
    assert store.verify() == {"e0-child": [], "e3": []}


# -- in the service's engine ---------------------------------------------------------------------------
def own_chat(job_id: str, messages: list[dict], sampling: str, *, seed: int = 21, max_tokens: int = 8) -> dict:
    return {"op": "run", "id": job_id, "kind": "chat", "session": f"chatcmpl-{job_id}", "prefix": {"scope": ""},
            "messages": messages, "max_tokens": max_tokens, "stop": [], "sampling": SAMPLING[sampling],
            "create": {"seed": seed, "chunk_size": CHUNK}}


def retain(job_id: str, budget: int = 2**30) -> dict:
    return {"op": "run", "id": f"retain-{job_id}", "kind": "retain", "session": f"chatcmpl-{job_id}",
            "budget": budget}


def events_of(sent: list[dict], job_id: str) -> dict:
    out = {"tokens": [(m["position"], m["token"], m["logits_sha256"]) for m in sent
                      if m.get("id") == job_id and m["event"] == "token"]}
    for m in sent:
        if m.get("id") == job_id and m["event"] in ("start", "end", "error"):
            out[m["event"]] = m
    return out


def library_cold(tmp_path, model, messages: list[dict], sampling: str, *, seed: int = 21, max_tokens: int = 8):
    """The cold run of a request through the library, on a store of its own: its trace and reply text."""
    store = kvstore.open_store(tmp_path / f"cold-{len(messages)}")
    path = tmp_path / f"cold-{len(messages)}.jsonl"
    with store.new("cold", model, seed=seed, chunk_size=CHUNK) as s:
        text = "".join(s.respond(messages, max_tokens, trace=str(path), **SAMPLING[sampling]))
    store.close()
    return trace_of(path), text


def conversation(turns: int, replies: list[str]) -> list[dict]:
    out = []
    for i in range(turns):
        out.append({"role": "user", "content": " ".join(f"q{i}w{k}" for k in range(6 + 3 * i))})
        if i < turns - 1:
            out.append({"role": "assistant", "content": replies[i]})
    return out


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_a_stateless_chat_resending_its_history_computes_only_the_new_tokens(tmp_path, model, sampling):
    """Each turn is a request of its own with the whole history: from turn 2 on it reuses the previous
    turn's entry up to the chunk boundary before the new tokens (before the reply's, on kernels that do
    not compute every row alone), and its reply is the cold run's, trace for trace."""
    store = kvstore.open_store(tmp_path / "home")
    replies: list[str] = []
    for turn in range(3):
        messages = conversation(turn + 1, replies)
        got = events_of(run_loop(store, model, [own_chat(f"t{turn}", messages, sampling)]), f"t{turn}")
        cold, text = library_cold(tmp_path, model, messages, sampling)
        assert got["tokens"] == cold, f"turn {turn}"
        prompt = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        start, end = got["start"], got["end"]
        assert (start["prefix_queried"], end["prompt_tokens"]) == (len(prompt), len(prompt))
        assert end["cached_tokens"] == start["prefix_hit"]
        if turn == 0:
            assert start["prefix_hit"] == 0 and start["context"] == "computed"
        else:  # the previous request's prompt, up to its last whole chunk; its reply too where rows compute alone
            before = model.tokenizer.apply_chat_template(conversation(turn, replies), add_generation_prompt=True)
            floor = len(before) // CHUNK * CHUNK
            assert start["context"] == "reused"
            assert start["prefix_hit"] >= floor if model.row_invariant else start["prefix_hit"] == floor
            assert len(prompt) - start["prefix_hit"] < len(prompt) - len(before) + CHUNK  # new tokens, rounded
        retained = events_of(run_loop(store, model, [retain(f"t{turn}")]), f"retain-t{turn}")["end"]
        assert retained["prefix_entries"] == turn + 1 and retained["prefix_evicted"] == 0
        replies.append(text)
    store.close()


def test_a_corrupt_source_falls_back_to_a_cold_run_and_leaves_the_cache(tmp_path, model):
    store = kvstore.open_store(tmp_path / "home")
    messages = conversation(2, ["a reply that the client kept"])
    run_loop(store, model, [own_chat("first", messages[:1], "greedy")])
    run_loop(store, model, [retain("first")])
    source = store.session_id("chatcmpl-first")
    for layer in (tmp_path / "home" / "sessions" / source).glob("layer-*.kv"):
        data = bytearray(layer.read_bytes())
        data[10] ^= 0xFF
        layer.write_bytes(bytes(data))
    sent = run_loop(store, model, [own_chat("second", messages, "greedy")])
    got = events_of(sent, "second")
    assert "error" not in got and got["start"]["prefix_hit"] == 0
    assert got["tokens"] == library_cold(tmp_path, model, messages, "greedy")[0]
    assert "chatcmpl-first" not in store.names() and store.prefix_held() == (0, 0)  # the broken entry went


def test_a_missing_source_file_falls_back_to_a_cold_run(tmp_path, model):
    """A named session is a source too (a fork shares its extents: it can go on or be deleted
    safely); when its files are gone it stops being one, and is otherwise left alone."""
    store = kvstore.open_store(tmp_path / "home")
    messages = conversation(2, ["a reply that the client kept"])
    prompt = model.tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True)
    with store.new("named", model, chunk_size=CHUNK) as s:
        s.append_tokens(prompt)
    for layer in (tmp_path / "home" / "sessions" / store.session_id("named")).glob("layer-*.kv"):
        layer.unlink()
    sent = run_loop(store, model, [own_chat("q", messages, "greedy")])
    got = events_of(sent, "q")
    assert "error" not in got and got["start"]["prefix_hit"] == 0
    assert got["tokens"] == library_cold(tmp_path, model, messages, "greedy")[0]
    assert "named" in store.names() and store.find_prefix(model, prompt, CHUNK, scope="named") is None


def test_a_row_invariant_model_is_keyed_every_block_whatever_its_chunk_size(tmp_path, tiny):
    """Where every row is computed alone, any position is a cold run's boundary: keys every KEY_BLOCK
    positions even with the default chunk of 512, so a conversation shorter than a chunk, resent with
    a new turn, reuses all but its last few tokens, and the reply is the cold run's, bit for bit."""
    from kvstore.store.prefix import KEY_BLOCK

    m = tiny("llama-gqa")
    model = kvstore.load_model(m.gguf(Q.Q4_1)[0], dtype="bfloat16", weights="stored")
    if not model.row_invariant:
        pytest.skip("this process lacks a native kernel the row-invariant forward needs")
    ids = m.ids(200, seed=5)
    store = kvstore.open_store(tmp_path)
    with store.new("turn1", model) as s:  # the default chunk (512)
        s.append_tokens(ids[:100])
        list(s.generate(20))
        turn1 = list(s.tokens)
    prompt = turn1 + ids[150:170]
    hit = store.find_prefix(model, prompt, kvstore.DEFAULT_CHUNK)
    assert hit is not None and hit.length == len(turn1) // KEY_BLOCK * KEY_BLOCK > 64  # its reply's tokens too
    assert store.find_prefix(model, prompt, 64).length == hit.length  # another chunking: the same keys
    assert store.fork_prefix(hit, "warm", prompt, seed=2)
    cold, warm = tmp_path / "cold.jsonl", tmp_path / "warm.jsonl"
    with store.new("cold", model, seed=2) as s:
        s.append_tokens(prompt)
        list(s.generate(8, trace=str(cold), temperature=0.9))
    with store.open("warm", model) as s:
        s.append_tokens(prompt[len(s.tokens):])
        list(s.generate(8, trace=str(warm), temperature=0.9))
    assert trace_of(warm) == trace_of(cold)


def test_an_edited_history_on_a_row_invariant_model_reuses_every_common_position(tmp_path, tiny):
    """A named session asked a history that differs from its own (a regenerated reply, say) is answered
    as a cold run on a fork: where every row is computed alone, at the last position both share (not
    the last chunk boundary, which with the default chunk of 512 would be 0); elsewhere at a boundary."""
    from kvstore_serve.jobs import plan

    m = tiny("llama-gqa")
    for model, row_invariant in ((kvstore.load_model(m.gguf(Q.Q4_1)[0], dtype="bfloat16", weights="stored"), True),
                                 (kvstore.load_model(m.folder), False)):
        if model.row_invariant != row_invariant:
            pytest.skip("this process lacks a native kernel the row-invariant forward needs")
        store = kvstore.open_store(tmp_path / f"home-{row_invariant}")
        with store.new("chat", model, chunk_size=16) as s:
            "".join(s.chat("hello there, how are you today", 12))
            edited = [{"role": "user", "content": "hello there, how are you today"},
                      {"role": "assistant", "content": "fine"}, {"role": "user", "content": "good"}]
            prompt = model.tokenizer.apply_chat_template(edited, add_generation_prompt=True)
            common = next(i for i, (a, b) in enumerate(zip(s.tokens, prompt)) if a != b)
            p = plan(s, edited)
        store.close()
        assert p.kind == "cold" and common > 17 and (common - 1) % 16, common
        assert p.fork_at == (common - 1 if row_invariant else (common - 1) // 16 * 16), (p.fork_at, common)


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_an_edited_history_on_a_named_session_is_the_cold_runs_bit_for_bit(tmp_path, model, sampling):
    """The engine's side of `plan`: the named session's reply to an edited history, on the branch it
    forks (at any common position where rows are computed alone), is the cold run's, trace for trace."""
    store = kvstore.open_store(tmp_path / "home")
    first = [{"role": "user", "content": " ".join(f"w{k}" for k in range(30))}]
    job = {**own_chat("a", first, sampling), "session": "named"}
    del job["prefix"]
    run_loop(store, model, [job])
    edited = first + [{"role": "assistant", "content": "an edited reply"}, {"role": "user", "content": "go on"}]
    got = events_of(run_loop(store, model, [{**job, "id": "b", "messages": edited}]), "b")
    cold, _ = library_cold(tmp_path, model, edited, sampling)
    assert got["tokens"] == cold
    assert got["end"]["cached_tokens"] > 0 and "named@1" in store.names()
    store.close()
