"""The sampler's settings, without torch: what a front end or the store checks and records before
a model is loaded (an HTTP request, an archive's manifest, a new session's row).

`SamplerSettings` validates itself (`InvalidArgument` says which setting is wrong); `sampling`
applies it.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, fields
from typing import Any

from ..errors import InvalidArgument

WRITTEN_WHEN_ON = ("presence_penalty", "frequency_penalty", "logit_bias")  # see SamplerSettings.to_dict
MAX_LOGIT_BIAS = 1024  # tokens one logit_bias may name
BIAS_RANGE = 100.0  # a logit_bias value lies in [-100, 100], as OpenAI bounds it


@dataclass(frozen=True)
class SamplerSettings:
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    repetition_window: int = 64  # how many previous tokens the penalty looks at
    presence_penalty: float = 0.0  # OpenAI's: off each token the reply has generated already (0: off)
    frequency_penalty: float = 0.0  # OpenAI's: off each token, times how often the reply has generated it (0: off)
    # OpenAI's: (token id, a number added to its logit) pairs in id order, () off; given as such pairs
    # or as a {token id: bias} mapping (ids as integers, or digit strings as JSON object keys are)
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "logit_bias", bias_pairs(self.logit_bias))
        whole = lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool)  # noqa: E731
        checks = [
            (whole(self.top_k) and whole(self.repetition_window), "top_k and repetition_window must be integers"),
            (self.temperature >= 0, "temperature must be >= 0 (0 is greedy)"),
            (self.top_k >= 0, "top_k must be >= 0 (0 turns it off)"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p < 1, "min_p must be in [0, 1)"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0 (1 turns it off)"),
            (self.repetition_window >= 0, "repetition_window must be >= 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2] (0 turns it off)"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2] (0 turns it off)"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidArgument(f"bad sampler setting: {message}")

    def to_dict(self) -> dict[str, Any]:
        """The settings as a session's row and an archive's manifest record them. The penalties and
        logit_bias (as [id, bias] pairs), added after archive format v5, only where they are on: a
        session that does not use them is written as before, so older versions read it."""
        out = {k: v for k, v in asdict(self).items() if k not in WRITTEN_WHEN_ON or v}
        if self.logit_bias:
            out["logit_bias"] = [[token, bias] for token, bias in self.logit_bias]
        return out

    def check_vocab(self, vocab_size: int) -> None:
        """InvalidArgument when logit_bias names a token id the model (`vocab_size` logits) does not have."""
        if self.logit_bias and self.logit_bias[-1][0] >= vocab_size:
            raise InvalidArgument(f"bad sampler setting: logit_bias names token id {self.logit_bias[-1][0]}; "
                                  f"this model's token ids are 0..{vocab_size - 1}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplerSettings":
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise InvalidArgument(f"unknown sampler setting(s): {', '.join(sorted(unknown))}")
        return cls(**d)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def bias_pairs(value: Any) -> tuple[tuple[int, float], ...]:
    """A logit_bias as given (see SamplerSettings) -> (token id, bias) pairs in id order, each bias a
    float; InvalidArgument naming what is wrong."""
    bad = ("bad sampler setting: logit_bias maps token ids (integers >= 0) to numbers in "
           f"[-{BIAS_RANGE:g}, {BIAS_RANGE:g}], at most {MAX_LOGIT_BIAS} of them")
    if isinstance(value, dict):
        items = list(value.items())
    else:
        try:
            items = [tuple(pair) for pair in value]
        except TypeError:
            raise InvalidArgument(bad) from None
    pairs: dict[int, float] = {}
    for pair in items:
        if len(pair) != 2:
            raise InvalidArgument(bad)
        token, bias = pair
        if isinstance(token, str) and token.isascii() and token.isdigit():
            token = int(token)
        whole = isinstance(token, numbers.Integral) and not isinstance(token, bool)
        number = isinstance(bias, numbers.Real) and not isinstance(bias, bool)
        if not (whole and token >= 0 and number and math.isfinite(bias) and abs(bias) <= BIAS_RANGE):
            raise InvalidArgument(f"{bad} (not {token!r}: {bias!r})")
        pairs[int(token)] = float(bias)
    if len(pairs) > MAX_LOGIT_BIAS:
        raise InvalidArgument(f"{bad} (got {len(pairs)})")
    return tuple(sorted(pairs.items()))
