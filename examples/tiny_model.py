"""Train kvstore's tiny model, then use it: its text ends where a real model's would.

Trains the tiny model on the standard library's docstrings (`python -m kvstore.train`, about half
a minute on one CPU thread; `--model FOLDER` takes one trained before), then, in a temporary store:

1. completes the start of a docstring raw, until a stop string (a blank line) or the model's own
   end-of-text token;
2. asks it about standard-library names in a chat: each reply (a docstring, as it learned them)
   ends at its end-of-turn token or at the length limit;
3. cuts a reply short, closes the session, reopens it from disk and finishes the reply: the
   tokens equal the uninterrupted reply's (contract C1).

    python examples/tiny_model.py
    python examples/tiny_model.py --model tiny-model -q heapq.merge -q json.dumps
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from pathlib import Path

import kvstore

QUESTIONS = ("heapq.merge", "json.dumps", "bisect.insort")
DOCSTRING_START = "heapq\n-----\nHeap queue algorithm"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a folder written by `python -m kvstore.train` (default: train one now)")
    p.add_argument("--steps", type=int, help="training steps, when training here [default: the trainer's]")
    p.add_argument("--max-new-tokens", type=int, default=80)
    p.add_argument("-q", "--question", action="append", help="a chat question (repeatable)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvstore-tiny-") as tmp:
        folder = args.model or train(Path(tmp) / "tiny-model", args.steps)
        run(kvstore.load_model(folder), Path(tmp) / "home", args.question or QUESTIONS, args.max_new_tokens)


def train(out: Path, steps: int | None) -> Path:
    from kvstore.train import Settings, train_folder

    settings = Settings() if steps is None else Settings(steps=steps)
    start = time.perf_counter()
    result, _ = train_folder(out, settings, progress=lambda done, total, loss: print(
        f"\rtraining: step {done}/{total}, loss {loss:.2f}", end="", flush=True))
    first, last = result.loss_ends()
    print(f"\ntrained {result.n_params():,} parameters in {time.perf_counter() - start:.0f} s: loss {first:.2f} "
          f"-> {last:.2f}\n")
    return out


def run(model, home: Path, questions, max_new_tokens: int) -> None:
    eos = model.tokenizer.eos_ids
    with kvstore.open_store(home) as store:
        with store.new("complete", model, seed=1, temperature=0.8) as s:
            s.append_text(DOCSTRING_START)
            text = "".join(s.text(s.generate(max_new_tokens, stop=("\n\n",))))
            print(f"raw: {DOCSTRING_START!r} -> {text!r}  [stopped by: {s.seq.stop_reason}]\n")

        for i, question in enumerate(questions):
            with store.new(f"chat-{i}", model, seed=i, temperature=0.8) as s:
                reply = "".join(s.chat(question, max_new_tokens=max_new_tokens))
                ended = "its end of turn" if s.tokens[-1] in eos else "the length limit"
            print(f"user: {question}\nassistant: {reply.strip()}\n    [{len(s.tokens) - s.messages[-1]['token_start']}"
                  f" tokens, ended by {ended}]\n")

        with store.new("cut", model, seed=0, temperature=0.8) as s:  # chat-0's question and seed, cut short
            pieces = s.chat(questions[0], max_new_tokens=max_new_tokens)
            list(itertools.islice(pieces, 3))
            pieces.close()
            cut_at = len(s.tokens)
        start = time.perf_counter()
        with store.open("cut", model) as s:
            restored = time.perf_counter() - start
            list(s.resume())
            same = s.tokens == store.tokens("chat-0")
        print(f"cut after {cut_at} tokens, reopened from disk in {restored * 1000:.0f} ms and finished: "
              f"{'identical to' if same else 'DIFFERENT from'} the uninterrupted reply")
        if not same:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
