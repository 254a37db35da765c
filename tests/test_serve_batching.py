"""Contract C9 in the engine process: sessions computed together in each step's one forward reply with
the library's tokens and logits bits of each session alone.

The engine loop runs in this process with a fake pipe (as tests/test_serve_engine.py does); every
session's token events (position, id, sha256 of the float32 logits) must equal a trace of the same
conversation run by the library on a store of its own. The target session decodes beside 1, 3 or 7
others of other lengths, some reading long prompts (chunks in the same forwards as its decode
tokens), some decoding; greedy and seeded sampling; dense and block-quantized weights; the engine's
own step statistics show the forwards really held several sessions.
"""

from __future__ import annotations

import json

import pytest

import kvstore
from engine_models import Q
from kvstore_serve import engine as engine_module
from kvstore_serve.engine import Engine, Loop
from test_serve_engine import FakePipe

CHUNK = 16
SAMPLING = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 0.9, "top_p": 0.95}}


def conversation(j: int) -> str:
    """Session j's prompt: every other companion reads a long one (several chunks)."""
    words = 40 if j % 2 else 2 + j
    return " ".join(f"w{(7 * j + i) % 50}" for i in range(words))


def job(j: int, sampling: str, max_tokens: int) -> dict:
    return {"op": "run", "id": f"j{j}", "kind": "chat", "session": f"s{j}",
            "messages": [{"role": "user", "content": conversation(j)}], "max_tokens": max_tokens, "stop": [],
            "sampling": SAMPLING[sampling], "create": {"seed": 100 + j, "chunk_size": CHUNK}}


def library_trace(tmp_path, model, j: int, sampling: str, max_tokens: int) -> list[tuple]:
    store = kvstore.open_store(tmp_path / f"alone-{j}")
    trace = tmp_path / f"alone-{j}.jsonl"
    with store.new(f"s{j}", model, seed=100 + j, chunk_size=CHUNK) as s:
        for _ in s.chat(conversation(j), max_new_tokens=max_tokens, trace=str(trace), **SAMPLING[sampling]):
            pass
    store.close()
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    return [(d["position"], d["token"], d["logits_sha256"]) for d in lines]


def together(tmp_path, model, jobs: list[dict], monkeypatch) -> tuple[dict, list]:
    monkeypatch.setattr(engine_module, "STATS_EVERY", 0.0)  # every forward's size in a stats message
    store = kvstore.open_store(tmp_path / "together")
    engine = Engine(store, model, step_tokens=16 * CHUNK)  # room for every session's chunk in one forward
    pipe = FakePipe([*jobs, {"op": "stop"}])
    try:
        Loop(pipe, engine).run()
    finally:
        engine.close()
        store.close()
    events = {j["id"]: [(m["position"], m["token"], m["logits_sha256"]) for m in pipe.sent
                        if m.get("id") == j["id"] and m["event"] == "token"] for j in jobs}
    steps = [s for m in pipe.sent if m["event"] == "stats" for s in m["steps"]]
    return events, steps


@pytest.fixture(scope="module", params=["dense", "stored-q4_1"])
def batched_model(request, tiny):
    m = tiny("llama-gqa")
    if request.param == "dense":
        return kvstore.load_model(m.folder, dtype="bfloat16", weights="dense")
    return kvstore.load_model(m.gguf(Q.Q4_1)[0], dtype="bfloat16", weights="stored")


@pytest.mark.parametrize("company", [1, 3, 7])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_every_session_in_a_batch_replies_as_the_library_alone(tmp_path, batched_model, company, sampling,
                                                             monkeypatch):
    jobs = [job(j, sampling, 12) for j in range(company + 1)]
    events, steps = together(tmp_path, batched_model, jobs, monkeypatch)
    for j in range(company + 1):
        assert events[f"j{j}"] == library_trace(tmp_path, batched_model, j, sampling, 12), f"session s{j}"
    assert max(sessions for sessions, _, _ in steps) == company + 1  # all of them in one forward, at times
    assert any(decode and prefill for _, decode, prefill in steps)  # decode tokens beside prompt chunks


@pytest.mark.realmodel
def test_the_real_model_in_a_batch_replies_as_the_library_alone(tmp_path, smollm2_path, monkeypatch):
    model = kvstore.load_model(smollm2_path)  # bfloat16 on the GGUF's own blocks where the kernels run
    jobs = [job(j, "seeded", 8) for j in range(4)]
    events, steps = together(tmp_path, model, jobs, monkeypatch)
    for j in range(4):
        assert events[f"j{j}"] == library_trace(tmp_path, model, j, "seeded", 8), f"session s{j}"
    assert max(sessions for sessions, _, _ in steps) == 4
