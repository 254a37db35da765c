"""ModelConfig: the one description of a model's shape that every other module reads.

Built by `from_hf` (a Hugging Face `config.json` dict) or `from_gguf` (GGUF metadata); both
ignore keys they don't need and refuse, with `UnsupportedModel`, settings that would make our
output differ from the model's real behaviour.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .errors import UnsupportedModel

LLAMA_FAMILY = ("llama", "mistral", "qwen2")
ARCHITECTURES = LLAMA_FAMILY + ("gpt2",)


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
        if self.arch not in ("llama", "gpt2"):
            raise UnsupportedModel(f"architecture {self.arch!r} is not supported; use one of {ARCHITECTURES}")
        if not self.n_kv_heads:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.n_heads)
        if not self.intermediate_size:
            object.__setattr__(self, "intermediate_size", 4 * self.hidden_size)
        if self.n_heads % self.n_kv_heads:
            raise UnsupportedModel(f"{self.n_heads} heads do not group evenly over {self.n_kv_heads} KV heads")

    @property
    def kv_bytes_per_token_fp32(self) -> int:
        return self.n_layers * 2 * self.n_kv_heads * self.head_dim * 4

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "extra"}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    # -- Hugging Face ------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        model_type = cfg.get("model_type")
        if model_type == "gpt2":
            return cls._gpt2_from_hf(cfg)
        if model_type not in LLAMA_FAMILY:
            raise UnsupportedModel(
                f"model_type {model_type!r} is not supported; kvstore runs {', '.join(ARCHITECTURES)}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
        rope = cfg.get("rope_parameters") or {}
        theta = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
        scaling = _rope_scaling(cfg.get("rope_scaling") or rope)
        attention_bias = bool(cfg.get("attention_bias", False)) and model_type == "llama"
        return cls(
            arch="llama",
            variant=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=cfg["num_attention_heads"],
            n_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            head_dim=cfg.get("head_dim") or 0,
            intermediate_size=cfg["intermediate_size"],
            norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_context=_llama_context(cfg, model_type),
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or model_type == "qwen2",  # Qwen2 always has q/k/v bias
            o_bias=attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
        )

    @classmethod
    def _gpt2_from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        act = cfg.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise UnsupportedModel(f"GPT-2 activation {act!r} is not supported (only gelu_new)")
        if cfg.get("scale_attn_by_inverse_layer_idx") or cfg.get("reorder_and_upcast_attn"):
            raise UnsupportedModel("GPT-2 attention variants (inverse layer scaling, reorder) are not supported")
        n_embd = cfg["n_embd"]
        return cls(
            arch="gpt2",
            variant="gpt2",
            vocab_size=cfg["vocab_size"],
            hidden_size=n_embd,
            n_layers=cfg["n_layer"],
            n_heads=cfg["n_head"],
            intermediate_size=cfg.get("n_inner") or 4 * n_embd,
            norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
            max_context=cfg.get("n_positions", 1024),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        )

    # -- GGUF --------------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, meta: dict[str, Any], tensor_names: set[str]) -> "ModelConfig":
        arch = meta.get("general.architecture")

        def get(key, default=None):
            return meta.get(f"{arch}.{key}", default)

        if arch == "gpt2":
            return cls(
                arch="gpt2",
                variant="gpt2",
                vocab_size=_gguf_vocab(meta, get),
                hidden_size=get("embedding_length"),
                n_layers=get("block_count"),
                n_heads=get("attention.head_count"),
                intermediate_size=get("feed_forward_length"),
                norm_eps=get("attention.layer_norm_epsilon", 1e-5),
                max_context=get("context_length", 1024),
                tie_embeddings="output.weight" not in tensor_names,
            )
        if arch not in LLAMA_FAMILY:
            raise UnsupportedModel(
                f"GGUF architecture {arch!r} is not supported; kvstore runs {', '.join(ARCHITECTURES)}"
            )
        n_heads = get("attention.head_count")
        hidden = get("embedding_length")
        if get("attention.sliding_window"):
            raise UnsupportedModel(f"{arch} with a sliding attention window is not supported yet")
        scaling = None
        if get("rope.scaling.type") not in (None, "none"):
            scaling = _rope_scaling(
                {"rope_type": get("rope.scaling.type"), "factor": get("rope.scaling.factor")}
            )
        return cls(
            arch="llama",
            variant=arch,
            vocab_size=_gguf_vocab(meta, get),
            hidden_size=hidden,
            n_layers=get("block_count"),
            n_heads=n_heads,
            n_kv_heads=get("attention.head_count_kv") or n_heads,
            head_dim=get("attention.key_length") or get("rope.dimension_count") or hidden // n_heads,
            intermediate_size=get("feed_forward_length"),
            norm_eps=get("attention.layer_norm_rms_epsilon", 1e-5),
            max_context=get("context_length", 2048),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            tie_embeddings="output.weight" not in tensor_names,
            qkv_bias="blk.0.attn_q.bias" in tensor_names,
            o_bias="blk.0.attn_output.bias" in tensor_names,
            mlp_bias="blk.0.ffn_up.bias" in tensor_names,
        )


def _gguf_vocab(meta, get) -> int:
    tokens = meta.get("tokenizer.ggml.tokens")
    return get("vocab_size") or (len(tokens) if tokens is not None else 0)


def _llama_context(cfg: dict[str, Any], model_type: str) -> int:
    """The context length; a sliding window is exact up to its size, so the context stops there."""
    context = cfg.get("max_position_embeddings", 2048)
    window = cfg.get("sliding_window")
    uses_window = cfg.get("use_sliding_window", model_type == "mistral")
    if window and uses_window and window < context:
        return int(window)
    return int(context)


def _rope_scaling(spec: dict[str, Any]) -> dict[str, Any] | None:
    """Normalise HF `rope_scaling` / `rope_parameters` into the two kinds we implement."""
    kind = spec.get("rope_type") or spec.get("type") or "default"
    if kind == "default":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(spec["factor"])}
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        return {"rope_type": "llama3", **{k: float(spec[k]) for k in keys}}
    raise UnsupportedModel(f"rope scaling {kind!r} is not supported (only linear and llama3)")
