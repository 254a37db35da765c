"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2): one forward over our tensor names.

RMSNorm, rotary embeddings (plain, linear or Llama-3 scaled, or GGUF `rope_freqs` factors),
grouped-query attention through `F.scaled_dot_product_attention`, SwiGLU, optional biases, tied or
untied embeddings. Weights are plain tensors and Q/K/V (and gate/up) are fused into one matmul each:
at this model size Python overhead per op, not FLOPs, bounds decode speed. Speaks the KVCache
protocol: `forward(ids, pos, cache)` writes positions pos..pos+T-1 and attends to 0..pos+T-1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention import attend, attention_mask
from .cache import KVCache
from .config import ModelConfig

ROPE_BLOCK = 1024  # positions per rotary table block


@dataclass
class Layer:
    attn_norm: torch.Tensor
    wqkv: torch.Tensor  # [(n_heads + 2 n_kv_heads) head_dim, hidden]
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    mlp_norm: torch.Tensor
    w_gate_up: torch.Tensor  # [2 ffn, hidden]
    b_gate_up: torch.Tensor | None
    w_down: torch.Tensor
    b_down: torch.Tensor | None


def inv_frequencies(cfg: ModelConfig, rope_freqs: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary inverse frequencies `[head_dim // 2]` in float32, scaling applied."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    if rope_freqs is not None:  # GGUF stores Llama-3 scaling as per-frequency divisors
        return inv / rope_freqs.float()
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") == "linear":
        return inv / scaling["factor"]
    if scaling.get("rope_type") == "llama3":
        return _llama3_scaled(inv, scaling)
    return inv


def _llama3_scaled(inv: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high, old_ctx = s["factor"], s["low_freq_factor"], s["high_freq_factor"], s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class Llama:
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor]):
        self.cfg = cfg
        self.embed = w["embed"]
        self.norm = w["norm"]
        self.lm_head = w["embed"] if cfg.tie_embeddings else w["lm_head"]
        self.layers = [self._layer(w, i) for i in range(cfg.n_layers)]
        self.inv_freq = inv_frequencies(cfg, w.get("rope_freqs")).to(self.embed.device)
        self._rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    @staticmethod
    def _layer(w: dict[str, torch.Tensor], i: int) -> Layer:
        p = f"layers.{i}."
        get = lambda k: w.get(p + k)  # noqa: E731
        cat = lambda *ks: torch.cat([w[p + k] for k in ks]) if all(p + k in w for k in ks) else None  # noqa: E731
        return Layer(attn_norm=get("attn_norm"), wqkv=cat("wq", "wk", "wv"), bqkv=cat("bq", "bk", "bv"),
                     wo=get("wo"), bo=get("bo"), mlp_norm=get("mlp_norm"), w_gate_up=cat("w_gate", "w_up"),
                     b_gate_up=cat("b_gate", "b_up"), w_down=get("w_down"), b_down=get("b_down"))

    def rope(self, pos: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for positions pos..pos+n-1, `[n, 1, head_dim]` in the model dtype.

        The table grows by whole blocks, each computed from its own positions only, so the bits for
        a position never depend on how long the table happened to be (resume, fork, trim).
        """
        end = pos + n
        while self._rope_cache is None or self._rope_cache[0].shape[0] < end:
            start = 0 if self._rope_cache is None else self._rope_cache[0].shape[0]
            cos, sin = self._rope_block(start)
            if self._rope_cache is not None:
                cos, sin = torch.cat([self._rope_cache[0], cos]), torch.cat([self._rope_cache[1], sin])
            self._rope_cache = (cos, sin)
        cos, sin = self._rope_cache
        return cos[pos:end], sin[pos:end]

    def _rope_block(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(start, start + ROPE_BLOCK, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(t, self.inv_freq)  # [ROPE_BLOCK, hd/2]
        cos, sin = freqs.cos(), freqs.sin()
        dtype = self.embed.dtype
        # rotate_half(x) * sin == cat(x2, x1) * cat(-sin, sin): fold the sign into the table
        return torch.cat([cos, cos], -1).to(dtype)[:, None], torch.cat([-sin, sin], -1).to(dtype)[:, None]

    def forward(self, ids: torch.Tensor, pos: int, cache: KVCache | None, *, last_only: bool) -> torch.Tensor:
        """Logits (float32) for `ids` `[T]` at positions pos..pos+T-1: `[T, vocab]`, or `[1, vocab]`."""
        cfg = self.cfg
        T = ids.shape[0]
        nh, nkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        cos, sin = self.rope(pos, T)
        mask, causal = attention_mask(pos, T, ids.device)
        x = F.embedding(ids, self.embed)  # [T, hidden]
        for i, L in enumerate(self.layers):
            h = rms_norm(x, L.attn_norm, cfg.norm_eps)
            qkv = F.linear(h, L.wqkv, L.bqkv)  # [T, (nh + 2 nkv) hd]
            qk = qkv[:, : (nh + nkv) * hd].view(T, nh + nkv, hd)
            half = hd // 2
            qk = qk * cos + torch.cat([qk[..., half:], qk[..., :half]], -1) * sin
            v = qkv[:, (nh + nkv) * hd:].view(T, nkv, hd)
            o = attend(qk[:, :nh], qk[:, nh:], v, cache, i, pos, mask, causal)  # [T, nh hd]
            x = x + F.linear(o, L.wo, L.bo)
            h = rms_norm(x, L.mlp_norm, cfg.norm_eps)
            gate, up = F.linear(h, L.w_gate_up, L.b_gate_up).chunk(2, -1)  # [T, ffn] each
            x = x + F.linear(F.silu(gate) * up, L.w_down, L.b_down)
        if cache is not None:
            cache.advance(pos + T)
        if last_only:
            x = x[-1:]
        return F.linear(rms_norm(x, self.norm, cfg.norm_eps), self.lm_head).float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, like the reference implementation."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
