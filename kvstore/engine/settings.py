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

WRITTEN_WHEN_ON = ("presence_penalty", "frequency_penalty")  # see SamplerSettings.to_dict


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
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2] (0 turns it off)"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2] (0 turns it off)"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidArgument(f"bad sampler setting: {message}")

    def to_dict(self) -> dict[str, Any]:
        """The settings as a session's row and an archive's manifest record them. The penalties added
        after archive format v5 only where they are on: a session that does not use them is written
        as before, so older versions read it."""
        return {k: v for k, v in asdict(self).items() if k not in WRITTEN_WHEN_ON or v}

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
