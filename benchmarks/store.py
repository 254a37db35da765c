"""kvstore's own persistence costs and gains on SmolLM2 (bfloat16), for `python -m benchmarks run`.

- time to the first new token: resume (`store.open` + one token) vs recompute (prefill the same
  tokens from scratch + one token), alternating, per session length; the restore alone warm (page
  cache warm, memory of the previous session reused, as in a pipeline opening one fork after
  another) and cold (the session's files evicted from the page cache and no memory to reuse: a new
  process's first open); disk bytes per length;
- save and restore of a whole session: the checkpoints a prefill commits (summed), `store.open`,
  `store.pack` and an open from the packed blobs — as one step of an A B A B rotation with peers;
- decode with a checkpoint every k tokens vs none; the checkpoints of several sessions handed over
  at once (as a batched step's sessions reach theirs) against the same committed one by one;
- forks: time and bytes on disk for 1..N forks of one session, then after each decodes a little.
The text is Python's own standard-library source, so the KV is real KV of real text.

    python -m benchmarks.store [--quick]     # these measurements only (no peers)
"""

from __future__ import annotations

import inspect
import os
import statistics
import time
from pathlib import Path
from typing import Iterable

SAVE_DIR = "peer-files"


def corpus_ids(tokenizer, n: int) -> list[int]:
    """n token ids of real text: the source of some standard-library modules."""
    import argparse, collections, json, pathlib, textwrap, typing  # noqa: E401

    text = "\n".join(inspect.getsource(m) for m in (collections, argparse, json, pathlib, textwrap, typing))
    ids = tokenizer.encode(text)
    assert len(ids) >= n, "not enough corpus text"
    return ids[:n]


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def evict(paths: Iterable[Path]) -> None:
    """Drop (clean, fsynced) files' pages from the page cache, so the next read comes from disk."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def go_warm(store) -> None:
    """The store's files in the page cache, as after they were written or read plainly (a cold open
    reads past the page cache and leaves them out of it)."""
    for p in store_files(store):
        with open(p, "rb") as f:
            while f.read(16 << 20):
                pass


def go_cold(store) -> None:
    """What a new process's first open meets: the store's files out of the page cache, and no
    memory of closed sessions to reuse (`kvstore.engine.cache.POOL`)."""
    from kvstore.engine.cache import POOL

    evict(store_files(store))
    POOL.clear()


def disk_bytes(path: Path) -> int:
    """Bytes allocated on disk under a folder (or by one file)."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_blocks * 512 for p in files)


def kv_bytes(model, n: int) -> int:
    c = model.config
    return n * c.n_layers * 2 * c.n_kv_heads * c.head_dim * 2  # bf16: 2 bytes per element


def store_files(store) -> list[Path]:
    """Every KV file of the store (layer files and packed blobs): what a cold restore must read."""
    home = Path(store.home)
    return [*(home / "sessions").rglob("layer-*.kv"), *(p for p in (home / "blobs").glob("*") if p.is_file())]


def time_checkpoints(session) -> list[tuple[float, float]]:
    """From now on, the (start, end) of each of the session's checkpoints, timed where they happen
    (the per-chunk commits of a prefill, the automatic ones of generate)."""
    spans, commit = [], session.checkpoint

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return commit(*args, **kwargs)
        finally:
            spans.append((start, time.perf_counter()))

    session.checkpoint = timed
    return spans


def build_session(store, model, name: str, ids: list[int]) -> float:
    """Create `name` holding ids (prefilled); returns the seconds its checkpoints took, summed."""
    session = store.new(name, model)
    spans = time_checkpoints(session)
    try:
        session.append_tokens(ids)
    finally:
        session.close()
    return sum(end - start for start, end in spans)


def timed_open(store, model, name: str) -> float:
    start = time.perf_counter()
    session = store.open(name, model)
    elapsed = time.perf_counter() - start
    session.close()
    return elapsed


# -- time to first token ---------------------------------------------------------------------------
def first_token_recompute(model, ids: list[int]) -> float:
    import kvstore

    start = time.perf_counter()
    seq = kvstore.Sequence(model)
    for _ in seq.extend(ids):
        pass
    next(seq.generate(kvstore.SamplerSettings(), seed=0, max_new_tokens=1))
    elapsed = time.perf_counter() - start
    seq.close()  # its memory goes to the next cache, as a closed session's does
    return elapsed


def first_token_resume(store, model, name: str, cold: bool) -> tuple[float, float]:
    """(restore seconds, restore + first token seconds) on a fresh fork of `name`; cold: its files
    out of the page cache and no memory to reuse, else its files in the page cache."""
    fork = f"{name}-r{time.monotonic_ns()}"
    store.fork(name, fork)
    if cold:
        go_cold(store)
    else:
        go_warm(store)
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


def ttft(store, model, lengths: list[int], reps: int, log=print) -> dict:
    """Per length: recompute vs resume (+ first token), restore warm/cold, disk bytes."""
    results = {}
    for n in lengths:
        ids = corpus_ids(model.tokenizer, n)
        name = f"doc{n}"
        build_session(store, model, name, ids)
        rec, res, restore, cold = [], [], [], []
        for _ in range(reps):  # alternate: recompute, resume (cold: a new process's first), resume, recompute, ...
            rec.append(first_token_recompute(model, ids))
            cold.append(first_token_resume(store, model, name, cold=True)[0])
            r, f = first_token_resume(store, model, name, cold=False)
            restore.append(r)
            res.append(f)
        results[str(n)] = {"tokens": n, "recompute_s": spread(rec), "resume_s": spread(res),
                           "restore_s": spread(restore), "restore_cold_s": spread(cold),
                           "speedup": statistics.median(rec) / statistics.median(res),
                           "speedups": spread([a / b for a, b in zip(rec, res)]),
                           "kv_bytes": kv_bytes(model, n), "disk_bytes": store.info(name).disk_bytes}
        log(f"  {n:>5} tokens: recompute {statistics.median(rec):.3f} s, resume {statistics.median(res) * 1e3:.1f} ms, "
            f"restore {statistics.median(restore) * 1e3:.1f} ms (cold {statistics.median(cold) * 1e3:.1f} ms), "
            f"{results[str(n)]['speedup']:.0f}x")
    return results


# -- save and restore, one step of the rotation with the peers ---------------------------------------
class KvstoreSaveRestore:
    """One repetition: build a session (its checkpoints are the save), open it (restore), pack it,
    open it from the blobs (unpack), each restore warm (its files in the page cache, as just written),
    then cold (a new process's first open: `restore_cold_s`), then cold into the memory the process
    holds (`restore_cold_kept_s`: the files evicted again, the memory of the session just closed
    reused, as llama.cpp's load fills the KV buffer its context holds), the order of the peers'
    `one_step`; then delete it."""

    methods = ("kvstore checkpoint / open", "kvstore pack / unpack")

    def __init__(self, store, model):
        self.store, self.model = store, model

    def run(self, ids: list[int]) -> dict[str, dict[str, float]]:
        store, name = self.store, f"save{len(ids)}-{time.monotonic_ns()}"
        out = {m: {} for m in self.methods}
        raw = out["kvstore checkpoint / open"]
        raw["save_s"] = build_session(store, self.model, name, ids)
        raw["bytes"] = store.info(name).disk_bytes
        raw["restore_s"] = timed_open(store, self.model, name)
        go_cold(store)
        raw["restore_cold_s"] = timed_open(store, self.model, name)
        evict(store_files(store))
        raw["restore_cold_kept_s"] = timed_open(store, self.model, name)
        packed = out["kvstore pack / unpack"]
        start = time.perf_counter()
        stats = store.pack(name)
        packed["save_s"] = time.perf_counter() - start
        packed["bytes"] = store.info(name).disk_bytes
        packed["ratio"] = stats["packed_bytes"] / stats["raw_bytes"]
        packed["restore_s"] = timed_open(store, self.model, name)
        go_cold(store)
        packed["restore_cold_s"] = timed_open(store, self.model, name)
        evict(store_files(store))
        packed["restore_cold_kept_s"] = timed_open(store, self.model, name)
        store.delete(name)
        return out


def save_restore(store, model, peers: list, lengths: list[int], reps: int, workdir: Path, log=print) -> dict:
    """Per length, kvstore and each peer's save / restore (warm, cold) / bytes, in A B A B order.

    A peer has `name`, `prepare(ids)` (its own prefill, untimed), `save(path) -> seconds` (fsync
    included, as kvstore's checkpoints are durable) and `restore(path) -> seconds`."""
    ours = KvstoreSaveRestore(store, model)
    results: dict[str, dict] = {}
    for n in lengths:
        ids = corpus_ids(model.tokenizer, n)
        for peer in peers:
            peer.prepare(ids)
        runs: dict[str, dict[str, list[float]]] = {}
        units = [ours, *peers]
        for rep in range(reps):
            for unit in units if rep % 2 == 0 else units[::-1]:
                for method, figures in one_step(unit, ids, workdir).items():
                    for key, value in figures.items():
                        runs.setdefault(method, {}).setdefault(key, []).append(value)
        for peer in peers:
            peer.release()
        results[str(n)] = {m: {k: spread(v) for k, v in figs.items()} for m, figs in runs.items()}
        for method, figs in results[str(n)].items():
            kept = f", memory kept {figs['restore_cold_kept_s']['median'] * 1e3:.1f} ms" \
                if "restore_cold_kept_s" in figs else ""
            log(f"  {n:>5} tokens, {method}: save {figs['save_s']['median'] * 1e3:.1f} ms, restore "
                f"{figs['restore_s']['median'] * 1e3:.1f} ms (cold {figs['restore_cold_s']['median'] * 1e3:.1f} ms"
                f"{kept}), {figs['bytes']['median'] / 1e6:.1f} MB")
    return results


def one_step(unit, ids: list[int], workdir: Path) -> dict[str, dict[str, float]]:
    if isinstance(unit, KvstoreSaveRestore):
        return unit.run(ids)
    path = workdir / SAVE_DIR / f"{unit.key}-{len(ids)}"
    path.parent.mkdir(parents=True, exist_ok=True)
    figures = {"save_s": unit.save(path), "bytes": disk_bytes(path)}
    figures["restore_s"] = unit.restore(path)
    evict([path])
    figures["restore_cold_s"] = unit.restore(path)
    path.unlink()
    return {unit.name: figures}


# -- checkpoint overhead during decode ---------------------------------------------------------------
def decode_rate(store, model, parent: str, n_new: int) -> tuple[float, float]:
    """(tok/s from the first new token to the last, the share of that time spent inside checkpoints,
    in %), in a fresh fork of `parent` (which sets the checkpoint interval)."""
    name = f"{parent}-{time.monotonic_ns()}"
    store.fork(parent, name)
    with store.open(name, model) as session:
        spans = time_checkpoints(session)
        stamps = []
        for _ in session.generate(n_new, stop_at_eos=False):
            stamps.append(time.perf_counter())
    store.delete(name)
    window = stamps[-1] - stamps[0]
    inside = sum(b - a for a, b in spans if a >= stamps[0] and b <= stamps[-1])
    return (len(stamps) - 1) / window, 100 * inside / (window - inside)


def checkpoint_overhead(store, model, intervals: list[int], reps: int, n_new: int, prompt: int, log=print) -> dict:
    """Decode tok/s per checkpoint interval (0: none), configurations rotated each repetition; each
    run decodes in a fork of one prefilled session per interval. Two measures of the overhead: the
    rates against the run without checkpoints (paired by repetition), and the time spent inside
    the checkpoints against the rest of the decode (timed in the same run: noise does not move it)."""
    ids = corpus_ids(model.tokenizer, prompt)
    configs = [0, *intervals]
    for every in configs:
        with store.new(f"ck{every}", model, checkpoint_every=every or 10 ** 9) as session:
            session.append_tokens(ids)
    rates: dict[int, list[float]] = {k: [] for k in configs}
    timed: dict[int, list[float]] = {k: [] for k in configs}
    for rep in range(reps):
        shift = rep % len(configs)
        for every in configs[shift:] + configs[:shift]:
            rate, share = decode_rate(store, model, f"ck{every}", n_new)
            rates[every].append(rate)
            timed[every].append(share)
    base = statistics.median(rates[0])
    out = {"new_tokens": n_new, "prompt_tokens": len(ids), "none": spread(rates[0]), "every": {}}
    for every in intervals:
        rate = statistics.median(rates[every])
        paired = [100 * (a - b) / a for a, b in zip(rates[0], rates[every])]  # the same repetition
        out["every"][str(every)] = {"tok_s": spread(rates[every]), "overhead_pct": 100 * (base - rate) / base,
                                    "overhead_pct_paired": spread(paired), "overhead_pct_timed": spread(timed[every]),
                                    "ms_per_checkpoint": 1e3 * every * (1 / rate - 1 / base)}
        log(f"  checkpoint every {every:>2}: {rate:.1f} tok/s vs {base:.1f} without, "
            f"{out['every'][str(every)]['overhead_pct']:+.1f} %; timed inside checkpoints: "
            f"{statistics.median(timed[every]):.1f} %")
    return out


def queued_checkpoints(store, model, n_sessions: int, reps: int, n_new: int = 16, prompt: int = 64,
                       log=print) -> dict:
    """The seconds until the automatic checkpoints of n_sessions sessions (n_new decoded tokens each),
    handed over at once as a batched step's sessions reach theirs, are all durable (`commit_later`:
    those that queue while the committing thread is busy commit together, `commit.commit_group`),
    against the same checkpoints each committed and waited for in turn; the two alternate, a
    repetition each."""
    ids = corpus_ids(model.tokenizer, prompt)
    sessions = [store.new(f"queued{i}", model, checkpoint_every=10 ** 9) for i in range(n_sessions)]
    decoding = []
    for s in sessions:
        s.append_tokens(ids)
        decoding.append(s.generate(2 * reps * n_new + 1, stop_at_eos=False))
    seconds: dict[str, list[float]] = {"together": [], "alone": []}
    for rep in range(2 * reps):
        for d in decoding:
            for _ in range(n_new):
                next(d)
        together = rep % 2 == 0
        start = time.perf_counter()
        for s in sessions:
            s.checkpoint("auto", wait=not together)
        for s in sessions:
            s.settle()
        seconds["together" if together else "alone"].append(time.perf_counter() - start)
    for d, s in zip(decoding, sessions):
        d.close()
        s.close()
        store.delete(s.name)
    out = {"sessions": n_sessions, "new_tokens": n_new, "prompt_tokens": len(ids),
           "together_s": spread(seconds["together"]), "alone_s": spread(seconds["alone"])}
    log(f"  checkpoints of {n_sessions} sessions handed over at once: {1e3 * out['together_s']['median']:.1f} ms "
        f"until all are durable, {1e3 * out['alone_s']['median']:.1f} ms one by one")
    return out


# -- forks --------------------------------------------------------------------------------------------
def fork_growth(store, model, name: str, count: int, n_new: int) -> dict:
    """Fork `name` 1..count times (time per fork, bytes after each), then let each fork decode
    n_new tokens (bytes after each: what a fork that diverges adds)."""
    home = Path(store.home)
    base = disk_bytes(home)
    times, after_fork, after_decode = [], [], []
    for i in range(count):
        start = time.perf_counter()
        store.fork(name, f"{name}-f{i}")
        times.append(time.perf_counter() - start)
        after_fork.append(disk_bytes(home) - base)
    for i in range(count):
        with store.open(f"{name}-f{i}", model) as session:
            for _ in session.generate(n_new, stop_at_eos=False):
                pass
        after_decode.append(disk_bytes(home) - base)
    return {"tokens": len(store.tokens(name)), "new_tokens_per_fork": n_new, "fork_s": times,
            "fork_s_stats": spread(times), "bytes_after_forks": after_fork, "bytes_after_decode": after_decode}


def main(argv: list[str] | None = None) -> int:
    from .__main__ import main as bench_main

    return bench_main(["run", "--no-peers", *(argv or [])])


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
