"""Converted weights kept in the per-user models folder, so that a GGUF file is parsed and
dequantized once per machine and dtype.

Reading a GGUF file costs seconds (the reader walks ~100k tokenizer strings, numpy dequantizes
every block); `kvstore continue` loads the model on every call. So the result of the conversion (the
tensors `weights.collect` returns: our names, sanitized, in the chosen dtype) is written once to
`models/cache/<file stem>-<dtype>-<key>.safetensors`, with what else a load needs in its header:
the config, the tokenizer's GGUF metadata and the source's tensor table (for the fingerprint).

A file's block-quantized matrices kept as stored (`quant.Blocks`) are entries of their own: their raw
block bytes as uint8 tensors, with each one's kind and width in the header (`info["blocks"]`).

The key hashes the format version, the kvstore version, the dtype, whether blocks are kept, and the
source file's content hash (`fingerprint.file_hash`, cached by path, size and mtime), so a changed file or a new converter
never meets a stale entry. Entries are written whole (`fileio.atomic_write`: temp file, fsync,
rename), so two processes converting at once each leave a complete entry, and read through a memory map (safetensors: no pickle). A damaged, foreign or mismatched entry is a
miss, rewritten by the next load; a folder that cannot be written only costs the slow path.
"""

from __future__ import annotations

import contextlib
import glob
import json
from pathlib import Path
from typing import Any

import torch
import xxhash

from ..defaults import VERSION
from ..fileio import PLAIN, atomic_write
from .quant import Blocks

FORMAT = "1"
MAGIC = "kvstore.converted-weights"


def entry_path(models: Path, source: Path, dtype: torch.dtype, source_hash: str, stored: bool = False) -> Path:
    key = xxhash.xxh3_64(f"{FORMAT}|{VERSION}|{dtype}|{stored}|{source_hash}".encode()).hexdigest()
    kind = "-stored" if stored else ""
    return models / "cache" / f"{source.stem}-{_dtype_name(dtype)}{kind}-{key}.safetensors"


def load(path: Path, dtype: torch.dtype, source_hash: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """(tensors, info) from a valid entry, else None.

    The tensors are copied out of the file's memory map: a later change to the file cannot reach them,
    and decoding streams process memory measurably faster here than page-cache pages (~6%)."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
        if (header.get("magic"), header.get("format"), header.get("dtype"), header.get("source_hash")) != (
                MAGIC, FORMAT, _dtype_name(dtype), source_hash):
            return None
        info = json.loads(header["info"])
        tensors = {name: t.clone() for name, t in load_file(str(path)).items()}
        blocks = {name: Blocks(kind, tensors[name], int(cols)) for name, (kind, cols) in info.get("blocks", {}).items()}
    except (SafetensorError, OSError, ValueError, KeyError, TypeError):
        return None
    if any(t.dtype != dtype for name, t in tensors.items() if name != "rope_freqs" and name not in blocks):
        return None
    return tensors | blocks, info


def save(path: Path, tensors: dict[str, Any], dtype: torch.dtype, source_hash: str, info: dict[str, Any]) -> bool:
    """Write an entry atomically and drop older entries of the same file stem and dtype; best effort."""
    from safetensors.torch import save_file

    blocks = {name: t for name, t in tensors.items() if isinstance(t, Blocks)}
    info = info | {"blocks": {name: [b.kind, b.cols] for name, b in blocks.items()}}
    tensors = tensors | {name: b.raw for name, b in blocks.items()}
    try:
        text = json.dumps(info)
    except (TypeError, ValueError):  # metadata of a kind JSON cannot hold: keep converting each time
        return False
    header = {"magic": MAGIC, "format": FORMAT, "dtype": _dtype_name(dtype), "source_hash": source_hash,
              "info": text}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(path, ops=PLAIN, clean=True, sync_by_path=True) as out:
            save_file({k: t.detach().to("cpu").contiguous() for k, t in tensors.items()}, str(out.path),
                      metadata=header)
    except OSError:
        return False
    with contextlib.suppress(OSError):
        for old in path.parent.glob(glob.escape(path.name.rsplit("-", 1)[0]) + "-*.safetensors"):
            if old != path:
                old.unlink(missing_ok=True)
    return True


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
