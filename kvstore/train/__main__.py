"""`python -m kvstore.train`: train the tiny model and write its Hugging Face folder.

    python -m kvstore.train --out tiny-model                  # the standard library's docstrings, seed 0
    python -m kvstore.train --text notes.txt --out notes-model --seed 3 --steps 600

A progress bar shows the loss on stderr; at the end the command prints the loss of the first and
last 10 % of the steps, how text-like the model's generations are next to the untrained model's
(`quality`), one generation, and the folder. Exit status 0, 1 on an error (one line), 2 on a usage
error. The same text, settings and seed give the same weight bytes (on the same machine, torch
version and `--threads`).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path

from .loop import Settings

OPTIONS = {  # Settings field -> (flag, help)
    "vocab_size": ("--vocab-size", "tokens in the BPE vocabulary, 3 special and 256 bytes included"),
    "hidden_size": ("--hidden-size", "width of the residual stream"),
    "n_layers": ("--layers", "transformer blocks"),
    "n_heads": ("--heads", "attention heads"),
    "n_kv_heads": ("--kv-heads", "key/value heads (grouped-query attention: fewer than --heads)"),
    "intermediate_size": ("--ffn-size", "width of the SwiGLU feed-forward layer"),
    "context": ("--context", "the model's context, and its longest training window, in tokens"),
    "steps": ("--steps", "optimizer steps"),
    "batch": ("--batch", "windows of the whole context per step (twice as many halves in the short steps)"),
    "lr": ("--lr", "peak learning rate (AdamW; warm-up, then cosine decay)"),
    "short_steps": ("--short-steps", "share of the steps on windows of half the context, twice as many"),
    "seed": ("--seed", "seed of the initial weights, the windows and the document order"),
    "threads": ("--threads", "CPU threads for torch (other counts give other bits)"),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvstore.train",
                                description="Train kvstore's tiny model and write its Hugging Face folder.")
    p.add_argument("--text", metavar="FILE", type=Path,
                   help="train on this UTF-8 text [default: the standard library's docstrings, as "
                        "examples/stdlib_text.py prints them]")
    p.add_argument("--out", metavar="DIR", type=Path, default=Path("tiny-model"),
                   help="folder to write: new, empty, or one written by this command [default: tiny-model]")
    defaults = Settings()
    for f in fields(Settings):
        flag, help_ = OPTIONS[f.name]
        default = getattr(defaults, f.name)
        p.add_argument(flag, dest=f.name, type=type(default), default=default, help=f"{help_} [default: {default}]",
                       metavar="N" if isinstance(default, int) else "X")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no report")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from ..errors import KvstoreError

    try:
        settings = Settings(**{f.name: getattr(args, f.name) for f in fields(Settings)})
        text = args.text.read_text(encoding="utf-8") if args.text else None
        return run(settings, text, args.out, args.quiet)
    except (KvstoreError, OSError, UnicodeDecodeError, ValueError) as e:
        print(f"Error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1


def run(settings: Settings, text: str | None, out: Path, quiet: bool) -> int:
    from . import train_folder

    if quiet:
        result, docs = train_folder(out, settings, text)
        return 0
    with _bar(settings.steps) as progress:
        result, docs = train_folder(out, settings, text, progress)
    report(result, docs, out, stdlib=text is None)
    return 0


def report(result, docs, out: Path, *, stdlib: bool) -> None:
    import torch

    from ..engine.model import load_model
    from .quality import text_likeness, untrained

    s, cfg = result.settings, result.config
    first, last = result.loss_ends()
    source = "the standard library's docstrings" if stdlib else "the text"
    print(f"trained {result.n_params():,} parameters ({cfg.n_layers} layers, hidden {cfg.hidden_size}, "
          f"{cfg.n_heads} heads / {cfg.n_kv_heads} KV heads, vocabulary {cfg.vocab_size}, context {s.context}) "
          f"on {result.n_tokens:,} tokens of {source}")
    print(f"{s.steps} steps in {result.seconds:.1f} s on {s.threads} thread(s); loss {first:.2f} in the first "
          f"10 % of steps, {last:.2f} in the last 10 %")
    before = torch.get_num_threads()
    torch.set_num_threads(s.threads)
    try:
        model = load_model(out, dtype="float32")  # the folder as any user loads it
        trained = text_likeness(model, docs)
        baseline = text_likeness(untrained(model, result.initial), docs)
    finally:
        torch.set_num_threads(before)
    print(f"text-likeness: {trained} (the untrained model: {baseline.share:.0%})")
    print(f"a generation: {' '.join(trained.samples[0].split())[:200]!r}")
    prompt = '--prompt "heapq.merge"' if stdlib else f'--raw --prompt {docs[0].body.split()[0]!r}'
    print(f"wrote {out}/; try: kvstore new demo --model {out} {prompt}")


class _bar:
    """A rich progress bar on stderr with the last step's loss; `progress(done, total, loss)`."""

    def __init__(self, steps: int):
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        self.bar = Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                            console=Console(stderr=True))
        self.task = self.bar.add_task("training", total=steps, loss="-")

    def __enter__(self):
        self.bar.start()
        return self

    def __call__(self, done: int, total: int, loss: float) -> None:
        self.bar.update(self.task, completed=done, loss=f"{loss:.3f}")

    def __exit__(self, *exc):
        self.bar.stop()


if __name__ == "__main__":
    sys.exit(main())
