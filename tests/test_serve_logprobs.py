"""Log-probabilities over HTTP: OpenAI's `logprobs` / `top_logprobs` (chat), `logprobs: k`
(completions) and `include: ["message.output_text.logprobs"]` (responses), as byte-identical as the
logits they come from.

Each token's entry is the natural log of its probability under the model's distribution (the float32
log-softmax of the logits row it was sampled from, before temperature and top-p) and the k likeliest
tokens' (`kvstore.engine.trace.token_logprobs`). The proofs: the numbers equal a float64 reference
of the same rows (`assert_close`: a reference, not our bits); the entries over HTTP are the
library's for the same conversation exactly (its trace with log-probabilities, `==` on the floats),
alone or in a step beside other sessions; a stream's entries are the whole reply's; the bytes of the
tokens spell the reply.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch

import kvstore
from conftest import single_thread
from kvstore.engine.trace import token_logprobs
from serve_kit import MODEL_NAME
from serve_kit import LiveServer
from test_serve_chat import (CHUNK, long_request, model_folder, server, sse_events,  # noqa: F401 (fixtures)
                             stream_events, text_of)

SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 7}
TOP = 3


class Collector:
    """A trace target that asks for log-probabilities (as the server's collector does)."""

    def __init__(self, top: int):
        self.digests, self.top_logprobs, self.lines = True, top, []

    def write(self, text: str) -> None:
        self.lines += [json.loads(line) for line in text.splitlines() if line.strip()]

    def flush(self) -> None:
        pass


def library_chat(folder: str, home, message: str, max_tokens: int) -> list[dict]:
    """The same one-turn conversation through the library: its trace lines with log-probabilities."""
    model = kvstore.load_model(folder)
    store = kvstore.open_store(home)
    lines = Collector(TOP)
    with single_thread(), store.new("lib", model, seed=SEEDED["seed"], chunk_size=CHUNK,
                                    temperature=SEEDED["temperature"], top_p=SEEDED["top_p"]) as s:
        "".join(s.chat(message, max_tokens, trace=lines))
    store.close()
    return lines.lines


def entries_as_lines(entries) -> list[tuple]:
    """(logprob, [logprob of each alternative]) of each entry: what the library's lines say of it."""
    return [(e.logprob, [t.logprob for t in e.top_logprobs]) for e in entries]


def test_token_logprobs_are_the_log_softmax_of_the_row_likeliest_first():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(500, generator=gen) * 4
        token = int(torch.randint(0, 500, (1,), generator=gen))
        got = token_logprobs(logits, token, 5)
        reference = torch.log_softmax(logits.double(), dim=-1)  # float32 tolerances: ours is float32
        torch.testing.assert_close(torch.tensor(got["logprob"]), reference[token].float())
        ids = [i for i, _ in got["top_logprobs"]]
        assert ids == reference.argsort(descending=True)[:5].tolist()
        torch.testing.assert_close(torch.tensor([lp for _, lp in got["top_logprobs"]]), reference[ids].float())
    assert token_logprobs(logits, 3, 0)["top_logprobs"] == []


def test_chat_logprobs_over_http_are_the_librarys_bit_for_bit(server, model_folder, tmp_path):
    message = "tell me something"
    reply = server.client().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": message}], max_tokens=16, logprobs=True,
        top_logprobs=TOP, extra_body={"session": "lp", "kvstore_trace": True}, **SEEDED)
    entries = reply.choices[0].logprobs.content
    assert len(entries) == reply.usage.completion_tokens == 16
    lines = library_chat(model_folder, tmp_path / "lib", message, 16)
    assert [(d["logprob"], [lp for _, lp in d["top_logprobs"]]) for d in lines] == entries_as_lines(entries)
    assert [(d["position"], d["token"], d["logits_sha256"]) for d in lines] == \
        [(d["position"], d["token"], d["logits_sha256"]) for d in reply.kvstore["trace"]]
    tokenizer = kvstore.load_model(model_folder).tokenizer
    for d, e in zip(lines, entries):
        assert bytes(e.bytes) == tokenizer.token_bytes(d["token"])
        assert [bytes(t.bytes) for t in e.top_logprobs] == [tokenizer.token_bytes(i) for i, _ in d["top_logprobs"]]
        assert len(e.top_logprobs) == TOP
        assert all(a.logprob >= b.logprob for a, b in zip(e.top_logprobs, e.top_logprobs[1:]))
        assert e.logprob <= e.top_logprobs[0].logprob < 0


def test_greedy_tokens_are_their_rows_likeliest_and_their_bytes_spell_the_reply(server):
    reply = server.client().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hello there"}], max_tokens=12, temperature=0,
        logprobs=True, top_logprobs=1, stop=None)
    entries = reply.choices[0].logprobs.content
    assert all(e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob for e in entries)
    if reply.choices[0].finish_reason == "length":  # (an end of text token adds bytes the reply leaves out)
        assert b"".join(bytes(e.bytes) for e in entries).decode("utf-8", "replace") == reply.choices[0].message.content


def test_a_streams_logprobs_are_the_whole_replys(server):
    client = server.client()
    ask = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "stream me"}], max_tokens=20, logprobs=True,
               top_logprobs=2, **SEEDED)
    whole = client.chat.completions.create(**ask, extra_body={"session": "lp-whole"})
    chunks = list(client.chat.completions.create(**ask, stream=True, extra_body={"session": "lp-streamed"}))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in whole.choices[0].logprobs.content]
    assert len(streamed) == whole.usage.completion_tokens
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content


def test_completions_give_the_legacy_shape(server):
    client = server.client()
    ask = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=10, temperature=0, logprobs=2)
    whole = client.completions.create(**ask).choices[0]
    lp = whole.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # the 2 likeliest and the sampled token, by text: tokens of one text (parts of characters, all
        # "\ufffd") are one key, as in OpenAI's format, the sampled token's value kept
        assert top[token] == logprob and 1 <= len(top) <= 3
        assert logprob == max(top.values())  # greedy
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(10)]
    streamed = [c.choices[0].logprobs for c in client.completions.create(**ask, stream=True)
                if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [x for s in streamed for x in s.token_logprobs] == lp.token_logprobs
    assert [x for s in streamed for x in s.text_offset] == lp.text_offset


def test_no_logprobs_unless_asked(server):
    reply = server.client().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert reply.choices[0].logprobs is None
    chunks = server.client().completions.create(model=MODEL_NAME, prompt="hi", max_tokens=4, stream=True)
    assert all(c.choices[0].logprobs is None for c in chunks if c.choices)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ("/v1/responses", {"top_logprobs": 21}, "top_logprobs"),
    ("/v1/responses", {"include": ["message.output_text.logprob"]}, "include"),  # a typo is no include
])
def test_logprobs_out_of_bounds_are_400s_naming_the_field(server, path, body, param):
    base = {"model": MODEL_NAME, "max_tokens": 2}
    base |= {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else \
        {"prompt": "x"} if path == "/v1/completions" else {"input": "x", "max_output_tokens": 2}
    if path == "/v1/responses":
        del base["max_tokens"]
    r = httpx.post(server.url + path, json=base | body, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"


def test_tokens_a_resumed_stream_replays_from_the_store_have_none(server):
    """Last-Event-ID after a whole reply: the tokens after that id come from the store, not computed
    again, so their chunks carry the text and `logprobs: null`."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "again"}], "max_tokens": 12,
            "stream": True, "session": "lp-resume", "logprobs": True, "top_logprobs": 1, **SEEDED}
    whole = stream_events(server, body, {})
    with_entries = [d for _, d in whole if d and d["choices"] and d["choices"][0]["logprobs"]]
    assert sum(len(d["choices"][0]["logprobs"]["content"]) for d in with_entries) == 12
    ids = [i for i, d in whole if i and d and d["choices"] and d["choices"][0]["logprobs"]]
    rest = stream_events(server, body, {"Last-Event-ID": ids[4]})
    replayed = [d for _, d in rest if d and d["choices"] and d["choices"][0]["finish_reason"] is None]
    after = [i for i, _ in whole].index(ids[4]) + 1
    assert text_of(rest) == text_of(whole[after:]) and text_of(rest)
    assert replayed and all(d["choices"][0]["logprobs"] is None for d in replayed)


def test_a_responses_logprobs_are_chats_for_the_same_conversation(server):
    """The Responses API asks with `include` (and `top_logprobs`); its entries are those a chat
    completion gets for the same conversation, whole and streamed (deltas, then all at the end)."""
    client = server.client()
    chat_reply = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "what now"}], max_tokens=10, logprobs=True,
        top_logprobs=2, **SEEDED)
    expected = [e.model_dump() for e in chat_reply.choices[0].logprobs.content]
    ask = dict(model=MODEL_NAME, input="what now", max_output_tokens=10, temperature=SEEDED["temperature"],
               top_p=SEEDED["top_p"], include=["message.output_text.logprobs"], top_logprobs=2,
               extra_body={"seed": SEEDED["seed"]})
    whole = client.responses.create(**ask)
    part = whole.output[0].content[0]
    assert part.text == chat_reply.choices[0].message.content
    assert [e.model_dump() for e in part.logprobs] == expected
    events = list(client.responses.create(**ask, stream=True))
    deltas = [e for ev in events if ev.type == "response.output_text.delta" for e in ev.logprobs]
    assert [e.model_dump() for e in deltas] == expected
    done = next(ev for ev in events if ev.type == "response.output_text.done")
    assert [e.model_dump() for e in done.logprobs] == expected
    stored = client.responses.retrieve(whole.id)  # read back from the session: the logits are not kept
    assert stored.output[0].content[0].text == part.text and stored.output[0].content[0].logprobs == []


def test_includes_of_output_this_server_never_makes_are_answered_as_is(server):
    r = server.client().responses.create(model=MODEL_NAME, input="hi", max_output_tokens=3,
                                         include=["reasoning.encrypted_content"])
    assert r.output[0].content[0].logprobs == [] and r.status in ("completed", "incomplete")


def entries_by_position(events) -> dict[int, dict]:
    """Each streamed token's logprobs entry, by its position (the event id's last part)."""
    return {int(i.rsplit("/", 1)[1]): d["choices"][0]["logprobs"]["content"][0] for i, d in events
            if i and d and d["choices"] and d["choices"][0]["logprobs"]}


def test_a_stream_with_logprobs_survives_kill_9_of_its_engine_and_of_the_server(tmp_path, model_folder):
    """Cut by kill -9 (of the engine mid-stream; of the whole server, then Last-Event-ID), the reply
    is whole and every entry it carries is the uncut run's for that position (tokens replayed from
    the store carry none: test_tokens_a_resumed_stream_replays_from_the_store_have_none)."""
    def body(session: str) -> dict:
        return long_request(session) | {"max_tokens": 60, "logprobs": True, "top_logprobs": 2}

    with LiveServer(tmp_path / "home", model_folder, "--chunk-size", str(CHUNK), "--threads", "1",
                    "--checkpoint-every", "4") as live:
        whole = stream_events(live, body("uncut"), {})
        expected = entries_by_position(whole)
        assert len(expected) == 60

        def same(events) -> None:
            got = entries_by_position(events)
            assert text_of(events) == text_of(whole) and events[-1][1] is None
            assert len(got) >= 20 and all(expected[p] == e for p, e in got.items())

        killed = []
        with httpx.stream("POST", live.url + "/v1/chat/completions", json=body("cut-engine"), timeout=120) as r:
            events = sse_events(r.iter_lines(), lambda out: len(out) == 30 and not killed
                                and killed.append(live.kill_engine()))
        assert killed
        same(events)
        got = stream_events(live, body("cut-server"), {}, stop_after=30)
        live.kill()
        live.start()
        same(got + stream_events(live, body("cut-server"), {"Last-Event-ID": [i for i, _ in got if i][-1]}))
