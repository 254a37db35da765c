"""A completion as one call (`Session.begin`): the prompt appended and recorded together with the
generation after it, whose tokens then come from `resume()` (the service's completions API runs every
prompt this way, `serve/jobs.py`).

What it proves: the call is `append_text` (or `append_scored`) then `generate`, token for token and
logits bit for bit, its entries the same floats; a call stopped while it reads its prompt (the
process killed after some of its chunks are durable) is finished by `resume()` in a new open, the
prompt held once, where a prompt recorded before its call is left without one (and a caller that
runs the request again appends it twice); a scoring stopped midway leaves the session as it was, in
memory and on disk, and the same call made again scores as an uninterrupted one.
"""

from __future__ import annotations

import pytest

import kvstore
from conftest import single_thread
from store_harness import read_trace

CHUNK = 16
PROMPT = "A prompt long enough to be read in several chunks of sixteen tokens, then continued."
N_NEW = 12


@pytest.fixture
def model(tiny):
    with single_thread():
        yield kvstore.load_model(str(tiny("llama-gqa").folder))


def uninterrupted(store, model, tmp_path, *, top: int | None = None) -> tuple[list[int], list[dict], list | None]:
    """(tokens, trace, entries) of the prompt appended (scored with `top`) then generated after, on a
    session that already holds a first turn."""
    with store.new("plain", model, chunk_size=CHUNK, seed=5) as s:
        s.append_text("First words.")
        entries = None
        if top is None:
            s.append_text(PROMPT)
        else:
            entries = s.append_scored(PROMPT, top=top)
        list(s.generate(N_NEW, trace=tmp_path / "plain.jsonl", stop_at_eos=False))
        return s.tokens, read_trace(tmp_path / "plain.jsonl"), entries


def failing_after(model, method: str, calls: int):
    """`model.<method>` raising (as a killed process stops) once it has run `calls` times."""
    real, count = getattr(model, method), [0]

    def counted(*args, **kwargs):
        count[0] += 1
        if count[0] > calls:
            raise RuntimeError("stopped here, as a killed process would")
        return real(*args, **kwargs)

    setattr(model, method, counted)
    return lambda: delattr(model, method)


@pytest.mark.parametrize("top", [None, 3], ids=["plain", "scored"])
def test_a_begun_call_is_append_then_generate_bit_for_bit(model, tmp_path, top):
    store = kvstore.open_store(tmp_path / "home")
    tokens, trace, entries = uninterrupted(store, model, tmp_path, top=top)
    with store.new("begun", model, chunk_size=CHUNK, seed=5) as s:
        s.append_text("First words.")
        got = s.begin(PROMPT, N_NEW, stop_at_eos=False, top=top)
        assert s.active_call["start"] == len(s.tokens)  # the reply starts after the prompt
        "".join(s.resume(trace=tmp_path / "begun.jsonl"))
        assert s.tokens == tokens and s.active_call is None
    assert read_trace(tmp_path / "begun.jsonl") == trace
    assert got == entries  # None unscored; else the same floats
    store.close()


def test_a_call_stopped_while_it_reads_its_prompt_is_resumed_and_holds_the_prompt_once(model, tmp_path):
    store = kvstore.open_store(tmp_path / "home")
    tokens, trace, _ = uninterrupted(store, model, tmp_path)
    with store.new("cut", model, chunk_size=CHUNK, seed=5) as s:
        s.append_text("First words.")
    s = store.open("cut", model)
    restore = failing_after(model, "feed", 2)
    try:
        with pytest.raises(RuntimeError, match="killed process"):
            s.begin(PROMPT, N_NEW, stop_at_eos=False)
    finally:
        restore()
    s.settle()
    s.lock.release()  # the process is gone: nothing else of it is written
    assert 0 < store.info("cut").n_cached < store.info("cut").n_tokens == len(tokens) - N_NEW
    with store.open("cut", model) as again:
        assert again.active_call is not None  # the prompt stands with its call
        "".join(again.resume(trace=tmp_path / "cut.jsonl"))
        assert again.tokens == tokens
    assert read_trace(tmp_path / "cut.jsonl") == trace
    store.close()


def test_a_prompt_appended_before_its_call_is_left_without_one(model, tmp_path):
    """What `begin` is for: `append_text` records the prompt first; stopped before `generate` records
    its call, the session holds the prompt and no call, and nothing says a request is unfinished."""
    store = kvstore.open_store(tmp_path / "home")
    with store.new("apart", model, chunk_size=CHUNK, seed=5) as s:
        s.append_text("First words.")
        restore = failing_after(model, "feed", 2)
        try:
            with pytest.raises(RuntimeError, match="killed process"):
                s.append_text(PROMPT)
        finally:
            restore()
        s.settle()
        s.lock.release()
    with store.open("apart", model) as again:
        assert again.active_call is None and again.pending  # a run of the request again appends it twice
    store.close()


def test_a_scoring_stopped_midway_leaves_the_session_as_it_was(model, tmp_path):
    store = kvstore.open_store(tmp_path / "home")
    tokens, trace, entries = uninterrupted(store, model, tmp_path, top=3)
    with store.new("scored", model, chunk_size=CHUNK, seed=5) as s:
        s.append_text("First words.")
        before = (list(s.tokens), s.n_cached, s.seq.hidden.clone(), store.info("scored").n_tokens)
        restore = failing_after(model, "feed_all", 2)
        try:
            with pytest.raises(RuntimeError, match="killed process"):
                s.begin(PROMPT, N_NEW, stop_at_eos=False, top=3)
        finally:
            restore()
        assert (s.tokens, s.n_cached, store.info("scored").n_tokens) == (before[0], before[1], before[3])
        assert s.active_call is None and s.seq.hidden.equal(before[2])
        assert s.begin(PROMPT, N_NEW, stop_at_eos=False, top=3) == entries  # the same call, again
        "".join(s.resume(trace=tmp_path / "again.jsonl"))
        assert s.tokens == tokens
    assert read_trace(tmp_path / "again.jsonl") == trace
    store.close()
