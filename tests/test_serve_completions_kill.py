"""The completions API when the engine dies while it reads a prompt (kill -9, the API process stays
up and runs the job again on the engine it starts: `pool.Pool._resubmit`).

What it proves: a named session's prompt is held once, its tokens those of an uncut run, and the
reply the same text (the prompt is recorded with its call, `Session.begin`, and the call finished
from the store); streamed with `echo`, the reply still begins with the prompt, sent again by the
engine that finished the call since the dead one never sent it. The engine is killed once the
session's index row shows the prompt recorded and not all of it read, watched from this process.

And when the whole server is killed while it streams a reply, the same completion resent without
Last-Event-ID (as a client that retries sends it) is answered with that reply, finished: its prompt
is not appended a second time (`jobs.retried_prompt`).
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


def streamed_text(server, session: str, prompt: str, *, chunks: int | None = None, **more) -> str:
    """A streamed completion's text; with `chunks`, its first `chunks` chunks' only: then the client goes away."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0, "session": session,
            "stream": True, **more}
    got: list[str] = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for chunk in _chunks(r.iter_lines()):
            got.append(chunk["choices"][0]["text"])
            if len(got) == chunks:
                break
    return "".join(got)


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


TOLD = " ".join(f"line {i} of it." for i in range(4))  # short: the tiny model's context holds it twice


def occurrences(seq: list[int], part: list[int]) -> int:
    return sum(seq[i:i + len(part)] == part for i in range(len(seq) - len(part) + 1))


def test_a_completion_cut_by_kill_9_of_the_server_and_resent_is_that_reply_whole_its_prompt_held_once(
        tmp_path, model_folder):
    """A completion on a named session whose stream the server's death cut, sent again without
    Last-Event-ID and not streamed, gets the reply it would have had (the cut one finished from its
    checkpoint), the session holding its prompt once, as an uncut run's; with `echo`, the prompt
    before it. The same prompt with another max_tokens is another request: appended again."""
    with LiveServer(tmp_path / "home", model_folder, "--chunk-size", str(CHUNK), "--threads", "1",
                    "--checkpoint-every", "4") as server:
        for name in ("uncut", "cut", "cut-echo", "cut-other"):
            complete(server, name, "Hello there.")
        store = kvstore.open_store(tmp_path / "home")
        first = store.info("uncut").n_tokens
        whole = complete(server, "uncut", TOLD, max_tokens=40)
        text = whole["choices"][0]["text"]
        prompt_ids = store.tokens("uncut")[first:whole["usage"]["prompt_tokens"]]
        for name, more in (("cut", {}), ("cut-echo", {"echo": True}), ("cut-other", {})):
            got = streamed_text(server, name, TOLD, chunks=12, max_tokens=40, **more)
            assert len(got) < len((TOLD if more else "") + text)  # cut before its end
        server.kill()
        server.start()

        retried = complete(server, "cut", TOLD, max_tokens=40)
        assert retried["choices"][0]["text"] == text
        assert store.tokens("cut") == store.tokens("uncut")  # the prompt once, the reply finished after it
        usage = retried["usage"]
        assert usage["completion_tokens"] == whole["usage"]["completion_tokens"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]  # the prompt not read again

        echoed = complete(server, "cut-echo", TOLD, max_tokens=40, echo=True)
        assert echoed["choices"][0]["text"] == TOLD + text
        assert store.tokens("cut-echo") == store.tokens("uncut")

        other = complete(server, "cut-other", TOLD, max_tokens=41)
        assert other["usage"]["prompt_tokens"] > whole["usage"]["prompt_tokens"] + len(prompt_ids)
        assert occurrences(store.tokens("cut-other"), prompt_ids) == 2
        assert occurrences(store.tokens("cut"), prompt_ids) == 1
        store.close()
