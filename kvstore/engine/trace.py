"""Generation traces: one JSON line per generated token, the proof of byte-identity.

Each line: `{"position": p, "token": id, "logits_sha256": hex}` where the hash covers the float32
logits row the token was sampled from. Two runs whose trace lines are equal produced the same
tokens from the same logits bits. Lines are appended, so an interrupted and continued generation
writes one file that can be compared with an uninterrupted run's.
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


def trace_line(position: int, token: int, logits: torch.Tensor) -> str:
    return json.dumps({"position": position, "token": token, "logits_sha256": logits_digest(logits)})


class TraceWriter:
    def __init__(self, target: str | os.PathLike | IO[str] | None):
        self.owned = isinstance(target, (str, os.PathLike))
        self.file = open(target, "a", encoding="utf-8") if self.owned else target

    def write(self, position: int, token: int, logits: torch.Tensor) -> None:
        if self.file is not None:
            self.file.write(trace_line(position, token, logits) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.owned and self.file is not None:
            self.file.close()
        self.file = None
