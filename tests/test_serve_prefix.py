"""The prefix cache over HTTP (contract C10): requests that name no session, from a live server.

A stateless chat (the client resends its history each turn) computes from turn 2 on only the new
tokens, rounded to a chunk, and every reply's trace (position, token, sha256 of the logits) equals
the cold run of the same request through the library; the entries survive a restart of the
server; the metrics count the tokens asked and reused; `--prefix-cache 0` keeps nothing.
"""

from __future__ import annotations

import json
import re
import time

import pytest

import kvstore
from conftest import single_thread
from serve_kit import MODEL_NAME, LiveServer

CHUNK = 16
SAMPLING = {"temperature": 0.9, "top_p": 0.95, "seed": 5}
QUESTIONS = ["hello there, tell me about the sea and the ships on it",
             "and what about the harbour?", "who keeps the lighthouse?"]


@pytest.fixture(scope="module")
def model_folder(tiny) -> str:
    return str(tiny("llama-gqa").folder)


def start(tmp_path, model_folder, *args) -> LiveServer:
    return LiveServer(tmp_path / "home", model_folder, "--chunk-size", str(CHUNK), "--threads", "1", *args)


def ask(server, messages: list[dict], **more):
    return server.client().chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12,
                                                   extra_body={"kvstore_trace": True}, **SAMPLING, **more)


def cold_trace(model_folder: str, home, messages: list[dict]) -> list[dict]:
    """The library's cold run of the request (a new session, the whole prompt computed)."""
    store = kvstore.open_store(home)
    path = home / "cold.jsonl"
    with single_thread(), store.new("cold", kvstore.load_model(model_folder), seed=SAMPLING["seed"], chunk_size=CHUNK,
                                    temperature=SAMPLING["temperature"], top_p=SAMPLING["top_p"]) as s:
        "".join(s.respond(messages, 12, trace=str(path)))
    store.close()
    return [json.loads(line) for line in path.read_text().splitlines()]


def metric(server, name: str) -> float:
    text = server.http().get("/metrics").text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


def test_a_stateless_chat_reuses_its_history_exactly_and_across_a_restart(tmp_path, model_folder):
    server = start(tmp_path, model_folder).start()
    try:
        messages, prompts, cached = [], [], []
        for i, question in enumerate(QUESTIONS):
            messages.append({"role": "user", "content": question})
            reply = ask(server, messages)
            assert reply.kvstore["trace"] == cold_trace(model_folder, tmp_path / f"lib-{i}", messages), f"turn {i}"
            prompts.append(reply.usage.prompt_tokens)
            cached.append(reply.usage.prompt_tokens_details.cached_tokens)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        assert cached[0] == 0
        for i in (1, 2):  # the previous prompt's whole chunks at least: only the new tokens, rounded, computed
            assert cached[i] % CHUNK == 0 and cached[i] >= prompts[i - 1] // CHUNK * CHUNK > 0
        assert metric(server, "kvstore:prefix_cache_queries_total") == sum(prompts)
        assert metric(server, "kvstore:prefix_cache_hits_total") == sum(cached)
        assert metric(server, "kvstore:prefix_cache_entries") == 3
        assert metric(server, "kvstore:prefix_cache_bytes") > 0
        assert metric(server, "kvstore:prefix_cache_evictions_total") == 0
        server.stop()
        server.start()  # the entries are in the index
        again = ask(server, messages[:-1])
        assert again.usage.prompt_tokens_details.cached_tokens >= cached[2]
        assert again.kvstore["trace"] == cold_trace(model_folder, tmp_path / "lib-again", messages[:-1])
    finally:
        server.stop()


def test_a_small_budget_keeps_the_newest_entries_and_every_named_session(tmp_path, model_folder):
    with start(tmp_path, model_folder, "--prefix-cache", "1") as server:
        client = server.client()
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": QUESTIONS[0]}],
                                       max_tokens=4, extra_body={"session": "named"}, **SAMPLING)
        for q in QUESTIONS:
            ask(server, [{"role": "user", "content": q}])
        names = {s["name"] for s in server.http().get("/v1/sessions").json()["data"]}
        assert "named" in names and not any(n.startswith("chatcmpl-") for n in names)  # each entry > 1 byte
        assert metric(server, "kvstore:prefix_cache_evictions_total") == 3
        assert metric(server, "kvstore:prefix_cache_entries") == 0


def test_prefix_cache_0_turns_it_off(tmp_path, model_folder):
    with start(tmp_path, model_folder, "--prefix-cache", "0") as server:
        messages = [{"role": "user", "content": QUESTIONS[0]}]
        first = ask(server, messages)
        second = ask(server, messages)
        assert first.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens_details.cached_tokens == 0
        assert first.kvstore["trace"] == second.kvstore["trace"]
        assert server.http().get("/v1/sessions").json()["data"] == []
        assert metric(server, "kvstore:prefix_cache_queries_total") == 0
        # a stream its client left after a few chunks: its session is deleted too, by a task of its own
        body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 200, "stream": True, **SAMPLING}
        with server.http() as http:
            with http.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                chunks = (line for line in r.iter_lines() if line.startswith("data:"))
                first = [next(chunks) for _ in range(3)]
            assert "chatcmpl-" in first[0]
            deadline = time.monotonic() + 20
            while http.get("/v1/sessions").json()["data"]:
                assert time.monotonic() < deadline, server.log()[-3000:]
                time.sleep(0.05)
        # n choices: each one's session deleted, after a whole answer and after a stream its client left
        assert len(ask(server, messages, n=3).choices) == 3
        assert http_sessions(server) == []
        with server.http() as http:
            with http.stream("POST", "/v1/chat/completions", json={**body, "n": 2}) as r:
                assert r.status_code == 200
                chunks = (line for line in r.iter_lines() if line.startswith("data:"))
                assert all(next(chunks) for _ in range(3))
        deadline = time.monotonic() + 20
        while http_sessions(server):
            assert time.monotonic() < deadline, server.log()[-3000:]
            time.sleep(0.05)


def http_sessions(server) -> list:
    return server.http().get("/v1/sessions").json()["data"]
