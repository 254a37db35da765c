"""The architectures kvstore runs, one module each (`llama`, `gpt2`), and the choice between them.

Every architecture module has the same parts: `HF_MODEL_TYPES` and `GGUF_ARCHITECTURES` (the names
it answers to), `config_from_hf` / `config_from_gguf`, the weight-name tables `LAYER` and `GLOBAL`
(ours -> (GGUF name, Hugging Face name)), `shapes(cfg)`, `optional(cfg)`, `stored_shape`,
`sanitize`, and `Net(cfg, weights)` with `forward`, `feed` and `head` over the KVCache protocol.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ...errors import UnsupportedModel
from ..config import ARCHITECTURES as NAMES, ModelConfig
from . import gpt2, llama

ARCHITECTURES: dict[str, ModuleType] = {"llama": llama, "gpt2": gpt2}  # ModelConfig.arch -> its module
assert tuple(ARCHITECTURES) == NAMES


def architecture(cfg: ModelConfig) -> ModuleType:
    return ARCHITECTURES[cfg.arch]


def _known(attr: str) -> str:
    return ", ".join(name for module in ARCHITECTURES.values() for name in getattr(module, attr))


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """A Hugging Face `config.json` (as a dict) -> ModelConfig, by its `model_type`."""
    model_type = cfg.get("model_type")
    for module in ARCHITECTURES.values():
        if model_type in module.HF_MODEL_TYPES:
            return module.config_from_hf(cfg)
    raise UnsupportedModel(f"model_type {model_type!r} is not supported; kvstore runs {_known('HF_MODEL_TYPES')}")


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    """GGUF metadata and the file's tensor names -> ModelConfig, by `general.architecture`."""
    arch = meta.get("general.architecture")
    for module in ARCHITECTURES.values():
        if arch in module.GGUF_ARCHITECTURES:
            return module.config_from_gguf(meta, tensor_names)
    raise UnsupportedModel(f"GGUF architecture {arch!r} is not supported; kvstore runs "
                           f"{_known('GGUF_ARCHITECTURES')}")
