"""The engine process's loop, in this process with a fake pipe: how it takes turns.

Every running job is advanced one step per round: a token, or one prefill chunk of a prompt. So a
session that reads a long prompt does not hold back another session's reply, and the order in
which events leave the engine shows it exactly (no timing involved).
"""

from __future__ import annotations

import subprocess
import sys

import kvstore
from kvstore_serve.engine import Engine, Loop

CHUNK = 16


class FakePipe:
    """The engine's end of the pipe: messages queued in, events collected out (a step's events in
    `sent` one by one, as the API process reads them; `messages`: what went down the pipe)."""

    def __init__(self, messages):
        self.inbox, self.sent, self.messages = list(messages), [], []

    def poll(self, timeout=0):
        return bool(self.inbox)

    def recv(self):
        return self.inbox.pop(0)

    def send(self, msg):
        self.messages.append(msg)
        self.sent.extend(msg["events"] if msg["event"] == "step" else [msg])


def run_loop(store, model, jobs: list[dict]) -> list[dict]:
    """Run `jobs` in an engine loop on `store` until they are done; every message it sent."""
    engine = Engine(store, model)
    pipe = FakePipe([*jobs, {"op": "stop"}])
    try:
        Loop(pipe, engine).run()
    finally:
        engine.close()
    return pipe.sent


def chat_job(job_id: str, session: str, text: str, max_tokens: int) -> dict:
    return {"op": "run", "id": job_id, "kind": "chat", "session": session,
            "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "stop": [],
            "sampling": {"temperature": 0.0}, "create": {"seed": 1, "chunk_size": CHUNK}}


def test_a_long_prompt_is_read_a_chunk_per_turn_while_another_session_replies(tmp_path, model):
    store = kvstore.open_store(tmp_path / "home")
    engine = Engine(store, model)
    document = " ".join(f"word{i}" for i in range(25))  # about 10 chunks of 16 tokens
    pipe = FakePipe([chat_job("long", "reader", document, 4), chat_job("short", "chatter", "hi", 3),
                     {"op": "stop"}])
    try:
        Loop(pipe, engine).run()
    finally:
        engine.close()
    order = [(m["id"], m["event"]) for m in pipe.sent if m["event"] != "stats"]
    assert order.count(("short", "token")) == 3 and order.count(("long", "token")) == 4
    assert order.index(("short", "end")) < order.index(("long", "token")), order  # done while the long one read
    ends = {m["id"]: m for m in pipe.sent if m["event"] == "end"}
    assert ends["long"]["prompt_tokens"] > 8 * CHUNK
    assert store.info("reader").checkpoints > 8  # a checkpoint per chunk, as in the library
    store.close()


def test_a_scored_prompt_is_read_a_call_per_step_while_another_session_replies(tmp_path, model):
    """Echo with logprobs scores a prompt outside the batched feeds (every row's state, then the head
    over them), one such call a step: the other session's tokens go on between its chunks, and the
    scores are the library's."""
    store = kvstore.open_store(tmp_path / "home")
    document = " ".join(f"word{i}" for i in range(25))  # about 10 chunks of 16 tokens
    score = {"op": "run", "id": "score", "kind": "complete", "session": "scorer", "prompt": document, "echo": True,
             "logprobs": 1, "max_tokens": 0, "stop": [], "sampling": {}, "create": {"seed": 1, "chunk_size": CHUNK}}
    sent = run_loop(store, model, [score, chat_job("short", "chatter", "hi", 30)])
    order = [(m["id"], m["event"]) for m in sent if m["event"] != "stats"]
    (prompt,) = [m for m in sent if m["event"] == "prompt"]
    chunks = -(-len(prompt["logprobs"]) // CHUNK)
    meanwhile = order[:order.index(("score", "prompt"))].count(("short", "token"))
    assert chunks >= 4 and meanwhile >= chunks, order  # a token at least per chunk, while it was scored
    with store.new("lib", model, chunk_size=CHUNK) as s:
        expected = s.append_scored(document, top=1)
    assert [e["logprob"] for e in prompt["logprobs"]] == [None if e is None else e["logprob"] for e in expected]
    store.close()


def test_interleaving_changes_no_bit(tmp_path, model):
    """The two sessions' replies, run together, equal each one run alone."""

    def run(jobs):
        store = kvstore.open_store(tmp_path / f"home-{len(jobs)}-{jobs[0]['id']}")
        try:
            sent = run_loop(store, model, jobs)
        finally:
            store.close()
        return {j["id"]: [(m["position"], m["token"], m["logits_sha256"]) for m in sent
                          if m.get("id") == j["id"] and m["event"] == "token"] for j in jobs}

    a = chat_job("a", "one", " ".join(f"w{i}" for i in range(16)), 6)
    b = chat_job("b", "two", "hello there", 6)
    together = run([a, b])
    assert together == {**run([a]), **run([b])}


def test_a_job_that_did_not_ask_for_the_trace_gets_the_same_tokens_without_hashing_the_logits(tmp_path, model):
    """The logits' hash (0.1 ms a token for a real vocabulary) is made only for a client that asked for
    the trace (`kvstore_trace`, which the API process hands on as the job's "trace")."""
    def tokens(job):
        store = kvstore.open_store(tmp_path / f"home-{job['id']}")
        try:
            sent = run_loop(store, model, [job])
        finally:
            store.close()
        return [(m["position"], m["token"], m["logits_sha256"]) for m in sent if m["event"] == "token"]

    asked = tokens({**chat_job("a", "one", "hello there", 5), "trace": True})
    plain = tokens({**chat_job("b", "one", "hello there", 5), "trace": False})
    assert [t[:2] for t in plain] == [t[:2] for t in asked] and len(asked) == 5
    assert all(len(h) == 64 for _, _, h in asked) and all(h is None for _, _, h in plain)


def test_the_events_of_one_step_go_to_the_api_process_in_one_message(tmp_path, model):
    store = kvstore.open_store(tmp_path / "home")
    engine = Engine(store, model)
    pipe = FakePipe([chat_job("a", "one", "hello there", 4), chat_job("b", "two", "good morning", 4), {"op": "stop"}])
    try:
        Loop(pipe, engine).run()
    finally:
        engine.close()
    steps = [[e["id"] for e in m["events"]] for m in pipe.messages if m["event"] == "step"]
    assert ["a", "b"] in steps  # both sessions' tokens of a step: one wake-up of the API process
    assert all(len(ids) > 1 for ids in steps) and not any(m["event"] == "step" for m in pipe.sent)
    for job in ("a", "b"):
        assert [m["event"] for m in pipe.sent if m.get("id") == job][-5:] == ["token"] * 4 + ["end"]
    store.close()


def test_a_conversation_that_ends_with_the_assistant_is_answered_whole_not_as_a_user_turn(tmp_path, model):
    store = kvstore.open_store(tmp_path / "home")
    engine = Engine(store, model)
    first = chat_job("one", "talk", "hello there", 3)
    messages = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "Sure, here"}]
    pipe = FakePipe([first, {**chat_job("two", "talk", "", 3), "messages": messages}, {"op": "stop"}])
    try:
        Loop(pipe, engine).run()
    finally:
        engine.close()
    assert [m["event"] for m in pipe.sent if m.get("id") == "two"][-1] == "end"
    roles = [(m.role, m.text) for m in store.messages("talk")][:2]
    assert roles == [("user", "hello there"), ("assistant", "Sure, here")]  # not chatted as the user's words
    store.close()


def test_the_warm_up_leaves_the_first_chat_turn_nothing_to_import_or_compile(model_path):
    """What a first request after a start would pay once, the engine pays before it says ready: the
    chat template's engine (jinja2) imported and the template compiled, a session's modules imported.
    In a fresh interpreter, since this one has them all."""
    script = (
        "import sys, kvstore\n"
        "from kvstore_serve.engine import warm_up\n"
        f"model = kvstore.load_model({model_path!r})\n"
        "assert model.tokenizer.chat_template\n"
        "before = {m for m in ('jinja2', 'kvstore.session') if m in sys.modules}\n"
        "warm_up(model)\n"
        "after = {m for m in ('jinja2', 'kvstore.session') if m in sys.modules}\n"
        "print(sorted(before), sorted(after), model.tokenizer._template is not None)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split("\n")[0] == "[] ['jinja2', 'kvstore.session'] True", out.stdout + out.stderr


def complete_job(job_id: str, **more) -> dict:
    return {"op": "run", "id": job_id, "kind": "complete", "session": "doc", "prompt": " and then some more words",
            "echo": True, "max_tokens": 6, "stop": [], "sampling": {"temperature": 0.0}, "trace": True,
            "create": {"seed": 1, "chunk_size": CHUNK}, **more}


def test_a_completion_run_again_after_its_engine_died_replays_what_it_recorded(tmp_path, model):
    """The API process runs a job again when its engine dies (`pool.Pool._resubmit`: `after` -1 where
    no token came). A completion whose prompt and reply the dead engine had recorded, its end event
    lost, is replayed from the store from `base` (its first start event's session length), the
    prompt not appended again; its echo is sent again where it had not come (`prompt_sent`)."""
    store = kvstore.open_store(tmp_path / "home")
    first = run_loop(store, model, [complete_job("first", prompt="Some words to begin with", echo=False)])
    base = len(store.tokens("doc"))
    sent = run_loop(store, model, [complete_job("cut")])
    (start,) = [m for m in sent if m["event"] == "start"]
    assert start["base"] == base and first
    held = store.tokens("doc")

    def again(**flags) -> list[dict]:
        return [m for m in run_loop(store, model, [complete_job("again", after=-1, reply_start=None, **flags)])
                if m["event"] != "stats"]

    replayed = again(base=base, prompt_sent=False)
    assert store.tokens("doc") == held  # nothing appended
    tokens = lambda events: [m["position"] for m in events if m["event"] == "token"]  # noqa: E731
    assert tokens(replayed) == tokens([m for m in sent if m["event"] != "stats"])
    assert [m["text"] for m in replayed if m["event"] == "prompt"] == [" and then some more words"]
    assert not [m for m in again(base=base, prompt_sent=True) if m["event"] == "prompt"]
    (error,) = [m for m in again(base=base, prompt_sent=False, logprobs=1) if m["event"] == "error"]
    assert error["code"] == "engine_failed" and "resend the request to a new session" in error["message"]
    assert store.tokens("doc") == held
    again(base=None)  # a job without its base (an engine before this one) runs afresh: the prompt twice
    assert len(store.tokens("doc")) > len(held)
    store.close()


def test_writes_run_again_after_their_engine_died_answer_as_the_first_run_did(tmp_path, model):
    """A write whose engine died after it committed, before its end event reached the API process, is
    run again with its first start event's `base` (`pool.Pool._resubmit`). It answers as the first run
    would have: a conversation's items are not added twice, a conversation, session, fork or import
    made is taken as made (not a 409), a session deleted as deleted (not a 404). Without `base` (a run that
    never got to its write) the same job is checked as new."""
    store = kvstore.open_store(tmp_path / "home")
    settings = {"seed": 1, "chunk_size": CHUNK}
    items = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi. What now?"}]

    def events(kind: str, **spec) -> list[dict]:
        return [m for m in run_loop(store, model, [{"op": "run", "id": kind, "kind": kind, **spec}])
                if m["event"] != "stats"]

    def again(kind: str, base, **spec) -> list[dict]:
        return events(kind, after=-1, reply_start=None, base=base, **spec)

    def error(sent: list[dict]) -> int:
        (e,) = [m for m in sent if m["event"] == "error"]
        return e["status"]

    made = events("conversation", session="conv", create=settings, items=items)
    assert [m["base"] for m in made if m["event"] == "start"] == [0] and made[-1]["count"] == 2
    assert again("conversation", 0, session="conv", create=settings, items=items)[-1] == made[-1]
    assert [(m.role, m.text) for m in store.messages("conv")] == [(m["role"], m["content"]) for m in items]
    assert error(events("conversation", session="conv", create=settings, items=items)) == 409

    more = [{"role": "user", "content": "Tell me more"}]
    added = events("items", session="conv", items=more)
    assert [m["base"] for m in added if m["event"] == "start"] == [2] and (added[-1]["first"], added[-1]["count"]) == (2, 1)
    assert again("items", 2, session="conv", items=more)[-1] == added[-1]
    assert len(store.messages("conv")) == 3
    # a first run that died before its items were committed: they are added now
    assert (again("items", 3, session="conv", items=more)[-1]["first"], len(store.messages("conv"))) == (3, 4)

    for write in ({"kind": "create", "session": "fresh", "settings": settings},
                  {"kind": "fork", "session": "conv", "new_name": "copy"}):
        first = events(**write)
        assert [m["base"] for m in first if m["event"] == "start"] == [0] and first[-1]["event"] == "end"
        assert again(**write, base=0)[-1] == first[-1]
        assert error(events(**write)) == 409
    assert store.tokens("copy") == store.tokens("conv")

    archive = tmp_path / "conv.kvs"
    store.export("conv", archive)
    write = {"kind": "import", "session": "imported", "path": str(archive), "new_name": "imported"}
    first = events(**write)
    assert [m["base"] for m in first if m["event"] == "start"] == [0] and first[-1]["session"] == "imported"
    assert again(**write, base=0)[-1] == first[-1] and error(events(**write)) == 409
    assert store.tokens("imported") == store.tokens("conv")
    store.export("fresh", tmp_path / "fresh.kvs")  # unnamed: the archive's own name, free again
    store.delete("fresh")
    write = {"kind": "import", "session": "import-x", "path": str(tmp_path / "fresh.kvs")}
    first = events(**write)
    assert first[-1]["session"] == "fresh" and again(**write, base=0)[-1] == first[-1] and error(events(**write)) == 409

    gone = events("delete", session="copy")
    assert [m["base"] for m in gone if m["event"] == "start"] == [0] and gone[-1]["event"] == "end"
    assert again("delete", 0, session="copy")[-1] == gone[-1]
    assert error(events("delete", session="copy")) == 404
    assert "copy" not in store.names() and {"conv", "fresh", "imported"} <= set(store.names())
    store.close()
