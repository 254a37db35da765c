"""The trained model as a Hugging Face folder that `kvstore.load_model` and transformers both load.

`write(out, result)` writes `config.json`, `model.safetensors` (float32, Hugging Face tensor names:
the HF column of `models/llama.py`'s tables, so the loader maps them back to the very names the
training used), `tokenizer.json`, `tokenizer_config.json` (BOS/EOS, the ChatML template) and
`training.json` (the settings, the text's sha256 and the loss of every step: how to make the same
bytes again).

A killed run never leaves a folder that loads half-written: every file is written whole
(`fileio.atomic_write`: temp file, fsync, rename), an old `config.json` is removed first and the
new one is written last, and a folder is only loadable with a `config.json`. `out` must be new,
empty or a folder this module wrote before (holding only these files), so no stray weight file
is ever loaded with the new ones.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from ..engine.models import llama
from ..engine.weights import HF, source_name
from ..errors import InvalidArgument
from ..fileio import PLAIN, atomic_write, fsync_path, is_temp_of
from . import bpe
from .loop import Result

FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "training.json")


def hf_tensors(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our names -> the Hugging Face names (`layers.0.wq` -> `model.layers.0.self_attn.q_proj.weight`)."""
    return {source_name(llama, ours, HF): t.detach().contiguous() for ours, t in weights.items()}


def write(out: Path, result: Result, text_sha256: str) -> Path:
    from safetensors.torch import save

    out = Path(out)
    _check_destination(out)
    out.mkdir(parents=True, exist_ok=True)
    config = out / "config.json"
    if config.exists():  # from here until the new one lands, the folder does not load
        config.unlink()
        fsync_path(out, getattr(os, "O_DIRECTORY", 0))
    s = result.settings
    training = {"settings": vars(s), "text_sha256": text_sha256, "n_tokens": result.n_tokens,
                "torch": torch.__version__, "losses": [round(x, 6) for x in result.losses]}
    _write(out / "tokenizer.json", result.tokenizer.to_str(pretty=True).encode())
    _write(out / "tokenizer_config.json", _json(bpe.tokenizer_config(s.context)))
    _write(out / "training.json", _json(training))
    _write(out / "model.safetensors", save(hf_tensors(result.weights), metadata={"format": "pt"}))
    _write(config, _json(result.hf_config))
    return out


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _check_destination(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise InvalidArgument(f"{out} exists and is not a folder; name a new or empty folder (--out)")
    if not out.is_dir():
        return
    strangers = sorted(p.name for p in out.iterdir()
                       if p.name not in FILES and not any(is_temp_of(p, name) for name in FILES))
    if strangers:
        raise InvalidArgument(f"{out} holds files this trainer did not write ({', '.join(strangers[:3])}); "
                              "name a new or empty folder (--out)")


def _json(data) -> bytes:
    return (json.dumps(data, indent=2) + "\n").encode()


def _write(path: Path, data: bytes) -> None:
    with atomic_write(path, ops=PLAIN, clean=True) as tmp:
        PLAIN.pwrite(tmp.fd, data, 0)
