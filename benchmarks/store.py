"""Persistence costs and gains of kvstore sessions, measured side by side on SmolLM2 (bfloat16).

    python -m benchmarks.store            # 1k, 2k, 4k and 8k tokens (a few minutes)
    python -m benchmarks.store --quick    # 1k and 2k tokens, fewer repetitions (CI)

- time to first new token: resume (`store.open` + first token) vs recompute (prefill the same
  tokens from scratch + first token), alternating, per session length; the restore alone, with the
  page cache warm and with the session's files evicted from it (cold);
- decode with a checkpoint every 16 tokens vs none: the overhead in percent;
- pack: packed bytes vs raw bytes, and restore throughput from packed blobs;
- fork of the longest session: time and new bytes on disk.
The text is Python's own standard-library source, so the KV is real KV of real text.
Figures land in benchmarks/out/store.json and store.md (and are printed).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parent / "out"
TARGETS = {"resume_speedup_2k": 40.0, "resume_speedup_8k": 80.0, "restore_2k_ms": 39.0,
           "checkpoint16_overhead_pct": 3.0, "packed_ratio": 0.70, "unpack_gbps": 1.0}


def corpus_ids(tokenizer, n: int) -> list[int]:
    """n token ids of real text: the source of some standard-library modules."""
    import collections, argparse as ap, json as js, pathlib, textwrap, typing  # noqa: E401

    text = "\n".join(inspect.getsource(m) for m in (collections, ap, js, pathlib, textwrap, typing))
    ids = tokenizer.encode(text)
    assert len(ids) >= n, "not enough corpus text"
    return ids[:n]


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def evict(directory: Path) -> None:
    """Drop a session's (clean, fsynced) file pages from the page cache."""
    for p in directory.glob("layer-*.kv"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def first_token_recompute(model, ids: list[int]) -> float:
    import kvstore

    start = time.perf_counter()
    seq = kvstore.Sequence(model)
    for _ in seq.extend(ids):
        pass
    next(seq.generate(kvstore.SamplerSettings(), seed=0, max_new_tokens=1))
    return time.perf_counter() - start


def first_token_resume(store, model, name: str, cold: bool) -> tuple[float, float]:
    """(restore seconds, restore + first token seconds) on a fresh fork of `name`."""
    fork = f"{name}-r{time.monotonic_ns()}"
    store.fork(name, fork)
    if cold:
        evict(store.session_dir(store.info(name).id))
    start = time.perf_counter()
    session = store.open(fork, model)
    restored = time.perf_counter() - start
    tokens = session.generate(1, stop_at_eos=False)
    next(tokens)
    first = time.perf_counter() - start
    tokens.close()
    session.close()
    store.delete(fork)
    return restored, first


def ttft(store, model, lengths: list[int], reps: int) -> dict:
    results = {}
    for n in lengths:
        ids = corpus_ids(model.tokenizer, n)
        name = f"doc{n}"
        with store.new(name, model) as s:
            s.append_tokens(ids)
        rec, res, restore, cold = [], [], [], []
        for _ in range(reps):  # alternate: recompute, resume, resume (cold), recompute, ...
            rec.append(first_token_recompute(model, ids))
            r, f = first_token_resume(store, model, name, cold=False)
            restore.append(r)
            res.append(f)
            cold.append(first_token_resume(store, model, name, cold=True)[0])
        results[n] = {"recompute_s": spread(rec), "resume_s": spread(res), "restore_s": spread(restore),
                      "restore_cold_s": spread(cold),
                      "speedup": statistics.median(rec) / statistics.median(res),
                      "kv_bytes": n * model.config.n_layers * 2 * model.config.n_kv_heads * model.config.head_dim * 2}
        print(f"  {n:>5} tokens: recompute {statistics.median(rec):.3f}s  resume {statistics.median(res) * 1e3:.1f}ms"
              f"  restore {statistics.median(restore) * 1e3:.1f}ms (cold {statistics.median(cold) * 1e3:.1f}ms)"
              f"  speedup {results[n]['speedup']:.0f}x", flush=True)
    return results


def checkpoint_overhead(store, model, reps: int, n_new: int) -> dict:
    ids = corpus_ids(model.tokenizer, 1024)
    rates = {16: [], 0: []}
    for i in range(reps):
        for every in (16, 0) if i % 2 == 0 else (0, 16):
            name = f"ck{every}-{i}"
            with store.new(name, model, checkpoint_every=every or 10 ** 9) as s:
                s.append_tokens(ids)
                start = time.perf_counter()
                for _ in s.generate(n_new, stop_at_eos=False):
                    pass
                rates[every].append(n_new / (time.perf_counter() - start))
            store.delete(name)
    with_ck, without = statistics.median(rates[16]), statistics.median(rates[0])
    return {"tok_s_every16": spread(rates[16]), "tok_s_none": spread(rates[0]),
            "overhead_pct": 100 * (without - with_ck) / without}


def pack_figures(store, model, n: int, reps: int) -> dict:
    name = f"doc{n}"
    if name not in store.names():
        with store.new(name, model) as s:
            s.append_tokens(corpus_ids(model.tokenizer, n))
    store.fork(name, "packed")
    stats = store.pack("packed")
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        store.open("packed", model).lock.release()
        times.append(time.perf_counter() - start)
    return {"raw_bytes": stats["raw_bytes"], "packed_bytes": stats["packed_bytes"],
            "ratio": stats["packed_bytes"] / stats["raw_bytes"], "restore_s": spread(times),
            "unpack_gbps": stats["raw_bytes"] / statistics.median(times) / 1e9}


def disk_bytes(home: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in home.rglob("*") if p.is_file())


def fork_figures(store, model, n: int) -> dict:
    name = f"doc{n}"
    before = disk_bytes(store.home)
    start = time.perf_counter()
    store.fork(name, "forked")
    elapsed = time.perf_counter() - start
    return {"tokens": n, "fork_ms": elapsed * 1e3, "new_bytes": disk_bytes(store.home) - before}


def markdown(report: dict) -> str:
    lines = ["| tokens | recompute + 1st token | resume + 1st token | restore (warm / cold) | speedup |",
             "|---:|---:|---:|---:|---:|"]
    for n, r in report["ttft"].items():
        lines.append(f"| {n} | {r['recompute_s']['median']:.3f} s ({r['recompute_s']['min']:.3f}–"
                     f"{r['recompute_s']['max']:.3f}) | {r['resume_s']['median'] * 1e3:.1f} ms "
                     f"({r['resume_s']['min'] * 1e3:.1f}–{r['resume_s']['max'] * 1e3:.1f}) | "
                     f"{r['restore_s']['median'] * 1e3:.1f} / {r['restore_cold_s']['median'] * 1e3:.1f} ms | "
                     f"{r['speedup']:.0f}× |")
    ck, pk, fk = report["checkpoint"], report["pack"], report["fork"]
    lines += ["", "| measure | figure | target | met |", "|---|---:|---:|:---:|"]
    for key, label, value, fmt, better in report["checks"]:
        lines.append(f"| {label} | {fmt.format(value)} | {fmt.format(TARGETS[key])} | "
                     f"{'yes' if (value >= TARGETS[key]) == (better == 'higher') else 'no'} |")
    lines += ["", f"Decode with a checkpoint every 16 tokens: {ck['tok_s_every16']['median']:.1f} tok/s, "
              f"without: {ck['tok_s_none']['median']:.1f} tok/s.",
              f"Pack of {pk['raw_bytes'] / 1e6:.1f} MB raw KV: {pk['packed_bytes'] / 1e6:.1f} MB; restore from blobs "
              f"{pk['restore_s']['median'] * 1e3:.0f} ms ({pk['unpack_gbps']:.2f} GB/s).",
              f"Fork of a {fk['tokens']}-token session: {fk['fork_ms']:.1f} ms, {fk['new_bytes'] / 1e3:.0f} kB new on disk."]
    return "\n".join(lines)


def checks(report: dict) -> list:
    out = []
    t = report["ttft"]
    if 2048 in t:
        out.append(("resume_speedup_2k", "resume speedup at 2k tokens", t[2048]["speedup"], "{:.0f}×", "higher"))
        out.append(("restore_2k_ms", "restore of 2k tokens (warm)", t[2048]["restore_s"]["median"] * 1e3,
                    "{:.1f} ms", "lower"))
    if 8192 in t:
        out.append(("resume_speedup_8k", "resume speedup at 8k tokens", t[8192]["speedup"], "{:.0f}×", "higher"))
    out.append(("checkpoint16_overhead_pct", "checkpoint-every-16 overhead", report["checkpoint"]["overhead_pct"],
                "{:.1f} %", "lower"))
    out.append(("packed_ratio", "packed / raw bytes", report["pack"]["ratio"], "{:.2f}", "lower"))
    out.append(("unpack_gbps", "restore from blobs", report["pack"]["unpack_gbps"], "{:.2f} GB/s", "higher"))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.store", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1k and 2k tokens, 2 repetitions (CI)")
    p.add_argument("--reps", type=int)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    reps = args.reps or (2 if args.quick else 3)
    lengths = [1024, 2048] if args.quick else [1024, 2048, 4096, 8191]
    import kvstore

    model = kvstore.load_model(args.model, dtype="bfloat16")
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-") as home:
        store = kvstore.open_store(home)
        print("time to first token (resume vs recompute):", flush=True)
        report = {"threads": args.threads, "dtype": "bfloat16", "model": Path(model.source).name,
                  "ttft": {8192 if n == 8191 else n: v for n, v in ttft(store, model, lengths, reps).items()}}
        report["checkpoint"] = checkpoint_overhead(store, model, max(reps, 2) * 2, 32 if args.quick else 96)
        report["pack"] = pack_figures(store, model, 2048, reps)
        report["fork"] = fork_figures(store, model, lengths[-1])
    report["checks"] = checks(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "store.json").write_text(json.dumps(report, indent=2))
    table = markdown(report)
    (args.out / "store.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
