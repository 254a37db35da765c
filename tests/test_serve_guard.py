"""The service's guard rails, on the real `kvstore serve` (tests/serve_kit.py) with the tiny model:
bad input of every kind is a 4xx in OpenAI's error shape and leaves the session as it was; API keys
are tenants that cannot see each other (404); the limits (body, tokens, queue: 429 with Retry-After);
409s; a client that goes away stops its generation, checkpointed, and the rest is resumable; SIGTERM
drains and exits 0; a non-loopback address without keys is refused; the metrics move; one JSON log
line per request.

One server (with two API keys, a small queue and body limit) serves the module; the SIGTERM test
starts its own, with its key from $KVSTORE_API_KEYS.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

import kvstore
from conftest import single_thread
from kvstore_cli.main import cli
from kvstore_serve import command
from kvstore_serve.tenants import tenant_of
from serve_kit import LiveServer

KEY_A, KEY_B = "key-alpha-0123456789", "key-beta-9876543210"
MAX_BODY = 64 * 1024
MAX_TOKENS = 200
SERVER_ARGS = ("--chunk-size", "16", "--threads", "1", "--log-format", "json", "--max-queue", "2",
               "--max-tokens", str(MAX_TOKENS), "--max-body", str(MAX_BODY))
OPENAI_ERROR = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def model_dir(tiny) -> str:
    return str(tiny("llama-gqa").folder)


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("serve-guard")
    keys = root / "keys.txt"
    keys.write_text(f"# the test's tenants\n{KEY_A}\n\n{KEY_B}\n", encoding="utf-8")
    with LiveServer(root / "home", model_dir, *SERVER_ARGS, "--api-key-file", str(keys)) as live:
        yield live
        assert "Traceback" not in live.log(), live.log()


@pytest.fixture(scope="module")
def a(server):
    with server.http(KEY_A) as client:
        yield client


@pytest.fixture(scope="module")
def b(server):
    with server.http(KEY_B) as client:
        yield client


def chat_body(*contents: str, **extra) -> dict:
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": c} for i, c in enumerate(contents)]
    return {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0, **extra}


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert "Traceback" not in response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == OPENAI_ERROR, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]


def info(client: httpx.Client, name: str) -> dict:
    r = client.get(f"/v1/sessions/{name}")
    assert r.status_code == 200, r.text
    return r.json()


def messages(client: httpx.Client, name: str) -> list[tuple[str, str]]:
    r = client.get(f"/v1/sessions/{name}/messages")
    assert r.status_code == 200, r.text
    return [(m["role"], m["content"]) for m in r.json()["data"]]


def metrics(server) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics: (name, sorted labels) -> value."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def sse(response: httpx.Response):
    """(id, data) of each server-sent event of a streamed response."""
    event_id, data = None, []
    for line in response.iter_lines():
        if line == "":
            if data:
                yield event_id, "\n".join(data)
            event_id, data = None, []
        elif line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())


def log_records(server) -> list[dict]:
    out = []
    for line in server.log().splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def wait_for_record(server, request_id: str, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [r for r in log_records(server) if r.get("request_id") == request_id]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no log line for request {request_id}:\n{server.log()[-3000:]}")


# -- bad input -------------------------------------------------------------------------------------
JSON = {"Content-Type": "application/json"}
CHAT, COMPLETIONS, SESSIONS = "/v1/chat/completions", "/v1/completions", "/v1/sessions"
OK = json.dumps(chat_body("hello")).encode()
BAD_INPUT = [
    # (case, path, extra headers, body bytes, status, code)
    ("malformed JSON", CHAT, {}, b'{"model": "tiny", "messages": [', 400, "invalid_json"),
    ("invalid UTF-8", CHAT, {}, b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400,
     "invalid_json"),
    ("nested too deeply", CHAT, {}, b"[" * 50_000, 400, "invalid_json"),
    ("not an object", CHAT, {}, b"[1, 2]", 400, "invalid_value"),
    ("empty body", CHAT, {}, b"", 400, None),
    ("messages not a list", CHAT, {}, json.dumps({"model": "tiny", "messages": "hi"}).encode(), 400, "invalid_value"),
    ("content a number", CHAT, {}, json.dumps({"model": "tiny", "messages": [{"role": "user", "content": 5}]}).encode(),
     400, "invalid_value"),
    ("unknown role", CHAT, {}, json.dumps(chat_body("x") | {"messages": [{"role": "tool", "content": "x"}]}).encode(),
     400, "invalid_value"),
    ("no messages", CHAT, {}, json.dumps(chat_body("x") | {"messages": []}).encode(), 400, "invalid_value"),
    ("missing model", CHAT, {}, json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(), 400,
     "missing_required_parameter"),
    ("max_tokens a string", CHAT, {}, json.dumps(chat_body("x", max_tokens="ten")).encode(), 400, "invalid_value"),
    ("max_tokens negative", CHAT, {}, json.dumps(chat_body("x", max_tokens=-1)).encode(), 400, "invalid_value"),
    ("max_tokens above the limit", CHAT, {}, json.dumps(chat_body("x", max_tokens=MAX_TOKENS + 1)).encode(), 400,
     "invalid_value"),
    ("max_tokens infinite", CHAT, {}, OK.replace(b'"max_tokens": 8', b'"max_tokens": 1e999'), 400, "invalid_value"),
    ("temperature out of range", CHAT, {}, json.dumps(chat_body("x", temperature=7)).encode(), 400, "invalid_value"),
    ("temperature NaN", CHAT, {}, OK.replace(b'"temperature": 0', b'"temperature": NaN'), 400, "invalid_value"),
    ("unknown field", CHAT, {}, json.dumps(chat_body("x", colour="blue")).encode(), 400, "unknown_parameter"),
    ("unknown field in a message", CHAT, {},
     json.dumps(chat_body("x") | {"messages": [{"role": "user", "content": "x", "mood": "?"}]}).encode(), 400,
     "unknown_parameter"),
    ("unsupported field", CHAT, {}, json.dumps(chat_body("x", functions=[{"name": "f"}])).encode(), 400,
     "unsupported_parameter"),
    ("a tool without its function", CHAT, {}, json.dumps(chat_body("x", tools=[{"type": "function"}])).encode(), 400,
     "missing_required_parameter"),
    ("n above the limit", CHAT, {}, json.dumps(chat_body("x", n=17)).encode(), 400, "invalid_value"),
    ("n 0", COMPLETIONS, {}, json.dumps({"model": "tiny", "prompt": "x", "n": 0}).encode(), 400, "invalid_value"),
    ("a tool call in a message without its function", CHAT, {}, json.dumps(chat_body("x") | {"messages": [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
        {"role": "user", "content": "x"}]}).encode(), 400, "missing_required_parameter"),
    ("a response format whose schema is not one", CHAT, {}, json.dumps(chat_body("x", response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}})).encode(), 400, "invalid_value"),
    ("a response format of an unknown type", CHAT, {}, json.dumps(chat_body("x", response_format={"type": "xml"})).encode(),
     400, "invalid_value"),
    ("a tool required, none given", CHAT, {}, json.dumps(chat_body("x", tool_choice="required")).encode(), 400,
     "invalid_value"),
    ("an image part", CHAT, {}, json.dumps(chat_body("x") | {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}).encode(),
     400, "unsupported_parameter"),
    ("a user message without content", CHAT, {},
     json.dumps(chat_body("x") | {"messages": [{"role": "user", "content": None}]}).encode(), 400, "invalid_value"),
    ("presence_penalty out of range", CHAT, {}, json.dumps(chat_body("x", presence_penalty=2.5)).encode(), 400,
     "invalid_value"),
    ("frequency_penalty out of range", COMPLETIONS, {},
     json.dumps({"model": "tiny", "prompt": "x", "frequency_penalty": -3}).encode(), 400, "invalid_value"),
    ("top_k negative", CHAT, {}, json.dumps(chat_body("x", top_k=-1)).encode(), 400, "invalid_value"),
    ("min_p 1", CHAT, {}, json.dumps(chat_body("x", min_p=1)).encode(), 400, "invalid_value"),
    ("repetition_penalty 0", CHAT, {}, json.dumps(chat_body("x", repetition_penalty=0)).encode(), 400,
     "invalid_value"),
    ("too many stops", CHAT, {}, json.dumps(chat_body("x", stop=list("abcde"))).encode(), 400, "invalid_value"),
    ("unknown model", CHAT, {}, json.dumps(chat_body("x", model="gpt-4o")).encode(), 404, "model_not_found"),
    ("prompt longer than the context", CHAT, {}, json.dumps(chat_body("word " * 400)).encode(), 400,
     "context_length_exceeded"),
    ("completion prompt longer than the context", COMPLETIONS, {},
     json.dumps({"model": "tiny", "prompt": "word " * 400, "max_tokens": 4}).encode(), 400, "context_length_exceeded"),
    ("completion prompts times n over 16", COMPLETIONS, {},
     json.dumps({"model": "tiny", "prompt": ["a", "b"] * 5, "n": 2}).encode(), 400, "invalid_value"),
    ("body over the limit", CHAT, {}, json.dumps(chat_body("x" * MAX_BODY)).encode(), 413, "request_too_large"),
    ("body over the limit, chunked", CHAT, {"Transfer-Encoding": "chunked"}, None, 413, "request_too_large"),
    ("Last-Event-ID not ours", CHAT, {"Last-Event-ID": "garbage"}, OK, 400, "invalid_value"),
    ("hostile name: a path", CHAT, {"X-Session-Id": "../../etc/passwd"}, OK, 400, "invalid_name"),
    ("hostile name: hidden", CHAT, {"X-Session-Id": ".kvstore"}, OK, 400, "invalid_name"),
    ("hostile name: spaces", CHAT, {"X-Session-Id": "a b"}, OK, 400, "invalid_name"),
    ("hostile name: too long", CHAT, {"X-Session-Id": "n" * 200}, OK, 400, "invalid_name"),
    ("hostile name: NUL in the body", CHAT, {}, json.dumps(chat_body("x", session="a\u0000b")).encode(), 400,
     "invalid_name"),
    ("hostile name: SQL", CHAT, {}, json.dumps(chat_body("x", session="x'; DROP TABLE sessions;--")).encode(), 400,
     "invalid_name"),
    ("hostile name: not a string", CHAT, {}, json.dumps(chat_body("x", session=["a"])).encode(), 400,
     "invalid_value"),
    ("session create: hostile name", SESSIONS, {}, json.dumps({"name": "../x"}).encode(), 400, "invalid_name"),
    ("session create: unknown field", SESSIONS, {}, json.dumps({"name": "ok", "size": 3}).encode(), 400,
     "unknown_parameter"),
    ("session create: seed out of range", SESSIONS, {}, json.dumps({"name": "ok", "seed": -1}).encode(), 400,
     "invalid_value"),
]


def chunks(total: int):
    piece = b"x" * 8192
    for _ in range(total // len(piece) + 1):
        yield piece


@pytest.mark.parametrize("case,path,headers,body,status,code", BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_bad_input_is_a_4xx_in_openai_shape(a, case, path, headers, body, status, code):
    content = body if body is not None else chunks(2 * MAX_BODY)
    r = a.post(path, content=content, headers={**JSON, **headers})
    error = assert_openai_error(r, status, code)
    if case.startswith("max_tokens above"):
        assert error["param"] == "max_tokens" and str(MAX_TOKENS) in error["message"]
    assert "kvstore-home" not in error["message"] and "Traceback" not in error["message"]


def test_bad_sessions_requests(a):
    assert_openai_error(a.get(SESSIONS, params={"limit": 0}), 400, "invalid_value")
    assert_openai_error(a.get(SESSIONS, params={"after": "../x"}), 400, "invalid_name")
    assert_openai_error(a.get(f"{SESSIONS}/nothing-here"), 404, "session_not_found")
    assert_openai_error(a.get(f"{SESSIONS}/..%2F..%2Fetc"), 404)
    assert_openai_error(a.post(f"{SESSIONS}/import", params={"name": "imp"}, content=b"not an archive"), 400,
                        "unsupported_format")
    assert_openai_error(a.post(f"{SESSIONS}/import"), 400)
    assert_openai_error(a.get("/v1/no-such-route"), 404)
    assert_openai_error(a.put(CHAT, json={}), 405)


def test_a_request_of_its_own_refused_before_any_output_leaves_no_session(a):
    """A request that names no session runs in one the server makes for it. Refused before any output
    (its prompt beyond the tiny model's 256 positions), whole or streamed, on each route, that session
    is deleted: its name never reached the client, and kept it would stay in the store for good (only
    delivered replies become prefix-cache entries)."""
    def names() -> set[str]:
        return {s["name"] for s in a.get(SESSIONS, params={"limit": 1000}).json()["data"]}

    before = names()
    long = "many words " * 200
    routes = [(CHAT, chat_body(long)), (COMPLETIONS, {"model": "tiny", "prompt": long, "max_tokens": 8}),
              ("/v1/responses", {"model": "tiny", "input": long, "max_output_tokens": 8})]
    for path, body in routes:
        for stream in (False, True):
            assert_openai_error(a.post(path, json=body | {"stream": stream}), 400, "context_length_exceeded")
    assert names() == before


def test_a_named_session_made_by_a_request_refused_before_any_output_is_deleted(a):
    """A request naming a session that does not exist makes it. Refused before any output (its prompt
    beyond the tiny model's 256 positions), whole or streamed, on chat and completions, the session
    it made is gone, and the name is free for the next request, which makes it afresh."""
    long = "many words " * 200
    routes = [(CHAT, chat_body(long)), (COMPLETIONS, {"model": "tiny", "prompt": long, "max_tokens": 8})]
    for path, body in routes:
        for stream in (False, True):
            name = f"made-{path.rsplit('/', 1)[-1]}-{stream}"
            r = a.post(path, json=body | {"stream": stream}, headers={"X-Session-Id": name})
            assert_openai_error(r, 400, "context_length_exceeded")
            assert_openai_error(a.get(f"{SESSIONS}/{name}"), 404, "session_not_found")
    ok = a.post(CHAT, json=chat_body("Hello.", max_tokens=2), headers={"X-Session-Id": "made-completions-False"})
    assert ok.status_code == 200, ok.text
    assert info(a, "made-completions-False")["n_tokens"] > 0


def test_bad_input_leaves_the_session_as_it_was(a, server, model):
    """A session with a turn meets every kind of refusal; then its next turn is what the library makes
    of the two turns alone: nothing of the refused requests reached it."""
    name, seed = "kept", 11
    first = a.post(CHAT, json=chat_body("Tell me a story.", seed=seed, max_tokens=6), headers={"X-Session-Id": name})
    assert first.status_code == 200, first.text
    reply = first.json()["choices"][0]["message"]["content"]
    before = info(a, name)
    history = messages(a, name)
    refusals = [
        chat_body("Tell me a story.", reply, "word " * 400),  # longer than the context
        chat_body("Tell me a story.", reply, "more", max_tokens=MAX_TOKENS + 1),
        chat_body("Tell me a story.", reply, "more", tools=[{"type": "function"}]),
        chat_body("Tell me a story.", reply, "more", model="other"),
    ]
    for body in refusals:
        assert a.post(CHAT, json=body, headers={"X-Session-Id": name}).status_code in (400, 404)
    assert a.post(CHAT, content=b'{"model": "tiny", "messages": [{"role"', headers={**JSON, "X-Session-Id": name}
                  ).status_code == 400
    assert a.post(COMPLETIONS, json={"model": "tiny", "prompt": "word " * 400}, headers={"X-Session-Id": name}
                  ).status_code == 400
    after = info(a, name)
    assert (after["n_tokens"], after["checkpoints"], after["active_call"]) == \
        (before["n_tokens"], before["checkpoints"], before["active_call"])
    assert messages(a, name) == history

    second = a.post(CHAT, json=chat_body("Tell me a story.", reply, "And then?", seed=seed, max_tokens=6,
                                         kvstore_trace=True), headers={"X-Session-Id": name})
    assert second.status_code == 200, second.text
    assert second.json()["kvstore"]["context"] in ("reused", "restored")
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == before["n_tokens"] - 1 or \
        second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= before["n_cached"]
    served = [line["token"] for line in second.json()["kvstore"]["trace"]]
    with single_thread(), kvstore.open_store(server.home.parent / "replay") as store:
        with store.new(name, model, seed=seed, chunk_size=16, temperature=0.0, top_p=1.0) as s:
            assert "".join(s.chat("Tell me a story.", 6)) == reply
            start = len(s.tokens)
            "".join(s.chat("And then?", 6))
            tokens = list(s.tokens)
    assert served == tokens[len(tokens) - len(served):]
    assert info(a, name)["n_tokens"] == len(tokens) and start < len(tokens)


# -- keys and tenants ------------------------------------------------------------------------------
def test_every_v1_call_needs_a_key(server):
    with server.http() as anonymous:
        for method, path in [("GET", "/v1/models"), ("GET", SESSIONS), ("GET", f"{SESSIONS}/x"),
                             ("POST", CHAT), ("POST", COMPLETIONS), ("POST", SESSIONS), ("POST", "/tokenize"),
                             ("POST", "/detokenize")]:
            r = anonymous.request(method, path, json=chat_body("x"))
            assert_openai_error(r, 401, "invalid_api_key")
        for header in ("Bearer not-a-key-at-all", "Basic " + KEY_A, KEY_A, "Bearer"):
            assert_openai_error(anonymous.get("/v1/models", headers={"Authorization": header}), 401,
                                "invalid_api_key")
        assert anonymous.get("/health").status_code == 200  # not under /v1: for load balancers
    with pytest.raises(openai.AuthenticationError):
        server.client("wrong-key-wrong-key").models.list()
    assert [m.id for m in server.client(KEY_A).models.list().data] == ["tiny"]


def test_tenants_are_walls(a, b, server):
    r = a.post(CHAT, json=chat_body("Only for A.", seed=3), headers={"X-Session-Id": "notes"})
    assert r.status_code == 200, r.text
    mine = info(a, "notes")
    assert a.post(f"{SESSIONS}/notes/fork", json={"name": "notes-copy"}).status_code == 201

    # B sees nothing of A's: not listed, and every call on the name is a 404 (not 403)
    assert [s["name"] for s in b.get(SESSIONS).json()["data"]] == []
    for method, path, body in [("GET", f"{SESSIONS}/notes", None), ("GET", f"{SESSIONS}/notes/messages", None),
                               ("GET", f"{SESSIONS}/notes/export", None), ("DELETE", f"{SESSIONS}/notes", None),
                               ("POST", f"{SESSIONS}/notes/fork", {"name": "stolen"}),
                               ("GET", f"{SESSIONS}/notes-copy", None)]:
        error = assert_openai_error(b.request(method, path, json=body), 404, "session_not_found")
        assert tenant_of(KEY_A).prefix not in error["message"]
    resume = b.post(CHAT, json=chat_body("Only for A.", stream=True), headers={"Last-Event-ID": "notes/20/21"})
    assert_openai_error(resume, 404, "session_not_found")
    # a name is per tenant: B's "notes" is a session of its own, and A's is untouched
    r = b.post(CHAT, json=chat_body("B here.", seed=3), headers={"X-Session-Id": "notes"})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert r.json()["kvstore"]["context"] == "computed"
    assert messages(b, "notes")[0] == ("user", "B here.")
    assert messages(a, "notes")[0] == ("user", "Only for A.")
    assert info(a, "notes")["n_tokens"] == mine["n_tokens"]
    assert {"notes", "notes-copy"} <= {s["name"] for s in a.get(SESSIONS).json()["data"]}
    assert [s["name"] for s in b.get(SESSIONS).json()["data"]] == ["notes"]
    assert info(a, "notes-copy")["parent"] == "notes"
    # in the store, the tenants' sessions are apart (by a hash of the key, not the key)
    with kvstore.open_store(server.home) as store:
        names = store.names()
    assert tenant_of(KEY_A).prefix + "notes" in names and tenant_of(KEY_B).prefix + "notes" in names
    assert not any(KEY_A in n or KEY_B in n for n in names)


# -- 409 -------------------------------------------------------------------------------------------
def test_conflicts_are_409(a, server, model):
    assert a.post(SESSIONS, json={"name": "taken"}).status_code == 201
    assert_openai_error(a.post(SESSIONS, json={"name": "taken"}), 409, "session_exists")
    assert_openai_error(a.post(f"{SESSIONS}/taken/fork", json={"name": "taken"}), 409, "session_exists")

    # a session another process is writing (the library here holds its writer lock): 409, then fine
    stored = tenant_of(KEY_A).stored("held")
    with single_thread(), kvstore.open_store(server.home) as store:
        with store.new(stored, model, seed=1, chunk_size=16):
            r = a.post(CHAT, json=chat_body("hi"), headers={"X-Session-Id": "held"})
            error = assert_openai_error(r, 409, "session_busy")
            assert tenant_of(KEY_A).prefix not in error["message"]
        r = a.post(CHAT, json=chat_body("hi"), headers={"X-Session-Id": "held"})
        assert r.status_code == 200, r.text
        assert r.json()["kvstore"]["context"] == "restored"
        assert store.messages(stored)[0].text == "hi"


# -- 429 -------------------------------------------------------------------------------------------
def burst(server, session: str, n: int) -> list[httpx.Response]:
    """n completions at once on one session."""
    barrier = threading.Barrier(n)
    out: list[httpx.Response | None] = [None] * n

    def one(i: int):
        with server.http(KEY_A) as client:
            barrier.wait()
            out[i] = client.post(COMPLETIONS, json={"model": "tiny", "prompt": f" {i}", "max_tokens": 20,
                                                    "temperature": 0}, headers={"X-Session-Id": session})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def test_one_session_runs_one_request_at_a_time_and_a_full_queue_is_429(server, a):
    """--max-queue 2: of a burst on one session, one runs, two wait their turn, the rest are 429 with
    Retry-After; those that ran ran one after the other (each began where the one before ended)."""
    for attempt in range(3):  # the burst must overlap the first request's run: on a loaded machine, retry
        name = f"queue-{attempt}"
        got = burst(server, name, 8)
        limited = [r for r in got if r.status_code == 429]
        if limited:
            break
    assert limited, [r.status_code for r in got]
    for r in limited:
        assert_openai_error(r, 429, "queue_full")
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert int(r.headers["Retry-After"]) >= 1
    done = sorted((r for r in got if r.status_code != 429), key=lambda r: r.json()["usage"]["prompt_tokens"])
    assert done and all(r.status_code == 200 for r in done), [r.text for r in done]
    assert len(done) + len(limited) == len(got)
    for before, after in zip(done, done[1:]):  # each began after the one before it had ended
        assert after.json()["usage"]["prompt_tokens"] > before.json()["usage"]["total_tokens"]
    assert info(a, name)["n_tokens"] == done[-1].json()["usage"]["total_tokens"]


# -- a client that goes away -----------------------------------------------------------------------
def stream_ids(response: httpx.Response, stop_after: int | None = None) -> tuple[list[int], str | None]:
    """The token ids of a streamed chat completion (from its trace) and the id of its last event."""
    ids, last = [], None
    for event_id, data in sse(response):
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        ids += [line["token"] for line in chunk.get("kvstore", {}).get("trace", [])]
        last = event_id or last
        if stop_after is not None and len(ids) >= stop_after:
            break
    return ids, last


def wait_cancelled(server, session: str) -> None:
    """Until the server's log has the request on `session` that stopped when its client went away."""
    deadline = time.monotonic() + 20
    while not any(rec.get("session") == session and rec.get("outcome") == "cancelled" for rec in log_records(server)):
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.05)


def test_a_client_that_goes_away_stops_its_generation_checkpointed(server, a):
    """Cut after three tokens: the engine stops there (not at max_tokens), the session holds what
    was sent and records the interrupted call; resent with Last-Event-ID, the rest comes, and the
    whole reply is the one an uninterrupted request makes."""
    body = chat_body("Write a long story.", seed=21, temperature=1.0, max_tokens=MAX_TOKENS, stream=True,
                     kvstore_trace=True)
    with server.http(KEY_A) as client:
        with client.stream("POST", CHAT, json=body, headers={"X-Session-Id": "cut"}) as r:
            assert r.status_code == 200
            got, last = stream_ids(r, stop_after=3)
    assert len(got) >= 3 and last
    wait_cancelled(server, "cut")
    cut = info(a, "cut")
    start = int(last.split("/")[1])
    assert cut["active_call"] is not None, cut  # stopped before its end, checkpointed mid-reply
    assert start + len(got) <= cut["n_tokens"] < start + MAX_TOKENS

    with server.http(KEY_A) as client:
        with client.stream("POST", CHAT, json=body, headers={"X-Session-Id": "cut", "Last-Event-ID": last}) as r:
            assert r.status_code == 200, r.read()
            rest, _ = stream_ids(r)
        with client.stream("POST", CHAT, json=body, headers={"X-Session-Id": "whole"}) as r:
            whole, _ = stream_ids(r)
    assert got + rest == whole
    assert info(a, "cut")["active_call"] is None and info(a, "cut")["n_tokens"] == info(a, "whole")["n_tokens"]


def test_a_stream_of_its_own_left_by_its_client_is_kept_as_a_prefix_cache_entry(server, a):
    """A request that names no session runs in one the server makes for it (`chatcmpl-...`, named by
    the stream's event ids). Its client leaves the stream after three tokens: that session becomes a
    prefix-cache entry, so the cache's budget bounds what such streams leave (each stayed in the store
    for good before), and until the budget evicts it, Last-Event-ID finishes the reply as an
    uninterrupted request makes it."""
    def entries() -> float:
        return sample(metrics(server), "kvstore:prefix_cache_entries")

    body = chat_body("Write a long story.", seed=25, temperature=1.0, max_tokens=MAX_TOKENS, stream=True,
                     kvstore_trace=True)
    before = entries()
    with server.http(KEY_A) as client:
        with client.stream("POST", CHAT, json=body) as r:
            assert r.status_code == 200
            got, last = stream_ids(r, stop_after=3)
    own = last.split("/")[0]
    assert own.startswith("chatcmpl-") and len(got) >= 3
    wait_cancelled(server, own)
    deadline = time.monotonic() + 20
    while entries() < before + 1:  # kept by a task of its own once the request is over
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.05)
    assert info(a, own)["active_call"] is not None  # stopped before its end, checkpointed mid-reply
    with server.http(KEY_A) as client:
        with client.stream("POST", CHAT, json=body, headers={"Last-Event-ID": last}) as r:
            assert r.status_code == 200, r.read()
            rest, _ = stream_ids(r)
        with client.stream("POST", CHAT, json=body, headers={"X-Session-Id": "whole-own"}) as r:
            whole, _ = stream_ids(r)
    assert got + rest == whole
    assert info(a, own)["active_call"] is None and entries() == before + 1


def test_a_name_in_any_script_means_the_same_in_the_headers_as_in_the_body(server, a):
    """A session's name may hold letters of any script, and its stream's event ids hold the name. Sent
    back in X-Session-Id and Last-Event-ID as UTF-8 bytes (as EventSource sends the last id), they name
    the session the body named: a stream cut short on it is finished, and the whole reply is the one an
    uninterrupted request makes. Header bytes that are not UTF-8 are read as Latin-1, as HTTP always read
    them (here no name: a 400)."""
    name = "日記-1"
    body = chat_body("Write a long story.", seed=23, temperature=1.0, max_tokens=MAX_TOKENS, stream=True,
                     kvstore_trace=True)
    with server.http(KEY_A) as client:
        with client.stream("POST", CHAT, json=body | {"session": name}) as r:
            assert r.status_code == 200
            got, last = stream_ids(r, stop_after=3)
    assert len(got) >= 3 and last.startswith(f"{name}/")
    wait_cancelled(server, name)
    with server.http(KEY_A) as client:
        headers = {"X-Session-Id": name.encode(), "Last-Event-ID": last.encode()}
        with client.stream("POST", CHAT, json=body, headers=headers) as r:
            assert r.status_code == 200, r.read()
            rest, _ = stream_ids(r)
        with client.stream("POST", CHAT, json=body, headers={"X-Session-Id": "whole-script"}) as r:
            whole, _ = stream_ids(r)
    assert got + rest == whole
    assert info(a, name)["n_tokens"] == info(a, "whole-script")["n_tokens"]
    bad = a.post(CHAT, json=chat_body("Hello.", max_tokens=2), headers={"X-Session-Id": b"\x80-x"})
    assert_openai_error(bad, 400, "invalid_name")


# -- metrics and the log line ----------------------------------------------------------------------
METRICS = ["kvstore:time_to_first_token_seconds", "kvstore:inter_token_latency_seconds",
           "kvstore:e2e_request_latency_seconds", "kvstore:request_queue_time_seconds",
           "kvstore:num_requests_running", "kvstore:num_requests_waiting", "kvstore:prompt_tokens_total",
           "kvstore:generation_tokens_total", "kvstore:session_restore_seconds", "kvstore:session_restore_bytes_total",
           "kvstore:checkpoint_seconds", "kvstore:kv_resident_bytes", "kvstore:engine_restarts_total",
           "kvstore:request_errors_total", "kvstore:engine_step_seconds", "kvstore:model_forward_seconds"]


def test_an_idle_engine_reports_its_last_forwards_at_once(server, a):
    """The engine sends its forwards' sizes at most every half second while it runs and the rest as
    soon as it has nothing to run: a reply's forwards are all in the metrics shortly after it ends,
    without waiting for another request."""
    before = metrics(server)
    r = a.post(CHAT, json=chat_body("Name three colours.", max_tokens=12, seed=5), headers={"X-Session-Id": "idle"})
    assert r.status_code == 200
    tokens = r.json()["usage"]["completion_tokens"]
    deadline, moved = time.monotonic() + 5, 0.0
    while time.monotonic() < deadline:
        moved = sample(metrics(server), "kvstore:batch_sessions_per_step_count") \
            - sample(before, "kvstore:batch_sessions_per_step_count")
        if moved >= tokens:  # a forward per new token (the prompt's, and the last token's, besides)
            break
        time.sleep(0.05)
    assert moved >= tokens, (moved, tokens)


def test_each_engine_step_reports_its_seconds_and_its_model_calls_seconds(server, a):
    """Every step that ran a forward reports how long it took and how much of it the model's calls took
    (the forward and the head): the rest is the jobs' own work (sampling, events, checkpoints)."""
    before = metrics(server)
    r = a.post(CHAT, json=chat_body("Name two rivers.", max_tokens=10, seed=4), headers={"X-Session-Id": "timed"})
    assert r.status_code == 200

    def grown(name: str) -> float:
        return sample(metrics(server), name) - sample(before, name)

    deadline = time.monotonic() + 5
    while grown("kvstore:batch_sessions_per_step_count") < r.json()["usage"]["completion_tokens"] \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    steps = grown("kvstore:batch_sessions_per_step_count")
    assert steps >= r.json()["usage"]["completion_tokens"]
    assert grown("kvstore:engine_step_seconds_count") == grown("kvstore:model_forward_seconds_count") == steps
    model_s, step_s = grown("kvstore:model_forward_seconds_sum"), grown("kvstore:engine_step_seconds_sum")
    assert 0 < model_s < step_s


def test_metrics_are_named_like_vllms_and_move(server, a, model):
    text = httpx.get(server.url + "/metrics", timeout=10).text
    families = {f.name for f in text_string_to_metric_families(text)}
    assert {n.removesuffix("_total") for n in METRICS} <= families, sorted(families)
    assert all(f.startswith("kvstore:") for f in families)

    before = metrics(server)
    r = a.post(CHAT, json=chat_body("Count to ten.", max_tokens=12, seed=2), headers={"X-Session-Id": "metered"})
    assert r.status_code == 200
    usage = r.json()["usage"]
    now = metrics(server)

    def moved(name, **labels):
        return sample(now, name, **labels) - sample(before, name, **labels)

    assert moved("kvstore:time_to_first_token_seconds_count", context="computed") == 1
    assert moved("kvstore:e2e_request_latency_seconds_count") == 1
    assert moved("kvstore:request_queue_time_seconds_count") == 1
    assert moved("kvstore:checkpoint_seconds_count") == 1
    assert moved("kvstore:inter_token_latency_seconds_count") == usage["completion_tokens"] - 1
    assert moved("kvstore:generation_tokens_total") == usage["completion_tokens"]
    assert moved("kvstore:prompt_tokens_total", source="computed") == usage["prompt_tokens"]
    assert sample(now, "kvstore:kv_resident_bytes", engine="0") > 0
    assert sample(now, "kvstore:num_requests_running") == 0 and sample(now, "kvstore:num_requests_waiting") == 0

    # the next turn reuses what the engine holds: "reused", its prompt tokens restored
    reply = r.json()["choices"][0]["message"]["content"]
    r = a.post(CHAT, json=chat_body("Count to ten.", reply, "Again.", max_tokens=4, seed=2),
               headers={"X-Session-Id": "metered"})
    assert r.status_code == 200 and r.json()["kvstore"]["context"] == "reused"
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    later = metrics(server)
    assert sample(later, "kvstore:time_to_first_token_seconds_count", context="reused") \
        - sample(now, "kvstore:time_to_first_token_seconds_count", context="reused") == 1
    assert sample(later, "kvstore:prompt_tokens_total", source="restored") \
        - sample(now, "kvstore:prompt_tokens_total", source="restored") == cached > 0

    # a session reopened from the store: "restored", with its seconds and bytes
    assert a.post(SESSIONS, json={"name": "cold", "seed": 4}).status_code == 201
    r = a.post(CHAT, json=chat_body("hi", max_tokens=2), headers={"X-Session-Id": "cold"})
    assert r.status_code == 200 and r.json()["kvstore"]["context"] == "restored"
    restored = metrics(server)
    assert sample(restored, "kvstore:session_restore_seconds_count") > sample(later,
                                                                               "kvstore:session_restore_seconds_count")
    assert sample(restored, "kvstore:time_to_first_token_seconds_count", context="restored") >= 1

    # errors, by status
    assert a.post(CHAT, json=chat_body("x", colour="blue")).status_code == 400
    with server.http() as anonymous:
        assert anonymous.get("/v1/models").status_code == 401
    errors = metrics(server)
    assert sample(errors, "kvstore:request_errors_total", code="400") - \
        sample(restored, "kvstore:request_errors_total", code="400") == 1
    assert sample(errors, "kvstore:request_errors_total", code="401") - \
        sample(restored, "kvstore:request_errors_total", code="401") == 1


def test_engine_restarts_are_counted(server, a):
    before = sample(metrics(server), "kvstore:engine_restarts_total")
    old = server.kill_engine()
    deadline = time.monotonic() + 60
    while True:
        try:
            health = server.health()
            if health.get("status") == "ok" and health["engines"] != [old]:
                break
        except (httpx.HTTPError, ValueError):
            pass
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.1)
    assert sample(metrics(server), "kvstore:engine_restarts_total") == before + 1
    r = a.post(CHAT, json=chat_body("still here?", max_tokens=2), headers={"X-Session-Id": "after-restart"})
    assert r.status_code == 200, r.text


def test_one_json_log_line_per_request(server, a):
    r = a.post(CHAT, json=chat_body("Log me.", max_tokens=5, seed=9), headers={"X-Session-Id": "logged"})
    assert r.status_code == 200
    request_id = r.json()["id"].removeprefix("chatcmpl-")
    record = wait_for_record(server, request_id)
    usage = r.json()["usage"]
    tenant = tenant_of(KEY_A).id
    assert re.fullmatch(r"t[0-9a-f]{10}", tenant)
    assert record["session"] == "logged" and record["tenant"] == tenant and record["outcome"] == "ok"
    assert record["status"] == 200 and record["context"] == "computed"
    assert record["tokens_generated"] == usage["completion_tokens"]
    assert record["tokens_computed"] + record["tokens_restored"] == usage["prompt_tokens"]
    assert record["tokens_restored"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert 0 < record["ttft_s"] <= record["duration_s"]

    # a refused request has its line too, and no key is ever written
    assert a.post(CHAT, json=chat_body("x", colour="blue"), headers={"X-Session-Id": "refused"}).status_code == 400
    deadline = time.monotonic() + 10
    while not [x for x in log_records(server) if x.get("session") == "refused"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    refused = [x for x in log_records(server) if x.get("session") == "refused"][-1]
    assert refused["status"] == 400 and refused["outcome"] == "unknown_parameter" and refused["tenant"] == tenant
    assert KEY_A not in server.log() and KEY_B not in server.log()
    ids = [x["request_id"] for x in log_records(server) if "request_id" in x]
    assert len(ids) == len(set(ids))  # one line per request


# -- SIGTERM ---------------------------------------------------------------------------------------
def test_sigterm_drains_checkpoints_and_exits_0(tmp_path, model_dir, model):
    """Eight long streams in flight (interleaved, so each is slow); SIGTERM: the server stops
    accepting, every session is checkpointed with at least what its client received, and the
    command exits 0 within the grace period. The key comes from $KVSTORE_API_KEYS."""
    key, grace = "key-gamma-5555555555", 5
    live = LiveServer(tmp_path / "home", model_dir, "--chunk-size", "16", "--threads", "1", "--grace", str(grace),
                      env={"KVSTORE_API_KEYS": f"{key},key-delta-6666666666"}).start()
    received: dict[str, tuple[list[int], str | None]] = {}
    first_tokens = threading.Barrier(9, timeout=60)

    def client(i: int):
        body = chat_body("Write a long story.", seed=i, temperature=1.0, max_tokens=230, stream=True,
                         kvstore_trace=True)
        ids: list[int] = []
        last = None
        try:
            with live.http(key) as http, http.stream("POST", CHAT, json=body,
                                                     headers={"X-Session-Id": f"drain-{i}"}) as r:
                assert r.status_code == 200
                for event_id, data in sse(r):
                    if data == "[DONE]":
                        break
                    ids += [line["token"] for line in json.loads(data).get("kvstore", {}).get("trace", [])]
                    last = event_id or last
                    if len(ids) == 1:
                        first_tokens.wait()
        except (httpx.HTTPError, threading.BrokenBarrierError):
            pass
        finally:
            received[f"drain-{i}"] = (ids, last)

    try:
        assert httpx.get(live.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        first_tokens.wait()
        stopped = time.monotonic()
        code = live.stop(timeout=grace + 30)
        took = time.monotonic() - stopped
        for t in threads:
            t.join(30)
    finally:
        if live.process.poll() is None:
            live.process.kill()
    assert code == 0, live.log()[-3000:]
    assert took < grace + 15, took
    assert "Traceback" not in live.log(), live.log()
    with pytest.raises(httpx.ConnectError):
        httpx.get(live.url + "/health", timeout=2)
    prefix = tenant_of(key).prefix
    with kvstore.open_store(live.home) as store:
        for name, (ids, last) in received.items():
            assert ids, f"{name} got no token before SIGTERM"
            start = int(last.split("/")[1])
            stored = store.tokens(prefix + name)
            assert stored[start:start + len(ids)] == ids, name
            with single_thread(), store.open(prefix + name, model):  # the writer lock was released
                pass


# -- binding -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.7", "example.org"])
def test_a_public_address_without_keys_is_refused(host, tmp_path, model_dir):
    result = CliRunner().invoke(cli, ["--home", str(tmp_path / "home"), "serve", "--host", host, "--model", model_dir],
                                env={"KVSTORE_API_KEYS": ""})
    assert result.exit_code == 2, result.output
    assert "--allow-unauthenticated" in result.output and "--api-key-file" in result.output


def test_the_real_command_refuses_it_before_loading_anything(tmp_path, model_dir):
    import subprocess
    import sys

    exe = str(Path(sys.executable).parent / "kvstore")
    done = subprocess.run([exe, "--home", str(tmp_path / "home"), "serve", "--host", "0.0.0.0", "--port", "0",
                           "--model", model_dir], capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in __import__("os").environ.items() if k != "KVSTORE_API_KEYS"})
    assert done.returncode == 2 and "no API keys are set" in done.stderr, done.stderr
    assert not (tmp_path / "home").exists()  # nothing was started


@pytest.mark.parametrize("host,args,env,keys", [
    ("0.0.0.0", ["--allow-unauthenticated"], {}, []),  # the operator says so explicitly
    ("0.0.0.0", [], {"KVSTORE_API_KEYS": "key-one-11111111, key-two-22222222"}, ["key-one-11111111",
                                                                               "key-two-22222222"]),
    ("127.0.0.1", [], {}, []), ("localhost", [], {}, []), ("::1", [], {}, []),
])
def test_what_may_be_served(host, args, env, keys, tmp_path, model_dir, monkeypatch):
    started = []
    monkeypatch.setattr(command, "run", started.append)
    result = CliRunner().invoke(cli, ["serve", "--host", host, "--model", model_dir, *args],
                                env={"KVSTORE_API_KEYS": "", **env})
    assert result.exit_code == 0, result.output
    (config,) = started
    assert config.host == host and config.api_keys == keys and config.allow_open == bool(args)


@pytest.mark.parametrize("text,error", [("", "holds no API key"), ("short\n", "at least 8 characters"),
                                        ("with a space inside\n", "without spaces")])
def test_bad_key_files_are_usage_errors(text, error, tmp_path, monkeypatch, model_dir):
    monkeypatch.setattr(command, "run", lambda config: pytest.fail("started"))
    keys = tmp_path / "keys.txt"
    keys.write_text(text, encoding="utf-8")
    result = CliRunner().invoke(cli, ["serve", "--api-key-file", str(keys), "--model", model_dir],
                                env={"KVSTORE_API_KEYS": ""})
    assert result.exit_code == 2 and error in result.output, result.output


def test_cuda_without_cuda_is_a_usage_error_before_anything_starts(tmp_path, monkeypatch, model_dir):
    import torch

    monkeypatch.setattr(command, "run", lambda config: pytest.fail("started"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = CliRunner().invoke(cli, ["--home", str(tmp_path / "home"), "serve", "--device", "cuda",
                                      "--model", model_dir], env={"KVSTORE_API_KEYS": ""})
    assert result.exit_code == 2, result.output
    assert "CUDA is not available here" in result.output and "--device cpu" in result.output
    assert not (tmp_path / "home").exists()


def test_the_device_reaches_the_engines(tmp_path, monkeypatch, model_dir):
    import torch

    started = []
    monkeypatch.setattr(command, "run", started.append)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    result = CliRunner().invoke(cli, ["serve", "--device", "cuda", "--model", model_dir], env={"KVSTORE_API_KEYS": ""})
    assert result.exit_code == 0, result.output
    (config,) = started
    assert config.device == "cuda"
    from kvstore_serve.service import Service

    monkeypatch.setattr("kvstore_serve.service.Pool", lambda settings, workers, metrics: settings)
    assert Service(config).pool["device"] == "cuda"  # the settings each engine process loads its model with
