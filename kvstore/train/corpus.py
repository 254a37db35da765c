"""The training text: the standard library's own docstrings, cut into documents, and the token
stream the model learns from.

- `stdlib_documents()` / `document(min_chars)`: the docstrings of some standard-library modules and
  of their public functions and classes, in a fixed order, read from the running interpreter
  (nothing is shipped; the text differs a little between Python versions; the docstrings are the
  Python Software Foundation's, under the PSF license). `document` is what `examples/stdlib_text.py`
  prints: each section a title, a line of dashes as long, the docstring.
- `documents(text)`: any text cut the same way: at such headings when it has them (the file
  `stdlib_text.py` writes reads back into its sections), else at blank lines (untitled paragraphs).
- `stream(docs, encode, seed)`: the token ids of the training stream. Every document is there as
  raw text ended by `<|endoftext|>`, and a titled one also as a ChatML exchange (the title asked,
  the body answered, ended by `<|im_end|>`), so the model learns where a text and a reply end and
  the chat path of a session runs on text it knows. The order is shuffled by `seed`.
"""

from __future__ import annotations

import importlib
import inspect
import random
import re
import sys
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

MODULES = ("heapq", "bisect", "re", "json", "argparse", "subprocess", "pickle", "collections", "itertools",
           "functools", "textwrap", "contextlib", "pathlib", "dataclasses", "logging", "csv", "datetime",
           "statistics", "random", "string", "decimal", "fractions", "shutil", "tempfile", "threading")
REPLACEABLE = ("threading.excepthook",)  # a hook programs replace (pytest does): left out, the text stays the same
END_OF_TEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END)  # ids 0, 1, 2 of the trained vocabulary
_HEADING = re.compile(r"^(?P<title>[^\n]*\S[^\n]*)\n(?P<rule>-+)\n", re.M)


@dataclass(frozen=True)
class Document:
    title: str  # "" for an untitled paragraph
    body: str

    def raw(self) -> str:
        """The document as `stdlib_text.py` prints it (a section), or the bare paragraph."""
        head = f"{self.title}\n{'-' * len(self.title)}\n" if self.title else ""
        return f"{head}{self.body}\n"

    def chat(self) -> str:
        """The document as one ChatML exchange, rendered as `CHAT_TEMPLATE` renders it (`bpe`)."""
        return f"{IM_START}user\n{self.title}{IM_END}\n{IM_START}assistant\n{self.body}{IM_END}\n"


def stdlib_documents() -> Iterator[Document]:
    """One document per module docstring and per public member's docstring, without repeats. A
    member that the running program replaced (a hook: `REPLACEABLE`; anything defined outside the
    standard library) is left out, so the text is the same in any program on one Python."""
    seen: set[str] = set()
    for name in MODULES:
        module = importlib.import_module(name)
        members = [(name, module)] + [(f"{name}.{attr}", getattr(module, attr, None))
                                      for attr in sorted(getattr(module, "__all__", []))]
        for title, obj in members:
            doc = inspect.getdoc(obj) if obj is not None else None
            if not doc or doc in seen or len(doc) < 80 or title in REPLACEABLE or not _standard(obj):
                continue
            seen.add(doc)
            yield Document(title, doc)


def _standard(obj) -> bool:
    module = getattr(obj, "__module__", None)
    return not isinstance(module, str) or module.split(".")[0] in sys.stdlib_module_names


def sections() -> Iterator[str]:
    """The standard-library documents as text sections (title, dashes, docstring)."""
    return (d.raw() for d in stdlib_documents())


def document(min_chars: int) -> str:
    """At least `min_chars` characters of standard-library documentation (all of it if shorter)."""
    parts, size = [], 0
    for section in sections():
        parts.append(section)
        size += len(section) + 1
        if size >= min_chars:
            break
    if not parts:
        raise RuntimeError("this Python has no docstrings (run without -OO)")
    return "\n".join(parts)


def documents(text: str) -> list[Document]:
    """`text` cut into documents: at headings (a line, then a line of as many dashes) when it has
    any, text before the first one untitled; else at blank lines."""
    heads = [m for m in _HEADING.finditer(text) if len(m["rule"]) == len(m["title"])]
    if not heads:
        return [Document("", p.strip("\n")) for p in re.split(r"\n\s*\n", text) if p.strip()]
    out = [Document("", text[:heads[0].start()].strip("\n"))] if text[:heads[0].start()].strip() else []
    for m, after in zip(heads, heads[1:] + [None]):
        body = text[m.end():after.start() if after else len(text)].strip("\n")
        if body.strip():
            out.append(Document(m["title"], body))
    return out


def stream(docs: Sequence[Document], encode: Callable[[str], list[int]], seed: int) -> list[int]:
    """The training token ids: every document raw and ended by `<|endoftext|>`, every titled one
    also as a chat exchange, in an order shuffled by `seed`."""
    pieces = [d.raw() + END_OF_TEXT for d in docs] + [d.chat() + END_OF_TEXT for d in docs if d.title]
    random.Random(seed).shuffle(pieces)
    return [i for piece in pieces for i in encode(piece)]
