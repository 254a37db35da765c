"""Constrained generation: a reply that must be JSON, match a JSON schema, or match a regular expression.

OpenAI's `response_format` (`{"type": "json_object"}`, `{"type": "json_schema", "schema": {...}}`)
and, beyond it, `{"type": "regex", "pattern": "..."}`. The grammar engine is llguidance (the Rust
library behind Guidance, also used by vLLM and llama.cpp): for each step it gives the set of token
ids that keep the text a prefix of some string the format accepts. The sampler sets every other
token's logit to -inf before temperature and the filters (`sampling.sample`'s `allowed`), greedy
included; once the text is complete the only token allowed is the end of sequence, and the reply
ends there.

Contracts:
- `canonical(value)`: a format as given (a dict, its JSON text, None or `{"type": "text"}` for none)
  -> its canonical JSON text (compact, keys in their order: an object's properties are generated in
  the schema's order), "" for none; InvalidArgument names what is wrong (an
  unknown type, a schema llguidance refuses, a regex that does not parse). Torch-free, model-free:
  front ends check a request with it before anything is changed.
- `Constraint(tokenizer, vocab_size, fmt, reply)`: the format's state after the reply's tokens so
  far (`reply`: a resumed call's, replayed; ModelError if they do not fit it). `allowed()` is a bool
  mask `[vocab_size]` of the tokens that may come next; `advance(token)` takes the sampled one;
  `ended(token)` says the reply is complete (the end of sequence came after an accepted text).
- The bits (C3, C9): the mask is a function of the format and the reply's tokens only, so a resumed,
  batched or replayed call masks exactly as the uninterrupted one; the model's logits are untouched
  (a trace hashes them as computed, before the mask).
- The call, not the session, holds a format: it is recorded in the call (`Session.active_call`),
  so an interrupted reply resumes under it, and the next call is free text unless it gives one.

llguidance's tokenizer view of a model (`LLTokenizer`, about 0.2 s to build) is made once per
tokenizer and vocabulary size and kept while the tokenizer lives.
"""

from __future__ import annotations

import json
import re
import weakref
from typing import Any, Sequence

from ..errors import InvalidArgument, ModelError

_KEYS = {  # each type: the keys it takes
    "json_object": {"type"}, "json_schema": {"type", "schema"}, "regex": {"type", "pattern"}}
_tokenizers: "weakref.WeakKeyDictionary[Any, dict[int, Any]]" = weakref.WeakKeyDictionary()


def canonical(value: Any) -> str:
    """A response format as given -> its canonical JSON text ("" for none); InvalidArgument otherwise."""
    if value is None or value == "":
        return ""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise InvalidArgument("bad response_format: not JSON text; give an object such as "
                                  '{"type": "json_object"}') from None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise InvalidArgument('bad response_format: an object with a "type" ("text", "json_object", "json_schema" '
                              'or "regex")')
    kind = value["type"]
    if kind == "text" and set(value) == {"type"}:
        return ""
    if kind not in _KEYS:
        raise InvalidArgument(f"bad response_format: unknown type {kind!r}; use text, json_object, json_schema "
                              "or regex")
    if set(value) != _KEYS[kind]:
        wanted = ", ".join(sorted(_KEYS[kind] - {"type"})) or "nothing else"
        raise InvalidArgument(f"bad response_format: type {kind} takes {wanted} (got {', '.join(sorted(value))})")
    if kind == "json_schema" and not isinstance(value["schema"], dict):
        raise InvalidArgument("bad response_format: the json_schema's schema must be a JSON object")
    if kind == "regex" and not (isinstance(value["pattern"], str) and value["pattern"]):
        raise InvalidArgument("bad response_format: the regex's pattern must be a non-empty string")
    # keys as given, not sorted: a schema's properties are generated in its order
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    problem = _llguidance().LLMatcher.validate_grammar(_grammar(value))
    if problem:
        raise InvalidArgument(f"bad response_format ({kind}): {_one_line(problem)}")
    return text


check_response_format = canonical  # the public API's name for it


def _one_line(message: str) -> str:
    """llguidance's message on one line, without the grammar text it quotes after it (`   1 | ...`)."""
    lines = []
    for line in message.strip().splitlines():
        if re.match(r"\s*\d+ \|", line):
            break
        lines.append(line.strip())
    return " ".join(x for x in lines if x)


def _llguidance():
    import llguidance  # here: only a constrained call needs it

    return llguidance


def _grammar(fmt: dict[str, Any]) -> str:
    """llguidance's grammar for a format (checked by `canonical`)."""
    matcher = _llguidance().LLMatcher
    if fmt["type"] == "json_object":
        return matcher.grammar_from_json_schema({"type": "object"})
    if fmt["type"] == "json_schema":
        return matcher.grammar_from_json_schema(fmt["schema"])
    return matcher.grammar_from_regex(fmt["pattern"])


def _tokenizer_view(tokenizer, vocab_size: int):
    """llguidance's view of the model's tokenizer (its `tokenizers` backend, the model's vocabulary
    size, its end-of-sequence ids), made once per tokenizer and size."""
    views = _tokenizers.setdefault(tokenizer, {})
    if vocab_size not in views:
        views[vocab_size] = _llguidance().LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                                      eos_token=sorted(tokenizer.eos_ids))
    return views[vocab_size]


class Constraint:
    """A call's format, at the point its reply has reached (see the module's docstring)."""

    def __init__(self, tokenizer, vocab_size: int, fmt: str, reply: Sequence[int] = ()):
        import numpy as np

        llg = _llguidance()
        self.vocab_size, self.eos_ids = vocab_size, frozenset(tokenizer.eos_ids)
        self.matcher = llg.LLMatcher(_tokenizer_view(tokenizer, vocab_size), _grammar(json.loads(fmt)), log_level=0)
        if self.matcher.is_error():  # `canonical` checked it; a grammar too large for this vocabulary, say
            raise InvalidArgument(f"bad response_format: {self.matcher.get_error()}")
        self._bits = np.zeros((vocab_size + 31) // 32, np.int32)  # llguidance's bitmask, one bit per token
        if reply and not self.matcher.consume_tokens(list(reply)):
            raise ModelError("the reply so far does not fit the call's response_format "
                             f"({self.matcher.get_error().splitlines()[0]}); it cannot be resumed under it")

    def allowed(self):
        """The tokens that may come next: bool `[vocab_size]`."""
        import numpy as np
        import torch

        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[:self.vocab_size]  # token i: bit i
        return torch.from_numpy(bits.view(np.bool_))

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise ModelError(f"token {token} does not fit the response_format: {self.matcher.get_error()}")

    def ended(self, token: int) -> bool:
        """Whether the reply is complete: `token` (taken) ended a text the format accepts."""
        return token in self.eos_ids and self.matcher.is_stopped()
