"""The sampler's settings, without torch: what a front end or the store checks and records before
a model is loaded (an HTTP request, an archive's manifest, a new session's row).

`SamplerSettings` validates itself (`InvalidArgument` says which setting is wrong); `sampling`
applies it.
"""

from __future__ import annotations

import numbers
from dataclasses import asdict, dataclass, fields
from typing import Any

from ..errors import InvalidArgument

@dataclass(frozen=True)
class SamplerSettings:
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    repetition_window: int = 64  # how many previous tokens the penalty looks at

    def __post_init__(self):
        whole = lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool)  # noqa: E731
        checks = [
            (whole(self.top_k) and whole(self.repetition_window), "top_k and repetition_window must be integers"),
            (self.temperature >= 0, "temperature must be >= 0 (0 is greedy)"),
            (self.top_k >= 0, "top_k must be >= 0 (0 turns it off)"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p < 1, "min_p must be in [0, 1)"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0 (1 turns it off)"),
            (self.repetition_window >= 0, "repetition_window must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidArgument(f"bad sampler setting: {message}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

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
