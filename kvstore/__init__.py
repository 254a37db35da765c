"""kvstore: persistent, resumable LLM generation sessions.

Public surface: `load_model`, `pull`, `open_store`, the `errors` module, and the engine pieces
(`Sequence`, `SamplerSettings`, `KVCache`) for those who drive generation themselves.
Names are imported on first use, so a command that only reads the index never loads torch.
"""

from importlib import import_module

from . import errors
from .pull import pull  # eager: the function shares its module's name (and needs no torch)

_WHERE = {"KVCache": "cache", "Sequence": "generate", "TokenEvent": "generate", "Model": "model",
          "load_model": "model", "SamplerSettings": "sampling", "Store": "store", "open_store": "store"}

__all__ = ["errors", "pull", *_WHERE]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
    value = getattr(import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
