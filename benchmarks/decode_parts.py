"""Where a decode step's time goes, against the memory it reads.

    python -m benchmarks.decode_parts [--model smollm2] [--contexts 1024,2048,8160] [--threads 2]

The engine benchmark reports each decode rate as a share of its bandwidth limit (`benchmarks.bandwidth`:
the step's bytes over a two-thread `torch.sum` of a large buffer). This one splits the step to say which
part keeps it from that limit. For the model as it loads by default (the GGUF's blocks as stored, the
native layer stack), on the same torch threads:

- `read`: the streaming read rate with every thread and with one (the benchmark's yardstick, and
  what one core alone can pull);
- `products`: the four block-quantized products of every layer for one row, layer after layer, and
  `head`: the output product; each as time per step and bytes read per second;
- `attention`: `attention_rows` for one query row over every layer's cache of n tokens (a real
  Sequence's, filled by a prefill), time per step and the cache's bytes per second;
- `step`: a whole decode step (the median gap between tokens of the engine benchmark's decode).

Each part is timed warm (called again and again: what it reads partly still in the caches) and cold
(before each call the read above, of a buffer at least four times the last-level cache, pushes its
bytes out of them). A step meets its parts between the two: its 100+ MB stream through the caches,
some of it still there from the step before. What a step spends beyond its parts (norms, rotary,
SwiGLU, the cache copy, allocation, dispatch, starting and ending the parallel regions, Python,
sampling) is not split out: the step's time less the parts' depends on which of the two the parts are
taken at.

Figures depend on the machine (the report names the CPU); nothing here is a target.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from . import bandwidth

OUT = Path(__file__).resolve().parent / "out"


def warm_cold(fn, reps: int, evict) -> dict:
    """{"warm": s, "cold": s}: the median time of `fn` called again and again (what it read still in
    the caches), and called after `evict()` each time (all of it from memory)."""
    return {"warm": median_s(fn, reps), "cold": median_s(fn, reps, evict)}


def median_s(fn, reps: int, evict=None) -> float:
    """The median time of `fn` over `reps` calls, each after `evict()` (when given) pushed what the
    last call read out of the caches."""
    fn()  # first call: allocation, kernel selection
    times = []
    for _ in range(reps):
        if evict is not None:
            evict()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def read_rates(probe: bandwidth.ReadProbe, threads: int) -> dict:
    """{"all_threads": bytes/s, "one_thread": bytes/s} of a plain read of the probe's buffer."""
    rates = {"all_threads": probe.read_bytes_per_s()}
    torch.set_num_threads(1)
    try:
        rates["one_thread"] = probe.read_bytes_per_s()
    finally:
        torch.set_num_threads(threads)
    return rates


def product_parts(net, reps: int, evict) -> dict:
    """The layers' four products for one row, every layer in order, and the head: seconds (warm, cold)
    and bytes."""
    from kvstore.engine.quant import KINDS

    def call(w, x):
        return torch.ops.kvstore.qgemm(w.data, KINDS[w.kind], w.rows, w.cols, x, None, -1)

    weights = [w for L in net.layers for w in (L.wqkv, L.wo, L.w_gate_up, L.w_down)]
    inputs = {w.cols: torch.randn(1, w.cols).to(net.dtype) for w in weights}
    layers_s = warm_cold(lambda: [call(w, inputs[w.cols]) for w in weights], reps, evict)
    head = net.lm_head
    head_x = torch.randn(1, head.cols).to(net.dtype)
    head_s = warm_cold(lambda: call(head, head_x), reps, evict)
    return {"products": {"s": layers_s, "bytes": sum(w.data.numel() for w in weights)},
            "head": {"s": head_s, "bytes": head.data.numel()}}


def attention_part(model, context: int, reps: int, evict) -> dict:
    """attention_rows for one row over every layer's cache of `context` tokens: seconds (warm, cold) and
    bytes."""
    import kvstore

    cfg = model.config
    seq = kvstore.Sequence(model, tokens=synthetic_prompt(context, cfg.vocab_size))
    seq.next_logits()  # the prefill fills every layer's cache
    cache = seq.cache
    pools, table = cache.pools(), cache.blocks(0)[1]
    row_seq, row_len = torch.zeros(1, dtype=torch.int32), torch.tensor([context], dtype=torch.int32)
    q = torch.randn(1, cfg.n_heads, cfg.head_dim).to(model.net.dtype)
    seconds = warm_cold(lambda: [torch.ops.kvstore.attention_rows(q, p, table, row_seq, row_len) for p in pools],
                        reps, evict)
    seq.close()
    per_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2  # K and V, bfloat16, every layer
    return {"s": seconds, "bytes": per_token * context}


def step_s(model, context: int, new: int) -> float:
    """The median gap between generated tokens after `context` prompt tokens (the engine benchmark's
    decode of kvstore: greedy, in its default chunks)."""
    from kvstore.engine.sequence import DEFAULT_CHUNK

    from .engine import Ours

    stamps, _ = Ours(model, DEFAULT_CHUNK, 0.0).decode(synthetic_prompt(context, model.config.vocab_size), new)
    return statistics.median(b - a for a, b in zip(stamps, stamps[1:]))


def synthetic_prompt(n: int, vocab: int) -> list[int]:
    return [(17 + 31 * i) % (vocab - 1) + 1 for i in range(n)]


def measure(model, contexts: list[int], threads: int, reps: int, new: int) -> dict:
    from .engine import net_weight_bytes

    net = model.net
    probe = bandwidth.ReadProbe(bandwidth.buffer_bytes(net_weight_bytes(net)))
    evict = probe.buffer.sum  # a read of a buffer at least 4x the last-level cache
    out = {"threads": threads, "contexts": contexts, "read_bytes_per_s": read_rates(probe, threads)}
    out.update(product_parts(net, reps, evict))
    out["at"] = {str(n): {"attention": attention_part(model, n, reps, evict), "step_s": step_s(model, n, new)}
                 for n in contexts}
    return out


def table(r: dict) -> list[str]:
    bw = r["read_bytes_per_s"]
    lines = [f"read: {bw['all_threads'] / 1e9:.1f} GB/s on {r['threads']} threads, "
             f"{bw['one_thread'] / 1e9:.1f} GB/s on one", "",
             "| context | part | ms warm | ms cold | GB/s cold | cold, share of the 2-thread read |",
             "|---|---|---|---|---|---|"]
    for n, at in r["at"].items():
        parts = [("products (every layer)", r["products"]), ("head", r["head"]), ("attention", at["attention"])]
        for name, p in parts:
            rate = p["bytes"] / p["s"]["cold"]
            lines.append(f"| {n} | {name} | {p['s']['warm'] * 1e3:.2f} | {p['s']['cold'] * 1e3:.2f} | "
                         f"{rate / 1e9:.1f} | {100 * rate / bw['all_threads']:.0f} % |")
        warm, cold = (sum(p["s"][k] for _, p in parts) for k in ("warm", "cold"))
        lines.append(f"| {n} | the parts together | {warm * 1e3:.2f} | {cold * 1e3:.2f} | | |")
        lines.append(f"| {n} | **a decode step** | {at['step_s'] * 1e3:.2f} | | | |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode_parts", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="alias or .gguf path (block-quantized weights)")
    p.add_argument("--contexts", default="1024,2048,8160", help="contexts, comma-separated")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=20, help="repetitions per part (the median is kept)")
    p.add_argument("--new", type=int, default=24, help="tokens generated per step measurement")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return run(p, args)
    finally:
        torch.set_num_threads(before)


def run(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import kvstore
    from kvstore.engine import native

    model = kvstore.load_model(args.model, dtype="bfloat16")
    if model.net._stack is None or native.layers() is None:
        p.error("the model does not run on the native layer stack here (block-quantized weights, "
                "bfloat16 on a CPU with AVX2 or AVX512): there are no parts to split")
    with torch.inference_mode():
        r = measure(model, [int(n) for n in args.contexts.split(",")], args.threads, args.reps, args.new)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_parts.json").write_text(json.dumps(r, indent=1) + "\n")
    print("\n".join(table(r)), file=sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
