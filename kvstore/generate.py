"""Prefill and decode over token ids; generation is a generator of sampled tokens.

A `Sequence` holds a model, its KVCache and the token ids t0..tn. The cache holds K/V for
t0..t(k-1) where k = `cache.length`; the rest, `pending`, still has to be fed (contract C2: after a
prefill or a sampled token exactly one is pending: the last one). Tokens are fed in chunks whose
boundaries are multiples of `chunk_size` in absolute positions, so a prefill interrupted anywhere
and resumed goes through exactly the same kernel calls as one that never stopped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence as Seq

import torch

from .cache import KVCache
from .errors import ModelError
from .sampling import SamplerSettings, sample

DEFAULT_CHUNK = 512


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
    def __init__(self, model, cache: KVCache | None = None, tokens: Seq[int] = (), *, chunk_size: int = DEFAULT_CHUNK):
        if chunk_size < 1:
            raise ModelError("chunk size must be at least 1 token")
        self.model = model
        self.cache = cache if cache is not None else model.new_cache()
        self.tokens: list[int] = list(tokens)
        self.chunk_size = chunk_size
        self.stop_reason: str | None = None
        assert self.cache.length <= len(self.tokens)

    def close(self) -> None:
        """Done with this sequence: its cache's memory goes to the next cache (`cache.POOL`). The
        tokens stay readable; generating again starts from an empty cache (all tokens pending)."""
        self.cache.release()

    @property
    def pending(self) -> list[int]:
        return self.tokens[self.cache.length:]

    def extend(self, ids: Seq[int]) -> Iterator[int]:
        """Append ids and prefill all pending tokens but the last; yields the cache length per chunk."""
        self.add(ids)
        yield from self.prefill()

    def add(self, ids: Seq[int]) -> None:
        """Append ids without feeding them (they become pending)."""
        ids = [int(i) for i in ids]
        vocab = self.model.config.vocab_size
        if any(not 0 <= i < vocab for i in ids):
            raise ModelError(f"token ids must lie in [0, {vocab}) for this model")
        if len(self.tokens) + len(ids) > self.model.config.max_context:
            raise ModelError(f"{len(self.tokens) + len(ids)} tokens exceed the model's context of "
                             f"{self.model.config.max_context}; start a new session or fork at an earlier point")
        self.tokens.extend(ids)

    def prefill(self) -> Iterator[int]:
        """Feed every pending token but the last, chunk by chunk; yields the cache length after each."""
        for a, b in chunk_bounds(self.cache.length, len(self.tokens) - 1, self.chunk_size):
            self.model.forward(self.tokens[a:b], a, self.cache, last_only=True)
            yield b

    def next_logits(self) -> torch.Tensor:
        """Feed all pending tokens; the float32 logits `[vocab]` (CPU) that predict the next one."""
        bounds = chunk_bounds(self.cache.length, len(self.tokens), self.chunk_size)
        if not bounds:
            raise ModelError("nothing to feed: a sequence needs at least one token before it can generate")
        for a, b in bounds:
            logits = self.model.forward(self.tokens[a:b], a, self.cache, last_only=True)
        return logits[-1].to("cpu")

    def generate(self, settings: SamplerSettings, *, seed: int, max_new_tokens: int,
                 stop_ids: Seq[int] = (), should_stop: Callable[[list[int]], bool] | None = None,
                 ) -> Iterator[TokenEvent]:
        """Sample up to max_new_tokens; stops after an id in stop_ids, when should_stop(new ids) is
        true, or at the end of the context. `stop_reason` says which."""
        new: list[int] = []
        self.stop_reason = "length"
        for _ in range(max_new_tokens):
            position = len(self.tokens)
            if position >= self.model.config.max_context:
                self.stop_reason = "context"
                return
            logits = self.next_logits()
            token = sample(logits, settings, seed=seed, position=position, history=self.tokens)
            self.tokens.append(token)
            new.append(token)
            yield TokenEvent(position, token, logits)
            if token in stop_ids:
                self.stop_reason = "eos"
                return
            if should_stop is not None and should_stop(new):
                self.stop_reason = "stop"
                return
