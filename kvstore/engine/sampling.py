"""Token sampling whose randomness is a function of (seed, position) alone (contract C3).

The uniform number that picks the token at absolute position p is derived from blake2b(seed, p), so
no RNG state exists to be saved: a resumed session draws exactly what an uninterrupted one would.
Sampling runs on the CPU in float32: repetition penalty, then OpenAI's presence and frequency
penalties (over the tokens the reply has generated so far, counted from where it began, so that a
resumed reply counts what it generated before the interruption), then OpenAI's logit_bias (each
named token's bias added to its logit), then a call's response format (`grammar.Constraint`: the
tokens it does not allow at -inf), then temperature, top-k, top-p,
min-p, then an inverse-CDF draw over the surviving tokens in id order. Temperature 0 is greedy
(argmax, after the penalties).
The settings themselves (`SamplerSettings`) live in the torch-free `settings` module.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch

from .settings import SamplerSettings  # noqa: F401 (the settings `sample` applies, importable from here too)


def uniform(seed: int, position: int) -> float:
    """The draw in [0, 1) for the token at absolute `position` of a session seeded `seed`."""
    digest = hashlib.blake2b(f"kvstore:{seed}:{position}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) * 2.0 ** -53


def sample(logits: torch.Tensor, settings: SamplerSettings, *, seed: int, position: int,
           history: Sequence[int] = (), reply_start: int | None = None, allowed: torch.Tensor | None = None) -> int:
    """The token id at `position` from a float32 logits row `[vocab]`; `history`: the tokens before
    `position`, the reply's from `reply_start` (None: no reply penalties); `allowed`: a bool `[vocab]`
    mask of the tokens a response format allows (None: all)."""
    logits = logits.detach().to("cpu", torch.float32).reshape(-1)
    if settings.repetition_penalty != 1.0 and settings.repetition_window and history:
        logits = apply_repetition_penalty(logits, history[-settings.repetition_window:], settings.repetition_penalty)
    if (settings.presence_penalty or settings.frequency_penalty) and reply_start is not None \
            and len(history) > reply_start:
        logits = apply_reply_penalties(logits, history[reply_start:], settings.presence_penalty,
                                       settings.frequency_penalty)
    if settings.logit_bias:
        logits = apply_logit_bias(logits, settings.logit_bias)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    if settings.greedy:  # numpy's argmax: torch's, the first maximum (or NaN), in a tenth of its 100 µs here
        return int(logits.numpy().argmax())
    probs = probabilities(logits, settings)
    return draw(probs, uniform(seed, position))


def apply_repetition_penalty(logits: torch.Tensor, recent: Sequence[int], penalty: float) -> torch.Tensor:
    """Make tokens seen recently less likely: positive logits divided by `penalty`, negative multiplied."""
    ids = torch.tensor(sorted(set(recent)), dtype=torch.long)
    out = logits.clone()
    picked = out[ids]
    out[ids] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return out


def apply_reply_penalties(logits: torch.Tensor, generated: Sequence[int], presence: float,
                          frequency: float) -> torch.Tensor:
    """OpenAI's penalties: each token the reply has generated c times loses frequency x c + presence
    (float32, in that order)."""
    ids, counts = torch.unique(torch.tensor(list(generated), dtype=torch.long), return_counts=True)
    out = logits.clone()
    out[ids] = out[ids] - (counts.to(torch.float32) * frequency + presence)
    return out


def apply_logit_bias(logits: torch.Tensor, bias: tuple[tuple[int, float], ...]) -> torch.Tensor:
    """OpenAI's logit_bias: each named token's logit plus its bias (float32)."""
    ids = torch.tensor([token for token, _ in bias], dtype=torch.long)
    out = logits.clone()
    out[ids] = out[ids] + torch.tensor([b for _, b in bias], dtype=torch.float32)
    return out


def probabilities(logits: torch.Tensor, s: SamplerSettings) -> torch.Tensor:
    """Softmax at temperature over the tokens that survive top-k, top-p and min-p (others 0)."""
    scaled = logits / s.temperature
    keep = top_k_mask(scaled, s.top_k) & top_p_mask(scaled, s.top_p)
    probs = torch.softmax(scaled.masked_fill(~keep, float("-inf")), -1)
    if s.min_p > 0:
        probs = probs.masked_fill(min_p_mask(probs, s.min_p).logical_not(), 0.0)
    return probs / probs.sum()


def top_k_mask(logits: torch.Tensor, k: int) -> torch.Tensor:
    """True for the k highest logits (ties at the k-th value all kept); all True when k is 0."""
    if k <= 0 or k >= logits.numel():
        return torch.ones_like(logits, dtype=torch.bool)
    kth = torch.topk(logits, k).values[-1]
    return logits >= kth


def top_p_mask(logits: torch.Tensor, p: float) -> torch.Tensor:
    """True for the smallest set of most likely tokens whose probability reaches p."""
    if p >= 1.0:
        return torch.ones_like(logits, dtype=torch.bool)
    probs = torch.softmax(logits, -1)
    sorted_probs, order = torch.sort(probs, descending=True, stable=True)
    before = torch.cumsum(sorted_probs, -1) - sorted_probs  # mass of the strictly more likely tokens
    keep_sorted = before < p
    keep = torch.zeros_like(keep_sorted)
    keep[order] = keep_sorted
    return keep


def min_p_mask(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    """True for tokens at least min_p times as likely as the most likely one."""
    return probs >= min_p * probs.max()


def draw(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF pick over `probs` (in token-id order, float64 cumsum) for a uniform u in [0, 1)."""
    cdf = torch.cumsum(probs.to(torch.float64), -1)
    index = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True))
    # the first index whose cdf exceeds the target: its own probability is > 0
    assert probs[index] > 0, (index, u)
    return index
