"""Engine speed: kvstore against Hugging Face transformers and llama.cpp on the same model file.

    python -m benchmarks.engine            # this phase alone (kvstore both ways and HF; no llama.cpp)
    python -m benchmarks.engine --quick    # CI-sized
    python -m benchmarks.engine --no-hf --llama --contexts 1024,2048 --reps 5   # kvstore against llama.cpp

The engines (`Ours`: a kvstore Model, on the GGUF's blocks as stored or on bfloat16; `HF`:
transformers in bfloat16; `benchmarks.llama_peer.LlamaCpp`) each have `decode(prompt, n_new)`,
`prefill(prompt)`, `load_s`, `weight_bytes` (what one decode step reads of the weights) and `about`
(how it holds the model, for the report). `measure` alternates them (A B C, then C B A, ...) so
that drift in the machine's speed hits all alike, each measurement after waiting (up to max_wait s)
for the CPUs to be idle. Per repetition:
- the read bandwidth (`benchmarks.bandwidth`: a plain read of a buffer the weights' size), so
  each decode rate can be set against the limit the memory puts on it, measured beside it;
- decode at each context n: greedy, `n_new` new tokens after a prompt of n tokens, tok/s from the
  first new token to the last (the prompt's prefill is not in it; HF: `generate` with a streamer).
  "steady" is 1 / the median time between two tokens, which a stray interruption does not move;
- prefill: one call that fills the cache with `prefill_len` tokens and yields the next token's
  logits (kvstore: chunked at its default chunk, and again in one chunk; HF: one forward;
  llama.cpp: `eval` in its batches of 512).
`phase` turns the repetitions into medians, spreads, ratios paired per repetition and limits.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from . import bandwidth
from .store import spread

OUT = Path(__file__).resolve().parent / "out"
DECODE_CONTEXTS, DECODE_NEW, PREFILL_LEN = (1024, 2048, 8160), 32, 2048  # 8,160 + 32 = the model's 8,192
OURS = "kvstore"  # the engine the ratios are of: kvstore as it loads by default (the GGUF's blocks as stored)
OURS_DENSE = "kvstore bf16"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short contexts, 2 repetitions (CI)")
    p.add_argument("--reps", type=int, help="repetitions per measurement (default 5, --quick 2)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default="smollm2", help="alias or .gguf path (HF loads the same file)")
    p.add_argument("--no-hf", action="store_true", help="leave HF transformers out")
    p.add_argument("--llama", action="store_true", help="llama.cpp too (llama-cpp-python, when installed)")
    p.add_argument("--contexts", help="decode contexts, comma-separated (default 1024,2048,8160; --quick: shorter)")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from kvstore.engine.sequence import DEFAULT_CHUNK

    from . import report
    from .__main__ import FULL, QUICK, load_kvstore

    cfg = dict(QUICK if args.quick else FULL)
    if args.reps:
        cfg["engine_reps"] = args.reps
    models, load_s = load_kvstore(args.model, None)
    engines = {name: Ours(m, DEFAULT_CHUNK, load_s[name]) for name, m in models.items()}
    if args.contexts:
        cfg["contexts"] = [int(n) for n in args.contexts.split(",")]
    if not args.no_hf:
        engines["hf"] = HF(Path(models[OURS].source))
    if args.llama:
        from . import llama_peer

        llama, why = llama_peer.load(Path(models[OURS].source), args.threads, models[OURS].config.max_context)
        if llama is None:
            p.error(f"llama.cpp is not measured: {why}")
        engines["llama.cpp"] = llama
    out = phase(engines, models[OURS], cfg, log=lambda m: print(m, file=sys.stderr))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "engine.json").write_text(json.dumps(out, indent=1) + "\n")
    print("\n".join(report.engine_tables(out)))
    return 0


# -- the measurement ---------------------------------------------------------------------------------
def measure(engines: dict, prompt: list[int], reps: int, max_wait: float, contexts: list[int], n_new: int,
            prefill_len: int, probe: bandwidth.ReadProbe | None = None, log=print):
    """Alternate the engines over `reps` repetitions: (results, greedy tokens at the first context,
    CPUs others used before each measurement, bytes/s read per repetition)."""
    results = {name: {"decode": {str(n): {"tok_s": [], "steady_tok_s": []} for n in contexts}, "prefill_s": []}
               for name in engines}
    tokens: dict[str, list[int]] = {}
    busy: list[float] = []
    read: list[float] = []
    order = list(engines)
    for name in order:  # warm-up: first-call allocations and kernel selection, not measured
        engines[name].decode(prompt[:64], 4)
        engines[name].prefill(prompt[:256])
    for rep in range(reps):
        turn = order if rep % 2 == 0 else order[::-1]
        if probe is not None:
            busy.append(wait_idle(max_wait))
            read.append(probe.read_bytes_per_s())
        for n in contexts:
            for name in turn:
                busy.append(wait_idle(max_wait))
                stamps, toks = engines[name].decode(prompt[:n], n_new)
                gaps = [b - a for a, b in zip(stamps, stamps[1:])]
                at = results[name]["decode"][str(n)]
                at["tok_s"].append(len(gaps) / sum(gaps))
                at["steady_tok_s"].append(1 / statistics.median(gaps))
                if n == contexts[0]:
                    tokens.setdefault(name, toks)
        for name in turn[::-1]:
            busy.append(wait_idle(max_wait))
            results[name]["prefill_s"].append(engines[name].prefill(prompt[:prefill_len]))
            if isinstance(engines[name], Ours):  # the engine alone: the whole prompt in one forward, like HF
                results[name].setdefault("prefill_one_chunk_s", []).append(
                    engines[name].prefill(prompt[:prefill_len], chunk=prefill_len))
        bw = f"read {read[-1] / 1e9:.1f} GB/s; " if read else ""
        log(f"  rep {rep + 1}/{reps}: {bw}" + "; ".join(
            f"{name} " + " ".join(f"{r['decode'][str(n)]['tok_s'][-1]:.1f}" for n in contexts)
            + f" tok/s, prefill {r['prefill_s'][-1]:.2f} s" for name, r in results.items()))
    return results, tokens, busy, read


def phase(engines: dict, model, cfg: dict, log=print) -> dict:
    """The engine phase: measure, then medians (min–max), kvstore ÷ each other engine paired per
    repetition, and each decode rate against its bandwidth limit."""
    from kvstore.engine.sequence import DEFAULT_CHUNK

    contexts, n_new, prefill_len = cfg["contexts"], cfg["engine_new"], cfg["prefill"]
    rng = random.Random(0)
    prompt = [rng.randrange(100, model.config.vocab_size) for _ in range(max(*contexts, prefill_len))]
    weight_bytes = {name: e.weight_bytes for name, e in engines.items()}
    probe = bandwidth.ReadProbe(bandwidth.buffer_bytes(max(weight_bytes.values())))
    raw, tokens, busy, read = measure(engines, prompt, cfg["engine_reps"], cfg["max_wait"], contexts, n_new,
                                      prefill_len, probe, log)
    kv_per_token = kv_bytes_per_token(model)
    bw = statistics.median(read)
    out = {"contexts": list(contexts), "decode_new": n_new, "prefill_tokens": prefill_len, "chunk": DEFAULT_CHUNK,
           "kv_bytes_per_token": kv_per_token,
           "bandwidth": {"bytes": probe.nbytes, "read_bytes_per_s": spread(read), "method": "torch.sum over float32"},
           "others_busy_cpus": [round(b, 2) for b in busy], "raw": raw, "engines": {}, "ratios": {},
           "greedy_equal_prefix": {}}
    for name, r in raw.items():
        e = engines[name]
        lim = bandwidth.limits(bw, e.weight_bytes, kv_per_token, contexts, n_new)
        out["engines"][name] = {
            "about": e.about, "weights": getattr(e, "weights", None), "weight_bytes": e.weight_bytes, "load_s": e.load_s,
            "decode": {n: {k: spread(v) for k, v in d.items()} | {
                "limit_tok_s": lim[n], "limit_pct": bandwidth.share_pct(statistics.median(d["tok_s"]), lim[n])}
                for n, d in r["decode"].items()},
            **{k: spread(v) for k, v in r.items() if k != "decode"}}
    ours = raw.get(OURS)
    for peer in [n for n in raw if n != OURS and ours is not None]:
        theirs = raw[peer]
        q = {"decode": {n: spread([a / b for a, b in zip(ours["decode"][n]["tok_s"], theirs["decode"][n]["tok_s"])])
                        for n in ours["decode"]},
             "prefill": spread([b / a for a, b in zip(ours["prefill_s"], theirs["prefill_s"])])}
        if "prefill_one_chunk_s" in ours:
            q["prefill_one_chunk"] = spread([b / a for a, b in zip(ours["prefill_one_chunk_s"], theirs["prefill_s"])])
        out["ratios"][peer] = q
        out["greedy_equal_prefix"][peer] = next(
            (i for i, (a, b) in enumerate(zip(tokens[OURS], tokens[peer])) if a != b), len(tokens[OURS]))
    return out


def kv_bytes_per_token(model) -> int:
    """K and V of every layer for one token, in the model's dtype (bfloat16: llama.cpp's f16 cache is as big)."""
    c = model.config
    return c.n_layers * 2 * c.n_kv_heads * c.head_dim * model.dtype.itemsize


def net_weight_bytes(net) -> int:
    """Bytes of the weights one decode step reads: every tensor and block-quantized matrix the Net
    holds, each once (a tied head is the embedding), less an untied embedding table (a step reads
    one row of it) and the rotary tables."""
    import dataclasses

    from kvstore.engine.quant import Packed

    seen: set[int] = set()
    skip = {"inv_freq"} | ({"embed"} if getattr(net, "embed", None) is not getattr(net, "lm_head", None) else set())

    def size(x) -> int:
        if isinstance(x, Packed):
            x = x.data
        if isinstance(x, torch.Tensor):
            if id(x) in seen:
                return 0
            seen.add(id(x))
            return x.numel() * x.element_size()
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return sum(size(getattr(x, f.name)) for f in dataclasses.fields(x))
        if isinstance(x, (list, tuple)):
            return sum(size(v) for v in x)
        if isinstance(x, dict):
            return sum(size(v) for v in x.values())
        return 0

    return sum(size(v) for k, v in vars(net).items() if not k.startswith("_") and k not in skip)


# -- the engines ---------------------------------------------------------------------------------------
class Ours:
    def __init__(self, model, chunk: int, load_s: float):
        self.model, self.chunk, self.load_s = model, chunk, load_s
        self.weights = model.weights
        self.weight_bytes = net_weight_bytes(model.net)
        self.about = ("the GGUF's blocks as stored (kvstore's integer kernels)" if model.weights == "stored" else
                      f"weights held as {model.weights}" if model.weights != "dense" else
                      f"weights dequantized to {model.dtype_name}") + f", {model.dtype_name} KV cache"

    def decode(self, prompt: list[int], n_new: int) -> tuple[list[float], list[int]]:
        import kvstore

        seq = kvstore.Sequence(self.model, chunk_size=self.chunk)
        for _ in seq.extend(prompt):
            pass
        stamps, toks = [], []
        for ev in seq.generate(kvstore.SamplerSettings(), seed=0, max_new_tokens=n_new):
            stamps.append(time.perf_counter())
            toks.append(ev.token)
        seq.close()  # its memory goes to the next sequence
        return stamps, toks

    def prefill(self, prompt: list[int], chunk: int | None = None) -> float:
        import kvstore

        seq = kvstore.Sequence(self.model, tokens=prompt, chunk_size=chunk or self.chunk)
        t0 = time.perf_counter()
        seq.next_logits()
        elapsed = time.perf_counter() - t0
        seq.close()
        return elapsed


class HF:
    def __init__(self, gguf_path: Path, dtype: torch.dtype = torch.bfloat16):
        import logging

        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        logging.getLogger("transformers").setLevel(logging.ERROR)
        t0 = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=dtype)
        self.load_s = time.perf_counter() - t0
        self.model.eval()
        gc = self.model.generation_config
        gc.eos_token_id = None  # always generate all n_new tokens, like kvstore without stop ids
        gc.pad_token_id = 0
        unique = {id(p): p for p in self.model.parameters()}.values()  # a tied head once
        self.weight_bytes = sum(p.numel() * p.element_size() for p in unique)
        self.about = f"weights dequantized to {str(dtype).removeprefix('torch.')}, `generate` with its DynamicCache"

    @torch.inference_mode()
    def decode(self, prompt: list[int], n_new: int) -> tuple[list[float], list[int]]:
        streamer = Stamps()
        ids = torch.tensor([prompt])
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                                  do_sample=False, streamer=streamer)
        return streamer.stamps, out[0, len(prompt):].tolist()

    @torch.inference_mode()
    def prefill(self, prompt: list[int]) -> float:
        ids = torch.tensor([prompt])
        t0 = time.perf_counter()
        self.model(ids, use_cache=True, logits_to_keep=1)
        return time.perf_counter() - t0


class Stamps:
    """A `generate` streamer that records when each new token arrives (the first put is the prompt)."""

    def __init__(self):
        self.stamps: list[float] = []
        self.seen_prompt = False

    def put(self, value) -> None:
        if self.seen_prompt:
            self.stamps.append(time.perf_counter())
        self.seen_prompt = True

    def end(self) -> None:
        pass


# -- a quiet machine -----------------------------------------------------------------------------------
def wait_idle(max_wait: float, threshold: float = 0.1) -> float:
    """Wait (up to max_wait s) until other processes use under `threshold` CPUs; returns what they used.

    Other jobs on a 2-core machine turn a measurement into noise (3-20x swings), so we measure in the
    quiet moments and record how busy the machine was."""
    deadline = time.monotonic() + max_wait
    while True:
        used = busy_cpus(0.3)
        if used < threshold or time.monotonic() >= deadline:
            return used
        time.sleep(0.7)


def busy_cpus(window: float) -> float:
    """CPUs busy over `window` seconds, from /proc/stat (0 where it cannot be read)."""
    def sample() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    try:
        t0, i0 = sample()
        time.sleep(window)
        t1, i1 = sample()
    except (OSError, ValueError, IndexError):
        return 0.0
    return (os.cpu_count() or 1) * (1 - (i1 - i0) / max(1, t1 - t0))


if __name__ == "__main__":
    raise SystemExit(main())
