"""`kvstore serve` as an OpenAI-compatible chat server whose conversations are stored sessions.

A live server (the real executable, a random loopback port, the tiny Llama, 16-token chunks, one
thread) and the official `openai` client. The proofs are exact: a conversation held over HTTP
gives the same tokens and logits bits (trace lines: position, token, sha256 of the logits row) as
the same conversation through the library; an edited history is answered exactly as a cold run of
the same request; streams broken by `kill -9` of the server or of its engine are finished, and the
client's whole reply equals an uninterrupted one.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

import kvstore
from conftest import single_thread
from serve_kit import MODEL_NAME, LiveServer

CHUNK = 16
SAMPLING = {"temperature": 0.9, "top_p": 0.95, "seed": 7}
TURNS = ["hello there", "tell me more", "and then?"]


@pytest.fixture(scope="module")
def model_folder(tiny) -> str:
    return str(tiny("llama-gqa").folder)


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_folder):
    home = tmp_path_factory.mktemp("serve") / "home"
    with LiveServer(home, model_folder, "--chunk-size", str(CHUNK), "--threads", "1",
                    "--checkpoint-every", "4") as s:
        yield s


def chat(client, session: str | None, messages: list[dict], max_tokens: int = 24, extra_body_more=None, **kw):
    extra = {"kvstore_trace": True, **({"session": session} if session else {}), **(extra_body_more or {})}
    return client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=max_tokens,
                                          extra_body=extra, **{**SAMPLING, **kw})


def library_conversation(folder: str, home, turns: list[str], max_tokens: int = 24,
                         chunk: int = CHUNK, more: dict | None = None, fmt: dict | None = None) -> list[list[dict]]:
    """The same conversation through the library: trace lines per turn (`more`: other sampler settings,
    `fmt`: every turn's response format)."""
    model = kvstore.load_model(folder)
    store = kvstore.open_store(home)
    traces = []
    with single_thread(), store.new("lib", model, seed=SAMPLING["seed"], chunk_size=chunk,
                                    temperature=SAMPLING["temperature"], top_p=SAMPLING["top_p"], **(more or {})) as s:
        for i, turn in enumerate(turns):
            path = home / f"turn-{i}.jsonl"
            "".join(s.chat(turn, max_tokens, trace=str(path), response_format=fmt))
            traces.append([json.loads(line) for line in path.read_text().splitlines()])
    store.close()
    return traces


def test_models_lists_the_served_model(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


def test_a_conversation_over_http_is_the_librarys_bit_for_bit(server, model_folder, tmp_path):
    client = server.client()
    messages, http_traces, cached = [], [], []
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        reply = chat(client, "talk", messages)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        http_traces.append(reply.kvstore["trace"])
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        assert reply.usage.completion_tokens == len(reply.kvstore["trace"])
    assert library_conversation(model_folder, tmp_path / "lib", TURNS) == http_traces
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > cached[1]  # later turns feed only the new message


def test_every_sampler_setting_over_http_is_the_librarys(server, model_folder, tmp_path):
    """OpenAI's presence and frequency penalties and the library's top_k, min_p and repetition penalty
    (vLLM's names): the reply is the library's with the same settings, token for token and bit for bit."""
    more = {"presence_penalty": 1.2, "frequency_penalty": 0.6, "top_k": 40, "min_p": 0.02, "repetition_penalty": 1.1}
    reply = chat(server.client(), "tuned", [{"role": "user", "content": TURNS[0]}], extra_body_more=more)
    assert library_conversation(model_folder, tmp_path / "lib", TURNS[:1], more=more) == [reply.kvstore["trace"]]
    plain = library_conversation(model_folder, tmp_path / "plain", TURNS[:1])
    assert [t["token"] for t in plain[0]] != [t["token"] for t in reply.kvstore["trace"]]  # they did something


def test_logit_bias_over_http_is_the_librarys_and_a_bad_one_is_a_400(server, model_folder, tmp_path):
    """OpenAI's logit_bias (token ids as the JSON object's keys): the reply is the library's with the
    same bias, bit for bit; +100 all but forces a token. Ids that are not whole numbers, biases beyond
    [-100, 100] and ids past the model's vocabulary are 400s naming the setting, and the session is
    left as it was."""
    bias = {"5": 3.0, "9": -100}
    reply = chat(server.client(), "biased", [{"role": "user", "content": TURNS[0]}], logit_bias=bias)
    assert library_conversation(model_folder, tmp_path / "lib", TURNS[:1], more={"logit_bias": bias}) == \
        [reply.kvstore["trace"]]
    assert 9 not in [t["token"] for t in reply.kvstore["trace"]]
    forced = chat(server.client(), None, [{"role": "user", "content": TURNS[0]}], max_tokens=6,
                  logit_bias={"5": 100})
    assert [t["token"] for t in forced.kvstore["trace"]] == [5] * 6
    http = server.http()
    before = http.get("/v1/sessions/biased").json()
    for bad, why in (({"x": 1}, "logit_bias maps token ids"), ({"5": 101}, "logit_bias maps token ids"),
                     ({"100000": 1}, "logit_bias names token id 100000")):
        r = http.post("/v1/chat/completions", headers={"X-Session-Id": "biased"},
                      json={"model": MODEL_NAME, "messages": [{"role": "user", "content": TURNS[0]}], "max_tokens": 2,
                            "logit_bias": bad})
        assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
        assert r.json()["error"]["code"] == "invalid_value"
    assert http.get("/v1/sessions/biased").json() == before


PHONE = {"type": "regex", "pattern": "[0-9]{3}-[0-9]{4}"}
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}}, "required": ["answer"],
                 "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}


def test_response_format_over_http_is_the_librarys_and_a_bad_one_is_a_400(server, model_folder, tmp_path):
    """OpenAI's response_format (json_schema, json_object, text) and kvstore's regex: the reply is
    what the format accepts, and the library's with the same format, bit for bit. A bad one is a 400
    naming response_format, and the session is left as it was."""
    client = server.client()
    shaped = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}
    reply = chat(client, "shaped", [{"role": "user", "content": TURNS[0]}], response_format=shaped)
    assert json.loads(reply.choices[0].message.content)["answer"] in ("yes", "no", "maybe")
    assert reply.choices[0].finish_reason == "stop"
    lib = library_conversation(model_folder, tmp_path / "lib", TURNS[:1], fmt={"type": "json_schema",
                                                                              "schema": ANSWER_SCHEMA})
    assert lib == [reply.kvstore["trace"]]
    phone = chat(client, None, [{"role": "user", "content": TURNS[0]}], extra_body_more={"response_format": PHONE})
    assert re.fullmatch(PHONE["pattern"], phone.choices[0].message.content)
    assert library_conversation(model_folder, tmp_path / "phone", TURNS[:1], fmt=PHONE) == [phone.kvstore["trace"]]
    loose = chat(client, None, [{"role": "user", "content": TURNS[0]}], max_tokens=6,
                 response_format={"type": "json_object"})
    assert loose.choices[0].message.content.startswith("{")  # cut by max_tokens: the start of an object
    text = chat(client, None, [{"role": "user", "content": TURNS[0]}], response_format={"type": "text"})
    free = chat(client, None, [{"role": "user", "content": TURNS[0]}])
    assert text.kvstore["trace"] == free.kvstore["trace"]
    http = server.http()
    before = http.get("/v1/sessions/shaped").json()
    for bad, why in (({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}, "Invalid type"),
                     ({"type": "regex", "pattern": "a("}, "unclosed group"), ({"type": "json_schema"}, "json_schema"),
                     ({"type": "yaml"}, "type"), ({"type": "json_object", "schema": {}}, "schema")):
        r = http.post("/v1/chat/completions", headers={"X-Session-Id": "shaped"},
                      json={"model": MODEL_NAME, "messages": [{"role": "user", "content": TURNS[1]}], "max_tokens": 2,
                            "response_format": bad})
        assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"].startswith("response_format"), r.text
    assert http.get("/v1/sessions/shaped").json() == before
    done = client.completions.create(model=MODEL_NAME, prompt="call me at", max_tokens=20, temperature=0.9, seed=5,
                                     extra_body={"response_format": PHONE})
    assert re.fullmatch(PHONE["pattern"], done.choices[0].text) and done.choices[0].finish_reason == "stop"


def test_a_reply_sent_back_as_the_sdk_made_it_continues_the_session(server):
    """Clients keep the reply's message as the openai package returns it, with its nulls (refusal,
    annotations, audio, function_call, tool_calls), and send it back: it is the stored message."""
    client = server.client()
    messages = [{"role": "user", "content": TURNS[0]}]
    first = chat(client, "sdk-dump", messages)
    dumped = first.choices[0].message.model_dump()
    assert {"refusal", "tool_calls", "function_call"} <= dumped.keys()
    messages += [dumped, {"role": "user", "content": TURNS[1]}]
    second = chat(client, "sdk-dump", messages)
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens  # not computed again
    nulls = {"tools": None, "tool_choice": None, "logit_bias": None, "response_format": None,
             "parallel_tool_calls": False, "audio": None}
    defaults = {"response_format": {"type": "text"}, "tool_choice": "none", "parallel_tool_calls": True,
                "modalities": ["text"]}
    for fields in (nulls, defaults):  # fields that ask for nothing, or for what happens anyway: as if not sent
        r = server.http().post("/v1/chat/completions",
                               json={"model": MODEL_NAME, "messages": messages[:1], "max_tokens": 2, **fields})
        assert r.status_code == 200, r.text


def test_streaming_gives_the_same_reply_as_a_whole_response(server):
    client = server.client()
    messages = [{"role": "user", "content": "stream me"}]
    whole = chat(client, "whole", messages, max_tokens=30)
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=30, stream=True, stream_options={"include_usage": True},
        extra_body={"session": "streamed"}, **SAMPLING))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_an_edited_history_is_answered_as_a_cold_run_reusing_the_common_chunks(server):
    client = server.client()
    first = [{"role": "system", "content": "You are a terse assistant who answers in one line."},
             {"role": "user", "content": "hello there, how are you today?"}]
    a1 = chat(client, "edit", first).choices[0].message.content
    second = first + [{"role": "assistant", "content": a1}, {"role": "user", "content": "go on"}]
    chat(client, "edit", second)
    edited = first + [{"role": "assistant", "content": "I am fine."}, {"role": "user", "content": "go on"}]
    branched = chat(client, "edit", edited)
    cold = chat(client, "edit-cold", edited)  # a new session: the whole prompt computed
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert branched.kvstore["trace"] == cold.kvstore["trace"]
    reused = branched.usage.prompt_tokens_details.cached_tokens
    assert reused > 0 and reused % CHUNK == 0  # whole chunks of the first prompt, no more
    names = {s["name"] for s in server.http().get("/v1/sessions").json()["data"]}
    assert {"edit", "edit@1"} <= names  # the old branch is kept
    kept = server.http().get("/v1/sessions/edit@1/messages").json()["data"]
    assert [m["content"] for m in kept][-2] == "go on" and kept[2]["content"] == a1


def test_a_request_without_a_session_leaves_only_its_prefix_cache_entry(server):
    """(tests/test_serve_prefix.py: with --prefix-cache 0 it leaves nothing behind.)"""
    before = {s["name"] for s in server.http().get("/v1/sessions").json()["data"]}
    reply = chat(server.client(), None, [{"role": "user", "content": "just once"}])
    assert reply.kvstore["session"].startswith("chatcmpl-")
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    after = {s["name"] for s in server.http().get("/v1/sessions").json()["data"]}
    assert after == before | {reply.kvstore["session"]}


def test_n_choices_are_the_replies_of_one_choice_requests_with_the_seeds_after_the_requests(server):
    """n = 3 in one request: choice i is, token for token and bit for bit, the reply of a one-choice
    request with seed 7 + i (each choice runs in a session of its own, the last two forked from the
    first's prompt, the three decoding in the engine's steps together); the usage counts the prompt
    once and every choice's tokens; each session is kept as a prefix-cache entry, as a one-choice
    request's is."""
    client = server.client()
    before = {s["name"] for s in server.http().get("/v1/sessions").json()["data"]}
    messages = [{"role": "user", "content": "pick three words that rhyme with the name of a colour"}]
    many = chat(client, None, messages, n=3, logprobs=True)
    assert [c.index for c in many.choices] == [0, 1, 2]
    extras = many.kvstore["choices"]
    # the first read the prompt; the others forked its whole chunks from the prefix cache
    assert [e["context"] for e in extras] == ["computed", "reused", "reused"]
    assert extras[0]["session"] == many.kvstore["session"]
    assert [e["session"] for e in extras[1:]] == [f"{extras[0]['session']}-1", f"{extras[0]['session']}-2"]
    traces = [e["trace"] for e in extras]
    assert len({json.dumps(t) for t in traces}) == 3  # three draws
    assert [len(c.logprobs.content) for c in many.choices] == [len(t) for t in traces]
    after = {s["name"] for s in server.http().get("/v1/sessions").json()["data"]}
    assert after == before | {e["session"] for e in extras}
    for i, trace in enumerate(traces):
        one = chat(client, None, messages, seed=SAMPLING["seed"] + i)
        assert one.kvstore["trace"] == trace, i
        assert one.choices[0].message.content == many.choices[i].message.content
        assert one.choices[0].finish_reason == many.choices[i].finish_reason
    assert many.usage.completion_tokens == sum(len(t) for t in traces)
    assert many.usage.prompt_tokens == one.usage.prompt_tokens
    assert many.usage.total_tokens == many.usage.prompt_tokens + many.usage.completion_tokens


def test_n_choices_stream_interleaved_each_with_its_index_and_no_event_ids(server):
    client = server.client()
    messages = [{"role": "user", "content": "two ways to say it"}]
    whole = chat(client, None, messages, n=2, max_tokens=16)
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 16, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}, **SAMPLING}
    events = stream_events(server, body, {})
    assert all(event_id is None for event_id, _ in events)  # a stream of several sessions: not resumable
    texts, finish = ["", ""], [None, None]
    for _, d in events:
        for c in (d or {}).get("choices", []):
            texts[c["index"]] += c["delta"].get("content") or ""
            finish[c["index"]] = c["finish_reason"] or finish[c["index"]]
    assert texts == [c.message.content for c in whole.choices]
    assert finish == [c.finish_reason for c in whole.choices]
    usage = [d["usage"] for _, d in events if d and d.get("usage")]
    assert len(usage) == 1  # (its prompt found whole chunks of the first request's in the prefix cache)
    assert (usage[0]["prompt_tokens"], usage[0]["completion_tokens"]) == (whole.usage.prompt_tokens,
                                                                         whole.usage.completion_tokens)
    assert events[-1] == (None, None)  # [DONE]


def test_n_choices_need_a_request_without_a_session(server):
    http = server.http()
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "n": 2}
    named = http.post("/v1/chat/completions", json=body, headers={"X-Session-Id": "one-story"})
    assert named.status_code == 400 and named.json()["error"]["param"] == "n"
    assert "fork the session for each one" in named.json()["error"]["message"]
    names = {s["name"] for s in http.get("/v1/sessions").json()["data"]}
    assert "one-story" not in names  # refused before anything ran
    resumed = http.post("/v1/chat/completions", json={**body, "stream": True},
                        headers={"Last-Event-ID": "one-story/5/9"})
    assert resumed.status_code == 400 and "resend with n: 1" in resumed.json()["error"]["message"]


def test_completions_continue_raw_text(server):
    client = server.client()
    a = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=12, temperature=0,
                                  extra_body={"session": "raw"})
    assert a.choices[0].finish_reason in ("length", "stop") and a.usage.completion_tokens > 0
    b = client.completions.create(model=MODEL_NAME, prompt=" and then", max_tokens=8, temperature=0,
                                  extra_body={"session": "raw"})
    assert b.usage.prompt_tokens_details.cached_tokens >= a.usage.prompt_tokens + a.usage.completion_tokens - 1
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL_NAME, prompt="Once upon a time", max_tokens=12, temperature=0, stream=True) if c.choices)
    assert streamed == a.choices[0].text


def test_a_completion_prompt_of_token_ids_is_the_texts(server, model_folder):
    """The completions API takes the prompt as token ids too (as they are, no BOS added): the ids the
    text encodes to give the text's reply, token for token and bit for bit."""
    client = server.client()
    text = "Once upon a time"
    ids = kvstore.load_model(model_folder).tokenizer.encode(text, add_bos=None)
    ask = dict(model=MODEL_NAME, max_tokens=8, temperature=0, extra_body={"kvstore_trace": True})
    by_text = client.completions.create(prompt=text, **ask)
    for prompt in (ids, [ids]):
        by_ids = client.completions.create(prompt=prompt, **ask)
        assert by_ids.model_extra["kvstore"]["trace"] == by_text.model_extra["kvstore"]["trace"]
        assert by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens == len(ids)
    for bad, why in (([10**9], "token ids must lie in"), ([], "empty prompt"), (["a", ""], "empty prompt"),
                     ([[1, 2]] * 17, "16 at most")):
        r = server.http().post("/v1/completions", json={"model": MODEL_NAME, "prompt": bad, "max_tokens": 2})
        assert r.status_code == 400 and why in r.json()["error"]["message"], r.text


def test_a_list_of_prompts_is_answered_as_that_many_requests(server):
    """OpenAI's batched completions (evaluation harnesses send them): choice k * n + i is prompt k's i-th,
    the same tokens and bits as a request of its own with that prompt; the usage counts each prompt once."""
    client = server.client()
    prompts = ["Once upon a time", "The fox", "In the beginning there was"]
    ask = dict(model=MODEL_NAME, max_tokens=5, temperature=0.9, seed=4, extra_body={"kvstore_trace": True})
    batched = client.completions.create(prompt=prompts, n=2, **ask)
    alone = [client.completions.create(prompt=p, n=2, **ask) for p in prompts]
    assert [c.index for c in batched.choices] == list(range(6))
    traces = batched.model_extra["kvstore"]["choices"]
    for k, one in enumerate(alone):
        for i in range(2):
            assert batched.choices[2 * k + i].text == one.choices[i].text
            assert traces[2 * k + i]["trace"] == one.model_extra["kvstore"]["choices"][i]["trace"]
    assert batched.usage.prompt_tokens == sum(one.usage.prompt_tokens for one in alone)
    assert batched.usage.completion_tokens == sum(one.usage.completion_tokens for one in alone)
    streamed = {}
    for chunk in client.completions.create(prompt=prompts, stream=True, **ask):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[k] for k in range(3)] == [one.choices[0].text for one in alone]
    r = server.http().post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompts, "max_tokens": 2,
                                                     "session": "one-session"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_n_completions_are_one_choice_completions_and_a_refused_prompt_leaves_no_session(server):
    client, http = server.client(), server.http()
    ask = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=10, temperature=1.0, seed=11)
    many = client.completions.create(n=2, **ask)
    assert [c.index for c in many.choices] == [0, 1]
    for i in (0, 1):
        one = client.completions.create(**{**ask, "seed": 11 + i})
        assert one.choices[0].text == many.choices[i].text
    before = {s["name"] for s in http.get("/v1/sessions").json()["data"]}
    long = http.post("/v1/completions", json={**ask, "prompt": "word " * 400, "n": 3})
    assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
    assert {s["name"] for s in http.get("/v1/sessions").json()["data"]} == before


def test_tokenize_gives_the_ids_a_request_reads_and_detokenize_their_text(server, model_folder):
    """POST /tokenize and /detokenize (vLLM's and llama.cpp's): a prompt's ids as a completion reads
    them, messages' as a new session's chat does (the count is the request's prompt_tokens)."""
    tok = kvstore.load_model(model_folder).tokenizer
    http, text = server.http(), "Once upon a time"
    r = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": text}).json()
    assert r["tokens"] == tok.encode(text, add_bos=None) and r["count"] == len(r["tokens"]) and r["max_model_len"] > 0
    bare = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == tok.encode(text, add_bos=False)
    assert http.post("/detokenize", json={"model": MODEL_NAME, "tokens": bare["tokens"]}).json() == {"prompt": text}
    messages = [{"role": "user", "content": "count me"}]
    counted = http.post("/tokenize", json={"model": MODEL_NAME, "messages": messages}).json()["count"]
    reply = server.client().chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1)
    assert counted == reply.usage.prompt_tokens
    for path, body, status in (("/detokenize", {"tokens": [10**9]}, 400), ("/tokenize", {}, 400),
                               ("/tokenize", {"prompt": "a", "messages": messages}, 400),
                               ("/tokenize", {"prompt": "a", "model": "gpt-4o"}, 404)):
        r = http.post(path, json={"model": MODEL_NAME, **body})
        assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text


def test_max_tokens_0_reads_the_prompt_into_the_session_and_generates_nothing(server):
    """kvstore's use of `max_tokens: 0` (OpenAI refuses it): a document read into a named session once,
    as `kvstore new --max-new-tokens 0` does; the next request on the session starts from its KV."""
    client = server.client()
    doc = "Once upon a time there was a fox who lived by a river, and every morning it went to drink."
    read = client.completions.create(model=MODEL_NAME, prompt=doc, max_tokens=0, extra_body={"session": "doc"})
    assert read.choices[0].text == "" and read.usage.completion_tokens == 0
    assert read.choices[0].finish_reason == "length"
    held = server.http().get("/v1/sessions/doc").json()
    assert held["n_tokens"] == read.usage.prompt_tokens > 10
    then = client.completions.create(model=MODEL_NAME, prompt=" The fox", max_tokens=6, temperature=0,
                                     extra_body={"session": "doc"})
    assert then.usage.prompt_tokens_details.cached_tokens >= read.usage.prompt_tokens - 1
    assert then.usage.completion_tokens > 0


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "nothing to add"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "nothing to add"}]})])
def test_a_request_of_its_own_that_generates_nothing_is_answered(server, path, body):
    """With no session named, the end comes among the first events: its run is still finished, so its
    session can be kept as a prefix-cache entry (before, the answer waited for good on that session's turn)."""
    r = server.http().post(path, json={"model": MODEL_NAME, "max_tokens": 0, **body}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 0


def sse_events(lines, on_event=None) -> list[tuple[str, dict]]:
    """(id, data) of each SSE event in raw lines (data None for [DONE]); `on_event(events)` after
    each one may return True to stop reading (the client goes away)."""
    out, event_id = [], None
    for line in lines:
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            payload = line[6:]
            out.append((event_id, None if payload == "[DONE]" else json.loads(payload)))
            event_id = None
            if on_event is not None and on_event(out):
                break
    return out


def stream_events(server, body: dict, headers: dict, *, stop_after: int | None = None) -> list[tuple[str, dict]]:
    """The events of a streamed request, read raw; `stop_after` n events with ids: then the client goes away."""
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        enough = (lambda out: sum(1 for i, _ in out if i) >= stop_after) if stop_after is not None else None
        return sse_events(r.iter_lines(), enough)


def text_of(events) -> str:
    return "".join((d["choices"][0]["delta"].get("content") or "") for _, d in events if d and d["choices"])


def long_request(session: str) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "a long one, please"}], "max_tokens": 200,
            "stream": True, "session": session, "kvstore_trace": True, **SAMPLING}


def tokens_of(events) -> list[int]:
    return [t["token"] for _, d in events if d and d.get("kvstore") and "trace" in d["kvstore"]
            for t in d["kvstore"]["trace"]]


def test_last_event_id_after_kill_9_of_the_server_finishes_the_reply_exactly(tmp_path, model_folder):
    with LiveServer(tmp_path / "home", model_folder, "--chunk-size", str(CHUNK), "--threads", "1",
                    "--checkpoint-every", "4") as server:
        whole = stream_events(server, long_request("uncut"), {})
        got = stream_events(server, long_request("cut"), {}, stop_after=40)
        last_id = [i for i, _ in got if i][-1]
        server.kill()
        server.start()
        rest = stream_events(server, long_request("cut"), {"Last-Event-ID": last_id})
        assert rest[-1][1] is None  # [DONE]
        assert all(i for i, _ in got + rest), "every event has an id"
        assert text_of(got) + text_of(rest) == text_of(whole)
        assert tokens_of(got) + tokens_of(rest) == tokens_of(whole)
        again = stream_events(server, long_request("cut"), {"Last-Event-ID": [i for i, _ in rest if i][-1]})
        assert text_of(again) == "" and again[-1][1] is None  # it had everything: only the end


def retried_whole(server, name: str, whole) -> dict:
    """`long_request(name)` sent again, not streamed and without Last-Event-ID, after its reply was
    cut: the reply is the uncut one (`whole`'s events), text and tokens, and no branch `NAME@1` was
    made. Its JSON."""
    r = server.http().post("/v1/chat/completions", json={**long_request(name), "stream": False}, timeout=120)
    assert r.status_code == 200, r.text
    retried = r.json()
    assert retried["choices"][0]["message"]["content"] == text_of(whole)
    assert [t["token"] for t in retried["kvstore"]["trace"]] == tokens_of(whole)
    assert f"{name}@1" not in {s["name"] for s in server.http().get("/v1/sessions").json()["data"]}
    return retried


def test_a_cut_reply_resent_without_last_event_id_is_that_reply_whole_not_a_second_answer(tmp_path, model_folder):
    """A client that lost its reply (the server killed mid-stream) and sends the same request again
    without Last-Event-ID, not streamed, as a client that retries does, gets that reply whole: the
    cut one finished from its checkpoint (not computed again), equal to an uncut reply, and no branch.
    The same messages with other settings are another request: answered cold, on a branch."""
    with LiveServer(tmp_path / "home", model_folder, "--chunk-size", str(CHUNK), "--threads", "1",
                    "--checkpoint-every", "4") as server:
        whole = stream_events(server, long_request("uncut"), {})
        got = stream_events(server, long_request("cut"), {}, stop_after=40)
        server.kill()
        server.start()
        retried = retried_whole(server, "cut", whole)
        assert tokens_of(got) == tokens_of(whole)[:len(tokens_of(got))]
        usage = retried["usage"]
        assert usage["completion_tokens"] == len(tokens_of(whole))
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]  # the prompt not read again
        assert "cut" in {s["name"] for s in server.http().get("/v1/sessions").json()["data"]}

        other = {**long_request("cut-other"), "max_tokens": 150}
        stream_events(server, {**long_request("cut-other")}, {}, stop_after=40)
        r = server.http().post("/v1/chat/completions", json={**other, "stream": False}, timeout=120)
        assert r.status_code == 200, r.text
        assert [t["token"] for t in r.json()["kvstore"]["trace"]] == tokens_of(whole)[:150]
        names = {s["name"] for s in server.http().get("/v1/sessions").json()["data"]}
        assert {"cut-other", "cut-other@1"} <= names


def test_a_formatted_reply_cut_by_kill_9_of_the_server_finishes_under_its_format_exactly(tmp_path, model_folder):
    """The reply's format is recorded with its call: the resumed stream (Last-Event-ID after a
    restart) is held to it from where the reply had got to, and the whole equals an uninterrupted one."""
    words = {"type": "regex", "pattern": "[a-z]{2,6}( [a-z]{2,6}){20,30}"}
    with LiveServer(tmp_path / "home", model_folder, "--chunk-size", str(CHUNK), "--threads", "1",
                    "--checkpoint-every", "4") as server:
        whole = stream_events(server, {**long_request("uncut"), "response_format": words}, {})
        assert re.fullmatch(words["pattern"], text_of(whole))
        got = stream_events(server, {**long_request("cut"), "response_format": words}, {}, stop_after=12)
        server.kill()
        server.start()
        rest = stream_events(server, {**long_request("cut"), "response_format": words},
                             {"Last-Event-ID": [i for i, _ in got if i][-1]})
        assert text_of(got) + text_of(rest) == text_of(whole)
        assert tokens_of(got) + tokens_of(rest) == tokens_of(whole)


def test_kill_9_of_the_engine_mid_stream_the_api_stays_up_and_the_reply_is_whole(tmp_path, model_folder):
    with LiveServer(tmp_path / "home", model_folder, "--chunk-size", str(CHUNK), "--threads", "1",
                    "--checkpoint-every", "4") as server:
        whole = stream_events(server, long_request("uncut"), {})
        killed = []

        def kill_at_30(out):
            if len(out) == 30 and not killed:
                killed.append(server.kill_engine())

        with httpx.stream("POST", server.url + "/v1/chat/completions", json=long_request("cut"), timeout=120) as r:
            events = sse_events(r.iter_lines(), kill_at_30)
        assert killed and events[-1][1] is None
        old = killed[0]
        assert text_of(events) == text_of(whole) and tokens_of(events) == tokens_of(whole)
        assert server.engine_pids() != [old]
        metrics = httpx.get(server.url + "/metrics").text
        assert "kvstore:engine_restarts_total 1.0" in metrics


def choice_texts(events) -> dict[int, str]:
    """Each choice's text in the events of an n-choice stream."""
    texts: dict[int, str] = {}
    for _, d in events:
        for c in (d or {}).get("choices", ()):
            texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
    return texts


def test_kill_9_of_the_engine_mid_stream_of_n_choices_every_choice_is_whole(tmp_path, model_folder):
    """n = 3 choices streaming (no event ids: each choice's session is resumed by the service): the
    engine killed mid-stream, the stream still ends with every choice whole, as uninterrupted."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "three long ones"}], "max_tokens": 120,
            "stream": True, "n": 3, **SAMPLING}
    with LiveServer(tmp_path / "home", model_folder, "--chunk-size", str(CHUNK), "--threads", "1",
                    "--checkpoint-every", "4") as server:
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
            whole = choice_texts(sse_events(r.iter_lines()))
        killed = []

        def kill_at_40(out):
            if len(out) == 40 and not killed:
                killed.append(server.kill_engine())

        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
            events = sse_events(r.iter_lines(), kill_at_40)
        assert killed and events[-1][1] is None  # [DONE]
        assert len(events) > 80  # the kill came mid-stream: most of the chunks came after it
        assert sorted(whole) == [0, 1, 2] and all(whole.values())
        assert choice_texts(events) == whole
        assert server.engine_pids() != killed


def test_a_long_reply_does_not_hold_back_another_sessions_first_token(tmp_path, model_folder):
    import threading

    # a checkpoint after every token: the tiny model's long reply then takes long enough to overlap
    with LiveServer(tmp_path / "home", model_folder, "--chunk-size", str(CHUNK), "--threads", "1",
                    "--checkpoint-every", "1", "--keep-alive", "0.05") as server:
        progress = {"events": 0, "done": False}

        def long_one():
            body = {**long_request("long"), "kvstore_trace": False, "temperature": 0}
            with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        progress["events"] += 1
            progress["done"] = True

        t = threading.Thread(target=long_one)
        t.start()
        try:
            while progress["events"] < 3:
                assert t.is_alive(), "the long reply ended before it began"
            short = chat(server.client(), "short", [{"role": "user", "content": "quick"}], max_tokens=3)
            seen = progress["events"]
            assert short.usage.completion_tokens == 3
            assert not progress["done"], "the short reply waited for the long one to finish"
        finally:
            t.join(120)
        assert progress["done"] and progress["events"] > seen + 20  # the long one went on after it

        # keep-alive comments every 50 ms in a stream of ids: the openai client reads it whole
        chunks = list(server.client().chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "a long one, please"}], max_tokens=200,
            stream=True, extra_body={"session": "kept-alive"}, temperature=0))
        assert b": keep-alive" in httpx.post(server.url + "/v1/chat/completions", json={
            **long_request("raw-look"), "kvstore_trace": False, "stream": True}, timeout=120).content
        assert chunks[-1].choices[0].finish_reason in ("length", "stop") and len(chunks) > 20


def test_two_engines_each_session_pinned_to_one_and_one_engine_dying_spares_the_other(tmp_path, model_folder):
    with LiveServer(tmp_path / "home", model_folder, "--workers", "2", "--threads", "1",
                    "--chunk-size", str(CHUNK)) as server:
        pids = server.engine_pids()
        assert len(set(pids)) == 2
        client = server.client()
        names = [f"pinned-{i}" for i in range(6)]
        first = {n: chat(client, n, [{"role": "user", "content": n}], max_tokens=6) for n in names}
        server.kill_engine(0)
        again = {n: chat(client, n, [{"role": "user", "content": n}, {"role": "assistant",
                                                                       "content": first[n].choices[0].message.content},
                                     {"role": "user", "content": "more"}], max_tokens=6) for n in names}
        assert all(r.usage.prompt_tokens_details.cached_tokens > 0 for r in again.values())
        contexts = {r.kvstore["context"] for r in again.values()}
        assert contexts == {"restored", "reused"}  # the dead engine's sessions came back from disk
        new_pids = server.engine_pids()
        assert new_pids[1] == pids[1] and new_pids[0] != pids[0]


def test_the_real_model_over_http_is_the_librarys_bit_for_bit(tmp_path, smollm2_path):
    turns = ["Name a colour.", "And another one?"]
    with LiveServer(tmp_path / "home", str(smollm2_path), "--threads", "1") as server:
        client = server.client()
        messages, http_traces = [], []
        for turn in turns:
            messages.append({"role": "user", "content": turn})
            reply = chat(client, "real", messages, max_tokens=12)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            http_traces.append(reply.kvstore["trace"])
    expected = library_conversation(str(smollm2_path), tmp_path / "lib", turns, max_tokens=12,
                                    chunk=kvstore.DEFAULT_CHUNK)
    assert expected == http_traces
    assert all(len(t) > 0 for t in http_traces)
