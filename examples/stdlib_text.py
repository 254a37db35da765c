"""A long, real text that every Python install carries: the standard library's own documentation.

`document(min_chars)` joins the docstrings of some standard-library modules and of their public
functions and classes, in a fixed order, until the text has at least `min_chars` characters. It is
read from the running interpreter (nothing is shipped with kvstore), so it differs a little between
Python versions; the docstrings are the Python Software Foundation's, under the PSF license. It is
also the text the tiny model is trained on (`python -m kvstore.train`), whose module
`kvstore.train.corpus` extracts it.

    python examples/stdlib_text.py 8000 > doc.txt     # about 2,000 tokens
"""

from __future__ import annotations

import sys

from kvstore.train.corpus import MODULES, document, sections  # noqa: F401

if __name__ == "__main__":
    sys.stdout.write(document(int(sys.argv[1]) if len(sys.argv) > 1 else 8000))
