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
bytes out of them), and in a step: the time the part's kernel calls take inside real decode steps
(the decode that times `step`, its next `new` tokens under torch.profiler: each call's own time on
the calling thread, per token; the head is the product whose weights are the output matrix). The
native layer stack runs those kernels' steps inside one call the profiler cannot see into, so the
profiled tokens run Python's loop over the same kernels instead (the same bits; each kernel its own
parallel region, as before the stack had one for all). A part
in a step may be slower than cold: the step's other reads (the weights, the head and every layer's
cache, each read once per step) share the caches with it. What a step spends beyond its parts (norms, rotary,
SwiGLU, the cache copy, allocation, dispatch, starting and ending the parallel regions, Python,
sampling) is the step less its parts in a step, give or take the profiler's own cost.

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


def decode_steps(model, context: int, new: int) -> tuple[float, dict]:
    """One greedy decode after `context` prompt tokens (the engine benchmark's decode of kvstore, in
    its default chunks), prefilled once for both of its figures:
    - the median gap between its first `new` generated tokens (the step);
    - for the `new` tokens after them, under torch.profiler and through Python's loop over the layers
      (the stack's one call hides its kernels from the profiler), the seconds per token that the
      parts' kernel calls take: {"products", "head", "attention"}, each the calls' own time on the
      calling thread (the profiler's self time), and "step_profiled", the steps' time under the
      profiler; "new", the tokens of each stretch: fewer than `new` where the context leaves less room
      (8,160 positions of SmolLM2's 8,192 leave 15 for each)."""
    import kvstore
    from kvstore.engine.sequence import DEFAULT_CHUNK
    from torch.profiler import ProfilerActivity, profile

    new = min(new, (model.config.max_context - context - 1) // 2)  # both stretches inside the context
    if new < 2:
        raise ValueError(f"a context of {context:,} leaves no room for decode steps in the model's "
                         f"{model.config.max_context:,} positions; measure a shorter one")
    head_shape = list(model.net.lm_head.data.shape)  # the packed output matrix, as the profiler records it
    seq = kvstore.Sequence(model, chunk_size=DEFAULT_CHUNK)
    tokens = None
    try:
        for _ in seq.extend(synthetic_prompt(context, model.config.vocab_size)):
            pass
        tokens = seq.generate(kvstore.SamplerSettings(), seed=0, max_new_tokens=2 * new)
        stamps = []
        for _ in range(new):
            next(tokens)
            stamps.append(time.perf_counter())
        stack, model.net._stack = model.net._stack, None  # the kernels called one by one: the same bits
        try:
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                start = time.perf_counter()
                for _ in range(new):
                    next(tokens)
                elapsed = time.perf_counter() - start
        finally:
            model.net._stack = stack
    finally:
        if tokens is not None:
            tokens.close()
        seq.close()
    spent = {"products": 0.0, "head": 0.0, "attention": 0.0}  # microseconds, all the steps
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key == "kvstore::qgemm":
            spent["head" if e.input_shapes and list(e.input_shapes[0]) == head_shape else "products"] += \
                e.self_cpu_time_total
        elif e.key == "kvstore::attention_rows":
            spent["attention"] += e.self_cpu_time_total
    step = statistics.median(b - a for a, b in zip(stamps, stamps[1:]))
    return step, {k: us / 1e6 / new for k, us in spent.items()} | {"step_profiled": elapsed / new, "new": new}


def synthetic_prompt(n: int, vocab: int) -> list[int]:
    return [(17 + 31 * i) % (vocab - 1) + 1 for i in range(n)]


def measure(model, contexts: list[int], threads: int, reps: int, new: int) -> dict:
    from .engine import net_weight_bytes

    net = model.net
    probe = bandwidth.ReadProbe(bandwidth.buffer_bytes(net_weight_bytes(net)))
    evict = probe.buffer.sum  # a read of a buffer at least 4x the last-level cache
    out = {"threads": threads, "contexts": contexts, "read_bytes_per_s": read_rates(probe, threads)}
    out.update(product_parts(net, reps, evict))
    out["at"] = {}
    for n in contexts:
        attention = attention_part(model, n, reps, evict)
        step, stepped = decode_steps(model, n, new)
        out["at"][str(n)] = {"attention": attention, "step_s": step, "in_step": stepped}
    return out


def table(r: dict) -> list[str]:
    bw = r["read_bytes_per_s"]
    lines = [f"read: {bw['all_threads'] / 1e9:.1f} GB/s on {r['threads']} threads, "
             f"{bw['one_thread'] / 1e9:.1f} GB/s on one", "",
             "| context | part | ms warm | ms cold | ms in a step | GB/s cold | GB/s in a step | cold, share of the "
             "2-thread read |",
             "|---|---|---|---|---|---|---|---|"]
    for n, at in r["at"].items():
        parts = [("products (every layer)", r["products"], "products"), ("head", r["head"], "head"),
                 ("attention", at["attention"], "attention")]
        for name, p, key in parts:
            rate, stepped = p["bytes"] / p["s"]["cold"], at["in_step"][key]
            stepped_rate = f"{p['bytes'] / stepped / 1e9:.1f}" if stepped else "–"  # none: another kernel ran it
            lines.append(f"| {n} | {name} | {p['s']['warm'] * 1e3:.2f} | {p['s']['cold'] * 1e3:.2f} | "
                         f"{stepped * 1e3:.2f} | {rate / 1e9:.1f} | {stepped_rate} | "
                         f"{100 * rate / bw['all_threads']:.0f} % |")
        warm, cold = (sum(p["s"][k] for _, p, _ in parts) for k in ("warm", "cold"))
        stepped = sum(at["in_step"][key] for _, _, key in parts)
        lines.append(f"| {n} | the parts together | {warm * 1e3:.2f} | {cold * 1e3:.2f} | {stepped * 1e3:.2f} | | | |")
        lines.append(f"| {n} | **a decode step** | {at['step_s'] * 1e3:.2f} | | "
                     f"{at['in_step']['step_profiled'] * 1e3:.2f} (profiled) | | | |")
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
    contexts = [int(n) for n in args.contexts.split(",")]
    if any(n < 1 or n > model.config.max_context - 5 for n in contexts):
        p.error(f"--contexts: each between 1 and {model.config.max_context - 5:,} (the model holds "
                f"{model.config.max_context:,} positions, and the steps measured need a few)")
    with torch.inference_mode():
        r = measure(model, contexts, args.threads, args.reps, args.new)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_parts.json").write_text(json.dumps(r, indent=1) + "\n")
    print("\n".join(table(r)), file=sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
