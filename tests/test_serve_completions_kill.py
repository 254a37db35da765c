"""The completions API when the engine dies while it reads a prompt (kill -9, the API process stays
up and runs the job again on the engine it starts: `pool.Pool._resubmit`).

What it proves: a named session's prompt is held once, its tokens those of an uncut run, and the
reply the same text (the prompt is recorded with its call, `Session.begin`, and the call finished
from the store); streamed with `echo`, the reply still begins with the prompt, sent again by the
engine that finished the call since the dead one never sent it. The engine is killed once the
session's index row shows the prompt recorded and not all of it read, watched from this process.
"""

from __future__ import annotations

import json
import threading
import time

import httpx

import kvstore
from serve_kit import MODEL_NAME, LiveServer
from test_serve_chat import model_folder  # noqa: F401 (fixture)

CHUNK = 4  # small chunks, each checkpointed: the prompt takes long enough to read to be cut midway
PROMPT = " ".join(f"line {i} of it." for i in range(14))  # about 180 tokens: some 45 chunks


def complete(server, session: str, prompt: str, **more) -> dict:
    r = server.http().post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4,
                                                  "temperature": 0, "session": session, **more}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def streamed_text(server, session: str, prompt: str, **more) -> str:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0, "session": session,
            "stream": True, **more}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        return "".join(chunk["choices"][0]["text"] for chunk in _chunks(r.iter_lines()))


def _chunks(lines):
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                yield chunk


def killed_while_reading(server, store, session: str, request) -> tuple[object, int | None]:
    """Run `request()` on a thread and kill the engine once `session`'s prompt is recorded and partly
    read; (the request's result, the killed pid, None where the prompt was read before this process
    saw it partly read: on a busy machine the read can slip between two looks)."""
    before = store.info(session).n_tokens
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("result", request()))
    t.start()
    killed, deadline = None, time.monotonic() + 60
    while killed is None and time.monotonic() < deadline and t.is_alive():
        info = store.info(session)
        if info.n_tokens > before and info.n_cached < info.n_tokens - 4 * CHUNK:  # chunks left to read
            killed = server.kill_engine()
    t.join(300)
    return out["result"], killed


def cut(server, store, prefix: str, request) -> tuple[str, object, int]:
    """`request(session)` on fresh sessions `prefix-1`, `prefix-2`, ... (each given the same first turn)
    until one is cut while its prompt is read: (that session, the result, the killed pid). An attempt
    that is not cut is an ordinary request (`request`'s own checks hold for it)."""
    for attempt in range(1, 5):
        session = f"{prefix}-{attempt}"
        complete(server, session, "Hello there.")
        result, killed = killed_while_reading(server, store, session, lambda: request(session))
        if killed is not None:
            return session, result, killed
    raise AssertionError("the prompt was read each time before the engine could be killed")


def restarted(server) -> list[int]:
    """The engine pids once the API process has started the one after the killed one."""
    deadline = time.monotonic() + 60
    while (metrics := httpx.get(server.url + "/metrics").text) and time.monotonic() < deadline:
        if "kvstore:engine_restarts_total 0.0" not in metrics:
            break
        time.sleep(0.05)
    return server.engine_pids()


def test_a_named_sessions_prompt_cut_by_kill_9_while_read_is_held_once_and_answered(tmp_path, model_folder):
    with LiveServer(tmp_path / "home", model_folder, "--chunk-size", str(CHUNK), "--threads", "1") as server:
        store = kvstore.open_store(tmp_path / "home")
        for name in ("uncut", "uncut-echo"):
            complete(server, name, "Hello there.")
        whole = complete(server, "uncut", PROMPT)
        session, reply, killed = cut(server, store, "cut", lambda name: complete(server, name, PROMPT))
        assert killed not in restarted(server)
        assert store.tokens(session) == store.tokens("uncut")  # the prompt once, the same reply after it
        assert reply["choices"][0]["text"] == whole["choices"][0]["text"]

        echoed = streamed_text(server, "uncut-echo", PROMPT, echo=True)
        session, text, _ = cut(server, store, "cut-echo", lambda name: streamed_text(server, name, PROMPT, echo=True))
        assert echoed.startswith(PROMPT) and text == echoed
        assert store.tokens(session) == store.tokens("uncut-echo")
        store.close()
