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
from kvstore_serve.batching import Pace
from kvstore_serve.engine import Engine, Loop
from test_serve_engine import FakePipe
from test_serve_logprobs import Collector

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


def library_trace(tmp_path, model, j: int, sampling: str, max_tokens: int, top: int | None = None,
                  fmt: dict | None = None) -> list[tuple]:
    """Session j alone through the library: (position, token, logits hash) per token, and with `top`
    its log-probabilities as `logprob_numbers` gives them (`fmt`: its reply's response format)."""
    store = kvstore.open_store(tmp_path / f"alone-{j}")
    trace = tmp_path / f"alone-{j}.jsonl"
    target = str(trace) if top is None else Collector(top)
    with store.new(f"s{j}", model, seed=100 + j, chunk_size=CHUNK) as s:
        for _ in s.chat(conversation(j), max_new_tokens=max_tokens, trace=target, response_format=fmt,
                        **SAMPLING[sampling]):
            pass
    store.close()
    lines = [json.loads(line) for line in trace.read_text().splitlines()] if top is None else target.lines
    return [(d["position"], d["token"], d["logits_sha256"], *logprob_numbers(d, model.tokenizer)) for d in lines]


def logprob_numbers(d: dict, tokenizer) -> tuple:
    """() or (the token's logprob, [(bytes, logprob) of each likeliest token]) of a trace line."""
    if "logprob" not in d:
        return ()
    return d["logprob"], [(tokenizer.token_bytes(t), lp) for t, lp in d["top_logprobs"]]


def together(tmp_path, model, jobs: list[dict], monkeypatch, max_slowdown: float = 2.0,
             kv_memory: int | None = None) -> tuple[dict, list]:
    monkeypatch.setattr(engine_module, "STATS_EVERY", 0.0)  # every forward's size in a stats message
    store = kvstore.open_store(tmp_path / "together")
    # room for every session's chunk in one forward
    engine = Engine(store, model, step_tokens=16 * CHUNK, max_slowdown=max_slowdown, kv_memory=kv_memory)
    pipe = FakePipe([*jobs, {"op": "stop"}])
    try:
        Loop(pipe, engine).run()
    finally:
        engine.close()
        store.close()
    events = {j["id"]: [(m["position"], m["token"], m["logits_sha256"], *event_logprobs(m)) for m in pipe.sent
                        if m.get("id") == j["id"] and m["event"] == "token"] for j in jobs}
    steps = [s for m in pipe.sent if m["event"] == "stats" for s in m["steps"]]
    return events, steps


def event_logprobs(m: dict) -> tuple:
    """() or (the token's logprob, [(bytes, logprob) of each likeliest token]) of a token event."""
    e = m.get("logprobs")
    return () if e is None else (e["logprob"], [(bytes(t["bytes"]), t["logprob"]) for t in e["top_logprobs"]])


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
    assert max(sessions for sessions, *_ in steps) == company + 1  # all of them in one forward, at times
    assert any(decode and prefill for _, decode, prefill, *_ in steps)  # decode tokens beside prompt chunks
    assert all(0 < model_s < step_s for *_, model_s, step_s in steps)  # the forward's seconds within the step's


def test_logprobs_in_a_batch_are_the_librarys_alone(tmp_path, batched_model, monkeypatch):
    """Each token's log-probabilities come from its logits row alone: beside 3 others (one reading a
    long prompt), the numbers are the library's for the session alone, float for float."""
    jobs = [job(j, "seeded", 10) | {"logprobs": 3} for j in range(4)]
    events, steps = together(tmp_path, batched_model, jobs, monkeypatch)
    for j in range(4):
        alone = library_trace(tmp_path, batched_model, j, "seeded", 10, top=3)
        assert len(alone[0]) == 5 and len(alone[0][4]) == 3
        assert events[f"j{j}"] == alone, f"session s{j}"
    assert max(sessions for sessions, *_ in steps) == 4


def test_sessions_held_to_response_formats_in_a_batch_reply_as_the_library_alone(tmp_path, batched_model,
                                                                                 monkeypatch):
    """Each session's format masks its own row only: two sessions held to formats (a regular
    expression, a JSON schema) beside two free ones reply as each does alone, bit for bit."""
    formats = [{"type": "regex", "pattern": "[a-z]{2,5}( [a-z]{2,5}){3,6}"}, None,
               {"type": "json_schema", "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                                  "required": ["ok"], "additionalProperties": False,
                                                  "x-guidance": {"whitespace_flexible": False}}}, None]
    jobs = [job(j, "seeded", 16) | {"format": fmt} for j, fmt in enumerate(formats)]
    events, steps = together(tmp_path, batched_model, jobs, monkeypatch)
    for j, fmt in enumerate(formats):
        assert events[f"j{j}"] == library_trace(tmp_path, batched_model, j, "seeded", 16, fmt=fmt), f"session s{j}"
    text = batched_model.tokenizer.decode([t for _, t, *_ in events["j2"]], skip_special=True)
    assert json.loads(text) in ({"ok": True}, {"ok": False})
    assert max(sessions for sessions, *_ in steps) == 4


@pytest.mark.realmodel
def test_the_real_model_in_a_batch_replies_as_the_library_alone(tmp_path, smollm2_path, monkeypatch):
    model = kvstore.load_model(smollm2_path)  # bfloat16 on the GGUF's own blocks where the kernels run
    jobs = [job(j, "seeded", 8) for j in range(4)]
    events, steps = together(tmp_path, model, jobs, monkeypatch)
    for j in range(4):
        assert events[f"j{j}"] == library_trace(tmp_path, model, j, "seeded", 8), f"session s{j}"
    assert max(sessions for sessions, *_ in steps) == 4


def reading(j: int, words: int, max_tokens: int) -> dict:
    """A job whose prompt is `words` words long (several chunks), greedy."""
    text = " ".join(f"w{(3 * j + i) % 50}" for i in range(words))
    return {"op": "run", "id": f"j{j}", "kind": "complete", "session": f"s{j}", "prompt": text,
            "max_tokens": max_tokens, "stop": [], "sampling": SAMPLING["greedy"],
            "create": {"seed": 100 + j, "chunk_size": CHUNK}}


def library_completion(tmp_path, model, spec: dict) -> list[tuple]:
    store = kvstore.open_store(tmp_path / f"alone-{spec['id']}")
    trace = tmp_path / f"alone-{spec['id']}.jsonl"
    with store.new(spec["session"], model, seed=spec["create"]["seed"], chunk_size=CHUNK) as s:
        s.append_text(spec["prompt"])
        for _ in s.generate(spec["max_tokens"], trace=str(trace), temperature=0.0):
            pass
    store.close()
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    return [(d["position"], d["token"], d["logits_sha256"]) for d in lines]


def test_a_long_prompt_is_read_while_others_decode_not_after_them(tmp_path, batched_model, monkeypatch):
    """Three sessions decode 96 tokens each while a fourth reads a prompt of many chunks: the reader
    gets prompt rows in every step beside their tokens (with --max-slowdown 1: the least, Pace.LEAST
    rows, where the model computes every row alone; a whole chunk otherwise), so it finishes long
    before they do, and every session's bits are the library's alone."""
    jobs = [reading(0, 30, 2)] + [reading(j, 3, 96) for j in (1, 2, 3)]
    events, steps = together(tmp_path, batched_model, jobs, monkeypatch, max_slowdown=1.0)
    for spec in jobs:
        assert events[spec["id"]] == library_completion(tmp_path, batched_model, spec), spec["id"]
    mixed = [(decode, prompt) for _, decode, prompt, *_ in steps if decode and prompt]
    assert len(mixed) >= 5  # the reader read beside the decoders' tokens, step after step
    if batched_model.row_invariant:
        assert all(prompt <= Pace.LEAST for _, prompt in mixed)  # pieces of chunks
    else:  # whole chunks, the prompt's last one shorter
        assert sorted(prompt for _, prompt in mixed)[1:] == [CHUNK] * (len(mixed) - 1)
    decode_steps = [decode for _, decode, _, *_ in steps if decode]
    assert decode_steps.count(3) > len(mixed)  # the decoders went on after the reader was done


def test_the_pace_lets_prompt_rows_take_what_max_slowdown_leaves_of_a_decode_step():
    pace = Pace(step_tokens=512, max_slowdown=2.0)
    assert pace.rows(4) == Pace.LEAST  # nothing measured yet: the least
    pace.observe(decode=4, prompt=0, seconds=0.040)  # a step of 4 decode tokens alone: 40 ms
    pace.observe(decode=0, prompt=100, seconds=0.300)  # a prompt row: 3 ms
    assert pace.rows(4) == 13  # 13 rows x 3 ms <= (2 - 1) x 40 ms
    wider, narrow = Pace(512, 3.0), Pace(14, 2.0)
    for p in (wider, narrow):
        p.observe(4, 0, 0.040)
        p.observe(0, 100, 0.300)
    assert wider.rows(4) == 26 and narrow.rows(4) == 10  # the step's budget bounds it: 14 - 4 decode rows
    pace.observe(decode=4, prompt=10, seconds=0.040 + 0.080)  # beside decode tokens a row cost 8 ms
    assert pace.row_s == pytest.approx(0.003 + Pace.WEIGHT * (0.008 - 0.003))
    assert pace.rows(4) == int(0.040 / pace.row_s)
    assert Pace(512, 1.0).rows(4) == Pace.LEAST  # no slowdown allowed: still the least, so prompts are read
