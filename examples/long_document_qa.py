"""Read a long document once, then answer several questions about it, each from a fork.

The document (the standard library's own docstrings, see stdlib_text.py) is prefilled once into a
session. Each question forks that session (the fork shares the document's KV on disk, costing
milliseconds and kilobytes), reopens the fork, which loads the KV instead of recomputing it, and
asks its question as a chat turn. For each answer the script prints how long the fork took to be
ready and how much time that saved compared with reading the document again.

    python examples/long_document_qa.py                      # SmolLM2, a ~2,000-token document
    python examples/long_document_qa.py --tokens 4000 -q "What does heapq.merge do?"
"""

from __future__ import annotations

import argparse
import tempfile
import time

import kvstore
from stdlib_text import document

QUESTIONS = (
    "Which function pushes an item onto a heap?",
    "What does the re module's sub function do?",
    "Name one option that argparse's add_argument accepts.",
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="alias, .gguf file or Hugging Face folder")
    p.add_argument("--home", help="kvstore home (default: a temporary one, removed at the end)")
    p.add_argument("--tokens", type=int, default=2000, help="document length in tokens")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("-q", "--question", action="append", help="a question (repeatable)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvstore-qa-") as tmp:
        run(args, args.home or tmp)


def run(args, home: str) -> None:
    model = kvstore.load_model(args.model)
    ids = model.tokenizer.encode(document(args.tokens * 6))[:args.tokens]
    text = model.tokenizer.decode(ids)
    questions = args.question or QUESTIONS
    with kvstore.open_store(home) as store:
        start = time.perf_counter()
        with store.new("stdlib-docs", model) as doc:
            doc.append_text(text, progress=lambda done, total: print(f"\rreading the document: {done:,}/{total:,}"
                                                                     " tokens", end="", flush=True))
            n_doc = len(doc.tokens)
        prefill = time.perf_counter() - start
        print(f"\nread {n_doc:,} tokens once in {prefill:.2f} s\n")

        for i, question in enumerate(questions, 1):
            start = time.perf_counter()
            store.fork("stdlib-docs", f"question-{i}")  # shares the document's KV by reference
            with store.open(f"question-{i}", model) as q:
                ready = time.perf_counter() - start
                answer = "".join(q.chat(question, max_new_tokens=args.max_new_tokens))
            print(f"Q{i}: {question}")
            print(f"A{i}: {answer.strip()}")
            print(f"    fork + load: {ready * 1000:.0f} ms instead of a {prefill:.2f} s prefill: "
                  f"saved {prefill - ready:.2f} s ({prefill / ready:.0f}x)\n")
        own = {i.name: i.disk_bytes for i in store.list()}
        print("disk: " + ", ".join(f"{name} {size / 1024:.0f} KiB" for name, size in sorted(own.items())))


if __name__ == "__main__":
    main()
