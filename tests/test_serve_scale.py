"""More sessions than the KV memory holds (issue 18's serving test): 200 sessions of about 1,000
tokens each (about 51 MB of KV) behind `--kv-memory 12MiB` (room for about 45 of them), driven over
HTTP by 8 clients in random order for three rounds. Sessions are evicted and restored all along;
every one continues exactly: its trace (position, token, logits sha256 of every generated token)
equals a replay of its turns through the library alone, and no request fails.
"""

from __future__ import annotations

import json
import queue
import random
import threading
import time

import httpx
import pytest

import kvstore
from conftest import single_thread
from engine_models import CORPUS
from serve_kit import LiveServer

SESSIONS, ROUNDS, CLIENTS = 200, 3, 8
MAX_TOKENS, CHUNK = 4, 64
SAMPLING = {"temperature": 0.8, "top_p": 0.95}
DEADLINE = 600.0  # seconds, the whole test
WORDS = " ".join(CORPUS).split()


def seed(i: int) -> int:
    return 1000 + i


def turn_text(i: int, turn: int) -> str:
    """Round 0: a document of ~1,000 tokens; later rounds: a short addition."""
    rng = random.Random(i * 100 + turn)
    n = 230 if turn == 0 else 6
    return " " + " ".join(rng.choice(WORDS) for _ in range(n))


def test_two_hundred_sessions_over_a_small_kv_memory_continue_exactly(tmp_path, tiny):
    serve_and_replay(tmp_path, tiny("llama-long").folder, SESSIONS, "12MiB", "cpu")


@pytest.mark.cuda
def test_sessions_over_a_small_kv_memory_on_cuda_continue_exactly(tmp_path, tiny):
    """The same on a CUDA device (`--device cuda`: the paged KV memory in the GPU's memory, each
    session's rows computed apart in a step): 40 sessions behind room for about 11."""
    serve_and_replay(tmp_path, tiny("llama-long").folder, 40, "3MiB", "cuda")


def serve_and_replay(tmp_path, folder, sessions: int, kv_memory: str, device: str) -> None:
    """`sessions` sessions driven by CLIENTS clients in random order for ROUNDS rounds on a server with
    `--kv-memory kv_memory`, then replayed by the library alone on `device`: traces equal."""
    started = time.monotonic()
    live = LiveServer(tmp_path / "home", str(folder), "--chunk-size", str(CHUNK), "--threads", "1",
                      "--kv-memory", kv_memory, "--max-running", "16", "--max-queue", "1000",
                      "--device", device).start()
    traces: dict[int, list[list[dict]]] = {i: [] for i in range(sessions)}
    failures: list[str] = []
    rounds = [[(i, r) for i in random.Random(r).sample(range(sessions), sessions)] for r in range(ROUNDS)]
    try:
        for work in rounds:  # within a round, 8 clients take the sessions in a random order
            todo: queue.Queue = queue.Queue()
            for item in work:
                todo.put(item)

            def client():
                with live.http() as http:
                    while True:
                        try:
                            i, turn = todo.get_nowait()
                        except queue.Empty:
                            return
                        body = {"model": "tiny", "prompt": turn_text(i, turn), "max_tokens": MAX_TOKENS,
                                "seed": seed(i), "kvstore_trace": True, **SAMPLING}
                        r = http.post("/v1/completions", json=body, headers={"X-Session-Id": f"s{i}"}, timeout=300)
                        if r.status_code != 200:
                            failures.append(f"s{i} turn {turn}: {r.status_code} {r.text[:300]}")
                            return
                        traces[i].append(r.json()["kvstore"]["trace"])

            threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(DEADLINE)
            assert not failures, failures[:5]
        exposition = httpx.get(live.url + "/metrics", timeout=10).text
    finally:
        code = live.stop()
    assert code == 0, live.log()[-3000:]
    assert "Traceback" not in live.log(), live.log()[-3000:]
    metric = {line.split()[0]: float(line.split()[1]) for line in exposition.splitlines()
              if line.startswith("kvstore:") and " " in line}
    assert metric["kvstore:kv_evictions_total"] > sessions  # far more sessions than the memory holds
    assert metric["kvstore:session_restore_seconds_count"] > sessions  # and they came back from disk

    model = kvstore.load_model(folder, device=device)  # what the server ran: bfloat16, the folder's dense weights
    with single_thread(), kvstore.open_store(tmp_path / "replay") as store:
        for i in range(sessions):
            assert len(traces[i]) == ROUNDS, i
            with store.new(f"s{i}", model, seed=seed(i), chunk_size=CHUNK, **SAMPLING) as s:
                for turn in range(ROUNDS):
                    path = tmp_path / f"replay-{i}-{turn}.jsonl"
                    s.append_text(turn_text(i, turn))
                    list(s.generate(MAX_TOKENS, trace=str(path), **SAMPLING))
                    expected = [json.loads(line) for line in path.read_text().splitlines()]
                    assert traces[i][turn] == expected, (i, turn)
            assert len(s.tokens) > 850
    assert time.monotonic() - started < DEADLINE
