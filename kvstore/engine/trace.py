"""Generation traces: one JSON line per generated token, the proof of byte-identity.

Each line: `{"position": p, "token": id, "logits_sha256": hex}` where the hash covers the float32
logits row the token was sampled from. Two runs whose trace lines are equal produced the same
tokens from the same logits bits. Lines are appended, so an interrupted and continued generation
writes one file that can be compared with an uninterrupted run's.

A target object whose `digests` attribute is false (the server's collector, when the client did
not ask for the trace) gets lines with `"logits_sha256": null`: the hash of a 49k-entry row costs
about 0.1 ms, a noticeable share of a batched step's time per session. One whose `top_logprobs`
attribute is a number k (the server's, when the client asked for logprobs) gets in each line the
token's log-probability and the k likeliest tokens' (`token_logprobs`); files never do.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import IO

import torch


def logits_digest(logits: torch.Tensor) -> str:
    row = logits.detach().to("cpu", torch.float32).contiguous()
    return hashlib.sha256(row.numpy().tobytes()).hexdigest()


def trace_line(position: int, token: int, logits: torch.Tensor | None, **more) -> str:
    """The line of one token; logits None: without its hash (null). `more`: further fields."""
    return json.dumps({"position": position, "token": token,
                       "logits_sha256": None if logits is None else logits_digest(logits), **more})


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> dict:
    """`{"logprob", "top_logprobs"}` of a token sampled from `logits` (`[vocab]`): its natural log
    probability under the model's distribution (float32 log-softmax of the row, before temperature
    and top-p, as OpenAI reports them) and the `top` likeliest tokens' as [id, logprob] pairs, the
    likeliest first. A function of the row's bits alone (one row's log-softmax and top-k on the CPU
    run in a fixed order), so as byte-identical as the logits: alone or batched, resumed or not."""
    row = torch.log_softmax(logits.detach().to("cpu", torch.float32), dim=-1)
    values, ids = torch.topk(row, min(max(top, 0), row.numel()))
    return {"logprob": float(row[token]), "top_logprobs": [[i, v] for i, v in zip(ids.tolist(), values.tolist())]}


class TraceWriter:
    def __init__(self, target: str | os.PathLike | IO[str] | None):
        self.owned = isinstance(target, (str, os.PathLike))
        self.file = open(target, "a", encoding="utf-8") if self.owned else target
        self.digests = self.owned or getattr(target, "digests", True)
        self.top_logprobs = None if self.owned else getattr(target, "top_logprobs", None)

    def write(self, position: int, token: int, logits: torch.Tensor) -> None:
        if self.file is not None:
            more = {} if self.top_logprobs is None else token_logprobs(logits, token, self.top_logprobs)
            self.file.write(trace_line(position, token, logits if self.digests else None, **more) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.owned and self.file is not None:
            self.file.close()
        self.file = None
