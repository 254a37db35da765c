"""Contract C1: a session that is checkpointed, closed or killed, and resumed produces exactly the
tokens and logits bits (equal trace lines: sha256 of every float32 logits row) of a run that never
stopped — in the same process, in a new process, after SIGKILL at random moments, after a kill
mid-prefill, through fork, pack and export/import, and across a new chat turn; from checkpoints
whose last token is pending (the end of a generation call) and from those that hold the last
token's state (a prefill's, mid-generation ones: C2 as kvstore amends it)."""

from __future__ import annotations

import random

import pytest
import torch

import kvstore
import store_harness as H

N_NEW = 48
MODES = {"greedy": {}, "sampled": H.SAMPLED}


@pytest.fixture(scope="module", params=sorted(MODES))
def mode(request):
    return request.param


@pytest.fixture(scope="module")
def reference(tmp_path_factory, model, mode):
    """(tokens, trace lines by position) of an uninterrupted run with N_NEW new tokens."""
    tmp = tmp_path_factory.mktemp(f"reference-{mode}")
    trace = tmp / "reference.jsonl"
    tokens = H.reference_run(tmp / "home", model, "ref", N_NEW, trace, **MODES[mode])
    return tokens, H.by_position(H.read_trace(trace))


def new_session(home, model, mode, name="s"):
    store = kvstore.open_store(home)
    s = store.new(name, model, seed=5, chunk_size=16, checkpoint_every=4, **MODES[mode])
    s.append_text(H.DOCUMENT)
    return store, s


def test_close_and_reopen_in_the_same_process(tmp_path, model, mode, reference):
    store, s = new_session(tmp_path / "home", model, mode)
    H.assert_matches(reference, *H.closed_and_reopened(store, s, model, N_NEW, tmp_path / "t.jsonl"))


def test_resume_into_reused_memory_full_of_nans(tmp_path, model, mode, reference):
    """The restored cache's memory comes from a closed session (`cache.POOL`): whatever it held,
    here NaN in every byte, never reaches a logit."""
    from kvstore.engine.cache import POOL

    store, s = new_session(tmp_path / "home", model, mode)
    trace = tmp_path / "t.jsonl"
    list(s.generate(N_NEW // 2, trace=trace, stop_at_eos=False))
    s.close()
    store.open("s", model).close()  # leaves memory the size of a restored cache in the pool
    for buf in POOL._free:
        buf.fill_(0xFF)  # bfloat16 0xFFFF is a NaN
    dirty = {buf.data_ptr() for buf in POOL._free}
    with store.open("s", model) as s:
        assert {t.untyped_storage().data_ptr() for t in s.seq.cache.layers} <= dirty
        list(s.generate(N_NEW - N_NEW // 2, trace=trace, stop_at_eos=False))
        H.assert_matches(reference, s.tokens, H.read_trace(trace))


def test_resume_in_a_new_process(tmp_path, model_path, model, mode, reference):
    store, s = new_session(tmp_path / "home", model, mode)
    s.close()
    trace = tmp_path / "t.jsonl"
    proc, conn = H.start(H.child_generate, str(tmp_path / "home"), model_path, "s", N_NEW, str(trace), 2)
    H.run_to_end(proc, conn)
    H.assert_matches(reference, store.tokens("s"), H.read_trace(trace))


def test_cache_reloads_with_identical_bytes(tmp_path, model, mode):
    store, s = new_session(tmp_path / "home", model, mode)
    list(s.generate(10, stop_at_eos=False))
    live = [t.clone() for t in s.seq.cache.state()]
    s.close()
    with store.open("s", model) as again:
        assert all(torch.equal(a, b) for a, b in zip(live, again.seq.cache.state()))
        assert again.pending == [again.tokens[-1]]  # C2: the last sampled token is not yet fed


@pytest.mark.parametrize("round_", range(10))
def test_sigkill_at_a_random_moment_during_generation(tmp_path, model_path, model, mode, reference, round_):
    rng = random.Random(f"{mode}-{round_}")
    store, s = new_session(tmp_path / "home", model, mode)
    s.close()
    trace = tmp_path / "t.jsonl"
    proc, conn = H.start(H.child_generate, str(tmp_path / "home"), model_path, "s", N_NEW, str(trace), 2)
    H.wait_for(conn, "ready")
    messages = H.kill_after(proc, conn, rng.uniform(0.0, 0.25))
    acked = [m for m in messages if m[0] == "ack"]
    with store.open("s", model) as s:
        if acked:  # C4: no acknowledged checkpoint is lost
            assert len(s.tokens) >= acked[-1][2]
        if s.active_call:
            for _ in s.resume(trace=trace):
                pass
        else:  # killed before the call was first recorded, or after it ended
            list(s.generate(len(reference[0]) - len(s.tokens), trace=trace, stop_at_eos=False))
        H.assert_matches(reference, s.tokens, H.read_trace(trace))


@pytest.mark.slow
@pytest.mark.parametrize("round_", range(10, 60))
def test_sigkill_many_more_moments(tmp_path, model_path, model, mode, reference, round_):
    test_sigkill_at_a_random_moment_during_generation(tmp_path, model_path, model, mode, reference, round_)


@pytest.mark.parametrize("kill_after_acks", [1, 3, 6])
def test_kill_mid_prefill_resumes_at_the_next_chunk(tmp_path, model_path, model, kill_after_acks):
    document = H.DOCUMENT * 2
    ref_store = kvstore.open_store(tmp_path / "ref")
    with ref_store.new("d", model, seed=5, chunk_size=8) as ref:
        ref.append_text(document)
        ref_trace = tmp_path / "ref.jsonl"
        list(ref.generate(8, trace=ref_trace, stop_at_eos=False))
    proc, conn = H.start(H.child_new_document, str(tmp_path / "home"), model_path, "d", document, 8)
    H.wait_for(conn, "ready")
    for _ in range(kill_after_acks):
        H.wait_for(conn, "ack")
    H.kill_after(proc, conn, 0.0)
    store = kvstore.open_store(tmp_path / "home")
    with store.open("d", model) as s:
        assert len(s.tokens) == len(ref_store.tokens("d")) - 8  # the whole document was recorded first
        assert s.seq.cache.length % 8 == 0 or s.seq.cache.length == len(s.tokens) - 1
        trace = tmp_path / "t.jsonl"
        list(s.generate(8, trace=trace, stop_at_eos=False))
        assert H.read_trace(trace) == H.read_trace(ref_trace)


def _reopened(store, tmp_path, model, way: str):
    """(store, name) of session 's' after it went through `way`."""
    if way == "fork":
        store.fork("s", "copy")
        return store, "copy"
    if way == "pack":
        store.pack("s")
    if way == "export":
        store.export("s", tmp_path / "s.kvs")
        other = kvstore.open_store(tmp_path / "other-home")
        return other, other.import_(tmp_path / "s.kvs", model=model)
    return store, "s"


@pytest.mark.parametrize("way", ["reopen", "fork", "pack", "export"])
def test_a_prefilled_document_resumes_from_its_last_tokens_state(tmp_path, model, mode, reference, way,
                                                                   monkeypatch):
    """A prefill's last checkpoint holds every token's KV and the last token's final state: the
    resumed session samples its first token from that state, feeding nothing through the layers
    first, and goes on exactly as the run that never stopped."""
    store, s = new_session(tmp_path / "home", model, mode)
    assert s.seq.cache.length == len(s.tokens)
    n_prompt = len(s.tokens)
    s.close()
    store, name = _reopened(store, tmp_path, model, way)
    fed = []
    real_feed = model.net.feed
    monkeypatch.setattr(model.net, "feed", lambda ids, pos, cache: fed.append(pos) or real_feed(ids, pos, cache))
    trace = tmp_path / "t.jsonl"
    with store.open(name, model) as s:
        assert s.pending == [] and s.seq.hidden is not None
        list(s.generate(N_NEW, trace=trace, stop_at_eos=False))
        H.assert_matches(reference, s.tokens, H.read_trace(trace))
    assert fed[0] == n_prompt  # the first feed is the first new token's: the prompt's last was not fed again


def test_fork_then_continue_replays_the_parent(tmp_path, model, mode, reference):
    store, s = new_session(tmp_path / "home", model, mode)
    list(s.generate(N_NEW, stop_at_eos=False))
    fork_at = len(reference[0]) - N_NEW + 20  # a decode position: the child re-draws the parent's tokens
    child = s.fork("child", at=fork_at)
    s.close()
    trace = tmp_path / "child.jsonl"
    list(child.generate(N_NEW - 20, trace=trace, stop_at_eos=False))
    H.assert_matches(reference, child.tokens, H.read_trace(trace))
    child.close()


def test_store_level_fork_then_continue(tmp_path, model, mode, reference):
    store, s = new_session(tmp_path / "home", model, mode)
    list(s.generate(10, stop_at_eos=False))
    s.close()
    store.fork("s", "copy")
    trace = tmp_path / "t.jsonl"
    with store.open("copy", model) as c:
        list(c.generate(N_NEW - 10, trace=trace, stop_at_eos=False))
        H.assert_matches(reference, c.tokens, H.read_trace(trace))


def test_pack_then_unpack_on_open(tmp_path, model, mode, reference):
    store, s = new_session(tmp_path / "home", model, mode)
    list(s.generate(10, stop_at_eos=False))
    s.close()
    stats = store.pack("s")
    assert stats["packed_bytes"] < stats["raw_bytes"]
    assert not list((tmp_path / "home" / "sessions").glob("*/layer-*.kv"))  # the raw files are freed
    trace = tmp_path / "t.jsonl"
    with store.open("s", model) as s:
        list(s.generate(N_NEW - 10, trace=trace, stop_at_eos=False))
        H.assert_matches(reference, s.tokens, H.read_trace(trace))


def test_export_then_import_into_another_home(tmp_path, model, mode, reference):
    store, s = new_session(tmp_path / "home", model, mode)
    list(s.generate(10, stop_at_eos=False))
    s.close()
    store.export("s", tmp_path / "s.kvs")
    other = kvstore.open_store(tmp_path / "other-home")
    assert other.import_(tmp_path / "s.kvs", model=model) == "s"
    trace = tmp_path / "t.jsonl"
    with other.open("s", model) as s:
        list(s.generate(N_NEW - 10, trace=trace, stop_at_eos=False))
        H.assert_matches(reference, s.tokens, H.read_trace(trace))


def test_a_new_chat_turn_after_resume(tmp_path, model, mode):
    turns = ["What does the store keep?", "And when a session stops?"]

    def chat(s, message, trace):
        return "".join(s.chat(message, max_new_tokens=12, trace=trace))

    live_store = kvstore.open_store(tmp_path / "live")
    with live_store.new("c", model, seed=3, system="Be brief.", **MODES[mode]) as live:
        live_replies = [chat(live, t, tmp_path / "live.jsonl") for t in turns]
    store = kvstore.open_store(tmp_path / "home")
    with store.new("c", model, seed=3, system="Be brief.", **MODES[mode]) as s:
        first = chat(s, turns[0], tmp_path / "resumed.jsonl")
    with store.open("c", model) as s:
        second = chat(s, turns[1], tmp_path / "resumed.jsonl")
        assert s.tokens == live_store.tokens("c")
    assert [first, second] == live_replies
    assert H.read_trace(tmp_path / "resumed.jsonl") == H.read_trace(tmp_path / "live.jsonl")
    roles = [m.role for m in store.messages("c")]
    assert roles == ["system", "user", "assistant", "user", "assistant"]


def test_a_cut_reply_is_known_as_the_reply_to_its_own_request_only(tmp_path, model, mode):
    """`unfinished_reply_to`: a request resent after its reply was cut is that reply's request
    (same messages, same settings) and `resume` finishes it as if nothing had happened; any other
    request, or once the reply has ended, is not."""
    question = [{"role": "user", "content": "What does the store keep?"}]
    settings = dict(stop=("zzz",), temperature=0.7)
    whole_store = kvstore.open_store(tmp_path / "whole")
    with whole_store.new("c", model, seed=3, **MODES[mode]) as s:
        whole = "".join(s.respond(question, 16, **settings))
    store = kvstore.open_store(tmp_path / "home")
    with store.new("c", model, seed=3, **MODES[mode]) as s:
        pieces = s.respond(question, 16, **settings)
        cut = "".join(next(pieces) for _ in range(6))
        pieces.close()  # interrupted: checkpointed with its call recorded
    with store.open("c", model) as s:
        assert s.unfinished_reply_to(question, 16, **settings)
        assert s.unfinished_reply_to([{**question[0], "name": "ignored"}], 16, **settings)  # role and text count
        assert not s.unfinished_reply_to([{"role": "user", "content": "Something else?"}], 16, **settings)
        assert not s.unfinished_reply_to(question + [{"role": "user", "content": "More?"}], 16, **settings)
        assert not s.unfinished_reply_to(question, 17, **settings)
        assert not s.unfinished_reply_to(question, 16, stop=(), temperature=0.7)
        assert not s.unfinished_reply_to(question, 16, stop=("zzz",), temperature=0.8)
        assert not s.unfinished_reply_to(question, 16, response_format={"type": "json_object"}, **settings)
        assert cut + "".join(s.resume()) == whole
        assert s.tokens == whole_store.tokens("c")
        assert not s.unfinished_reply_to(question, 16, **settings)  # it has ended


@pytest.mark.parametrize("first, bos", [("", False), ("", True), ("Before it. ", False)],
                         ids=["at-the-start", "at-the-start-after-bos", "after-text"])
def test_a_cut_generation_is_known_as_the_one_its_own_prompt_began(tmp_path, model, mode, first, bos, monkeypatch):
    """`unfinished_generation_after`: a completion resent after its generation was cut is the one
    that began it (its prompt just before the generation, as text or ids, the same settings): it
    says where the prompt began, and `resume` finishes the generation as if nothing had happened,
    the prompt held once; any other request, or once the generation has ended, is not. The prompt
    read at a session's start has the model's BOS before it, as `begin` read it there."""
    monkeypatch.setattr(model.tokenizer, "add_bos", bos)
    prompt = "The store keeps every layer of the cache"
    settings = dict(stop=("zzz",), temperature=0.7)
    whole_store = kvstore.open_store(tmp_path / "whole")
    with whole_store.new("c", model, seed=3, **MODES[mode]) as s:
        if first:
            s.append_text(first)
        s.begin(prompt, 16, **settings)
        whole = "".join(s.resume())
    store = kvstore.open_store(tmp_path / "home")
    with store.new("c", model, seed=3, **MODES[mode]) as s:
        if first:
            s.append_text(first)
        base = len(s.tokens)
        s.begin(prompt, 16, **settings)
        ids = s.tokens[base:]
        assert (ids[0] == model.tokenizer.bos_id) == bos
        pieces = s.resume()
        cut = "".join(next(pieces) for _ in range(6))
        pieces.close()  # interrupted: checkpointed with its call recorded
    with store.open("c", model) as s:
        assert s.unfinished_generation_after(prompt, 16, **settings) == base
        assert s.unfinished_generation_after(ids, 16, **settings) == base  # the same prompt as ids
        assert s.unfinished_generation_after(ids[1:], 16, **settings) == base + 1  # its end is a prompt too
        assert s.unfinished_generation_after(prompt + ".", 16, **settings) is None
        assert s.unfinished_generation_after("Something else", 16, **settings) is None
        assert s.unfinished_generation_after(prompt, 17, **settings) is None
        assert s.unfinished_generation_after(prompt, 16, stop=(), temperature=0.7) is None
        assert s.unfinished_generation_after(prompt, 16, stop=("zzz",), temperature=0.8) is None
        assert s.unfinished_generation_after(prompt, 16, stop_at_eos=False, **settings) is None
        assert s.unfinished_generation_after(prompt, 16, response_format={"type": "json_object"}, **settings) is None
        assert not s.unfinished_reply_to([{"role": "user", "content": prompt}], 16, **settings)  # not a chat reply
        assert cut + "".join(s.resume()) == whole
        assert s.tokens == whole_store.tokens("c")
        assert s.unfinished_generation_after(prompt, 16, **settings) is None  # it has ended


def test_a_warmed_up_store_opens_a_session_without_compiling_a_statement(tmp_path, model, monkeypatch):
    """Store.warm_up (what `kvstore serve` runs before it says it is ready) compiles an open's index
    statements and starts the restore's threads, so a process's first open pauses for neither; it
    reads no session and writes nothing."""
    import threading

    from sqlalchemy.sql.compiler import SQLCompiler

    from kvstore.store import workers

    home = tmp_path / "home"
    with kvstore.open_store(home) as store:
        s = store.new("s", model, chunk_size=16)
        s.append_text(H.DOCUMENT)
        s.close()
    compiled: list[str] = []
    compile_ = SQLCompiler.__init__

    def counted(self, *args, **kwargs):
        compiled.append(type(self).__name__)
        compile_(self, *args, **kwargs)

    def compiles_in_open(store) -> int:
        compiled.clear()
        monkeypatch.setattr(SQLCompiler, "__init__", counted)
        try:
            session = store.open("s", model)
        finally:
            monkeypatch.setattr(SQLCompiler, "__init__", compile_)
        session.close()
        return len(compiled)

    with kvstore.open_store(home) as cold:  # a new engine: nothing compiled yet
        assert compiles_in_open(cold) > 0
    with kvstore.open_store(home) as warm:
        listed = [(i.name, i.n_tokens) for i in warm.list()]
        files = sorted(p.relative_to(home) for p in home.rglob("*") if "kvstore.db" not in p.name)
        warm.warm_up()
        assert [(i.name, i.n_tokens) for i in warm.list()] == listed
        assert sorted(p.relative_to(home) for p in home.rglob("*") if "kvstore.db" not in p.name) == files
        helpers = [t for t in threading.enumerate() if t.name.startswith(workers.PREFIX)]
        assert len(helpers) >= 4 and any(t.name.startswith("kvstore-sync") for t in threading.enumerate())
        assert compiles_in_open(warm) == 0
