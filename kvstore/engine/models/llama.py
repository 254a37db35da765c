"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2), all of it: config readers, weight names, forward.

- **Config**: `config_from_hf` (a `config.json` of model_type llama, mistral or qwen2) and
  `config_from_gguf` (GGUF metadata), refusing what this forward does not implement.
- **Weights**: `LAYER` and `GLOBAL` map our tensor names to the file's (GGUF, Hugging Face; `{}` is
  the layer index); `shapes` says which tensors a config needs and their shapes; `sanitize` undoes
  llama.cpp's Q/K row permutation (`unpermute_rows`; Qwen2 files are not permuted).
- **Forward**: RMSNorm, rotary embeddings (plain, linear or Llama-3 scaled, or GGUF `rope_freqs`
  factors), grouped-query attention (`attention.attend`), SwiGLU, optional biases, tied or untied
  embeddings. Speaks the KVCache protocol: `forward(ids, pos, cache)` writes positions
  pos..pos+T-1 and attends to 0..pos+T-1. `feed` stops at the last token's final hidden state
  (normalized) and `head` turns that into logits, so a session can keep the state, a `[hidden]`
  vector, and compute the next logits from it after a resume with the very kernel call a
  forward makes (`forward(last_only=True)` is `head(feed(...))`).

Speed at this size is a matter of kernel calls, not FLOPs: Q/K/V and gate/up are fused into one
matmul each, the residual add rides in the matmul (addmm/addmv), RMSNorm, SwiGLU and rotary are one
pass each (`ops`: kvstore's native bfloat16 kernels where the CPU allows; rotary in place),
K|V land in the cache with one copy. A chunk takes matrix kernels; one token (the decode
loop) takes matrix-vector kernels where the weights are dense (`ops.linear`). Which path and kernels run
depends on T alone, so a forward over [pos, pos+T) gives the same bits whatever ran
before, the cache's capacity or the rotary table's length (contract C1's premise).

Where every product is block-quantized without a bias, in bfloat16 on the CPU, and the native
attention reads the items' caches (one cache, or one paged pool), the layer loop of `_rows` runs as
one native call (`native.layers()`, layers.cpp): the same kernels' steps in the same order on the same
arguments, so the same bits (tests/test_native_layers.py), without Python's dispatch between them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...errors import UnsupportedModel
from .. import native
from ..attention import Batch, attend_items
from ..cache import KVCache
from ..config import ModelConfig, gguf_vocab
from ..ops import Weight, embed, linear, matvec, rms_norm, rotate_, rows_add_linear, rows_linear, swiglu
from ..quant import KINDS, Blocks, Packed, fuse, packed
from ..rows import Item, spans_of
from ..weights import GGUF, per_layer

HF_MODEL_TYPES = ("llama", "mistral", "qwen2")
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2")
ROPE_BLOCK = 1024  # positions per rotary table block


# -- config ------------------------------------------------------------------------------------------
def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    model_type = cfg.get("model_type")
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
    rope = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
    scaling = _rope_scaling(cfg.get("rope_scaling") or rope)
    attention_bias = bool(cfg.get("attention_bias", False)) and model_type == "llama"
    return ModelConfig(
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
        max_context=_hf_context(cfg, model_type),
        rope_theta=float(theta),
        rope_scaling=scaling,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias or model_type == "qwen2",  # Qwen2 always has q/k/v bias
        o_bias=attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
    )


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    arch = meta.get("general.architecture")

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    n_heads = get("attention.head_count")
    hidden = get("embedding_length")
    if get("attention.sliding_window"):
        raise UnsupportedModel(f"{arch} with a sliding attention window is not supported yet")
    scaling = None
    if get("rope.scaling.type") not in (None, "none"):
        scaling = _rope_scaling({"rope_type": get("rope.scaling.type"), "factor": get("rope.scaling.factor")})
    return ModelConfig(
        arch="llama",
        variant=arch,
        vocab_size=gguf_vocab(meta, arch),
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


def _hf_context(cfg: dict[str, Any], model_type: str) -> int:
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


# -- weights -----------------------------------------------------------------------------------------
LAYER = {  # ours (under `layers.{i}.`): (GGUF name, Hugging Face name)
    "attn_norm": ("blk.{}.attn_norm.weight", "model.layers.{}.input_layernorm.weight"),
    "wq": ("blk.{}.attn_q.weight", "model.layers.{}.self_attn.q_proj.weight"),
    "wk": ("blk.{}.attn_k.weight", "model.layers.{}.self_attn.k_proj.weight"),
    "wv": ("blk.{}.attn_v.weight", "model.layers.{}.self_attn.v_proj.weight"),
    "wo": ("blk.{}.attn_output.weight", "model.layers.{}.self_attn.o_proj.weight"),
    "bq": ("blk.{}.attn_q.bias", "model.layers.{}.self_attn.q_proj.bias"),
    "bk": ("blk.{}.attn_k.bias", "model.layers.{}.self_attn.k_proj.bias"),
    "bv": ("blk.{}.attn_v.bias", "model.layers.{}.self_attn.v_proj.bias"),
    "bo": ("blk.{}.attn_output.bias", "model.layers.{}.self_attn.o_proj.bias"),
    "mlp_norm": ("blk.{}.ffn_norm.weight", "model.layers.{}.post_attention_layernorm.weight"),
    "w_gate": ("blk.{}.ffn_gate.weight", "model.layers.{}.mlp.gate_proj.weight"),
    "w_up": ("blk.{}.ffn_up.weight", "model.layers.{}.mlp.up_proj.weight"),
    "w_down": ("blk.{}.ffn_down.weight", "model.layers.{}.mlp.down_proj.weight"),
    "b_gate": ("blk.{}.ffn_gate.bias", "model.layers.{}.mlp.gate_proj.bias"),
    "b_up": ("blk.{}.ffn_up.bias", "model.layers.{}.mlp.up_proj.bias"),
    "b_down": ("blk.{}.ffn_down.bias", "model.layers.{}.mlp.down_proj.bias"),
}
GLOBAL = {
    "embed": ("token_embd.weight", "model.embed_tokens.weight"),
    "norm": ("output_norm.weight", "model.norm.weight"),
    "lm_head": ("output.weight", "lm_head.weight"),
    "rope_freqs": ("rope_freqs.weight", None),
}


def shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our tensor names -> shapes, for exactly the tensors this config needs."""
    h, q, kv, ff = cfg.hidden_size, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.intermediate_size
    out = {"embed": (cfg.vocab_size, h), "norm": (h,)}
    if not cfg.tie_embeddings:
        out["lm_head"] = (cfg.vocab_size, h)
    layer = {"attn_norm": (h,), "wq": (q, h), "wk": (kv, h), "wv": (kv, h), "wo": (h, q), "mlp_norm": (h,),
             "w_gate": (ff, h), "w_up": (ff, h), "w_down": (h, ff)}
    if cfg.qkv_bias:
        layer.update(bq=(q,), bk=(kv,), bv=(kv,))
    if cfg.o_bias:
        layer["bo"] = (h,)
    if cfg.mlp_bias:
        layer.update(b_gate=(ff,), b_up=(ff,), b_down=(h,))
    return out | per_layer(cfg, layer)


def optional(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Tensors read when the file has them: GGUF's Llama-3 rope factors, kept in float32."""
    return {"rope_freqs": ((cfg.head_dim // 2,), torch.float32)}


def stored_shape(cfg: ModelConfig, ours: str, kind: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    return shape  # both sources store [out, in]


def sanitize(cfg: ModelConfig, ours: str, t: torch.Tensor, kind: int) -> torch.Tensor:
    key = ours.rsplit(".", 1)[-1]
    if kind == GGUF and cfg.variant != "qwen2" and key in ("wq", "bq", "wk", "bk"):
        heads = cfg.n_heads if key in ("wq", "bq") else cfg.n_kv_heads
        if isinstance(t, Blocks):  # rows are whole runs of blocks: they move as they are
            return t.map_rows(lambda raw: unpermute_rows(raw, heads))
        return unpermute_rows(t, heads)
    return t


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K permutation (interleaved rotary pairs -> two halves per head)."""
    rows = w.shape[0]
    # [n_heads, 2 (halves), head_dim // 2, ...] <- [n_heads, head_dim // 2, 2 (pair), ...]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# -- the forward ---------------------------------------------------------------------------------------
@dataclass
class Layer:
    attn_norm2: torch.Tensor  # the norm weights twice over: see rms_norm
    wqkv: Weight  # [(n_heads + 2 n_kv_heads) head_dim, hidden]
    bqkv: torch.Tensor | None
    wo: Weight
    bo: torch.Tensor | None
    mlp_norm2: torch.Tensor
    w_gate_up: Weight  # [2 ffn, hidden]
    b_gate_up: torch.Tensor | None
    w_down: Weight
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
    def __init__(self, cfg: ModelConfig, w: dict[str, Any]):
        """`w`: our names -> dense tensors (the model dtype) or `quant.Blocks` (packed here)."""
        self.cfg = cfg
        self.dtype, self.device = w["norm"].dtype, w["norm"].device
        self.embed = packed(w["embed"])
        self.norm2 = torch.cat([w["norm"], w["norm"]])
        self.lm_head = self.embed if cfg.tie_embeddings else packed(w["lm_head"])
        self.layers = [self._layer(w, i) for i in range(cfg.n_layers)]
        self.inv_freq = inv_frequencies(cfg, w.get("rope_freqs")).to(self.device)
        self._rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self._stack = self._stack_args()
        if self._stack is not None:
            native.layers()  # settled now: a first build on this machine belongs to loading, not to a forward

    def _stack_args(self) -> tuple[list[torch.Tensor], list[int], list[torch.Tensor]] | None:
        """What `native.layers()` takes of the weights (per layer the four products' packed data, their
        (kind, rows, cols), the two norms), where it computes this model's layers: bfloat16 on the CPU,
        every product block-quantized (the kernel `ops.linear` picks for them at any row count), no
        biases. Else None: the layers run one by one (`_rows`)."""
        if self.dtype is not torch.bfloat16 or self.device.type != "cpu":
            return None
        weights, meta, norms = [], [], []
        for L in self.layers:
            products = (L.wqkv, L.wo, L.w_gate_up, L.w_down)
            if not all(isinstance(w, Packed) for w in products) or any(
                    b is not None for b in (L.bqkv, L.bo, L.b_gate_up, L.b_down)):
                return None
            for w in products:
                weights.append(w.data)
                meta += [KINDS[w.kind], w.rows, w.cols]
            norms += [L.attn_norm2, L.mlp_norm2]
        return weights, meta, norms

    def _layer(self, w: dict[str, Any], i: int) -> Layer:
        p = f"layers.{i}."
        get = lambda k: packed(w.get(p + k))  # noqa: E731
        cat = lambda *ks: packed(fuse([w[p + k] for k in ks], self.dtype)) if all(p + k in w for k in ks) else None  # noqa: E731
        return Layer(attn_norm2=cat("attn_norm", "attn_norm"), wqkv=cat("wq", "wk", "wv"), bqkv=cat("bq", "bk", "bv"),
                     wo=get("wo"), bo=get("bo"), mlp_norm2=cat("mlp_norm", "mlp_norm"), w_gate_up=cat("w_gate", "w_up"),
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
        """cos and signed sin of positions start..start+ROPE_BLOCK-1, `[ROPE_BLOCK, 1, head_dim]` each.

        The angles are float32 products position x inverse frequency (each rounded once, as HF's);
        their cos and sin are taken in float64 by numpy on this thread and rounded to float32, then
        to the model dtype. So every entry is the float32 rounding of the exact value (numpy's float64
        error is far below it), the same in every process and on every CPU. torch's float32 cos is
        not: on the CPU it is MKL's, which computes part of a long tensor on a second thread and
        there took another code path in about one process in eight (Intel Xeon with AMX: half of a
        block's cos entries off by up to a few bfloat16 ulps), so a session continued in another
        process decoded other bits now and then."""
        t = np.arange(start, start + ROPE_BLOCK, dtype=np.float32)
        freqs = np.outer(t, self.inv_freq.cpu().numpy()).astype(np.float64)  # [ROPE_BLOCK, hd/2] float32 angles
        cos, sin = (torch.from_numpy(f(freqs)).float().to(self.device) for f in (np.cos, np.sin))
        dtype = self.dtype
        # rotate_half(x) * sin == cat(x2, x1) * cat(-sin, sin): fold the sign into the table
        return torch.cat([cos, cos], -1).to(dtype)[:, None], torch.cat([-sin, sin], -1).to(dtype)[:, None]

    def rope_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin of each row's position `[R]` -> `[R, 1, head_dim]` each (rows of `rope`'s table)."""
        self.rope(0, int(positions.max()) + 1)  # the table reaches the last one
        cos, sin = self._rope_cache
        return cos[positions], sin[positions]

    def forward(self, ids: torch.Tensor, pos: int, cache: KVCache | None, *, last_only: bool) -> torch.Tensor:
        """Logits (float32) for `ids` `[T]` at positions pos..pos+T-1: `[T, vocab]`, or `[1, vocab]`."""
        if last_only:
            return self.head(self.feed(ids, pos, cache))[None]
        x = self._rows([Item(ids, pos, cache)])
        return linear(rms_norm(x, self.norm2, self.cfg.norm_eps), self.lm_head).float()

    def feed(self, ids: torch.Tensor, pos: int, cache: KVCache | None) -> torch.Tensor:
        """Write the K/V of `ids` `[T]` at positions pos..pos+T-1; the last one's final hidden state,
        normalized: `[hidden]`, what `head` turns into the logits that predict the next token."""
        return self.feed_rows([Item(ids, pos, cache)])[0]

    def feed_all(self, ids: torch.Tensor, pos: int, cache: KVCache | None) -> torch.Tensor:
        """`feed` that keeps every row: the final hidden states of `ids` `[T]`, normalized, `[T, hidden]`;
        the last row is `feed`'s state, computed as `feed` computes it (the same bits)."""
        x = self._rows([Item(ids, pos, cache)])
        last = rms_norm(x[torch.tensor([x.shape[0] - 1], device=x.device)], self.norm2, self.cfg.norm_eps)
        return torch.cat([rms_norm(x[:-1], self.norm2, self.cfg.norm_eps), last]) if x.shape[0] > 1 else last

    def feed_rows(self, items: list[Item]) -> torch.Tensor:
        """`feed` of several sequences in one forward: each item's tokens into its own cache; their last
        rows' final hidden states, normalized, `[len(items), hidden]`. Row for row the same bits as
        each item fed alone (see `_rows`)."""
        x = self._rows(items)
        last = torch.tensor([s.end - 1 for s in spans_of(items)], device=x.device)
        return rms_norm(x[last], self.norm2, self.cfg.norm_eps)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits `[vocab]` from a final hidden state `[hidden]` (`feed`'s); `[n, hidden]` rows
        give `[n, vocab]`, each row's bits as alone."""
        if hidden.dim() == 2:
            return linear(hidden, self.lm_head).float() if isinstance(self.lm_head, Packed) else \
                torch.stack([matvec(self.lm_head, h) for h in hidden]).float()
        return matvec(self.lm_head, hidden).float()

    def _rows(self, items: list[Item]) -> torch.Tensor:
        """The residual stream `[R, hidden]` after the last layer for every item's tokens, rows in item
        order, K/V written into each item's cache. A row's bits depend on its own item only: the
        products are row-wise (`rows_linear`: one product over all rows where the kernel computes each
        row alone, else per item as `linear` would), so are RMSNorm, rotary and SwiGLU, and attention
        runs per item."""
        cfg = self.cfg
        nh, nkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        eps, q_end, k_end = cfg.norm_eps, nh * hd, (nh + nkv) * hd
        spans = spans_of(items)
        ids = items[0].ids if len(items) == 1 else torch.cat([it.ids for it in items])
        R = ids.shape[0]
        if len(items) == 1:
            cos, sin = self.rope(items[0].pos, R)
        else:
            cos, sin = self.rope_rows(torch.cat([torch.arange(it.pos, it.pos + s.end - s.start)
                                                 for it, s in zip(items, spans)]).to(ids.device))
        batch = Batch(items, spans, self.dtype, ids.device)  # masks, and the paged kernel's arguments once made
        x = embed(ids, self.embed, self.dtype)  # [R, hidden]
        stack = native.layers() if self._stack is not None else None
        args = batch.layer_args(nh) if stack is not None else None
        if args is not None:  # the loop below in one native call: the same kernels in the same order
            pools, slots, table, row_seq, row_len = args
            x = stack(x, *self._stack, cos, sin, pools, slots, table, row_seq, row_len, nh, eps)
            batch.written()
            return x
        for i, L in enumerate(self.layers):
            qkv = rows_linear(rms_norm(x, L.attn_norm2, eps), L.wqkv, L.bqkv, spans)  # [R, (nh + 2 nkv) hd]: q | k | v
            rotate_(qkv[:, :k_end].view(R, nh + nkv, hd), cos, sin)
            q, kv = qkv[:, :q_end].view(R, nh, hd), qkv[:, q_end:].view(R, 2, nkv, hd)  # k | v: cache rows
            o = attend_items(q, kv, batch, i, len(self.layers))  # [R, nh hd]
            x = rows_add_linear(x, o, L.wo, L.bo, spans)
            gate_up = rows_linear(rms_norm(x, L.mlp_norm2, eps), L.w_gate_up, L.b_gate_up, spans)  # [R, 2 ffn]
            x = rows_add_linear(x, swiglu(gate_up), L.w_down, L.b_down, spans)
        return x


Net = Llama
