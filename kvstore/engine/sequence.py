"""Prefill and decode over token ids; generation is a generator of sampled tokens.

A `Sequence` holds a model, its KVCache and the token ids t0..tn. The cache holds K/V for
t0..t(k-1) where k = `cache.length`; the rest, `pending`, still has to be fed. When every token is
fed (k = n+1), `hidden` holds tn's final hidden state (`Model.feed`'s), from which `next_logits`
computes the logits that predict t(n+1) without another pass through the layers. Contract C2 (as
kvstore amends it): a checkpoint holds either that state and the K/V of every token, or the K/V of
all but the last token, which is then pending (after a generation call ends: its last token was
never fed). Tokens are fed in chunks whose boundaries are multiples of `chunk_size` in absolute
positions, so a prefill interrupted anywhere and resumed goes through exactly the same kernel
calls as one that never stopped.

`reusable` counts the leading positions whose K/V a cold run computes alike: a prefill of the
tokens from position 0 in those chunks (contract C10, the prefix cache's keys). A whole chunk fed
after reusable positions adds to it; so does any call when the model computes every row alone
(`Model.row_invariant`: then how the tokens were fed changes no bit). A partial chunk (a prompt's
last one), a decode step on other kernels, or a chunk fed after positions that are not reusable
leave it where it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence as Seq

import torch

from ..defaults import DEFAULT_CHUNK
from ..errors import ModelError
from .cache import KVCache, with_room
from .sampling import sample
from .settings import SamplerSettings



@dataclass
class TokenEvent:
    position: int  # absolute position of the sampled token
    token: int
    logits: torch.Tensor  # the float32 `[vocab]` row it was sampled from (CPU)


def chunk_bounds(start: int, end: int, chunk_size: int) -> list[tuple[int, int]]:
    """[start, end) cut at every multiple of chunk_size."""
    bounds, a = [], start
    while a < end:
        b = min(end, (a // chunk_size + 1) * chunk_size)
        bounds.append((a, b))
        a = b
    return bounds


class Sequence:
    def __init__(self, model, cache: KVCache | None = None, tokens: Seq[int] = (), *, chunk_size: int = DEFAULT_CHUNK,
                 hidden: torch.Tensor | None = None, reusable: int = 0):
        if chunk_size < 1:
            raise ModelError("chunk size must be at least 1 token")
        self.model = model
        self.cache = cache if cache is not None else model.new_cache()
        self.tokens: list[int] = list(tokens)
        self.chunk_size = chunk_size
        self.stop_reason: str | None = None
        # [hidden] the last token's final state when the cache holds every token (see the module's docstring)
        self.hidden = hidden
        self.reusable = min(reusable, self.cache.length)  # see the module's docstring
        self._rows_alone = bool(getattr(model, "row_invariant", False))
        assert self.cache.length <= len(self.tokens)
        assert hidden is None or self.cache.length == len(self.tokens), "a final state belongs to the last token"

    def close(self) -> None:
        """Done with this sequence: its cache's memory goes to the next cache (`cache.POOL`). The
        tokens stay readable; generating again starts from an empty cache (all tokens pending)."""
        self.cache.release()
        self.hidden = None
        self.reusable = 0

    @property
    def pending(self) -> list[int]:
        return self.tokens[self.cache.length:]

    def extend(self, ids: Seq[int]) -> Iterator[int]:
        """Append ids and prefill every pending token; yields the cache length per chunk."""
        self.add(ids)
        yield from self.prefill()

    def add(self, ids: Seq[int]) -> None:
        """Append ids without feeding them (they become pending)."""
        ids = [int(i) for i in ids]
        self.model.check_ids(ids)
        self.model.check_context(len(self.tokens) + len(ids))
        self.tokens.extend(ids)
        if ids:
            self.hidden = None  # it belonged to the token before these

    def prefill(self, rows: Callable[[int, torch.Tensor], None] | None = None) -> Iterator[int]:
        """Feed every pending token, chunk by chunk; yields the cache length after each chunk. The
        last chunk leaves `hidden` (the last token's final state). `rows(a, logits)`: called with each
        chunk's logits `[b - a, vocab]` (float32, CPU; row i predicts the token at position a + i + 1),
        from every row's final state (`Model.feed_all`: the chunks, the K/V and `hidden` stay as without)."""
        if len(self.pending) > 1:  # text read: room for it all and the tokens generated after, at once
            self.cache.make_room(min(with_room(len(self.tokens)), self.model.config.max_context))
        for a, b in chunk_bounds(self.cache.length, len(self.tokens), self.chunk_size):
            if rows is None:
                hidden = self.model.feed(self.tokens[a:b], a, self.cache)
            else:
                states = self.model.feed_all(self.tokens[a:b], a, self.cache)  # [b - a, hidden]
                hidden = states[-1].clone()  # in memory of its own, as `feed`'s (a kernel's bits may depend on where)
                rows(a, self.model.head(states).to("cpu"))
            if a == self.reusable and (self._rows_alone or (a % self.chunk_size == 0 and b - a == self.chunk_size)):
                self.reusable = b
            if b == len(self.tokens):
                self.hidden = hidden
            yield b

    def feed(self) -> None:
        """`prefill` to the end: every token in the cache, `hidden` set."""
        for _ in self.prefill():
            pass

    def next_logits(self) -> torch.Tensor:
        """Feed all pending tokens; the float32 logits `[vocab]` (CPU) that predict the next one."""
        if not self.tokens:
            raise ModelError("nothing to feed: a sequence needs at least one token before it can generate")
        if self.hidden is None and not self.pending:  # a cache built elsewhere without the last state:
            self.cache.trim(len(self.tokens) - 1)  # feed the last token again
            self.reusable = min(self.reusable, self.cache.length)
        self.feed()
        return self.model.head(self.hidden).to("cpu")

    def generate(self, settings: SamplerSettings, *, seed: int, max_new_tokens: int,
                 stop_ids: Seq[int] = (), should_stop: Callable[[list[int]], bool] | None = None,
                 fed: Callable[[], None] | None = None, reply_start: int | None = None,
                 constraint=None) -> Iterator[TokenEvent]:
        """Sample up to max_new_tokens; stops after an id in stop_ids, when should_stop(new ids) is
        true, or at the end of the context. `stop_reason` says which. `fed()` is called before each
        sample, when every token is in the cache and `hidden` is set: the moment to checkpoint.
        `reply_start`: where the reply began, for the presence and frequency penalties (default:
        here; a reply resumed after an interruption gives its own). `constraint`: the call's
        response format (`grammar.Constraint`, at the reply's tokens so far): only the tokens it
        allows are sampled, and the reply ends ("eos") once it is complete."""
        new: list[int] = []
        reply_start = len(self.tokens) if reply_start is None else reply_start
        self.stop_reason = "length"
        for _ in range(max_new_tokens):
            position = len(self.tokens)
            if position >= self.model.config.max_context:
                self.stop_reason = "context"
                return
            logits = self.next_logits()
            if fed is not None:
                fed()
            token = sample(logits, settings, seed=seed, position=position, history=self.tokens,
                           reply_start=reply_start, allowed=None if constraint is None else constraint.allowed())
            if constraint is not None:
                constraint.advance(token)
            self.add([token])  # and the state, the previous token's, goes
            new.append(token)
            yield TokenEvent(position, token, logits)
            if token in stop_ids or (constraint is not None and constraint.ended(token)):
                self.stop_reason = "eos"
                return
            if should_stop is not None and should_stop(new):
                self.stop_reason = "stop"
                return
