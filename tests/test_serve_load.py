"""A bounded load test on loopback: 16 clients, 5 turns each, over 8 sessions (two clients send to
each at once), with an engine that runs 4 requests at a time and a queue of 2, so that requests wait
for their session and the engine and some are refused. No error but 429 (the client waits its
Retry-After and sends the turn again), no lost turn, and every session's tokens equal a sequential
replay of its turns, in the order the server served them, through the library (one thread here,
`--threads 1` there: the same bits).

The turns are completions (`/v1/completions`: text appended to the session, then a reply): ten chat
turns, with the template's two dozen tokens each, do not fit the tiny model's 256 positions, and
two clients can only send chat turns on one session in turn (each resends the history it knows).
"""

from __future__ import annotations

import random
import threading
import time

import httpx

import kvstore
from conftest import single_thread
from serve_kit import LiveServer

CLIENTS, TURNS, SESSIONS = 16, 5, 8
MAX_TOKENS = 12  # ten turns of a session fit the tiny model's 256 positions
TEMPERATURE, TOP_P = 0.8, 0.95
DEADLINE = 120.0  # seconds, the whole test


def seed(session: int) -> int:
    return 100 + session


def test_sixteen_clients_five_turns_eight_sessions(tmp_path, tiny, model):
    started = time.monotonic()
    live = LiveServer(tmp_path / "home", str(tiny("llama-gqa").folder), "--chunk-size", "16", "--threads", "1",
                      "--max-running", "4", "--max-queue", "2").start()
    served: dict[str, list[tuple[int, int, str, list[int]]]] = {f"load-{i}": [] for i in range(SESSIONS)}
    failures: list[str] = []
    refused = []
    lock = threading.Lock()

    def client(c: int):
        rng = random.Random(c)
        name = f"load-{c % SESSIONS}"
        with live.http() as http:
            for turn in range(TURNS):
                text = f" {c}.{turn}{rng.choice('?!.,')}"
                body = {"model": "tiny", "prompt": text, "max_tokens": MAX_TOKENS, "temperature": TEMPERATURE,
                        "top_p": TOP_P, "seed": seed(c % SESSIONS), "kvstore_trace": True}
                while True:
                    if time.monotonic() - started > DEADLINE:
                        failures.append(f"{name} client {c} turn {turn}: out of time")
                        return
                    r = http.post("/v1/completions", json=body, headers={"X-Session-Id": name})
                    if r.status_code != 429:
                        break
                    with lock:
                        refused.append(r.headers.get("Retry-After"))
                    time.sleep(float(r.headers["Retry-After"]) * rng.uniform(0.05, 0.3))
                if r.status_code != 200:
                    failures.append(f"{name} client {c} turn {turn}: {r.status_code} {r.text}")
                    return
                usage = r.json()["usage"]
                ids = [line["token"] for line in r.json()["kvstore"]["trace"]]
                with lock:
                    served[name].append((usage["prompt_tokens"], usage["total_tokens"], text, ids))

    try:
        threads = [threading.Thread(target=client, args=(c,)) for c in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(DEADLINE)
        assert not failures, failures
        exposition = httpx.get(live.url + "/metrics", timeout=10).text
    finally:
        code = live.stop()
    assert code == 0, live.log()[-3000:]
    assert "Traceback" not in live.log(), live.log()

    # no error but 429, and every 429 said when to come back
    errors = [line for line in exposition.splitlines() if line.startswith("kvstore:request_errors_total{")]
    assert all('code="429"' in line for line in errors), errors
    assert all(r is not None and float(r) > 0 for r in refused)
    print(f"{len(refused)} requests were refused with 429 and sent again")

    # no lost turn, and one at a time: in each session, each turn began where the one before ended
    with kvstore.open_store(live.home) as store:
        stored = {name: store.tokens(name) for name in served}
    for name, turns in served.items():
        turns.sort()
        assert len(turns) == TURNS * CLIENTS // SESSIONS, name
        for (_, end, _, _), (begin, _, _, _) in zip(turns, turns[1:]):
            assert begin > end, (name, turns)
        assert len(stored[name]) == turns[-1][1], name

    # the same tokens as a sequential replay through the library, in the order they were served
    with single_thread(), kvstore.open_store(tmp_path / "replay") as store:
        for i, (name, turns) in enumerate(served.items()):
            with store.new(name, model, seed=seed(i), chunk_size=16, temperature=TEMPERATURE, top_p=TOP_P) as s:
                for begin, end, text, ids in turns:
                    s.append_text(text)
                    assert len(s.tokens) == begin, name
                    assert list(s.generate(MAX_TOKENS, temperature=TEMPERATURE, top_p=TOP_P)) == ids, name
                assert list(s.tokens) == stored[name], name
    assert time.monotonic() - started < DEADLINE
