"""A long, real text that every Python install carries: the standard library's own documentation.

`document(min_chars)` joins the docstrings of some standard-library modules and of their public
functions and classes, in a fixed order, until the text has at least `min_chars` characters. It is
read from the running interpreter (nothing is shipped with kvstore), so it differs a little between
Python versions; the docstrings are the Python Software Foundation's, under the PSF license.

    python examples/stdlib_text.py 8000 > doc.txt     # about 2,000 tokens
"""

from __future__ import annotations

import importlib
import inspect
import sys
from typing import Iterator

MODULES = ("heapq", "bisect", "re", "json", "argparse", "subprocess", "pickle", "collections", "itertools",
           "functools", "textwrap", "contextlib", "pathlib", "dataclasses", "logging", "csv", "datetime",
           "statistics", "random", "string", "decimal", "fractions", "shutil", "tempfile", "threading")


def sections() -> Iterator[str]:
    """One section per module docstring and per public member's docstring, without repeats."""
    seen: set[str] = set()
    for name in MODULES:
        module = importlib.import_module(name)
        members = [(name, module)] + [(f"{name}.{attr}", getattr(module, attr, None))
                                      for attr in sorted(getattr(module, "__all__", []))]
        for title, obj in members:
            doc = inspect.getdoc(obj) if obj is not None else None
            if not doc or doc in seen or len(doc) < 80:
                continue
            seen.add(doc)
            yield f"{title}\n{'-' * len(title)}\n{doc}\n"


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


if __name__ == "__main__":
    sys.stdout.write(document(int(sys.argv[1]) if len(sys.argv) > 1 else 8000))
