"""The token ids a new chat turn adds to a session that already holds some tokens.

The chat template renders the whole conversation; what the session has seen is the decoded text
of its tokens (byte-level BPE decodes losslessly). The new turn is the part of the rendering past
that text. When the rendering does not extend it (a raw document was fed first, or a template
rewrote an earlier message), the turn is the part of the rendering past the rendering of the
conversation so far.
"""

from __future__ import annotations

from .tokenizer import Tokenizer


def turn_ids(tokenizer: Tokenizer, history: list[dict[str, str]], message: dict[str, str],
             session_tokens: list[int], *, add_generation_prompt: bool = True) -> list[int]:
    """The ids `message` adds after `history`; with the assistant's opening (the generation prompt)
    unless `add_generation_prompt` is False (a message given as context, not answered)."""
    full = tokenizer.render_chat(history + [message], add_generation_prompt=add_generation_prompt)
    seen = tokenizer.decode(session_tokens) if session_tokens else ""
    if full.startswith(seen) and (seen or not session_tokens):
        text = full[len(seen):]
    else:
        spoken = [m for m in history if m["role"] != "system"]
        before = tokenizer.render_chat(history, add_generation_prompt=False) if spoken else ""
        text = full[len(before):] if full.startswith(before) else full
    return tokenizer.encode(text, add_bos=False)  # templates write BOS themselves when they want it
