"""REPORT.md, its PNG plots and the README's Benchmarks section, built from a results.json of
`python -m benchmarks run` (committed beside REPORT.md, so the report can be rebuilt from it:
`python -m benchmarks report`).

Every figure is a median with its spread (min–max over the repetitions); the targets table marks
each goal met or not met, and says "not measured" where a run had no figure for it, also when a
target is a peer's figure and the peer did not run (no figure from an earlier run stands in).

Machine kinds: each full run is kept as benchmarks/results/<cpu_slug>.json, and the report's
"Machine kinds" table puts the headline figures of every such file side by side, a column per kind,
"—" where a file has no such figure (an older run), so a regression on one kind cannot hide behind
another. `upgrade` reads the results of older runs (one decode context, no bandwidth) in the
current shape. A batching phase's results (`results["batching"]`) are rendered by
benchmarks/batching.py's `section(batching)` where that module exists.
"""

from __future__ import annotations

import re
from pathlib import Path

KVSTORE = ("kvstore checkpoint / open", "kvstore pack / unpack")


# -- formatting ----------------------------------------------------------------------------------
def span(s: dict, scale: float = 1.0, fmt: str = ".1f", unit: str = "") -> str:
    """"median unit (min–max)"."""
    return f"{s['median'] * scale:{fmt}}{unit} ({s['min'] * scale:{fmt}}–{s['max'] * scale:{fmt}})"


def label(n: int | str) -> str:
    n = int(n)
    return f"{n:,}"


def mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def gib(n: float) -> str:
    return f"{n / 2 ** 30:.0f} GiB"


# -- targets -------------------------------------------------------------------------------------
def targets(r: dict) -> list[dict]:
    """[{goal, figure, target, met: True | False | None}] from the results (None: not measured)."""
    rows = []

    def add(goal: str, value: float | None, text: str, target: str, ok) -> None:
        rows.append({"goal": goal, "figure": text if value is not None else "not measured",
                     "target": target, "met": None if value is None else bool(ok(value))})

    r = upgrade(r)
    e = r.get("engine", {})
    ratios, engines = e.get("ratios", {}), e.get("engines", {})
    for n in e.get("contexts", []):
        q = ratios.get("llama.cpp", {}).get("decode", {}).get(str(n))
        add(f"decode vs llama.cpp at {label(n)} tokens of context", q and q["median"],
            q and span(q, fmt=".2f", unit="×"), "≥ 1.0×", lambda v: v >= 1.0)
    for n in e.get("contexts", []):
        d = engines.get("kvstore", {}).get("decode", {}).get(str(n), {})
        pct = d.get("limit_pct")
        add(f"decode at {label(n)} tokens of context: share of the memory-bandwidth limit", pct,
            pct is not None and f"{pct:.0f} % ({d['tok_s']['median']:.1f} of {d['limit_tok_s']:.1f} tok/s)", "≥ 70 %",
            lambda v: v >= 70)
    first = e.get("contexts", [None])[0]
    hf = ratios.get("hf")
    dec = hf and hf["decode"].get(str(first))
    add(f"decode vs HF transformers `generate` at {label(first or 0)} tokens of context", dec and dec["median"],
        dec and span(dec, fmt=".2f", unit="×"), "≥ 2×", lambda v: v >= 2)
    n_pre = label(e.get("prefill_tokens", 2048))
    one = hf and hf.get("prefill_one_chunk")
    add(f"prefill speed, {n_pre} tokens in one forward (as HF runs it) vs HF transformers", one and one["median"],
        one and f"{span(one, fmt='.2f', unit='×')}", "≥ 1×", lambda v: v >= 1)
    for peer, goal in (("hf", 1.5), ("llama.cpp", 2.0)):
        q = ratios.get(peer, {}).get("prefill")
        add(f"prefill speed, {n_pre} tokens in kvstore's default chunks vs {PEER_NAMES[peer]}", q and q["median"],
            q and span(q, fmt=".2f", unit="×"), f"≥ {goal}×", lambda v, g=goal: v >= g)
    for n, goal in (("2048", 60), ("8191", 80)):
        t = r.get("ttft", {}).get(n)
        add(f"resume vs recompute, time to first token at {label(n)} tokens", t and t["speedup"],
            t and f"{t['speedup']:.0f}× ({t['speedups']['min']:.0f}–{t['speedups']['max']:.0f})", f"≥ {goal}×",
            lambda v, g=goal: v >= g)
    restore_targets(r.get("save_restore", {}).get("2048", {}), add)
    ck = r.get("checkpoint", {}).get("every", {}).get("16")
    add("decode overhead of a checkpoint every 16 tokens: time the decode spends in the checkpoints",
        ck and ck.get("overhead_pct_timed", {}).get("median"),
        ck and "overhead_pct_timed" in ck and span(ck["overhead_pct_timed"], unit=" %"), "≤ 3 %", lambda v: v <= 3)
    add("the same, from decode rates with and without (paired per repetition; noisy)",
        ck and ck["overhead_pct_paired"]["median"], ck and span(ck["overhead_pct_paired"], unit=" %"), "≤ 3 %",
        lambda v: v <= 3)
    pk = r.get("save_restore", {}).get("2048", {}).get(KVSTORE[1])
    add("packed size / raw bf16 KV (2,048 tokens)", pk and pk["ratio"]["median"],
        pk and f"{pk['ratio']['median']:.2f}", "≤ 0.70", lambda v: v <= 0.70)
    unpack = pk and pk["bytes"]["median"] / pk["ratio"]["median"] / pk["restore_s"]["median"] / 1e9
    add("unpack: raw bytes / time to open a packed 2,048-token session (warm)", unpack,
        unpack and f"{unpack:.2f} GB/s", "≥ 1 GB/s", lambda v: v >= 1)
    quality_targets(r.get("quality"), add)
    if "batching" in r and (module := batching_module()) is not None and hasattr(module, "targets"):
        module.targets(r["batching"], add)  # its goals, through the same `add(goal, value, text, target, ok)`
    scale_targets(r.get("scale"), add)
    return rows


PEER_NAMES = {"hf": "HF transformers", "llama.cpp": "llama.cpp", "kvstore bf16": "kvstore on bfloat16 weights"}
LLAMA_STATE, HF_SAFETENSORS = "llama.cpp state file (seq save / load)", "HF DynamicCache, safetensors"


def restore_targets(methods: dict, add) -> None:
    """kvstore's restore of a 2,048-token session against the peers' loads of the same cache; a target
    that is a peer's figure is not judged where the peer did not run."""
    ours = methods.get(KVSTORE[0])
    # (our figure, the peer's, what kind of restore, the peer, what the peer's is)
    cold = [("restore_cold_s", "restore_cold_s", "cold: files out of the page cache", LLAMA_STATE, "llama.cpp's")]
    if ours is not None and "restore_cold_kept_s" in ours:
        # llama.cpp's cold load fills the KV buffer its context holds: like for like, kvstore's with the
        # memory kept; a new process's first open (fresh memory) is shown beside it
        cold = [("restore_cold_kept_s", "restore_cold_s", "cold: files out of the page cache, into memory the "
                 "process holds", LLAMA_STATE, "llama.cpp's, which fills its context's KV buffer"),
                ("restore_cold_s", "restore_cold_s", "cold: files out of the page cache, a new process's fresh "
                 "memory", LLAMA_STATE, "llama.cpp's into its context's buffer, allocated untimed")]
    for key, peer_key, kind, peer, name in (
            ("restore_s", "restore_s", "warm: page cache, reused memory", LLAMA_STATE, "llama.cpp's"),
            ("restore_s", "restore_s", "warm, checksums verified", HF_SAFETENSORS,
             "HF safetensors' load, which verifies nothing"), *cold):
        goal = f"restore of a 2,048-token session ({kind})"
        theirs = methods.get(peer)
        if theirs is None:  # without the peer there is nothing to judge against
            add(goal, None, "", f"≤ {name} (not run here)", lambda v: False)
            continue
        limit = theirs[peer_key]["median"] * 1e3
        add(goal, ours and ours[key]["median"] * 1e3, ours and span(ours[key], 1e3, unit=" ms"),
            f"≤ {limit:.1f} ms ({name}, measured in this run)", lambda v, lim=limit: v <= lim)


def quality_targets(q: dict | None, add) -> None:
    """kvstore's perplexity within TARGETS % of each peer's (benchmarks/quality.py)."""
    from .quality import TARGETS

    for peer, pct in TARGETS.items():
        vs = (q or {}).get("vs", {}).get(peer)
        figure = vs is not None and (f"{vs:+.2f} % ({q['engines']['kvstore']['ppl']:.3f} vs "
                                     f"{q['engines'][peer]['ppl']:.3f})")
        add(f"perplexity: kvstore within {pct:g} % of {QUALITY_NAMES[peer]}", vs, figure, f"≤ {pct:g} %",
            lambda v, p=pct: abs(v) <= p)


QUALITY_NAMES = {"llama.cpp": "llama.cpp's (same GGUF)", "hf f32": "HF float32's (dequantized weights)"}


def scale_targets(sc: dict | None, add) -> None:
    """The store-scale goals (benchmarks/scale.py), each measured in a store of sc's sessions."""
    t = (sc or {}).get("targets", {"page_ms": 50.0, "open_ms": 20.0, "cli_ratio": 1.25})
    where = f", {sc['listing']['sessions']:,} sessions" if sc else ""
    page = sc and sc["listing"]["page_s"]
    add("store scale: list a page of sessions (`store.page`, median of random cursors)", page and page["median"] * 1e3,
        page and span(page, 1e3, unit=" ms") + where, f"≤ {t['page_ms']:.0f} ms", lambda v: v <= t["page_ms"])
    fork = sc and sc["open"]["fork_s"]
    add("store scale: open a fork of a 2,045-token document (warm)", fork and fork["median"] * 1e3,
        fork and span(fork, 1e3, unit=" ms") + where, f"≤ {t['open_ms']:.0f} ms", lambda v: v <= t["open_ms"])
    cli = sc and sc["cli"]
    add("store scale: `kvstore list --limit 100 --after NAME` process time vs `kvstore list` in a store of one "
        "session",
        cli and cli["ratio"], cli and f"{cli['ratio']:.2f}× ({cli['ratios']['min']:.2f}–{cli['ratios']['max']:.2f})"
        + where, f"≤ {t['cli_ratio']:.2f}×", lambda v: v <= t["cli_ratio"])
    v = sc and sc["verify"]
    add("store scale: `verify` reads per distinct extent (forks share them)", v and v["reads"] / v["extents"],
        v and f"{v['reads'] / v['extents']:.2f} ({v['reads']:,} reads, {v['extents']:,} extents)", "1.00",
        lambda x: x <= 1)


MARK = {True: "met", False: "**not met**", None: "not measured"}


def summary_table(r: dict, only: str = "") -> str:
    """The targets table; `only`: the goals that start with it."""
    lines = ["| goal | measured: median (min–max) | target | |", "|---|---|---|---|"]
    lines += [f"| {t['goal']} | {t['figure']} | {t['target']} | {MARK[t['met']]} |" for t in targets(r)
              if t["goal"].startswith(only)]
    return "\n".join(lines)


# -- sections ------------------------------------------------------------------------------------
def cpu_features(m: dict) -> str:
    """", with AVX512-BF16, AMX-BF16, ..." from the run's CPU flags (older results: amx_bf16 only)."""
    flags = m.get("flags")
    if flags is None:
        return ", AMX-BF16" if m.get("amx_bf16") else ""
    shown = [name for flag, name in CPU_FLAGS.items() if flag in flags]
    return f", with {', '.join(shown)}" if shown else ""


CPU_FLAGS = {"avx2": "AVX2", "avx512f": "AVX512F", "avx512_bf16": "AVX512-BF16", "avx512_vnni": "AVX512-VNNI",
             "avx_vnni": "AVX-VNNI", "amx_bf16": "AMX-BF16", "amx_int8": "AMX-INT8"}


def instruction_sets(m: dict) -> str:
    """"AVX2, AVX512F; not: AVX512-BF16, ..." over CPU_FLAGS (those that choose kernels)."""
    flags = m.get("flags") or []
    have = [name for flag, name in CPU_FLAGS.items() if flag in flags]
    lack = [name for flag, name in CPU_FLAGS.items() if flag not in flags]
    return ", ".join(have or ["none of them"]) + (f"; not: {', '.join(lack)}" if lack else "")


def measured_at(r: dict, phase: str) -> str:
    """Where a phase measured by its own command says the commit it ran at: "at the same commit" only
    when it is this run's (a phase's figures carried over from an older run must not pass for this
    run's: the kvstore bits may have changed since)."""
    commit, ours = r.get(phase, {}).get("commit"), r["versions"].get("kvstore")
    if commit is None:
        return "at a commit it did not record"
    return "at the same commit" if commit == ours else f"at commit {commit} (this run: {ours})"


def header(r: dict) -> list[str]:
    m, v, s = r["machine"], r["versions"], r["settings"]
    load = r["load"]
    phases = ", ".join(f"{k} {v[0]:.2f}" for k, v in load.items())
    kernels = m.get("kernels", {})
    lines = [
        "# Benchmark report", "",
        f"Generated by `python -m benchmarks run{' --quick' if r['quick'] else ''}{run_options(r)}` on {r['started']} "
        f"({r['duration_s'] / 60:.1f} min). SmolLM2-135M-Instruct (the Q4_1 GGUF) on {s['threads']} threads; "
        f"kvstore {WEIGHTS.get(s.get('weights', 'dense'), s.get('weights'))}, {s['dtype']} activations and KV; "
        "kvstore and its peers measured alternately (A B A B) in one process, "
        "each figure the median of the repetitions with the spread (min–max) in brackets."
        + (f" Phases left out of this run (`--skip`): {', '.join(r['skipped'])}." if r.get("skipped") else "")
        + "".join(f" The {phase} phase was measured by `{how}` {measured_at(r, phase)}."
                  for phase, how in r.get("separately", {}).items()),
        "",
        "## Summary", "", summary_table(r), "",
        "## Machine and versions", "",
        f"- CPU: {m['cpu']} ({m['arch']}), {m['cores']} cores{cpu_features(m)}; "
        f"RAM {gib(m['ram_bytes'])}; {m['os']}",
        f"- Instruction sets that choose kernels: {instruction_sets(m)} (machine kind `{cpu_slug(r)}`)"]
    lines += [f"- kvstore's kernels here, {op}: {how}" for op, how in kernels.items()]
    if "llama_repack" in r:
        lines.append(f"- llama.cpp's CPU weight repacking: {r['llama_repack']}")
    return lines + [
        f"- Python {v['python']}, torch {v['torch']}, transformers {v['transformers'] or 'not installed'}, "
        f"llama-cpp-python {v['llama-cpp-python'] or 'not installed'}, kvstore commit {v['kvstore']}",
        f"- Load average (1 min) when each phase started: {phases}. The machine has "
        f"{m['cores']} cores; other work on it shows up as spread.", ""]


WEIGHTS = {"stored": "on the GGUF's blocks as stored", "dense": "on weights dequantized to bfloat16",
           "q8_0": "on weights quantized to Q8_0"}


def ttft_section(r: dict) -> list[str]:
    t = r["ttft"]
    lines = ["## Time to first token: resume vs recompute", "",
             "Recompute: prefill the session's tokens from scratch in memory, then sample one token. "
             "Resume: `store.open` (restore from disk, checksums verified) of a fork of the session, then "
             "one token. Restore alone: warm (page cache warm, the memory of the previous session reused, as a "
             "pipeline opening fork after fork does) / cold (files evicted from the page cache and no memory to "
             "reuse: a new process's first open).", "",
             "| tokens | recompute + 1st token | resume + 1st token | restore, warm | restore, cold | speedup |",
             "|---:|---:|---:|---:|---:|---:|"]
    for n, x in t.items():
        lines.append(f"| {label(n)} | {span(x['recompute_s'], fmt='.3f', unit=' s')} | "
                     f"{span(x['resume_s'], 1e3, unit=' ms')} | {span(x['restore_s'], 1e3, unit=' ms')} | "
                     f"{span(x['restore_cold_s'], 1e3, unit=' ms')} | "
                     f"{x['speedup']:.0f}× ({x['speedups']['min']:.0f}–{x['speedups']['max']:.0f}) |")
    return lines + ["", "![time to first token](plots/ttft.png)", ""]


# -- the engine phase ----------------------------------------------------------------------------
def upgrade(r: dict) -> dict:
    """Results of an older run in the current shape (a copy; current results come back as they are):
    its one decode prompt becomes its one context, its kvstore ran on bfloat16 weights, and it
    measured no bandwidth (so no limits)."""
    e = r.get("engine")
    if not e or "contexts" in e:
        return r
    n = str(e["decode_prompt"])
    engines = {}
    for name, x in e["engines"].items():
        engines[name] = {"about": None, "weights": "dense" if name == "kvstore" else None, "load_s": x["load_s"],
                         "decode": {n: {"tok_s": x["decode_tok_s"], "steady_tok_s": x["decode_steady_tok_s"]}},
                         **{k: v for k, v in x.items() if k.startswith("prefill")}}
    ratios = {peer: {"decode": {n: q["decode"]}, **{k: v for k, v in q.items() if k.startswith("prefill")}}
              for peer, q in e["ratios"].items()}
    new = {"contexts": [int(n)], "decode_new": e["decode_new"], "prefill_tokens": e["prefill_tokens"],
           "chunk": e["chunk"], "others_busy_cpus": e["others_busy_cpus"], "engines": engines, "ratios": ratios,
           "greedy_equal_prefix": e["greedy_equal_prefix"]}
    return r | {"engine": new, "settings": {"weights": "dense"} | r["settings"]}


def context_label(n: int | str) -> str:
    """"1k", "2k", "8k" (8,160 tokens: the 8,192 context less the tokens decoded), or the count below 1k."""
    n = int(n)
    return f"{round(n / 1024)}k" if n >= 1000 else f"{n:,}"


def gb_s(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.1f} GB/s"


def engine_tables(e: dict) -> list[str]:
    """The engine phase's tables: decode per context (with each rate's share of its bandwidth limit),
    prefill and load, then kvstore ÷ each other engine."""
    ctx = [str(n) for n in e["contexts"]]
    bw = e.get("bandwidth")
    head = "| engine | " + " | ".join(f"decode tok/s at {label(n)}" + (" (% of limit)" if bw else "") for n in ctx)
    lines = [head + " | prefill tok/s | load s |", "|---|" + "---:|" * (len(ctx) + 2)]
    n_pre = e["prefill_tokens"]

    def rate(p: dict) -> str:
        return f"{n_pre / p['median']:.0f} ({n_pre / p['max']:.0f}–{n_pre / p['min']:.0f})"

    for name, x in e["engines"].items():
        cells = []
        for n in ctx:
            d = x["decode"][n]
            cells.append(span(d["tok_s"]) + (f" · {d['limit_pct']:.0f} %" if "limit_pct" in d else ""))
        lines.append(f"| {name} | {' | '.join(cells)} | {rate(x['prefill_s'])} | {x['load_s']:.1f} |")
        if "prefill_one_chunk_s" in x:
            lines.append(f"| {name}, prefill in one chunk |{' |' * len(ctx)} {rate(x['prefill_one_chunk_s'])} | |")
    for peer, q in e["ratios"].items():
        cells = " | ".join(f"**{span(q['decode'][n], fmt='.2f', unit='×')}**" for n in ctx)
        lines.append(f"| **kvstore ÷ {peer}** | {cells} | **{span(q['prefill'], fmt='.2f', unit='×')}** | |")
        if "prefill_one_chunk" in q:
            lines.append(f"| **kvstore in one chunk ÷ {peer}** |{' |' * len(ctx)} "
                         f"**{span(q['prefill_one_chunk'], fmt='.2f', unit='×')}** | |")
    if bw:
        lines += ["", "| engine | weights read per token | " + " | ".join(
            f"limit at {label(n)}, tok/s" for n in ctx) + " | how it holds the model |", "|---|---:|" + "---:|" * len(ctx) + "---|"]
        for name, x in e["engines"].items():
            lines.append(f"| {name} | {mb(x['weight_bytes'])} | "
                         + " | ".join(f"{x['decode'][n]['limit_tok_s']:.1f}" for n in ctx) + f" | {x['about']} |")
    return lines


def engine_section(r: dict) -> list[str]:
    e = r["engine"]
    bw = e.get("bandwidth")
    lines = ["## Engine speed: decode and prefill", "",
             f"Decode: greedy, {e['decode_new']} new tokens after a prompt of each length (the context), tok/s "
             "from the first new token to the last. "
             f"Prefill: {label(e['prefill_tokens'])} tokens in one call that yields the next token's logits "
             f"(kvstore: chunks of {e['chunk']}, and the same tokens in one chunk; llama.cpp: its batches of 512). "
             "`kvstore` is the model as kvstore loads it by default, `kvstore bf16` the same with its weights "
             "dequantized to bfloat16 (as HF transformers runs them); llama.cpp runs the GGUF's own blocks with an "
             "f16 KV cache."
             + (f" llama.cpp's CPU weight repacking: {r['llama_repack']}." if "llama_repack" in r else ""), ""]
    if bw:
        lines += [f"Memory bandwidth, measured beside the engines (once per repetition, same threads): a read of "
                  f"{mb(bw['bytes'])} ({bw['method']}) at **{span(bw['read_bytes_per_s'], 1e-9, unit=' GB/s')}**. "
                  "A decode step reads every weight once and the whole KV cache once, so each engine's limit at a "
                  f"context of n tokens is bandwidth / (its weight bytes + {e['kv_bytes_per_token']:,} KV bytes per "
                  f"token × (n + {e['decode_new']}/2)), and \"% of limit\" is its median rate against that.", ""]
    lines += engine_tables(e)
    if e["greedy_equal_prefix"]:
        same = ", ".join(f"{p}: {k}" for p, k in e["greedy_equal_prefix"].items())
        lines += ["", f"Greedy tokens equal to kvstore's for the first k of {e['decode_new']} at the first context "
                      f"({same}): the engines round differently (blocks, bfloat16, their own kernels), so a divergence "
                      "is expected."]
    busy = e["others_busy_cpus"]
    if busy and max(busy) >= 0.1:
        lines += ["", f"Other processes used up to {max(busy):.1f} CPUs just before some engine measurements."]
    return lines + ["", "![engine speed](plots/engine.png)", ""]


# -- quality ---------------------------------------------------------------------------------------
def quality_table(q: dict) -> list[str]:
    lines = ["| engine | perplexity | kvstore vs it | predictions | seconds | how it runs the model |",
             "|---|---:|---:|---:|---:|---|"]
    for name, x in q["engines"].items():
        vs = q["vs"].get(name)
        lines.append(f"| {name} | {x['ppl']:.4f} | {'' if vs is None else f'{vs:+.2f} %'} | {x['predictions']:,} | "
                     f"{x['seconds']:.0f} | {x['about']} |")
    return lines


def quality_section(r: dict) -> list[str]:
    q = r.get("quality")
    if not q:
        return []
    return ["## Quality: perplexity", "",
            f"{q['tokens']:,} tokens of {q['text']} (token ids' sha256 {q['ids_sha256']}), in {q['windows']} windows of "
            f"up to {q['window']:,} tokens, each from an empty cache, the same for every engine: the perplexity of "
            "each next token (`python -m benchmarks.quality`).", "", *quality_table(q), ""]


# -- machine kinds ---------------------------------------------------------------------------------
def machines_dir(bench: Path) -> Path:
    """Where each machine kind's latest full run is kept (`cpu_slug(results)`.json)."""
    return bench / "results"


def published_machines(bench: Path, suite: dict) -> list[dict]:
    """The committed full runs of the other machine kinds (benchmarks/results/*.json), by file name."""
    import json

    own = cpu_slug(suite)
    return [json.loads(p.read_text(encoding="utf-8")) for p in sorted(machines_dir(bench).glob("*.json"))
            if p.stem != own]


def headline(r: dict) -> dict[str, str]:
    """{row: figure} of the figures the machine-kinds table compares (those a run lacks are absent)."""
    r = upgrade(r)
    out: dict[str, str] = {}
    e = r.get("engine", {})
    engines, ratios = e.get("engines", {}), e.get("ratios", {})
    ours = engines.get("kvstore", {})
    out["kvstore's weights"] = WEIGHTS.get(ours.get("weights") or "", "—").removeprefix("on ")
    bw = e.get("bandwidth")
    if bw:
        out["memory read bandwidth"] = gb_s(bw["read_bytes_per_s"]["median"])
    for n in e.get("contexts", []):
        k, d = context_label(n), ours.get("decode", {}).get(str(n))
        llama = engines.get("llama.cpp", {}).get("decode", {}).get(str(n))
        if d:
            out[f"decode at {k}: kvstore tok/s"] = f"{d['tok_s']['median']:.1f}"
            if "limit_pct" in d:
                out[f"decode at {k}: kvstore, % of the bandwidth limit"] = f"{d['limit_pct']:.0f} %"
        if llama:
            out[f"decode at {k}: llama.cpp tok/s"] = f"{llama['tok_s']['median']:.1f}"
        q = ratios.get("llama.cpp", {}).get("decode", {}).get(str(n))
        if q:
            out[f"decode at {k}: kvstore ÷ llama.cpp"] = f"{q['median']:.2f}×"
    for peer in ("hf", "llama.cpp"):
        q = ratios.get(peer, {}).get("prefill")
        if q:
            out[f"prefill {context_label(e['prefill_tokens'])}: kvstore ÷ {peer}"] = f"{q['median']:.2f}×"
    t = r.get("ttft", {}).get("2048")
    if t:
        out["resume vs recompute at 2k: time to first token"] = f"{t['speedup']:.0f}×"
    sr = r.get("save_restore", {}).get("2048", {})
    ours_sr = sr.get(KVSTORE[0])
    # (ours, the peer's, the peer, the row): llama.cpp's one cold figure fills the memory its context holds
    for key, peer_key, peer, row in (
            ("restore_s", "restore_s", HF_SAFETENSORS, "restore 2k warm, ms: kvstore / HF safetensors"),
            ("restore_cold_s", "restore_cold_s", LLAMA_STATE, "restore 2k cold, ms: kvstore / llama.cpp"),
            ("restore_cold_kept_s", "restore_cold_s", LLAMA_STATE,
             "restore 2k cold, memory kept, ms: kvstore / llama.cpp")):
        if ours_sr and sr.get(peer) and key in ours_sr:
            out[row] = f"{ours_sr[key]['median'] * 1e3:.1f} / {sr[peer][peer_key]['median'] * 1e3:.1f}"
    for peer, x in (r.get("quality") or {}).get("vs", {}).items():
        out[f"perplexity: kvstore vs {peer}"] = f"{x:+.2f} %"
    if "llama_repack" in r:
        out["llama.cpp's CPU weight repacking"] = r["llama_repack"].split(" ", 1)[0]
    return out


def machines_section(r: dict, machines: list[dict]) -> list[str]:
    """One table, a column per machine kind (this run first), a row per headline figure."""
    runs = [r, *machines]
    figures = [headline(x) for x in runs]
    rows = list(dict.fromkeys(row for f in figures for row in f))
    cols = [f"{x['machine']['cpu']} ({kind_tag(x['machine'])}, {x['started'][:10]}"
            + (", this run" if i == 0 else "") + ")" for i, x in enumerate(runs)]
    lines = ["## Machine kinds", "",
             "The headline figures of this run beside the latest full run of each other machine kind "
             "(benchmarks/results/<kind>.json), each measured on its own machine with its peers; \"—\": that run "
             "had no such figure (an older run measured fewer).", "",
             "| figure | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    lines += [f"| {row} | " + " | ".join(f.get(row, "—") for f in figures) + " |" for row in rows]
    return lines + [""]


def run_options(r: dict) -> str:
    """The options of the run beside --quick, as typed: --reps, --skip."""
    s = r.get("settings", {})
    reps = f" --reps {s['reps']}" if s.get("reps_given") else ""
    return reps + (f" --skip {','.join(r['skipped'])}" if r.get("skipped") else "")


def batching_module():
    """benchmarks/batching.py where this checkout has it, else None."""
    import importlib.util

    if importlib.util.find_spec(f"{__package__}.batching") is None:
        return None
    from . import batching

    return batching


def batching_section(r: dict) -> list[str]:
    """results["batching"] rendered by benchmarks/batching.py's `section(batching) -> [markdown lines]`
    (and its goals in the summary by its optional `targets(batching, add)`), where the module exists."""
    if "batching" not in r:
        return []
    module = batching_module()
    if module is None:
        return ["## Batching", "", "These results have a batching phase, but this checkout has no "
                "benchmarks/batching.py to render it.", ""]
    return list(module.section(r["batching"]))


def save_section(r: dict) -> list[str]:
    lines = ["## Save and restore a session", "",
             "The same tokens in each: kvstore sessions built by a prefill (save: its per-chunk checkpoints, "
             "summed; restore: `store.open`), then packed (`store.pack`, restore from the blobs); HF "
             "transformers' `DynamicCache` from a real HF prefill, written with `torch.save` or safetensors "
             "and read back into a `DynamicCache`; llama.cpp's `llama_state_seq_save_file` / `_load_file`. "
             "Every save ends with its bytes fsynced (kvstore's checkpoints are durable; the peers' files get "
             "an fsync). Restore warm: right after the save, its files in the page cache (kvstore reuses the "
             "memory of the session it closed, as llama.cpp restores into the KV buffer its context holds); then "
             "cold: the files evicted from the page cache, and for kvstore no memory to reuse (a new process's "
             "first open; kvstore reads files the page cache lacks with direct I/O where the kernel can say so)."]
    if any("restore_cold_kept_s" in x for methods in r["save_restore"].values() for x in methods.values()):
        lines[-1] += (" Then cold with the memory kept: the files evicted again, kvstore's memory of the session "
                      "just closed reused. That is llama.cpp's cold load: it fills the KV buffer its context holds "
                      "(allocated, and written by its prefill, before the timing), so its own cold figure is of "
                      "that kind; HF's loads make new tensors each time.")
    lines.append("")
    for n, methods in r["save_restore"].items():
        raw = int(n) * r["settings"]["kv_bytes_per_token"]
        kept = any("restore_cold_kept_s" in x for x in methods.values())
        lines += [f"**{label(n)} tokens** (raw bf16 KV: {mb(raw)})", "",
                  "| method | save | restore, warm | restore, cold | " + ("cold, memory kept | " if kept else "")
                  + "on disk |", "|---|---:|---:|---:|" + ("---:|" if kept else "") + "---:|"]
        for name, x in methods.items():
            size = mb(x["bytes"]["median"]) + (f" ({x['ratio']['median']:.2f} of raw)" if "ratio" in x else "")
            held = (span(x["restore_cold_kept_s"], 1e3, unit=" ms") if "restore_cold_kept_s" in x else
                    "(as cold)" if name == LLAMA_STATE else "—") + " | " if kept else ""
            lines.append(f"| {name} | {span(x['save_s'], 1e3, unit=' ms')} | {span(x['restore_s'], 1e3, unit=' ms')} | "
                         f"{span(x['restore_cold_s'], 1e3, unit=' ms')} | {held}{size} |")
        lines.append("")
    return lines + ["![save and restore](plots/save_restore.png)", ""]


def checkpoint_section(r: dict) -> list[str]:
    c = r["checkpoint"]
    lines = ["## Checkpoint overhead during decode", "",
             f"Decode of {c['new_tokens']} tokens (rate from the first to the last) after a "
             f"{label(c['prompt_tokens'])}-token prompt, in a fresh fork of a session that commits a checkpoint "
             "every k tokens (each: the new KV appended and fsynced, one SQLite transaction, committed on a "
             "thread of its own while the next tokens decode), vs one that commits none while decoding; "
             "configurations rotated each repetition. Paired: the overhead within each repetition (it holds "
             "what the commits running beside the decode cost it). Timed: the time the decode spends inside "
             "the checkpoint calls (the change handed over, the previous commit waited for) against the rest "
             "of the same decode (the rates of separate runs move with the machine's noise; this does not).",
             "",
             "| checkpoint every | decode tok/s | overhead (of medians) | overhead, paired | overhead, timed "
             "| ms per checkpoint (from the rates) |",
             "|---:|---:|---:|---:|---:|---:|", f"| never | {span(c['none'])} | | | | |"]
    for k, x in c["every"].items():
        timed = span(x["overhead_pct_timed"], unit=" %") if "overhead_pct_timed" in x else "not measured"
        lines.append(f"| {k} | {span(x['tok_s'])} | {x['overhead_pct']:.1f} % | "
                     f"{span(x['overhead_pct_paired'], unit=' %')} | {timed} | {x['ms_per_checkpoint']:.1f} |")
    if q := c.get("queued"):
        lines += ["", f"Checkpoints of {q['sessions']} sessions handed over at once ({q['new_tokens']} new tokens "
                  f"each, after a {label(q['prompt_tokens'])}-token prompt), as the sessions of a batched decode step "
                  f"reach theirs: all durable in {span(q['together_s'], scale=1e3, unit=' ms')} (those that "
                  "queue while the committing thread is busy commit together: one transaction, one sync), against "
                  f"{span(q['alone_s'], scale=1e3, unit=' ms')} for the same committed one by one, each waited for "
                  f"({q['together_s']['n']} repetitions of each, alternated)."]
    return lines + ["", "![checkpoint overhead](plots/checkpoint.png)", ""]


def growth_section(r: dict) -> list[str]:
    t, f = r["ttft"], r["forks"]
    lines = ["## How costs grow", "",
             "Restore time and disk bytes against session length (the sessions above), and forks of the "
             f"{label(f['tokens'])}-token session: each fork's time, and the store's growth on disk after 1..N "
             f"forks, then after each fork decoded {f['new_tokens_per_fork']} tokens of its own.", "",
             "| tokens | restore, warm | restore, cold | on disk | bytes per token |", "|---:|---:|---:|---:|---:|"]
    for n, x in t.items():
        lines.append(f"| {label(n)} | {span(x['restore_s'], 1e3, unit=' ms')} | {span(x['restore_cold_s'], 1e3, unit=' ms')} "
                     f"| {mb(x['disk_bytes'])} | {x['disk_bytes'] / int(n):,.0f} |")
    count = len(f["fork_s"])
    lines += ["", f"Forks: {span(f['fork_s_stats'], 1e3, unit=' ms')} each; after {count} forks the store grew "
              f"{f['bytes_after_forks'][-1] / 1e3:,.0f} kB, after each decoded {f['new_tokens_per_fork']} tokens "
              f"{f['bytes_after_decode'][-1] / 1e3:,.0f} kB in all "
              f"({f['bytes_after_decode'][-1] / count / 1e3:,.0f} kB per fork).", "",
              "![growth](plots/growth.png)", ""]
    return lines


def scale_section(r: dict) -> list[str]:
    """The store-scale table (benchmarks/scale.py): a store of forks and small sessions."""
    sc = r.get("scale")
    if not sc:
        return []
    c, li, o, cl, g, v = sc["create"], sc["listing"], sc["open"], sc["cli"], sc["gc"], sc["verify"]
    n = li["sessions"]

    def ms(x: dict) -> str:
        return span(x, 1e3, unit=" ms")

    def per(seconds: float) -> str:
        return f"{seconds / n * 1e3:.2f} ms"

    rows = [
        (f"`store.page({sc['config']['page']})` at random cursors", ms(li["page_s"]), "", ""),
        (f"the first page (holds the document, whose record lists its {li['doc_forks']:,} forks)",
         f"{li['first_page_s'] * 1e3:.1f} ms", "", ""),
        ("`store.count()`", ms(li["count_s"]), "", ""),
        ("`store.list()` of every session", f"{li['list_all_s']:.2f} s", per(li["list_all_s"]), ""),
        ("`store.open` of a fork (warm: the document's files in the page cache)", ms(o["fork_s"]), "", ""),
        *([(f"the first open of a fork, before the document's files were read through the page cache "
            f"({o['doc_cached']:.0%} of their pages in it)" if o.get("doc_cached") is not None else
            "the first open of a fork, before the document's files were read through the page cache",
            f"{o['fork_first_s'] * 1e3:.1f} ms", "", "")] if "fork_first_s" in o else []),
        ("`store.open` of a small session (warm)", ms(o["small_s"]), "", ""),
        (f"`kvstore list --limit {sc['config']['page']} --after NAME`, random cursors (one process)",
         span(cl["page_s"], fmt=".2f", unit=" s"), "", ""),
        (f"`kvstore list --limit {sc['config']['page']}`: the first page, with the document's record",
         span(cl["first_page_s"], fmt=".2f", unit=" s") if "first_page_s" in cl else "not measured", "", ""),
        ("`kvstore list` in a store of one session (one process)", span(cl["one_s"], fmt=".2f", unit=" s"), "", ""),
        ("`kvstore list` of every session", f"{cl['all_s']:.1f} s", per(cl["all_s"]), ""),
        ("`kvstore list --json` of every session", f"{cl['all_json_s']:.1f} s", per(cl["all_json_s"]), ""),
        ("`store.gc()` with nothing to collect", f"{g['scan_s']:.2f} s", per(g["scan_s"]),
         f"{g['per_gb_s']:.2f} s per GB on disk"),
        ("`store.delete` of a small session (its gc included)", span(g["delete_s"], fmt=".2f", unit=" s"), "", ""),
        ("`store.verify()` of every session", f"{v['s']:.1f} s", per(v["s"]),
         f"{v['per_gb_s']:.2f} s per GB of KV read" if v["per_gb_s"] else ""),
        ("`store.verify(name)` of one fork", f"{v['one_s'] * 1e3:.0f} ms", "", "")]
    lines = ["## Store scale", "",
             f"A store of {n:,} sessions made through the public API: a {sc['doc_tokens']:,}-token document "
             f"(prefilled, {c['doc_s']:.1f} s), {c['forks']:,} forks of it (`store.fork`, {c['forks_per_s']:,.0f} "
             f"per second) and {c['small']:,} small sessions of {sc['small_tokens']} tokens with files of their own "
             f"(`store.new` + `append_tokens`, {c['small_per_s']:,.1f} per second); {c['total_s'] / 60:.1f} min to "
             f"create, {sc['store_bytes'] / 1e9:.2f} GB on disk (index included). Verify read "
             f"{v['bytes'] / 1e9:.2f} GB of KV in {v['reads']:,} extent reads ({v['extents']:,} distinct extents); "
             f"{v['problems']} of {v['sessions']:,} sessions had problems. A page costs what its records hold, "
             "not what the store holds: the first page holds the document, whose record lists every one of its "
             "forks.", "",
             "| measure | median (min–max) or time | per session | per GB |", "|---|---:|---:|---:|"]
    return lines + [f"| {a} | {b} | {c_} | {d} |" for a, b, c_, d in rows] + [""]


# -- the service (benchmarks/serve.py) --------------------------------------------------------------
CASE_TITLES = {"first": "a conversation's first turn (the document, cold)",
               "next": "the next turn of the same conversation",
               "back": "back to a conversation after others used the server",
               "restart": "the next turn after a server restart (killed, started again)",
               "many": "round-robin over more conversations than llama.cpp's RAM cache holds"}
SERVICE_GOALS = {"restart": "first turn after a server restart", "back": "coming back to a conversation",
                 "many": "more conversations than llama.cpp's RAM cache holds"}


def services_dir(bench: Path) -> Path:
    """Where the published standalone service results live: one file per CPU model."""
    return bench / "results" / "serve"


def published_services(bench: Path, suite: dict) -> list[dict]:
    """The committed service results (benchmarks/results/serve/*.json), by file name, less the one
    of the suite run's CPU when the suite run measured the service itself."""
    import json

    docs = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(services_dir(bench).glob("*.json"))]
    if "serve" in suite:
        docs = [d for d in docs if cpu_slug(d) != cpu_slug(suite)]
    return docs


def service_docs(r: dict, services: list[dict]) -> list[dict]:
    """The service runs to show: the suite run's own, else the suite CPU's published one first."""
    return ([r] if "serve" in r else []) + sorted(services, key=lambda d: cpu_slug(d) != cpu_slug(r))


def seconds(x: float) -> str:
    return f"{x * 1e3:.0f} ms" if x < 1 else f"{x:.2f} s"


def service_rows(sv: dict) -> list[dict]:
    """[{case, goal, ours, best, figure, target, met}] for the service's targets (met None: not measured)."""
    rows = []
    for case, goal in SERVICE_GOALS.items():
        q = sv.get("ratios", {}).get(case)
        ours = sv.get("summary", {}).get("kvstore", {}).get("cases", {}).get(case)
        target = sv.get("targets", {}).get(case)
        rows.append({"case": case, "goal": goal, "target": f"≥ {target:.0f}×" if target else "",
                     "ours": seconds(ours["ttft_s"]["p50"]) if ours else "not measured",
                     "best": f"{seconds(q['best_p50'])} ({q['best'].removeprefix('llama.cpp ')})" if q else
                     "not measured",
                     "figure": f"{q['ratio_p50']:.1f}×" if q else "not measured",
                     "met": None if q is None else bool(q["met"])})
    return rows


def service_table(sv: dict) -> str:
    lines = ["| goal: TTFT p50 | kvstore | llama.cpp, best mode | llama.cpp ÷ kvstore | target | |",
             "|---|---:|---:|---:|---|---|"]
    lines += [f"| {t['goal']} | {t['ours']} | {t['best']} | {t['figure']} | {t['target']} | {MARK[t['met']]} |"
              for t in service_rows(sv)]
    return "\n".join(lines)


def served(sv: dict) -> str:
    """How kvstore held the model in a service run (runs before `kvstore_weights` was recorded:
    bfloat16, the only way `kvstore serve` had then)."""
    weights, dtype = sv.get("kvstore_weights"), sv.get("kvstore_dtype", "bf16")
    if weights == "stored":
        return f"kvstore serves the GGUF's blocks as stored (its integer kernels) with {dtype} activations and KV"
    if weights in (None, "dense"):
        return f"kvstore serves the model in {dtype}"
    return f"kvstore serves the model's weights as {weights}, {dtype} activations and KV"


def service_header(doc: dict, suite_machine: dict | None) -> list[str]:
    sv, m, v = doc["serve"], doc["machine"], doc["versions"]
    other = suite_machine is not None and cpu_slug({"machine": suite_machine}) != cpu_slug(doc)
    cfg = sv["config"]
    lines = ["## Service", "",
             f"**{m['cpu']}**: measured by `python -m benchmarks.serve{' --quick' if doc['quick'] else ''}` on "
             f"{doc['started']} ({doc['duration_s'] / 60:.1f} min) on {m['cpu']} ({m['arch']}), {m['cores']} cores"
             f"{cpu_features(m)}, each server on {sv['threads']} threads; llama-cpp-python "
             f"{v.get('llama-cpp-python') or 'not installed'}, openai {v.get('openai') or '?'}, kvstore commit "
             f"{v['kvstore']}." + (f" **Not the machine of the sections above** ({suite_machine['cpu']}, "
                                   f"{kind_tag(suite_machine)}): compare "
                                   "these figures with each other only." if other else ""), "",
             f"The workload: {cfg['conversations']} conversations, then {cfg['many']} more, each opening with a "
             f"system line of its own and a {sv['doc_chars']:,}-character document (the standard library's "
             "docstrings) as its first user message, then short questions; the client (the official `openai` "
             f"package, streaming, greedy, {cfg['max_tokens']} tokens a reply) resends the whole history each turn, "
             "and names the conversation for kvstore with `X-Session-Id`. TTFT: from the request to the first "
             "content chunk. Each server runs as its own process on a loopback port; a restart kills it "
             "(SIGKILL) and starts it again on the same folder" + (
                 " (kvstore then restores the sessions it held open, its default `--prewarm`, while no request "
                 "waits: the restart case's turn finds its conversation in memory if that was done before the "
                 "request came, and restores it itself otherwise)" if sv.get("kvstore_prewarm") else "") +
             ". " + served(sv) + "; llama.cpp runs "
             "the GGUF's own Q4_1 weights with an f16 KV cache, in each prompt-cache mode: none, ram "
             "(`--cache True --cache_type ram`) and disk (`--cache True --cache_type disk`); for the round-robin "
             f"case its RAM cache is sized (`--cache_size`) for {cfg['cache_conversations']} conversations. "
             "The ratio is llama.cpp's TTFT p50 in its best mode for the case ÷ kvstore's. p99 is over the turns "
             "shown (with few turns, close to the slowest); tok/s: completion tokens ÷ request time.", ""]
    if sv.get("sse_comments_dropped"):
        lines += ["In this run the client dropped the streams' SSE comments (keep-alive pings) before the `openai` "
                  "package read them: its decoder keeps the last event id and turned the blank line after a ping "
                  "into an event with empty data, which it failed to parse, so a ping after an event with an id "
                  "(kvstore serve's resumable streams) broke it (since fixed in the server: its keep-alives end no "
                  "event). Comments carry nothing a client uses.", ""]
    if "llama.cpp disk" in sv.get("summary", {}):
        lines += ["llama-cpp-python's disk cache (0.3.36) takes the entry its lookup matches out of the cache "
                  "(`LlamaDiskCache.__getitem__` pops it) even when the request then does not use it: a new "
                  "conversation, whose tokens share the first words of the system line with another's, removes "
                  "that other conversation's entry. So its disk mode helps a conversation only when no other one "
                  "ran since, as in the restart case, which runs the same conversation before and after.", ""]
    gone = sv.get("not_measured", {})
    if gone:
        lines += ["Not measured: " + "; ".join(f"{k}: {why}" for k, why in gone.items()) + ".", ""]
    return lines


def service_case(sv: dict, case: str) -> list[str]:
    rows = [(server, x["cases"][case]) for server, x in sv["summary"].items() if case in x["cases"]]
    if not rows:
        return []
    lines = [f"**{case}**: {CASE_TITLES[case]}", "",
             "| server | turns | TTFT p50 | TTFT p99 | min–max | tok/s | prompt tokens | reused / evaluated |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for server, c in rows:
        t = c["ttft_s"]
        reuse = (f"{c['cached_tokens']:,.0f} reused" if c.get("cached_tokens") is not None else
                 f"{c['prompt_eval_tokens']:,.0f} evaluated" if c.get("prompt_eval_tokens") is not None else "")
        prompt = f"{c['prompt_tokens']:,.0f}" if c.get("prompt_tokens") is not None else ""
        lines.append(f"| {server} | {t['n']} | {seconds(t['p50'])} | {seconds(t['p99'])} | "
                     f"{seconds(t['min'])}–{seconds(t['max'])} | {c['tok_s']:.1f} | {prompt} | {reuse} |")
    q = sv.get("ratios", {}).get(case)
    if q:
        goal = f"; target ≥ {q['target']:.0f}×: {MARK[q['met']]}" if "target" in q else ""
        lines += ["", f"llama.cpp's best mode here: {q['best'].removeprefix('llama.cpp ')}; its p50 ÷ kvstore's: "
                      f"**{q['ratio_p50']:.1f}×** (p99: {q['ratio_p99']:.1f}×){goal}."]
    return lines + [""]


def service_totals(doc: dict) -> list[str]:
    sv = doc["serve"]
    starts = {}
    for s in sv.get("starts", []):
        starts.setdefault(s["server"], []).append(s["ready_s"])
    lines = ["**All turns**", "",
             "| server | turns | completion tokens | aggregate tok/s | ready after start, median | load average (1 min) |",
             "|---|---:|---:|---:|---:|---:|"]
    for server, x in sv["summary"].items():
        ready = sorted(starts.get(server, [0.0]))
        load = x.get("load_1min")
        lines.append(f"| {server} | {x['turns']} | {x['completion_tokens']:,} | {x['tok_s']:.1f} | "
                     f"{seconds(ready[len(ready) // 2])} | {f'{load[0]:.2f}–{load[1]:.2f}' if load else ''} |")
    return lines + ["", f"The machine has {doc['machine']['cores']} cores: a load average above the servers' own "
                        "threads means other work shared them, which shows in the spread.", ""]


def service_section(doc: dict, suite_machine: dict | None) -> list[str]:
    """The Service section of one service run (its CPU named; flagged when it is not the suite's)."""
    sv = doc["serve"]
    lines = service_header(doc, suite_machine)
    if not sv.get("summary"):
        return lines
    lines += [service_table(sv), ""]
    for case in CASE_TITLES:
        lines += service_case(sv, case)
    return lines + service_totals(doc)


def not_measured(r: dict) -> list[str]:
    gone = {k: why for k, why in r["peers"].items() if why}
    if not gone:
        return []
    return ["## Not measured", ""] + [f"- {k}: {why}" for k, why in gone.items()] + [""]


SECTIONS = ((ttft_section, ("ttft",)), (engine_section, ("engine",)), (quality_section, ()), (batching_section, ()),
            (save_section, ("save_restore",)), (checkpoint_section, ("checkpoint",)), (growth_section, ("ttft", "forks")),
            (scale_section, ()))  # the report's sections in order, each with the phases it needs


def markdown(r: dict, services: list[dict] = (), machines: list[dict] = ()) -> str:
    """The report of a suite run `r`, with a Service section for its own serve phase (if it ran one)
    and for each of `services` (standalone `python -m benchmarks.serve` results, per CPU), and the
    machine-kinds table of `r` beside `machines` (other kinds' full runs)."""
    r = upgrade(r)
    parts = header(r) + machines_section(r, list(machines)) + not_measured(r)
    for section, phases in SECTIONS:
        if all(r.get(phase) for phase in phases):  # `run --skip` leaves phases out
            parts += section(r)
    for doc in service_docs(r, services):
        parts += service_section(doc, r["machine"])
    return "\n".join(parts).rstrip() + "\n"


def write(r: dict, dest: Path, services: list[dict] = (), machines: list[dict] = ()) -> Path:
    from . import charts

    dest.mkdir(parents=True, exist_ok=True)
    charts.draw_all(upgrade(r), dest / "plots")
    path = dest / "REPORT.md"
    path.write_text(markdown(r, services, machines), encoding="utf-8")
    return path


def isa_tag(m: dict) -> str:
    """The widest kernel path the CPU's flags allow: "amx", "avx512", "avx2", else the architecture."""
    flags = set(m.get("flags") or [])
    for tag, names in (("amx", ("amx_bf16", "amx_int8")), ("avx512", ("avx512f", "avx512_bf16", "avx512_vnni")),
                       ("avx2", ("avx2",))):
        if flags & set(names):
            return tag
    return m.get("arch", "cpu")


def generation(m: dict) -> str | None:
    """The core generation where the CPU's name does not tell it ("AMD EPYC" is a Zen 2 to a Zen 5, whose
    AVX-512 units differ: Zen 4 splits a 512-bit operation in two halves, Zen 5 does not), from the CPU
    family and model that `machine()` records; None where they are not recorded (older files) or the
    name says enough."""
    family, model = m.get("family"), m.get("model")
    if family is None or "AMD" not in m.get("cpu", ""):
        return None
    if family == 0x17:
        return "zen2" if model >= 0x30 else "zen1"
    if family == 0x19:
        return "zen4" if (0x10 <= model <= 0x1f or 0x60 <= model <= 0xaf) else "zen3"
    if family == 0x1a:
        return "zen5"
    return f"family{family}"


def kind_tag(m: dict) -> str:
    """The machine kind beside its CPU's name: the generation where known, then the widest kernel
    path ("zen5, avx512", "amx")."""
    return ", ".join(t for t in (generation(m), isa_tag(m)) if t)


def cpu_slug(r: dict) -> str:
    """A file name for the run's machine kind: the CPU's name, its generation where the name does not
    tell it, and its widest kernel path (`intel-r-xeon-r-processor-amx`, `amd-epyc-zen4-avx512`,
    `amd-epyc-zen5-avx512`, `amd-epyc-avx2`): one name ("AMD EPYC") covers CPUs of different
    instruction sets and cores, hence kernels and speeds."""
    name = re.sub(r"[^a-z0-9]+", "-", r["machine"]["cpu"].lower()).strip("-") or "unknown-cpu"
    return f"{name}-{kind_tag(r['machine']).replace(', ', '-')}"


def readme_section(r: dict, services: list[dict] = ()) -> str:
    service = []
    for doc in service_docs(r, services):
        if doc["serve"].get("summary"):
            service += [f"`kvstore serve` against llama.cpp's server (`python -m benchmarks.serve` on "
                        f"{doc['started']}, "
                        f"{doc['serve']['threads']} threads of a {doc['machine']['cores']}-core {doc['machine']['cpu']} "
                        f"({kind_tag(doc['machine'])})"
                        f"{', not the CPU above' if cpu_slug(doc) != cpu_slug(r) else ''}): "
                        "TTFT p50, llama.cpp in its best prompt-cache mode for each case "
                        "([Service](benchmarks/REPORT.md#service)).", "", service_table(doc["serve"]), ""]
    return "\n".join([
        f"Measured by `python -m benchmarks run` on {r['started']}: SmolLM2-135M-Instruct (kvstore "
        f"{WEIGHTS[upgrade(r)['settings']['weights']]}, bf16 activations) on "
        f"{r['settings']['threads']} threads of a {r['machine']['cores']}-core {r['machine']['cpu']} "
        f"({kind_tag(r['machine'])}), "
        "kvstore and its peers (HF transformers, llama.cpp) alternating; median (min–max). "
        "The full report, with every figure, the machine, the versions and the plots: "
        "[benchmarks/REPORT.md](benchmarks/REPORT.md).", "", summary_table(r), "", *service,
        "Run it yourself with `python -m benchmarks run` (full, writes the report) or "
        "`python -m benchmarks run --quick` (a few minutes, into `benchmarks/out/`); the perplexities alone: "
        "`python -m benchmarks.quality`; the service alone: "
        "`python -m benchmarks.serve` (`--publish` writes its per-CPU file and rebuilds the report); where a decode "
        "step's time goes (the layers' products, the head, the attention, each timed warm and from memory beside "
        "the step): `python -m benchmarks.decode_parts`. The report "
        "compares every machine kind measured so far ([Machine kinds](benchmarks/REPORT.md#machine-kinds)).", ""])


def update_readme(path: Path, r: dict, services: list[dict] = ()) -> None:
    """Replace the body of the README's `## Benchmarks` section (up to the next `## `)."""
    text = path.read_text(encoding="utf-8")
    m = re.search(r"^## Benchmarks\n(.*?)(?=^## )", text, re.S | re.M)
    if m is None:
        raise SystemExit(f"{path}: no `## Benchmarks` section followed by another section")
    body = readme_section(r, services)
    path.write_text(text[:m.start(1)] + "\n" + body + "\n" + text[m.end(1):], encoding="utf-8")
