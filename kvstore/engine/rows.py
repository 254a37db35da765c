"""Rows of several sequences in one forward: `Item` (one sequence's new tokens, where they start, its
cache) and `spans_of` (each item's rows in the stacked `[R, ...]` tensors, in item order).

A forward over items stacks their rows so that a product reads its weights once for all of them;
contract C9 (a session's bits do not depend on its company) holds because every operation on the
stacked rows computes each row alone (`ops.rows_linear` decides, per kernel, where it may stack) and
attention runs per item.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass
class Item:
    ids: torch.Tensor  # [T] token ids, at positions pos..pos+T-1
    pos: int
    cache: object  # the item's KVCache (None: a forward without a cache, from position 0)


class Span(NamedTuple):
    start: int
    end: int

    @property
    def rows(self) -> int:
        return self.end - self.start


def spans_of(items: list[Item]) -> list[Span]:
    out, at = [], 0
    for it in items:
        out.append(Span(at, at + it.ids.shape[0]))
        at += it.ids.shape[0]
    return out
