"""A multi-turn chat in which every turn runs in a new process, resuming the saved session.

Each turn starts a fresh Python process (`chat_resume.py turn ...`) that opens the session,
restores its KV cache from disk (no prefill of the conversation so far), adds the user's message
and streams the reply. At the end the same conversation is replayed in one process without any
restart, and the two token sequences are compared: they are identical (contract C1).

    python examples/chat_resume.py
    python examples/chat_resume.py --temperature 0.8 "Hi!" "Tell me about heaps." "Thanks."
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import kvstore

MESSAGES = ("Hello! What is a priority queue?", "How would I build one in Python?", "Thanks, that helps.")


def turn(home: str, model_spec: str, name: str, message: str, max_new_tokens: int, temperature: float) -> None:
    """One turn in this process: open (or create) the session, reply, checkpoint, exit."""
    model = kvstore.load_model(model_spec)
    with kvstore.open_store(home) as store:
        start = time.perf_counter()
        if name in store.names():
            session = store.open(name, model)
        else:
            session = store.new(name, model, seed=1, temperature=temperature)
        with session:
            ms = (time.perf_counter() - start) * 1000
            print(f"[process {os.getpid()}: " + (f"restored {len(session.tokens):,} tokens in {ms:.0f} ms, no prefill]"
                                                 if session.tokens else "new session]"))
            print(f"user: {message}\nassistant: ", end="", flush=True)
            for piece in session.chat(message, max_new_tokens=max_new_tokens):
                print(piece, end="", flush=True)
            print("\n")


def replay(home: str, model_spec: str, messages: list[str], max_new_tokens: int, temperature: float) -> list[int]:
    """The same conversation in one process, no restarts: the reference."""
    model = kvstore.load_model(model_spec)
    with kvstore.open_store(home) as store, store.new("one-process", model, seed=1, temperature=temperature) as s:
        for message in messages:
            for _ in s.chat(message, max_new_tokens=max_new_tokens):
                pass
        return list(s.tokens)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "turn":
        _, _, home, model_spec, name, message, max_new, temperature = sys.argv
        turn(home, model_spec, name, message, int(max_new), float(temperature))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("messages", nargs="*", default=list(MESSAGES))
    p.add_argument("--model", default="smollm2", help="alias, .gguf file or Hugging Face folder")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args()
    model_spec = str(kvstore.pull(args.model)) if args.model == "smollm2" else args.model
    with tempfile.TemporaryDirectory(prefix="kvstore-chat-") as home:
        for message in args.messages:
            subprocess.run([sys.executable, __file__, "turn", home, model_spec, "chat", message,
                            str(args.max_new_tokens), str(args.temperature)], check=True)
        with kvstore.open_store(home) as store:
            across = store.tokens("chat")
        same = replay(home, model_spec, args.messages, args.max_new_tokens, args.temperature)
    verdict = "identical" if across == same else "DIFFERENT"
    print(f"{len(args.messages)} turns in {len(args.messages)} processes vs one process: {len(across):,} tokens, "
          f"{verdict}")
    sys.exit(0 if across == same else 1)


if __name__ == "__main__":
    main()
