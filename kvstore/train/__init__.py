"""Train kvstore's tiny model: a small Llama (grouped-query attention, rotary, RMSNorm, SwiGLU: the
same code path as SmolLM2), trained on the CPU in about half a minute on the standard library's
docstrings, through the engine's own forward; written as a Hugging Face folder that
`kvstore.load_model` and transformers load. It is a model that was actually trained, small
enough for the tests and examples to make in seconds: its text is text, so end-of-sequence
tokens, stop strings and chat turns happen as they do with a real model.

    python -m kvstore.train --out tiny-model          # then: kvstore new s --model tiny-model ...

Modules: `corpus` (the text and the token stream), `bpe` (the tokenizer and its files), `loop`
(the training), `folder` (the folder), `quality` (is the output text?), `__main__` (the command).
`train_folder` runs them in order. Importing the package (or `corpus`) does not import torch.
The package sits above the engine: nothing in kvstore imports it.
"""

from __future__ import annotations

from importlib import import_module
from pathlib import Path

from .corpus import Document, documents, stdlib_documents

_WHERE = {"Progress": "loop", "Result": "loop", "Settings": "loop", "train": "loop"}  # torch: imported on first use
__all__ = ["Document", "documents", "stdlib_documents", "train_folder", *_WHERE]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'kvstore.train' has no attribute {name!r}")
    return getattr(import_module(f".{_WHERE[name]}", __name__), name)


def train_folder(out: str | Path, settings=None, text: str | None = None, progress=None):
    """Train on `text` (default: the standard library's docstrings) and write the folder `out`;
    returns (`loop.Result`, the documents trained on). `settings`: a `loop.Settings` (default: the
    default size)."""
    from . import folder, loop

    docs = documents(text) if text is not None else list(stdlib_documents())
    result = loop.train(docs, settings or loop.Settings(), progress)
    source = text if text is not None else "\n".join(d.raw() for d in docs)
    folder.write(Path(out), result, folder.sha256(source))
    return result, docs
