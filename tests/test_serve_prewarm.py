"""`kvstore serve --prewarm` (the default): after a start, each engine restores the sessions it held
open before, the most recently used first, while no request waits (serve/prewarm.py).

What it proves: after a kill -9 of the server, the conversations it held are in memory again before
their next request (its context "reused", not "restored"), and that reply is byte-identical (its trace
tokens) to the same turn on a twin session that its own request restored (--no-prewarm); a session
another writer holds and one deleted meanwhile are left out without an error, and their requests go
on as before; an engine fills half of its KV memory at most, the most recently used session first;
an engine killed alone (the server starts another) restores what it held too.
"""

from __future__ import annotations

import re
import time

import pytest

import kvstore
from serve_kit import MODEL_NAME, LiveServer

CHUNK = 16
SAMPLING = {"temperature": 0.9, "top_p": 0.95, "seed": 7}
FIRST = [{"role": "user", "content": "Tell me about the store."}]


@pytest.fixture(scope="module")
def model_folder(tiny) -> str:
    return str(tiny("llama-gqa").folder)


def turn(server, session: str, messages: list[dict]) -> dict:
    r = server.http().post("/v1/chat/completions", json={
        "model": MODEL_NAME, "messages": messages, "max_tokens": 12, "session": session, "kvstore_trace": True,
        **SAMPLING})
    assert r.status_code == 200, r.text
    return r.json()


def second(first: dict) -> list[dict]:
    """The conversation after `first`'s reply, with the next question."""
    return [*FIRST, {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And then?"}]


def prewarmed(server, sessions: int) -> None:
    """Wait until the server's engines have restored `sessions` sessions after its start."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = re.search(r"^kvstore:kv_prewarmed_sessions_total (\S+)$", server.http().get("/metrics").text, re.M)
        if found and float(found.group(1)) >= sessions:
            assert float(found.group(1)) == sessions
            return
        time.sleep(0.05)
    raise AssertionError(f"the engine did not restore {sessions} sessions after its start:\n{server.log()[-2000:]}")


def tokens(reply: dict) -> list[int]:
    return [t["token"] for t in reply["kvstore"]["trace"]]


def test_after_a_kill_9_the_sessions_held_open_are_in_memory_before_their_next_request(tmp_path, model_folder):
    with LiveServer(tmp_path / "home", model_folder, "--chunk-size", str(CHUNK), "--threads", "1") as server:
        firsts = {name: turn(server, name, FIRST) for name in ("a", "twin")}
        assert tokens(firsts["a"]) == tokens(firsts["twin"])
        server.kill()
        server.start()
        prewarmed(server, 2)
        again = turn(server, "a", second(firsts["a"]))
        assert again["kvstore"]["context"] == "reused"  # in memory before it asked
        assert "restored 2 of the sessions it held before it started" in server.log()

        server.kill()
        server.args.append("--no-prewarm")
        server.start()
        twin = turn(server, "twin", second(firsts["twin"]))
        assert twin["kvstore"]["context"] == "restored"  # its own request restored it
        assert tokens(twin) == tokens(again) and twin["choices"][0]["message"] == again["choices"][0]["message"]


def test_an_engine_killed_and_started_again_by_the_server_has_its_sessions_back(tmp_path, model_folder):
    """kill -9 of the engine alone: the API process starts another, which restores what the dead one
    held (its lock released by the kernel), before their next request."""
    with LiveServer(tmp_path / "home", model_folder, "--chunk-size", str(CHUNK), "--threads", "1") as server:
        first = turn(server, "a", FIRST)
        killed = server.kill_engine()
        prewarmed(server, 1)  # by the engine started after it
        assert killed not in server.engine_pids()
        assert turn(server, "a", second(first))["kvstore"]["context"] == "reused"


def test_a_session_held_by_another_writer_or_deleted_is_left_out_and_its_request_goes_on(tmp_path, model_folder):
    home = tmp_path / "home"
    with LiveServer(home, model_folder, "--chunk-size", str(CHUNK), "--threads", "1") as server:
        firsts = {name: turn(server, name, FIRST) for name in ("held", "gone", "kept")}
        server.kill()
        store = kvstore.open_store(home)
        store.delete("gone")
        with store.open("held", kvstore.load_model(model_folder)):  # this process is its writer meanwhile
            server.start()
            prewarmed(server, 1)
        assert "restored 1 of the sessions it held before it started" in server.log()
        assert "2 left out" in server.log()
        assert turn(server, "kept", second(firsts["kept"]))["kvstore"]["context"] == "reused"
        assert turn(server, "held", second(firsts["held"]))["kvstore"]["context"] == "restored"
        assert turn(server, "gone", FIRST)["kvstore"]["context"] == "computed"  # a new session of that name
        store.close()


def test_an_engine_restores_into_half_of_its_kv_memory_at_most_the_most_recent_first(tmp_path, model_folder):
    """Room for three of these sessions: half of it holds one, the one used last."""
    cfg = kvstore.load_model(model_folder).config
    probe = tmp_path / "probe"
    with LiveServer(probe, model_folder, "--chunk-size", str(CHUNK), "--threads", "1") as server:
        used = turn(server, "probe", FIRST)["usage"]
    blocks = -(-(used["prompt_tokens"] + used["completion_tokens"]) // 16)
    budget = 3 * blocks * 16 * 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2  # bfloat16 K and V
    with LiveServer(tmp_path / "home", model_folder, "--chunk-size", str(CHUNK), "--threads", "1",
                    "--kv-memory", str(budget)) as server:
        firsts = {name: turn(server, name, FIRST) for name in ("older", "newer")}
        server.kill()
        server.start()
        prewarmed(server, 1)
        assert turn(server, "newer", second(firsts["newer"]))["kvstore"]["context"] == "reused"
        assert turn(server, "older", second(firsts["older"]))["kvstore"]["context"] == "restored"
