"""Generation traces: one JSON line per generated token, the proof of byte-identity.

Each line: `{"position": p, "token": id, "logits_sha256": hex}` where the hash covers the float32
logits row the token was sampled from. Two runs whose trace lines are equal produced the same
tokens from the same logits bits. Lines are appended, so an interrupted and continued generation
writes one file that can be compared with an uninterrupted run's.

A target object whose `digests` attribute is false (the server's collector, when the client did
not ask for the trace) gets lines with `"logits_sha256": null`: the hash of a 49k-entry row costs
about 0.1 ms, a noticeable share of a batched step's time per session.
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


def trace_line(position: int, token: int, logits: torch.Tensor | None) -> str:
    """The line of one token; logits None: without its hash (null)."""
    return json.dumps({"position": position, "token": token,
                       "logits_sha256": None if logits is None else logits_digest(logits)})


class TraceWriter:
    def __init__(self, target: str | os.PathLike | IO[str] | None):
        self.owned = isinstance(target, (str, os.PathLike))
        self.file = open(target, "a", encoding="utf-8") if self.owned else target
        self.digests = self.owned or getattr(target, "digests", True)

    def write(self, position: int, token: int, logits: torch.Tensor) -> None:
        if self.file is not None:
            self.file.write(trace_line(position, token, logits if self.digests else None) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.owned and self.file is not None:
            self.file.close()
        self.file = None
