"""Store scale: what the index-bound verbs cost as a store fills with sessions, for `python -m
benchmarks run` (phase "scale") or alone:

    python -m benchmarks.scale [--quick] [--sessions N] [--small N] [--out DIR]

The store is built through the public API, as a user would: one document of DOC_TOKENS tokens of
real text, prefilled by the real model (`store.new` + `append_tokens`), forked (`store.fork`)
into most of the sessions, and `small` sessions of SMALL_TOKENS tokens each with files of their
own (`store.new` + `append_tokens`). Then, on that store:

- creation: forks per second, small sessions per second;
- a page: `store.page(PAGE, after=...)` at random cursors (median), the first page (it holds the
  document, whose record lists every fork), `count()`, and `list()` of everything;
- open: `store.open` of random forks and small sessions, warm (the document's files read through
  the page cache, then a first open); the first open of a fork before that;
- the CLI, one process per call: `kvstore list --limit PAGE --after NAME` at random cursors in this
  store against `kvstore list` in a store of one session, alternating; the first page (it holds
  the document, whose record lists every fork); `kvstore list` and `--json` of everything;
- gc: `store.gc()` with nothing to collect (its scan of the store) and `store.delete` of small
  sessions (each runs a gc that has work), per session and per GB on disk;
- verify: `store.verify()` of every session, per session and per GB of KV read, and how many
  extent reads it made for how many distinct extents; `verify(name)` of one fork.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .store import corpus_ids, disk_bytes, spread, timed_open

DOC_TOKENS = 2045  # the new user's document
SMALL_TOKENS = 16
FULL = {"sessions": 100_000, "small": 2_000, "page": 100, "pages": 20, "opens": 10, "cli_reps": 5, "deletes": 5}
QUICK = {"sessions": 1_000, "small": 30, "page": 100, "pages": 10, "opens": 5, "cli_reps": 3, "deletes": 3}
TARGETS = {"page_ms": 50.0, "open_ms": 20.0, "cli_ratio": 1.25}  # checked in the report


def run(model, cfg: dict, workdir: Path, log=print) -> dict:
    """Build the store in `workdir` and measure it; the figures as a JSON-able dict."""
    import kvstore

    rng = random.Random(0)
    store = kvstore.open_store(workdir / "scale-home")
    try:
        out = {"config": dict(cfg), "doc_tokens": DOC_TOKENS, "small_tokens": SMALL_TOKENS, "targets": TARGETS}
        out["create"] = build(store, model, cfg, log)
        out["store_bytes"] = disk_bytes(Path(store.home))
        names = store.names()
        forks = [n for n in names if n.startswith("doc-")]
        small = [n for n in names if n.startswith("small-")]
        out["listing"] = listing(store, names, cfg, rng)
        li = out["listing"]
        log(f"  page of {cfg['page']}: {li['page_s']['median'] * 1e3:.1f} ms; first page "
            f"{li['first_page_s'] * 1e3:.0f} ms; list() of {len(names):,}: {li['list_all_s']:.1f} s")
        out["open"] = opens(store, model, forks, small, cfg, rng)
        log(f"  open: fork {out['open']['fork_s']['median'] * 1e3:.1f} ms, "
            f"small {out['open']['small_s']['median'] * 1e3:.1f} ms")
        out["cli"] = cli(store, model, names, cfg, workdir, rng)
        log(f"  CLI: list --limit {cfg['page']} --after NAME {out['cli']['page_s']['median']:.2f} s vs one-session store "
            f"{out['cli']['one_s']['median']:.2f} s; everything {out['cli']['all_s']:.1f} s")
        out["verify"] = verify(store, forks)
        v = out["verify"]
        log(f"  verify: {v['s']:.1f} s, {v['reads']:,} reads of {v['extents']:,} extents")
        out["gc"] = gc(store, small[-cfg["deletes"]:], out["store_bytes"])
        log(f"  gc: {out['gc']['scan_s']:.2f} s; delete {out['gc']['delete_s']['median']:.2f} s")
    finally:
        store.close()
    return out


def build(store, model, cfg: dict, log) -> dict:
    """The document, its forks and the small sessions, through the public API; their rates."""
    text = corpus_ids(model.tokenizer, DOC_TOKENS + cfg["small"] * SMALL_TOKENS // 4 + SMALL_TOKENS)
    start = time.perf_counter()
    with store.new("doc", model) as s:
        s.append_tokens(text[:DOC_TOKENS])
    doc_s = time.perf_counter() - start
    n_forks = cfg["sessions"] - cfg["small"] - 1
    start = time.perf_counter()
    for i in range(n_forks):
        store.fork("doc", f"doc-q{i:06d}")
        if (i + 1) % 10_000 == 0:
            log(f"    {i + 1:,} forks, {time.perf_counter() - start:.0f} s")
    fork_s = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(cfg["small"]):
        at = (i * SMALL_TOKENS // 4) % (len(text) - SMALL_TOKENS)  # overlapping windows: each its own KV
        with store.new(f"small-{i:05d}", model) as s:
            s.append_tokens(text[at:at + SMALL_TOKENS])
    small_s = time.perf_counter() - start
    log(f"  built: document {doc_s:.1f} s, {n_forks:,} forks in {fork_s:.0f} s, {cfg['small']:,} small sessions "
        f"in {small_s:.0f} s")
    return {"doc_s": doc_s, "forks": n_forks, "fork_s": fork_s, "forks_per_s": n_forks / fork_s,
            "small": cfg["small"], "small_s": small_s, "small_per_s": cfg["small"] / small_s,
            "total_s": doc_s + fork_s + small_s}


def timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def listing(store, names: list[str], cfg: dict, rng: random.Random) -> dict:
    cursors = rng.sample(names, min(cfg["pages"], len(names)))
    page = [timed(lambda c=c: store.page(cfg["page"], after=c)) for c in cursors]
    first = timed(lambda: store.page(cfg["page"]))
    counts = [timed(store.count) for _ in range(5)]
    return {"sessions": len(names), "page_s": spread(page), "first_page_s": first,
            "doc_forks": len(store.info("doc").forks), "count_s": spread(counts),
            "list_all_s": timed(store.list)}


def opens(store, model, forks: list[str], small: list[str], cfg: dict, rng: random.Random) -> dict:
    """`store.open` of random forks and small sessions, warm: the document's layer files read through
    the page cache, then a first open (the process's memory). An open alone does not warm the files:
    a restore reads what the page cache does not hold straight from the disk without caching it
    (kvstore/direct_io.py), and the build may outlast their pages (on the Intel Xeon KVM guest,
    pages left idle were gone within a minute). Also: the share of the document's pages cached
    before (`doc_cached`), and the first open of a fork then (`fork_first_s`)."""
    doc = sorted((Path(store.home) / "sessions" / store.info("doc").id).glob("layer-*.kv"))
    doc_cached = cached_share(doc)
    first = timed_open(store, model, forks[0])
    for path in doc:
        path.read_bytes()
    timed_open(store, model, forks[0])
    fork_s = [timed_open(store, model, n) for n in rng.sample(forks, min(cfg["opens"], len(forks)))]
    small_s = [timed_open(store, model, n) for n in rng.sample(small, min(cfg["opens"], len(small)))]
    return {"fork_s": spread(fork_s), "small_s": spread(small_s), "doc_cached": doc_cached, "fork_first_s": first}


def cached_share(paths: list[Path]) -> float | None:
    """The share of the files' pages in the page cache; None where the kernel cannot say."""
    from kvstore import direct_io

    cached = total = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            pages = direct_io.cached_pages(fd, 0, size) if size else 0
        finally:
            os.close(fd)
        if pages is None:
            return None
        cached, total = cached + pages, total + (direct_io.pages_in(0, size) if size else 0)
    return cached / total if total else None


def kvstore_cli(home: Path, *args: str) -> float:
    """Seconds for one `kvstore --home HOME ARGS` process, stdout discarded."""
    env = {k: v for k, v in os.environ.items() if k != "KVSTORE_INDEX"}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "kvstore_cli", "--home", str(home), *args], stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, env=env, check=True)
    return time.perf_counter() - start


def cli(store, model, names: list[str], cfg: dict, workdir: Path, rng: random.Random) -> dict:
    """`kvstore list --limit PAGE --after NAME` (random cursors) here vs `kvstore list` in a store of
    one session, alternating; and the first page, which holds the document: its record lists every
    fork, so that page costs what its records hold, not what the store holds."""
    import kvstore

    one_home = workdir / "one-session-home"
    with kvstore.open_store(one_home) as one, one.new("only", model) as s:
        s.append_tokens(corpus_ids(model.tokenizer, SMALL_TOKENS))
    home, limit = Path(store.home), str(cfg["page"])
    page, first, single = [], [], []
    for cursor in rng.sample(names, cfg["cli_reps"]):
        page.append(kvstore_cli(home, "list", "--limit", limit, "--after", cursor))
        single.append(kvstore_cli(one_home, "list"))
        first.append(kvstore_cli(home, "list", "--limit", limit))
    return {"page_s": spread(page), "one_s": spread(single), "first_page_s": spread(first),
            "ratios": spread([a / b for a, b in zip(page, single)]),
            "ratio": statistics.median(page) / statistics.median(single),
            "all_s": kvstore_cli(home, "list"), "all_json_s": kvstore_cli(home, "list", "--json")}


def verify(store, forks: list[str]) -> dict:
    """verify() of everything, with its extent reads counted; verify(name) of one fork."""
    from kvstore.store import verify as module

    reads, real = [], module.read_layers_unlocked
    module.read_layers_unlocked = lambda st, ref, *a, **k: (reads.append(ref.extent_id), real(st, ref, *a, **k))[1]
    totals = []
    try:
        start = time.perf_counter()
        report = store.verify(progress=lambda done, total: totals.append(total))
        seconds = time.perf_counter() - start
    finally:
        module.read_layers_unlocked = real
    kv = totals[-1] if totals else 0
    return {"s": seconds, "sessions": len(report), "problems": sum(bool(p) for p in report.values()),
            "bytes": kv, "reads": len(reads), "extents": len(set(reads)),
            "per_session_s": seconds / len(report), "per_gb_s": seconds / (kv / 1e9) if kv else None,
            "one_s": timed(lambda: store.verify(forks[len(forks) // 2]))}


def gc(store, victims: list[str], store_bytes: int) -> dict:
    """gc with nothing to collect (the scan), then deletes of small sessions (each with its gc)."""
    n = store.count()
    scan = timed(store.gc)
    deletes = [timed(lambda v=v: store.delete(v)) for v in victims]
    return {"scan_s": scan, "sessions": n, "per_session_s": scan / n, "per_gb_s": scan / (store_bytes / 1e9),
            "delete_s": spread(deletes)}


# -- alone ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK['sessions']:,} sessions instead of {FULL['sessions']:,}")
    p.add_argument("--sessions", type=int, help="sessions in the store, all told")
    p.add_argument("--small", type=int, help="of which small sessions with files of their own")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    import kvstore

    from . import report
    from .__main__ import machine, versions

    cfg = dict(QUICK if args.quick else FULL)
    cfg.update({k: v for k, v in (("sessions", args.sessions), ("small", args.small)) if v is not None})
    model = kvstore.load_model(args.model, dtype="bfloat16")
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="kvstore-scale-") as tmp:
        figures = run(model, cfg, Path(tmp))
    results = {"scale": figures, "machine": machine(), "versions": versions(), "quick": args.quick,
               "started": time.strftime("%Y-%m-%d %H:%M", time.localtime(started)),
               "duration_s": time.time() - started}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "scale.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    print("\n".join(report.scale_section(results)))
    print(report.summary_table(results, only="store scale"))
    print(f"results: {path} ({results['duration_s'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
