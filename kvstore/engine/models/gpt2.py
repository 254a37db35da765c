"""GPT-2, all of it: config readers, weight names, forward. The same cache protocol as Llama.

- **Config**: `config_from_hf` (model_type gpt2) and `config_from_gguf`; activation and attention
  variants this forward does not implement are refused.
- **Weights**: `LAYER` and `GLOBAL` map our names (`layers.{i}.attn_qkv.weight`, ...) to the
  file's; Hugging Face stores the Conv1D weights `[in, out]`, so `stored_shape` checks them as such
  and `sanitize` transposes them to our `[out, in]`.
- **Forward**: learned positions, LayerNorm, tanh-GELU, fused `c_attn`; `forward(ids, pos, cache)`
  writes positions pos..pos+T-1 and attends to 0..pos+T-1; `feed` and `head` split a forward's
  last row at the final hidden state, as Llama's do.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ...errors import UnsupportedModel
from ..attention import attend, causal_mask
from ..cache import KVCache
from ..config import ModelConfig, gguf_vocab
from ..ops import embed, project
from ..quant import dense, packed
from ..weights import HF, per_layer

HF_MODEL_TYPES = ("gpt2",)
GGUF_ARCHITECTURES = ("gpt2",)


# -- config ------------------------------------------------------------------------------------------
def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    act = cfg.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise UnsupportedModel(f"GPT-2 activation {act!r} is not supported (only gelu_new)")
    if cfg.get("scale_attn_by_inverse_layer_idx") or cfg.get("reorder_and_upcast_attn"):
        raise UnsupportedModel("GPT-2 attention variants (inverse layer scaling, reorder) are not supported")
    n_embd = cfg["n_embd"]
    return ModelConfig(
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


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    def get(key, default=None):
        return meta.get(f"gpt2.{key}", default)

    return ModelConfig(
        arch="gpt2",
        variant="gpt2",
        vocab_size=gguf_vocab(meta, "gpt2"),
        hidden_size=get("embedding_length"),
        n_layers=get("block_count"),
        n_heads=get("attention.head_count"),
        intermediate_size=get("feed_forward_length"),
        norm_eps=get("attention.layer_norm_epsilon", 1e-5),
        max_context=get("context_length", 1024),
        tie_embeddings="output.weight" not in tensor_names,
    )


# -- weights -----------------------------------------------------------------------------------------
LAYER = {  # ours (under `layers.{i}.`): (GGUF name, Hugging Face name)
    "ln_1.weight": ("blk.{}.attn_norm.weight", "h.{}.ln_1.weight"),
    "ln_1.bias": ("blk.{}.attn_norm.bias", "h.{}.ln_1.bias"),
    "attn_qkv.weight": ("blk.{}.attn_qkv.weight", "h.{}.attn.c_attn.weight"),
    "attn_qkv.bias": ("blk.{}.attn_qkv.bias", "h.{}.attn.c_attn.bias"),
    "attn_out.weight": ("blk.{}.attn_output.weight", "h.{}.attn.c_proj.weight"),
    "attn_out.bias": ("blk.{}.attn_output.bias", "h.{}.attn.c_proj.bias"),
    "ln_2.weight": ("blk.{}.ffn_norm.weight", "h.{}.ln_2.weight"),
    "ln_2.bias": ("blk.{}.ffn_norm.bias", "h.{}.ln_2.bias"),
    "fc.weight": ("blk.{}.ffn_up.weight", "h.{}.mlp.c_fc.weight"),
    "fc.bias": ("blk.{}.ffn_up.bias", "h.{}.mlp.c_fc.bias"),
    "proj.weight": ("blk.{}.ffn_down.weight", "h.{}.mlp.c_proj.weight"),
    "proj.bias": ("blk.{}.ffn_down.bias", "h.{}.mlp.c_proj.bias"),
}
GLOBAL = {
    "wte": ("token_embd.weight", "wte.weight"),
    "wpe": ("position_embd.weight", "wpe.weight"),
    "ln_f.weight": ("output_norm.weight", "ln_f.weight"),
    "ln_f.bias": ("output_norm.bias", "ln_f.bias"),
    "lm_head": ("output.weight", "lm_head.weight"),
}
CONV1D = ("attn_qkv.weight", "attn_out.weight", "fc.weight", "proj.weight")  # [in, out] in HF files


def shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our tensor names -> shapes, for exactly the tensors this config needs."""
    h, ff = cfg.hidden_size, cfg.intermediate_size
    out = {"wte": (cfg.vocab_size, h), "wpe": (cfg.max_context, h), "ln_f.weight": (h,), "ln_f.bias": (h,)}
    if not cfg.tie_embeddings:
        out["lm_head"] = (cfg.vocab_size, h)
    layer = {"ln_1.weight": (h,), "ln_1.bias": (h,), "attn_qkv.weight": (3 * h, h), "attn_qkv.bias": (3 * h,),
             "attn_out.weight": (h, h), "attn_out.bias": (h,), "ln_2.weight": (h,), "ln_2.bias": (h,),
             "fc.weight": (ff, h), "fc.bias": (ff,), "proj.weight": (h, ff), "proj.bias": (h,)}
    return out | per_layer(cfg, layer)


def optional(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {}


def _conv1d(ours: str, kind: int) -> bool:
    return kind == HF and ours.split(".", 2)[-1] in CONV1D


def stored_shape(cfg: ModelConfig, ours: str, kind: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """`shape` as the source stores it: HF's Conv1D weights are [in, out]."""
    return shape[::-1] if _conv1d(ours, kind) else shape


def sanitize(cfg: ModelConfig, ours: str, t: torch.Tensor, kind: int) -> torch.Tensor:
    return t.t().contiguous() if _conv1d(ours, kind) else t


# -- the forward ---------------------------------------------------------------------------------------
class GPT2:
    def __init__(self, cfg: ModelConfig, w: dict[str, Any]):
        """`w`: our names -> dense tensors (the model dtype) or `quant.Blocks` (packed here; the
        position table is read by slices, so it is kept dense)."""
        self.cfg = cfg
        self.dtype = w["ln_f.weight"].dtype
        self.w = {k: packed(t) for k, t in w.items()}
        self.w["wpe"] = dense(w["wpe"], self.dtype)
        self.lm_head = self.w["wte"] if cfg.tie_embeddings else self.w["lm_head"]
        self.layers = [{k.split(".", 2)[2]: t for k, t in self.w.items() if k.startswith(f"layers.{i}.")}
                       for i in range(cfg.n_layers)]

    def forward(self, ids: torch.Tensor, pos: int, cache: KVCache | None, *, last_only: bool) -> torch.Tensor:
        """Logits (float32) for `ids` `[T]` at positions pos..pos+T-1: `[T, vocab]`, or `[1, vocab]`."""
        if last_only:
            return self.head(self.feed(ids, pos, cache))[None]
        return project(self._final_norm(self._trunk(ids, pos, cache)), self.lm_head).float()

    def feed(self, ids: torch.Tensor, pos: int, cache: KVCache | None) -> torch.Tensor:
        """Write the K/V of `ids` `[T]`; the last one's final hidden state after `ln_f`: `[hidden]`."""
        return self._final_norm(self._trunk(ids, pos, cache)[-1:])[0]

    def feed_all(self, ids: torch.Tensor, pos: int, cache: KVCache | None) -> torch.Tensor:
        """`feed` that keeps every row: the final hidden states after `ln_f`, `[T, hidden]`; the last row
        computed as `feed` computes it."""
        x = self._trunk(ids, pos, cache)
        return torch.cat([self._final_norm(x[:-1]), self._final_norm(x[-1:])])

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits `[vocab]` from a final hidden state `[hidden]` (`feed`'s)."""
        return project(hidden[None], self.lm_head).float()[0]  # as a [1, hidden] row, like a chunk's last

    def _final_norm(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        return F.layer_norm(x, (self.cfg.hidden_size,), w["ln_f.weight"], w["ln_f.bias"], self.cfg.norm_eps)

    def _trunk(self, ids: torch.Tensor, pos: int, cache: KVCache | None) -> torch.Tensor:
        """The residual stream `[T, hidden]` after the last block, K/V written into `cache`."""
        cfg, w = self.cfg, self.w
        T = ids.shape[0]
        if pos + T > cfg.max_context:
            raise UnsupportedModel(f"GPT-2 has {cfg.max_context} learned positions; position {pos + T - 1} is past them")
        nh, hd, h_size = cfg.n_heads, cfg.head_dim, cfg.hidden_size
        mask = causal_mask(pos, T, self.dtype, ids.device)
        x = embed(ids, w["wte"], self.dtype) + w["wpe"][pos:pos + T]  # [T, hidden]
        for i, L in enumerate(self.layers):
            h = F.layer_norm(x, (h_size,), L["ln_1.weight"], L["ln_1.bias"], cfg.norm_eps)
            qkv = project(h, L["attn_qkv.weight"], L["attn_qkv.bias"]).view(T, 3, nh, hd)  # q | k | v per token
            o = attend(qkv[:, 0], qkv[:, 1:], cache, i, pos, mask)  # k | v: cache rows [T, 2, nh, hd]
            x = x + project(o, L["attn_out.weight"], L["attn_out.bias"])
            h = F.layer_norm(x, (h_size,), L["ln_2.weight"], L["ln_2.bias"], cfg.norm_eps)
            h = F.gelu(project(h, L["fc.weight"], L["fc.bias"]), approximate="tanh")
            x = x + project(h, L["proj.weight"], L["proj.bias"])
        return x


Net = GPT2
