"""The benchmark report builder, on made-up figures: the targets are judged right, every section
renders, the README's section is replaced and nothing else, and the plots are written. No timing,
except the service benchmark's quick mode against `kvstore serve` (a real server, real turns)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks import report, serve


def s(median: float, lo: float | None = None, hi: float | None = None) -> dict:
    return {"median": median, "min": median * 0.9 if lo is None else lo, "max": median * 1.1 if hi is None else hi, "n": 3}


def fake(speedup_8k: float = 120.0, llama: bool = True) -> dict:
    ttft = {str(n): {"tokens": n, "recompute_s": s(n / 2000), "resume_s": s(0.02 + n / 1e6), "restore_s": s(0.004 * n / 512),
                     "restore_cold_s": s(0.006 * n / 512), "speedup": sp, "speedups": s(sp), "kv_bytes": n * 23040,
                     "disk_bytes": (n - 1) * 23040}
            for n, sp in ((512, 10.0), (2048, 45.0), (8191, speedup_8k))}
    method = {"save_s": s(0.05), "restore_s": s(0.03), "restore_cold_s": s(0.05), "bytes": s(47e6)}
    save = {"kvstore checkpoint / open": method, "kvstore pack / unpack": method | {"ratio": s(0.66)},
            "HF DynamicCache, torch.save / torch.load": method}
    if llama:
        save["llama.cpp state file (seq save / load)"] = method | {"restore_s": s(0.04)}
    engines = {"kvstore": {"decode_tok_s": s(40), "decode_steady_tok_s": s(42), "prefill_s": s(0.8), "load_s": 3.0},
               "hf": {"decode_tok_s": s(16), "decode_steady_tok_s": s(17), "prefill_s": s(1.0), "load_s": 15.0}}
    return {
        "quick": False, "started": "2026-11-30 12:00", "duration_s": 600.0,
        "settings": {"threads": 2, "dtype": "bfloat16", "kv_bytes_per_token": 23040},
        "machine": {"cpu": "Some CPU", "cores": 2, "ram_bytes": 24 * 2 ** 30, "os": "Linux", "arch": "x86_64",
                    "flags": ["avx2", "avx512_bf16", "amx_bf16"]},
        "versions": {"python": "3.11", "torch": "2.13", "transformers": "5.24", "llama-cpp-python": "0.3.36" if llama else None,
                     "kvstore": "abc1234"},
        "peers": {"hf": "", "llama.cpp": "" if llama else "llama-cpp-python is not installed"},
        "load": {"start": [0.5, 0.5, 0.5], "end": [0.7, 0.6, 0.5]},
        "engine": {"decode_prompt": 1024, "decode_new": 64, "prefill_tokens": 2048, "chunk": 512, "others_busy_cpus": [0.0],
                   "engines": engines, "greedy_equal_prefix": {"hf": 12},
                   "ratios": {"hf": {"decode": s(2.5), "decode_steady": s(2.4), "prefill": s(0.95),
                                             "prefill_one_chunk": s(1.25)}}},
        "ttft": ttft, "save_restore": {"2048": save},
        "checkpoint": {"new_tokens": 129, "prompt_tokens": 1024, "none": s(40),
                       "every": {str(k): {"tok_s": s(40 - 4 / k), "overhead_pct": 10 / k, "overhead_pct_paired": s(10 / k),
                                          "overhead_pct_timed": s(4 / k),
                                          "ms_per_checkpoint": 2.0} for k in (1, 4, 16, 64)}},
        "forks": {"tokens": 8191, "new_tokens_per_fork": 16, "fork_s": [0.004] * 3, "fork_s_stats": s(0.004),
                  "bytes_after_forks": [4096, 8192, 12288], "bytes_after_decode": [4e5, 8e5, 1.2e6]},
        "scale": scale(),
    }


def scale(page_ms: float = 12.0, reads: int = 1004) -> dict:
    """benchmarks/scale.py's figures for a store of 100,000 sessions."""
    return {
        "config": {"sessions": 100_000, "small": 1_000, "page": 100}, "doc_tokens": 2045, "small_tokens": 16,
        "targets": {"page_ms": 50.0, "open_ms": 20.0, "cli_ratio": 1.25},
        "create": {"doc_s": 1.5, "forks": 98_999, "fork_s": 600.0, "forks_per_s": 165.0, "small": 1_000,
                   "small_s": 50.0, "small_per_s": 20.0, "total_s": 651.5},
        "store_bytes": 2.5e9,
        "listing": {"sessions": 100_000, "page_s": s(page_ms / 1e3), "first_page_s": 0.3, "doc_forks": 98_999,
                    "count_s": s(0.004), "list_all_s": 9.0},
        "open": {"fork_s": s(0.015), "small_s": s(0.005)},
        "cli": {"page_s": s(0.6), "one_s": s(0.55), "first_page_s": s(0.8), "ratios": s(1.09), "ratio": 1.09, "all_s": 14.0, "all_json_s": 20.0},
        "gc": {"scan_s": 3.0, "sessions": 100_000, "per_session_s": 3e-5, "per_gb_s": 1.2, "delete_s": s(3.1)},
        "verify": {"s": 120.0, "sessions": 100_000, "problems": 0, "bytes": 1.1e8, "reads": reads, "extents": 1004,
                   "per_session_s": 1.2e-3, "per_gb_s": 1090.0, "one_s": 0.06},
    }


def verdicts(results: dict) -> dict[str, bool | None]:
    return {t["goal"]: t["met"] for t in report.targets(results)}


def test_targets_are_judged_against_their_goals():
    v = verdicts(fake(speedup_8k=60.0))
    assert v["decode speed vs HF transformers `generate`"] is True  # 2.5x >= 2x
    assert v["resume vs recompute, time to first token at 2,048 tokens"] is True  # 45x >= 40x
    assert v["resume vs recompute, time to first token at 8,191 tokens"] is False  # 60x < 80x
    assert v["restore of a 2,048-token session (warm: page cache, reused memory)"] is True  # 30 ms <= llama.cpp's 40 ms
    assert v["prefill speed, 2,048 tokens in one forward (as HF runs it) vs HF transformers"] is True  # 1.25x
    assert v["prefill speed, 2,048 tokens in kvstore's default chunks of 512 vs HF transformers"] is False  # 0.95x
    assert v["decode overhead of a checkpoint every 16 tokens: time inside the checkpoints"] is True  # 0.25 % <= 3 %
    assert v["the same, from decode rates with and without (paired per repetition; noisy)"] is True  # 0.6 % <= 3 %
    assert v["packed size / raw bf16 KV (2,048 tokens)"] is True  # 0.66 <= 0.70
    assert v["unpack: raw bytes / time to open a packed 2,048-token session (warm)"] is True  # 47 MB / 0.66 / 30 ms
    assert v["store scale: list a page of sessions (`store.page`, median of random cursors)"] is True  # 12 <= 50 ms
    assert v["store scale: open a fork of a 2,045-token document (warm)"] is True  # 15 <= 20 ms
    assert v["store scale: `kvstore list --limit 100 --after NAME` process time vs `kvstore list` in a store of one "
             "session"] is True
    assert v["store scale: `verify` reads per distinct extent (forks share them)"] is True  # 1004 reads, 1004 extents


def test_store_scale_targets_fail_when_a_page_is_slow_or_verify_rereads_shared_extents():
    r = fake()
    r["scale"] = scale(page_ms=80.0, reads=2008)
    v = verdicts(r)
    assert v["store scale: list a page of sessions (`store.page`, median of random cursors)"] is False
    assert v["store scale: `verify` reads per distinct extent (forks share them)"] is False
    del r["scale"]
    assert all(met is None for goal, met in verdicts(r).items() if goal.startswith("store scale"))
    assert "## Store scale" not in report.markdown(r)


def test_missing_figures_are_not_measured_and_a_peers_target_without_the_peer_too():
    r = fake(llama=False)
    del r["ttft"]["8191"]
    r["engine"]["ratios"] = {}
    rows = {t["goal"]: t for t in report.targets(r)}
    assert rows["resume vs recompute, time to first token at 8,191 tokens"]["met"] is None
    assert rows["decode speed vs HF transformers `generate`"]["figure"] == "not measured"
    restore = rows["restore of a 2,048-token session (warm: page cache, reused memory)"]
    assert restore["met"] is None and restore["figure"] == "not measured" and "not run here" in restore["target"]
    text = report.markdown(r)
    assert "## Not measured" in text and "llama-cpp-python is not installed" in text


def test_report_has_every_section_and_no_local_paths():
    text = report.markdown(fake())
    for heading in ("## Summary", "## Machine and versions", "## Time to first token", "## Engine speed",
                    "## Save and restore", "## Checkpoint overhead", "## How costs grow", "## Store scale"):
        assert heading in text
    assert "| `store.page(100)` at random cursors | 12.0 ms (10.8–13.2) |" in text
    assert "98,999 forks of it (`store.fork`, 165 per second)" in text
    assert "45× (40–50)" in text  # a figure with its spread
    assert "Some CPU (x86_64), 2 cores, with AVX2, AVX512-BF16, AMX-BF16" in text
    assert "/tmp" not in text and "/work" not in text
    assert report.cpu_slug(fake()) == "some-cpu"


def test_readme_section_is_replaced_and_the_rest_kept(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n## Benchmarks\n\nold draft\n\n## CLI reference\n\nkept\n", encoding="utf-8")
    report.update_readme(readme, fake())
    text = readme.read_text(encoding="utf-8")
    assert "old draft" not in text and "| goal |" in text
    assert text.startswith("# x\n\n## Benchmarks\n\n") and text.endswith("## CLI reference\n\nkept\n")


def test_write_makes_the_report_and_its_plots(tmp_path):
    path = report.write(fake(), tmp_path)
    assert path.read_text(encoding="utf-8").startswith("# Benchmark report")
    for name in ("ttft", "engine", "save_restore", "checkpoint", "growth"):
        assert (tmp_path / "plots" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


MEASURED = re.compile(r"(?:about |~|≈ ?)?\b\d[\d,.]*\s?(?:ms|µs|s|tok/s|GB/s|MB/s|×|x faster|times faster)\b"
                      r"|\b(?:twice|several times|\w+ times) (?:as fast|faster|slower)")


def figures_outside_the_report(readme: str) -> list[str]:
    """Speed figures in README prose, outside code blocks and the generated Benchmarks section."""
    text = re.sub(r"```.*?```", "", readme, flags=re.S)
    text = re.sub(r"^## Benchmarks\n.*?(?=^## )", "", text, flags=re.S | re.M)
    return [m.group(0) for m in MEASURED.finditer(text)]


def test_the_readme_has_no_speed_figure_the_report_builder_did_not_write():
    """A timing in the README goes stale with the next run: the Benchmarks section (written by
    `python -m benchmarks run` from results.json) holds them all. Constants are stated by value."""
    from kvstore.store.index import LOCK_WAIT_S

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    stated = f"more than {LOCK_WAIT_S} s"
    assert stated in readme, "the README states the index's lock wait: keep it equal to LOCK_WAIT_S"
    assert figures_outside_the_report(readme.replace(stated, "")) == []
    assert figures_outside_the_report("restores in about 19 ms, twice as fast as before\n") == ["about 19 ms",
                                                                                             "twice as fast"]


def test_the_committed_report_and_readme_table_are_rebuilt_from_the_committed_results():
    """benchmarks/REPORT.md and the README's Benchmarks section are what the report builder writes
    from benchmarks/results.json (a full run publishes all three together), so every committed
    figure can be traced to a measured repetition; the per-CPU copy is the same file."""
    import json

    root = Path(__file__).resolve().parent.parent
    text = (root / "benchmarks" / "results.json").read_text(encoding="utf-8")
    results = json.loads(text)
    services = report.published_services(root / "benchmarks", results)
    assert (root / "benchmarks" / "REPORT.md").read_text(encoding="utf-8") == report.markdown(results, services)
    readme = (root / "README.md").read_text(encoding="utf-8")
    section = re.search(r"^## Benchmarks\n(.*?)(?=^## )", readme, re.S | re.M)[1]
    assert section == "\n" + report.readme_section(results, services) + "\n"
    assert (root / "benchmarks" / "results" / f"{report.cpu_slug(results)}.json").read_text(encoding="utf-8") == text
    assert not results["quick"] and all(not why for why in results["peers"].values()), "a full run with its peers"


def test_each_published_service_file_is_a_full_run_of_both_servers_named_by_its_cpu():
    """benchmarks/results/serve/<cpu>.json: what `python -m benchmarks.serve --publish` writes, one
    per CPU model, so figures of one CPU never stand in for another's."""
    import json

    for path in sorted(report.services_dir(Path(__file__).resolve().parent.parent / "benchmarks").glob("*.json")):
        doc = json.loads(path.read_text(encoding="utf-8"))
        assert path.stem == report.cpu_slug(doc), f"{path.name} holds a run on {doc['machine']['cpu']}"
        sv = doc["serve"]
        assert not doc["quick"] and not sv["not_measured"] and set(sv["modes"]) == set(serve.MODES), path.name
        assert set(sv["summary"]) == {"kvstore", *(f"llama.cpp {m}" for m in serve.MODES)}


# -- the service benchmark (benchmarks/serve.py) --------------------------------------------------------
def turns(server: str, ttft: dict[str, float], n: int = 3) -> list[dict]:
    """Made-up turn records of one server: n turns per case at about ttft[case] seconds."""
    return [{"server": server, "case": case, "ttft_s": t * (1 + i / 10), "total_s": t + 1.0, "completion_tokens": 32,
             "prompt_tokens": 2300, "cached_tokens": 2250 if server == "kvstore" else None,
             "prompt_eval_tokens": None if server == "kvstore" else 2300}
            for case, t in ttft.items() for i in range(n)]


def fake_service(restart_kv: float = 0.05, cpu: str = "AMD EPYC") -> dict:
    records = (turns("kvstore", {"first": 3.0, "next": 0.1, "back": 0.1, "restart": restart_kv, "many": 0.2})
               + turns("llama.cpp none", {"first": 12.0, "next": 0.2, "back": 11.0, "restart": 13.0, "many": 11.0})
               + turns("llama.cpp ram", {"first": 12.0, "next": 0.2, "back": 1.3, "restart": 13.0, "many": 11.5})
               + turns("llama.cpp disk", {"first": 12.5, "next": 0.2, "back": 12.0, "restart": 1.5, "many": 1.6}))
    summary = serve.summarize(records)
    sv = {"config": dict(serve.FULL), "threads": 2, "model": "smollm2", "model_file": "x.gguf",
          "modes": list(serve.MODES), "targets": serve.TARGETS, "not_measured": {}, "doc_chars": 8000,
          "servers": {}, "turns": records, "starts": [{"server": "kvstore", "ready_s": 4.0}],
          "summary": summary, "ratios": serve.compare(summary)}
    return {"serve": sv, "quick": False, "started": "2026-12-01 23:00", "duration_s": 900.0,
            "machine": {"cpu": cpu, "cores": 2, "ram_bytes": 24 * 2 ** 30, "os": "Linux", "arch": "x86_64",
                        "flags": ["avx2", "avx512_bf16"]},
            "versions": {"python": "3.11", "torch": "2.13", "transformers": "5.24", "llama-cpp-python": "0.3.36",
                         "openai": "1.0", "kvstore": "abc1234"}}


def test_percentiles_interpolate_between_ranks():
    assert serve.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert serve.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert serve.percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert serve.percentile([5.0], 99) == 5.0


def test_service_ratios_take_llama_cpps_best_mode_per_case_and_judge_the_targets():
    r = fake_service(restart_kv=0.05)["serve"]["ratios"]
    assert r["restart"]["best"] == "llama.cpp disk" and r["back"]["best"] == "llama.cpp ram"
    assert r["many"]["best"] == "llama.cpp disk"
    assert r["restart"]["ratio_p50"] == pytest.approx(1.65 / 0.055) and r["restart"]["met"] is True  # 30x >= 20x
    assert r["back"]["ratio_p50"] == pytest.approx(13.0) and r["back"]["met"] is True  # 1.43 s / 0.11 s
    assert r["many"]["ratio_p50"] == pytest.approx(8.0) and r["many"]["met"] is False  # 1.76 s / 0.22 s < 10x
    slow = fake_service(restart_kv=0.1)["serve"]["ratios"]["restart"]
    assert slow["ratio_p50"] == pytest.approx(15.0) and slow["met"] is False  # 1.65 s / 0.11 s < 20x
    assert "target" not in r["first"] and "next" in r


def test_a_service_without_kvstore_or_the_peer_has_no_ratio():
    doc = fake_service()
    sv = doc["serve"]
    sv["summary"] = {k: v for k, v in sv["summary"].items() if k != "kvstore"}
    sv["ratios"] = serve.compare(sv["summary"])
    sv["not_measured"] = {"kvstore": "`kvstore serve` is not available in this checkout"}
    assert sv["ratios"] == {}
    rows = report.service_rows(sv)
    assert all(row["met"] is None and row["figure"] == "not measured" for row in rows)
    assert "Not measured: kvstore: `kvstore serve` is not available" in "\n".join(report.service_section(doc, None))


def test_the_service_section_names_its_cpu_and_says_when_it_is_not_the_suites():
    doc = fake_service(cpu="AMD EPYC")
    text = report.markdown(fake(), [doc])
    assert "## Service" in text and "**AMD EPYC**: measured by `python -m benchmarks.serve`" in text
    assert "**Not the machine of the sections above** (Some CPU)" in text
    assert "| coming back to a conversation | 110 ms | 1.43 s (ram) | 13.0× | ≥ 10× | met |" in text
    assert "| more conversations than llama.cpp's RAM cache holds | 220 ms | 1.76 s (disk) | 8.0× | ≥ 10× | " \
           "**not met** |" in text
    assert "| kvstore | 3 | 110 ms | 120 ms | 100 ms–120 ms |" in text  # back: 0.1, 0.11, 0.12 s
    assert "/tmp" not in text and "/work" not in text
    same = report.markdown(fake() | {"machine": fake()["machine"] | {"cpu": "AMD EPYC"}}, [doc])
    assert "Not the machine" not in same
    readme = report.readme_section(fake(), [doc])
    assert "2-core AMD EPYC, not the CPU above" in readme and "| first turn after a server restart |" in readme
    assert "## Service" not in report.markdown(fake())


def test_a_suite_run_with_its_own_service_phase_leaves_out_the_published_file_of_its_cpu(tmp_path):
    import json

    folder = report.services_dir(tmp_path)
    folder.mkdir(parents=True)
    for cpu in ("AMD EPYC", "Some CPU"):
        doc = fake_service(cpu=cpu)
        (folder / f"{report.cpu_slug(doc)}.json").write_text(json.dumps(doc))
    suite = fake()
    assert [d["machine"]["cpu"] for d in report.published_services(tmp_path, suite)] == ["AMD EPYC", "Some CPU"]
    suite["serve"] = fake_service(cpu="Some CPU")["serve"]
    assert [d["machine"]["cpu"] for d in report.published_services(tmp_path, suite)] == ["AMD EPYC"]
    assert report.markdown(suite, report.published_services(tmp_path, suite)).count("## Service") == 2


def test_the_service_workload_restarts_right_after_the_conversation_it_resumes():
    cfg = dict(serve.FULL)
    steps = serve.base_script(cfg)
    cases = [s[2] for s in steps if s[0] == "turn"]
    n = cfg["conversations"]
    assert cases.count("first") == n and cases.count("restart") == cfg["restarts"]
    assert cases.count("back") == n * cfg["back_rounds"] and cases.count("next") == n
    for i, step in enumerate(steps):
        if step[0] == "restart":  # the conversation that ran last, with no other one in between
            assert steps[i - 1][1] == steps[i + 1][1] and steps[i + 1][2] == "restart"
        elif step[2] in ("next", "back"):
            before = next(s for s in reversed(steps[:i]) if s[0] == "turn")
            assert (before[1] == step[1]) == (step[2] == "next"), (i, step)
    many = serve.many_script(cfg)
    assert [s[2] for s in many].count("many") == cfg["many"] * cfg["rounds"]
    assert len({s[1] for s in many}) == cfg["many"] > cfg["cache_conversations"]


def test_what_the_servers_report_is_read():
    log = ("Llama._create_completion: cache miss\nllama_perf_context_print: prompt eval time =  1234.5 ms /  2301 "
           "tokens (  0.54 ms per token)\n")
    assert serve.llama_log_facts(log) == {"cache": "miss", "prompt_eval_tokens": 2301}
    assert serve.llama_log_facts("") == {"cache": None, "prompt_eval_tokens": None}

    class Usage:
        completion_tokens, prompt_tokens = 32, 2300
        prompt_tokens_details = type("Details", (), {"cached_tokens": 2250})()

    assert serve.usage_fields(Usage(), 31) == {"completion_tokens": 32, "tokens_from": "usage", "prompt_tokens": 2300,
                                               "cached_tokens": 2250}
    assert serve.usage_fields(None, 31)["completion_tokens"] == 31


@pytest.mark.realmodel
def test_the_quick_service_benchmark_runs_against_kvstore_serve(tmp_path, smollm2_path):
    """`python -m benchmarks.serve --quick --no-peer`'s measurement: a real `kvstore serve` in a
    subprocess, every case measured, the sessions' KV reused where the case says it must be."""
    why = serve.kvstore_serve_status()
    if why:
        pytest.skip(f"{why}: this test runs once main has `kvstore serve` (issue 17)")
    sv = serve.run(dict(serve.QUICK), 2, str(smollm2_path), False, tmp_path)
    assert sv["not_measured"] == {"llama.cpp": "left out (--no-peer)"}
    ours = sv["summary"]["kvstore"]
    assert set(ours["cases"]) == set(serve.CASES) and ours["no_content"] == 0
    for t in sv["turns"]:
        assert t["ttft_s"] > 0 and t["completion_tokens"] > 0
        if t["case"] != "first":  # a stored session: its history is not prefilled again
            assert t["cached_tokens"] and t["cached_tokens"] >= t["prompt_tokens"] // 2, t
    text = "\n".join(report.service_section(fake_service() | {"serve": sv}, None))
    assert "| kvstore |" in text and str(tmp_path) not in text
