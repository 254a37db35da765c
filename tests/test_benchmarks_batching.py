"""The many-sessions benchmark (benchmarks/batching.py): the arithmetic of its limits and windows on
made-up figures, its targets judged, its section rendered, finding llama-server, and its quick mode
end to end against a real `kvstore serve` (no timing is judged here)."""

from __future__ import annotations

import os

import pytest

from benchmarks import batching, llama_build


def test_the_memory_bound_limit_is_sessions_times_bandwidth_over_the_bytes_a_step_reads():
    # 100 MB of weights and two sessions of 50 MB at 10 GB/s: a step reads 200 MB in 20 ms, two tokens
    assert batching.limit_tok_s(100e6, [50e6, 50e6], 10e9) == pytest.approx(100.0)
    assert batching.limit_tok_s(100e6, [0.0], 10e9) == pytest.approx(100.0)  # weights alone: 10 ms a token
    # more sessions share the weights' read: the limit grows, but less than their number
    one, eight = batching.limit_tok_s(97e6, [12e6], 10e9), batching.limit_tok_s(97e6, [12e6] * 8, 10e9)
    assert one < eight < 8 * one


def test_a_sessions_kv_counts_its_prompt_and_half_its_reply():
    assert batching.context_bytes({"prompt_tokens": 512, "completion_tokens": 128}, 23040) == (512 + 64) * 23040


def stream(times: list[float], tokens: int | None = None) -> dict:
    return {"times": times, "completion_tokens": len(times) if tokens is None else tokens, "error": None}


def test_the_rate_is_taken_where_every_stream_decodes():
    a = stream([1.0, 2.0, 3.0, 4.0, 5.0])
    b = stream([2.5, 3.0, 3.5, 4.0, 4.5, 6.0])
    w = batching.window([a, b])
    assert (w["start"], w["end"]) == (2.5, 5.0)  # b's first token, a's last
    # inside (2.5, 5.0]: a's 3, 4, 5 and b's 3.0, 3.5, 4.0, 4.5
    assert w["tokens"] == 7 and w["tok_s"] == pytest.approx(7 / 2.5)
    # a stream whose chunks carried two tokens each counts double
    assert batching.window([stream([1.0, 2.0, 3.0], 6), stream([1.0, 2.0, 3.0])])["tokens"] == 6
    assert batching.window([stream([1.0, 2.0]), stream([3.0, 4.0])]) is None  # never both decoding
    assert batching.window([stream([1.0]), stream([1.0, 2.0])]) is None


def test_gaps_are_between_chunks_of_one_reply_and_the_window_keeps_those_ending_inside():
    assert batching.gaps([1.0, 1.5, 3.0]) == [0.5, 1.5]
    assert batching.gaps([1.0]) == []
    assert batching.gaps_within([1.0, 1.5, 3.0, 3.25], 1.2, 3.0) == [0.5, 1.5]


def test_metrics_are_read_from_prometheus_text_and_differenced():
    before = {"kvstore:batch_sessions_per_step_sum": 10.0, "kvstore:batch_sessions_per_step_count": 10.0}
    after = {"kvstore:batch_sessions_per_step_sum": 40.0, "kvstore:batch_sessions_per_step_count": 20.0,
             "kvstore:kv_evictions_total": 3.0}
    assert batching.steps_mean(after, before) == 3.0  # 30 sessions in 10 forwards
    assert batching.steps_mean(before, before) is None
    assert batching.grown(after, before, "kvstore:kv_") == {"kvstore:kv_evictions_total": 3.0}


def test_a_steps_seconds_are_split_into_the_model_calls_and_the_rest():
    before = {"kvstore:engine_step_seconds_sum": 1.0, "kvstore:engine_step_seconds_count": 10.0,
              "kvstore:model_forward_seconds_sum": 0.5, "kvstore:model_forward_seconds_count": 10.0}
    after = {"kvstore:engine_step_seconds_sum": 3.0, "kvstore:engine_step_seconds_count": 30.0,
             "kvstore:model_forward_seconds_sum": 2.0, "kvstore:model_forward_seconds_count": 30.0}
    split = batching.step_split(after, before)
    assert split["step_s"] == pytest.approx(0.1) and split["model_share"] == pytest.approx(0.75)  # 1.5 of 2 s
    assert batching.step_split(before, before) == {}  # no step between them


def row(n: int, count: int, tok_s: float, limit: float, llama: float | None = None) -> dict:
    r = {"context": n, "sessions": count,
         "kvstore": {"tok_s": tok_s, "limit_tok_s": limit, "of_limit": tok_s / limit, "sessions_per_step": count,
                     "min": tok_s, "max": tok_s, "model_share": 0.85 if count > 1 else None}}
    if llama:
        r["llama.cpp"] = {"tok_s": llama, "limit_tok_s": limit, "min": llama, "max": llama}
        r["ratio"] = tok_s / llama
    return r


def fake(scale8: float = 4.5, llama: bool = True) -> dict:
    decode = [row(512, 1, 40.0, 50.0, 45.0 if llama else None), row(512, 8, 40.0 * scale8, 200.0, 150.0 if llama else None),
              row(2048, 8, 80.0, 100.0, 60.0 if llama else None)]
    gap = {"p50": 0.02, "p99": 0.04, "min": 0.01, "max": 0.05, "n": 100}
    chat = {"no prefix cache": {"prompt_tokens": [1500, 1560], "computed_tokens": [1500, 1560], "ttft_s": gap,
                                "ttft_later_s": gap, "computed_total": 3060, "prompt_total": 3060}}
    r = {"config": dict(batching.FULL), "threads": 2, "model": "smollm2", "model_file": "x.gguf",
         "targets": batching.TARGETS, "facts": {"weight_bytes": 96_576_768, "kv_bytes_per_token": 23040},
         "bandwidth": {"bytes_per_s": 11.2e9}, "decode": decode,
         "not_measured": {"prefix cache": "not available in this build (`kvstore serve` has no --prefix-cache)"},
         "interleave": {"sessions": 4, "context": 512, "reader_tokens": 7800, "reader_s": 6.0, "quiet": gap,
                        "loaded": gap | {"p99": 0.07}, "p99_ratio": 1.75, "errors": 0},
         "chat": chat, "forks": {"forks": 600, "doc_tokens": 2048, "kv_memory": "2GiB", "resident_bytes": 28.6e9,
                                 "restore_s": gap, "restored": 600, "tok_s": 90.0, "requests_per_s": 5.6, "ttft_s": gap,
                                 "evictions": 0.0, "failed": 0}}
    if llama:
        r["llama_server"] = {"version": "version: 1 (abc)", "sdist": "0.3.36"}
    else:
        r["not_measured"]["llama.cpp"] = "left out (--no-peer)"
    return r | {"verdicts": batching.verdicts(r)}


def test_the_targets_are_judged_from_the_figures():
    v = {x["goal"]: x for x in fake()["verdicts"]}
    scaling = v["decode rate, 8 sessions at 512 tokens ÷ 1 session"]
    assert scaling["met"] is True and scaling["figure"] == "4.50×"
    lowest = v["decode rate ÷ its memory-bound limit, lowest point"]
    assert lowest["met"] is True and lowest["figure"] == "80 %"  # 40/50, 180/200, 80/100
    assert v["decode rate ÷ llama-server's (continuous batching), lowest point"]["figure"] == "0.89×"  # 40/45
    assert v["decode rate ÷ llama-server's (continuous batching), lowest point"]["met"] is False
    assert v["inter-token p99 while a long document is read ÷ quiet p99"]["met"] is True
    assert v["failed requests, forks behind the KV budget"]["met"] is True
    slow = {x["goal"]: x["met"] for x in fake(scale8=3.0)["verdicts"]}
    assert slow["decode rate, 8 sessions at 512 tokens ÷ 1 session"] is False
    assert slow["decode rate ÷ its memory-bound limit, lowest point"] is False  # 120/200


def test_a_figure_that_was_not_measured_is_not_judged():
    r = fake(llama=False)
    v = {x["goal"]: x for x in r["verdicts"]}
    assert v["decode rate ÷ llama-server's (continuous batching), lowest point"]["met"] is None
    assert v["decode rate ÷ llama-server's (continuous batching), lowest point"]["figure"] == "not measured"
    empty = {x["goal"]: x["met"] for x in batching.verdicts({})}
    assert set(empty.values()) == {None}


def test_the_section_renders_every_workload_and_says_what_was_not_measured():
    text = batching.markdown(fake())
    assert text.startswith("## Many sessions at once\n")
    assert "| 2,048 | 8 | 80.0 | 100 | 80 % | 8.0 | 85 % | 60.0 | 1.33× |" in text
    assert "| quiet | 20.0 ms | 40.0 ms | 100 |" in text and "| during the read | 20.0 ms | 70.0 ms | 100 |" in text
    assert "| no prefix cache | 1,500 / 1,560 | 1,500 / 1,560 | 3,060 of 3,060 |" in text
    assert "| prefix cache | not available in this build |" in text
    assert "600 forks of a 2,048-token document session" in text and "28,600 MB" in text
    assert "**0 failed requests**" in text
    assert "llama-cpp-python 0.3.36 sources" in text
    alone = batching.markdown(fake(llama=False))
    assert "Not measured: llama.cpp: left out (--no-peer)" in alone and "| 512 | 1 | 40.0 | 50 | 80 % | 1.0 | – | – | – |" in alone
    assert batching.markdown({"not_measured": {"kvstore": "no --kv-memory"}}).count("Not measured") == 1


def test_llama_server_is_found_where_it_is_named_or_built(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(llama_build.ENV, raising=False)
    binary, why = llama_build.find()
    assert binary is None and "python -m benchmarks.llama_build" in why
    built = llama_build.cached_binary()
    built.parent.mkdir(parents=True)
    built.write_text("#!/bin/sh\necho 'version: 1 (abc)'\n")
    built.chmod(0o755)
    assert llama_build.find() == (built, "")
    assert llama_build.version(built) == "version: 1 (abc)"
    named = tmp_path / "llama-server"
    named.write_text("")  # not executable
    monkeypatch.setenv(llama_build.ENV, str(named))
    with pytest.raises(SystemExit, match="not an executable file"):
        llama_build.find()
    os.chmod(named, 0o755)
    assert llama_build.find() == (named, "")
    assert llama_build.find(built) == (built, "")  # --llama-server before the environment


@pytest.mark.realmodel
def test_the_quick_benchmark_runs_against_kvstore_serve(tmp_path, smollm2_path):
    """`python -m benchmarks.batching --quick --no-peer`'s measurement, end to end: real servers, real
    requests; what is checked is what the figures must be whatever the machine's speed."""
    cfg = dict(batching.QUICK)
    r = batching.run(cfg, 1, str(smollm2_path), tmp_path, peer=False)  # 1 thread: fast on a shared machine too
    assert r["not_measured"].get("llama.cpp") == "left out (--no-peer)" and "kvstore" not in r["not_measured"]
    assert r["bandwidth"]["bytes_per_s"] > 1e8 and r["facts"]["weight_bytes"] > 5e7
    rows = {(x["context"], x["sessions"]): x for x in r["decode"]}
    assert set(rows) == {(n, c) for n in cfg["contexts"] for c in cfg["sessions"]}
    for (n, count), x in rows.items():
        ours = x["kvstore"]
        assert ours["tok_s"] > 0 and 0 < ours["limit_tok_s"]
        assert ours["sessions_per_step"] >= 1
    assert all(p["errors"] == 0 and p["completion_tokens"] == [cfg["new_tokens"]] * p["sessions"] for p in r["points"])
    # the biggest point's sessions were computed together
    assert rows[(cfg["contexts"][-1], max(cfg["sessions"]))]["kvstore"]["sessions_per_step"] > 1
    it = r["interleave"]
    assert it["errors"] == 0 and it["quiet"] and it["loaded"], it  # gaps alone and during the read
    # without a prefix cache a stateless request computes its whole prompt
    plain = [t for t in r["chat_turns"] if t["mode"] == "no prefix cache"]
    assert len(plain) == cfg["chat_conversations"] * cfg["chat_turns"]
    assert all(t["computed_tokens"] == t["prompt_tokens"] > cfg["chat_doc_tokens"] for t in plain)
    cached = [t for t in r["chat_turns"] if t["mode"] == "prefix cache" and t["turn"] > 0]
    # a later turn reuses the stored chunks of its history (the quick documents are longer than one
    # chunk, 512 tokens): it computes less than its prompt
    assert cached and all(t["computed_tokens"] < t["prompt_tokens"] for t in cached)
    fk = r["forks"]
    assert fk["failed"] == 0 and fk["requests"] == cfg["forks"] and fk["restored"] == cfg["forks"]
    text = batching.markdown(r)
    assert "## Many sessions at once" in text and str(tmp_path) not in text
