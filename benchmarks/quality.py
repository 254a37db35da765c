"""Perplexity of the default model on a fixed held-in text, per engine: what running the GGUF's
blocks as stored costs in quality, measured.

    python -m benchmarks.quality            # ~20k tokens in windows of the model's context
    python -m benchmarks.quality --quick    # CI-sized: 2,048 tokens in windows of 512

The text is the standard library's own docstrings (`kvstore.train.corpus.document`, what the
examples use): the first `tokens` ids of it, as kvstore's tokenizer encodes it, the same ids for
every engine. They are cut into windows of `window` tokens (the model's context unless told),
one after the other; each window starts from an empty cache, so each engine sees exactly the same
contexts. In a window of k tokens the logits at position i predict token i + 1: k - 1 predictions,
scored as -log softmax(logits)[next] in float64. Perplexity = exp(the mean over all windows).

Engines (each a "scorer": `logits(ids)` yields float32 `[rows, vocab]` for the window's positions
in order, chunk by chunk so no window's full logits are held at once):
- `kvstore` (the model as it loads by default: the GGUF's blocks as stored) and `kvstore bf16`
  (weights dequantized to bfloat16): `Model.forward` over the window in the default prefill chunks;
- `llama.cpp`: the same GGUF through llama-cpp-python, every position's logits in its batches;
- `hf f32`: Hugging Face transformers on the GGUF's weights dequantized to float32, one forward
  per window (the reference: the model's own arithmetic, no rounding to bfloat16).
Targets: kvstore's within 1 % of llama.cpp's perplexity and within 2 % of HF float32's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Iterable, Iterator

import torch

OUT = Path(__file__).resolve().parent / "out"
FULL = {"tokens": 20_000, "window": None}  # None: the model's context
QUICK = {"tokens": 2048, "window": 512}
TEXT_CHARS = 200_000  # enough docstrings for FULL's tokens
TARGETS = {"llama.cpp": 1.0, "hf f32": 2.0}  # kvstore's perplexity within this many % of the engine's


# -- the text and its windows ------------------------------------------------------------------------
def text_ids(tokenizer, n: int) -> list[int]:
    """The first n token ids of the standard library's docstrings (all of them if fewer)."""
    from kvstore.train.corpus import document

    return tokenizer.encode(document(TEXT_CHARS), add_bos=False)[:n]


def windows(n_tokens: int, window: int) -> list[tuple[int, int]]:
    """[start, end) of consecutive windows of `window` tokens (the last one shorter), each of at
    least two tokens (one prediction)."""
    bounds = [(a, min(a + window, n_tokens)) for a in range(0, n_tokens, window)]
    return [(a, b) for a, b in bounds if b - a >= 2]


def nll(chunks: Iterable, targets: list[int]) -> tuple[float, int]:
    """(sum of -log p(next token), predictions) over a window: `chunks` yields the logits rows of its
    positions in order (torch or numpy, `[rows, vocab]`), `targets` is the window's ids; the last
    position predicts nothing."""
    total, row = 0.0, 0
    for chunk in chunks:
        logits = torch.as_tensor(chunk).to(torch.float64)
        logits = logits[: max(0, len(targets) - 1 - row)]  # rows that have a next token
        if logits.shape[0]:
            nxt = torch.tensor(targets[row + 1: row + 1 + logits.shape[0]])
            logp = torch.log_softmax(logits, dim=-1).gather(1, nxt[:, None])
            total -= float(logp.sum())
        row += chunk.shape[0]
    assert row == len(targets), f"{row} logits rows for {len(targets)} tokens"
    return total, len(targets) - 1


def perplexity(scorer, ids: list[int], window: int) -> dict:
    """The scorer's perplexity over `ids` in windows of `window` tokens, and how long it took."""
    total, count = 0.0, 0
    start = time.perf_counter()
    for a, b in windows(len(ids), window):
        s, k = nll(scorer.logits(ids[a:b]), ids[a:b])
        total, count = total + s, count + k
    mean = total / count
    return {"ppl": math.exp(mean), "nll": mean, "predictions": count, "seconds": time.perf_counter() - start}


# -- the scorers --------------------------------------------------------------------------------------
class KvstoreScorer:
    def __init__(self, model, chunk: int | None = None):
        from kvstore.engine.sequence import DEFAULT_CHUNK

        self.model, self.chunk = model, chunk or DEFAULT_CHUNK

    def logits(self, ids: list[int]) -> Iterator[torch.Tensor]:
        from kvstore.engine.sequence import chunk_bounds

        cache = self.model.new_cache(len(ids))
        try:
            for a, b in chunk_bounds(0, len(ids), self.chunk):
                yield self.model.forward(ids[a:b], a, cache, last_only=False)  # [b - a, vocab] float32
        finally:
            cache.release()


class HFScorer:
    """A transformers causal LM: one forward per window, the head applied `rows` positions at a time."""

    def __init__(self, hf_model, rows: int = 512):
        self.model, self.rows = hf_model, rows

    @torch.inference_mode()
    def logits(self, ids: list[int]) -> Iterator[torch.Tensor]:
        hidden = self.model.model(torch.tensor([ids]), use_cache=False).last_hidden_state[0]  # [T, hidden]
        for a in range(0, hidden.shape[0], self.rows):
            yield self.model.lm_head(hidden[a:a + self.rows]).float()


class LlamaScorer:
    def __init__(self, peer):
        self.peer = peer

    def logits(self, ids: list[int]):
        return self.peer.logits(ids)


# -- the phase -----------------------------------------------------------------------------------------
def run(models: dict, ids: list[int], window: int, llama=None, hf32=None, log=print) -> dict:
    """Perplexity per engine (`models`: kvstore models by name; `llama`: a benchmarks.llama_peer.LlamaCpp
    or None; `hf32`: a float32 transformers model or None), and kvstore's against each peer."""
    scorers = {name: KvstoreScorer(m) for name, m in models.items()}
    about = {name: f"{m.weights} weights, {m.dtype_name}" for name, m in models.items()}
    if llama is not None:
        scorers["llama.cpp"], about["llama.cpp"] = LlamaScorer(llama), llama.about
    if hf32 is not None:
        scorers["hf f32"], about["hf f32"] = HFScorer(hf32), "transformers, weights dequantized to float32"
    out = {"tokens": len(ids), "window": window, "windows": len(windows(len(ids), window)),
           "text": "the standard library's docstrings (kvstore.train.corpus), Python "
                   f"{sys.version_info.major}.{sys.version_info.minor}",
           "ids_sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16],
           "engines": {}, "targets_pct": TARGETS, "vs": {}}
    for name, scorer in scorers.items():
        out["engines"][name] = perplexity(scorer, ids, window) | {"about": about[name]}
        e = out["engines"][name]
        log(f"  {name}: perplexity {e['ppl']:.4f} over {e['predictions']:,} predictions ({e['seconds']:.0f} s)")
    ours = out["engines"].get("kvstore")
    for peer in [n for n in out["engines"] if n != "kvstore" and ours is not None]:
        out["vs"][peer] = 100.0 * (ours["ppl"] / out["engines"][peer]["ppl"] - 1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2,048 tokens in windows of 512 (CI)")
    p.add_argument("--tokens", type=int, help="tokens of text (default 20,000; --quick 2,048)")
    p.add_argument("--window", type=int, help="window length (default: the model's context; --quick 512)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default="smollm2", help="alias or .gguf path")
    p.add_argument("--no-llama", action="store_true", help="leave llama.cpp out")
    p.add_argument("--no-hf", action="store_true", help="leave HF transformers (float32) out")
    p.add_argument("--out", type=Path, default=OUT, help="where quality.json goes (default benchmarks/out)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from . import llama_peer
    from .__main__ import git_commit, load_kvstore
    from .engine import HF

    cfg = dict(QUICK if args.quick else FULL)
    models, _ = load_kvstore(args.model, None)
    first = next(iter(models.values()))
    gguf = Path(first.source)
    llama = None
    if not args.no_llama:
        llama, why = llama_peer.load(gguf, args.threads, first.config.max_context)
        if llama is None:
            print(f"llama.cpp not measured: {why}", file=sys.stderr)
    hf32 = None if args.no_hf else HF(gguf, torch.float32).model
    ids = text_ids(first.tokenizer, args.tokens or cfg["tokens"])
    out = run(models, ids, args.window or cfg["window"] or first.config.max_context, llama, hf32,
              log=lambda m: print(m, file=sys.stderr))
    out["commit"] = git_commit()  # a run that publishes these figures beside its own says whether they match
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quality.json").write_text(json.dumps(out, indent=1) + "\n")
    from . import report

    print("\n".join(report.quality_table(out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
