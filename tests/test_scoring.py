"""Scoring what a session reads (`Session.append_scored`): each appended token's log-probability
given everything before it, and the likeliest tokens' there, from the prefill's own rows.

What it proves: the entries are the log-softmax of the logits that HF transformers computes for the
same ids (assert_close, float32); where the model computes every row alone they equal, bit for bit,
the entries of a decode that reached each position one token at a time (the logprob a sampled token
reports there); scoring changes nothing the session holds (K/V bytes, the last state, the tokens
that follow it); the first token of a session, with nothing before it, has no entry; a session's
last state (or its pending token) predicts the first token appended to it.
"""

from __future__ import annotations

import pytest
import torch

import kvstore
from conftest import single_thread
from engine_models import Q
from kvstore.engine.trace import token_logprobs

CHUNK = 16


def test_entries_are_the_reference_models_log_softmax(tiny, tmp_path):
    m = tiny("llama-gqa")
    with single_thread():
        model = kvstore.load_model(str(m.folder), dtype="float32")
        ids = m.ids(40)
        store = kvstore.open_store(tmp_path / "home")
        with store.new("scored", model, chunk_size=CHUNK) as s:
            entries = s.append_scored(ids, top=3)
        store.close()
        expected = torch.log_softmax(m.reference_logits(ids).float(), dim=-1)  # [40, vocab]: row p predicts p + 1
    assert entries[0] is None  # nothing before the first token predicts it
    got = torch.tensor([e["logprob"] for e in entries[1:]])
    torch.testing.assert_close(got, expected[torch.arange(39), torch.tensor(ids[1:])])
    for p in (1, 17, 39):  # the likeliest tokens at a few positions, likeliest first
        top = expected[p - 1].topk(3)
        assert [t for t, _ in entries[p]["top_logprobs"]] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in entries[p]["top_logprobs"]]), top.values)
    assert [(e["position"], e["token"]) for e in entries[1:]] == list(zip(range(1, 40), ids[1:]))


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_a_row_invariant_models_entries_are_a_decodes_bit_for_bit(tiny, tmp_path, qtype):
    m = tiny("llama-gqa")
    model = kvstore.load_model(m.gguf(qtype)[0], dtype="bfloat16", weights="stored")
    if not model.row_invariant:
        pytest.skip("this process lacks a native kernel the row-invariant forward needs")
    ids = m.ids(37)
    store = kvstore.open_store(tmp_path / "home")
    with store.new("scored", model, chunk_size=CHUNK) as s:
        entries = s.append_scored(ids[:20], top=4) + s.append_scored(ids[20:], top=4)  # the second: from the state
    store.close()
    cache = model.new_cache()
    for p in range(len(ids) - 1):  # one token at a time, as a decode reaches each position
        logits = model.head(model.feed(ids[p:p + 1], p, cache)).to("cpu")
        assert entries[p + 1] == {"position": p + 1, "token": ids[p + 1], **token_logprobs(logits, ids[p + 1], 4)}


def test_scoring_changes_nothing_the_session_holds(tiny, tmp_path):
    """A dense model (rows not computed alone): the same chunks, K/V, state and continuation as
    append_tokens, including after a generation whose last token is pending."""
    m = tiny("llama-gqa")
    store = kvstore.open_store(tmp_path / "home")
    with single_thread():
        model = kvstore.load_model(str(m.folder), dtype="float32")
        runs = {}
        for name, scored in (("plain", False), ("scored", True)):
            with store.new(name, model, chunk_size=CHUNK, seed=3) as s:
                s.append_tokens(m.ids(21))
                list(s.generate(5))  # its last token pending: the next prefill's first row
                if scored:
                    entries = s.append_scored(m.ids(30, seed=1), top=2)
                    assert all(e is not None for e in entries)  # the pending token's row predicts the first
                else:
                    s.append_tokens(m.ids(30, seed=1))
                state = (s.seq.cache.state(), s.seq.hidden.clone())
                runs[name] = state, list(s.generate(6, temperature=0.8))
    store.close()
    (plain_kv, plain_hidden), plain_next = runs["plain"]
    (scored_kv, scored_hidden), scored_next = runs["scored"]
    assert all(torch.equal(a, b) for a, b in zip(plain_kv, scored_kv)) and torch.equal(plain_hidden, scored_hidden)
    assert plain_next == scored_next


def test_text_is_tokenized_as_append_text_does(tiny, tmp_path):
    m = tiny("llama-gqa")
    model = kvstore.load_model(str(m.folder), dtype="float32")
    store = kvstore.open_store(tmp_path / "home")
    with store.new("t", model, chunk_size=CHUNK) as s:
        entries = s.append_scored("hello world", top=0)
        assert [e["token"] for e in entries[1:]] == s.tokens[1:] and len(entries) == len(s.tokens)
        assert all(e["top_logprobs"] == [] for e in entries[1:])
        more = s.append_scored(" again")
        assert more[0]["position"] == len(entries)  # from the state: no BOS in the middle
    store.close()


@pytest.mark.realmodel
def test_the_real_model_finds_the_likely_continuation_likelier(tmp_path, smollm2_path):
    """SmolLM2 as kvstore runs it by default (its GGUF blocks, bfloat16): a log-likelihood comparison,
    as an evaluation harness makes it, from a document read once and forked per candidate; each
    candidate's entries are the same whether scored on the fork or with the document in one call."""
    model = kvstore.load_model(smollm2_path)
    store = kvstore.open_store(tmp_path / "home")
    context = "The capital of France is"
    with store.new("doc", model) as doc:
        doc.append_text(context)
    totals, alone = {}, {}
    for name, candidate in (("right", " Paris"), ("wrong", " a banana")):
        store.fork("doc", f"doc-{name}")
        with store.open(f"doc-{name}", model) as s:
            entries = s.append_scored(candidate, top=1)
        totals[name] = sum(e["logprob"] for e in entries)
        with store.new(f"whole-{name}", model) as w:
            alone[name] = w.append_scored(context + candidate, top=1)[-len(entries):]
        same_tokens = [e["token"] for e in alone[name]] == [e["token"] for e in entries]
        if model.row_invariant and same_tokens:  # the fork went on from the stored state: the same rows' bits
            assert alone[name] == entries
    store.close()
    assert totals["right"] > totals["wrong"] + 2.0
