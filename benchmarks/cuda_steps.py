"""What batch invariance costs on a CUDA device: decode steps of many sessions where each session's
rows are computed apart.

    python -m benchmarks.cuda_steps [--sessions 1,2,4,8,16] [--context 512] [--steps 32] [--device cuda]

Off the CPU's native kernels (`Model.row_invariant` is false: CUDA, `KVSTORE_NATIVE=0`, float32) a
step keeps every session's bits (contract C9) by running each session's products, attention and
head row as that session alone would, inside the one forward (`Model.feed_rows`): the weights are
read once per session, not once per step. This measures the aggregate decode rate of N sessions at
one context, beside one session's, in the library's step (`feed_rows`, then `head`, then the
greedy next token on the host, as the engine samples): a ratio near 1 is that cost. Every point is
run once untimed first, then `--reps` times alternated with the others; the median is reported.

The model has SmolLM2-135M-Instruct's shape (30 layers, hidden 576, 9 query and 3 KV heads of 64,
MLP 1536, a vocabulary of 49,152, tied embeddings) and random weights in bfloat16: a step's time
depends on the shapes alone, and the GPU machines reach no model hub. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
             tie_word_embeddings=True)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def model_folder(folder: Path, layers: int, vocab: int) -> Path:
    """A Hugging Face folder at SmolLM2-135M's shape (`layers`, `vocab` may be cut for a quick run),
    random weights, a word-level tokenizer of `vocab` entries (ids are fed directly)."""
    import transformers
    from tokenizers import Tokenizer, models

    cfg = transformers.LlamaConfig(**{**SHAPE, "num_hidden_layers": layers, "vocab_size": vocab,
                                      "bos_token_id": 0, "eos_token_id": 0})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(folder)
    words = SPECIAL + [f"w{i}" for i in range(vocab - len(SPECIAL))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=SPECIAL[0]))
    tok.add_special_tokens(SPECIAL)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": SPECIAL[0], "add_bos_token": False}))
    return folder


def rate(model, n: int, context: int, steps: int, warm: int = 3) -> float:
    """Aggregate decode tok/s of `n` sessions of `context` tokens each, stepped together."""
    gen = torch.Generator().manual_seed(n)
    caches, last = [], []
    for _ in range(n):
        cache = model.new_cache(capacity=context + warm + steps + 1)
        ids = torch.randint(len(SPECIAL), model.config.vocab_size, (context,), generator=gen).tolist()
        for a in range(0, context, 512):
            model.feed(ids[a:a + 512], a, cache)
        caches.append(cache)
        last.append(ids[-1])

    def step(pos: int) -> list[int]:
        hidden = model.feed_rows([([tok], pos, cache) for tok, cache in zip(last, caches)])
        return model.head(hidden).argmax(-1).tolist()  # on the host: the engine samples there

    pos = context
    for _ in range(warm):
        last, pos = step(pos), pos + 1
    start = time.perf_counter()
    for _ in range(steps):
        last, pos = step(pos), pos + 1
    seconds = time.perf_counter() - start
    for cache in caches:
        cache.release()
    return n * steps / seconds


def run(sessions: list[int], context: int, steps: int, device: str, layers: int = 30, vocab: int = 49152,
        reps: int = 3) -> dict:
    import kvstore

    with tempfile.TemporaryDirectory() as tmp:
        model = kvstore.load_model(model_folder(Path(tmp) / "model", layers, vocab), dtype="bfloat16",
                                   device=device, weights="dense")
    assert not model.row_invariant, "the model computes every row alone here: nothing to measure"
    for n in sessions:  # untimed: the device's and the libraries' first calls at each shape
        rate(model, n, context, 2)
    runs = {n: [] for n in sessions}
    for _ in range(reps):  # the points alternate, so a slow spell of the machine touches them all
        for n in sessions:
            runs[n].append(rate(model, n, context, steps))
    rates = {n: statistics.median(r) for n, r in runs.items()}
    one = rates[sessions[0]]
    name = torch.cuda.get_device_name() if device == "cuda" else device
    return {"device": name, "torch": torch.__version__, "context": context, "steps": steps, "layers": layers,
            "reps": reps, "tok_s": {str(n): round(r, 1) for n, r in rates.items()},
            "tok_s_runs": {str(n): [round(x, 1) for x in r] for n, r in runs.items()},
            "vs_first": {str(n): round(r / one, 2) for n, r in rates.items()}}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", default="1,2,4,8,16", help="session counts, comma-separated")
    ap.add_argument("--context", type=int, default=512, help="tokens in each session's cache")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per point")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--layers", type=int, default=30, help="layers (fewer for a quick check)")
    ap.add_argument("--vocab", type=int, default=49152, help="vocabulary (smaller for a quick check)")
    ap.add_argument("--reps", type=int, default=3, help="timed runs of each point, alternated; the median is kept")
    args = ap.parse_args(argv)
    out = run([int(n) for n in args.sessions.split(",")], args.context, args.steps, args.device, args.layers,
              args.vocab, args.reps)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
