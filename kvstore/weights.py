"""Model files -> (metadata, named torch tensors in our own naming).

Two sources: a GGUF file (read with the `gguf` package, every type it can dequantize) and a
Hugging Face folder (`config.json` + `*.safetensors`, sharded or not). Names are mapped by one
table per architecture and source (`{}` is the layer index); `sanitize` undoes the source's own
layout tricks (llama.cpp's Q/K row permutation, GPT-2's transposed Conv1D); every tensor's shape
is checked against the config. Failures raise `MissingTensor`, `TensorShapeMismatch`,
`TruncatedFile` or `ModelError` with the file named.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from .config import ModelConfig
from .errors import MissingTensor, ModelError, TensorShapeMismatch, TruncatedFile

LLAMA_LAYER = {
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
LLAMA_GLOBAL = {
    "embed": ("token_embd.weight", "model.embed_tokens.weight"),
    "norm": ("output_norm.weight", "model.norm.weight"),
    "lm_head": ("output.weight", "lm_head.weight"),
    "rope_freqs": ("rope_freqs.weight", None),
}
GPT2_LAYER = {
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
GPT2_GLOBAL = {
    "wte": ("token_embd.weight", "wte.weight"),
    "wpe": ("position_embd.weight", "wpe.weight"),
    "ln_f.weight": ("output_norm.weight", "ln_f.weight"),
    "ln_f.bias": ("output_norm.bias", "ln_f.bias"),
    "lm_head": ("output.weight", "lm_head.weight"),
}
GPT2_CONV1D = ("attn_qkv.weight", "attn_out.weight", "fc.weight", "proj.weight")
GGUF, HF = 0, 1


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our tensor names -> shapes, for exactly the tensors this config needs."""
    return _llama_shapes(cfg) if cfg.arch == "llama" else _gpt2_shapes(cfg)


def _llama_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, q, kv, ff = cfg.hidden_size, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.intermediate_size
    shapes = {"embed": (cfg.vocab_size, h), "norm": (h,)}
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, h)
    layer = {"attn_norm": (h,), "wq": (q, h), "wk": (kv, h), "wv": (kv, h), "wo": (h, q), "mlp_norm": (h,),
             "w_gate": (ff, h), "w_up": (ff, h), "w_down": (h, ff)}
    if cfg.qkv_bias:
        layer.update(bq=(q,), bk=(kv,), bv=(kv,))
    if cfg.o_bias:
        layer["bo"] = (h,)
    if cfg.mlp_bias:
        layer.update(b_gate=(ff,), b_up=(ff,), b_down=(h,))
    return shapes | _per_layer(cfg, layer)


def _gpt2_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, ff = cfg.hidden_size, cfg.intermediate_size
    shapes = {"wte": (cfg.vocab_size, h), "wpe": (cfg.max_context, h), "ln_f.weight": (h,), "ln_f.bias": (h,)}
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, h)
    layer = {"ln_1.weight": (h,), "ln_1.bias": (h,), "attn_qkv.weight": (3 * h, h), "attn_qkv.bias": (3 * h,),
             "attn_out.weight": (h, h), "attn_out.bias": (h,), "ln_2.weight": (h,), "ln_2.bias": (h,),
             "fc.weight": (ff, h), "fc.bias": (ff,), "proj.weight": (h, ff), "proj.bias": (h,)}
    return shapes | _per_layer(cfg, layer)


def _per_layer(cfg: ModelConfig, layer: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    return {f"layers.{i}.{k}": v for i in range(cfg.n_layers) for k, v in layer.items()}


def source_name(cfg: ModelConfig, ours: str, kind: int) -> str | None:
    """The file's name for our tensor `ours` (`layers.3.wq` -> `blk.3.attn_q.weight`)."""
    layer_table, global_table = (LLAMA_LAYER, LLAMA_GLOBAL) if cfg.arch == "llama" else (GPT2_LAYER, GPT2_GLOBAL)
    if ours.startswith("layers."):
        _, index, key = ours.split(".", 2)
        pattern = layer_table[key][kind]
        return pattern.format(index) if pattern else None
    return global_table[ours][kind]


# -- GGUF ------------------------------------------------------------------------------------
def open_gguf(path: Path):
    """A `gguf.GGUFReader`, with a truncated or malformed file reported as such."""
    import gguf

    size = path.stat().st_size
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises bare ValueError/IndexError on damaged files
        raise TruncatedFile(f"{path}: not a readable GGUF file, truncated or damaged ({e}); download it again") from e
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise TruncatedFile(
                f"{path}: tensor {t.name} ends at byte {t.data_offset + t.n_bytes} but the file has {size}; "
                "the file is truncated, download it again"
            )
    return reader


def gguf_metadata(reader) -> dict[str, Any]:
    meta = {}
    for key, fld in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = fld.contents()
        meta[key] = value
    return meta


def gguf_tensors(reader) -> dict[str, Any]:
    return {t.name: t for t in reader.tensors}


def dequantize_gguf(t, dtype: torch.dtype) -> torch.Tensor:
    """One GGUF tensor as a torch tensor of `dtype`, shape in PyTorch order ([rows, cols])."""
    import gguf

    kind = gguf.GGMLQuantizationType
    shape = tuple(int(n) for n in reversed(t.shape))
    if t.tensor_type in (kind.F32, kind.F16):
        array = np.asarray(t.data)
    elif t.tensor_type == kind.BF16:
        raw = torch.from_numpy(np.array(t.data, copy=True).view(np.int16))  # not a view of the read-only map
        return raw.view(torch.bfloat16).reshape(shape).to(dtype)
    else:
        try:
            array = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ModelError(f"tensor {t.name}: GGUF type {t.tensor_type.name} cannot be dequantized") from e
    array = np.ascontiguousarray(array)
    if not array.flags.writeable:  # a view of the read-only file map
        array = array.copy()
    return torch.from_numpy(array).reshape(shape).to(dtype)


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K permutation (interleaved rotary pairs -> two halves per head)."""
    rows = w.shape[0]
    # [n_heads, 2 (halves), head_dim // 2, ...] <- [n_heads, head_dim // 2, 2 (pair), ...]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# -- Hugging Face safetensors folders ----------------------------------------------------------
def safetensor_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({folder / f for f in weight_map.values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{folder}: no *.safetensors files; kvstore reads safetensors folders only")
    for f in files:
        if not f.exists():
            raise MissingTensor(f"{folder}: shard {f.name} named in the index is missing")
    return files


def read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    """Every tensor of the folder, memory-mapped; `transformer.` prefixes (GPT-2) stripped."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            loaded = load_file(f)
        except (SafetensorError, OSError) as e:
            raise TruncatedFile(f"{f}: cannot read safetensors file ({e}); it may be truncated") from e
        for name, t in loaded.items():
            tensors[name.removeprefix("transformer.")] = t
    return tensors


# -- assembling our named tensors -------------------------------------------------------------
def collect(cfg: ModelConfig, kind: int, fetch, available: set[str], dtype: torch.dtype,
            origin: str) -> dict[str, torch.Tensor]:
    """Fetch, sanitize and shape-check every tensor `cfg` needs; `fetch(name, dtype)` reads one."""
    out: dict[str, torch.Tensor] = {}
    for ours, shape in expected_shapes(cfg).items():
        name = source_name(cfg, ours, kind)
        if name not in available:
            raise MissingTensor(f"{origin}: tensor {name!r} ({ours}) is missing; the file is incomplete "
                                f"or not a {cfg.variant} model")
        t = fetch(name, dtype)
        # checked in the file's own layout, before `sanitize` reshapes rows or transposes
        _check_shape(t, _transposed(cfg, ours, kind, shape), name, origin)
        out[ours] = sanitize(cfg, ours, t, kind)
    extra = source_name(cfg, "rope_freqs", kind) if cfg.arch == "llama" else None
    if extra and extra in available:
        out["rope_freqs"] = _check_shape(fetch(extra, torch.float32), (cfg.head_dim // 2,), extra, origin)
    return out


def _transposed(cfg: ModelConfig, ours: str, kind: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """`shape` as the source stores it: HF's GPT-2 Conv1D weights are [in, out]."""
    if kind == HF and cfg.arch == "gpt2" and ours.split(".", 2)[-1] in GPT2_CONV1D:
        return shape[::-1]
    return shape


def _check_shape(t: torch.Tensor, shape: tuple[int, ...], name: str, origin: str) -> torch.Tensor:
    if tuple(t.shape) != shape:
        raise TensorShapeMismatch(f"{origin}: tensor {name!r} has shape {tuple(t.shape)}, "
                                  f"the config implies {shape}")
    return t


def sanitize(cfg: ModelConfig, ours: str, t: torch.Tensor, kind: int) -> torch.Tensor:
    key = ours.rsplit(".", 1)[-1] if cfg.arch == "llama" else ours.split(".", 2)[-1]
    if kind == GGUF and cfg.arch == "llama" and cfg.variant != "qwen2":
        if key in ("wq", "bq"):
            return unpermute_rows(t, cfg.n_heads)
        if key in ("wk", "bk"):
            return unpermute_rows(t, cfg.n_kv_heads)
    if kind == HF and cfg.arch == "gpt2" and key in GPT2_CONV1D:
        return t.t().contiguous()
    return t


def iter_file_chunks(path: Path, size: int = 1 << 24) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(size):
            yield chunk


def file_identity(path: Path) -> tuple[str, int, int]:
    st = os.stat(path)
    return str(path.resolve()), st.st_size, st.st_mtime_ns
