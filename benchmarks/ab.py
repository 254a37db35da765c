"""Two revisions of kvstore side by side: which one is faster, and whether they compute the same bits.

    python -m benchmarks.ab BASE [CHANGED] [--case decode:1024 --case step:8x512 --case attention:1024 ...]

A change to a kernel is judged against the revision before it, each revision's own build, in fresh
processes alternated (BASE CHANGED, CHANGED BASE, ...) so that the machine's slow and fast phases
fall on both. Not two paths of one build behind a switch read inside the kernels: that switch costs
the path it guards. On AMD EPYC Zen 4 (2026-12-06) a decode tile's K layout done two ways in one
build, chosen by a flag read in the kernel, made the new way look 5-12 % faster in decode steps; the
two builds, each with one way, ran alike (1.00x).

- BASE, CHANGED: git revisions (what `git rev-parse` takes); CHANGED left out: the working tree as it
  is, uncommitted changes and files git does not ignore included. Each is written to a temporary
  folder and imported from there; its native kernels are built on its first import (kept in the
  build cache, named by their sources' hash: a revision measured before builds nothing).
- Cases (each a median within one process; the figure kept per process is that median):
  - `decode:N`: 32 greedy tokens after a prompt of N (the library's `Sequence`): the median gap between
    tokens. Bits: the tokens and the logits after them.
  - `step:SxN`: S sequences of N positions in one paged pool (as the server holds them) take 16
    batched decode steps (`Model.feed_rows`, then `Model.head`): the median step. Bits: the logits.
  - `attention:N`: `attention_rows` for one decode row over one layer's N positions, on one thread,
    100 calls a time, the cache in L2: the kernel's arithmetic alone. Bits: the outputs.
  - `attention-cold:N`: the same row over every layer's N positions, on the threads given, each time
    after a read of a buffer four times the last-level cache has pushed the cache out of it: the
    kernel's reads from memory. Bits: the outputs.
  - `restore:N`: `store.open` of a stored session of N positions whose layer files were just dropped
    from the page cache, into the memory of the session closed before it (a process opening session
    after session: the engine's pool), 12 times: the disk, the reading threads and the checksums.
    `restore-fresh:N`: the same with that memory given back first (a new process's first open).
    Bits: the restored cache.
- Prints per case each revision's median over the processes (min-max), CHANGED / BASE, and whether
  the two computed the same bits (`--json FILE` writes it all).

How many processes a verdict needs depends on the machine: HEAD against the same code in the working
tree, 4 processes each (AMD EPYC Zen 4, 2 threads, a machine whose speed swings by a third within
minutes), gave decode:1024 0.80x, step:8x512 1.13x and attention:1024 1.00x (57 us, every process within
1 %). There, a decode or step figure needs a dozen processes or more and a gain well beyond that
spread; the attention case, on one thread from L2, tells a few percent apart in four.

The measuring runs in child processes of this file run as a script (`--child`), so that nothing of the
tree it measures comes from elsewhere: it imports the standard library, torch, kvstore (the tree's)
and this file's neighbour `bandwidth.py` (the size of the last-level cache).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CASE_KINDS = ("decode", "step", "attention", "attention-cold", "restore", "restore-fresh")


# -- the child: one case, measured in the tree on sys.path -----------------------------------------------
def prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    """n token ids, deterministic, away from the special ids at the start of the vocabulary."""
    return [(17 + 31 * i + 101 * seed) % (vocab - 1) + 1 for i in range(n)]


def measure_decode(model, n: int) -> tuple[float, bytes]:
    import kvstore

    seq = kvstore.Sequence(model, tokens=prompt(n, model.config.vocab_size))
    stamps, tokens = [], []
    for event in seq.generate(kvstore.SamplerSettings(temperature=0.0), seed=0, max_new_tokens=33):
        stamps.append(time.perf_counter())
        tokens.append(event.token)
    logits = seq.next_logits()
    seq.close()
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return statistics.median(gaps), json.dumps(tokens).encode() + logits.numpy().tobytes()


def measure_step(model, sessions: int, n: int) -> tuple[float, bytes]:
    import torch

    from kvstore.engine.paged import BLOCK_TOKENS, BlockPool, PagedCache

    c, steps = model.config, 16
    per_sequence = -(-(n + steps + 1) // BLOCK_TOKENS)
    pool = BlockPool(c.n_layers, c.n_kv_heads, c.head_dim, dtype=model.dtype, n_blocks=sessions * per_sequence + 8)
    caches, ids = [], []
    for s in range(sessions):
        cache, tokens = PagedCache(pool), prompt(n + steps, c.vocab_size, seed=s + 1)
        for a in range(0, n, 256):  # the prompt in chunks of the library's size
            model.feed(tokens[a:min(a + 256, n)], a, cache)
        caches.append(cache)
        ids.append(tokens[n:])
    times, out = [], []
    for k in range(steps):
        start = time.perf_counter()
        logits = model.head(model.feed_rows([([ids[s][k]], n + k, caches[s]) for s in range(sessions)]))
        times.append(time.perf_counter() - start)
        out.append(logits.to(torch.float32).numpy().tobytes())
    for cache in caches:
        cache.release()
    return statistics.median(times), b"".join(out)


def measure_attention(model, n: int, cold: bool) -> tuple[float, bytes]:
    import torch

    import kvstore

    c = model.config
    seq = kvstore.Sequence(model, tokens=prompt(n + 1, c.vocab_size))
    seq.next_logits()
    pools, table = seq.cache.pools(), seq.cache.blocks(0)[1]
    q = torch.randn(1, c.n_heads, c.head_dim, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    row_seq, row_len = torch.zeros(1, dtype=torch.int32), torch.tensor([n], dtype=torch.int32)
    out = [torch.ops.kvstore.attention_rows(q, p, table, row_seq, torch.tensor([k], dtype=torch.int32))
           for p in pools[:4] for k in (1, 17, n // 3 + 1, n)]

    def layers(which):
        for p in which:
            torch.ops.kvstore.attention_rows(q, p, table, row_seq, row_len)
    times = []
    if cold:  # every layer, each time after a read that pushes the cache out of the CPU's caches
        from bandwidth import CACHE_MULTIPLE, last_level_cache_bytes  # this file's neighbour (run as a script)

        evict = torch.ones(max(CACHE_MULTIPLE * last_level_cache_bytes(), 64 << 20) // 4)
        for _ in range(16):
            evict.sum()
            start = time.perf_counter()
            layers(pools)
            times.append(time.perf_counter() - start)
    else:  # one layer on one thread, again and again: its cache stays in L2
        torch.set_num_threads(1)
        for _ in range(100):
            layers(pools[:1])
        for _ in range(15):
            start = time.perf_counter()
            for _ in range(100):
                layers(pools[:1])
            times.append((time.perf_counter() - start) / 100)
    seq.close()
    return statistics.median(times), b"".join(o.view(torch.int16).numpy().tobytes() for o in out)


def measure_restore(model, n: int, fresh: bool) -> tuple[float, bytes]:
    import torch

    import kvstore
    from kvstore.engine.cache import POOL

    with tempfile.TemporaryDirectory(prefix="kvstore-ab-restore-") as home:
        store = kvstore.open_store(home)
        session = store.new("s", model)
        session.append_tokens(prompt(n, model.config.vocab_size))
        session.close()
        files = [p for p in Path(home).rglob("layer-*.kv")]
        times = []
        for _ in range(13):  # the first open pays what a process pays once (threads, statements)
            for path in files:  # out of the page cache: the next read comes from the disk
                fd = os.open(path, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
            if fresh:
                POOL.clear()
            time.sleep(0.2)  # the disk done with whatever came before
            start = time.perf_counter()
            session = store.open("s", model)
            times.append(time.perf_counter() - start)
            bits = b"".join(t.contiguous().view(torch.int16).numpy().tobytes() for t in session.seq.cache.state())
            session.close()
        store.close()
    return statistics.median(times[1:]), bits


def child(case: str, model_spec: str, threads: int) -> dict:
    """One case measured in this process: {"s": seconds, "digest": of the bits it computed, "kvstore": where
    kvstore came from}."""
    import torch

    import kvstore

    torch.set_num_threads(threads)
    kind, size = parse_case(case)
    model = kvstore.load_model(model_spec, dtype="bfloat16")
    with torch.inference_mode():
        if kind == "decode":
            measure_decode(model, min(size[-1], 64))  # warm: kernels chosen, memory taken
            s, bits = measure_decode(model, size[-1])
        elif kind == "step":
            s, bits = measure_step(model, *size)
        elif kind.startswith("restore"):
            s, bits = measure_restore(model, size[-1], fresh=kind == "restore-fresh")
        else:
            s, bits = measure_attention(model, size[-1], cold=kind == "attention-cold")
    return {"s": s, "digest": hashlib.sha256(bits).hexdigest()[:16], "kvstore": kvstore.__file__}


# -- the parent: trees, alternation, the table ----------------------------------------------------------
def parse_case(text: str) -> tuple[str, tuple[int, ...]]:
    """'decode:1024' -> ("decode", (1024,)); 'step:8x512' -> ("step", (8, 512)); ValueError otherwise."""
    kind, _, size = text.partition(":")
    parts = size.split("x")
    if kind not in CASE_KINDS or not all(p.isdigit() and int(p) > 0 for p in parts) or \
            len(parts) != (2 if kind == "step" else 1):
        raise ValueError(f"{text!r}: a case is decode:N, step:SxN, attention:N, attention-cold:N, restore:N or "
                         "restore-fresh:N (positive integers)")
    return kind, tuple(int(p) for p in parts)


def git(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True, **kwargs)


def write_tree(revision: str | None, into: Path) -> str:
    """The tree of `revision` (None: the working tree) written to `into`; returns its name for the table."""
    into.mkdir(parents=True)
    if revision is not None:
        try:
            commit = git("rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}", text=True).stdout.strip()
        except subprocess.CalledProcessError:
            raise ValueError(f"{revision!r} is not a revision of this repository (git rev-parse knows no such "
                             "commit)") from None
        archive = git("archive", "--format=tar", commit).stdout
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
        return f"{revision} ({commit[:7]})"
    files = git("ls-files", "-z", "--cached", "--others", "--exclude-standard").stdout.split(b"\0")
    for name in filter(None, files):
        source = REPO / os.fsdecode(name)
        if source.is_file():  # a tracked file deleted in the working tree is not there
            target = into / os.fsdecode(name)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())
    return "working tree"


def run_child(tree: Path, case: str, model: str, threads: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", case, "--model", model,
                           "--threads", str(threads)], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{case} in {tree} failed:\n{done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not Path(result["kvstore"]).resolve().is_relative_to(tree.resolve()):
        raise RuntimeError(f"the child imported kvstore from {result['kvstore']}, not from {tree}")
    return result


def compare(trees: dict[str, Path], cases: list[str], model: str, threads: int, reps: int, log=print) -> dict:
    """Per case: each tree's seconds per process (alternated), digests, and the ratio of the medians."""
    names = list(trees)
    out = {}
    for case in cases:
        runs = {name: [] for name in names}
        digests = {name: set() for name in names}
        for rep in range(reps):
            for name in names if rep % 2 == 0 else names[::-1]:
                r = run_child(trees[name], case, model, threads)
                runs[name].append(r["s"])
                digests[name].add(r["digest"])
        medians = {name: statistics.median(v) for name, v in runs.items()}
        same = len(set().union(*digests.values())) == 1
        out[case] = {"s": runs, "median_s": medians, "ratio": medians[names[1]] / medians[names[0]],
                     "same_bits": same, "digests": {k: sorted(v) for k, v in digests.items()}}
        log(line(case, out[case], names))
    return out


def line(case: str, r: dict, names: list[str]) -> str:
    def fig(name: str) -> str:
        v = r["s"][name]
        return f"{statistics.median(v) * 1e3:.3f} ms ({min(v) * 1e3:.3f}-{max(v) * 1e3:.3f})"
    bits = "same bits" if r["same_bits"] else "**different bits**: " + json.dumps(r["digests"])
    return f"{case}: {names[0]} {fig(names[0])}, {names[1]} {fig(names[1])}: {r['ratio']:.3f}x; {bits}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ab", description=__doc__.split("\n\n")[0])
    p.add_argument("base", nargs="?", help="the revision measured against (a git revision)")
    p.add_argument("changed", nargs="?", help="the revision measured (default: the working tree)")
    p.add_argument("--case", action="append", help="decode:N, step:SxN, attention:N, attention-cold:N, restore:N or "
                   "restore-fresh:N (repeatable; default: decode:1024, step:8x512, attention:1024)")
    p.add_argument("--model", default="smollm2", help="alias or path, as kvstore.load_model takes it")
    p.add_argument("--threads", type=int, default=2, help="torch threads (attention: always 1)")
    p.add_argument("--reps", type=int, default=4, help="processes per revision and case")
    p.add_argument("--json", type=Path, help="write the figures here too")
    p.add_argument("--child", metavar="CASE", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.model, args.threads)))
        return 0
    if args.base is None:
        p.error("name the revision to measure against (say HEAD)")
    cases = args.case or ["decode:1024", "step:8x512", "attention:1024"]
    for case in cases:
        try:
            parse_case(case)
        except ValueError as e:
            p.error(f"--case {e}")
    if args.reps < 1 or args.threads < 1:
        p.error("--reps and --threads must be at least 1")
    with tempfile.TemporaryDirectory(prefix="kvstore-ab-") as tmp:
        trees = {}
        try:
            for key, revision in (("base", args.base), ("changed", args.changed)):
                path = Path(tmp) / key
                trees[write_tree(revision, path)] = path
        except ValueError as e:
            p.error(str(e))
        if len(trees) < 2:
            p.error("BASE and CHANGED name the same tree; name two revisions")
        result = compare(trees, cases, args.model, args.threads, args.reps)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
