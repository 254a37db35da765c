"""GPT-2: learned positions, LayerNorm, tanh-GELU, fused `c_attn`; the same cache protocol as Llama.

Weights use our names (`layers.{i}.attn_qkv.weight`, already `[out, in]`: the loader transposes
HF's Conv1D); `forward(ids, pos, cache)` writes positions pos..pos+T-1 and attends to 0..pos+T-1;
`feed` and `head` split a forward's last row at the final hidden state, as Llama's do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import attend, attention_mask
from .cache import KVCache
from .config import ModelConfig
from .errors import UnsupportedModel


class GPT2:
    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor]):
        self.cfg = cfg
        self.w = w
        self.lm_head = w["wte"] if cfg.tie_embeddings else w["lm_head"]
        self.layers = [{k.split(".", 2)[2]: t for k, t in w.items() if k.startswith(f"layers.{i}.")}
                       for i in range(cfg.n_layers)]

    def forward(self, ids: torch.Tensor, pos: int, cache: KVCache | None, *, last_only: bool) -> torch.Tensor:
        """Logits (float32) for `ids` `[T]` at positions pos..pos+T-1: `[T, vocab]`, or `[1, vocab]`."""
        if last_only:
            return self.head(self.feed(ids, pos, cache))[None]
        return F.linear(self._final_norm(self._trunk(ids, pos, cache)), self.lm_head).float()

    def feed(self, ids: torch.Tensor, pos: int, cache: KVCache | None) -> torch.Tensor:
        """Write the K/V of `ids` `[T]`; the last one's final hidden state after `ln_f`: `[hidden]`."""
        return self._final_norm(self._trunk(ids, pos, cache)[-1:])[0]

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits `[vocab]` from a final hidden state `[hidden]` (`feed`'s)."""
        return F.linear(hidden[None], self.lm_head).float()[0]  # as a [1, hidden] row, like a chunk's last

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
        mask, causal = attention_mask(pos, T, ids.device)
        x = F.embedding(ids, w["wte"]) + w["wpe"][pos:pos + T]  # [T, hidden]
        for i, L in enumerate(self.layers):
            h = F.layer_norm(x, (h_size,), L["ln_1.weight"], L["ln_1.bias"], cfg.norm_eps)
            q, k, v = F.linear(h, L["attn_qkv.weight"], L["attn_qkv.bias"]).view(T, 3, nh, hd).unbind(1)
            o = attend(q, k, v, cache, i, pos, mask, causal)  # [T, hidden]
            x = x + F.linear(o, L["attn_out.weight"], L["attn_out.bias"])
            h = F.layer_norm(x, (h_size,), L["ln_2.weight"], L["ln_2.bias"], cfg.norm_eps)
            h = F.gelu(F.linear(h, L["fc.weight"], L["fc.bias"]), approximate="tanh")
            x = x + F.linear(h, L["proj.weight"], L["proj.bias"])
        if cache is not None:
            cache.advance(pos + T)
        return x
