"""ModelConfig: the one description of a model's shape that every other module reads.

A frozen dataclass with derived fields filled in `__post_init__`. The readers that build one from a
Hugging Face `config.json` or from GGUF metadata belong to each architecture (`models/llama.py`,
`models/gpt2.py`); `models.config_from_hf` / `models.config_from_gguf` pick the architecture.
They ignore keys they don't need and refuse, with `UnsupportedModel`, settings that would make
our output differ from the model's real behaviour.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..errors import UnsupportedModel

ARCHITECTURES = ("llama", "gpt2")  # the forwards kvstore has (`models.ARCHITECTURES` maps them to modules)


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "llama" (covers mistral, qwen2) or "gpt2"
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int = 0  # 0: same as n_heads
    head_dim: int = 0  # 0: hidden_size // n_heads
    intermediate_size: int = 0
    norm_eps: float = 1e-5
    max_context: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "llama3"|"linear", ...}
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    variant: str = ""  # the source's own name for the architecture (qwen2, mistral, ...)
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if self.arch not in ARCHITECTURES:
            raise UnsupportedModel(f"architecture {self.arch!r} is not supported; use one of {ARCHITECTURES}")
        if not self.n_kv_heads:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.n_heads)
        if not self.intermediate_size:
            object.__setattr__(self, "intermediate_size", 4 * self.hidden_size)
        if self.n_heads % self.n_kv_heads:
            raise UnsupportedModel(f"{self.n_heads} heads do not group evenly over {self.n_kv_heads} KV heads")

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "extra"}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def gguf_vocab(meta: dict[str, Any], arch: str) -> int:
    """The vocabulary size a GGUF file declares, else the length of its token list."""
    tokens = meta.get("tokenizer.ggml.tokens")
    return meta.get(f"{arch}.vocab_size") or (len(tokens) if tokens is not None else 0)
