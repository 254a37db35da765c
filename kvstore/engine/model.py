"""`load_model(spec)`: a ready-to-run Model (config, tokenizer, fingerprint, forward).

`spec` is an alias of a default model (`smollm2`, pulled on first use), a `.gguf` file or a
Hugging Face folder. Activations and the KV cache are `dtype` (bfloat16 by default), on `device`.
The weight matrices are held as `weights` says (defaults.WEIGHT_FORMATS): a GGUF file's Q4_0 / Q4_1 /
Q8_0 blocks as stored (`quant`: the native integer kernels multiply them), dequantized into `dtype`,
or quantized to Q8_0 on load; `Model.weights` says which it got (a session records it: C6). A GGUF
file is parsed (and dequantized) once per dtype and format; later loads read the result from the
per-user models folder (`weight_cache`). `load_tokenizer(spec)` reads only the tokenizer.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from ..defaults import DEFAULT_DTYPE, DTYPE_NAMES, WEIGHT_FORMATS
from ..errors import ModelError, UnsupportedModel
from . import native, quant, weight_cache
from . import tokenizer as tok
from .cache import KVCache
from .config import ModelConfig
from .fingerprint import file_hash, model_fingerprint
from .models import architecture, config_from_gguf, config_from_hf
from .pull import ALIASES, models_dir, pull
from .rows import Item
from .weights import (GGUF, HF, collect, dequantize_gguf, gguf_metadata, gguf_tensors, open_gguf,
                      read_safetensors, safetensor_files)

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # "bfloat16" -> torch.bfloat16, ...


@dataclass
class Model:
    config: ModelConfig
    tokenizer: tok.Tokenizer
    fingerprint: str
    dtype: torch.dtype
    device: torch.device
    source: str
    net: object  # the architecture's Net (models/llama.py, models/gpt2.py)
    weights: str = "dense"  # how its matrices are held: defaults.WEIGHT_FORMATS

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def new_cache(self, capacity: int = 0) -> KVCache:
        c = self.config
        return KVCache(c.n_layers, c.n_kv_heads, c.head_dim, dtype=self.dtype, device=self.device, capacity=capacity)

    @torch.inference_mode()
    def forward(self, ids: Sequence[int], pos: int, cache: KVCache | None, *, last_only: bool = True) -> torch.Tensor:
        """Float32 logits for `ids` at positions pos..; writes their K/V into `cache`."""
        return self.net.forward(self._ids(ids, pos, cache), pos, cache, last_only=last_only)

    @torch.inference_mode()
    def feed(self, ids: Sequence[int], pos: int, cache: KVCache) -> torch.Tensor:
        """Write the K/V of `ids` at positions pos..; the last one's final hidden state `[hidden]`
        (normalized, model dtype, on the model's device): `head` of it is `forward`'s last logits row."""
        return self.net.feed(self._ids(ids, pos, cache), pos, cache)

    @torch.inference_mode()
    def feed_all(self, ids: Sequence[int], pos: int, cache: KVCache) -> torch.Tensor:
        """`feed` that keeps every row's final hidden state `[len(ids), hidden]` (scoring a prompt: `head`
        of row i gives the logits that predict the token after ids[i]); the last row's bits are `feed`'s."""
        return self.net.feed_all(self._ids(ids, pos, cache), pos, cache)

    @torch.inference_mode()
    def feed_rows(self, items: Sequence[tuple[Sequence[int], int, KVCache]]) -> torch.Tensor:
        """`feed` of several sequences, `(ids, pos, cache)` each, in one forward (their rows stacked):
        the last rows' final hidden states `[len(items), hidden]`, each the bits `feed` gives it alone
        (contract C9). GPT-2 feeds them one after the other."""
        rows = [Item(self._ids(ids, pos, cache), pos, cache) for ids, pos, cache in items]
        if hasattr(self.net, "feed_rows"):
            return self.net.feed_rows(rows)
        return torch.stack([self.net.feed(it.ids, it.pos, it.cache) for it in rows])

    @torch.inference_mode()
    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits `[vocab]` (model's device) from a final hidden state `[hidden]` (`feed`'s);
        rows `[n, hidden]` give `[n, vocab]`, each row's bits as alone."""
        if hidden.dim() == 2 and not hasattr(self.net, "feed_rows"):
            return torch.stack([self.net.head(h) for h in hidden])
        return self.net.head(hidden)

    @property
    def row_invariant(self) -> bool:
        """Whether every kernel of this model's forward computes each token's row alone (a Llama on the
        GGUF's blocks or Q8_0, bfloat16, on the CPU's native kernels: the integer products, the
        row-wise norms, rotary and SwiGLU, the row attention). Then a token's K/V and logits bits
        do not depend on how the tokens were fed: in chunks of any size, one at a time or beside
        other sequences, so any stored prefix is a cold run's (C10)."""
        from .attention import NATIVE_MAX_GROUP

        c = self.config
        return (c.arch == "llama" and self.weights != "dense" and self.dtype == torch.bfloat16
                and self.device.type == "cpu" and c.head_dim % 16 == 0 and c.n_heads % c.n_kv_heads == 0
                and c.n_heads // c.n_kv_heads <= NATIVE_MAX_GROUP and native.kernels() is not None
                and native.quant() is not None and native.attention() is not None)

    @property
    def kernels(self) -> str:
        """Which kernels compute this model's forward, in a word ("cpu:bf16+quant+attention",
        "cpu:torch", "cuda"): KV computed by other kernels has other bits, so the prefix cache's keys
        name them (C10)."""
        if self.device.type != "cpu":
            return self.device.type
        native_ops = [name for name, ops in (("bf16", native.kernels), ("quant", native.quant),
                                             ("attention", native.attention)) if ops() is not None]
        return "cpu:" + ("+".join(native_ops) or "torch")

    @property
    def hidden_bytes(self) -> int:
        """Bytes of one final hidden state (`feed`'s) in the model's dtype."""
        return self.config.hidden_size * self.dtype.itemsize

    def check_context(self, n_tokens: int) -> None:
        """ModelError, saying what to do, when a sequence of `n_tokens` does not fit the context."""
        if n_tokens > self.config.max_context:
            raise ModelError(f"{n_tokens:,} tokens exceed the model's context of {self.config.max_context:,}; "
                             "start a new session with less text, or fork at an earlier point")

    def check_ids(self, ids: Sequence[int]) -> None:
        """ModelError when an id lies outside the model's vocabulary."""
        vocab = self.config.vocab_size
        if any(not 0 <= i < vocab for i in ids):
            raise ModelError(f"token ids must lie in [0, {vocab}) for this model")

    def _ids(self, ids: Sequence[int], pos: int, cache: KVCache | None) -> torch.Tensor:
        """`ids` as a tensor on the model's device, once they are known to fit in the context at pos and
        the cache has room for them."""
        self.check_context(pos + len(ids))
        if cache is not None:
            cache.reserve(pos + len(ids))
        return torch.tensor(list(ids), dtype=torch.long, device=self.device)

    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        """A full forward without a cache: float32 `[len(ids), vocab]` on the CPU (checks, debugging)."""
        return self.forward(ids, 0, None, last_only=False).cpu()


def load_model(spec: str | os.PathLike, dtype: str | torch.dtype | None = None, device: str = "cpu",
               home: str | os.PathLike | None = None, weights: str | None = None) -> Model:
    """An alias (`smollm2`), a `.gguf` file or a Hugging Face folder -> Model. `home` only matters for
    an alias not pulled yet: a store home from before may hold its file (`pull`). `weights`: see the
    module's docstring (None: "stored" where the native quantized kernels run, else "dense")."""
    dt = _dtype(dtype)
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelError("device 'cuda' asked for, but CUDA is not available here; use --device cpu")
    wanted = _weights(weights, dev)
    path = model_path(spec, home)
    cache_file = models_dir() / "fingerprints.json"
    if path.is_file():
        cfg, tokenizer, tensors, fp = _read_gguf(path, dt, wanted == "stored", cache_file)
    else:
        cfg, tokenizer, tensors, fp = _read_hf(path, dt, cache_file)
    if wanted == "q8_0":
        tensors = {k: _q8_0(t) for k, t in tensors.items()}
    held = wanted if any(isinstance(t, quant.Blocks) for t in tensors.values()) else "dense"
    tensors = {k: v.to(dev) for k, v in tensors.items()}
    if dt == torch.bfloat16 and dev.type == "cpu":
        native.kernels()  # settle the kernels now: a first build on this machine belongs to loading
        native.attention()
    return Model(cfg, tokenizer, fp, dt, dev, str(path), architecture(cfg).Net(cfg, tensors), held)


def _weights(weights: str | None, dev: torch.device) -> str:
    if weights is None:
        return "stored" if dev.type == "cpu" and native.quant() is not None else "dense"
    if weights not in WEIGHT_FORMATS:
        raise ModelError(f"weights {weights!r}: use one of {', '.join(WEIGHT_FORMATS)}")
    return weights


def _q8_0(t):
    """A matrix (2-D, rows a multiple of 32 wide) as Q8_0 blocks, from its values; anything else as it is."""
    if isinstance(t, quant.Blocks):
        t = t.dequantize(torch.float32)
    if t.dim() != 2 or t.shape[1] % quant.BLOCK:
        return t
    return quant.quantize_q8_0(t)


def load_tokenizer(spec: str | os.PathLike, home: str | os.PathLike | None = None) -> tok.Tokenizer:
    """The tokenizer (and chat template) of an alias, a `.gguf` file or a Hugging Face folder, without
    reading the weights."""
    path = model_path(spec, home)
    if path.is_dir():
        return tok.from_hf_folder(path)
    with _naming(path):
        return tok.from_gguf(gguf_metadata(open_gguf(path)))


def model_path(spec: str | os.PathLike, home: str | os.PathLike | None = None) -> Path:
    """The file or folder `spec` names: an alias is pulled first (once per user)."""
    if str(spec) in ALIASES:
        return pull(str(spec), home=home)
    path = Path(spec).expanduser()
    if not (path.is_file() or path.is_dir()):
        raise ModelError(f"{spec}: no such file or folder, and not a known alias ({', '.join(ALIASES)})")
    return path


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is None:
        return DTYPES[DEFAULT_DTYPE]
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ModelError(f"dtype {dtype} is not supported; use one of {', '.join(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise ModelError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


@contextmanager
def _naming(path: Path):
    """Say which file an unsupported setting came from."""
    try:
        yield
    except UnsupportedModel as e:
        raise UnsupportedModel(f"{path}: {e}") from e


def _read_gguf(path: Path, dtype: torch.dtype, stored: bool, cache_file: Path):
    """A GGUF file: parsed (and dequantized) once, then read from the weight cache (see weight_cache).
    `stored`: the matrices of kinds in `quant.KINDS` stay `quant.Blocks`."""
    source_hash = file_hash(path, cache_file)
    entry = weight_cache.entry_path(cache_file.parent, path, dtype, source_hash, stored)
    hit = weight_cache.load(entry, dtype, source_hash)
    if hit is None:
        cfg, tokenizer, weights, info = _convert_gguf(path, dtype, stored)
        weight_cache.save(entry, weights, dtype, source_hash, info)
    else:
        weights, info = hit
        with _naming(path):
            cfg = ModelConfig.from_dict(info["config"])
            tokenizer = tok.from_gguf(info["tokenizer"])
    table = [(name, tuple(shape), kind) for name, shape, kind in info["table"]]
    return cfg, tokenizer, weights, model_fingerprint(cfg.to_dict(), table, [path], cache_file)


def _convert_gguf(path: Path, dtype: torch.dtype, stored: bool):
    """(config, tokenizer, our tensors, what the weight cache keeps besides the tensors)."""
    reader = open_gguf(path)
    meta = gguf_metadata(reader)
    tensors = gguf_tensors(reader)
    with _naming(path):
        cfg = config_from_gguf(meta, set(tensors))
        tokenizer = tok.from_gguf(meta)

    def fetch(name: str, dt: torch.dtype):
        blocks = quant.from_gguf(tensors[name]) if stored else None
        return blocks if blocks is not None else dequantize_gguf(tensors[name], dt)

    weights = collect(cfg, architecture(cfg), GGUF, fetch, set(tensors), dtype, str(path))
    info = {"config": cfg.to_dict(),
            "table": [(t.name, [int(n) for n in t.shape], t.tensor_type.name) for t in tensors.values()],
            "tokenizer": {k: v for k, v in meta.items() if k.startswith("tokenizer.")}}
    return cfg, tokenizer, weights, info


def _read_hf(folder: Path, dtype: torch.dtype, cache_file: Path):
    config_path = folder / "config.json"
    if not config_path.exists():
        raise ModelError(f"{folder}: no config.json; a model folder needs config.json and *.safetensors")
    with _naming(folder):
        cfg = config_from_hf(json.loads(config_path.read_text()))
    files = safetensor_files(folder)
    raw = read_safetensors(files)
    tokenizer = tok.from_hf_folder(folder)
    weights = collect(cfg, architecture(cfg), HF, lambda name, dt: raw[name].to(dt), set(raw), dtype, str(folder))
    table = [(name, tuple(t.shape), str(t.dtype)) for name, t in raw.items()]
    extra = [f for f in (config_path, folder / "tokenizer.json") if f.exists()]
    return cfg, tokenizer, weights, model_fingerprint(cfg.to_dict(), table, files + extra, cache_file)
