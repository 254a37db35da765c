"""`load_model(spec)`: a ready-to-run Model (config, tokenizer, fingerprint, forward).

`spec` is an alias of a default model (`smollm2`, pulled on first use), a `.gguf` file or a
Hugging Face folder. Weights load into `dtype` (bfloat16 by default) on `device`, through the
architecture's module (`models`). A GGUF file is parsed and dequantized once per dtype; later loads
read the result from the per-user models folder (`weight_cache`). `load_tokenizer(spec)` reads
only the tokenizer (the weights stay on disk).
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from ..defaults import DEFAULT_DTYPE, DTYPE_NAMES
from ..errors import ModelError, UnsupportedModel
from . import native, weight_cache
from . import tokenizer as tok
from .cache import KVCache
from .config import ModelConfig
from .fingerprint import file_hash, model_fingerprint
from .models import architecture, config_from_gguf, config_from_hf
from .pull import ALIASES, models_dir, pull
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
    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits `[vocab]` (model's device) from a final hidden state `[hidden]` (`feed`'s)."""
        return self.net.head(hidden)

    @property
    def hidden_bytes(self) -> int:
        """Bytes of one final hidden state (`feed`'s) in the model's dtype."""
        return self.config.hidden_size * self.dtype.itemsize

    def check_context(self, n_tokens: int) -> None:
        """ModelError, saying what to do, when a sequence of `n_tokens` does not fit the context."""
        if n_tokens > self.config.max_context:
            raise ModelError(f"{n_tokens:,} tokens exceed the model's context of {self.config.max_context:,}; "
                             "start a new session with less text, or fork at an earlier point")

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
               home: str | os.PathLike | None = None) -> Model:
    """An alias (`smollm2`), a `.gguf` file or a Hugging Face folder -> Model. `home` only matters for
    an alias not pulled yet: a store home from before may hold its file (`pull`)."""
    dt = _dtype(dtype)
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelError("device 'cuda' asked for, but CUDA is not available here; use --device cpu")
    path = model_path(spec, home)
    cache_file = models_dir() / "fingerprints.json"
    if path.is_file():
        cfg, tokenizer, weights, fp = _read_gguf(path, dt, cache_file)
    else:
        cfg, tokenizer, weights, fp = _read_hf(path, dt, cache_file)
    weights = {k: v.to(dev) for k, v in weights.items()}
    if dt == torch.bfloat16 and dev.type == "cpu":
        native.kernels()  # settle the kernels now: a first build on this machine belongs to loading
        native.attention()
    return Model(cfg, tokenizer, fp, dt, dev, str(path), architecture(cfg).Net(cfg, weights))


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


def _read_gguf(path: Path, dtype: torch.dtype, cache_file: Path):
    """A GGUF file: parsed and dequantized once, then read from the weight cache (see weight_cache)."""
    source_hash = file_hash(path, cache_file)
    entry = weight_cache.entry_path(cache_file.parent, path, dtype, source_hash)
    hit = weight_cache.load(entry, dtype, source_hash)
    if hit is None:
        cfg, tokenizer, weights, info = _convert_gguf(path, dtype)
        weight_cache.save(entry, weights, dtype, source_hash, info)
    else:
        weights, info = hit
        with _naming(path):
            cfg = ModelConfig.from_dict(info["config"])
            tokenizer = tok.from_gguf(info["tokenizer"])
    table = [(name, tuple(shape), kind) for name, shape, kind in info["table"]]
    return cfg, tokenizer, weights, model_fingerprint(cfg.to_dict(), table, [path], cache_file)


def _convert_gguf(path: Path, dtype: torch.dtype):
    """(config, tokenizer, our tensors, what the weight cache keeps besides the tensors)."""
    reader = open_gguf(path)
    meta = gguf_metadata(reader)
    tensors = gguf_tensors(reader)
    with _naming(path):
        cfg = config_from_gguf(meta, set(tensors))
        tokenizer = tok.from_gguf(meta)
    weights = collect(cfg, architecture(cfg), GGUF, lambda name, dt: dequantize_gguf(tensors[name], dt), set(tensors),
                      dtype, str(path))
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
