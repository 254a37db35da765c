"""Model files -> (metadata, named torch tensors in our own naming).

Two sources: a GGUF file (read with the `gguf` package, every type it can dequantize) and a
Hugging Face folder (`config.json` + `*.safetensors`, sharded or not). `collect` maps names through
the architecture's own tables (`models/llama.py`, `models/gpt2.py`: `{}` is the layer index), lets
it undo the source's layout tricks (`sanitize`: llama.cpp's Q/K row permutation, GPT-2's
transposed Conv1D) and checks every tensor's shape against the config. Failures raise `MissingTensor`, `TensorShapeMismatch`,
`TruncatedFile` or `ModelError` with the file named.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator

import numpy as np
import torch

from ..errors import MissingTensor, ModelError, TensorShapeMismatch, TruncatedFile
from .config import ModelConfig

GGUF, HF = 0, 1  # the two sources, and the index of each one's name in an architecture's tables


def per_layer(cfg: ModelConfig, layer: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """One layer's shapes -> every layer's, under our names `layers.{i}.KEY`."""
    return {f"layers.{i}.{k}": v for i in range(cfg.n_layers) for k, v in layer.items()}


def source_name(arch: ModuleType, ours: str, kind: int) -> str | None:
    """The file's name for our tensor `ours` (`layers.3.wq` -> `blk.3.attn_q.weight`) in the
    architecture's tables; None when the source has no such tensor."""
    if ours.startswith("layers."):
        _, index, key = ours.split(".", 2)
        pattern = arch.LAYER[key][kind]
        return pattern.format(index) if pattern else None
    return arch.GLOBAL[ours][kind]


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
def collect(cfg: ModelConfig, arch: ModuleType, kind: int, fetch, available: set[str], dtype: torch.dtype,
            origin: str) -> dict[str, torch.Tensor]:
    """Fetch, sanitize and shape-check every tensor `cfg` needs, by the tables of `arch` (its module
    in `models`); `fetch(name, dtype)` reads one tensor of the file."""
    out: dict[str, torch.Tensor] = {}
    for ours, shape in arch.shapes(cfg).items():
        name = source_name(arch, ours, kind)
        if name not in available:
            raise MissingTensor(f"{origin}: tensor {name!r} ({ours}) is missing; the file is incomplete "
                                f"or not a {cfg.variant} model")
        t = fetch(name, dtype)
        # checked in the file's own layout, before `sanitize` reshapes rows or transposes
        _check_shape(t, arch.stored_shape(cfg, ours, kind, shape), name, origin)
        out[ours] = arch.sanitize(cfg, ours, t, kind)
    for ours, (shape, dt) in arch.optional(cfg).items():
        name = source_name(arch, ours, kind)
        if name and name in available:
            out[ours] = _check_shape(fetch(name, dt), shape, name, origin)
    return out


def _check_shape(t: torch.Tensor, shape: tuple[int, ...], name: str, origin: str) -> torch.Tensor:
    if tuple(t.shape) != shape:
        raise TensorShapeMismatch(f"{origin}: tensor {name!r} has shape {tuple(t.shape)}, "
                                  f"the config implies {shape}")
    return t


def iter_file_chunks(path: Path, size: int = 1 << 24) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(size):
            yield chunk


def file_identity(path: Path) -> tuple[str, int, int]:
    st = os.stat(path)
    return str(path.resolve()), st.st_size, st.st_mtime_ns
