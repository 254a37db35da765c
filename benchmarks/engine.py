"""Engine speed, kvstore vs Hugging Face transformers, on the same SmolLM2 weights.

    python -m benchmarks.engine            # full run (7 repetitions, a few minutes)
    python -m benchmarks.engine --quick    # CI-sized run (3 repetitions, under two minutes)

Both engines load SmolLM2-135M-Instruct in bfloat16 on the CPU with the same thread count; then the
measurements alternate between them (kvstore, HF, then HF, kvstore, ...) so that drift in the
machine's speed hits both alike, and each waits (up to --max-wait s) for the CPUs to be idle.
Per engine, median and spread (min-max) of:
- decode tok/s: greedy, 64 new tokens after a 1,024-token prompt, timed from the first new token to
  the last (the prompt's prefill is not in it; HF: `generate` with a streamer). "steady" is
  1 / the median time between two tokens, which a stray interruption does not move;
- prefill s: one forward of 2,048 tokens that fills the cache and yields the next token's logits
  (kvstore: chunked at --chunk tokens, and again in one chunk; HF: `model(ids, use_cache=True,
  logits_to_keep=1)`);
- load s: `kvstore.load_model` / `AutoModelForCausalLM.from_pretrained`, once per process.
The ratios are medians of the per-repetition ratios (kvstore and HF measured back to back).
Figures land in benchmarks/out/engine.json and engine.md, and are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parent / "out"
DECODE_PROMPT, DECODE_NEW, PREFILL_LEN = 1024, 64, 2048
METRICS = ("decode_tok_s", "decode_steady_tok_s", "prefill_s")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import kvstore
    from kvstore.engine.sequence import DEFAULT_CHUNK

    chunk = args.chunk or DEFAULT_CHUNK
    t0 = time.perf_counter()
    model = kvstore.load_model(args.model, dtype="bfloat16")
    engines = {"kvstore": Ours(model, chunk, time.perf_counter() - t0)}
    if not args.no_hf:
        engines["hf"] = HF(Path(model.source))
    rng = random.Random(0)
    prompt = [rng.randrange(100, model.config.vocab_size) for _ in range(max(DECODE_PROMPT, PREFILL_LEN))]
    results, tokens, busy = measure(engines, prompt, args.reps, args.max_wait)
    report = {
        "env": environment(args.threads, chunk, args.reps) | {"others_busy_cpus": [round(b, 2) for b in busy]},
        "engines": {name: summarize(r) | {"load_s": engines[name].load_s} for name, r in results.items()},
        "raw": results,
    }
    if "hf" in results:
        report["ratios"] = ratios(results)
        report["greedy_tokens_equal_prefix"] = next(
            (i for i, (a, b) in enumerate(zip(tokens["kvstore"], tokens["hf"])) if a != b), DECODE_NEW)
    table = markdown(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "engine.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "engine.md").write_text(table)
    print(table)
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="3 repetitions, short idle waits (CI)")
    p.add_argument("--reps", type=int, help="repetitions of each measurement per engine (default 7, --quick 3)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--chunk", type=int, default=None, help="kvstore prefill chunk size (default: the library's)")
    p.add_argument("--model", default="smollm2", help="alias or .gguf path (HF loads the same file)")
    p.add_argument("--no-hf", action="store_true", help="measure kvstore only")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--max-wait", type=float, default=None,
                   help="before each measurement, wait up to this many seconds for other processes to leave "
                        "the CPUs idle (default 120, --quick 5; 0: never wait)")
    args = p.parse_args(argv)
    args.reps = args.reps or (3 if args.quick else 7)
    if args.max_wait is None:
        args.max_wait = 5.0 if args.quick else 120.0
    return args


def measure(engines: dict, prompt: list[int], reps: int, max_wait: float):
    """Alternate the engines over `reps` repetitions: (results, greedy tokens, CPUs others used)."""
    results = {name: {m: [] for m in METRICS} for name in engines}
    tokens: dict[str, list[int]] = {}
    busy: list[float] = []
    order = list(engines)
    for name in order:  # warm-up: first-call allocations and kernel selection, not measured
        engines[name].decode(prompt[:64], 4)
        engines[name].prefill(prompt[:256])
    for rep in range(reps):
        for name in order if rep % 2 == 0 else order[::-1]:
            busy.append(wait_idle(max_wait))
            stamps, toks = engines[name].decode(prompt[:DECODE_PROMPT], DECODE_NEW)
            gaps = [b - a for a, b in zip(stamps, stamps[1:])]
            results[name]["decode_tok_s"].append(len(gaps) / sum(gaps))
            results[name]["decode_steady_tok_s"].append(1 / statistics.median(gaps))
            tokens.setdefault(name, toks)
        for name in order[::-1] if rep % 2 == 0 else order:
            busy.append(wait_idle(max_wait))
            results[name]["prefill_s"].append(engines[name].prefill(prompt[:PREFILL_LEN]))
            if isinstance(engines[name], Ours):  # the engine alone: the whole prompt in one forward, like HF
                results[name].setdefault("prefill_one_chunk_s", []).append(
                    engines[name].prefill(prompt[:PREFILL_LEN], chunk=PREFILL_LEN))
        print(f"rep {rep + 1}/{reps}: " + "  ".join(
            f"{n} {r['decode_tok_s'][-1]:.1f} tok/s (steady {r['decode_steady_tok_s'][-1]:.1f}), "
            f"prefill {r['prefill_s'][-1]:.3f} s" for n, r in results.items()), file=sys.stderr)
    return results, tokens, busy


class Ours:
    def __init__(self, model, chunk: int, load_s: float):
        self.model, self.chunk, self.load_s = model, chunk, load_s

    def decode(self, prompt: list[int], n_new: int) -> tuple[list[float], list[int]]:
        import kvstore

        seq = kvstore.Sequence(self.model, chunk_size=self.chunk)
        for _ in seq.extend(prompt):
            pass
        stamps, toks = [], []
        for ev in seq.generate(kvstore.SamplerSettings(), seed=0, max_new_tokens=n_new):
            stamps.append(time.perf_counter())
            toks.append(ev.token)
        return stamps, toks

    def prefill(self, prompt: list[int], chunk: int | None = None) -> float:
        import kvstore

        seq = kvstore.Sequence(self.model, tokens=prompt, chunk_size=chunk or self.chunk)
        t0 = time.perf_counter()
        seq.next_logits()
        return time.perf_counter() - t0


class HF:
    def __init__(self, gguf_path: Path):
        import logging

        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        logging.getLogger("transformers").setLevel(logging.ERROR)
        t0 = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                          dtype=torch.bfloat16)
        self.load_s = time.perf_counter() - t0
        self.model.eval()
        gc = self.model.generation_config
        gc.eos_token_id = None  # always generate all n_new tokens, like kvstore without stop ids
        gc.pad_token_id = 0

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


def summarize(r: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {k: {"median": statistics.median(v), "min": min(v), "max": max(v)} for k, v in r.items()}


def ratios(results: dict) -> dict[str, dict[str, float]]:
    """kvstore / HF speed per repetition (back-to-back pairs): median, min, max."""
    ours, hf = results["kvstore"], results["hf"]
    pairs = {
        "decode": [a / b for a, b in zip(ours["decode_tok_s"], hf["decode_tok_s"])],
        "decode_steady": [a / b for a, b in zip(ours["decode_steady_tok_s"], hf["decode_steady_tok_s"])],
        "prefill": [b / a for a, b in zip(ours["prefill_s"], hf["prefill_s"])],
        "prefill_one_chunk": [b / a for a, b in zip(ours["prefill_one_chunk_s"], hf["prefill_s"])],
    }
    return summarize(pairs)


def environment(threads: int, chunk: int, reps: int) -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, check=False).stdout.strip()
    except OSError:
        commit = ""
    import transformers

    cpu = next((ln.split(":", 1)[1].strip() for ln in _cpuinfo() if ln.startswith("model name")), platform.processor())
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": commit, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(), "cpu": cpu,
            "cores": os.cpu_count(), "threads": threads, "dtype": "bfloat16", "chunk": chunk, "reps": reps,
            "decode": f"{DECODE_PROMPT}-token prompt, {DECODE_NEW} new tokens, greedy",
            "prefill": f"{PREFILL_LEN} tokens"}


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def markdown(report: dict) -> str:
    env, eng = report["env"], report["engines"]

    def cell(stats: dict, fmt: str, suffix: str = "") -> str:
        return f"{stats['median']:{fmt}}{suffix} ({stats['min']:{fmt}}–{stats['max']:{fmt}})"

    lines = [f"SmolLM2-135M-Instruct (Q4_1 GGUF → bf16), {env['threads']} threads, {env['cpu']}, "
             f"torch {env['torch']}, transformers {env['transformers']}, kvstore chunk {env['chunk']}, "
             f"commit {env['commit']}; {env['reps']} repetitions, median (min–max)", "",
             "| engine | decode tok/s | decode tok/s, steady | prefill 2,048 tok, s | load, s |",
             "|---|---|---|---|---|"]
    for name, e in eng.items():
        lines.append(f"| {name} | {cell(e['decode_tok_s'], '.1f')} | {cell(e['decode_steady_tok_s'], '.1f')} "
                     f"| {cell(e['prefill_s'], '.3f')} | {e['load_s']:.1f} |")
    if "ratios" in report:
        r = report["ratios"]
        lines.append(f"| **kvstore ÷ hf** (target: decode ≥ 2, prefill ≥ 1) "
                     f"| **{cell(r['decode'], '.2f', '×')}** | {cell(r['decode_steady'], '.2f', '×')} "
                     f"| **{cell(r['prefill'], '.2f', '×')}** | |")
        lines += ["", f"Greedy tokens equal for the first {report['greedy_tokens_equal_prefix']} of {DECODE_NEW} "
                      "(bf16 kernels round differently, so a divergence is not a bug by itself)."]
    busy = env["others_busy_cpus"]
    if busy and max(busy) >= 0.1:
        lines += ["", f"Other processes were using up to {max(busy):.1f} CPUs before some measurements: "
                      "expect noise."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
